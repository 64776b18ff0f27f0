"""Key ranks per layer, moved to where truncating keys costs the model most, at the same memory.

Why: a policy gives every layer the same key ranks, but layers differ in what a truncated key costs.  On
SmolLM2-135M at 4,096 tokens (the default policy, 4 held-out sequences) keeping the keys exact in layers
15-24 removed 2.2 of the 3.1 points that key truncation adds to perplexity, and keeping them exact in layers
10-14 or 25-29 removed nothing.  Neither the keys' spectra nor the attention a layer pays to old tokens
predicts this (layers 0-9 attend to old tokens most and cost little: their attention is broad, so score
errors average out), so the cost is measured.

- ``key_sensitivity`` measures it: per layer, the KL divergence (mean over continuation tokens) between the
  cache with every layer's keys at full rank and the same cache with this one layer's keys at the policy's
  ranks.  Everything else (values, bits, tiers) is as in the policy, so the number isolates key truncation.
- ``allocate_key_ranks`` models a layer's cost at other ranks as its measured KL scaled by the key energy
  those ranks drop (``LayerFactors.key_energy``; in the basis fitted to the queries that is the expected
  square score error), and moves rank greedily, ``step`` at a time, to the layer where it removes the most
  modelled cost, until the key coefficients of the uniform policy are spent.  Every truncated tier of a
  layer moves by the same offset, so the tiers' order of significance is kept; full-rank tiers stay full.
  The cost is convex in rank (energies are sorted), so the greedy choice is the best one under the model.

On SmolLM2 (16 + 8 held-out sequences of 4,096 + 256 tokens, docs/results/kvcompress.md) this took the
default's perplexity increase from +5.6% to +3.8% on chat and from +11.0% to +9.3% on documentation text at
the same 7.11x, and a 9.1x policy's from +12.0% to +8.3%; 85% of the measured KL sat in 7 of 30 layers.

Calibration stores the measurement in the factors' metadata (``SENSITIVITY_KEY``: the layers' KL and the
key ranks it was measured at) and writes the allocated default policy; any other policy can be allocated
from the same measurement (``kvcompress.evaluate`` does, unless a method asks for ``:uniform``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .attention import enable_tale
from .cache import TaleCache
from .continuation import SharedPrefill, compare, continuation_logits
from .factors import Factors
from .policy import Policy

SENSITIVITY_KEY = "key_sensitivity"
STEP = 8  # rank moves in multiples of 8: packable at 2, 4 and 8 bits


@torch.no_grad()
def key_sensitivity(
    model,
    factors: Factors,
    policy: Policy,
    sequences: Iterable[torch.Tensor],
    continuation: int,
    chunk: int = 16,
    summed: dict[int, float] | None = None,
    tokens: int = 0,
    done: Callable[[dict[int, float], int], None] | None = None,
) -> dict:
    """The measurement ``allocate_key_ranks`` takes (module docstring), over the last ``continuation`` tokens
    of each sequence fed in ``chunk``-token steps: ``{"kl": {layer: mean KL}, "ranks": [...], "fractions":
    [...]}``.  ``done(summed_kl, tokens)`` is called after each sequence, and a run resumes from what it
    was given (``summed``, ``tokens``) with the sequences that remain."""
    head_dim = factors.meta["head_dim"]
    layers = sorted(factors.layers)
    full = {layer: [head_dim] * len(policy.tiers) for layer in layers}
    reference = policy.model_copy(update={"layer_key_ranks": full})
    truncated = [
        reference.model_copy(update={"layer_key_ranks": {k: v for k, v in full.items() if k != layer}})
        for layer in layers
    ]
    enable_tale(model)
    summed = {layer: (summed or {}).get(layer, 0.0) for layer in layers}
    for ids in sequences:
        prefix = ids.shape[1] - continuation
        if prefix < 1:
            raise ValueError(
                f"a sensitivity sequence has {ids.shape[1]} tokens, at most the continuation of {continuation}; "
                "to resolve, calibrate with a longer --max-length"
            )
        shared, targets = SharedPrefill(model, ids[:, :prefix]), ids[:, prefix:]
        ref = continuation_logits(
            model, ids, TaleCache(factors, reference, model.config), prefix, chunk, shared
        )
        for layer, p in zip(layers, truncated, strict=True):
            logits = continuation_logits(
                model, ids, TaleCache(factors, p, model.config), prefix, chunk, shared
            )
            summed[layer] += compare(logits, ref, targets)["kl"]
        tokens += ids.shape[1] - prefix
        if done:
            done(summed, tokens)
    return measurement(policy, summed, tokens)


def measurement(policy: Policy, summed: dict[int, float], tokens: int) -> dict:
    """The stored form of a sensitivity measurement (JSON: layer indices as strings; a KL that rounding made
    negative counts as zero)."""
    return {
        "kl": {str(layer): max(value, 0.0) / max(tokens, 1) for layer, value in summed.items()},  # rounding
        "ranks": [t.k_rank for t in policy.tiers],
        "fractions": [t.fraction for t in policy.tiers],
    }


def allocate_key_ranks(policy: Policy, factors: Factors, sensitivity: dict, step: int = STEP) -> Policy:
    """``policy`` with ``layer_key_ranks`` moved by ``sensitivity`` (module docstring), at no more key
    coefficients a token than the uniform policy."""
    head_dim = factors.meta["head_dim"]
    check_measurement(sensitivity, head_dim)
    scored = policy.uses_scored_keys
    fractions = [t.fraction for t in policy.tiers]
    base = [t.k_rank for t in policy.tiers]
    cut = [r < head_dim for r in base]
    if not any(cut) or not any(sensitivity["kl"].values()):
        return policy
    lowest = min(r for r, c in zip(base, cut, strict=True) if c)

    def ranks(offset: int) -> list[int]:
        return [min(head_dim, max(step, r + offset)) if c else r for r, c in zip(base, cut, strict=True)]

    def coefficients(offset: int) -> float:
        return sum(f * r for f, r in zip(fractions, ranks(offset), strict=True))

    def dropped(tail: list[float], tier_ranks: list[int], tier_fractions: list[float]) -> float:
        return sum(f * tail[r] for f, r in zip(tier_fractions, tier_ranks, strict=True))

    costs: dict[int, Callable[[int], float]] = {}
    for layer, lf in factors.layers.items():
        tail = lf.key_energy(scored).sum(0).flip(0).cumsum(0).flip(0).tolist() + [0.0]  # energy beyond rank r
        measured = dropped(tail, sensitivity["ranks"], sensitivity["fractions"])
        weight = sensitivity["kl"].get(str(layer), 0.0) / measured if measured > 0 else 0.0
        costs[layer] = lambda o, t=tail, w=weight: w * dropped(t, ranks(o), fractions)

    offsets = dict.fromkeys(costs, step - lowest)
    budget = len(costs) * coefficients(0) - sum(coefficients(o) for o in offsets.values())
    while True:
        best, best_gain = None, -1.0  # every step that fits is taken: the uniform policy's memory is spent
        for layer, o in offsets.items():
            extra = coefficients(o + step) - coefficients(o)
            if extra <= 0 or extra > budget + 1e-9:
                continue
            gain = (costs[layer](o) - costs[layer](o + step)) / extra
            if gain > best_gain:
                best, best_gain, best_extra = layer, gain, extra
        if best is None:
            break
        budget -= best_extra
        offsets[best] += step
    layer_ranks = {layer: ranks(o) for layer, o in sorted(offsets.items()) if ranks(o) != base}
    return Policy.model_validate({**policy.model_dump(), "layer_key_ranks": layer_ranks})


def check_measurement(sensitivity, head_dim: int) -> None:
    """Raise a one-line ValueError unless ``sensitivity`` has the stored form (it is read from a factors file)."""
    try:
        ranks, fractions, kl = sensitivity["ranks"], sensitivity["fractions"], sensitivity["kl"]
        ok = (
            len(ranks) == len(fractions) > 0
            and all(isinstance(r, int) and 0 < r <= head_dim for r in ranks)
            and all(isinstance(f, (int, float)) for f in fractions)
            and all(isinstance(v, (int, float)) and v >= 0 for v in kl.values())
        )
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(
            f"the factors' {SENSITIVITY_KEY} is not a measurement kvcompress wrote; to resolve, re-run "
            "`swiftkv kvcompress calibrate` (or calibrate with --sensitivity-samples 0)"
        )
