"""Drafts equal those of the C++ reference (arctic-inference 0.3.0's SuffixDecodingCache and SuffixTree) on the
same streams.

The reference is never a dependency: build it outside the repository (docs/serving.md, "Reference C++ suffix
tree") and point ``SUFFIX_REFERENCE_PATH`` at the folder holding ``arctic_inference/``.  Without it these tests
skip with that reason; CI never installs it, so under CI=true they skip too.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
from helpers.ci import NO_SUFFIX_REFERENCE

from eval.serving.suffix.cache import SpecConfig, SuffixCache
from eval.serving.suffix.tree import SuffixTree


@pytest.fixture(scope="module")
def reference():
    path = os.environ.get("SUFFIX_REFERENCE_PATH")
    if not path:
        pytest.skip(NO_SUFFIX_REFERENCE)
    sys.path.insert(0, path)
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        pytest.skip(f"reference not importable from {path}: {e}")
    finally:
        sys.path.remove(path)
    return SuffixDecodingCache


@pytest.fixture(scope="module")
def reference_tree(reference):
    """The reference's SuffixTree (the C++ class its cache holds, imported with it)."""
    from arctic_inference.suffix_decoding._C import SuffixTree as ReferenceTree

    return ReferenceTree


def paths(tokens, parents, probs, above: float) -> list[tuple[int, ...]]:
    """Root-to-token paths of the draft tokens whose probability is above ``above``, sorted."""
    out: list[tuple[int, ...]] = []
    for tok, parent in zip(tokens, parents, strict=True):
        out.append((out[parent] if parent >= 0 else ()) + (tok,))
    return sorted(p for p, pr in zip(out, probs, strict=True) if pr > above)


def streams(reference, seed: int, mode: str):
    """Both caches driven through the same requests; yields (ours, theirs) drafts at every step."""
    rng = random.Random(seed)
    vocab, depth, cached = rng.randint(2, 12), rng.randint(2, 16), rng.randint(1, 6)
    cfg = SpecConfig(
        max_depth=depth,
        max_spec=rng.randint(1, 12),
        min_token_prob=rng.choice([0.0, 0.1, 0.3]),
        max_cached_requests=cached,
        mode=mode,
        factor=rng.choice([0.5, 1.0, 2.0]),
        offset=rng.choice([0.0, 1.0]),
    )
    ours, theirs = SuffixCache(cfg), reference(depth, cached)
    motif = [rng.randrange(vocab) for _ in range(6)]

    def tokens(n: int, start: int) -> list[int]:
        return [rng.randrange(vocab) if rng.random() < 0.3 else motif[(start + i) % 6] for i in range(n)]

    for r in range(12):
        ctx = tokens(rng.randint(1, 20), 0)
        ours.start_request(r, ctx)
        theirs.start_request(r, ctx)
        for _ in range(rng.randint(1, 30)):
            a = ours.speculate(r, ctx)
            b = theirs.speculate(
                r, ctx, cfg.max_spec, cfg.factor, cfg.offset, cfg.min_token_prob, mode == "tree"
            )
            yield a, b
            new = tokens(rng.randint(1, 3), len(ctx))
            ours.append(r, new)
            theirs.add_active_response(r, new)
            ctx = ctx + new
        ours.finish_request(r)
        theirs.stop_request(r)


@pytest.mark.parametrize("seed", range(120))
def test_path_drafts_identical_to_reference(reference, seed):
    for a, b in streams(reference, seed, "path"):
        assert (a.tokens, a.parents, a.probs, a.score) == (b.token_ids, b.parents, b.probs, b.score)
        assert not a.tokens or a.match_len == b.match_len


@pytest.mark.parametrize("seed", range(60))
def test_tree_drafts_have_the_reference_nodes(reference, seed):
    """Same probabilities and score; same nodes except where equal-probability candidates tie at the budget
    (the reference breaks those ties in std::priority_queue's heap order, this heap in insertion order)."""
    for a, b in streams(reference, seed, "tree"):
        if a.match_len != b.match_len:  # a tie broken differently changed a float32 sum's order: 1 ulp apart
            assert a.score == pytest.approx(b.score, rel=1e-6)
            continue
        assert sorted(a.probs) == sorted(b.probs) and a.score == b.score
        low = min(a.probs, default=0.0)
        assert paths(a.tokens, a.parents, a.probs, low) == paths(b.token_ids, b.parents, b.probs, low)


@pytest.mark.parametrize("seed", range(100))
def test_tree_drafts_as_the_reference_under_interleaved_appends_and_removals(reference_tree, seed):
    """Sequences grown token by token in turn, then removed one by one: at every check the same path drafts
    (token for token, probability, score, match length) and tree drafts with the reference's nodes."""
    rng = random.Random(seed)
    depth, vocab = rng.randint(1, 10), rng.randint(1, 6)
    seqs = {k: [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for k in range(rng.randint(1, 7))}
    ours, theirs = SuffixTree(depth), reference_tree(depth)
    order = [k for k, s in seqs.items() for _ in s]
    rng.shuffle(order)
    grown = {k: 0 for k in seqs}

    def check_drafts():
        for _ in range(4):
            src = rng.choice(list(seqs.values()))
            i = rng.randrange(len(src))
            ctx = src[max(0, i - rng.randint(0, depth)) : i + 1] + (
                [rng.randrange(vocab)] if rng.random() < 0.3 else []
            )
            spec = (
                rng.randint(1, 10),
                rng.choice([0.5, 1.0, 2.0]),
                rng.choice([0.0, 1.0]),
                rng.choice([0.0, 0.1, 0.3]),
            )
            for tree in (False, True):
                a = ours.speculate(
                    ctx, spec[0], factor=spec[1], offset=spec[2], min_token_prob=spec[3], tree=tree
                )
                b = theirs.speculate(ctx, *spec, tree)
                if not tree:
                    assert (a.tokens, a.parents, a.probs, a.score) == (
                        b.token_ids,
                        b.parents,
                        b.probs,
                        b.score,
                    )
                    assert not a.tokens or a.match_len == b.match_len
                elif a.match_len != b.match_len:  # as in test_tree_drafts_have_the_reference_nodes
                    assert a.score == pytest.approx(b.score, rel=1e-6)
                else:
                    assert sorted(a.probs) == sorted(b.probs) and a.score == b.score
                    low = min(a.probs, default=0.0)
                    assert paths(a.tokens, a.parents, a.probs, low) == paths(
                        b.token_ids, b.parents, b.probs, low
                    )

    for step, k in enumerate(order):
        ours.append(k, seqs[k][grown[k]])
        theirs.extend(k, [seqs[k][grown[k]]])
        grown[k] += 1
        if step % 7 == 0:
            check_drafts()
    for k in rng.sample(sorted(seqs), rng.randint(0, len(seqs) - 1)):
        ours.remove(k)
        theirs.remove(k)
        del seqs[k]
        check_drafts()
