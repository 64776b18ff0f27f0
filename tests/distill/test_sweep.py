"""The fraction sweep: candidates, the budget choice, and real sweeps of a tiny model: each candidate a stage of
the main job's resume scheme (skipped when unchanged, rerun when its recipe changed, resumed after a kill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.faults import Job

from distill.sweep import candidate_layers, choose, report_lines, sweep
from swiftkv.flops import Shape, ideal_prefill_speedup, prefill_flops_original, prefill_flops_swiftkv
from toolkit.cliargs import UsageError


def test_candidates_are_distinct_layer_counts_most_layers_kept_first():
    config = {"num_hidden_layers": 30}
    assert candidate_layers(config, [0.5, 0.2, 0.25, 0.49], 1) == [24, 22, 15]
    assert candidate_layers(config, [0.5, 0.4], 2) == [18, 14]  # SwiftKV layers rounded to groups of 2
    with pytest.raises(UsageError, match=r"must lie in \(0, 1\)"):
        candidate_layers(config, [0.5, 1.0], 1)
    with pytest.raises(UsageError, match="skip no layer"):
        candidate_layers(config, [0.01], 1)


def _result(swiftkv_layers: int, kl: float, ppl_ratio: float) -> dict:
    return {"swiftkv_layers": swiftkv_layers, "kl": kl, "ppl_ratio": ppl_ratio}


def test_choice_is_the_most_skipped_layers_within_every_limit():
    results = [_result(6, 0.05, 1.05), _result(9, 0.15, 1.2), _result(12, 0.3, 1.3), _result(15, 0.5, 1.6)]
    assert choose(results, 0.2, None)["swiftkv_layers"] == 9
    assert choose(results, 0.4, 1.25)["swiftkv_layers"] == 9
    assert choose(results, None, 1.35)["swiftkv_layers"] == 12
    assert choose(results, 0.01, None) is None
    assert choose(results, None, None) is None


def write_recipe(path: Path, model: Path, data: Path) -> Path:
    recipe = {
        "output_dir": "unused",
        "model": {"source": "unused", "swiftkv": {"fraction": 0.5, "init": "lstsq", "init_rows": 4}},
        "data": {"sources": [{"path": str(data)}], "seq_len": 64, "holdout": 0.1},
        "loss": {"chunk_tokens": 32, "mse_weight": 0.01},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0},
        "train": {"micro_batch_size": 2, "max_steps": 50},
        "checkpoint": {"every_steps": 1, "keep": 1},
        "log": {"every_steps": 1, "eval_batches": 100},
    }
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


@pytest.mark.smollm2
def test_sweep_distills_each_candidate_once_and_reports_the_choice(tiny_chat_model, chat_data, tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_chat_model, chat_data)
    out = tmp_path / "sweep"
    summary = sweep(tiny_chat_model, [0.3, 0.5], out, budget_tokens=300, recipe=recipe, max_kl=10.0)
    assert [r["num_key_value_layers"] for r in summary["results"]] == [4, 3]
    config = json.loads((tiny_chat_model / "config.json").read_text())
    for r in summary["results"]:
        final = json.loads((out / f"l{r['num_key_value_layers']}" / "final_metrics.json").read_text())
        assert r["kl"] == final["eval_kl"] and r["kl"] < r["initial_kl"]
        assert r["steps"] == 3 and r["train_tokens"] == 3 * 64 * 2  # 300 tokens at 128 per step, rounded up
        shape = Shape.from_config({**config, "num_key_value_layers": r["num_key_value_layers"]})
        assert r["ideal_prefill_speedup"] == pytest.approx(
            prefill_flops_original(shape, 2048) / prefill_flops_swiftkv(shape, 2048)
        )
        assert (out / f"l{r['num_key_value_layers']}" / "model" / "config.json").is_file()
    assert summary["chosen"]["num_key_value_layers"] == 3  # both fit KL <= 10: the one that skips more
    report = (out / "sweep.md").read_text()
    assert "Largest fraction within KL ≤ 10.0: 50% (`model.swiftkv.num_key_value_layers: 3`)" in report
    assert report.strip() == "\n".join(report_lines(summary)).strip()
    assert (out / "sweep.png").stat().st_size > 0

    logs = {p: p.stat().st_mtime_ns for p in out.glob("l*/log.jsonl")}
    again = sweep(
        tiny_chat_model, [0.5, 0.3], out, budget_tokens=300, recipe=recipe, max_kl=0.0001
    )  # re-judged
    assert {p: p.stat().st_mtime_ns for p in out.glob("l*/log.jsonl")} == logs
    assert [r["kl"] for r in again["results"]] == [r["kl"] for r in summary["results"]]
    assert again["chosen"] is None and "No candidate meets KL ≤ 0.0001." in (out / "sweep.md").read_text()

    # another budget: that candidate is another stage and reruns from scratch; the other one stays as it is
    l4 = (out / "l4" / "log.jsonl").read_text()
    third = sweep(tiny_chat_model, [0.5], out, budget_tokens=600, recipe=recipe)
    steps = [json.loads(line)["step"] for line in (out / "l3" / "log.jsonl").read_text().splitlines()]
    assert third["results"][0]["steps"] == 5 and max(steps) == 5 and steps.count(0) == 1  # a fresh log
    assert (out / "l4" / "log.jsonl").read_text() == l4


@pytest.mark.smollm2
def test_sweep_with_exact_kv_trains_the_window_and_counts_it_in_the_speedup(
    tiny_chat_model, chat_data, tmp_path
):
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_chat_model, chat_data)
    out = tmp_path / "sweep"
    summary = sweep(
        tiny_chat_model,
        [0.5],
        out,
        budget_tokens=100,
        recipe=recipe,
        overrides=["model.exact_kv_window=4"],
        prefill_tokens=64,
    )
    (result,) = summary["results"]
    config = json.loads((tiny_chat_model / "config.json").read_text())
    shape = Shape.from_config({**config, "num_key_value_layers": 3, "exact_kv_window": 4})
    assert result["exact_kv_window"] == 4
    assert result["ideal_prefill_speedup"] == pytest.approx(ideal_prefill_speedup(shape, 64))
    assert result["ideal_prefill_speedup"] < ideal_prefill_speedup(replace(shape, exact_kv_window=0), 64)
    assert json.loads((out / "l3" / "model" / "config.json").read_text())["exact_kv_window"] == 4
    assert "with exact K/V (W = 4) at the served positions" in (out / "sweep.md").read_text()


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distill", "sweep", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.smollm2
@pytest.mark.slow
def test_cli_sweep_killed_in_a_candidate_resumes_it_and_skips_the_finished_one(
    tiny_chat_model, chat_data, tmp_path
):
    """SIGKILL inside the second candidate's step-2 checkpoint write (a point the test chooses); the rerun skips
    the first, resumes the second from its step-1 checkpoint, and ends with the uninterrupted sweep's numbers."""
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_chat_model, chat_data)
    args = [str(tiny_chat_model), "--fractions", "0.3,0.5", "--budget-tokens", "640", "--recipe", str(recipe)]
    assert cli(*args, "--out", str(tmp_path / "reference")).returncode == 0  # same threads as the runs below
    reference = json.loads((tmp_path / "reference" / "sweep.json").read_text())

    out = tmp_path / "killed"
    sweep_cmd = ["-m", "distill", "sweep", *args, "--out", str(out)]
    with Job(tmp_path / "launches", sweep_cmd, at="checkpoint:2@l3") as job:
        job.kill_at_point()  # inside candidate l3's step-2 checkpoint write, after l4 finished
    assert not (out / "l3" / "model").exists() and (out / "l4" / "model").is_dir()
    first_log = (out / "l4" / "log.jsonl").read_text()

    result = cli(*args, "--out", str(out), "--max-kl", "100")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[l4] up to date, skipped" in result.stdout
    assert "resumed from" in result.stdout + result.stderr
    assert (out / "l4" / "log.jsonl").read_text() == first_log
    summary = json.loads((out / "sweep.json").read_text())
    for got, want in zip(summary["results"], reference["results"], strict=True):
        assert got["kl"] == pytest.approx(want["kl"], rel=1e-6)
        assert got["top1_agreement"] == want["top1_agreement"]
    assert summary["chosen"]["num_key_value_layers"] == 3
    assert "Largest fraction within KL ≤ 100.0: 50%" in result.stdout


def test_cli_refuses_bad_input_in_one_line_before_any_work(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "num_key_value_layers": 3}))
    result = cli(str(model), "--fractions", "0.5", "--budget-tokens", "100", "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {model} is already a SwiftKV checkpoint (to resolve, pass its base model)"
    ]
    assert not (tmp_path / "o").exists()
