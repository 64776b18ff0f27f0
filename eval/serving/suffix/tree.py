"""Depth-limited suffix tree over token ids with per-node counts (the data structure of SuffixDecoding).

Conceptually the tree is a trie of every suffix of every stored sequence, cut at ``max_depth`` tokens, whose
node counts say how many of those (truncated) suffixes pass through or end at the node.  Stored as is that
trie has O(n * depth) nodes, so chains of single-child nodes with equal counts are compressed into one node
that points into a stored sequence (``ref[end - length:end]`` are its tokens).  The compressed form is
canonical: a node boundary exists exactly where the trie branches or where a suffix ends, which also means
every suffix ends at the end of a node.  Two invariants make the O(depth) append possible:

* every node's ``ref``/``end`` is an occurrence *with its whole root path in front of it*, so a node can be
  split or merged with a neighbour without looking anything up;
* each still-growing suffix of a sequence is held as a pointer to the node it ends at, and every operation
  keeps the node object whose end position is unchanged, so pointers of other suffixes stay valid.

A removed sequence's token array stays alive (by reference counting) while a live node still points into
it; the counts never include it again.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("count", "length", "ref", "end", "parent", "children")

    def __init__(self, count: int, length: int, ref: array | None, end: int, parent: _Node | None) -> None:
        self.count = count
        self.length = length
        self.ref = ref
        self.end = end
        self.parent = parent
        self.children: dict[int, _Node] = {}

    def token(self, offset: int = 0) -> int:
        """The node's token at ``offset`` (0 = the first one, its key in the parent)."""
        return self.ref[self.end - self.length + offset]


