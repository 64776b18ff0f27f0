"""Evaluation: stock lm-eval on a converted checkpoint, report from a fixture run, resumable stages."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.report import write_report
from eval.tasks import write_tasks
from swiftkv.convert import convert
from toolkit.stages import run_stage


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory, smollm2, sharegpt):
    return write_tasks(tmp_path_factory.mktemp("tasks"), n_docs=6)


def loglikelihood(model, tokenizer, context: str, continuation: str, max_length: int) -> float:
    """log P(continuation | context), computed here the way lm-eval's HF model defines it: the context's
    trailing spaces moved to the continuation, the pair encoded whole and split at the context's length, the
    last ``max_length`` tokens of context + continuation fed to the model."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    ids = (ctx + whole[len(ctx) :])[-(max_length + 1) :]
    n = len(whole) - len(ctx)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids[:-1]])).logits[0].float().log_softmax(-1)
    return logprobs[-n:].gather(-1, torch.tensor(ids[-n:])[:, None]).sum().item()


@pytest.mark.slow
@pytest.mark.smollm2
def test_stock_lm_eval_runs_a_converted_checkpoint(tiny_chat_model, tasks_dir, tmp_path):
    """The stock ``lm_eval`` command on a converted checkpoint (its own modeling code, trust_remote_code): every
    score it logs, and both tasks' metrics, equal the ones computed here from the same model's logits."""
    model_dir = convert(tiny_chat_model, tmp_path / "swift", num_key_value_layers=3)
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},trust_remote_code=True,max_length=256",
        "--include_path",
        str(tasks_dir),
        "--tasks",
        "sharegpt_mc,sharegpt_ppl",
        "--limit",
        "3",
        "--device",
        "cpu",
        "--output_path",
        str(out),
        "--log_samples",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mc = [json.loads(line) for line in (tasks_dir / "sharegpt_mc.jsonl").read_text().splitlines()[:3]]
    logged = [
        json.loads(line) for line in next(out.rglob("samples_sharegpt_mc_*.jsonl")).read_text().splitlines()
    ]
    correct = 0
    for doc, sample in zip(mc, sorted(logged, key=lambda r: r["doc_id"]), strict=True):
        context = f"User: {doc['prompt']}\nAssistant:"  # then lm-eval's target delimiter, a space
        ours = [loglikelihood(model, tokenizer, context, " " + c, 256) for c in doc["choices"]]
        theirs = [float(ll) for ll, _ in sample["filtered_resps"]]  # the samples file holds them as text
        assert theirs == pytest.approx(ours, rel=1e-4, abs=1e-3)
        correct += max(range(4), key=ours.__getitem__) == doc["label"]
    assert results["sharegpt_mc"]["acc,none"] == pytest.approx(correct / 3)

    texts = [
        json.loads(line)["text"] for line in (tasks_dir / "sharegpt_ppl.jsonl").read_text().splitlines()[:3]
    ]
    total, words = 0.0, 0
    for text in texts:  # one rolling window each: the BOS, then every token of the text
        tokens = tokenizer.encode(text)
        assert len(tokens) <= 256
        with torch.no_grad():
            logprobs = model(torch.tensor([[tokenizer.bos_token_id, *tokens[:-1]]])).logits[0].log_softmax(-1)
        total += logprobs.gather(-1, torch.tensor(tokens)[:, None]).sum().item()
        words += len(re.split(r"\s+", text))
    assert results["sharegpt_ppl"]["word_perplexity,none"] == pytest.approx(
        math.exp(-total / words), rel=1e-4
    )


