"""Depth-limited suffix tree over token ids with per-node counts (the data structure of SuffixDecoding).

Conceptually the tree is a trie of every suffix of every stored sequence, cut at ``max_depth`` tokens, whose
node counts say how many of those (truncated) suffixes pass through or end at the node.  Chains of
single-child nodes with equal counts are compressed into one node that points into a stored sequence
(``ref[end - length:end]`` are its tokens).  The compressed form is canonical: a node boundary exists exactly
where the trie branches or where a suffix ends, so every suffix ends at the end of a node.

The semantics are those of arctic-inference's C++ ``SuffixTree`` (the reference SuffixDecoding
implementation), so drafts are the same token for token:

* each still-growing suffix of a sequence is held as a pointer to the node it ends at (its *active nodes*),
  which makes appending O(max_depth) and gives the match position of every suffix of the sequence in O(1);
* each node records where suffixes end in it (``endpoints``: seq id -> end index), so removing a sequence
  re-points the nodes that referenced it to a live sequence and the removed token array is freed;
* children are kept in a list ordered by decreasing count (equal counts grouped, ties in the order the
  reference's updates produce), so the most frequent child is ``head`` and tree drafts stop early;
* probabilities and scores are computed in float32 in the reference's order of operations.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import sys
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_F32 = array("f", [0.0])


def f32(x: float) -> float:
    """``x`` rounded to float32 (the reference's arithmetic; exact for one +, -, * or / of float32 values)."""
    _F32[0] = x
    return _F32[0]


class _Group:
    """A run of siblings with equal counts; ``head`` is its first node."""

    __slots__ = ("head", "next", "prev")

    def __init__(self, head: _Node) -> None:
        self.head = head
        self.next: _Group | None = None
        self.prev: _Group | None = None


class _Node:
    __slots__ = (
        "count",
        "length",
        "ref",
        "ref_id",
        "end",
        "parent",
        "children",
        "endpoints",
        "head",
        "tail",
        "next",
        "prev",
        "group",
    )

    def __init__(
        self, count: int, length: int, ref: array | None, ref_id: int, end: int, parent: _Node | None
    ) -> None:
        self.count = count
        self.length = length
        self.ref = ref
        self.ref_id = ref_id
        self.end = end
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.endpoints: dict[int, int] = {}
        self.head: _Node | None = None  # most frequent child
        self.tail: _Node | None = None
        self.next: _Node | None = None  # next sibling (lower or equal count)
        self.prev: _Node | None = None
        self.group: _Group | None = None

    def token(self, offset: int = 0) -> int:
        """The node's token at ``offset`` (0 = the first one, its key in the parent)."""
        return self.ref[self.end - self.length + offset]

    def ordered_children(self) -> list[_Node]:
        out, c = [], self.head
        while c is not None:
            out.append(c)
            c = c.next
        return out


# ---- the ordered sibling list (a port of the reference's linked-list updates) --------------------------


def _remove_from_siblings(node: _Node) -> None:
    group = node.group
    if group.head is node:
        if node.next is not None and node.next.count == node.count:
            group.head = node.next
            node.group = None
        else:
            if group.prev is not None:
                group.prev.next = group.next
            if group.next is not None:
                group.next.prev = group.prev
            group.prev = group.next = None
    else:
        node.group = None
    parent = node.parent
    if node.next is not None:
        node.next.prev = node.prev
    else:
        parent.tail = node.prev
    if node.prev is not None:
        node.prev.next = node.next
    else:
        parent.head = node.next
    node.prev = node.next = None


def _insert_before(node: _Node, other: _Node) -> None:
    if other.prev is not None:
        other.prev.next = node
    else:
        node.parent.head = node
    node.next = other
    node.prev = other.prev
    other.prev = node
    prev = node.prev
    if prev is not None and node.count == prev.count:
        node.group = prev.group
    elif node.count == other.count:
        node.group = other.group
        node.group.head = node
    else:
        if node.group is None:
            node.group = _Group(node)
        group = node.group
        if prev is not None:
            group.prev = prev.group
            group.prev.next = group
        group.next = other.group
        group.next.prev = group


def _insert_after(node: _Node, other: _Node) -> None:
    if other.next is not None:
        other.next.prev = node
    else:
        node.parent.tail = node
    node.prev = other
    node.next = other.next
    other.next = node
    nxt = node.next
    if nxt is not None and node.count == nxt.count:
        node.group = nxt.group
        if node.group.head is nxt:
            node.group.head = node
    elif node.count == other.count:
        node.group = other.group
    else:
        if node.group is None:
            node.group = _Group(node)
        group = node.group
        if nxt is not None:
            group.next = nxt.group
            group.next.prev = group
        group.prev = other.group
        group.prev.next = group


def _replace_in_siblings(old: _Node, new: _Node) -> None:
    parent = old.parent
    if old.next is not None:
        old.next.prev = new
    else:
        parent.tail = new
    if old.prev is not None:
        old.prev.next = new
    else:
        parent.head = new
    new.prev, new.next = old.prev, old.next
    old.prev = old.next = None
    if old.group.head is old:
        old.group.head = new
    new.group, old.group = old.group, None


def _increment_count(node: _Node) -> None:
    if node.parent is None:
        node.count += 1
        return
    prev = node.prev
    if prev is None or prev.count > node.count + 1:
        if node.next is None or node.next.count < node.count:
            node.count += 1
        else:  # split off from its group into a new one in front of it
            orig = node.group
            orig.head = node.next
            new = _Group(node)
            new.next = orig
            if orig.prev is not None:
                new.prev = orig.prev
                new.prev.next = new
            orig.prev = new
            node.group = new
            node.count += 1
    else:
        other = prev.group.head
        _remove_from_siblings(node)
        node.count += 1
        _insert_before(node, other)


def _decrement_count(node: _Node) -> None:
    if node.parent is None:
        node.count -= 1
        return
    nxt = node.next
    if nxt is None or nxt.count < node.count - 1:
        if node.prev is None or node.prev.count > node.count:
            node.count -= 1
        else:  # split off from its group into a new one behind it
            orig = node.group
            new = _Group(node)
            new.prev = orig
            if orig.next is not None:
                new.next = orig.next
                new.next.prev = new
            orig.next = new
            node.group = new
            node.count -= 1
    elif nxt.count == node.count - 1:
        nxt.group.head = node
        if node.group.head is node:
            group = node.group
            if group.prev is not None:
                group.prev.next = group.next
            group.next.prev = group.prev
        node.group = nxt.group
        node.count -= 1
    else:
        other_group = node.group.next
        _remove_from_siblings(node)
        node.count -= 1
        if other_group is None:
            _insert_after(node, node.parent.tail)
        else:
            _insert_before(node, other_group.head)


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


Position = tuple[_Node, int]


@functools.lru_cache(maxsize=256)
def _search_order(
    n: int, max_depth: int, max_spec: int, factor: float, offset: float
) -> tuple[tuple[int, int, int], ...]:
    """(upper bound, match length, budget) for match lengths 1..n, most promising first (longer on ties)."""
    factor, offset = f32(factor), f32(offset)
    rows = []
    for p in range(1, n + 1):
        budget = max(0, min(max_spec, int(f32(f32(p * factor) + offset) + 1e-6)))
        rows.append((min(budget, max(max_depth - p, 0)), p, budget))
    return tuple(sorted(rows, reverse=True))


class SuffixTree:
    """Suffix tree of token sequences, each suffix truncated to ``max_depth`` tokens.

    >>> t = SuffixTree(max_depth=8); t.extend(0, [1, 2, 3, 1, 2, 4])
    >>> t.speculate([5, 1, 2], max_spec=4).tokens   # "1 2" was followed by 3 and by 4: the first seen leads
    [3, 1]
    """

    def __init__(self, max_depth: int = 64) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth={max_depth} must be >= 1")
        self.max_depth = max_depth
        self.clear()

    @classmethod
    def for_request(cls, max_depth: int) -> SuffixTree:
        """A tree for one request's prompt and output (the compiled tree leaves out what such a tree never reads)."""
        return cls(max_depth)

    @property
    def root_count(self) -> int:
        """Suffixes in the tree: the tokens of all its sequences."""
        return self.root.count

    def clear(self) -> None:
        """Remove every sequence."""
        self.root = _Node(0, 0, None, -1, 0, None)
        self.seqs: dict[int, array] = {}
        self._active: dict[int, deque[_Node]] = {}

    def restart(self, tokens: Iterable[int]) -> None:
        """Clear the tree and add ``tokens`` as open sequence 0 (a finished request's tree serving the next one)."""
        self.clear()
        self.extend(0, tokens)

    # ---- building -------------------------------------------------------------------------------------

    def append(self, seq_id: int, token: int) -> None:
        """Append one token to sequence ``seq_id`` (new or still open); O(max_depth)."""
        if seq_id in self.seqs and seq_id not in self._active:
            raise ValueError(f"sequence {seq_id} was closed; to resolve, append to a new sequence id")
        seq = self.seqs.setdefault(seq_id, array("i"))
        active = self._active.setdefault(seq_id, deque())
        root = self.root
        active.append(root)
        root.endpoints[seq_id] = len(seq)
        root.count += 1
        if len(active) > self.max_depth:
            active.popleft()
        seq.append(token)
        n = len(seq)
        extend = self._extend_suffix
        for i, node in enumerate(active):  # _extend_suffix's most common case inlined
            if node.count == 1 and node is not root:  # a leaf only this suffix reaches: grow it
                node.length += 1
                node.end = n
                node.endpoints[seq_id] = n
            else:
                active[i] = extend(node, token, seq, seq_id, n)

    def _extend_suffix(self, node: _Node, token: int, seq: array, seq_id: int, n: int) -> _Node:
        """Extend the suffix of ``seq_id`` that ends at the end of ``node`` by ``token`` (= seq[n-1])."""
        child = node.children.get(token)
        is_root = node is self.root
        if child is None:
            if node.count == 1 and not is_root:  # only this suffix reaches node: a leaf, grow it
                node.length += 1
                node.end = n
                node.endpoints[seq_id] = n
                return node
            new = _Node(1, 1, seq, seq_id, n, node)
            new.endpoints[seq_id] = n
            node.children[token] = new
            del node.endpoints[seq_id]
            if node.head is None:
                node.head = node.tail = new
                new.group = _Group(new)
            else:
                _insert_after(new, node.tail)
            return new
        if node.count == child.count + 1 and not is_root:  # node's only child; this suffix ends at node
            if child.length == 1:  # fuse node into child, keeping child (other suffixes may end there)
                parent, key = node.parent, node.token()
                child.count += 1
                child.length = node.length + 1
                child.ref, child.ref_id, child.end = seq, seq_id, n
                child.endpoints[seq_id] = n
                child.parent = parent
                _replace_in_siblings(node, child)
                parent.children[key] = child
                return child
            node.length += 1  # node grows into child by one token
            node.endpoints[seq_id] += 1
            node.ref, node.ref_id, node.end = seq, seq_id, n
            child.length -= 1
            first = child.token()
            if first != token:
                del node.children[token]
                node.children[first] = child
            return node
        if child.length == 1:
            del node.endpoints[seq_id]
            child.endpoints[seq_id] = n
            _increment_count(child)
            return child
        new = _Node(child.count, 1, seq, seq_id, n, node)  # split child after its first token
        _replace_in_siblings(child, new)
        node.children[token] = new
        child.length -= 1
        new.children[child.token()] = child
        child.parent = new
        del node.endpoints[seq_id]
        new.endpoints[seq_id] = n
        new.head = new.tail = child
        child.group = _Group(child)
        _increment_count(new)
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
        """Remove every suffix of ``seq_id`` and release its token array; O(len * max_depth)."""
        seq = self.seqs[seq_id]
        n = len(seq)
        root = self.root
        for start in range(n):
            node = root
            node.count -= 1
            idx = start
            path: list[_Node] = []
            while idx < n:
                tok = seq[idx]
                child = node.children.get(tok)
                if child is None:
                    break
                if child.count > 1:
                    _decrement_count(child)
                else:  # the child and its whole subtree go
                    _remove_from_siblings(child)
                    del node.children[tok]
                    break
                child.endpoints.pop(seq_id, None)
                idx += child.length
                node = child
                path.append(node)
            if node is not root and len(node.children) == 1:
                (only,) = node.children.values()
                if node.count == only.count:  # no suffix ends at node any more: merge it into its child
                    key = node.token()
                    only.length += node.length
                    only.parent = node.parent
                    _replace_in_siblings(node, only)
                    node.parent.children[key] = only
                    path[-1] = node = only
            leaf, distance = node, 0
            while leaf.children:
                leaf = next(iter(leaf.children.values()))
                distance += leaf.length
            if not leaf.endpoints or seq_id in leaf.endpoints:
                continue  # visited again later in this removal
            ref_id, ref_end = next(iter(leaf.endpoints.items()))
            end = ref_end - distance
            ref = self.seqs[ref_id]
            for p in reversed(path):
                if p.ref_id == seq_id:
                    p.ref, p.ref_id, p.end = ref, ref_id, end
                end -= p.length
        del self.seqs[seq_id]
        self._active.pop(seq_id, None)

    # ---- lookup and speculation -----------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> Position | None:
        """Position (node, tokens matched inside it) reached by ``tokens`` from the root, or None."""
        node, offset = self.root, 0
        for tok in tokens:
            if offset < node.length:
                if node.ref[node.end - node.length + offset] != tok:
                    return None
                offset += 1
            else:
                node = node.children.get(tok)
                if node is None:
                    return None
                offset = 1
        return node, offset

    def match_positions(self, context: Sequence[int], start: int = 1) -> list[Position]:
        """Positions of the context's tails of length start, start + 1, ... < len(context) while they occur
        (a walk from the root each)."""
        ctx = context if isinstance(context, array) else array("i", context)
        n, out = len(ctx), []
        children = self.root.children
        for p in range(start, n):
            i = n - p
            node = children.get(ctx[i])
            if node is None:
                break
            while True:
                length = node.length
                k = min(length, n - i)
                s = node.end - length
                if node.ref[s : s + k] != ctx[i : i + k]:
                    node = None
                    break
                i += k
                if i == n:
                    break
                node = node.children.get(ctx[i])
                if node is None:
                    break
            if node is None:
                break
            out.append((node, k))
        return out

    def is_open(self, seq_id: int) -> bool:
        """Whether ``seq_id`` can still grow (and has active nodes)."""
        return seq_id in self._active

    def active_positions(self, seq_id: int) -> list[Position]:
        """Positions of the tails of open sequence ``seq_id`` (lengths 1, 2, ...), from its active nodes; O(1) each."""
        return [(node, node.length) for node in reversed(self._active[seq_id])]

    def speculate_path(self, node: _Node, offset: int, max_tokens: int, min_prob: float) -> Draft:
        """Follow the most frequent child while the probability stays >= min_prob."""
        draft, prob, score = Draft(), 1.0, 0.0
        tokens, probs = draft.tokens, draft.probs
        min_prob = f32(min_prob)
        while len(tokens) < max_tokens and prob >= min_prob:
            if offset < node.length:
                k = min(node.length - offset, max_tokens - len(tokens))
                s = node.end - node.length + offset
                tokens.extend(node.ref[s : s + k])
                probs.extend([prob] * k)
                if prob == 1.0 and score < 16_777_216:
                    score += k  # exact in float32
                else:
                    for _ in range(k):
                        score = f32(score + prob)
                offset += k
            else:
                child = node.head
                if child is None:
                    break
                prob = f32(prob * f32(child.count / node.count))
                node, offset = child, 0
        draft.parents = list(range(-1, len(tokens) - 1))
        draft.score = score
        return draft

    def speculate_tree(self, node: _Node, offset: int, max_tokens: int, min_prob: float) -> Draft:
        """Best-first expansion: the ``max_tokens`` most probable continuations (each with its ancestors)."""
        draft, order, score = Draft(), itertools.count(), 0.0
        min_prob = f32(min_prob)
        heap = [(-1.0, next(order), node, offset, -1)]
        while heap and len(draft.tokens) < max_tokens:
            neg_p, _, n, o, parent = heapq.heappop(heap)
            if o < n.length:
                draft.tokens.append(n.ref[n.end - n.length + o])
                draft.parents.append(parent)
                draft.probs.append(-neg_p)
                score = f32(score - neg_p)
                heapq.heappush(heap, (neg_p, next(order), n, o + 1, len(draft.tokens) - 1))
            else:
                child = n.head
                while child is not None:
                    p = f32(f32(-neg_p * child.count) / n.count)
                    if p < min_prob:
                        break
                    heapq.heappush(heap, (-p, next(order), child, 0, parent))
                    child = child.next
        draft.score = score
        return draft

    @staticmethod
    def _path_score(node: _Node, offset: int, max_tokens: int, min_prob: float) -> float:
        """The score :meth:`speculate_path` would give (float32, same order of additions), without the draft."""
        score, prob, n = 0.0, 1.0, 0
        while n < max_tokens and prob >= min_prob:
            rest = node.length - offset
            if rest > 0:
                k = min(rest, max_tokens - n)
                if prob == 1.0:  # every earlier token had probability 1 too: score is a small integer
                    score += k
                else:
                    for _ in range(k):
                        _F32[0] = score + prob
                        score = _F32[0]
                n += k
                offset += k
            else:
                child = node.head
                if child is None:
                    break
                prob = f32(prob * f32(child.count / node.count))
                node, offset = child, 0
        return score

    def best_draft(
        self,
        positions: list[Position],
        max_spec: int,
        factor: float = 1.0,
        offset: float = 0.0,
        min_token_prob: float = 0.1,
        tree: bool = False,
    ) -> Draft:
        """Best draft over match positions for lengths 1, 2, ...: the highest score, ties to the longer match.

        Budget per match length p: min(max_spec, int(factor * p + offset)).  Lengths are tried in order of
        their upper bound min(budget, max_depth - p) (a draft can neither exceed its budget nor the tree's
        depth), and the search stops once no remaining length can beat the best; the result is the one of
        trying every length in turn.  Path drafts are scored first and only the winner is built.
        """
        best_score, best_p, best_draft = -1.0, 0, None
        min_prob = f32(min_token_prob)
        slack = 1 + 1e-5 if tree else 1  # a level's float32 probabilities may sum to a hair over 1
        for bound, p, budget in _search_order(len(positions), self.max_depth, max_spec, factor, offset):
            bound *= slack
            if bound < best_score or (bound == best_score and p < best_p):
                break
            node, off = positions[p - 1]
            if tree:
                draft = self.speculate_tree(node, off, budget, min_prob)
                score = draft.score
            else:
                score = self._path_score(node, off, budget, min_prob)
            if score > best_score or (score == best_score and p > best_p):
                best_score, best_p, best_draft = score, p, (draft if tree else (node, off, budget))
        if best_draft is None:
            return Draft()
        if not tree:
            best_draft = self.speculate_path(*best_draft, min_prob)
        best_draft.match_len = best_p
        return best_draft

    def speculate(
        self,
        context: Sequence[int],
        max_spec: int,
        factor: float = 1.0,
        offset: float = 0.0,
        min_token_prob: float = 0.1,
        tree: bool = False,
    ) -> Draft:
        """Best draft for the tails of ``context`` shorter than it (lengths 1 .. len(context) - 1)."""
        return self.best_draft(self.match_positions(context), max_spec, factor, offset, min_token_prob, tree)

    def tail_positions(self, seq_id: int | None, ctx: array) -> list[Position]:
        """Match positions of ``ctx``'s tails (lengths 1 .. len(ctx) - 1) using open sequence ``seq_id``'s
        active nodes for the tails it ends with; [] when ``seq_id`` does not end with ``ctx``'s last token."""
        seq = self.seqs.get(seq_id)
        if seq is None or not self.is_open(seq_id) or not seq or not ctx or seq[-1] != ctx[-1]:
            return []
        n = min(len(seq), len(ctx))
        if seq[len(seq) - n :] != ctx[len(ctx) - n :]:
            return []
        positions = self.active_positions(seq_id)[: min(n, len(ctx) - 1)]
        if n == len(seq) and n < len(ctx) - 1:  # tails reaching back past the sequence's start: walk them
            positions += self.match_positions(ctx, start=n + 1)
        return positions

    def speculate_open(
        self,
        seq_id: int | None,
        context: Sequence[int],
        walk: bool,
        max_spec: int,
        factor: float = 1.0,
        offset: float = 0.0,
        min_token_prob: float = 0.1,
        tree: bool = False,
    ) -> Draft:
        """Best draft for ``context``'s tails, positions from ``seq_id``'s active nodes when ``context`` ends
        with that open sequence (O(1) each), else (with ``walk``) walked from the root."""
        ctx = context if isinstance(context, array) else array("i", context)
        positions = self.tail_positions(seq_id, ctx)
        if not positions and walk:
            positions = self.match_positions(ctx)
        return self.best_draft(positions, max_spec, factor, offset, min_token_prob, tree)

    def nbytes(self) -> int:
        """Bytes held by the tree: nodes, their dicts and token arrays (sys.getsizeof, shared objects once)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += sys.getsizeof(node) + sys.getsizeof(node.children) + sys.getsizeof(node.endpoints)
            if node.group is not None and node.group.head is node:
                total += sys.getsizeof(node.group)
            stack.extend(node.children.values())
        total += sum(sys.getsizeof(s) for s in self.seqs.values()) + sys.getsizeof(self.seqs)
        return total + sum(sys.getsizeof(a) for a in self._active.values())
