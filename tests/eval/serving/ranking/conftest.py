"""Fixtures of the ranking tests: a word-level tokenizer and a synthetic ShareGPT file (helpers.ranking), built
once per module."""

from pathlib import Path

import pytest
from helpers.ranking import save_word_tokenizer, write_sharegpt


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return save_word_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> Path:
    return write_sharegpt(tmp_path_factory.mktemp("sg") / "sharegpt.jsonl")