RUN = {
    "meta": {
        "model": "m",
        "machine": "x86_64 CPU",
        "threads": 2,
        "dtype": "float32",
        "date": "2026-11-29",
        "prefill_lengths": [128, 256],
        "seconds": 1,
        "quick": True,
    },
    "commands": ["swiftkv run --quick"],
    "variants": [
        {
            "name": "original",
            "num_layers": 30,
            "swiftkv_layers": 0,
            "group_size": 1,
            "kv_bytes_per_token": 23040,
            "ideal_prefill_speedup": {"128": 1.0, "256": 1.0},
            "quality": {
                "kl": 0.0,
                "top1_agreement": 1.0,
                "ppl_student": 5.5,
                "ppl_teacher": 5.5,
                "greedy_prefix_agreement": 1.0,
            },
            "quality_before": None,
            "speed": {
                "prefill_s": {"128": 0.2, "256": 0.4},
                "prefill_speedup": {"128": 1.0, "256": 1.0},
                "decode_s": 0.05,
                "decode_ratio": 1.0,
            },
            "lm_eval": {"sharegpt_mc": {"acc": 0.5}, "sharegpt_ppl": {"word_perplexity": 40.25}},
        },
        {
            "name": "swiftkv50",
            "num_layers": 30,
            "swiftkv_layers": 15,
            "group_size": 1,
            "kv_bytes_per_token": 23040,
            "ideal_prefill_speedup": {"128": 1.8, "256": 1.85},
            "quality": {
                "kl": 0.123,
                "top1_agreement": 0.876,
                "ppl_student": 6.25,
                "ppl_teacher": 5.5,
                "greedy_prefix_agreement": 0.5,
                "exact_kv_window": 32,
                "served": {
                    "reply": {"kl": 0.071, "top1_agreement": 0.905, "ppl_student": 5.94, "ppl_teacher": 5.5},
                    "first16": {"kl": 0.105},
                    "first_reply": {"kl": 0.066},
                },
            },
            "quality_before": {"kl": 0.987, "top1_agreement": 0.543},
            "speed": {
                "prefill_s": {"128": 0.12, "256": 0.23},
                "prefill_speedup": {"128": 1.67, "256": 1.74},
                "decode_s": 0.05,
                "decode_ratio": 0.99,
            },
            "lm_eval": {"sharegpt_mc": {"acc": 0.25}, "sharegpt_ppl": {"word_perplexity": 45.5}},
        },
    ],
}


def test_report_from_a_fixture_run(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(RUN))
    report = write_report(tmp_path).read_text()
    row = next(line for line in report.splitlines() if line.startswith("| swiftkv50 "))
    for text in (
        "15/30",
        "0.987 → 0.123",
        "0.876",
        "6.25 (5.50)",
        "1.74x (1.85x)",
        "0.990",
        "23040",
        "0.25",
        "45.50",
    ):
        assert text in row, text
    served = [line for line in report.splitlines() if line.startswith("| swiftkv50 ")][1]
    assert (
        served == "| swiftkv50 | 32 | 0.123 | 0.071 | 0.105 | 0.066 | – | ×1.080 | 0.905 |"
    )  # no long prompt
    assert not any(line.startswith("| original | off") for line in report.splitlines())
    for png in ("prefill_vs_length.png", "quality_vs_prefill.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert f"]({png})" in report
    assert "    swiftkv run --quick" in report


def _eval_record(step: int, kl: float, **extra) -> dict:
    return {
        "step": step,
        "train_tokens": step * 1024,
        "eval_kl": kl,
        "eval_top1_agreement": 1 - kl,
        "eval_tokens": 500,
        "eval_ppl_student": 5.0 + kl,
        "eval_ppl_teacher": 5.0,
        **extra,
    }


