"""Compression policy: which tokens stay exact, and how significance maps to rank and bit width.

A token is stored in one of three ways:

- **exact** (model dtype): the first ``sinks`` tokens (attention sinks) forever, and the most recent
  ``window`` tokens while they are recent (lazy approximation: a token is compressed only once it has left
  the window, and never recomputed);
- **tier i** of ``tiers``: ``k_rank``/``v_rank`` coefficients in the calibrated basis, quantized to ``bits``.

A token's tier is chosen from the attention it received, so a token leaves the window only once
``min(observe, window + 1)`` query rows have attended to it.  In a plain model this always holds already (a
prefill observes from its last 64 rows, a decoded token is seen by ``window + 1`` rows before it leaves); in
SwiftKV's later layers a ``generate()`` prefill runs only the last prompt row, so the prompt waits there for
the first decode steps' queries instead of being tiered from one row.

Tokens leave the window in blocks of at least ``block`` tokens (so per-block quotas are meaningful and the
work is amortized).  Within each leaving block, separately per batch row and KV head, tokens are sorted by
significance and the top ``fraction[0]`` go to tier 0, the next ``fraction[1]`` to tier 1, and so on.
Quotas (rather than significance thresholds) make the memory exactly predictable from the policy and keep
every (row, head) with the same number of tokens per tier, so tiers are rectangular tensors.

``from_budget`` turns the CLI knobs (``--rank-budget`` = average key rank / head_dim over compressed tokens,
``--bits 8,4,2`` = the keys' bit width per tier, ``--value-bits`` the values' where they differ) into tiers:
tier 0 (the most significant tokens) keeps full rank; the remaining key-rank budget is shared by the other
tiers with ranks halving per tier; value ranks are 1.5x key ranks.  These defaults come from measurements on
SmolLM2.  A probe on one held-out sequence (512+128 tokens), at equal bytes: the most significant half at full
rank and the rest at rank 32/64 had KL 0.032, vs 0.134 for a uniform key rank 48, and 0.071 with the
significance order reversed.  2-bit integer codes are only usable for the least significant tokens with
per-token scales: uniform 2-bit per-token quantization broke SmolLM2 (+838% ppl).  With per-channel scales
(``scales``, ``kvcompress.quant``) 2 bits carry most tiers.  The calibration default ``--rank-budget 0.5
--bits 4,4,2 --value-bits 4,2,2 --scales cc`` (10% full rank at 4 bits; 30% key rank 40 at 4 bits and value
rank 64 at 2; 60% rank 24/32 at 2 bits) comes from the 2026-12-07 sweep over 16 ShareGPT and 8 documentation
sequences of 4,096 + 256 tokens (docs/results/kvcompress.md): against the former ``--bits 4,2,2`` it halved
the perplexity increase on chat (+3.8% -> +1.6%) and cut it on the documentation (+9.3% -> +6.0%) for 8% more
memory (6.57x against 7.11x smaller than fp16).  Where the bits go matters: the middle tier's keys at 4 bits
bought that, its values at 4 bits gained under half a point for 14% more memory, and the most significant
tier's values need their 4 bits.  Key rank matters as much: at key rank 8 in the least significant tier, 4-bit
keys stay at +13.5% (9.16x), and key-heavy tiers (value ranks half the key ranks) moved the ShareGPT front a
little at 8.2-8.6x and lost on the documentation text, so value ranks stay 1.5x key ranks.  Key ranks can
differ by layer (``layer_key_ranks``): calibration moves them to the layers where truncated keys cost most, at
the same memory (``kvcompress.allocate``).
"""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .defaults import BLOCK, SINKS, WINDOW
from .quant import ALLOWED_BITS, INT_BITS, bytes_per_vector, check_bits

Scales = Literal["token", "channel"]

DEFAULT_FRACTIONS = {1: (1.0,), 2: (0.25, 0.75), 3: (0.1, 0.3, 0.6), 4: (0.1, 0.2, 0.3, 0.4)}
RANK_MULTIPLIERS = (1.0, 0.5, 0.25)  # key rank of tiers 1, 2, 3 relative to each other
V_RANK_FACTOR = 1.5  # values are less low-rank than keys (SmolLM2: rank 32 keeps ~95% of K energy, ~80% of V)


class Tier(BaseModel):
    """One storage level for compressed tokens."""

    model_config = ConfigDict(extra="forbid")
    k_rank: int = Field(gt=0, description="key coefficients kept per token and head")
    v_rank: int = Field(gt=0, description="value coefficients kept per token and head")
    bits: int | None = Field(
        description="key bits (and value bits unless v_bits is given): 2, 4 or 8 (integer codes), 16 (fp16) or "
        "None (model dtype)"
    )
    v_bits: int | None = Field(description="value bits, as bits (default: bits)")
    fraction: float = Field(gt=0, le=1, description="share of each leaving block assigned to this tier")
    k_scales: Scales = Field(
        "token",
        description="key scales: per token (groups of group_size) or per channel (token_group tokens)",
    )
    v_scales: Scales = Field("token", description="value scales, as k_scales")

    @model_validator(mode="before")
    @classmethod
    def _value_bits_default(cls, data):
        """A tier written without ``v_bits`` (every policy.json before it existed) stores values like keys."""
        if isinstance(data, dict) and "v_bits" not in data:
            data = {**data, "v_bits": data.get("bits")}
        return data


