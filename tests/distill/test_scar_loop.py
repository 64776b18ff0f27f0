"""SCAR in the real training loop: resume at the running checkpoint's step, fallbacks and refusals.

(Switching SCAR on for a run that has only full checkpoints, and other block settings refused on resume, are
in test_train.py's single-process kill test, which resumes that way.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.distill_runs import REFERENCE, distill, killed_at, launched, losses, records, write_recipe
from helpers.faults import Job

from distill.scar.faults import truncate_file

SCAR = "checkpoint.scar={fraction: 1.0, every_steps: 1, block_bytes: 4096}"
EVAL = "log.eval_every_steps=1"


def resumed_step(text: str) -> int:
    lines = [line for line in text.splitlines() if "resumed" in line]
    return int(lines[-1].rsplit("at step ", 1)[1].split()[0])


def manifests(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "scar").glob("rank_*/manifest.json"))]


def evals_at(out: Path, step: int) -> list[dict]:
    return [r for r in records(out) if r["step"] == step and "eval_kl" in r]


@pytest.mark.slow
@pytest.mark.smollm2
def test_resume_continues_from_the_running_checkpoint_step(
    tiny_chat_model, chat_data, distill_reference, tmp_path
):
    """Every block each step, no full checkpoint before the kill (after step 5): the run resumes at the running
    save's step from it alone, in exactly the killed run's state (its held-out metrics are the killed run's of
    that step), and continues with the reference's losses (data order, learning rate and Adam's step counters
    of that step).  Half the blocks every 2 steps by largest change, a full checkpoint at step 3, one block
    saved at step 4 damaged: the resume at step 4 takes that block from the full checkpoint with one warning
    line, logs the recovered state's evaluation (a mix, not step 4's state) before training on, and finishes."""
    reference = losses(distill_reference)

    out = tmp_path / "killed"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, **{**REFERENCE, "every": 10})
    killed_at(tmp_path, "step:6", "-m", "distill", recipe, SCAR, EVAL)
    assert [m["step"] for m in manifests(out)] == [5] and not (out / "checkpoints").exists()
    text = distill(recipe, SCAR, EVAL)
    assert resumed_step(text) == 5 and "warning" not in text
    resumed = losses(out)
    assert resumed[6] == pytest.approx(reference[6], rel=1e-6, abs=1e-7)
    killed_eval, recovered_eval = evals_at(out, 5)
    assert recovered_eval["resumed"] == "running" and "resumed" not in killed_eval
    metrics = [{k: v for k, v in r.items() if k.startswith("eval_")} for r in (killed_eval, recovered_eval)]
    assert len(metrics[0]) >= 4 and metrics[1] == metrics[0]  # the same state, to the last bit

    out = tmp_path / "damaged"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, **{**REFERENCE, "every": 3})
    scar = "checkpoint.scar={fraction: 0.5, every_steps: 2, select: max-change}"
    killed_at(tmp_path, "step:6", "-m", "distill", recipe, scar, EVAL)
    (manifest,) = manifests(out)
    assert manifest["step"] == 4
    bad = sorted(b for b, entry in manifest["blocks"].items() if entry["step"] == 4)[0]
    truncate_file(out / "scar" / "rank_00000" / manifest["blocks"][bad]["file"])
    result = distill(recipe, scar, EVAL)
    warnings = [line for line in result.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and bad in warnings[0] and "full checkpoint" in warnings[0], result[-3000:]
    assert "resumed running checkpoint" in result and resumed_step(result) == 4
    # the killed run's evaluation of step 4, then the recovered state's (the full checkpoint of step 3 with the
    # blocks saved at step 4, but the damaged one), evaluated before training on
    killed_eval, recovered_eval = evals_at(out, 4)
    assert recovered_eval["resumed"] == "running" and recovered_eval["train_tokens"] == 4 * 4 * 64
    assert recovered_eval["eval_kl"] != killed_eval["eval_kl"]
    assert [r["step"] for r in records(out) if "loss" in r][-2:] == [5, 6]
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.smollm2
def test_two_process_zero1_bf16_resume_and_a_failing_rank(tiny_chat_model, chat_data, tmp_path):
    """ZeRO-1 with bf16 (DeepSpeed's BF16_Optimizer) on 2 processes: a rank whose running checkpoint cannot be
    read stops both ranks with the same one-line error (no rank waits in a collective); once repaired, the run
    resumes at the running checkpoint's step and finishes."""
    out = tmp_path / "zero1"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, mixed_precision="bf16")
    target = ("-m", "distill", recipe, SCAR, "optim.schedule=linear")
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
