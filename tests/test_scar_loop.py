"""SCAR in the real training loop: resume at the running checkpoint's step, fallbacks and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_points import Job
from test_distill_train import PY, killed_at, launched, losses, run, write_recipe

from distill.scar.faults import truncate_file

SCAR = "checkpoint.scar={fraction: 1.0, every_steps: 1, block_bytes: 4096}"
SCHEDULE = "optim.schedule=linear"  # the resumed learning rate must be the step's, not the full checkpoint's


def resumed_step(result) -> int:
    text = result if isinstance(result, str) else result.stdout + result.stderr
    lines = [line for line in text.splitlines() if "resumed" in line]
    return int(lines[-1].rsplit("at step ", 1)[1].split()[0])


def manifests(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "scar").glob("rank_*/manifest.json"))]


@pytest.mark.slow
@pytest.mark.smollm2
def test_resume_continues_from_the_running_checkpoint_step(tiny_chat_model, chat_data, tmp_path):
    """A running checkpoint of every block each step: after SIGKILL after step 5 (no full checkpoint yet) the
    run resumes at the running save's step and continues with the uninterrupted run's losses (data order,
    learning rate and Adam's step counters of that step); with a full checkpoint at step 3, a corrupt block
    file falls back to it with one warning line."""
    ref = tmp_path / "reference"
    run([PY, "-m", "distill", str(write_recipe(tmp_path, tiny_chat_model, chat_data, ref)), SCHEDULE])
    reference = losses(ref)

    out = tmp_path / "killed"  # no full checkpoint before the kill: the running checkpoint alone resumes
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, every=10)
    killed_at(tmp_path, "step:6", "-m", "distill", recipe, SCAR, SCHEDULE)
    saved = manifests(out)[0]["step"]
    assert saved == 5
    result = run([PY, "-m", "distill", str(recipe), SCAR, SCHEDULE])
    assert resumed_step(result) == saved
    resumed = losses(out)
    for step in range(saved + 1, 7):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step
    assert "warning" not in result.stderr

    out = tmp_path / "corrupt"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out)
    killed_at(tmp_path, "step:6", "-m", "distill", recipe, SCAR, SCHEDULE)
    manifest = manifests(out)[0]
    bad = sorted(manifest["blocks"])[0]
    truncate_file(out / "scar" / "rank_00000" / manifest["blocks"][bad]["file"])
    result = run([PY, "-m", "distill", str(recipe), SCAR, SCHEDULE])
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and bad in warnings[0] and "full checkpoint" in warnings[0], result.stderr
    assert resumed_step(result) == manifest["step"]
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.smollm2
def test_switching_scar_on_or_changing_its_blocks_on_resume(tiny_chat_model, chat_data, tmp_path):
    """SCAR switched on for a run that has only full checkpoints resumes from the full checkpoint; other block
    settings than the running checkpoint's are refused with one line (exit 2) before any training."""
    out = tmp_path / "late"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out)
    killed_at(tmp_path, "step:6", "-m", "distill", recipe)
    result = run([PY, "-m", "distill", str(recipe), SCAR, "train.max_steps=6"])
    assert resumed_step(result) == 3 and manifests(out)[0]["step"] == 6

    (out / "model").rename(out / "model-1")
    other = "checkpoint.scar={fraction: 1.0, every_steps: 1, block_bytes: 256}"
    result = run([PY, "-m", "distill", str(recipe), other, "train.max_steps=8"], expect=2)
    error = result.stderr.strip().splitlines()
    assert error[-1].startswith("error: ") and "block" in error[-1] and "to resolve" in error[-1]
    assert not (out / "model").exists()


@pytest.mark.slow
@pytest.mark.smollm2
def test_two_process_zero1_bf16_resume_and_a_failing_rank(tiny_chat_model, chat_data, tmp_path):
    """ZeRO-1 with bf16 (DeepSpeed's BF16_Optimizer) on 2 processes: a rank whose running checkpoint cannot be
    read stops both ranks with the same one-line error (no rank waits in a collective); once repaired, the run
    resumes at the running checkpoint's step and finishes."""
    out = tmp_path / "zero1"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, mixed_precision="bf16")
    target = ("-m", "distill", recipe, SCAR, SCHEDULE)
    killed_at(tmp_path, "step:6", *target, processes=2, config="cpu_2proc_zero1")
    assert [m["step"] for m in manifests(out)] == [5, 5]
    manifest = out / "scar" / "rank_00001" / "manifest.json"
    good = manifest.read_bytes()
    manifest.write_bytes(good[: len(good) // 2])  # a torn write of rank 1's manifest
    with Job(tmp_path / "launches", target, 2, "cpu_2proc_zero1") as job:
        job.finish(expect=1)
        errors = [[x for x in job.output(r, "err").splitlines() if x.startswith("error:")] for r in (0, 1)]
    assert len(errors[0]) == 1 and errors[0] == errors[1], errors  # each rank's own stderr file
    assert errors[0][0].startswith("error: running checkpoint not resumable (rank 1: ")
    assert not (out / "model").exists()
    manifest.write_bytes(good)
    job = launched(tmp_path, "cpu_2proc_zero1", *target[2:])
    assert resumed_step(job.output()) == 5
    assert (out / "model" / "model.safetensors").is_file()
