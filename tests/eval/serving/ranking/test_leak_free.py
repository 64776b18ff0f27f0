"""Leak-free evaluation: prompts deduplicated across every split before the split, repeats kept on one side of a
shuffle split, and `evaluate` never scoring a prompt the ranker was trained on."""

import json

import pytest
from helpers.ranking import synthetic_pairs

from eval.serving.ranking.labels import sharegpt_lengths, unique_pairs
from eval.serving.ranking.traces import Trace, load_traces, prompt_key, split_traces
from eval.serving.ranking.train import TrainConfig, evaluate_ranker, held_out_traces, train_ranker


def _row(i, prompt: str, reply: str) -> dict:
    return {
        "id": str(i),
        "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}],
    }


@pytest.fixture
def split_file(tmp_path, monkeypatch):
    """An embedded-style file of 300 records, held out from record 200: three held-out prompts repeat a train
    prompt (verbatim, with other whitespace, and with another reply), one repeats within the held-out part."""
    import toolkit.assets as assets

    pairs = synthetic_pairs(300)
    pairs[200] = pairs[3]
    pairs[201] = ("  " + pairs[4][0].replace(" ", "\n\t ") + " ", pairs[4][1])
    pairs[202] = (pairs[5][0], "me " * 40)
    pairs[250] = pairs[240]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(_row(i, p, r)) + "\n" for i, (p, r) in enumerate(pairs)))
    monkeypatch.setattr(assets, "sharegpt_path", lambda: path)
    monkeypatch.setattr(assets, "HELDOUT_START", 200)
    return path


def test_train_and_heldout_records_share_no_prompt(split_file, tokenizer_dir, tmp_path):
    train = load_traces(sharegpt_lengths(tokenizer_dir, tmp_path / "train", records="train"))
    heldout = load_traces(sharegpt_lengths(tokenizer_dir, tmp_path / "heldout", records="heldout"))
    keys = {prompt_key(t.prompt) for t in train}
    assert not keys & {prompt_key(t.prompt) for t in heldout}
    assert len(train) == 200 and len(heldout) == 100 - 4  # three seen in training, one repeat
    assert len(unique_pairs("sharegpt", "heldout")) == 96 and len(unique_pairs("sharegpt")) == 296


@pytest.mark.smollm2
def test_embedded_splits_share_no_prompt(sharegpt):
    """The embedded file: 200 of the 2,209 held-out pairs stood verbatim among the train records before the
    deduplication across splits (the length filter only drops pairs, so the pairs decide)."""
    train = {prompt_key(p) for p, _ in unique_pairs("sharegpt", "train")}
    heldout = [prompt_key(p) for p, _ in unique_pairs("sharegpt", "heldout")]
    assert not train & set(heldout) and len(set(heldout)) == len(heldout) > 2000


def test_split_keeps_a_prompts_traces_together():
    traces = [Trace(f"prompt {i % 50}" + " " * (i % 3), 5 + i) for i in range(200)]  # 4 traces per prompt
    train, test = split_traces(traces, 0.2, seed=1)
    assert len(test) == 40 and len(train) == 160
    assert not {prompt_key(t.prompt) for t in train} & {prompt_key(t.prompt) for t in test}
    unique = [
        Trace(f"p{i}", i + 1) for i in range(100)
    ]  # no repeats: a plain shuffle of the traces, as before
    import numpy as np

    order = np.random.default_rng(3).permutation(100)
    assert split_traces(unique, 0.25, 3) == ([unique[i] for i in order[25:]], [unique[i] for i in order[:25]])


def test_evaluate_leaves_out_the_rankers_training_prompts(tokenizer_dir, tmp_path):
    def write(path, pairs):
        path.mkdir()
        rows = [{"prompt": p, "prompt_len": len(p.split()), "output_len": len(r.split())} for p, r in pairs]
        (path / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (path / "meta.json").write_text(json.dumps({"model": str(tokenizer_dir)}))

    pairs = synthetic_pairs(300)
    write(tmp_path / "a", pairs[:200])
    write(
        tmp_path / "b", pairs[150:] + [(p + "  ", r) for p, r in pairs[:10]]
    )  # 60 seen, 10 with other spaces
    ranker = train_ranker(
        tmp_path / "a", tmp_path / "r", TrainConfig(kind="ngram", ngram_bits=12, held_out=0)
    )
    assert len(held_out_traces(ranker, tmp_path / "b", "all")) == 100
    assert evaluate_ranker(ranker, tmp_path / "b", "all")["n"] == 100
    with pytest.raises(ValueError, match="every prompt"):
        held_out_traces(ranker, tmp_path / "a", "all")
