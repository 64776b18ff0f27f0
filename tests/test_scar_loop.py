"""SCAR in the real training loop: resume at the running checkpoint's step, fallbacks and refusals."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from test_distill_train import PY, ROOT, env, kill_when, launch, logged_step, losses, run, write_recipe

from distill.scar.faults import truncate_file

SCAR = "checkpoint.scar={fraction: 1.0, every_steps: 1, block_bytes: 4096}"
SCHEDULE = "optim.schedule=linear"  # the resumed learning rate must be the step's, not the full checkpoint's


def resumed_step(result) -> int:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "resumed" in line]
    return int(lines[-1].rsplit("at step ", 1)[1].split()[0])


def manifests(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "scar").glob("rank_*/manifest.json"))]


@pytest.mark.slow
@pytest.mark.smollm2
def test_resume_continues_from_the_running_checkpoint_step(tiny_chat_model, chat_data, tmp_path):
    """A running checkpoint of every block each step: after SIGKILL at step 5 (no full checkpoint yet) the
    run resumes at the running save's step and continues with the uninterrupted run's losses (data order,
    learning rate and Adam's step counters of that step); with a full checkpoint at step 3, a corrupt block
    file falls back to it with one warning line."""
    ref = tmp_path / "reference"
    run([PY, "-m", "distill", str(write_recipe(tmp_path, tiny_chat_model, chat_data, ref)), SCHEDULE])
    reference = losses(ref)

    out = tmp_path / "killed"  # no full checkpoint before the kill: the running checkpoint alone resumes
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, every=10)
    kill_when([PY, "-m", "distill", str(recipe), SCAR, SCHEDULE], logged_step(out, 5))
    saved = manifests(out)[0]["step"]
    assert saved >= 4
    result = run([PY, "-m", "distill", str(recipe), SCAR, SCHEDULE])
    assert resumed_step(result) == saved
    resumed = losses(out)
    for step in range(saved + 1, 7):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step
    assert "warning" not in result.stderr

    out = tmp_path / "corrupt"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out)
    kill_when([PY, "-m", "distill", str(recipe), SCAR, SCHEDULE], logged_step(out, 5))
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
    kill_when([PY, "-m", "distill", str(recipe)], logged_step(out, 5))
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
    cmd = launch("cpu_2proc_zero1", recipe, SCAR, SCHEDULE)
    kill_when(cmd, logged_step(out, 5))
    saved = min(m["step"] for m in manifests(out))
    assert saved >= 4 and len(manifests(out)) == 2
    manifest = out / "scar" / "rank_00001" / "manifest.json"
    good = manifest.read_bytes()
    manifest.write_bytes(good[: len(good) // 2])  # a torn write of rank 1's manifest
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env(), timeout=600)
    # both ranks print the line at once, so their writes may share one line of the combined stderr
    errors = re.findall(
        r"error: running checkpoint not resumable \(rank \d+: .*?\)+(?=error:|\n|$)", result.stderr
    )
    assert result.returncode != 0 and len(errors) == 2 and errors[0] == errors[1], result.stderr[-3000:]
    assert "rank 1" in errors[0] and not (out / "model").exists()
    manifest.write_bytes(good)
    result = run(cmd)
    assert resumed_step(result) == saved
    assert (out / "model" / "model.safetensors").is_file()
