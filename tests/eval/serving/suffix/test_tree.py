"""Suffix tree and cache against brute-force references on random token sequences (seeded property tests); the
reference's tie order and float32 arithmetic: test_arctic_reference.py."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from helpers.suffix import brute_counts, expand

from eval.serving.suffix.artifact import tree_to_arrays
from eval.serving.suffix.cache import SpecConfig, SuffixCache
from eval.serving.suffix.tree import SuffixTree


def check_canonical(tree: SuffixTree) -> None:
    """Compression is maximal: no non-root node has a single child with the same count; siblings are in
    decreasing count."""
    a = tree_to_arrays(tree, sorted(tree.seqs))
    children: dict[int, list[int]] = {}
    for i in range(1, len(a["parent"])):
        children.setdefault(int(a["parent"][i]), []).append(int(a["count"][i]))
    for node, counts in children.items():
        assert a["count"][node] >= sum(counts)
        assert counts == sorted(counts, reverse=True)
        if node != 0 and len(counts) == 1:
            assert counts[0] < a["count"][node]


def random_case(seed: int):
    rng = random.Random(seed)
    depth, vocab = rng.randint(1, 8), rng.randint(1, 5)
    seqs = {k: [rng.randrange(vocab) for _ in range(rng.randint(1, 25))] for k in range(rng.randint(1, 6))}
    return rng, depth, seqs


@pytest.mark.parametrize("seed", range(0, 400, 1))
def test_tree_matches_brute_force_under_interleaved_appends_and_removal(seed):
    rng, depth, seqs = random_case(seed)
    tree = SuffixTree(depth)
    order = [k for k, s in seqs.items() for _ in s]
    rng.shuffle(order)  # sequences grow concurrently, as live requests do
    pos: Counter = Counter()
    for k in order:
        tree.append(k, seqs[k][pos[k]])
        pos[k] += 1
    assert expand(tree) == brute_counts(seqs.values(), depth)
    for k in rng.sample(sorted(seqs), rng.randint(0, len(seqs))):
        tree.remove(k)
        del seqs[k]
        assert expand(tree) == brute_counts(seqs.values(), depth)
        check_canonical(tree)
    assert tree.root_count == sum(map(len, seqs.values()))
    assert max(map(len, expand(tree)), default=0) <= depth


def brute_continuations(seqs, depth, context):
    """P(w | context) for every continuation w, from brute-force counts (root count = all positions)."""
    counts = brute_counts(seqs, depth)
    total = sum(map(len, seqs))
    ctx = tuple(context)
    out = {}
    frontier = [((), 1.0)]
    while frontier:
        w, p = frontier.pop()
        parent = counts.get(ctx + w, 0) if ctx + w else total
        for key, c in counts.items():
            if len(key) == len(ctx + w) + 1 and key[: len(ctx + w)] == ctx + w:
                out[w + key[-1:]] = p * c / parent
                frontier.append((w + key[-1:], p * c / parent))
    return out


@pytest.mark.parametrize("seed", range(150))
def test_drafts_equal_brute_force_enumeration(seed):
    rng, depth, seqs = random_case(seed)
    depth = max(depth, 3)
    tree = SuffixTree(depth)
    for k, s in seqs.items():
        tree.add(k, s)
    src = rng.choice(list(seqs.values()))
    i = rng.randrange(len(src))
    context = src[i : i + rng.randint(1, 2)]
    budget, min_prob = rng.randint(1, 6), rng.choice([0.0, 0.1, 0.3])
    # a token no sequence holds in front: the tails of `context` are the match candidates, each with `budget`
    kw = dict(max_spec=budget, factor=float(budget), min_token_prob=min_prob)

    path = tree.speculate([vocab_size(seqs), *context], tree=False, **kw)
    assert 1 <= path.match_len <= len(context)
    probs = brute_continuations(list(seqs.values()), depth, context[-path.match_len :])
    w = ()
    for tok, p in zip(path.tokens, path.probs, strict=True):  # each step takes a most probable next token
        options = {k[-1]: q for k, q in probs.items() if len(k) == len(w) + 1 and k[:-1] == w}
        assert p == pytest.approx(options[tok], rel=1e-6) and p >= min_prob * (1 - 1e-6)
        assert options[tok] == pytest.approx(max(options.values()), rel=1e-6)
        w += (tok,)
    options = [q for k, q in probs.items() if len(k) == len(w) + 1 and k[:-1] == w]
    assert len(path.tokens) == budget or not options or max(options) < min_prob * (1 + 1e-6)
    assert path.score == pytest.approx(sum(path.probs), rel=1e-6)
    # ties between equally frequent children follow the reference's sibling order (test_arctic_reference.py)

    tree_draft = tree.speculate([vocab_size(seqs), *context], tree=True, **kw)
    assert 1 <= tree_draft.match_len <= len(context)
    probs = brute_continuations(list(seqs.values()), depth, context[-tree_draft.match_len :])
    paths = []
    for i, (tok, parent) in enumerate(zip(tree_draft.tokens, tree_draft.parents, strict=True)):
        assert parent < i
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
        assert tree_draft.probs[i] == pytest.approx(probs[paths[i]], rel=1e-6)
    assert len(set(paths)) == len(paths)
    eligible = sorted((p for p in probs.values() if p >= min_prob), reverse=True)
    # best-first = the top-`budget` continuations by probability (ancestors are never less probable)
    assert sorted(tree_draft.probs, reverse=True) == pytest.approx(eligible[:budget], rel=1e-6)


def vocab_size(seqs) -> int:
    return max(max(s) for s in seqs.values()) + 1


def test_budget_rule_and_best_match_length():
    tree = SuffixTree(16)
    tree.add(0, [9, 1, 2, 3, 4, 5, 6, 7, 8])
    for p, cfg in [
        (1, dict(factor=1.0, offset=0.0)),
        (3, dict(factor=1.0, offset=0.0)),
        (2, dict(factor=2.0, offset=1.0)),
    ]:
        draft = tree.speculate(
            [0, 9, 1, 2][-p - 1 :] if p < 3 else [0, 9, 1, 2], max_spec=100, min_token_prob=0.0, **cfg
        )
        budget = int(cfg["factor"] * draft.match_len + cfg["offset"])
        assert draft.tokens == [3, 4, 5, 6, 7, 8][:budget]
    # max_spec caps the budget; the longest match wins when scores tie; match lengths < len(context)
    draft = tree.speculate([9, 1, 2], max_spec=2, min_token_prob=0.0)
    assert draft.tokens == [3, 4] and draft.match_len == 2
    draft = tree.speculate([0, 9, 1, 2], max_spec=2, min_token_prob=0.0)
    assert draft.tokens == [3, 4] and draft.match_len == 3


def test_cache_fifo_eviction_and_best_of_two_trees():
    cache = SuffixCache(SpecConfig(max_depth=8, max_cached_requests=2, min_token_prob=0.0))
    for resp in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        cache.add_response(resp)
    assert cache.num_responses == 2
    reference = SuffixTree(8)
    reference.add(0, [4, 5, 6])
    reference.add(1, [7, 8, 9])
    assert expand(cache.global_tree) == expand(reference)  # [1, 2, 3] evicted, oldest first
    assert set(cache.global_tree.seqs) == {1, 2}
    cache.start_request(0, [4, 5, 0] * 3)
    # starting the request evicted [4, 5, 6] (the live response takes a slot)
    assert cache.num_responses == 2
    assert cache.speculate(0, [1, 7]).tokens == [8]  # only the global tree knows 7 -> 8
    cache.append(0, [4, 5])
    # request tree: 4 5 -> 0 4 with p = 3/4 each (score 1.5); the global tree holds only the live "4 5"
    assert cache.speculate(0, [0, 4, 5]).tokens == [0, 4]
    assert cache.speculate(0, [9, 7, 8]).tokens == [9]  # 7 8 -> 9 from the global tree
    cache.finish_request(0)
    assert cache.num_responses == 2


def test_closed_sequence_and_bad_depth_are_refused():
    tree = SuffixTree(4)
    tree.add(0, [1, 2])
    with pytest.raises(ValueError, match="closed"):
        tree.append(0, 3)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0)
    with pytest.raises(ValueError, match="max_spec"):
        SpecConfig(max_spec=0)
