"""What a suffix tree speculates (:class:`Draft`) and the arithmetic of choosing one: float32 rounding and the
order in which match lengths are tried (the tree's kernels and the cache share these; nothing here needs numba).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np


def f32(x: float) -> float:
    """``x`` rounded to float32 (the reference's arithmetic; exact for one +, -, * or / of float32 values)."""
    return float(np.float32(x))


@dataclass
class Draft:
    """Speculated tokens as a tree: ``parents[i]`` is the index of token i's parent, -1 for the root.

    A path draft has ``parents == [-1, 0, 1, ...]``.  ``probs[i]`` is the estimated probability of reaching
    token i; ``score`` (their float32 sum) is the expected number of accepted tokens used to pick drafts.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0
    score: float = 0.0


@functools.lru_cache(maxsize=256)
def search_order(max_depth: int, max_spec: int, factor: float, offset: float) -> np.ndarray:
    """(upper bound, match length, budget) rows for match lengths 1 .. max_depth, most promising first (longer
    on ties), as the (n, 3) int64 array the speculation kernel walks.

    Budget per match length p: min(max_spec, int(factor * p + offset)) in float32; a draft can exceed neither
    its budget nor the tree's depth, so min(budget, max_depth - p) bounds its score.  The kernel skips lengths
    beyond the positions it found (a filtered sorted list stays sorted) and stops once no remaining length can
    beat the best, which gives the result of trying every length in turn.
    """
    factor, offset = f32(factor), f32(offset)
    rows = []
    for p in range(1, max_depth + 1):
        budget = max(0, min(max_spec, int(f32(f32(p * factor) + offset) + 1e-6)))
        rows.append((min(budget, max(max_depth - p, 0)), p, budget))
    out = np.array(sorted(rows, reverse=True), np.int64).reshape(-1, 3)
    out.flags.writeable = False  # shared by every call with these settings
    return out
