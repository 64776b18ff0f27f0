"""The numba-compiled ArrayTree against the pure-Python SuffixTree: same trie, same sibling order, same drafts
(token for token, probability and score) under interleaved appends, removals, eviction and artifact round trips."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from helpers.chat import word_tokenizer
from helpers.suffix import brute_counts, expand

from eval.serving.suffix.artifact import load_cache, save_cache, tree_to_arrays
from eval.serving.suffix.cache import SpecConfig, SuffixCache
from eval.serving.suffix.tree import SuffixTree

pytest.importorskip("numba", reason="the compiled tree needs numba (the `fast` extra)")
from eval.serving.suffix import fast  # noqa: E402
from eval.serving.suffix.fast import ArrayTree  # noqa: E402


def structure(tree) -> list[tuple[int, int, int, int]]:
    """Breadth-first (parent, count, length, first token) rows in sibling order: the trie and its tie order."""
    a = tree_to_arrays(tree, sorted(tree.seqs))
    rows = []
    for i in range(1, len(a["parent"])):
        first = a["tokens"][a["offsets"][a["ref"][i]] + a["end"][i] - a["length"][i]]
        rows.append((int(a["parent"][i]), int(a["count"][i]), int(a["length"][i]), int(first)))
    return rows


def same_draft(a, b) -> None:
    assert (a.tokens, a.parents, a.probs, a.score, a.match_len) == (
        b.tokens,
        b.parents,
        b.probs,
        b.score,
        b.match_len,
    )


@pytest.mark.parametrize("seed", range(150))
def test_same_tree_and_drafts_under_interleaved_appends_and_removal(seed):
    rng = random.Random(seed)
    depth, vocab = rng.randint(1, 10), rng.randint(1, 6)
    seqs = {k: [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for k in range(rng.randint(1, 7))}
    py, fast = SuffixTree(depth), ArrayTree(depth)
    order = [k for k, s in seqs.items() for _ in s]
    rng.shuffle(order)
    pos: Counter = Counter()

    def check_drafts():
        for _ in range(4):
            src = rng.choice(list(seqs.values()))
            i = rng.randrange(len(src))
            ctx = src[max(0, i - rng.randint(0, depth)) : i + 1] + (
                [rng.randrange(vocab)] if rng.random() < 0.3 else []
            )
            kw = dict(
                max_spec=rng.randint(1, 10),
                factor=rng.choice([0.5, 1.0, 2.0]),
                offset=rng.choice([0.0, 1.0]),
                min_token_prob=rng.choice([0.0, 0.1, 0.3]),
                tree=rng.random() < 0.5,
            )
            same_draft(py.speculate(ctx, **kw), fast.speculate(ctx, **kw))
            k = rng.choice(list(seqs))
            if py.is_open(k):
                tail = seqs[k][: pos[k]][-rng.randint(1, depth + 2) :]
                same_draft(py.speculate_open(k, tail, True, **kw), fast.speculate_open(k, tail, True, **kw))

    for step, k in enumerate(order):
        for t in (py, fast):
            t.append(k, seqs[k][pos[k]])
        pos[k] += 1
        if step % 7 == 0:
            assert structure(py) == structure(fast)
            check_drafts()
        if pos[k] == len(seqs[k]) and rng.random() < 0.5:
            py.close(k)
            fast.close(k)
    assert structure(py) == structure(fast)
    assert expand(fast) == brute_counts(seqs.values(), depth)
    for k in rng.sample(sorted(seqs), rng.randint(0, len(seqs))):
        py.remove(k)
        fast.remove(k)
        del seqs[k]
        assert structure(py) == structure(fast)
        assert expand(fast) == brute_counts(seqs.values(), depth)
        if seqs:
            check_drafts()
    assert fast.root_count == py.root.count == sum(map(len, seqs.values()))


def drive(cache: SuffixCache, seed: int, cfg: SpecConfig):
    """Requests with copy-heavy prompts and outputs through one cache; yields its draft at every step."""
    rng = random.Random(seed)
    vocab = rng.randint(2, 12)
    motif = [rng.randrange(vocab) for _ in range(6)]

    def tokens(n: int, start: int) -> list[int]:
        return [rng.randrange(vocab) if rng.random() < 0.3 else motif[(start + i) % 6] for i in range(n)]

    for r in range(14):
        ctx = tokens(rng.randint(1, 30), 0)
        cache.start_request(r, ctx)
        for _ in range(rng.randint(1, 40)):
            yield cache.speculate(r, ctx)
            new = tokens(rng.randint(1, 4), len(ctx))
            cache.append(r, new)
            ctx = ctx + new
        cache.finish_request(r)
        if rng.random() < 0.3:
            cache.add_response(tokens(rng.randint(1, 50), 0))


@pytest.mark.parametrize("mode", ["path", "tree"])
@pytest.mark.parametrize("seed", range(60))
def test_caches_give_identical_drafts(seed, mode):
    rng = random.Random(1000 + seed)
    cfg = SpecConfig(
        max_depth=rng.randint(2, 20),
        max_spec=rng.randint(1, 12),
        min_token_prob=rng.choice([0.0, 0.1, 0.3]),
        max_cached_requests=rng.randint(0, 6),
        mode=mode,
        factor=rng.choice([0.5, 1.0, 2.0]),
        offset=rng.choice([0.0, 1.0]),
    )
    py, fast = SuffixCache(cfg, compiled=False), SuffixCache(cfg, compiled=True)
    assert isinstance(fast.global_tree, ArrayTree) and isinstance(py.global_tree, SuffixTree)
    for a, b in zip(drive(py, seed, cfg), drive(fast, seed, cfg), strict=True):
        same_draft(a, b)
    assert structure(py.global_tree) == structure(fast.global_tree)


@pytest.mark.parametrize("saved_compiled", [False, True])
def test_artifact_is_read_by_both_kinds(tmp_path, saved_compiled):
    cfg = SpecConfig(max_depth=8, max_cached_requests=5, min_token_prob=0.0)
    rng = random.Random(3)
    source = SuffixCache(cfg, compiled=saved_compiled)
    for _ in range(9):  # past the limit: evicted responses are re-pointed away from and not saved
        source.add_response([rng.randrange(3, 9) for _ in range(rng.randint(1, 40))])
    tok = word_tokenizer()
    save_cache(source, tmp_path / "c", tok)
    py, fast = load_cache(tmp_path / "c", tok, compiled=False), load_cache(tmp_path / "c", tok, compiled=True)
    assert isinstance(fast.global_tree, ArrayTree) and isinstance(py.global_tree, SuffixTree)
    assert structure(py.global_tree) == structure(fast.global_tree) == structure(source.global_tree)
    for a, b in zip(drive(py, 5, cfg), drive(fast, 5, cfg), strict=True):  # then grow and evict alike
        same_draft(a, b)
    assert structure(py.global_tree) == structure(fast.global_tree)


def test_evicted_tokens_are_reclaimed_and_memory_stays_bounded():
    """Thousands of responses through a 3-response cache: the token pool, tables and hash tables stop growing
    (freed rows and evicted segments are reused), and the tree still equals the object tree's."""
    cfg = SpecConfig(max_depth=16, max_cached_requests=3)
    rng = random.Random(0)
    py, fast = SuffixCache(cfg, compiled=False), SuffixCache(cfg, compiled=True)
    sizes = []
    for i in range(3000):
        resp = [rng.randrange(50) for _ in range(rng.randint(1, 200))]
        py.add_response(resp)
        fast.add_response(resp)
        if i in (500, 2999):
            sizes.append(fast.global_tree.nbytes())
    assert sizes[1] <= 1.25 * sizes[0]
    tree = fast.global_tree
    assert len(tree.seqtab) <= 16 and len(tree.tokens) <= 8 * 200 * 3 and tree.meta[1] <= 2 * 200 * 3 * 16
    arrays = tree_to_arrays(tree, sorted(tree.seqs))  # nothing refers to a removed sequence's reused slot
    assert (arrays["ref"][1:] >= 0).all() and (arrays["endpoint_seq"] >= 0).all()
    assert expand(tree) == expand(py.global_tree)
    assert structure(tree) == structure(py.global_tree)


