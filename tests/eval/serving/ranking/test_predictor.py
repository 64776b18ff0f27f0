"""Ranking predictor: ListMLE math, x_l features, training that learns, export round trips, traces, CLI."""

import itertools
import json
import math
import runpy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT
from helpers.hub import HUB_REPO

from eval.serving.ranking.cli import main
from eval.serving.ranking.listmle import (
    bucket_edges,
    kendall_tau,
    kendall_tau_interval,
    length_labels,
    listmle_loss,
    tau_ceiling,
)
from eval.serving.ranking.predictors import HiddenStateFeatures, Ranker
from eval.serving.ranking.traces import generate_traces, load_traces, read_meta, split_traces
from eval.serving.ranking.train import TRAIN_FILE, TrainConfig, evaluate_ranker, train_ranker

WORDS = ["short", "long", "tell", "me", "about", "cats", "dogs", "code", "please", "now", "why", "how"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 4-layer random Llama with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny")
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<eos>", "user", "assistant", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=None,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def synthetic_traces(tmp_path_factory, tiny_model) -> Path:
    """Prompts whose reply length is set by the words `short`/`long`, plus random filler words."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("traces")
    lines = []
    for i in range(160):
        n_long = int(rng.integers(0, 4))
        words = (
            ["long"] * n_long
            + ["short"] * (3 - n_long)
            + list(rng.choice(WORDS[2:], int(rng.integers(2, 6))))
        )
        rng.shuffle(words)
        length = 10 + 40 * n_long + int(rng.integers(0, 10))
        lines.append(
            json.dumps(
                {"prompt": " ".join(words), "output_len": length, "prompt_len": len(words) + 2, "id": i}
            )
        )
    (path / "traces.jsonl").write_text("\n".join(lines) + "\n")
    (path / "meta.json").write_text(json.dumps({"model": str(tiny_model), "max_new_tokens": 160}))
    return path


def test_listmle_equals_brute_force_plackett_luce():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(4, generator=gen, dtype=torch.float64)
    labels = torch.tensor([3.0, 1.0, 4.0, 2.0], dtype=torch.float64)
    order = torch.argsort(labels, descending=True).tolist()
    neg_log_p = -sum(scores[order[i]] - torch.logsumexp(scores[order[i:]], 0) for i in range(4))
    assert listmle_loss(scores, labels).item() == pytest.approx(neg_log_p.item(), rel=1e-12)
    # the probabilities of all 4! orders sum to one
    total = sum(
        math.exp(-listmle_loss(scores, torch.tensor(perm, dtype=torch.float64)).item())
        for perm in itertools.permutations([3.0, 2.0, 1.0, 0.0])
    )
    assert total == pytest.approx(1.0, rel=1e-9)


def test_listmle_ties_pick_one_consistent_order_and_gradient_flows():
    scores = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    options = set()
    for seed in range(20):
        options.add(round(listmle_loss(scores, labels, torch.Generator().manual_seed(seed)).item(), 6))
    s = scores.detach()
    expected = {
        round((torch.logsumexp(s, 0) - s[a] + torch.logsumexp(s[[b, 2]], 0) - s[b]).item(), 6)
        for a, b in [(0, 1), (1, 0)]
    }
    assert options == expected
    listmle_loss(scores, labels).backward()
    assert scores.grad[2] > 0  # the longest request is pushed down


def test_kendall_tau_and_labels():
    lengths = np.array([5, 100, 37, 9000, 250])
    labels = length_labels(lengths, cap=8192)
    assert labels.tolist() == [819 - 0, 819 - 10, 819 - 3, 0, 819 - 25]
    assert kendall_tau(-lengths, labels) == pytest.approx(1.0)
    assert kendall_tau(lengths, labels) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="bin=0"):
        length_labels(lengths, 10, 0)
    assert len(bucket_edges(np.arange(100), 4)) == 3


def test_tau_ceiling_is_the_tau_of_a_tie_free_perfect_predictor():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.integers(1, 400, 300), 256)  # ~36% at the cap: one big tie
    labels = length_labels(lengths, cap=256)
    tie_broken = labels + rng.random(len(labels)) * 0.5  # same order, no ties
    assert tau_ceiling(labels) == pytest.approx(kendall_tau(tie_broken, labels))
    assert tau_ceiling(labels) < 0.95
    assert tau_ceiling(np.arange(10.0)) == pytest.approx(1.0)


def test_tau_interval_resamples_prompts_with_their_labels():
    """Against a plain loop (prompts drawn with replacement, tau of each draw, the 2.5/97.5 percentiles): the
    same interval up to bootstrap noise; a perfect ranking stays [1, 1] (only a paired resample keeps it)."""
    rng = np.random.default_rng(1)
    lengths = rng.lognormal(5, 1, 300)
    scores = -np.log(lengths) + rng.normal(0, 1, 300)
    draws = rng.integers(0, 300, (1000, 300))
    loop = np.percentile([kendall_tau(scores[d], -lengths[d]) for d in draws], [2.5, 97.5])
    low, high = kendall_tau_interval(scores, -lengths)
    assert low < kendall_tau(scores, -lengths) < high
    np.testing.assert_allclose([low, high], loop, atol=0.015)
    assert kendall_tau_interval(-lengths, -lengths) == pytest.approx((1.0, 1.0))
    assert all(math.isnan(v) for v in (kendall_tau([1.0], [2.0]), *kendall_tau_interval([1.0], [2.0])))


def test_tau_difference_interval_is_paired():
    """The gain of one ranker over another on the same prompts: against a plain loop of paired draws; a ranker
    against itself gains exactly 0, and a clean one over a noisy one gains with an interval far narrower than
    the two rankers' intervals side by side."""
    rng = np.random.default_rng(2)
    lengths = rng.lognormal(5, 1, 300)
    truth = -np.log(lengths)
    clean, noisy = truth + rng.normal(0, 0.8, 300), truth + rng.normal(0, 1.6, 300)
    draws = rng.integers(0, 300, (1000, 300))
    loop = np.percentile(
        [kendall_tau(clean[d], -lengths[d]) - kendall_tau(noisy[d], -lengths[d]) for d in draws], [2.5, 97.5]
    )
    low, high = kendall_tau_interval(clean, -lengths, minus=noisy)
    np.testing.assert_allclose([low, high], loop, atol=0.015)
    gain = kendall_tau(clean, -lengths) - kendall_tau(noisy, -lengths)
    assert 0 < low < gain < high
    side_by_side = np.subtract(
        kendall_tau_interval(clean, -lengths), kendall_tau_interval(noisy, -lengths)[::-1]
    )
    assert high - low < 0.8 * (side_by_side[1] - side_by_side[0])
    assert kendall_tau_interval(noisy, -lengths, minus=noisy) == pytest.approx((0.0, 0.0))


def test_combined_scores_ignore_each_rankers_unit_and_beat_either():
    """Two rankers with independent errors, one scoring in units a thousand times the other's: the mean of their
    standardized scores does not depend on the units and ranks better than either alone."""
    from eval.serving.ranking.train import combined_scores

    rng = np.random.default_rng(3)
    truth = rng.normal(size=2000)
    a, b = truth + rng.normal(size=2000), 1000 * (truth + rng.normal(size=2000)) + 5
    mix = combined_scores([a, b])
    np.testing.assert_allclose(mix, combined_scores([a, b / 1000]), atol=1e-9)
    np.testing.assert_allclose(mix, ((a - a.mean()) / a.std() + (b - b.mean()) / b.std()) / 2)
    assert kendall_tau(mix, truth) > max(kendall_tau(a, truth), kendall_tau(b, truth)) + 0.03


def test_features_equal_full_model_hidden_state_and_serving_path(tiny_model, synthetic_traces):
    from transformers import AutoModel

    prompts = [t.prompt for t in load_traces(synthetic_traces)[:5]]
    feats = HiddenStateFeatures(tiny_model, layer=2, max_prompt_tokens=64)
    enc = feats.encode(prompts)
    full = AutoModel.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        x_l = full(**enc, output_hidden_states=True).hidden_states[2]
    torch.testing.assert_close(
        feats(prompts, batch_size=2), HiddenStateFeatures.pool(x_l, enc["attention_mask"])
    )


def test_cut_model_loads_without_the_load_report_and_warns_of_missing_weights(
    tiny_model, tmp_path, capfd, caplog
):
    """Cutting the model leaves its later layers unloaded, as meant: no load report (transformers prints one listing
    them on every load, in a server's log too); a weight the cut model lacks is still a warning."""
    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    HiddenStateFeatures(tiny_model, layer=2, max_prompt_tokens=64)
    assert "LOAD REPORT" not in capfd.readouterr().err + caplog.text  # a handler's stream or the log records
    assert hf_logging.get_verbosity() == verbosity
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (weights,) = broken.glob("*.safetensors")
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}, weights, {"format": "pt"})
    HiddenStateFeatures(broken, layer=2, max_prompt_tokens=64)
    assert "layers.1.mlp.up_proj.weight" in caplog.text


