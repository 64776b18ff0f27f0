"""Suffix trees seen as tries (so the object tree and the numba-compiled one compare the same way), brute-force
substring counts, and a suffix cache filled past its request limit."""

from __future__ import annotations

import random
from collections import Counter

from eval.serving.suffix.artifact import tree_to_arrays
from eval.serving.suffix.cache import SpecConfig, SuffixCache


def brute_counts(seqs, depth: int) -> dict[tuple[int, ...], int]:
    """Occurrences of every substring of length <= depth (= the uncompressed suffix trie's counts)."""
    counts: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i : i + n])] += 1
    return dict(counts)


def expand(tree) -> dict[tuple[int, ...], int]:
    """The compressed tree (object or compiled) as a trie: path -> count, one entry per token position inside
    each node, read from its artifact arrays (so both kinds are seen the same way)."""
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


def filled_cache(seed: int = 0, limit: int = 6, compiled: bool | None = None) -> SuffixCache:
    rng = random.Random(seed)
    cache = SuffixCache(
        SpecConfig(max_depth=6, max_cached_requests=limit, min_token_prob=0.0), compiled=compiled
    )
    for _ in range(10):  # more than the limit: nodes that pointed into evicted responses are re-pointed
        cache.add_response([rng.randrange(3, 9) for _ in range(rng.randint(1, 30))])
    return cache
