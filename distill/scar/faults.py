"""Fault injection for benchmarks and tests, applied from outside the code under test: kill a process, zero
or perturb a random subset of parameter blocks, truncate a checkpoint file."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .blocks import Block


def kill_process(pid: int, sig: int = signal.SIGKILL) -> None:
    """Kill a process (a rank, a writer) without giving it a chance to clean up."""
    os.kill(pid, sig)


def pick_blocks(blocks: Sequence[Block], fraction: float, generator: torch.Generator) -> list[Block]:
    """A random ``fraction`` of the blocks (at least one)."""
    k = max(1, round(fraction * len(blocks)))
    order = torch.randperm(len(blocks), generator=generator)[:k].tolist()
    return [blocks[i] for i in sorted(order)]


@torch.no_grad()
def damage_blocks(
    params: Mapping[str, torch.Tensor],
    blocks: Sequence[Block],
    mode: str = "zero",
    scale: float = 1.0,
    generator: torch.Generator | None = None,
) -> set[str]:
    """Lose the given blocks in place: ``zero`` them, or ``perturb`` them with N(0, scale^2) noise, or set
    them to ``nan``; return their ids (the fault signal a recovery gets)."""
    for block in blocks:
        rows = block.rows(params[block.name])
        if mode == "zero":
            rows.zero_()
        elif mode == "perturb":
            noise = torch.randn(rows.shape, generator=generator, dtype=rows.dtype)
            rows.add_(scale * noise.to(rows.device))
        elif mode == "nan":
            rows.fill_(float("nan"))
        else:
            raise ValueError(f"unknown damage mode {mode!r}; to resolve, use zero, perturb or nan")
    return {b.id for b in blocks}


def truncate_file(path: str | os.PathLike, keep: float = 0.5) -> None:
    """Cut a file to ``keep`` of its bytes, as a crash of the storage layer would."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))
