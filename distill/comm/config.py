"""The ``comm:`` recipe section: which DDP communication hook runs and how it spends its budget.

Pure pydantic (no torch import), so the recipe module can validate it before anything heavy loads.  The
combinations that cannot work are rejected here, one line each, with the fix.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Hook = Literal["allreduce", "managed", "powersgd"]
Priority = Literal["relative-magnitude", "magnitude", "random", "fifo"]


class CommConfig(BaseModel):
    """Gradient communication for the DDP path (DeepSpeed keeps its own communication)."""

    model_config = ConfigDict(extra="forbid")

    hook: Hook = Field(
        "allreduce",
        description="allreduce: plain averaging; managed: Bösen budgeted, prioritized sends with error "
        "feedback; powersgd: torch's low-rank PowerSGD hook (comparison baseline)",
    )
    budget: float = Field(
        1.0,
        gt=0,
        le=1,
        description="managed: fraction of each bucket's gradient blocks sent per step; the rest stays "
        "queued locally and goes out later (1.0 = every block, i.e. all-reduce)",
    )
    priority: Priority = Field(
        "relative-magnitude",
        description="managed: which blocks go first; relative-magnitude |Δ/x| (|Δ| where x=0), magnitude "
        "|Δ|, random (same draw on every rank), fifo (longest-unsent first)",
    )
    block_size: int = Field(
        64, ge=1, description="managed: elements per block (the unit of priority and of sending)"
    )
    staleness: int = Field(
        0,
        ge=0,
        description="bounded staleness s: a worker may run at most s steps ahead of the slowest; the "
        "gradient applied at step t is the average from step t-s (0 = synchronous)",
    )
    powersgd_rank: int = Field(1, ge=1, description="powersgd: matrix approximation rank")
    powersgd_start_iter: int = Field(
        2, ge=2, description="powersgd: plain all-reduce steps before compression starts (>= 2)"
    )
    seed: int = Field(0, description="managed: seed of the random priority (identical on all ranks)")

    @model_validator(mode="after")
    def _combinations(self):
        if self.staleness and self.hook == "powersgd":
            raise ValueError(
                "comm.staleness > 0 does not work with hook=powersgd; to resolve, use hook=allreduce or managed"
            )
        if self.staleness and self.hook == "managed" and self.priority in ("relative-magnitude", "magnitude"):
            raise ValueError(
                f"comm.priority={self.priority} needs a score exchange every step, which would make "
                "staleness synchronous; to resolve, use priority=random or fifo with staleness > 0"
            )
        return self


def require_ddp_path(cfg: CommConfig, deepspeed: bool, processes: int) -> None:
    """Refuse, before any work, a comm section that only the multi-process DDP path can run: DeepSpeed keeps
    its own gradient communication (a hook would silently not apply), and one process communicates nothing."""
    if cfg.hook == "allreduce" and not cfg.staleness:
        return
    if deepspeed or processes < 2:
        where = (
            "under DeepSpeed, which keeps its own gradient communication" if deepspeed else "on one process"
        )
        raise ValueError(
            f"comm.hook={cfg.hook} (staleness {cfg.staleness}) cannot run {where} (to resolve, launch >= 2 "
            "processes without DeepSpeed, e.g. torchrun --nproc_per_node N -m distill RECIPE, or drop the comm section)"
        )
