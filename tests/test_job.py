"""The main job's quick mode end to end (so CI catches a missing install step), then a rerun that skips;
and the README's wrapper ``scripts/demo.py`` is the same command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.smollm2
@pytest.mark.slow
def test_quick_job_end_to_end_and_resume(smollm2, tmp_path):
    cmd = [sys.executable, "-m", "eval", "run", "--quick", "--out", str(tmp_path / "run")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert first.returncode == 0, first.stderr[-3000:]
    report = tmp_path / "run" / "report.md"
    assert str(report) in first.stdout
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [v["name"] for v in run["variants"]] == ["original", "swiftkv50"]
    assert run["variants"][1]["quality"]["kl"] > 0 and run["variants"][1]["distill"]["eval_kl"] > 0
    assert "swiftkv50" in report.read_text()
    # the quick recipe evaluates at steps 0 and 4 (the final one): the distillation's curve reaches the report
    curve = run["variants"][1]["distill"]["curve"]
    assert [(r["step"], r["train_tokens"]) for r in curve] == [(0, 0), (4, 4 * 2 * 128)]
    assert curve[-1]["eval_kl"] == run["variants"][1]["distill"]["eval_kl"]
    assert "| swiftkv50 (this job) | 4 | 1,024 |" in report.read_text()
    assert (tmp_path / "run" / "quality_vs_tokens.png").stat().st_size > 1000
    wrapper = [sys.executable, "scripts/demo.py", *cmd[4:]]
    second = subprocess.run(wrapper, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[distill-swiftkv50] up to date, skipped" in second.stdout
    assert "running" not in second.stdout
