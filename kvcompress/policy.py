"""Compression policy: which tokens stay exact, and how significance maps to rank and bit width.

A token is stored in one of three ways:

- **exact** (model dtype): the first ``sinks`` tokens (attention sinks) forever, and the most recent
  ``window`` tokens while they are recent (lazy approximation: a token is compressed only once it has left
  the window, and never recomputed);
- **tier i** of ``tiers``: ``k_rank``/``v_rank`` whitened coefficients quantized to ``bits``.

Tokens leave the window in blocks of at least ``block`` tokens (so per-block quotas are meaningful and the
work is amortized).  Within each leaving block, separately per batch row and KV head, tokens are sorted by
significance and the top ``fraction[0]`` go to tier 0, the next ``fraction[1]`` to tier 1, and so on.
Quotas (rather than significance thresholds) make the memory exactly predictable from the policy and keep
every (row, head) with the same number of tokens per tier, so tiers are rectangular tensors.

``from_budget`` turns the CLI knobs (``--rank-budget`` = average rank / head_dim over compressed tokens,
``--bits 8,4,2``) into tiers: more significant tokens get both more rank and more bits.
"""

from __future__ import annotations

import itertools

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .quant import ALLOWED_BITS, bytes_per_vector, check_bits

DEFAULT_FRACTIONS = {1: (1.0,), 2: (0.3, 0.7), 3: (0.2, 0.3, 0.5), 4: (0.1, 0.2, 0.3, 0.4)}
RANK_MULTIPLIERS = (2.0, 1.0, 0.5, 0.25)


class Tier(BaseModel):
    """One storage level for compressed tokens."""

    model_config = ConfigDict(extra="forbid")
    k_rank: int = Field(gt=0, description="key coefficients kept per token and head")
    v_rank: int = Field(gt=0, description="value coefficients kept per token and head")
    bits: int | None = Field(description="2, 4 or 8 (integer codes), 16 (fp16) or None (model dtype)")
    fraction: float = Field(gt=0, le=1, description="share of each leaving block assigned to this tier")


class Policy(BaseModel):
    """How a ``TaleCache`` stores tokens; validates itself (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    sinks: int = Field(4, ge=0, description="first tokens kept exact forever (attention sinks)")
    window: int = Field(64, ge=0, description="most recent tokens kept exact")
    block: int = Field(32, ge=1, description="compress only once this many tokens have left the window")
    group_size: int | None = Field(
        None, description="coefficients per quantization group (None: whole vector)"
    )
    tiers: list[Tier] = Field(min_length=1, description="most significant first")

    @model_validator(mode="after")
    def _check(self) -> Policy:
        total = sum(t.fraction for t in self.tiers)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"tier fractions sum to {total:.4f}; to resolve, make them sum to 1")
        for t in self.tiers:
            check_bits(t.bits, t.k_rank, self.group_size)
            check_bits(t.bits, t.v_rank, self.group_size)
        return self

    def check_head_dim(self, head_dim: int) -> None:
        for i, t in enumerate(self.tiers):
            if max(t.k_rank, t.v_rank) > head_dim:
                raise ValueError(
                    f"tier {i} asks for rank {max(t.k_rank, t.v_rank)} but head_dim is {head_dim}; "
                    "to resolve, lower --rank-budget or the tier ranks"
                )

    @classmethod
    def from_budget(
        cls,
        rank_budget: float,
        bits: list[int | None],
        head_dim: int,
        fractions: list[float] | None = None,
        **kw,
    ) -> Policy:
        """Tiers whose average rank is about ``rank_budget * head_dim``; ranks fall by 2× per tier."""
        if not 0 < rank_budget <= 1:
            raise ValueError(f"rank budget {rank_budget} is out of range; to resolve, pass a value in (0, 1]")
        if not 1 <= len(bits) <= len(RANK_MULTIPLIERS):
            raise ValueError(
                f"{len(bits)} bit widths given; to resolve, pass 1 to {len(RANK_MULTIPLIERS)} (e.g. 8,4,2)"
            )
        for b in bits:
            if b not in ALLOWED_BITS:
                raise ValueError(f"bits={b} is not supported; to resolve, use 2, 4, 8 or 16")
        fractions = list(fractions or DEFAULT_FRACTIONS[len(bits)])
        mults = RANK_MULTIPLIERS[: len(bits)]
        base = rank_budget * head_dim / sum(f * m for f, m in zip(fractions, mults, strict=True))
        tiers = []
        for b, f, m in zip(bits, fractions, mults, strict=True):
            step = 8  # keeps every rank packable at 2/4/8 bits
            rank = int(min(head_dim, max(step, step * round(base * m / step))))
            tiers.append(Tier(k_rank=rank, v_rank=rank, bits=b, fraction=f))
        return cls(tiers=tiers, **kw)

    def tier_counts(self, n: int) -> list[int]:
        """Tokens per tier for a block of ``n`` leaving tokens (largest-remainder rounding, sums to ``n``)."""
        bounds = [0] + [round(n * f) for f in itertools.accumulate(t.fraction for t in self.tiers)]
        bounds[-1] = n
        return [bounds[i + 1] - bounds[i] for i in range(len(self.tiers))]

    def compressed_bytes_per_token(self, float_bytes: int) -> float:
        """Average bytes one compressed token costs per KV head (K + V coefficients + its tier id)."""
        per = [
            bytes_per_vector(t.k_rank, t.bits, self.group_size, float_bytes)
            + bytes_per_vector(t.v_rank, t.bits, self.group_size, float_bytes)
            for t in self.tiers
        ]
        return sum(t.fraction * p for t, p in zip(self.tiers, per, strict=True)) + 1

    def describe(self) -> str:
        tiers = ", ".join(f"{t.fraction:.0%}@r{t.k_rank}/{t.v_rank}x{t.bits or 'f'}b" for t in self.tiers)
        return f"sinks={self.sinks} window={self.window} [{tiers}]"


def uniform_policy(rank: int, bits: int | None, **kw) -> Policy:
    """One tier for every compressed token: the uniform low-rank / uniform quantization baselines."""
    return Policy(tiers=[Tier(k_rank=rank, v_rank=rank, bits=bits, fraction=1.0)], **kw)
