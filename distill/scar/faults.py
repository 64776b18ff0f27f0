"""Fault injection for tests and benchmarks: kill a process (or the writer itself at a named point of a
save), zero or perturb a random subset of parameter blocks, truncate a checkpoint file.

``SWIFTKV_SCAR_KILL_AT=<point>:<n>`` makes the process hard-exit (status 17, no cleanup, like a lost rank)
the n-th time it reaches ``<point>``; the points are ``block_written`` and ``manifest_written``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .blocks import Block

KILL_ENV = "SWIFTKV_SCAR_KILL_AT"
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Die here if ``SWIFTKV_SCAR_KILL_AT`` asks for it (no-op otherwise)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(count or 1):
        os._exit(17)


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
