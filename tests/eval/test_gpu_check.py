"""``swiftkv gpu-check --tiny`` (``eval.gpu_check``): the GPU check's own code, run on the CPU with a tiny config,
end to end; its verdict is never ``ok`` for what did not run (a CPU run, a step past the budget, a vLLM part not
run), and on a machine without a GPU it says so in one line with a status of its own.  The vLLM part's row logic:
tests/eval/serving/vllm/test_gpu_check_vllm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import ROOT

import eval.gpu_check as check

COMMAND = [sys.executable, "-m", "toolkit", "gpu-check"]  # the front door, as `swiftkv gpu-check`


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "gpu_check.json"
    cmd = [*COMMAND, "--tiny", "--out", str(out), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    return result, json.loads(out.read_text()) if out.is_file() else None


@pytest.mark.slow
def test_tiny_run_reports_every_check(tmp_path):
    result, report = run_check(tmp_path, "--compile-backend", "none", "--lengths", "32,64")
    assert result.returncode == 3, result.stderr[-3000:]  # incomplete: the vLLM part never runs on --tiny
    assert report["verdict"] == "incomplete" and report["skipped"] == []
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
    assert report["vllm"] == {"status": "skipped", "reason": "--tiny (CPU)", "verdict": "incomplete"}
    assert "verdict: incomplete" in result.stdout


@pytest.mark.slow
def test_time_budget_skips_what_would_not_fit(tmp_path):
    result, report = run_check(tmp_path, "--compile-backend", "none", "--budget-s", "0", "--lengths", "32")
    assert result.returncode == 3 and report["verdict"] == "incomplete", result.stderr[-3000:]
    skipped = [s["step"] for s in report["skipped"]]
    assert "prefill 32" in skipped and "static+compile parity swiftkv50" in skipped
    assert report["prefill"] == [] and all(
        s["reason"].startswith("past the 0 s budget") for s in report["skipped"]
    )
    assert "skipped prefill 32: past the 0 s budget" in result.stdout


# A serving environment's python in miniature: the probe of eval.gpu_check gets FAKE_PROBE (default: CUDA and vLLM
# there), the vLLM check (its arguments: -m eval.serving.vllm.gpu_check --out OUT ...) does what FAKE_CHILD says
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = "-c" ]; then
    if [ -n "$FAKE_PROBE" ]; then echo "$FAKE_PROBE"; else echo '{"cuda": true, "vllm": true}'; fi
    exit 0
fi
case "$FAKE_CHILD" in
    refuse) echo "error: the reference is stale (to resolve, use another python)" >&2; exit 2 ;;
    nogpu) echo "no GPU: no CUDA device is visible, nothing was checked (to resolve, ...)" >&2; exit 4 ;;
    ok) echo '{"verdict": "ok", "rows": [], "tolerances": null, "elapsed_s": 1.0}' > "$4"; exit 0 ;;
    *) exit 1 ;;
esac
"""


@pytest.fixture
def serving_python(tmp_path) -> str:
    path = tmp_path / "serving-python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return str(path)


def run_vllm_only(
    tmp_path: Path, serving_python: str, child: str
) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "gpu_check.json"
    cmd = [*COMMAND, "--vllm", "only", "--vllm-python", serving_python, "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FAKE_CHILD": child}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300), out


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_vllm_only_without_a_gpu_is_one_line_and_its_own_status(tmp_path):
    """``--vllm only`` where neither this interpreter nor the serving one sees a GPU (this venv has no vLLM
    either): one line, the no-GPU status, no report."""
    out = tmp_path / "gpu_check.json"
    cmd = [*COMMAND, "--vllm", "only", "--out", str(out)]
    result = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode == 4 and result.stdout == "" and not out.exists(), result.stderr[-3000:]
    assert result.stderr.startswith("no GPU: no CUDA device is visible, nothing was checked (to resolve, ")
    assert result.stderr.count("\n") == 1


