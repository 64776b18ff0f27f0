"""The ``checkpoint.scar`` recipe section: how often, how much and which parameter blocks the running
checkpoint writes.  Pure pydantic (no torch), so the recipe module can import it cheaply.

Equal I/O budget with a full checkpoint every ``F`` steps means ``fraction * F == every_steps``
(``ScarConfig.equal_budget`` builds that config); the benchmark compares strategies at that point.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ScarConfig(BaseModel):
    """Prioritized running checkpoint (SCAR): every ``every_steps`` steps, write ``fraction`` of the blocks."""

    model_config = ConfigDict(extra="forbid")

    fraction: float = Field(
        0.25, gt=0, le=1, description="share of this rank's blocks written at each running save"
    )
    every_steps: int = Field(50, ge=1, description="optimizer steps between two running saves")
    block: Literal["tensor", "row-block"] = Field(
        "tensor", description="tensor: one block per named tensor; row-block: slices of rows along dim 0"
    )
    rows_per_block: int = Field(64, ge=1, description="rows per block when block=row-block")
    select: Literal["max-change", "round-robin", "random"] = Field(
        "max-change",
        description="max-change: largest ||x - x_saved|| first (SCAR); round-robin and random: baselines",
    )
    seed: int = Field(0, description="seed of the random selection")

    def blocks_per_save(self, num_blocks: int) -> int:
        """How many blocks one running save writes (at least one)."""
        return max(1, min(num_blocks, math.ceil(self.fraction * num_blocks - 1e-9)))

    @classmethod
    def equal_budget(cls, full_every_steps: int, fraction: float, **fields) -> ScarConfig:
        """The running checkpoint that writes, per step, the bytes of a full checkpoint every
        ``full_every_steps`` steps: ``fraction`` of the blocks every ``fraction * full_every_steps`` steps."""
        every = fraction * full_every_steps
        if every < 1 or abs(every - round(every)) > 1e-9:
            raise ValueError(
                f"fraction {fraction} x full every_steps {full_every_steps} = {every} is not a whole number "
                "of steps; to resolve, pick a fraction that divides the full checkpoint interval"
            )
        return cls(fraction=fraction, every_steps=round(every), **fields)