def test_swiftkv_head_learns_and_exports(tiny_model, synthetic_traces, tmp_path):
    out = train_ranker(
        synthetic_traces, tmp_path / "ranker", TrainConfig(epochs=40, list_size=16, head_hidden=64)
    )
    spec = json.loads((out / "ranker.json").read_text())
    assert spec["layer"] == 2 and spec["kind"] == "swiftkv-head" and "higher score = shorter" in spec["score"]
    result = evaluate_ranker(out, synthetic_traces)
    assert result["n"] == 32 and result["kendall_tau"] > 0.5
    # exported weights are the trained ones: the recorded training tau is reproduced from the directory
    info = json.loads((out / TRAIN_FILE).read_text())
    train = split_traces(load_traces(synthetic_traces), 0.2, 0)[0]
    ranker = Ranker(out, tiny_model)
    labels = length_labels([t.output_len for t in train], 160)
    assert kendall_tau(ranker.score([t.prompt for t in train]), labels) == pytest.approx(
        info["train_tau"], abs=1e-6
    )
    # a server that already holds x_l scores the same
    enc = ranker._features.encode([t.prompt for t in train[:4]])
    with torch.no_grad():
        x_l = ranker._features.model(**enc, output_hidden_states=True).hidden_states[2]
    np.testing.assert_allclose(
        ranker.score_hidden(x_l, enc["attention_mask"]),
        ranker.score([t.prompt for t in train[:4]]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_small_lm_and_bucket_baseline_train(tiny_model, synthetic_traces, tmp_path):
    lm = TrainConfig(
        kind="small-lm", epochs=6, lr=3e-3, list_size=16, backbone_layers=2, max_prompt_tokens=32
    )
    out = train_ranker(synthetic_traces, tmp_path / "lm", lm)
    info = json.loads((out / TRAIN_FILE).read_text())
    assert info["history"][-1]["loss_per_item"] < info["history"][0]["loss_per_item"]
    ranker = Ranker(out)
    assert ranker.model.config.num_hidden_layers == 2
    # training scores micro-batches in length order; the recorded tau must still pair scores with prompts
    train = split_traces(load_traces(synthetic_traces), 0.2, 0)[0]
    labels = length_labels([t.output_len for t in train], 160)
    assert kendall_tau(ranker.score([t.prompt for t in train]), labels) == pytest.approx(
        info["train_tau"], abs=1e-3
    )
    assert evaluate_ranker(out, synthetic_traces)["kendall_tau"] > 0.3
    cls = train_ranker(
        synthetic_traces, tmp_path / "cls", TrainConfig(objective="buckets", buckets=4, epochs=40)
    )
    ranker = Ranker(cls, tiny_model)
    assert ranker.spec.outputs == len(ranker.spec.bucket_edges) + 1
    assert evaluate_ranker(cls, synthetic_traces)["kendall_tau"] > 0.3


def test_ranker_dir_is_portable_and_checks_the_model_it_reads(tiny_model, synthetic_traces, tmp_path):
    out = train_ranker(synthetic_traces, tmp_path / "ranker", TrainConfig(epochs=3, list_size=16))
    for file in out.iterdir():  # nothing in the directory points at where the model or traces were
        if file.suffix in (".json", ".jinja", ".txt"):
            text = file.read_text()
            assert str(tiny_model) not in text and str(synthetic_traces) not in text, file.name
    moved_model, moved_ranker = tmp_path / "elsewhere" / "model", tmp_path / "elsewhere" / "ranker"
    shutil.copytree(tiny_model, moved_model)
    shutil.copytree(out, moved_ranker)
    prompts = [t.prompt for t in load_traces(synthetic_traces)[:6]]
    np.testing.assert_allclose(
        Ranker(moved_ranker, moved_model).score(prompts), Ranker(out, tiny_model).score(prompts), rtol=1e-5
    )
    with pytest.raises(ValueError, match="pass the served model"):
        Ranker(moved_ranker)
    # same architecture, one more token in the tokenizer: another model as far as x_l goes
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(moved_model)
    tok.add_tokens(["zebra"])
    tok.save_pretrained(moved_model)
    with pytest.raises(
        ValueError, match="another architecture or tokenizer .* train the ranker on this model"
    ):
        Ranker(moved_ranker, moved_model)


def test_swiftkv_head_reads_the_served_swiftkv_checkpoint(tiny_model, synthetic_traces, tmp_path):
    """A head trained on the original scores prompts identically through its SwiftKV conversion (the layers below l,
    hence x_l, are the original's), loaded by transformers' AutoModel without remote code."""
    import swiftkv.convert

    out = train_ranker(synthetic_traces, tmp_path / "ranker", TrainConfig(epochs=1, list_size=16))
    served = swiftkv.convert.convert(tiny_model, tmp_path / "swiftkv", swiftkv_fraction=0.5)
    prompts = [t.prompt for t in load_traces(synthetic_traces)[:6]]
    np.testing.assert_allclose(
        Ranker(out, served).score(prompts), Ranker(out, tiny_model).score(prompts), rtol=1e-5
    )


@pytest.fixture(scope="module")
def two_eos_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model made to answer "now" (id 14) at once; generation_config ends turns on <eos> or "now"."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = tmp_path_factory.mktemp("two-eos")
    model = LlamaForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():  # x_0 is dominated by a constant embedding column, so lm_head row 14 always wins
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[14, 0] = 10.0
    model.generation_config.eos_token_id = [2, 14]  # like Llama-3's [128001, 128008, 128009]
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


def test_trace_generation_stops_on_every_end_of_turn_id(two_eos_model, tmp_path):
    data = tmp_path / "convs.jsonl"
    data.write_text(
        "".join(json.dumps({"conversations": [{"from": "human", "value": w}]}) + "\n" for w in WORDS)
    )
    file = generate_traces(two_eos_model, tmp_path / "traces", data=data, n=5, max_new_tokens=8, batch_size=2)
    traces = load_traces(file)
    assert [(t.output_len, t.finished) for t in traces] == [(1, True)] * 5


def test_trace_generation_resumes_and_refuses_other_options(tiny_model, tmp_path):
    data = tmp_path / "convs.jsonl"
    rows = [
        {"conversations": [{"from": "human", "value": " ".join(WORDS[i % 5 : i % 5 + 3])}]} for i in range(12)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "traces"
    file = generate_traces(tiny_model, out, data=data, n=4, max_new_tokens=6, batch_size=3)
    first = load_traces(file)
    assert len(first) == 4 and all(1 <= t.output_len <= 6 for t in first)
    with open(file, "a") as f:
        f.write('{"prompt": "torn li')  # a crash mid-line
    generate_traces(tiny_model, out, data=data, n=7, max_new_tokens=6, batch_size=3)
    again = load_traces(file)
    assert len(again) == 7 and again[:4] == first
    assert [t.prompt for t in again] == [r["conversations"][0]["value"] for r in rows[:7]]
    with pytest.raises(ValueError, match="other options"):
        generate_traces(tiny_model, out, data=data, n=8, max_new_tokens=9)


def test_cli_train_evaluate_and_errors(tiny_model, synthetic_traces, tmp_path, capsys):
    assert (
        main(["train", str(synthetic_traces), "--out", str(tmp_path / "r"), "--epochs", "2", "--layer", "1"])
        == 0
    )
    assert (
        main(["evaluate", str(tmp_path / "r"), str(synthetic_traces), "--out", str(tmp_path / "e.json")]) == 0
    )
    assert json.loads((tmp_path / "e.json").read_text())["n"] == 32
    assert main(["train", str(synthetic_traces), "--out", str(tmp_path / "r"), "--epochs", "2"]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "to resolve" in capsys.readouterr().err
    assert main(["train", str(synthetic_traces), "--out", str(tmp_path / "y"), "--layer", "9"]) == 2
    assert not (tmp_path / "y").exists()


def test_cli_traces_of_a_hub_id_and_an_unknown_id_in_one_line(hub, chat_data, tmp_path, capsys):
    home, commit = hub  # HUB_REPO in an offline cache
    out = tmp_path / "traces"
    argv = ["traces", HUB_REPO, "--out", str(out), "--data", str(chat_data), "--limit", "2"]
    assert main([*argv, "--max-new-tokens", "4", "--batch-size", "2"]) == 0
    snapshot = home / "hub" / "models--acme--tiny-chat" / "snapshots" / commit
    assert read_meta(out)["model"] == str(snapshot) and len(load_traces(out)) == 2
    capsys.readouterr()
    assert main(["calibrate", "acme/missing", "--out", str(tmp_path / "cost.json")]) == 2
    stdout, err = capsys.readouterr()
    assert stdout == "" and err.count("\n") == 1
    assert (
        err.startswith("error: model acme/missing is not in the Hugging Face cache") and "to resolve" in err
    )
    assert not (tmp_path / "cost.json").exists()


@pytest.mark.smollm2
def test_smollm2_head_features_at_the_swiftkv_layer(smollm2):
    feats = HiddenStateFeatures(smollm2, layer=15, max_prompt_tokens=64)
    assert feats.model.config.num_hidden_layers == 16
    prompts = ["Write a haiku.", "Explain quicksort in detail with code."]
    x = feats(prompts)  # one left-padded batch
    assert x.shape == (2, 2 * 576)
    for row, prompt in zip(x, prompts, strict=True):  # each prompt alone, unpadded, pooled here
        text = feats.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = feats.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, -64:]
        with torch.no_grad():
            hidden = feats.model(ids, output_hidden_states=True).hidden_states[15][0]
        torch.testing.assert_close(row, torch.cat([hidden[1:].mean(0), hidden[-1]]), atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # trains a head: ~15 s of CPU
def test_bench_ranking_runs_both_kv_settings_on_a_tiny_case(synthetic_traces, tmp_path, capsys):
    """scripts/bench_ranking.py through its main(argv) in this process (test_cli starts scripts as commands)."""
    script = ROOT / "scripts" / "bench_ranking.py"
    bench = runpy.run_path(str(script), run_name="script_under_test")["main"]
    out = tmp_path / "bench.json"
    argv = [str(synthetic_traces),
            "--work", str(tmp_path / "work"), "--seeds", "1", "--small-lm-seeds", "0", "--head-epochs", "2",
            "--list-size", "8", "--max-prompt-tokens", "32", "--loads", "1.5", "--requests", "40",
            "--sim-seeds", "1", "--kv-capacity", "400", "--out", str(out)]  # fmt: skip
    assert bench(argv) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["latency"]
    assert {(r["kv"], r["policy"]) for r in rows} == {
        (kv, p) for kv in ("free", "kv 400") for p in ("fcfs", "swiftkv-head listmle", "oracle")
    }
    assert "kv 400 | 1.5 |" in table and "free | 1.5 |" in table