def test_closed_sequence_and_bad_depth_are_refused():
    tree = ArrayTree(4)
    tree.add(0, [1, 2])
    with pytest.raises(ValueError, match="closed"):
        tree.append(0, 3)
    with pytest.raises(ValueError, match="max_depth"):
        ArrayTree(0)


def node_table(tree: ArrayTree) -> np.ndarray:
    """The rows in use without the endpoint column: equal when two trees made the same updates in the same order."""
    return tree.nodes[: tree.meta[fast.M_NHWM], : fast.EPH]


@pytest.mark.parametrize("seed", range(40))
def test_request_tree_has_the_full_trees_nodes_and_drafts_and_is_reusable(seed):
    """A request's tree (no endpoints), fresh, restarted after an earlier request (its slot kept, its hash
    tables emptied by a generation step) or cleared, makes the same node updates as a tree with endpoints and
    gives the object tree's drafts."""
    rng = random.Random(seed)
    depth, vocab = rng.randint(1, 12), rng.randint(1, 6)
    reused = ArrayTree.for_request(depth)
    reused.restart([rng.randrange(vocab) for _ in range(rng.randint(0, 300))])
    for request in range(3):  # requests through the same reused tree: restarted, restarted, cleared
        full, py, fresh = ArrayTree(depth), SuffixTree(depth), ArrayTree.for_request(depth)
        seq: list[int] = []
        if request == 2:
            reused.clear()
        for step in range(rng.randint(1, 12)):
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
            seq += new
            for t in (full, py, fresh):
                t.extend(0, new)
            reused.restart(new) if step == 0 and request < 2 else reused.extend(0, new)
            assert np.array_equal(node_table(full), node_table(fresh))
            assert np.array_equal(node_table(full), node_table(reused))
            ctx = seq[-rng.randint(1, depth + 2) :]
            kw = dict(
                max_spec=rng.randint(1, 10), min_token_prob=rng.choice([0.0, 0.1]), tree=rng.random() < 0.5
            )
            for t in (fresh, reused):
                same_draft(py.speculate_open(0, ctx, False, **kw), t.speculate_open(0, ctx, False, **kw))
        assert reused.root_count == len(seq) and list(reused.seqs[0]) == seq
    with pytest.raises(ValueError, match="endpoints"):
        fresh.remove(0)
    with pytest.raises(ValueError, match="endpoints"):
        tree_to_arrays(fresh, [0])


