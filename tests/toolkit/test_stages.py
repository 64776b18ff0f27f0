"""Stages (``toolkit.stages``): a stage whose inputs are unchanged is skipped with its output kept; a changed
input reruns it and every stage downstream of it."""

from __future__ import annotations

import json

from toolkit.stages import run_stage


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
