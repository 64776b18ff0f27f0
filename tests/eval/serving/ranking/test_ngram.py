"""ngram ranker and recorded ShareGPT lengths: the hash, the scorer against the fitted regression, training that
learns, the export round trip, vLLM's length filter, the one-feature baseline."""

import json

import numpy as np
import pytest
from helpers.ranking import synthetic_pairs

from eval.serving.ranking.cli import main
from eval.serving.ranking.labels import sharegpt_lengths, unique_pairs, write_sharegpt_json
from eval.serving.ranking.ngram import NgramScorer, count_matrix, design, fit, hashed_ngrams
from eval.serving.ranking.predictors import Ranker
from eval.serving.ranking.traces import load_traces, read_meta
from eval.serving.ranking.train import (
    TrainConfig,
    evaluate_ranker,
    one_feature_fit,
    one_feature_scores,
    train_ranker,
)


def test_hash_is_fixed_and_in_range():
    ids = np.array([5, 7, 5, 7, 9], np.uint64)
    slots = hashed_ngrams(ids, 2, 2, 20)
    assert slots.tolist() == hashed_ngrams(ids.copy(), 2, 2, 20).tolist()
    assert slots[0] == slots[2] and slots[0] != slots[1]  # (5,7) twice
    assert slots.min() >= 0 and slots.max() < 1 << 20
    assert len(hashed_ngrams(ids[:1], 2, 2, 20)) == 0


