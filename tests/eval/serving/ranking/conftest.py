"""Fixtures of the ranking tests: a word-level tokenizer, a synthetic ShareGPT file (helpers.ranking) and an ngram
ranker trained on it (what the proxy loads), built once per module."""

from pathlib import Path

import pytest
from helpers.ranking import save_word_tokenizer, write_sharegpt

from eval.serving.ranking.labels import sharegpt_lengths
from eval.serving.ranking.train import TrainConfig, train_ranker


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return save_word_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> Path:
    return write_sharegpt(tmp_path_factory.mktemp("sg") / "sharegpt.jsonl")


@pytest.fixture(scope="module")
def ranker_dir(sharegpt_file, tokenizer_dir, tmp_path_factory) -> Path:
    """An ngram ranker of the synthetic prompts (`short ...` before `essay ...`)."""
    work = tmp_path_factory.mktemp("proxy")
    sharegpt_lengths(tokenizer_dir, work / "lengths", data=sharegpt_file, records="all")
    return train_ranker(
        work / "lengths", work / "ranker", TrainConfig(kind="ngram", ngram_bits=14, ngram_edge=4)
    )
