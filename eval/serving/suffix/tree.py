"""The suffix tree of SuffixDecoding: a Python class over numpy tables that the numba kernels of :mod:`.kernels`
update and search (the tree's rules and layout are described there).

Why compiled: appending a token is O(max_depth) steps (one per active suffix, in the request tree and in the
global tree) and a ``speculate()`` scores up to ``max_depth`` drafts; compiled, both take a few microseconds.  This
side owns the tables' room (kernels never allocate: they stop before a token that might not fit, and
:meth:`SuffixTree._make_room` grows what is short), the sequence ids and the token pool.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numba
import numpy as np

from .draft import Draft, f32, search_order
from .kernels import (
    CNT,
    EMPTY,
    M_CLIVE,
    M_EHWM,
    M_ELIVE,
    M_ENDPOINTS,
    M_GHWM,
    M_NHWM,
    NODE_FIELDS,
    SCAP,
    SLEN,
    SROW,
    SSTART,
    h_rehash,
    k_clear,
    k_extend,
    k_from_arrays,
    k_remove,
    k_speculate,
    k_to_arrays,
)


def _through_entry(name: str, kernel):
    """``kernel`` for this module's global ``name``: called through numba's dispatcher once, which then rebinds
    ``name`` to the compiled entry point.  The dispatcher types every argument on every call (~5 µs for the 14
    arguments here, as much as a whole append) and a Python wrapper would add a frame to every call; SuffixTree
    always passes the same types (its tables, ``array('i')`` tokens, Python ints, floats and bools)."""

    def first_call(*args):
        out = kernel(*args)
        globals()[name] = kernel.overloads[tuple(numba.typeof(a) for a in args)].entry_point
        return out

    return first_call


_extend = _through_entry("_extend", k_extend)
_speculate = _through_entry("_speculate", k_speculate)
_clear = _through_entry("_clear", k_clear)


def _tokens(tokens: Iterable[int]) -> array:
    """``tokens`` as the ``array('i')`` the kernels take (numba reads it through the buffer protocol, which costs
    less per call than a numpy array); the cache's own arrays pass through."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    if isinstance(tokens, np.ndarray):
        return array("i", np.ascontiguousarray(tokens, np.int32).tobytes())
    return array("i", tokens)


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, (int(n) - 1).bit_length())


class _Seqs(Mapping):
    """Read-only view seq id -> token array (a copy) of a :class:`SuffixTree`'s sequences."""

    def __init__(self, tree: SuffixTree) -> None:
        self._tree = tree

    def __getitem__(self, seq_id: int) -> np.ndarray:
        t = self._tree
        start, length = t.seqtab[t._slot[seq_id], [SSTART, SLEN]]
        return t.tokens[start : start + length].copy()

    def __iter__(self) -> Iterator[int]:
        return iter(self._tree._slot)

    def __len__(self) -> int:
        return len(self._tree._slot)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tree._slot


