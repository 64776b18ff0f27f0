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


def test_an_interrupted_stage_resumes_in_its_output_and_other_inputs_start_it_afresh(tmp_path):
    out = tmp_path / "out"
    seen = []

    def work(fail: bool):
        seen.append(sorted(p.name for p in out.iterdir()))
        (out / "checkpoint").write_text("partial")
        if fail:
            raise RuntimeError("killed")
        return "done"

    try:
        run_stage(tmp_path, "train", {"lr": 1}, lambda: work(True), output=out)
    except RuntimeError:
        pass
    assert not (tmp_path / "stages" / "train.json").exists()  # recorded only after it succeeded
    assert run_stage(tmp_path, "train", {"lr": 1}, lambda: work(False), output=out)[1] == "done"
    assert seen[-1] == [".stage_key", "checkpoint"]  # the same inputs resume in what the first try left
    run_stage(tmp_path, "train", {"lr": 2}, lambda: work(False), output=out)
    assert seen[-1] == [".stage_key"]  # other inputs: nothing of the finished stage is kept


def test_only_the_main_process_records_and_every_process_waits_for_it(tmp_path):
    waits = []
    key, result = run_stage(
        tmp_path, "s", {"x": 1}, lambda: 7, output=tmp_path / "o", main=False, barrier=lambda: waits.append(1)
    )
    assert result == 7 and len(waits) == 2  # before the work (folders ready) and after it (record written)
    assert not (tmp_path / "stages").exists() and not (tmp_path / "o").exists()
