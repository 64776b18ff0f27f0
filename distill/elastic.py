"""Elastic resume: a checkpoint written by N processes continues on M, with the same global batch.

The rule for the batch: ``train.grad_accum`` in the recipe is the accumulation at the world size of the run's
first launch.  Every checkpoint records the global batch (micro_batch_size x grad_accum x processes) it was
trained with, and a launch on M processes accumulates ``global_batch / (micro_batch_size x M)`` micro-batches
per step; when that is not a whole number the launch is refused with one line before any work.

The data order does not depend on the world size either: accelerate's seedable sampler draws one permutation
per epoch from ``data.seed + epoch``, its micro-batches are dealt round-robin to the ranks, and step s takes
the micro-batches ``s·k .. (s+1)·k - 1`` of that permutation (k = grad_accum x processes, the same k at every
world size).  So the global batch at step s holds the same rows on 1 or N processes, as long as an epoch's
micro-batch count is a multiple of k (otherwise accelerate pads the last step of an epoch per world size).

The state itself: without DeepSpeed it is world-size independent (one model, one optimizer state; only the
per-rank RNG and communication-hook states are not carried over; SCAR's running blocks of another world
size are dropped by ``train._running_checkpoint``).  ZeRO checkpoints hold one optimizer
partition per rank; they are converted once (by the main process, into ``<checkpoint>/elastic``) with
DeepSpeed's universal checkpoint (``deepspeed.checkpoint.ds_to_universal``) and loaded with
``checkpoint.load_universal``, which re-partitions them over the new ranks.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from .recipe import Recipe


class ResumeError(ValueError):
    """The checkpoint to resume from does not belong to this recipe or cannot continue on this launch."""


def world_state(recipe: Recipe, processes: int, grad_accum: int, zero_stage: int) -> dict:
    """What a checkpoint records about the launch that wrote it (next to the step and the fingerprint)."""
    return {
        "num_processes": processes,
        "grad_accum": grad_accum,
        "global_batch": recipe.train.micro_batch_size * grad_accum * processes,
        "zero_stage": zero_stage,
    }


@dataclass(frozen=True)
class Resume:
    """Where a launch starts: the checkpoint (None for a fresh start), its step, and the accumulation."""

    checkpoint: Path | None
    step: int
    grad_accum: int
    processes: int
    saved_processes: int
    saved_grad_accum: int

    @property
    def elastic(self) -> bool:
        """True when the checkpoint was written by another number of processes."""
        return self.checkpoint is not None and self.saved_processes != self.processes

    def describe(self) -> str:
        return (
            f"converted checkpoint {self.checkpoint} from {self.saved_processes} to {self.processes} processes "
            f"(grad_accum {self.saved_grad_accum} -> {self.grad_accum}, global batch kept)"
        )


def fresh(recipe: Recipe, processes: int) -> Resume:
    ga = recipe.train.grad_accum
    return Resume(None, 0, ga, processes, processes, ga)


def plan(ckpt: Path, state: dict, recipe: Recipe, processes: int, zero_stage: int) -> Resume:
    """The resume of ``ckpt`` (its ``trainer_state.json`` read into ``state``) on ``processes`` processes;
    raises ResumeError, with the fix, when it cannot continue there."""
    missing = [
        k for k in ("step", "num_processes", "grad_accum", "global_batch", "zero_stage") if k not in state
    ]
    if missing:  # written before checkpoints recorded their launch (or not by this trainer)
        raise ResumeError(
            f"checkpoint {ckpt} does not record {', '.join(missing)} (an older format); to resolve, finish it "
            "with the version that wrote it, or use a new output_dir or checkpoint.resume=never"
        )
    saved_n, saved_stage, global_batch = state["num_processes"], state["zero_stage"], state["global_batch"]
    if saved_stage != zero_stage:

        def name(stage: int) -> str:
            return f"DeepSpeed ZeRO-{stage}" if stage else "no DeepSpeed"

        raise ResumeError(
            f"checkpoint {ckpt} was written with {name(saved_stage)}, this launch runs {name(zero_stage)}; "
            f"to resolve, launch with an accelerate config of {name(saved_stage)}, or use a new output_dir "
            "or checkpoint.resume=never"
        )
    if saved_n == processes:
        return Resume(ckpt, state["step"], state["grad_accum"], processes, saved_n, state["grad_accum"])
    per_step = recipe.train.micro_batch_size * processes
    if global_batch % per_step:
        fits = [
            m for m in range(1, global_batch + 1) if global_batch % (recipe.train.micro_batch_size * m) == 0
        ]
        raise ResumeError(
            f"checkpoint {ckpt} trained with a global batch of {global_batch} sequences, which {processes} "
            f"processes x micro_batch_size {recipe.train.micro_batch_size} do not divide; to resolve, launch "
            f"with one of {fits} processes, or use a new output_dir or checkpoint.resume=never"
        )
    if recipe.comm.hook != "allreduce" or recipe.comm.staleness:
        raise ResumeError(
            f"checkpoint {ckpt} was written by {saved_n} processes, this launch has {processes}, and the "
            f"comm hook's per-rank residuals do not carry over to another world size; to resolve, launch with "
            f"{saved_n} processes, or drop the comm section"
        )
    return Resume(ckpt, state["step"], global_batch // per_step, processes, saved_n, state["grad_accum"])


def _zero_to_universal(src: Path, dst: Path) -> None:
    """DeepSpeed's converter on one ``save_checkpoint`` tag folder (its progress output swallowed)."""
    from deepspeed.checkpoint.ds_to_universal import main

    args = Namespace(
        input_folder=str(src),
        output_folder=str(dst),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # engines of plain models do not write universal_checkpoint_info
    )
    with contextlib.redirect_stdout(io.StringIO()):
        main(args)


def elastic_checkpoint(ckpt: Path) -> Path:
    """A folder that ``accelerator.load_state`` reads on any world size: ``ckpt``'s files hard-linked, less
    the per-rank state that does not carry over (custom objects after the first, i.e. the comm hook state; see
    ``train.setup``), and ZeRO partitions (``pytorch_model/``) as a universal checkpoint.  Written under a
    temp name and renamed, so a killed conversion is redone; kept inside ``ckpt`` and removed with it."""
    dst, tmp = ckpt / "elastic", ckpt / ".elastic.tmp"
    if dst.is_dir():
        return dst
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for path in ckpt.iterdir():
        carried = not path.name.startswith("custom_checkpoint_") or path.name == "custom_checkpoint_0.pkl"
        if path.is_file() and path.name != "latest" and carried:
            os.link(path, tmp / path.name)
    zero = ckpt / "pytorch_model"
    if zero.is_dir():
        _zero_to_universal(zero, tmp / "pytorch_model")
    os.replace(tmp, dst)
    return dst