class Policy(BaseModel):
    """How a ``TaleCache`` stores tokens; validates itself (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    sinks: int = Field(SINKS, ge=0, description="first tokens kept exact forever (attention sinks)")
    window: int = Field(WINDOW, ge=0, description="most recent tokens kept exact")
    block: int = Field(BLOCK, ge=1, description="compress only once this many tokens have left the window")
    observe: int = Field(
        64,
        ge=1,
        description="query rows that must have attended to a token before its tier is chosen (at most window + 1 "
        "are waited for); matters where a prompt's rows skipped attention (SwiftKV's later layers)",
    )
    group_size: int | None = Field(
        None, description="coefficients per quantization group (None: whole vector)"
    )
    token_group: int = Field(
        64, ge=1, description="tokens of a tier that share one scale/zero per channel (channel scales)"
    )
    scored_keys: bool = Field(
        True,
        description="key coefficients in the factors' basis fitted to the queries where they have one and no tier "
        "quantizes keys per token (kvcompress.factors); False: always the PCA basis of the keys",
    )
    tiers: list[Tier] = Field(min_length=1, description="most significant first")
    layer_key_ranks: dict[int, list[int]] = Field(
        default_factory=dict,
        description="per layer index, the key rank of every tier, where it differs from the tiers' k_rank "
        "(kvcompress.allocate moves rank between layers by measured sensitivity)",
    )

    @model_validator(mode="after")
    def _check(self) -> Policy:
        total = sum(t.fraction for t in self.tiers)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"tier fractions sum to {total:.4f}; to resolve, make them sum to 1")
        for t in self.tiers:
            check_bits(t.bits, t.k_rank, self.group_size)
            check_bits(t.v_bits, t.v_rank, self.group_size)
        for layer, ranks in self.layer_key_ranks.items():
            if len(ranks) != len(self.tiers):
                raise ValueError(
                    f"layer {layer} has {len(ranks)} key ranks for {len(self.tiers)} tiers; to resolve, give one per tier"
                )
            for t, r in zip(self.tiers, ranks, strict=True):
                if r < 1:
                    raise ValueError(f"layer {layer} has key rank {r}; to resolve, use ranks >= 1")
                check_bits(t.bits, r, self.group_size)
        return self

    def check_head_dim(self, head_dim: int) -> None:
        for i, t in enumerate(self.tiers):
            if max(t.k_rank, t.v_rank) > head_dim:
                raise ValueError(
                    f"tier {i} asks for rank {max(t.k_rank, t.v_rank)} but head_dim is {head_dim}; "
                    "to resolve, lower --rank-budget or the tier ranks"
                )
        for layer, ranks in self.layer_key_ranks.items():
            if max(ranks) > head_dim:
                raise ValueError(
                    f"layer {layer} asks for key rank {max(ranks)} but head_dim is {head_dim}; "
                    "to resolve, re-run the allocation for this model"
                )

    def key_ranks(self, layer: int) -> list[int]:
        """Key rank of every tier in ``layer``."""
        return self.layer_key_ranks.get(layer) or [t.k_rank for t in self.tiers]

    @classmethod
    def from_budget(
        cls,
        rank_budget: float,
        bits: list[int | None],
        head_dim: int,
        fractions: list[float] | None = None,
        value_bits: list[int | None] | None = None,
        scales: tuple[Scales, Scales] = ("token", "token"),
        **kw,
    ) -> Policy:
        """Tiers whose average key rank is about ``rank_budget * head_dim`` (see the module docstring), every
        tier with key and value ``scales``; values at ``value_bits`` where given (one per tier), else at ``bits``."""
        if not 0 < rank_budget <= 1:
            raise ValueError(f"rank budget {rank_budget} is out of range; to resolve, pass a value in (0, 1]")
        if not 1 <= len(bits) <= len(RANK_MULTIPLIERS) + 1:
            raise ValueError(
                f"{len(bits)} bit widths given; to resolve, pass 1 to {len(RANK_MULTIPLIERS) + 1} (e.g. 8,4,2)"
            )
        value_bits = list(bits if value_bits is None else value_bits)
        if len(value_bits) != len(bits):
            raise ValueError(
                f"{len(value_bits)} value bit widths for {len(bits)} tiers; to resolve, give one per tier "
                "(--value-bits), as many as --bits"
            )
        for b in [*bits, *value_bits]:
            if b not in ALLOWED_BITS:
                raise ValueError(f"bits={b} is not supported; to resolve, use 2, 4, 8 or 16")
        fractions = list(fractions or DEFAULT_FRACTIONS[len(bits)])
        if len(fractions) != len(bits):
            raise ValueError(
                f"{len(fractions)} fractions for {len(bits)} tiers; to resolve, give one per bit width"
            )
        ranks = [head_dim]  # the most significant tokens keep every component
        if len(bits) > 1:
            rest = rank_budget * head_dim - fractions[0] * head_dim
            mults = RANK_MULTIPLIERS[: len(bits) - 1]
            base = rest / sum(f * m for f, m in zip(fractions[1:], mults, strict=True))
            ranks += [_round8(base * m, head_dim) for m in mults]
        tiers = [
            Tier(
                k_rank=r,
                v_rank=_round8(V_RANK_FACTOR * r, head_dim),
                bits=b,
                v_bits=vb,
                fraction=f,
                k_scales=scales[0],
                v_scales=scales[1],
            )
            for r, b, vb, f in zip(ranks, bits, value_bits, fractions, strict=True)
        ]
        return cls(tiers=tiers, **kw)

    def tier_counts(self, n: int) -> list[int]:
        """Tokens per tier for a block of ``n`` leaving tokens (largest-remainder rounding, sums to ``n``)."""
        bounds = [0] + [round(n * f) for f in itertools.accumulate(t.fraction for t in self.tiers)]
        bounds[-1] = n
        return [bounds[i + 1] - bounds[i] for i in range(len(self.tiers))]

    @property
    def uses_scored_keys(self) -> bool:
        """Whether keys go into the factors' basis fitted to the queries (where they have one): asked for, and
        no tier quantizes keys to integers with per-token scales (``kvcompress.factors`` says why)."""
        return self.scored_keys and not any(t.k_scales == "token" and t.bits in INT_BITS for t in self.tiers)

    def token_group_of(self, scales: Scales) -> int | None:
        """The ``token_group`` a ``quantize`` call takes for ``scales`` (None: per-token scales)."""
        return self.token_group if scales == "channel" else None

    @property
    def tier_id_bits(self) -> int:
        """Bits of a compressed token's tier id (packed ``8 // tier_id_bits`` a byte; none for one tier)."""
        n = len(self.tiers)
        return 0 if n == 1 else 2 if n <= 4 else 8

    def compressed_bytes_per_token(self, float_bytes: int, layer: int | None = None) -> float:
        """Average bytes one compressed token costs per KV head (in ``layer``, whose key ranks may differ):
        K + V coefficients, their scales (channel scales amortized over full groups of ``token_group``
        tokens) and its packed tier id."""
        k_ranks = self.key_ranks(layer) if layer is not None else [t.k_rank for t in self.tiers]
        per = [
            bytes_per_vector(k, t.bits, self.group_size, float_bytes, self.token_group_of(t.k_scales))
            + bytes_per_vector(
                t.v_rank, t.v_bits, self.group_size, float_bytes, self.token_group_of(t.v_scales)
            )
            for t, k in zip(self.tiers, k_ranks, strict=True)
        ]
        return sum(t.fraction * p for t, p in zip(self.tiers, per, strict=True)) + self.tier_id_bits / 8

    def describe(self) -> str:
        tiers = ", ".join(
            f"{t.fraction:.0%}@r{t.k_rank}/{t.v_rank}x{_bits_tag(t)}b{_scales_tag(t)}" for t in self.tiers
        )
        by_layer = ""
        if self.layer_key_ranks:
            spans = zip(*self.layer_key_ranks.values(), strict=True)
            by_layer = " key ranks by layer " + "/".join(f"{min(s)}-{max(s)}" for s in spans)
        return f"sinks={self.sinks} window={self.window} [{tiers}]{by_layer}"