@dataclass
class Draft:
    """Speculated tokens as a tree: ``parents[i]`` is the index of token i's parent, -1 for the root.

    A path draft has ``parents == [-1, 0, 1, ...]``.  ``probs[i]`` is the estimated probability of reaching
    token i; ``score`` (their sum) is the expected number of accepted tokens used to pick between drafts.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)


class SuffixTree:
    """Suffix tree of token sequences, each suffix truncated to ``max_depth`` tokens.

    >>> t = SuffixTree(max_depth=8); t.extend(0, [1, 2, 3, 1, 2, 4])
    >>> t.speculate([5, 1, 2], max_spec=4).tokens   # "1 2" was followed by 3 and by 4; ties pick the smaller id
    [3]
    """

    def __init__(self, max_depth: int = 64) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth={max_depth} must be >= 1")
        self.max_depth = max_depth
        self.root = _Node(0, 0, None, 0, None)
        self.seqs: dict[int, array] = {}
        self._active: dict[int, deque[_Node]] = {}

    # ---- building -------------------------------------------------------------------------------------

    def append(self, seq_id: int, token: int) -> None:
        """Append one token to sequence ``seq_id`` (new or still open); O(max_depth)."""
        if seq_id in self.seqs and seq_id not in self._active:
            raise ValueError(f"sequence {seq_id} was closed; to resolve, append to a new sequence id")
        seq = self.seqs.setdefault(seq_id, array("i"))
        active = self._active.setdefault(seq_id, deque())
        seq.append(token)
        n = len(seq)
        root = self.root
        root.count += 1
        active.append(root)
        if len(active) > self.max_depth:
            active.popleft()
        for i, node in enumerate(active):
            active[i] = self._extend_suffix(node, token, seq, n)

    def _extend_suffix(self, a: _Node, token: int, seq: array, n: int) -> _Node:
        """Extend the suffix that ends at the end of node ``a`` by ``token`` (= seq[n-1]); return its new node."""
        c = a.children.get(token)
        is_root = a is self.root
        if c is None:
            if not is_root and a.count == 1:  # only this suffix reaches a: a is a leaf, grow it
                a.length += 1
                a.ref, a.end = seq, n
                return a
            new = _Node(1, 1, seq, n, a)
            a.children[token] = new
            return new
        merge_up = (
            not is_root and a.count == c.count + 1
        )  # a's only child is c and only this suffix ends at a
        if c.length == 1:
            c.count += 1
            if merge_up:  # fuse a into c, keeping c (other suffixes may end at c)
                parent, key = a.parent, a.token()
                c.length += a.length
                c.ref, c.end, c.parent = seq, n, parent
                parent.children[key] = c
            return c
        c.length -= 1  # split c after its first token; c keeps its end
        del a.children[token]
        if merge_up:
            a.length += 1
            a.ref, a.end = seq, n
            a.children[c.token()] = c
            return a
        new = _Node(c.count + 1, 1, seq, n, a)
        c.parent = new
        new.children[c.token()] = c
        a.children[token] = new
        return new

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(seq_id, token)

    def close(self, seq_id: int) -> None:
        """Stop growing ``seq_id`` (frees its suffix pointers); its suffixes stay counted until ``remove``."""
        self._active.pop(seq_id, None)

    def add(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Insert a complete sequence."""
        self.extend(seq_id, tokens)
        self.close(seq_id)

    def remove(self, seq_id: int) -> None:
        """Remove every suffix of ``seq_id``; O(len * max_depth)."""
        seq = self.seqs.pop(seq_id)
        self._active.pop(seq_id, None)
        n = len(seq)
        for start in range(n):
            node = self.root
            node.count -= 1
            idx, stop = start, min(n, start + self.max_depth)
            while idx < stop:
                child = node.children[seq[idx]]
                child.count -= 1
                if child.count == 0:
                    del node.children[seq[idx]]
                    break
                idx += child.length
                node = child
            self._merge_with_only_child(node)

    def _merge_with_only_child(self, x: _Node) -> None:
        """Restore the canonical form at ``x`` after a count decrement (no suffix ends at x any more)."""
        if x is self.root or len(x.children) != 1:
            return
        (y,) = x.children.values()
        if y.count != x.count:
            return
        key = x.token()
        y.length += x.length
        y.parent = x.parent
        x.parent.children[key] = y

    # ---- lookup and speculation -----------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> tuple[_Node, int] | None:
        """Position (node, tokens matched inside it) reached by ``tokens`` from the root, or None."""
        node, offset = self.root, 0
        for tok in tokens:
            if offset < node.length:
                if node.token(offset) != tok:
                    return None
                offset += 1
            else:
                node = node.children.get(tok)
                if node is None:
                    return None
                offset = 1
        return node, offset

    def _next(
        self, node: _Node, offset: int, prob: float, min_prob: float
    ) -> list[tuple[float, int, _Node, int]]:
        """Continuations of a position as (prob, token, node, offset), those below ``min_prob`` dropped."""
        if offset < node.length:
            return [(prob, node.token(offset), node, offset + 1)]
        out = []
        for tok, child in node.children.items():
            p = prob * child.count / node.count
            if p >= min_prob:
                out.append((p, tok, child, 1))
        return out

    def speculate_path(self, node: _Node, offset: int, max_tokens: int, min_prob: float) -> Draft:
        """Follow the most frequent continuation (ties: smaller token id) while its probability >= min_prob."""
        draft, prob = Draft(), 1.0
        while len(draft.tokens) < max_tokens:
            options = self._next(node, offset, prob, min_prob)
            if not options:
                break
            prob, tok, node, offset = max(options, key=lambda o: (o[0], -o[1]))
            draft.parents.append(len(draft.tokens) - 1)
            draft.tokens.append(tok)
            draft.probs.append(prob)
        return draft

    def speculate_tree(self, node: _Node, offset: int, max_tokens: int, min_prob: float) -> Draft:
        """Best-first expansion: the ``max_tokens`` most probable continuations (each with its ancestors)."""
        draft, tiebreak = Draft(), itertools.count()
        heap = [
            (-p, tok, next(tiebreak), -1, n, o) for p, tok, n, o in self._next(node, offset, 1.0, min_prob)
        ]
        heapq.heapify(heap)
        while heap and len(draft.tokens) < max_tokens:
            neg_p, tok, _, parent, n, o = heapq.heappop(heap)
            idx = len(draft.tokens)
            draft.tokens.append(tok)
            draft.parents.append(parent)
            draft.probs.append(-neg_p)
            for p, t, n2, o2 in self._next(n, o, -neg_p, min_prob):
                heapq.heappush(heap, (-p, t, next(tiebreak), idx, n2, o2))
        return draft

    def speculate(
        self,
        context: Sequence[int],
        max_spec: int,
        factor: float = 1.0,
        offset: float = 0.0,
        min_token_prob: float = 0.1,
        tree: bool = False,
    ) -> Draft:
        """Best draft over every match length p of the context's tail, budget min(max_spec, floor(factor*p + offset)).

        Ties between match lengths go to the longer match.
        """
        best = Draft()
        for p in range(1, min(len(context), self.max_depth) + 1):
            pos = self.match(context[len(context) - p :])
            if pos is None:
                break
            budget = max(0, min(max_spec, int(factor * p + offset + 1e-6)))
            fn = self.speculate_tree if tree else self.speculate_path
            draft = fn(pos[0], pos[1], budget, min_token_prob)
            if draft.score >= best.score:
                draft.match_len = p
                best = draft
        return best
