"""scripts/gpu_check.py --tiny: the GPU check's own code, run on the CPU with a tiny config, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "scripts/gpu_check.py", "--tiny", "--out", str(out), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    return result, json.loads(out.read_text()) if out.is_file() else None


@pytest.mark.slow
def test_tiny_run_reports_every_check(tmp_path):
    result, report = run_check(tmp_path, "--compile-backend", "none", "--lengths", "32,64")
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["ok"] and report["skipped"] == []
    assert report["meta"]["variants"] == {"swiftkv25": 6, "swiftkv50": 4}  # of 8 layers
    models = ["original", "swiftkv25", "swiftkv50"]

    prefill = report["prefill"]
    assert [(r["length"], r["model"]) for r in prefill] == [(n, m) for n in (32, 64) for m in models]
    for r in prefill:
        assert len(r["times_s"]) == 3 and r["median_s"] > 0 and r["peak_memory_bytes"] is None  # CPU
        assert r["ideal"] == 1.0 if r["model"] == "original" else 1.0 < r["ideal"] < 2.0
        assert r["speedup"] == pytest.approx(r["of_ideal"] * r["ideal"])

    parity = {(r["model"], r["backend"]): r for r in report["attention_parity"]}
    assert set(parity) == {(m, b) for m in models for b in ("eager", "flash_attention_2")}
    for m in models:
        assert parity[m, "eager"]["status"] == "ok" and parity[m, "eager"]["rel_max_diff"] < 1e-4
        assert parity[m, "flash_attention_2"]["status"] == "not installed"  # CPU: flash never loads

    static = report["static_compile_parity"]
    assert [r["model"] for r in static] == ["swiftkv25", "swiftkv50", "original"]  # the control last
    for r in static:
        assert r["status"] == "ok" and r["static"] == r["dynamic"] and len(r["dynamic"]) == 16
    assert "peak_bytes" in report["memory"] and set(report["meta"]["step_s"]) == {
        "build",
        "attention_parity",
        "static_compile_parity",
        "prefill",
        "eval_quality",
    }
    fp32, bf16 = report["eval_quality"]  # eval quality on the device (the CPU here) in both dtypes
    assert (fp32["dtype"], bf16["dtype"], bf16["device"], bf16["status"]) == (
        "float32",
        "bfloat16",
        "cpu",
        "ok",
    )
    assert fp32["tokens"] == bf16["tokens"] > 0 and abs(bf16["kl"] - fp32["kl"]) <= 0.01
    assert "| 64 | swiftkv50 |" in result.stdout  # the table
    assert report["vllm"] == {"status": "skipped", "reason": "--tiny (CPU)", "ok": True}


@pytest.mark.slow
def test_time_budget_skips_what_would_not_fit(tmp_path):
    result, report = run_check(tmp_path, "--compile-backend", "none", "--budget-s", "0", "--lengths", "32")
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = [s["step"] for s in report["skipped"]]
    assert "prefill 32" in skipped and "static+compile parity swiftkv50" in skipped
    assert report["prefill"] == [] and all(
        s["reason"].startswith("past the 0 s budget") for s in report["skipped"]
    )
    assert "skipped prefill 32: past the 0 s budget" in result.stdout


def test_vllm_section_is_skipped_cleanly_without_vllm(tmp_path):
    """This venv has no vLLM (it lives in .venv-vllm): the vLLM section says so and the check passes."""
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "scripts/gpu_check.py", "--vllm", "only", "--out", str(out)]
    result = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    vllm = json.loads(out.read_text())["vllm"]
    assert vllm == {"status": "skipped", "reason": f"vLLM is not installed for {sys.executable}", "ok": True}
    assert f"vLLM section skipped: vLLM is not installed for {sys.executable}" in result.stdout
