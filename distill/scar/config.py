"""The ``checkpoint.scar`` recipe section: how often, how much and which parameter blocks the running
checkpoint writes.  Pure pydantic (no torch), so the recipe module can import it cheaply.

The budget is in bytes (parameter values plus optimizer state), not in blocks, because blocks differ in
size: a running save may write ``fraction`` of the bytes of all this rank's blocks.  Equal I/O with a full
checkpoint every ``F`` steps then means ``fraction * F == every_steps`` (``ScarConfig.equal_budget`` builds
that config); the benchmark compares strategies at that point.  Blocks are sized in bytes too
(``block_bytes``), so that the number of files per save does not grow with the element count of a ZeRO
partition; ``distill.scar.blocks`` bounds the count and keeps every block inside one save's budget.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MiB = 1 << 20
REPLACED = ("block", "rows_per_block")  # element-count sizing, replaced by block_bytes


class ScarConfig(BaseModel):
    """Prioritized running checkpoint (SCAR): every ``every_steps`` steps, write blocks worth
    ``fraction`` of this rank's checkpoint bytes."""

    model_config = ConfigDict(extra="forbid")

    fraction: float = Field(
        0.25,
        ge=0.01,
        le=1,
        description="share of this rank's checkpoint bytes (values + optimizer state) written per running save",
    )
    every_steps: int = Field(50, ge=1, description="optimizer steps between two running saves")
    block_bytes: int = Field(
        16 * MiB,
        ge=256,
        le=1024 * MiB,
        description="parameter bytes per block (slices along dim 0; a payload with Adam's state is ~3x); "
        "raised so that a rank has at most 1000 blocks, lowered so that no block exceeds one save's budget",
    )
    select: Literal["max-change", "round-robin", "random"] = Field(
        "max-change",
        description="max-change: largest ||x - x_saved||^2 per byte first (SCAR); round-robin, random: baselines",
    )
    seed: int = Field(0, description="seed of the random selection")

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data):
        old = sorted(set(data) & set(REPLACED)) if isinstance(data, dict) else []
        if old:
            raise ValueError(
                f"{old[0]} was replaced by block_bytes (blocks are sized in bytes); to resolve, remove "
                f"{' and '.join(old)} and set block_bytes (default {16 * MiB} = 16 MiB)"
            )
        return data

    @classmethod
    def equal_budget(cls, full_every_steps: int, fraction: float, **fields) -> ScarConfig:
        """The running checkpoint that writes, per step, the bytes of a full checkpoint every
        ``full_every_steps`` steps: ``fraction`` of the bytes every ``fraction * full_every_steps`` steps."""
        every = fraction * full_every_steps
        if every < 1 or abs(every - round(every)) > 1e-9:
            raise ValueError(
                f"fraction {fraction} x full every_steps {full_every_steps} = {every} is not a whole number "
                "of steps; to resolve, pick a fraction that divides the full checkpoint interval"
            )
        return cls(fraction=fraction, every_steps=round(every), **fields)