def test_scorer_equals_the_regression(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pairs = synthetic_pairs(200)
    ids = tok([p for p, _ in pairs]).input_ids
    lengths = np.array([len(r.split()) for _, r in pairs])
    tensors = fit(ids, lengths, bits=14, edge=4, alpha=0.5)
    scorer = NgramScorer(tensors, bits=14, edge=4)
    x, n = count_matrix(ids, 14, 4)
    w = np.r_[tensors["weight"], tensors["length_weight"]].astype(np.float64)
    expected = design(x, n, tensors["idf"].astype(np.float64)) @ w + tensors["bias"][0]
    np.testing.assert_allclose(-scorer.scores(ids), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="retrain"):
        NgramScorer(tensors, bits=15, edge=4)


def test_labels_follow_vllm_filter(sharegpt_file, tokenizer_dir, tmp_path):
    file = sharegpt_lengths(tokenizer_dir, tmp_path / "lengths", data=sharegpt_file, records="all")
    traces = load_traces(file)
    assert len(traces) == 400  # duplicate, short prompt/reply, long prompt/total and one-turn rows dropped
    assert traces[0].output_len == len(synthetic_pairs(400)[0][1].split())
    assert all(
        4 <= t.prompt_len <= 1024 and t.output_len >= 4 and t.prompt_len + t.output_len <= 2048
        for t in traces
    )
    assert read_meta(file)["source"] == "sharegpt-recorded"
    assert len(unique_pairs(sharegpt_file)) == 404  # the duplicate prompt once
    out = write_sharegpt_json(unique_pairs(sharegpt_file)[:3], tmp_path / "sg.json")
    assert json.loads(out.read_text())[2]["conversations"][1]["from"] == "gpt"
    with pytest.raises(ValueError, match="records"):
        sharegpt_lengths(tokenizer_dir, tmp_path / "x", data=sharegpt_file, records="test")


def test_one_feature_baseline_learns_any_shape():
    rng = np.random.default_rng(0)
    p = rng.integers(4, 1000, 2000)
    y = np.where((p > 300) & (p < 600), 500, 20)  # not monotone in prompt length
    fit_ = one_feature_fit(p, y)
    from scipy.stats import kendalltau

    assert kendalltau(one_feature_scores(fit_, p), -y).statistic > 0.7
    assert abs(kendalltau(-p, -y).statistic) < 0.5


def test_train_evaluate_roundtrip(sharegpt_file, tokenizer_dir, tmp_path):
    traces = tmp_path / "lengths"
    sharegpt_lengths(tokenizer_dir, traces, data=sharegpt_file, records="all")
    out = train_ranker(traces, tmp_path / "ranker", TrainConfig(kind="ngram", ngram_bits=14, ngram_edge=4))
    result = evaluate_ranker(out, traces)
    assert result["kind"] == "ngram" and result["objective"] == "regression"
    assert result["kendall_tau_raw"] > 0.6 > abs(result["prompt_len_tau_raw"])
    assert result["kendall_tau_raw"] > result["one_feature_tau_raw"]
    ranker = Ranker(out)  # no target model needed
    s = ranker.score(["short tell me", "essay about cats and dogs please"])
    assert s[0] > s[1]
    ids = ranker.tokenizer(["short tell me"]).input_ids
    np.testing.assert_allclose(ranker.score_ids(ids), s[:1], rtol=1e-6)
    assert len(ranker.score([])) == 0


def test_cli_labels_train_evaluate(sharegpt_file, tokenizer_dir, tmp_path, capsys):
    assert (
        main(
            [
                "labels",
                str(tokenizer_dir),
                "--out",
                str(tmp_path / "l"),
                "--data",
                str(sharegpt_file),
                "--records",
                "all",
                "--sharegpt-json",
                str(tmp_path / "sg.json"),
            ]
        )
        == 0
    )
    assert len(json.loads((tmp_path / "sg.json").read_text())) == 404
    assert (
        main(
            [
                "train",
                str(tmp_path / "l"),
                "--out",
                str(tmp_path / "r"),
                "--kind",
                "ngram",
                "--ngram-bits",
                "12",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        main(["evaluate", str(tmp_path / "r"), str(tmp_path / "l"), "--out", str(tmp_path / "e.json")]) == 0
    )
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["kendall_tau_raw"] > 0.5 and result["n"] == 80 and result["n_train"] == 320
    table = capsys.readouterr().out
    for name, key in [("ranker (ngram", "kendall_tau"), ("shortest prompt", "prompt_len_tau"),
                      ("one-feature", "one_feature_tau")]:  # fmt: skip
        row = next(line for line in table.splitlines() if line.startswith(f"| {name}"))
        raw = f"{result[key + '_raw']:.3f}"
        if key + "_raw_95" in result:  # the ranker's tau with its interval
            raw += " [{:.3f}, {:.3f}]".format(*result[key + "_raw_95"])
        assert row.split("|")[2:4] == [f" {raw} ", f" {result[key]:.3f} "]
    low, high = result["kendall_tau_raw_95"]
    assert low < result["kendall_tau_raw"] < high and high - low < 0.3  # 80 prompts


def test_train_on_every_trace_then_evaluate_others(sharegpt_file, tokenizer_dir, tmp_path, capsys):
    """--held-out 0 trains on all traces (ShareGPT's train records); evaluate then scores other traces with
    --split all and refuses, in one line, the held-out split it does not have."""
    from helpers.ranking import write_sharegpt

    traces = tmp_path / "lengths"
    sharegpt_lengths(tokenizer_dir, traces, data=sharegpt_file, records="all")
    other = write_sharegpt(tmp_path / "other.jsonl", seed=1)
    sharegpt_lengths(tokenizer_dir, tmp_path / "other", data=other, records="all")
    config = TrainConfig(kind="ngram", ngram_bits=14, ngram_edge=4, held_out=0)
    ranker = train_ranker(traces, tmp_path / "ranker", config)
    assert json.loads((ranker / "train.json").read_text())["n_train"] == 400
    result = evaluate_ranker(ranker, tmp_path / "other", split="all")
    assert result["n"] == 400 and result["kendall_tau_raw"] > result["one_feature_tau_raw"]
    assert main(["evaluate", str(ranker), str(traces)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ranker") and "--split all" in err and len(err.splitlines()) == 1


def test_evaluate_with_another_ranker_scores_prompts_neither_saw(
    sharegpt_file, tokenizer_dir, tmp_path, capsys
):
    """``evaluate --with``: the second ranker, trained on other traces and on half of the first one's held-out
    prompts, takes those out of the evaluation; its tau and the combination's are reported on the prompts left,
    and the combination's gain over the first ranker comes with its paired interval."""
    from helpers.ranking import write_sharegpt

    from eval.serving.ranking.listmle import kendall_tau
    from eval.serving.ranking.train import combined_scores, held_out_traces

    traces = tmp_path / "lengths"
    sharegpt_lengths(tokenizer_dir, traces, data=sharegpt_file, records="all")
    first = train_ranker(traces, tmp_path / "first", TrainConfig(kind="ngram", ngram_bits=14, ngram_edge=4))
    alone = held_out_traces(first, traces)
    sharegpt_lengths(tokenizer_dir, tmp_path / "other", data=write_sharegpt(tmp_path / "o.jsonl", seed=1))
    mixed = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": t.prompt, "output_len": t.output_len} for t in alone[::2] + load_traces(tmp_path / "other")
    ]
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = TrainConfig(
        kind="ngram", ngram_bits=12, ngram_edge=2, held_out=0, target_model=str(tokenizer_dir)
    )
    second = train_ranker(mixed, tmp_path / "second", config)
    result = evaluate_ranker(first, traces, combine_with=(second,))
    kept = alone[1::2]
    assert result["n"] == len(kept) > 20
    raw = [-t.output_len for t in kept]
    a, b = (Ranker(r).score([t.prompt for t in kept]) for r in (first, second))
    assert result["kendall_tau_raw"] == pytest.approx(kendall_tau(a, raw))
    assert result["others"][0]["kendall_tau_raw"] == pytest.approx(kendall_tau(b, raw))
    assert result["combined_tau_raw"] == pytest.approx(kendall_tau(combined_scores([a, b]), raw))
    low, high = result["combined_gain_raw_95"]
    assert low <= result["combined_tau_raw"] - result["kendall_tau_raw"] <= high
    assert main(["evaluate", str(first), str(traces), "--with", str(second)]) == 0
    table = capsys.readouterr().out
    assert f"ranker {second} (ngram, regression)" in table and "combined: mean of the rankers'" in table
    assert "combined minus the first ranker, paired over the same prompts: " in table


def test_pairwise_objective_ranks_and_keeps_log_length_units(tokenizer_dir, tmp_path):
    """The gap-weighted pairwise refinement orders held-out prompts at least as well as the ridge it starts from,
    and its predictions stay in log-length units (what the proxy's priority and aging read)."""
    from transformers import AutoTokenizer

    from eval.serving.ranking.listmle import kendall_tau
    from eval.serving.ranking.ngram import fit_pairwise

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pairs = synthetic_pairs(600)
    ids = tok([p for p, _ in pairs]).input_ids
    lengths = np.array([len(r.split()) for _, r in pairs])
    taus = {}
    for name, tensors in [
        ("ridge", fit(ids[:400], lengths[:400], 14, 4, 0.5)),
        *(
            (w, fit_pairwise(ids[:400], lengths[:400], 14, 4, 0.5, 0.05, w))
            for w in ("log-gap", "gap", "none")
        ),
    ]:
        predicted = -NgramScorer(tensors, 14, 4).scores(ids[400:])
        taus[name] = kendall_tau(predicted, lengths[400:])
        slope = np.polyfit(predicted, np.log(lengths[400:]), 1)[0]
        assert 0.7 < slope < 1.4, (name, slope)
    assert min(taus.values()) > 0.6 and taus["log-gap"] >= taus["ridge"] - 0.02
    with pytest.raises(ValueError, match="pair weight"):
        fit_pairwise(ids[:50], lengths[:50], 14, 4, 0.5, 0.05, "squared")
    traces = tmp_path / "t"
    traces.mkdir()
    rows = [{"prompt": p, "output_len": int(n)} for (p, _), n in zip(pairs, lengths, strict=True)]
    (traces / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (traces / "meta.json").write_text(json.dumps({"model": str(tokenizer_dir)}))
    out = train_ranker(traces, tmp_path / "r", TrainConfig(kind="ngram", objective="pairwise", ngram_bits=14))
    result = evaluate_ranker(out, traces)
    assert result["objective"] == "pairwise" and result["kendall_tau_raw"] > 0.6
    with pytest.raises(ValueError, match="ngram kind"):
        train_ranker(traces, tmp_path / "h", TrainConfig(kind="swiftkv-head", objective="pairwise"))
