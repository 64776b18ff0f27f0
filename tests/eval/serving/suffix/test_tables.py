"""The tree's tables and kernels: positions from active nodes equal walks from the root, freed rows and evicted
segments are reused, a request's tree (no endpoints, restarted, cleared) makes a full tree's node updates, the
hash tables' generation wraps around, a tree draft's heap grows (drafts against the C++ reference:
test_arctic_reference.py; against brute force: test_tree.py)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from helpers.suffix import brute_counts, expand, structure

from eval.serving.suffix import kernels
from eval.serving.suffix.artifact import tree_from_arrays, tree_to_arrays
from eval.serving.suffix.cache import SpecConfig, SuffixCache
from eval.serving.suffix.tree import SuffixTree


def same_draft(a, b) -> None:
    assert (a.tokens, a.parents, a.probs, a.score, a.match_len) == (
        b.tokens,
        b.parents,
        b.probs,
        b.score,
        b.match_len,
    )


def random_kwargs(rng: random.Random) -> dict:
    return dict(
        max_spec=rng.randint(1, 10),
        factor=rng.choice([0.5, 1.0, 2.0]),
        offset=rng.choice([0.0, 1.0]),
        min_token_prob=rng.choice([0.0, 0.1, 0.3]),
        tree=rng.random() < 0.5,
    )


@pytest.mark.parametrize("seed", range(150))
def test_active_nodes_give_the_walks_drafts_under_interleaved_appends_closes_and_removals(seed):
    """An open sequence's tails found from its active nodes (O(1) each) draft as the same tails walked from
    the root; the tree stays the brute-force trie, and a saved and loaded copy has its nodes in the same order."""
    rng = random.Random(seed)
    depth, vocab = rng.randint(1, 10), rng.randint(1, 6)
    seqs = {k: [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for k in range(rng.randint(1, 7))}
    tree = SuffixTree(depth)
    order = [k for k, s in seqs.items() for _ in s]
    rng.shuffle(order)
    pos: Counter = Counter()

    def check_drafts():
        for _ in range(4):
            k = rng.choice(list(seqs))
            if tree.is_open(k) and pos[k]:
                tail = seqs[k][: pos[k]][-rng.randint(1, depth + 2) :]
                kw = random_kwargs(rng)
                same_draft(tree.speculate_open(k, tail, False, **kw), tree.speculate(tail, **kw))

    for step, k in enumerate(order):
        tree.append(k, seqs[k][pos[k]])
        pos[k] += 1
        if step % 7 == 0:
            check_drafts()
        if pos[k] == len(seqs[k]) and rng.random() < 0.5:
            tree.close(k)
    assert expand(tree) == brute_counts(seqs.values(), depth)
    for k in rng.sample(sorted(seqs), rng.randint(0, len(seqs))):
        tree.remove(k)
        del seqs[k]
        assert expand(tree) == brute_counts(seqs.values(), depth)
        if seqs:
            check_drafts()
    assert tree.root_count == sum(map(len, seqs.values()))
    assert structure(tree_from_arrays(tree_to_arrays(tree, sorted(seqs)))) == structure(tree)


def test_evicted_tokens_are_reclaimed_and_memory_stays_bounded():
    """Thousands of responses through a 3-response cache: the token pool, tables and hash tables stop growing
    (freed rows and evicted segments are reused), and the tree still holds exactly the last three responses."""
    cfg = SpecConfig(max_depth=16, max_cached_requests=3)
    rng = random.Random(0)
    cache = SuffixCache(cfg)
    sizes, responses = [], []
    for i in range(3000):
        responses.append([rng.randrange(50) for _ in range(rng.randint(1, 200))])
        cache.add_response(responses[-1])
        if i in (500, 2999):
            sizes.append(cache.global_tree.nbytes())
    assert sizes[1] <= 1.25 * sizes[0]
    tree = cache.global_tree
    assert len(tree.seqtab) <= 16 and len(tree.tokens) <= 8 * 200 * 3 and tree.meta[1] <= 2 * 200 * 3 * 16
    arrays = tree_to_arrays(tree, sorted(tree.seqs))  # nothing refers to a removed sequence's reused slot
    assert (arrays["ref"][1:] >= 0).all() and (arrays["endpoint_seq"] >= 0).all()
    assert expand(tree) == brute_counts(responses[-3:], 16)


def node_table(tree: SuffixTree) -> np.ndarray:
    """The rows in use without the endpoint column: equal when two trees made the same updates in the same order."""
    return tree.nodes[: tree.meta[kernels.M_NHWM], : kernels.EPH]


@pytest.mark.parametrize("seed", range(40))
def test_request_tree_has_the_full_trees_nodes_and_drafts_and_is_reusable(seed):
    """A request's tree (no endpoints), fresh, restarted after an earlier request (its slot kept, its hash
    tables emptied by a generation step) or cleared, makes the same node updates as a tree with endpoints and
    gives its drafts."""
    rng = random.Random(seed)
    depth, vocab = rng.randint(1, 12), rng.randint(1, 6)
    reused = SuffixTree.for_request(depth)
    reused.restart([rng.randrange(vocab) for _ in range(rng.randint(0, 300))])
    for request in range(3):  # requests through the same reused tree: restarted, restarted, cleared
        full, fresh = SuffixTree(depth), SuffixTree.for_request(depth)
        seq: list[int] = []
        if request == 2:
            reused.clear()
        for step in range(rng.randint(1, 12)):
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
            seq += new
            for t in (full, fresh):
                t.extend(0, new)
            reused.restart(new) if step == 0 and request < 2 else reused.extend(0, new)
            assert np.array_equal(node_table(full), node_table(fresh))
            assert np.array_equal(node_table(full), node_table(reused))
            ctx = seq[-rng.randint(1, depth + 2) :]
            kw = dict(
                max_spec=rng.randint(1, 10), min_token_prob=rng.choice([0.0, 0.1]), tree=rng.random() < 0.5
            )
            for t in (fresh, reused):
                same_draft(full.speculate_open(0, ctx, False, **kw), t.speculate_open(0, ctx, False, **kw))
        assert reused.root_count == len(seq) and list(reused.seqs[0]) == seq
        assert expand(full) == brute_counts([seq], depth)
    with pytest.raises(ValueError, match="endpoints"):
        fresh.remove(0)
    with pytest.raises(ValueError, match="endpoints"):
        tree_to_arrays(fresh, [0])


def test_hash_generation_wraps_around():
    """A tree emptied at the last generation rewrites its hash rows and counts again from 0: it then grows into
    the same trie as a fresh tree, with the same drafts."""
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(80)] for _ in range(2)]
    tree = SuffixTree.for_request(6)
    tree.restart(seqs[0])
    tree.chash[-1, 0] = 0x7FFFFFFE  # as if emptied that often (the rows written are of an earlier generation)
    tree.restart(seqs[0])  # rows of the last generation
    assert tree.chash[-1, 0] == 0x7FFFFFFF
    tree.restart(seqs[1])
    assert tree.chash[-1, 0] == 0
    fresh = SuffixTree.for_request(6)
    fresh.extend(0, seqs[1])
    assert np.array_equal(node_table(tree), node_table(fresh))
    for k in range(1, 7):
        same_draft(fresh.speculate(seqs[1][-k:], 8, tree=True), tree.speculate(seqs[1][-k:], 8, tree=True))


def test_tree_draft_with_more_candidates_than_the_heap_holds():
    """A node with 200 children and no probability floor: the draft's heap outgrows its first size, and the
    speculation is retried with a larger one (the draft of a tree whose heap was that large from the start)."""
    seq = [t for k in range(200) for t in (0, k + 1)]
    small, large = SuffixTree(4), SuffixTree(4)
    for t in (small, large):
        t.extend(0, seq)
    large._heap_p, large._heap_i = np.empty(1024), np.empty((1024, 4), np.int64)
    assert len(small._heap_p) < 200
    kw = dict(max_spec=64, factor=64.0, min_token_prob=0.0, tree=True)
    draft = small.speculate([0, 0], **kw)
    same_draft(large.speculate([0, 0], **kw), draft)
    assert len(small._heap_p) >= 200 and len(draft.tokens) == 64
