"""Placer: maps each job's configuration onto concrete nodes and GPU indices.

Jobs whose configuration did not change keep their GPUs (a move would be a restart).  The others are
placed whole-node jobs first, then single-node jobs largest first onto the fullest node with room
(best fit, which keeps whole nodes free for later multi-node jobs).  If that fails because the kept jobs
fragment a type, the type is repacked from scratch in the same order; with power-of-two jobs on
power-of-two nodes that first-fit-decreasing packing always succeeds when the GPU count is within
capacity, which is exactly what the ILP guarantees.
"""

from __future__ import annotations

from .configs import Config
from .spec import Cluster, GpuType, Placement


class PlacementError(RuntimeError):
    pass


def _place_one(cfg: Config, free: list[list[int]], gpu: GpuType) -> dict[int, list[int]] | None:
    if cfg.nodes > 1:
        whole = [n for n, f in enumerate(free) if len(f) == gpu.gpus_per_node][: cfg.nodes]
        if len(whole) < cfg.nodes:
            return None
        return {n: free[n][:] for n in whole}
    fits = [n for n, f in enumerate(free) if len(f) >= cfg.gpus]
    if not fits:
        return None
    n = min(fits, key=lambda n: (len(free[n]), n))
    return {n: free[n][: cfg.gpus]}


def _pack(
    order: list[tuple[str, Config]], free: list[list[int]], gpu: GpuType
) -> dict[str, Placement] | None:
    out = {}
    for name, cfg in order:
        got = _place_one(cfg, free, gpu)
        if got is None:
            return None
        for n, idx in got.items():
            free[n] = [g for g in free[n] if g not in idx]
        out[name] = Placement(gpu_type=gpu.name, gpus=got)
    return out


def place(
    allocation: dict[str, Config | None], cluster: Cluster, previous: dict[str, Placement] | None = None
) -> dict[str, Placement]:
    """Placement of every allocated job; keeps unchanged jobs where they were when possible."""
    previous = previous or {}
    out: dict[str, Placement] = {}
    for gpu in cluster.gpu_types:
        jobs = {n: c for n, c in allocation.items() if c is not None and c.gpu_type == gpu.name}
        if sum(c.gpus for c in jobs.values()) > gpu.capacity:
            raise PlacementError(
                f"{gpu.name}: {sum(c.gpus for c in jobs.values())} GPUs allocated > {gpu.capacity}"
            )
        order = sorted(jobs.items(), key=lambda kv: (-kv[1].nodes, -kv[1].gpus, kv[0]))
        free = [list(range(gpu.gpus_per_node)) for _ in range(gpu.nodes)]
        kept = {}
        for name, cfg in order:
            old = previous.get(name)
            if (
                old is not None
                and old.gpu_type == gpu.name
                and old.num_gpus == cfg.gpus
                and len(old.gpus) == cfg.nodes
            ):
                kept[name] = old
                for n, idx in old.gpus.items():
                    free[n] = [g for g in free[n] if g not in idx]
        rest = _pack([kv for kv in order if kv[0] not in kept], free, gpu)
        if rest is None:
            kept = {}
            rest = _pack(order, [list(range(gpu.gpus_per_node)) for _ in range(gpu.nodes)], gpu)
        if rest is None:
            raise PlacementError(f"{gpu.name}: could not pack {[str(c) for _, c in order]}")
        out.update(kept)
        out.update(rest)
    return out