def test_hash_generation_wraps_around():
    """A tree emptied at the last generation rewrites its hash rows and counts again from 0: it then grows into
    the same trie as a fresh tree."""
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(80)] for _ in range(2)]
    tree = ArrayTree.for_request(6)
    tree.restart(seqs[0])
    tree.chash[-1, 0] = 0x7FFFFFFE  # as if emptied that often (the rows written are of an earlier generation)
    tree.restart(seqs[0])  # rows of the last generation
    assert tree.chash[-1, 0] == 0x7FFFFFFF
    tree.restart(seqs[1])
    assert tree.chash[-1, 0] == 0
    fresh = ArrayTree.for_request(6)
    fresh.extend(0, seqs[1])
    assert np.array_equal(node_table(tree), node_table(fresh))
    py = SuffixTree(6)
    py.extend(0, seqs[1])
    for k in range(1, 7):
        same_draft(py.speculate(seqs[1][-k:], 8, tree=True), tree.speculate(seqs[1][-k:], 8, tree=True))


def test_tree_draft_with_more_candidates_than_the_heap_holds():
    """A node with 200 children and no probability floor: the draft's heap outgrows its first size, and the
    speculation is retried with a larger one (same draft as the object tree)."""
    seq = [t for k in range(200) for t in (0, k + 1)]
    py, tree = SuffixTree(4), ArrayTree(4)
    py.extend(0, seq)
    tree.extend(0, seq)
    assert len(tree._heap_p) < 200
    kw = dict(max_spec=64, factor=64.0, min_token_prob=0.0, tree=True)
    same_draft(py.speculate([0, 0], **kw), tree.speculate([0, 0], **kw))
    assert len(tree._heap_p) >= 200