def test_report_draws_the_jobs_and_longer_runs_quality_curves(tmp_path):
    run = json.loads(json.dumps(RUN))
    run["variants"][1]["distill"] = {"curve": [_eval_record(0, 0.9), _eval_record(60, 0.4)]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    longer = tmp_path / "curve" / "swiftkv50"
    longer.mkdir(parents=True)
    lines = [
        {"step": 0, "train_tokens": 0, "lr": 1e-3},  # a training record, not an evaluation
        _eval_record(0, 0.9),
        _eval_record(200, 0.5),  # the interrupted run's; the resumed run's record replaces it
        {"step": 200, "eval_kl": 0.7},  # an old record without a token count is left out
        _eval_record(200, 0.3),
        _eval_record(400, 0.2),
    ]
    (longer / "log.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    report = write_report(tmp_path, [longer]).read_text()
    rows = [line for line in report.splitlines() if line.startswith("| swiftkv50 (")]
    assert rows == [
        "| swiftkv50 (this job) | 0 | 0 | 0.900 | 0.100 | 5.90 / 5.00 (×1.180) |",
        "| swiftkv50 (this job) | 60 | 61,440 | 0.400 | 0.600 | 5.40 / 5.00 (×1.080) |",
        "| swiftkv50 (longer run) | 0 | 0 | 0.900 | 0.100 | 5.90 / 5.00 (×1.180) |",
        "| swiftkv50 (longer run) | 200 | 204,800 | 0.300 | 0.700 | 5.30 / 5.00 (×1.060) |",
        "| swiftkv50 (longer run) | 400 | 409,600 | 0.200 | 0.800 | 5.20 / 5.00 (×1.040) |",
    ]
    assert (tmp_path / "quality_vs_tokens.png").stat().st_size > 1000
    assert "](quality_vs_tokens.png)" in report and str(longer / "log.jsonl") in report

    with pytest.raises(FileNotFoundError, match="pass the output_dir of a distillation run"):
        write_report(tmp_path, [tmp_path / "missing"])


def test_report_without_a_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="run.json not found"):
        write_report(tmp_path)


def test_stages_skip_when_unchanged_and_rerun_downstream_when_inputs_change(tmp_path):
    calls = []

    def pipeline(n: int):
        key, a = run_stage(
            tmp_path, "a", {"n": n}, lambda: calls.append("a") or n * 2, output=tmp_path / "a-out"
        )
        (tmp_path / "a-out" / "partial").write_text("x")
        _, b = run_stage(tmp_path, "b", {"upstream": key}, lambda: calls.append("b") or a + 1)
        return b

    assert pipeline(1) == 3 and calls == ["a", "b"]
    assert pipeline(1) == 3 and calls == ["a", "b"]  # both skipped
    assert (tmp_path / "a-out" / "partial").exists()
    assert pipeline(5) == 11 and calls == ["a", "b", "a", "b"]  # a's input changed: a and b rerun
    assert json.loads((tmp_path / "stages" / "b.json").read_text())["result"] == 11


@pytest.mark.smollm2
def test_served_lm_eval_scores_continuations_as_generated_tokens(tiny_chat_model, tmp_path):
    """With exact K/V, the harness's lm-eval model scores each continuation as a server generates it: its
    log-likelihood equals a cached generation that prefills the context and feeds the continuation token by
    token, for every row of a padded, reordered batch; stock lm-eval (one forward, the input as one prompt)
    gives another number."""
    from eval.harness import ServedHFLM

    path = convert(tiny_chat_model, tmp_path / "exact", swiftkv_fraction=0.5)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "exact_kv_window": 3}))
    lm = ServedHFLM(
        pretrained=str(path), dtype="float32", backend="causal", max_length=64, batch_size=2, device="cpu"
    )
    torch.manual_seed(0)
    requests = [
        (torch.randint(5, 1000, (n,)).tolist(), torch.randint(5, 1000, (k,)).tolist())
        for n, k in ((9, 4), (20, 6), (5, 1), (12, 3))
    ]
    got = [ll for ll, _ in lm._loglikelihood_tokens([(("", ""), c, x) for c, x in requests])]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    served, whole = [], []
    with torch.no_grad():
        for context, continuation in requests:
            step = model(torch.tensor([context]), use_cache=True, logits_to_keep=1)
            total = 0.0
            for token in continuation:
                total += step.logits[0, -1].log_softmax(-1)[token].item()
                step = model(torch.tensor([[token]]), cache=step.cache, use_cache=True)
            served.append(total)
            ids = torch.tensor([context + continuation[:-1]])
            logprobs = model(ids, use_cache=False).logits[0, -len(continuation) :].log_softmax(-1)
            whole.append(logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum().item())
    assert got == pytest.approx(served, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(served, whole, strict=True)) > 1e-3