class SuffixTree:
    """Suffix tree of token sequences, each suffix truncated to ``max_depth`` tokens, in numpy tables updated by the
    numba kernels of :mod:`.kernels` (the rules and the layout are described there).

    >>> t = SuffixTree(max_depth=8); t.extend(0, [1, 2, 3, 1, 2, 4])
    >>> t.speculate([5, 1, 2], max_spec=4).tokens
    [3, 1]
    """

    def __init__(self, max_depth: int = 64, endpoints: bool = True) -> None:
        """``endpoints=False``: a tree that never removes a sequence nor is saved (a request's tree) skips the
        suffix-endpoint records that only :meth:`remove` and :meth:`to_arrays` read."""
        if max_depth < 1:
            raise ValueError(f"max_depth={max_depth} must be >= 1")
        self.max_depth = max_depth
        self.endpoints = endpoints
        # room for one token (a request tree that stays empty allocates little); tables grow when a token
        # might not fit, for all of a prompt at once
        rows = 2 * (max_depth + 1)
        self.nodes = np.empty((rows, NODE_FIELDS), np.int32)
        self.groups = np.empty((2 * rows, 4), np.int32)
        self.chash = self._hash_table(2 * rows)
        ep_rows = rows if endpoints else 1  # kernels never touch a tree's endpoint tables without endpoints
        self.eps = np.empty((ep_rows, 5), np.int32)
        self.ehash = self._hash_table(2 * ep_rows)
        self.meta = np.zeros(9, np.int64)
        self.meta[M_ENDPOINTS] = endpoints
        self.tokens = np.empty(256, np.int32)
        self.seqtab = np.empty((16, 4), np.int64)
        self.active = np.empty((4, max_depth), np.int32)
        self.actmeta = np.empty((4, 2), np.int32)
        self.seqs = _Seqs(self)
        self._spec_ints, self._spec_probs = np.empty((6, 64), np.int64), np.empty((2, 64))  # k_speculate's
        self._heap_p, self._heap_i = np.empty(64), np.empty((64, 4), np.int64)  # scratch and output
        self._free_slots: list[int] = []
        self._free_rows: list[int] = []  # of the active-node table
        self._slot: dict[int, int] = {}  # seq id -> slot
        self._open: dict[int, int] = {}  # the open ones
        self._id_of: dict[int, int] = {}
        self._refresh()
        self.clear()

    def clear(self) -> None:
        """Remove every sequence, keeping the allocated tables (a finished request's tree serves the next one:
        allocating the tables costs more than a short prompt's insertion); O(1) but for the Python maps."""
        _clear(self.nodes, self.chash, self.ehash, self.meta, self.seqtab, self.actmeta)
        self._tok_used = 0
        self._garbage = 0
        self._n_slots = 0
        self._free_slots.clear()
        self._free_rows[:] = range(len(self.active) - 1, -1, -1)
        self._slot.clear()
        self._open.clear()
        self._id_of.clear()

    def restart(self, tokens: Iterable[int]) -> None:
        """Clear the tree and add ``tokens`` as open sequence 0 (a finished request's tree serving the next
        request): a tree whose only sequence is an open sequence 0 keeps its slot and token segment, and the
        whole start is one kernel call."""
        slot = self._open.get(0) if len(self._slot) == 1 else None
        if slot is None:
            self.clear()
            self.extend(0, tokens)
            return
        new = _tokens(tokens)
        if (done := _extend(*self._ext_args, slot, new, True)) < len(new):
            self._extend_rest(slot, new, done)

    @property
    def root_count(self) -> int:
        return int(self.nodes[0, CNT])

    # ---- room -----------------------------------------------------------------------------------------

    @staticmethod
    def _grown(table: np.ndarray, rows: int, fill: int = 0) -> np.ndarray:
        new = np.full((_pow2_at_least(max(rows, len(table))),) + table.shape[1:], fill, table.dtype)
        new[: len(table)] = table
        return new

    @staticmethod
    def _hash_table(size: int) -> np.ndarray:
        """An empty hash table for ``size`` rows or more (h_get)."""
        table = np.full((_pow2_at_least(size) + 1, 2), EMPTY, np.int64)
        table[-1, 0] = 0
        return table

    @classmethod
    def _rehashed(cls, table: np.ndarray, size: int) -> np.ndarray:
        new = cls._hash_table(size)
        h_rehash(table, new)
        return new

    def _make_room(self, slot: int, n_tokens: int) -> None:
        """Grow what :func:`k_extend` found short for one more token of ``n_tokens`` to come: doubled, or sized
        for all of them if more (n tokens make at most 2n nodes), so that a long prompt's tables grow once."""
        need, meta = self.max_depth + 1, self.meta
        rows = 2 * n_tokens + 3 * need
        if meta[M_NHWM] + need > len(self.nodes):
            self.nodes = self._grown(self.nodes, max(2 * len(self.nodes), meta[M_NHWM] + rows), -1)
        if meta[M_GHWM] + 3 * need > len(self.groups):
            self.groups = self._grown(self.groups, max(2 * len(self.groups), meta[M_GHWM] + rows))
        if 2 * (meta[M_CLIVE] + need) > len(self.chash) - 1:
            size = max(2 * (len(self.chash) - 1), 2 * (meta[M_CLIVE] + rows))
            self.chash = self._rehashed(self.chash, size)
        if self.endpoints and meta[M_EHWM] + need > len(self.eps):
            self.eps = self._grown(self.eps, max(2 * len(self.eps), meta[M_EHWM] + rows))
        if self.endpoints and 2 * (meta[M_ELIVE] + 2 * need) > len(self.ehash) - 1:  # a record can hash two
            size = max(2 * (len(self.ehash) - 1), 2 * (meta[M_ELIVE] + rows))
            self.ehash = self._rehashed(self.ehash, size)
        self._token_room(slot, n_tokens)
        self._refresh()

    def _token_room(self, slot: int, n_tokens: int) -> None:
        """Room for ``n_tokens`` more tokens in the sequence's segment (moved to the pool's end, doubled, at least
        256 tokens: each growth is a trip through Python, and a response of a few hundred tokens then grows its
        segment twice, not six times)."""
        start, length, cap, _ = self.seqtab[slot]
        if length + n_tokens <= cap:
            return
        new_cap = max(2 * int(cap), int(length) + n_tokens, 256)
        if self._tok_used + new_cap > len(self.tokens):
            if self._garbage > len(self.tokens) // 2:
                self._compact()
            if self._tok_used + new_cap > len(self.tokens):
                grown = np.zeros(_pow2_at_least(self._tok_used + new_cap), np.int32)
                grown[: self._tok_used] = self.tokens[: self._tok_used]
                self.tokens = grown
            start = self.seqtab[slot, SSTART]
        self.tokens[self._tok_used : self._tok_used + length] = self.tokens[start : start + length]
        self._garbage += int(cap)
        self.seqtab[slot, [SSTART, SCAP]] = self._tok_used, new_cap
        self._tok_used += new_cap

    def _compact(self) -> None:
        """Copy live segments to a fresh pool, dropping removed and moved-away ones."""
        pool = np.zeros(len(self.tokens), np.int32)
        used = 0
        for slot in self._slot.values():
            start, length, cap, _ = self.seqtab[slot]
            pool[used : used + length] = self.tokens[start : start + length]
            self.seqtab[slot, SSTART] = used
            used += int(cap)
        self.tokens, self._tok_used, self._garbage = pool, used, 0

    def _tables(self) -> tuple:
        return (self.nodes, self.groups, self.eps, self.chash, self.ehash, self.meta)

    def _refresh(self) -> None:
        """Rebind the kernels' argument tuples after a table was replaced (grown, rehashed, compacted)."""
        self._ext_args = (*self._tables(), self.tokens, self.seqtab, self.active, self.actmeta)
        self._spec_args = (
            self.nodes,
            self.chash,
            self.tokens,
            self.seqtab,
            self.active,
            self.actmeta,
        )

    # ---- building -------------------------------------------------------------------------------------

    def _open_slot(self, seq_id: int) -> int:
        """A slot (and active-node row) for new sequence ``seq_id``."""
        if seq_id in self._slot:
            raise ValueError(f"sequence {seq_id} was closed; to resolve, append to a new sequence id")
        if self._free_slots:  # a removed sequence's slot (its endpoints and node references are gone)
            slot = self._free_slots.pop()
        else:
            slot = self._n_slots
            self._n_slots += 1
        if slot >= len(self.seqtab):
            self.seqtab = self._grown(self.seqtab, slot + 1)
        if not self._free_rows:
            rows = len(self.active)
            self.active = self._grown(self.active, 2 * rows)
            self.actmeta = self._grown(self.actmeta, 2 * rows)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free_rows.pop()
        self.actmeta[row] = 0
        self.seqtab[slot] = (self._tok_used, 0, 0, row)
        self._slot[seq_id], self._id_of[slot], self._open[seq_id] = slot, seq_id, slot
        self._refresh()
        return slot

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append tokens to sequence ``seq_id`` (new or still open); O(max_depth) each."""
        slot = self._open.get(seq_id)
        if slot is None:
            slot = self._open_slot(seq_id)
        new = _tokens(tokens)
        if (done := _extend(*self._ext_args, slot, new, False)) < len(new):
            self._extend_rest(slot, new, done)

    def _extend_rest(self, slot: int, new: array, done: int) -> None:
        """What k_extend left of ``new`` after ``done`` tokens, growing the tables it found short."""
        while done < len(new):
            self._make_room(slot, len(new) - done)
            done += _extend(*self._ext_args, slot, new[done:], False)

    def append(self, seq_id: int, token: int) -> None:
        self.extend(seq_id, [token])

    def close(self, seq_id: int) -> None:
        """Stop growing ``seq_id``; its suffixes stay counted until ``remove``."""
        slot = self._open.pop(seq_id, None)
        if slot is not None:
            self._free_rows.append(int(self.seqtab[slot, SROW]))
            self.seqtab[slot, SROW] = -1
            self._garbage += int(self.seqtab[slot, SCAP] - self.seqtab[slot, SLEN])
            self.seqtab[slot, SCAP] = self.seqtab[slot, SLEN]

    def add(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Insert a complete sequence."""
        self.extend(seq_id, tokens)
        self.close(seq_id)

    def remove(self, seq_id: int) -> None:
        """Remove every suffix of ``seq_id`` and release its tokens; O(len * max_depth)."""
        self._need_endpoints("remove a sequence")
        self.close(seq_id)
        slot = self._slot.pop(seq_id)
        del self._id_of[slot]
        path = np.empty(self.max_depth + 1, np.int32)
        k_remove(*self._tables(), self.tokens, self.seqtab, slot, path)
        self._garbage += int(self.seqtab[slot, SCAP])
        self.seqtab[slot] = (0, 0, 0, -1)
        self._free_slots.append(slot)

    def is_open(self, seq_id: int) -> bool:
        return seq_id in self._open

    @classmethod
    def for_request(cls, max_depth: int) -> SuffixTree:
        """A tree for one request's prompt and output: never removed nor saved, so without endpoints."""
        return cls(max_depth, endpoints=False)

    def _need_endpoints(self, what: str) -> None:
        if not self.endpoints:
            raise ValueError(
                f"a tree built with endpoints=False cannot {what}; to resolve, build it with endpoints"
            )

    # ---- speculation ----------------------------------------------------------------------------------

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
        """Best draft for ``context``'s tails (lengths 1 .. len(context) - 1): the highest score, ties to the
        longer match, with budget min(max_spec, int(factor * match length + offset)) tokens.  Match positions come
        from ``seq_id``'s active nodes when ``context`` ends with that open sequence (O(1) each), else (with
        ``walk``) from walks from the root.  ``tree``: best-first tree drafts, else path drafts."""
        slot = -1 if seq_id is None else self._slot.get(seq_id, -1)
        ctx = _tokens(context)
        order = search_order(self.max_depth, max_spec, factor, offset)
        if self._spec_probs.shape[1] < max(max_spec, len(ctx)):
            size = _pow2_at_least(max(max_spec, len(ctx)))
            self._spec_ints, self._spec_probs = np.empty((6, size), np.int64), np.empty((2, size))
        ints, probs = self._spec_ints, self._spec_probs
        while True:
            n, score, match_len = _speculate(
                *self._spec_args,
                slot,
                ctx,
                bool(walk),
                order,
                int(max_spec),
                f32(min_token_prob),
                bool(tree),
                ints,
                probs,
                self._heap_p,
                self._heap_i,
            )
            if n >= 0:
                break
            self._heap_p, self._heap_i = (
                np.empty(2 * len(self._heap_p)),
                np.empty((2 * len(self._heap_p), 4), np.int64),
            )
        tokens, parents = ints[:2, :n].tolist()
        return Draft(tokens, parents, probs[0, :n].tolist(), match_len, score)

    def speculate(self, context: Sequence[int], max_spec: int, **kwargs) -> Draft:
        """Best draft for the tails of ``context`` shorter than it, each walked from the root."""
        return self.speculate_open(None, context, True, max_spec, **kwargs)

    # ---- artifacts and size ---------------------------------------------------------------------------

    def to_arrays(self, order: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(node rows parent/count/length/ref/end, endpoint rows node/seq/end), breadth-first in sibling
        order, sequences as indices into ``order`` (artifact.tree_to_arrays)."""
        self._need_endpoints("be saved")
        slot_index = np.full(max(self._n_slots, 1), -1, np.int64)
        for k, seq_id in enumerate(order):
            slot_index[self._slot[seq_id]] = k
        return k_to_arrays(self.nodes[: self.meta[M_NHWM]], self.eps, slot_index)

    @classmethod
    def from_arrays(
        cls,
        max_depth: int,
        seq_ids: list[int],
        offsets: np.ndarray,
        tokens: np.ndarray,
        columns,
        first,
        ep_rows,
    ) -> SuffixTree:
        """A tree of closed sequences from validated artifact arrays; ValueError if siblings are out of order."""
        tree = cls(max_depth)
        n_nodes, n_eps = len(columns), len(ep_rows)
        tree.nodes = tree._grown(tree.nodes, n_nodes + 1, -1)
        tree.groups = tree._grown(tree.groups, n_nodes + 1)
        tree.eps = tree._grown(tree.eps, n_eps + 1)
        tree.chash = tree._rehashed(tree.chash, 2 * n_nodes + 1)
        tree.ehash = tree._rehashed(tree.ehash, 2 * n_eps + 1)
        bad = k_from_arrays(*tree._tables(), columns, first, ep_rows)
        if bad:
            raise ValueError(f"node {bad} is out of count order")
        tree.tokens = np.ascontiguousarray(tokens, np.int32).copy()
        tree._tok_used = len(tree.tokens)
        tree.seqtab = tree._grown(tree.seqtab, len(seq_ids))
        lengths = np.diff(offsets)
        for k, seq_id in enumerate(seq_ids):
            tree.seqtab[k] = (offsets[k], lengths[k], lengths[k], -1)
            tree._slot[seq_id], tree._id_of[k] = k, seq_id
        tree._n_slots = len(seq_ids)
        tree._refresh()
        return tree

    def nbytes(self) -> int:
        """Bytes of the tables, token pool and id maps (allocated, not just used)."""
        arrays = (
            self.nodes,
            self.groups,
            self.eps,
            self.meta,
            self.chash,
            self.ehash,
            self.tokens,
            self.seqtab,
            self.active,
            self.actmeta,
        )
        maps = (self._slot, self._id_of, self._open)
        return sum(a.nbytes for a in arrays) + sum(map(sys.getsizeof, maps))
