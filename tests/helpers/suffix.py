"""Suffix trees seen as tries (read from their artifact arrays), brute-force substring counts, a suffix cache
filled past its request limit, and the tree's numba kernels compiled once per machine."""

from __future__ import annotations

import fcntl
import functools
import random
import tempfile
from collections import Counter
from pathlib import Path

from eval.serving.suffix.artifact import tree_from_arrays, tree_to_arrays
from eval.serving.suffix.cache import SpecConfig, SuffixCache

# held while a process compiles the kernels (or loads them from numba's on-disk cache)
KERNELS_LOCK = Path(tempfile.gettempdir()) / "swiftkv-suffix-kernels.lock"


@functools.cache
def compiled_kernels() -> None:
    """Compile (or load) every kernel of the suffix tree, one process at a time: the first pytest-xdist worker
    compiles them (about a minute and a half) and numba writes them to its on-disk cache (``cache=True``); the
    other workers wait on the lock and then load them from that cache in seconds instead of compiling the same
    kernels at the same time.  Each call below runs one kernel for the first time, with the argument types the
    tree always passes."""
    from eval.serving.suffix.tree import SuffixTree

    with open(KERNELS_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rng = random.Random(0)
        tree = SuffixTree(4)
        tree.extend(0, [rng.randrange(50) for _ in range(300)])  # k_extend; the tables grow: h_rehash
        tree.speculate([1, 2], 4)  # k_speculate
        tree.speculate([1, 2], 4, tree=True)
        tree_from_arrays(tree_to_arrays(tree, [0]))  # k_to_arrays, k_from_arrays
        tree.remove(0)  # k_remove
        tree.clear()  # k_clear


def brute_counts(seqs, depth: int) -> dict[tuple[int, ...], int]:
    """Occurrences of every substring of length <= depth (= the uncompressed suffix trie's counts)."""
    counts: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i : i + n])] += 1
    return dict(counts)


def expand(tree) -> dict[tuple[int, ...], int]:
    """The compressed tree as a trie: path -> count, one entry per token position inside each node, read from
    its artifact arrays."""
    a = tree_to_arrays(tree, sorted(tree.seqs))
    out: dict[tuple[int, ...], int] = {}
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(a["parent"])):
        start = a["offsets"][a["ref"][i]] + a["end"][i] - a["length"][i]
        p = paths[a["parent"][i]] + tuple(a["tokens"][start : start + a["length"][i]].tolist())
        for o in range(a["length"][i]):
            out[p[: len(p) - a["length"][i] + o + 1]] = int(a["count"][i])
        paths.append(p)
    return out


def structure(tree) -> list[tuple[int, int, int, int]]:
    """Breadth-first (parent, count, length, first token) rows in sibling order: the trie and its tie order."""
    a = tree_to_arrays(tree, sorted(tree.seqs))
    rows = []
    for i in range(1, len(a["parent"])):
        first = a["tokens"][a["offsets"][a["ref"][i]] + a["end"][i] - a["length"][i]]
        rows.append((int(a["parent"][i]), int(a["count"][i]), int(a["length"][i]), int(first)))
    return rows


def filled_cache(seed: int = 0, limit: int = 6) -> SuffixCache:
    compiled_kernels()
    rng = random.Random(seed)
    cache = SuffixCache(SpecConfig(max_depth=6, max_cached_requests=limit, min_token_prob=0.0))
    for _ in range(10):  # more than the limit: nodes that pointed into evicted responses are re-pointed
        cache.add_response([rng.randrange(3, 9) for _ in range(rng.randint(1, 30))])
    return cache