SCALE_LETTERS = {"t": "token", "c": "channel"}


def scales_pair(letters: str) -> tuple[Scales, Scales]:
    """``"ct"`` -> ``("channel", "token")``: key then value scales, ``t`` per token, ``c`` per channel."""
    if len(letters) != 2 or any(c not in SCALE_LETTERS for c in letters):
        raise ValueError(
            f"scales {letters!r}: to resolve, give two letters of t (per token) and c (per channel), keys first"
        )
    return SCALE_LETTERS[letters[0]], SCALE_LETTERS[letters[1]]


def _bits_tag(tier: Tier) -> str:
    """``"4"`` where keys and values share a bit width, else keys/values, e.g. ``"2/4"`` (``f``: unquantized)."""
    k, v = (b or "f" for b in (tier.bits, tier.v_bits))
    return f"{k}" if k == v else f"{k}/{v}"


def _scales_tag(tier: Tier) -> str:
    """``""`` for per-token scales of both K and V, else e.g. ``"[K ch, V tok]"``."""
    if tier.k_scales == tier.v_scales == "token":
        return ""
    short = {"token": "tok", "channel": "ch"}
    return f"[K {short[tier.k_scales]}, V {short[tier.v_scales]}]"


def _round8(rank: float, head_dim: int) -> int:
    """Round to a multiple of 8 (packable at 2/4/8 bits) within [8, head_dim]."""
    return int(min(head_dim, max(8, 8 * round(rank / 8))))


def uniform_policy(rank: int, bits: int | None, **kw) -> Policy:
    """One tier for every compressed token: the uniform low-rank / uniform quantization baselines."""
    return Policy(tiers=[Tier(k_rank=rank, v_rank=rank, bits=bits, fraction=1.0)], **kw)