def test_vllm_only_passes_on_the_serving_check_and_its_refusals(tmp_path, serving_python):
    """``--vllm only --vllm-python`` runs the vLLM check there with this interpreter as the transformers
    reference: its refusal to start (exit 2, its one line) is a setup error with the same status and no other
    output, its no-GPU status stays 4, a report gives the verdict, and an exit without a report is a FAIL."""
    refused, out = run_vllm_only(tmp_path, serving_python, "refuse")
    assert refused.returncode == 2 and not out.exists(), refused.stderr[-3000:]
    assert refused.stderr == "error: the reference is stale (to resolve, use another python)\n"
    assert refused.stdout == ""
    no_gpu, out = run_vllm_only(tmp_path, serving_python, "nogpu")
    assert no_gpu.returncode == 4 and no_gpu.stderr.startswith("no GPU: ") and no_gpu.stderr.count("\n") == 1
    ok, out = run_vllm_only(tmp_path, serving_python, "ok")
    assert ok.returncode == 0, ok.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["verdict"] == "ok" and report["vllm"]["status"] == "ran" and "verdict: ok" in ok.stdout
    crashed, out = run_vllm_only(tmp_path, serving_python, "crash")
    assert crashed.returncode == 1 and "vLLM section FAIL: the vLLM check exited 1 without a report" in (
        crashed.stdout
    )


def test_vllm_setup_is_decided_before_any_work(monkeypatch, tmp_path, serving_python):
    """Which interpreter runs what: the probe of the serving python (CUDA, vLLM) and of this one (the reference)
    decide, in one line, no GPU (4) or a setup error (2) naming --vllm-python; under ``--vllm auto`` a setup
    problem makes the section a setup error and the verdict incomplete, not FAIL."""
    here = check.probe_python(sys.executable)  # this venv: no vLLM (it lives in .venv-vllm)
    assert here["vllm"].startswith("ModuleNotFoundError") and isinstance(here["cuda"], bool)
    assert "error" in check.probe_python(str(tmp_path / "missing-python"))
    ready = {"cuda": True, "vllm": True}
    assert check.setup_problem(ready, False, "P", None) is None  # the serving env sees the GPU: enough
    code, line = check.setup_problem({"cuda": False, "vllm": True}, False, "P", None)
    assert code == 4 and line.startswith(
        "no GPU: no CUDA device is visible, nothing was checked (to resolve, "
    )
    code, line = check.setup_problem({**ready, "vllm": here["vllm"]}, True, "P", None)
    assert code == 2 and line.startswith("error: vLLM is not importable for P (ModuleNotFoundError")
    assert "(to resolve, pass --vllm-python with the python of the serving environment" in line
    code, line = check.setup_problem({"error": "OSError: no such file"}, True, "P", None)
    assert code == 2 and line.startswith("error: --vllm-python P does not run (OSError: no such file)")
    code, line = check.setup_problem(ready, True, "P", "transformers 5.19.0 (this package needs >=5.24)")
    assert code == 2 and "cannot run the transformers reference: transformers 5.19.0" in line
    assert "\n" not in line

    args = SimpleNamespace(vllm="auto", tiny=False, vllm_python=serving_python, out=tmp_path / "g.json",
                           vllm_budget_s=60.0)  # fmt: skip
    monkeypatch.setenv("FAKE_PROBE", json.dumps({"cuda": True, "vllm": here["vllm"]}))
    section = check.vllm_section(args)
    assert section["status"] == "setup error" and section["reason"].startswith("vLLM is not importable for ")
    report = {"attention_parity": [], "static_compile_parity": [], "eval_quality": [], "skipped": [],
              "vllm": section}  # fmt: skip
    assert check.verdict(report) == "incomplete"
    monkeypatch.delenv("FAKE_PROBE")
    monkeypatch.setenv("FAKE_CHILD", "refuse")
    section = check.vllm_section(args)
    assert (section["status"], section["verdict"], section["exit"]) == ("setup error", "incomplete", 2)
    assert check.verdict({**report, "vllm": section}) == "incomplete"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_no_gpu_is_one_line_and_its_own_status(tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [*COMMAND, "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 4 and result.stdout == "" and not out.exists()
    assert result.stderr.startswith("no GPU: no CUDA device is visible, nothing was checked (to resolve, ")
    assert result.stderr.count("\n") == 1
