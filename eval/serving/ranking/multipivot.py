"""1-, 2- (Yaroslavskiy) and 3-pivot (Kushagra et al.) quicksort as argsorts, counted or compiled.

Each algorithm is written once, inside :func:`_build`, and instantiated twice: as plain Python (exact
counts of comparisons and swaps, optionally through a simulated LRU cache) and compiled with numba, for
timing and for the scheduler's per-iteration ordering (the pure-Python instantiation is for counting, far too
slow for a scheduler).  Every algorithm sorts positions by the total order (key, position), so ties are broken
by arrival order and the result equals ``np.argsort(keys, kind="stable")``.  Pivots are sampled with a small
xorshift generator kept in the stats array, so both instantiations do the same work for a seed.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

PIVOTS = (1, 2, 3)
_MASK = 0xFFFFFFFF


def _build(jit: Callable, count: bool = True, helper: Callable | None = None) -> dict[int, Callable]:
    """Define the three sorts with ``jit`` applied to them and ``helper`` (default ``jit``) to the functions
    they call (identity = pure Python).

    Each sorts ``k`` (keys) and ``ix`` (original positions) together in place, comparing (key, position)
    pairs, so scans read contiguous keys as a native value sort does.
    ``stats`` = [comparisons, swaps, xorshift state, insertion moves]; ``count=False`` leaves the counters
    alone (the timed path: no counter store per comparison).
    """
    helper = helper or jit

    @helper
    def lt(ka, ia, kb, ib, stats):  # one comparison of (key, position) pairs
        if count:
            stats[0] += 1
        return ka < kb or (ka == kb and ia < ib)

    @helper
    def swap(k, ix, i, j, stats):
        if count:
            stats[1] += 1
        k[i], k[j] = k[j], k[i]
        ix[i], ix[j] = ix[j], ix[i]

    @helper
    def pick(k, ix, slot, lo, hi, stats):  # move a uniform random element of [lo, hi] to slot (uncounted)
        x = stats[2]
        x ^= (x << 13) & _MASK
        x ^= x >> 17
        x ^= (x << 5) & _MASK
        stats[2] = x
        j = lo + x % (hi - lo + 1)
        k[slot], k[j] = k[j], k[slot]
        ix[slot], ix[j] = ix[j], ix[slot]

    @helper
    def insertion(k, ix, lo, hi, stats):
        for i in range(lo + 1, hi + 1):
            xk, xi = k[i], ix[i]
            j = i - 1
            while j >= lo and lt(xk, xi, k[j], ix[j], stats):
                k[j + 1], ix[j + 1] = k[j], ix[j]
                if count:
                    stats[3] += 1
                j -= 1
            k[j + 1], ix[j + 1] = xk, xi

    @jit
    def sort1(k, ix, cutoff, stats):
        stack = [(0, len(k) - 1)]
        while stack:
            lo, hi = stack.pop()
            if hi - lo + 1 <= cutoff:
                insertion(k, ix, lo, hi, stats)
                continue
            pick(k, ix, lo, lo, hi, stats)
            pk, pi = k[lo], ix[lo]
            i, j = lo + 1, hi
            while True:  # Hoare-style crossing scans
                while i <= j and lt(k[i], ix[i], pk, pi, stats):
                    i += 1
                while i <= j and lt(pk, pi, k[j], ix[j], stats):
                    j -= 1
                if i >= j:
                    break
                swap(k, ix, i, j, stats)
                i += 1
                j -= 1
            swap(k, ix, lo, j, stats)
            stack.append((lo, j - 1))
            stack.append((j + 1, hi))

    @jit
    def sort2(k, ix, cutoff, stats):  # Yaroslavskiy's dual-pivot partition (Java 7)
        stack = [(0, len(k) - 1)]
        while stack:
            lo, hi = stack.pop()
            if hi - lo + 1 <= cutoff:
                insertion(k, ix, lo, hi, stats)
                continue
            pick(k, ix, lo, lo, hi, stats)
            pick(k, ix, hi, lo + 1, hi, stats)
            if lt(k[hi], ix[hi], k[lo], ix[lo], stats):
                swap(k, ix, lo, hi, stats)
            pk, pi, qk, qi = k[lo], ix[lo], k[hi], ix[hi]
            l, m, g = lo + 1, lo + 1, hi - 1
            while m <= g:
                if lt(k[m], ix[m], pk, pi, stats):
                    swap(k, ix, m, l, stats)
                    l += 1
                elif not lt(k[m], ix[m], qk, qi, stats):
                    while m < g and lt(qk, qi, k[g], ix[g], stats):
                        g -= 1
                    swap(k, ix, m, g, stats)
                    g -= 1
                    if lt(k[m], ix[m], pk, pi, stats):
                        swap(k, ix, m, l, stats)
                        l += 1
                m += 1
            l -= 1
            g += 1
            swap(k, ix, lo, l, stats)
            swap(k, ix, hi, g, stats)
            stack.append((lo, l - 1))
            stack.append((l + 1, g - 1))
            stack.append((g + 1, hi))

    @jit
    def sort3(k, ix, cutoff, stats):  # Kushagra, Lopez-Ortiz, Munro, Qiao: four pointers a <= b, c <= d
        stack = [(0, len(k) - 1)]
        while stack:
            lo, hi = stack.pop()
            if hi - lo + 1 <= max(cutoff, 3):
                insertion(k, ix, lo, hi, stats)
                continue
            pick(k, ix, lo, lo, hi, stats)
            pick(k, ix, lo + 1, lo + 1, hi, stats)
            pick(k, ix, hi, lo + 2, hi, stats)
            if lt(k[lo + 1], ix[lo + 1], k[lo], ix[lo], stats):
                swap(k, ix, lo, lo + 1, stats)
            if lt(k[hi], ix[hi], k[lo + 1], ix[lo + 1], stats):
                swap(k, ix, lo + 1, hi, stats)
                if lt(k[lo + 1], ix[lo + 1], k[lo], ix[lo], stats):
                    swap(k, ix, lo, lo + 1, stats)
            pk, pi, qk, qi, rk, ri = k[lo], ix[lo], k[lo + 1], ix[lo + 1], k[hi], ix[hi]
            a, b, c, d = lo + 2, lo + 2, hi - 1, hi - 1
            while b <= c:
                while b <= c and lt(k[b], ix[b], qk, qi, stats):
                    if lt(k[b], ix[b], pk, pi, stats):
                        swap(k, ix, a, b, stats)
                        a += 1
                    b += 1
                while b <= c and lt(qk, qi, k[c], ix[c], stats):
                    if lt(rk, ri, k[c], ix[c], stats):
                        swap(k, ix, c, d, stats)
                        d -= 1
                    c -= 1
                if b <= c:
                    if lt(rk, ri, k[b], ix[b], stats):
                        if lt(k[c], ix[c], pk, pi, stats):
                            swap(k, ix, b, a, stats)
                            swap(k, ix, a, c, stats)
                            a += 1
                        else:
                            swap(k, ix, b, c, stats)
                        swap(k, ix, c, d, stats)
                        d -= 1
                    else:
                        if lt(k[c], ix[c], pk, pi, stats):
                            swap(k, ix, b, a, stats)
                            swap(k, ix, a, c, stats)
                            a += 1
                        else:
                            swap(k, ix, b, c, stats)
                    b += 1
                    c -= 1
            a -= 1
            b -= 1
            d += 1
            swap(k, ix, lo + 1, a, stats)
            swap(k, ix, a, b, stats)
            a -= 1
            swap(k, ix, lo, a, stats)
            swap(k, ix, hi, d, stats)
            stack.append((lo, a - 1))
            stack.append((a + 1, b - 1))
            stack.append((b + 1, d - 1))
            stack.append((d + 1, hi))

    return {1: sort1, 2: sort2, 3: sort3}


_PURE = _build(lambda f: f)


@functools.cache
def _compiled() -> dict[int, Callable]:
    """The numba instantiation, compiled on first use and cached on disk by numba.

    The helpers are plain jitable functions, not dispatchers: numba keys a cached closure by its cell contents,
    and a dispatcher pickles with a new id in every process (a recompile and a new cache file every run)."""
    import numba
    from numba.extending import register_jitable

    return _build(numba.njit(cache=True), count=False, helper=register_jitable)


@dataclass
class SortStats:
    """Counted work of one pure-Python sort; ``cache_misses`` only when a cache was simulated.

    ``swaps`` are exchanges in partitioning and pivot sorting (what the literature counts); insertion
    sort's element shifts are ``moves``.
    """

    comparisons: int
    swaps: int
    moves: int
    cache_misses: int | None = None


class LRUTrace(list):
    """A list that feeds every element access through an LRU cache of ``blocks`` blocks of ``block`` items."""

    def __init__(self, items: Sequence[int], block: int, blocks: int):
        super().__init__(items)
        self.block, self.blocks, self.misses = block, blocks, 0
        self._lru: OrderedDict[int, None] = OrderedDict()

    def _touch(self, i: int) -> None:
        blk = i // self.block
        if blk in self._lru:
            self._lru.move_to_end(blk)
            return
        self.misses += 1
        self._lru[blk] = None
        if len(self._lru) > self.blocks:
            self._lru.popitem(last=False)

    def __getitem__(self, i):
        self._touch(i)
        return super().__getitem__(i)

    def __setitem__(self, i, v):
        self._touch(i)
        super().__setitem__(i, v)


def _check(pivots: int, cutoff: int) -> None:
    if pivots not in PIVOTS:
        raise ValueError(f"pivots={pivots} is not supported; to resolve, choose one of {PIVOTS}")
    if cutoff < 1:
        raise ValueError(f"cutoff={cutoff} must be >= 1; to resolve, pass e.g. 16")


def argsort(
    keys: Sequence[float] | np.ndarray, pivots: int = 3, cutoff: int = 16, seed: int = 1
) -> np.ndarray:
    """Positions that sort ``keys`` ascending, ties by position: the compiled multi-pivot sort."""
    _check(pivots, cutoff)
    k = np.array(keys, dtype=np.float64)  # a copy: it is sorted along
    stats = np.array([0, 0, seed & _MASK or 1, 0], dtype=np.int64)
    ix = np.arange(len(k), dtype=np.int64)
    _compiled()[pivots](k, ix, cutoff, stats)
    return ix


def count_costs(
    keys: Sequence[float] | np.ndarray,
    pivots: int = 3,
    cutoff: int = 16,
    seed: int = 1,
    cache: tuple[int, int] | None = None,
) -> tuple[np.ndarray, SortStats]:
    """Pure-Python argsort with exact counts; ``cache=(block, blocks)`` also runs the keys through an LRU cache."""
    _check(pivots, cutoff)
    values = np.asarray(keys, dtype=np.float64).tolist()
    k = LRUTrace(values, *cache) if cache else values
    ix = list(range(len(values)))
    stats = [0, 0, seed & _MASK or 1, 0]
    _PURE[pivots](k, ix, cutoff, stats)
    misses = k.misses if cache else None
    return np.asarray(ix, dtype=np.int64), SortStats(stats[0], stats[1], stats[3], misses)


# Expected partitioning comparisons per element and pivot-sorting comparisons (Wild & Nebel; Kushagra et al.)
_PARTITION = {1: (1.0, 0.0), 2: (19 / 12, 1.0), 3: (2.0, 3.0)}
# Leading constants per n ln n from the literature: comparisons, swaps, cache misses (x (n+1)/B, ln(n/M))
LITERATURE = {1: (2.0, 1 / 3, 2.0), 2: (1.9, 0.6, 1.6), 3: (24 / 13, 8 / 13, 18 / 13)}


def expected_comparisons(n: int, pivots: int = 3, cutoff: int = 16) -> float:
    """Expected comparisons on a random permutation from the cost recurrence (random pivots, insertion cutoff).

    C_m = P_m + (k+1) * sum_j Pr[a part has j elements] C_j, with Pr = binom(m-1-j, k-1) / binom(m, k),
    P_m = alpha_k (m - k) + sorting the k pivots, and C_m = m(m+3)/4 - H_m for m <= cutoff (insertion sort).
    The sum is kept as prefix sums of C_j, j C_j, j^2 C_j, so the whole table costs O(n).
    """
    _check(pivots, cutoff)
    k = pivots
    cut = max(cutoff, 3) if k == 3 else cutoff
    alpha, sort_k = _PARTITION[k]
    c = [0.0] * (n + 1)
    s0 = s1 = s2 = 0.0  # prefix sums over j < m - k + 1 of C_j, j C_j, j^2 C_j
    harmonic = 0.0
    added = 0
    for m in range(1, n + 1):
        harmonic += 1.0 / m
        if m <= cut:
            c[m] = m * (m + 3) / 4 - harmonic
            continue
        while added <= m - k:  # parts have at most m - k elements
            s0, s1, s2 = s0 + c[added], s1 + added * c[added], s2 + added * added * c[added]
            added += 1
        t = m - 1  # binom(t - j, k - 1) as a polynomial in j
        if k == 1:
            weighted = s0
        elif k == 2:
            weighted = t * s0 - s1
        else:
            weighted = ((t * t - t) * s0 - (2 * t - 1) * s1 + s2) / 2
        c[m] = alpha * (m - k) + sort_k + (k + 1) * weighted / math.comb(m, k)
    return c[n]
