"""The main job's quick mode end to end (so CI catches a missing install step), then a rerun that skips;
and the README's wrapper ``scripts/demo.py`` is the same command.

Both run in this process (``main(argv)``, and the wrapper through runpy): a Python start with lm-eval costs
seconds of CPU, and the real command lines start in tests/test_cli.py."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from eval.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.smollm2
@pytest.mark.slow
def test_quick_job_end_to_end_and_resume(smollm2, tmp_path, capsys, monkeypatch):
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--quick", "--out", str(tmp_path / "run")]
    try:
        assert main(["run", *args]) == 0
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the job's distillation ran in this process
    report = tmp_path / "run" / "report.md"
    assert str(report) in capsys.readouterr().out
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [v["name"] for v in run["variants"]] == ["original", "swiftkv50"]
    original, swift = run["variants"]
    assert original["quality"]["kl"] == 0 and original["quality"]["top1_agreement"] == 1  # teacher = itself
    assert swift["quality"]["kl"] > 0 and swift["distill"]["eval_kl"] > 0
    assert "swiftkv50" in report.read_text()
    # the quick recipe evaluates at steps 0 and 4 (the final one): the distillation's curve reaches the report
    curve = swift["distill"]["curve"]
    assert [(r["step"], r["train_tokens"]) for r in curve] == [(0, 0), (4, 4 * 2 * 128)]
    assert curve[-1]["eval_kl"] == swift["distill"]["eval_kl"] < curve[0]["eval_kl"]
    assert "| swiftkv50 (this job) | 4 | 1,024 |" in report.read_text()
    assert (tmp_path / "run" / "quality_vs_tokens.png").stat().st_size > 1000
    monkeypatch.setattr(sys, "argv", ["scripts/demo.py", *args])
    with pytest.raises(SystemExit) as status:
        runpy.run_path(str(ROOT / "scripts" / "demo.py"), run_name="__main__")
    assert status.value.code == 0
    second = capsys.readouterr().out
    assert "[distill-swiftkv50] up to date, skipped" in second
    assert "running" not in second
