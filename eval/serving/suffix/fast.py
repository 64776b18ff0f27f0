"""The suffix tree of :mod:`.tree` in flat numpy arrays, updated and searched by numba-compiled kernels.

Why: the object tree does O(max_depth) Python work per appended token (one step per active node, in the
request tree and in the global tree) and scores up to ``max_depth`` drafts per ``speculate()``; compiled,
both are a few microseconds.  Same structure, same update rules in the same order (so the same sibling
order and ties), same float32 arithmetic: drafts are identical to :class:`.tree.SuffixTree`'s
(tests/eval/serving/suffix/test_fast.py).  numba is optional (the ``fast`` extra); without it the object tree is used.

Layout: node fields are the columns of one int32 table (``NODE_FIELDS``); a node's children are found in
an open-addressing hash table keyed by (parent, token), its suffix endpoints in a linked list of records
(found by (node, sequence slot) in a second hash table when a node has two or more); equal-count sibling
groups are rows of a group table, reference-counted by their members.  Freed rows go on free lists (linked
through the ``NEXT`` column).  Each sequence's tokens live in a segment of one token pool (moved to the end,
doubled, when it outgrows its segment); removed and moved-away segments are reclaimed by compaction.  Kernels
never grow a table: appending stops before a token that might not fit (one token adds at most max_depth + 1
rows anywhere), the Python side grows what is short and resumes.  A request's tree (``for_request``) keeps no
endpoints (only removal and artifacts read them), starts small, and serves the cache's next request after
``restart``: one kernel call that empties it in O(1) (counters, the root's row, and the hash tables by a
generation step) and inserts the new prompt.  The first use compiles the kernels (about a minute and a half;
numba caches them in ``__pycache__`` for later processes, which then load in seconds).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numba
import numpy as np

from .tree import Draft, _search_order, f32

# Kernels run without numba's runtime (NRT): with it, every array bound to a name inside a kernel (each inlined
# helper's parameters, each call's arguments) is reference-counted with an atomic increment and decrement that
# LLVM keeps, which perf put at 80% of a prompt's insertion (five times slower, 2026-12-04).  Without the runtime
# a kernel cannot allocate: its scratch arrays come from the Python side.  Only the artifact conversions, which
# build their outputs, keep it (``jit``).  Kernels keep the GIL, as the C++ tree does: they take microseconds, and
# releasing and retaking it would add a fifth to a call's fixed cost.
kernel = numba.njit(cache=True, _nrt=False)
jit = numba.njit(cache=True)
# The kernels' helpers are inlined into them at numba's IR level (fewer calls; the compiler sees the kernel whole).
inline = numba.njit(cache=True, inline="always")

# node table columns
CNT, LEN, REF, END, PAR, HEAD, TAIL, NEXT, PREV, GRP, EPH = range(11)
NODE_FIELDS = 11
# group table columns
GHEAD, GNEXT, GPREV, GSIZE = range(4)
# endpoint record columns
ENODE, ESEQ, EEND, ENEXT, EPREV = range(5)
# sequence table columns (int64)
SSTART, SLEN, SCAP, SROW = range(4)
# meta counters and flags (M_ENDPOINTS: 1 if the tree keeps suffix endpoints, which only removal and artifacts
# read: a request's tree, never removed nor saved, skips them and does a third of the hash-table work per step)
M_NFREE, M_NHWM, M_GFREE, M_GHWM, M_EFREE, M_EHWM, M_CLIVE, M_ELIVE, M_ENDPOINTS = range(9)
EMPTY = -1
MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (Fibonacci hashing)


# ---- hash tables: int64 keys, int32 values, linear probing, backward-shift deletion ---------------------
# A table is a (2^k + 1, 2) int64 array: rows (key, generation << 32 | value), then one row whose first column
# is the table's generation.  Only rows of that generation are in the table, so emptying it is one increment (a
# finished request's tree is reused without touching its rows: ArrayTree.restart, clear).


@inline
def _home(key, mask):
    h = key * MUL
    return (h ^ (h >> 29)) & mask


@inline
def h_get(ht, key):
    """The value of ``key``, or -1."""
    mask = len(ht) - 2
    gen = ht[mask + 1, 0]
    i = _home(key, mask)
    while ht[i, 1] >> 32 == gen:
        if ht[i, 0] == key:
            return ht[i, 1] & 0xFFFFFFFF
        i = (i + 1) & mask
    return -1


@inline
def h_put(ht, key, val):
    """Set key -> val; 1 if the key is new."""
    mask = len(ht) - 2
    gen = ht[mask + 1, 0]
    i = _home(key, mask)
    while ht[i, 1] >> 32 == gen:
        if ht[i, 0] == key:
            ht[i, 1] = (gen << 32) | val
            return 0
        i = (i + 1) & mask
    ht[i, 0] = key
    ht[i, 1] = (gen << 32) | val
    return 1


@inline
def h_del(ht, key):
    """Delete key; 1 if it was there."""
    mask = len(ht) - 2
    gen = ht[mask + 1, 0]
    i = _home(key, mask)
    while ht[i, 0] != key:
        if ht[i, 1] >> 32 != gen:
            return 0
        i = (i + 1) & mask
    if ht[i, 1] >> 32 != gen:  # a row of an earlier generation
        return 0
    j = i
    while True:
        j = (j + 1) & mask
        if ht[j, 1] >> 32 != gen:
            break
        k = _home(ht[j, 0], mask)
        if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
            continue  # row j is between its home and i's hole: it stays
        ht[i, 0] = ht[j, 0]
        ht[i, 1] = ht[j, 1]
        i = j
    ht[i, 1] = EMPTY
    return 1


@kernel
def h_rehash(ht, new):
    """Put ``ht``'s rows into the empty table ``new``, which takes its generation."""
    mask = len(ht) - 2
    gen = ht[mask + 1, 0]
    new[len(new) - 1, 0] = gen
    for i in range(mask + 1):
        if ht[i, 1] >> 32 == gen:
            h_put(new, ht[i, 0], ht[i, 1] & 0xFFFFFFFF)


@inline
def h_clear(ht):
    """Empty the table: its next generation (rows rewritten only when the generation would overflow)."""
    mask = len(ht) - 2
    if ht[mask + 1, 0] == 0x7FFFFFFF:
        for i in range(mask + 1):
            ht[i, 1] = EMPTY
        ht[mask + 1, 0] = 0
    else:
        ht[mask + 1, 0] += 1


@inline
def ckey(node, token):
    return (np.int64(node) << 32) | (np.int64(token) & 0xFFFFFFFF)


# ---- allocation ----------------------------------------------------------------------------------------


@inline
def new_node(nodes, meta, count, length, ref, end, parent):
    r = meta[M_NFREE]
    if r >= 0:
        meta[M_NFREE] = nodes[r, NEXT]
    else:
        r = meta[M_NHWM]
        meta[M_NHWM] = r + 1
    nodes[r, CNT] = count
    nodes[r, LEN] = length
    nodes[r, REF] = ref
    nodes[r, END] = end
    nodes[r, PAR] = parent
    for f in (HEAD, TAIL, NEXT, PREV, GRP, EPH):
        nodes[r, f] = -1
    return r


@inline
def new_group(groups, meta, head):
    g = meta[M_GFREE]
    if g >= 0:
        meta[M_GFREE] = groups[g, GNEXT]
    else:
        g = meta[M_GHWM]
        meta[M_GHWM] = g + 1
    groups[g, GHEAD] = head
    groups[g, GNEXT] = -1
    groups[g, GPREV] = -1
    groups[g, GSIZE] = 0
    return g


@inline
def gset(nodes, groups, meta, node, g):
    """node.group = g, counting members; a group left without members is freed."""
    old = nodes[node, GRP]
    if old == g:
        return
    if g >= 0:
        groups[g, GSIZE] += 1
    nodes[node, GRP] = g
    if old >= 0:
        groups[old, GSIZE] -= 1
        if groups[old, GSIZE] == 0:
            groups[old, GNEXT] = meta[M_GFREE]
            meta[M_GFREE] = old


# ---- endpoints (node, sequence slot) -> end ------------------------------------------------------------
# A node's endpoint records are a linked list from its EPH column.  Most nodes hold at most one (the suffix
# passing through), so the hash table (node, slot) -> record holds only the records of nodes with two or more:
# moving a suffix's endpoint from a node to its child, an append's usual step, touches no hash table.


@inline
def ep_find(nodes, eps, ehash, node, slot):
    """The record of (node, slot), or -1."""
    r = nodes[node, EPH]
    if r < 0 or eps[r, ENEXT] < 0:  # none or one record: not in the hash table
        return r if r >= 0 and eps[r, ESEQ] == slot else -1
    return h_get(ehash, ckey(node, slot))


@inline
def ep_get(nodes, eps, ehash, node, slot):
    r = ep_find(nodes, eps, ehash, node, slot)
    return -1 if r < 0 else eps[r, EEND]


@inline
def _ep_hash(eps, ehash, meta, r):
    meta[M_ELIVE] += h_put(ehash, ckey(eps[r, ENODE], eps[r, ESEQ]), r)


@inline
def _ep_unhash(eps, ehash, meta, r):
    meta[M_ELIVE] -= h_del(ehash, ckey(eps[r, ENODE], eps[r, ESEQ]))


@inline
def ep_set(nodes, eps, ehash, meta, node, slot, end):
    """Record that a suffix of ``slot`` ends at ``node`` at index ``end`` (no-op in a tree without endpoints)."""
    if not meta[M_ENDPOINTS]:
        return
    r = ep_find(nodes, eps, ehash, node, slot)
    if r >= 0:
        eps[r, EEND] = end
        return
    r = meta[M_EFREE]
    if r >= 0:
        meta[M_EFREE] = eps[r, ENEXT]
    else:
        r = meta[M_EHWM]
        meta[M_EHWM] = r + 1
    eps[r, ENODE] = node
    eps[r, ESEQ] = slot
    eps[r, EEND] = end
    first = nodes[node, EPH]
    eps[r, ENEXT] = first
    eps[r, EPREV] = -1
    nodes[node, EPH] = r
    if first >= 0:
        eps[first, EPREV] = r
        if eps[first, ENEXT] < 0:  # the node's second record: the first one goes into the hash table too
            _ep_hash(eps, ehash, meta, first)
        _ep_hash(eps, ehash, meta, r)


@inline
def _ep_free(nodes, eps, ehash, meta, r):
    node = eps[r, ENODE]
    hashed = eps[nodes[node, EPH], ENEXT] >= 0  # the node has two or more records, all in the hash table
    if hashed:
        _ep_unhash(eps, ehash, meta, r)
    nx, pv = eps[r, ENEXT], eps[r, EPREV]
    if nx >= 0:
        eps[nx, EPREV] = pv
    if pv >= 0:
        eps[pv, ENEXT] = nx
    else:
        nodes[node, EPH] = nx
    head = nodes[node, EPH]
    if hashed and eps[head, ENEXT] < 0:  # one record left: it leaves the hash table
        _ep_unhash(eps, ehash, meta, head)
    eps[r, ENEXT] = meta[M_EFREE]
    meta[M_EFREE] = r


@inline
def ep_del(nodes, eps, ehash, meta, node, slot):
    if not meta[M_ENDPOINTS]:
        return
    r = ep_find(nodes, eps, ehash, node, slot)
    if r >= 0:
        _ep_free(nodes, eps, ehash, meta, r)


@inline
def free_node(nodes, groups, eps, ehash, meta, node):
    """Release a node that is out of the tree (its child keys are the caller's): endpoints, group, row."""
    while nodes[node, EPH] >= 0:
        _ep_free(nodes, eps, ehash, meta, nodes[node, EPH])
    gset(nodes, groups, meta, node, -1)
    nodes[node, CNT] = 0
    nodes[node, NEXT] = meta[M_NFREE]
    meta[M_NFREE] = node


# ---- the ordered sibling list (the updates of tree.py, on rows) ---------------------------------------


@inline
def remove_from_siblings(nodes, groups, meta, node):
    g = nodes[node, GRP]
    nx = nodes[node, NEXT]
    pv = nodes[node, PREV]
    if groups[g, GHEAD] == node:
        if nx >= 0 and nodes[nx, CNT] == nodes[node, CNT]:
            groups[g, GHEAD] = nx
            gset(nodes, groups, meta, node, -1)
        else:
            gp, gn = groups[g, GPREV], groups[g, GNEXT]
            if gp >= 0:
                groups[gp, GNEXT] = gn
            if gn >= 0:
                groups[gn, GPREV] = gp
            groups[g, GPREV] = -1
            groups[g, GNEXT] = -1
    else:
        gset(nodes, groups, meta, node, -1)
    parent = nodes[node, PAR]
    if nx >= 0:
        nodes[nx, PREV] = pv
    else:
        nodes[parent, TAIL] = pv
    if pv >= 0:
        nodes[pv, NEXT] = nx
    else:
        nodes[parent, HEAD] = nx
    nodes[node, PREV] = -1
    nodes[node, NEXT] = -1


@inline
def insert_before(nodes, groups, meta, node, other):
    op = nodes[other, PREV]
    if op >= 0:
        nodes[op, NEXT] = node
    else:
        nodes[nodes[node, PAR], HEAD] = node
    nodes[node, NEXT] = other
    nodes[node, PREV] = op
    nodes[other, PREV] = node
    if op >= 0 and nodes[node, CNT] == nodes[op, CNT]:
        gset(nodes, groups, meta, node, nodes[op, GRP])
    elif nodes[node, CNT] == nodes[other, CNT]:
        gset(nodes, groups, meta, node, nodes[other, GRP])
        groups[nodes[node, GRP], GHEAD] = node
    else:
        if nodes[node, GRP] < 0:
            gset(nodes, groups, meta, node, new_group(groups, meta, node))
        g = nodes[node, GRP]
        if op >= 0:
            groups[g, GPREV] = nodes[op, GRP]
            groups[groups[g, GPREV], GNEXT] = g
        groups[g, GNEXT] = nodes[other, GRP]
        groups[groups[g, GNEXT], GPREV] = g


@inline
def insert_after(nodes, groups, meta, node, other):
    on = nodes[other, NEXT]
    if on >= 0:
        nodes[on, PREV] = node
    else:
        nodes[nodes[node, PAR], TAIL] = node
    nodes[node, PREV] = other
    nodes[node, NEXT] = on
    nodes[other, NEXT] = node
    if on >= 0 and nodes[node, CNT] == nodes[on, CNT]:
        gset(nodes, groups, meta, node, nodes[on, GRP])
        g = nodes[node, GRP]
        if groups[g, GHEAD] == on:
            groups[g, GHEAD] = node
    elif nodes[node, CNT] == nodes[other, CNT]:
        gset(nodes, groups, meta, node, nodes[other, GRP])
    else:
        if nodes[node, GRP] < 0:
            gset(nodes, groups, meta, node, new_group(groups, meta, node))
        g = nodes[node, GRP]
        if on >= 0:
            groups[g, GNEXT] = nodes[on, GRP]
            groups[groups[g, GNEXT], GPREV] = g
        groups[g, GPREV] = nodes[other, GRP]
        groups[groups[g, GPREV], GNEXT] = g


@inline
def replace_in_siblings(nodes, groups, meta, old, new):
    parent = nodes[old, PAR]
    on, op = nodes[old, NEXT], nodes[old, PREV]
    if on >= 0:
        nodes[on, PREV] = new
    else:
        nodes[parent, TAIL] = new
    if op >= 0:
        nodes[op, NEXT] = new
    else:
        nodes[parent, HEAD] = new
    nodes[new, PREV] = op
    nodes[new, NEXT] = on
    nodes[old, PREV] = -1
    nodes[old, NEXT] = -1
    g = nodes[old, GRP]
    if groups[g, GHEAD] == old:
        groups[g, GHEAD] = new
    gset(nodes, groups, meta, new, g)
    gset(nodes, groups, meta, old, -1)


@inline
def increment_count(nodes, groups, meta, node):
    if nodes[node, PAR] < 0:
        nodes[node, CNT] += 1
        return
    pv = nodes[node, PREV]
    c = nodes[node, CNT]
    if pv < 0 or nodes[pv, CNT] > c + 1:
        nx = nodes[node, NEXT]
        if nx >= 0 and nodes[nx, CNT] >= c:  # split off from its group into a new one in front of it
            orig = nodes[node, GRP]
            groups[orig, GHEAD] = nx
            g = new_group(groups, meta, node)
            groups[g, GNEXT] = orig
            if groups[orig, GPREV] >= 0:
                groups[g, GPREV] = groups[orig, GPREV]
                groups[groups[g, GPREV], GNEXT] = g
            groups[orig, GPREV] = g
            gset(nodes, groups, meta, node, g)
        nodes[node, CNT] = c + 1
    else:
        other = groups[nodes[pv, GRP], GHEAD]
        remove_from_siblings(nodes, groups, meta, node)
        nodes[node, CNT] = c + 1
        insert_before(nodes, groups, meta, node, other)


@inline
def decrement_count(nodes, groups, meta, node):
    if nodes[node, PAR] < 0:
        nodes[node, CNT] -= 1
        return
    nx = nodes[node, NEXT]
    c = nodes[node, CNT]
    if nx < 0 or nodes[nx, CNT] < c - 1:
        pv = nodes[node, PREV]
        if pv >= 0 and nodes[pv, CNT] <= c:  # split off from its group into a new one behind it
            orig = nodes[node, GRP]
            g = new_group(groups, meta, node)
            groups[g, GPREV] = orig
            if groups[orig, GNEXT] >= 0:
                groups[g, GNEXT] = groups[orig, GNEXT]
                groups[groups[g, GNEXT], GPREV] = g
            groups[orig, GNEXT] = g
            gset(nodes, groups, meta, node, g)
        nodes[node, CNT] = c - 1
    elif nodes[nx, CNT] == c - 1:
        groups[nodes[nx, GRP], GHEAD] = node
        g = nodes[node, GRP]
        if groups[g, GHEAD] == node:
            if groups[g, GPREV] >= 0:
                groups[groups[g, GPREV], GNEXT] = groups[g, GNEXT]
            groups[groups[g, GNEXT], GPREV] = groups[g, GPREV]
        gset(nodes, groups, meta, node, nodes[nx, GRP])
        nodes[node, CNT] = c - 1
    else:
        other_group = groups[nodes[node, GRP], GNEXT]
        remove_from_siblings(nodes, groups, meta, node)
        nodes[node, CNT] = c - 1
        if other_group < 0:
            insert_after(nodes, groups, meta, node, nodes[nodes[node, PAR], TAIL])
        else:
            insert_before(nodes, groups, meta, node, groups[other_group, GHEAD])


# ---- building ------------------------------------------------------------------------------------------


@inline
def token_at(nodes, tokens, seqtab, node, offset):
    return tokens[seqtab[nodes[node, REF], SSTART] + nodes[node, END] - nodes[node, LEN] + offset]


@inline
def clear_tables(nodes, chash, ehash, meta, seqtab, actmeta, keep):
    """Empty the tree in O(1): counters, free lists, the root's row and the hash tables (by generation; other
    rows are initialised when taken).  ``keep`` >= 0: that open sequence's slot stays, emptied."""
    h_clear(chash)
    if meta[M_ENDPOINTS]:
        h_clear(ehash)
    meta[M_NFREE], meta[M_NHWM], meta[M_GFREE], meta[M_GHWM] = -1, 1, -1, 0
    meta[M_EFREE], meta[M_EHWM], meta[M_CLIVE], meta[M_ELIVE] = -1, 0, 0, 0
    for f in range(NODE_FIELDS):
        nodes[0, f] = 0 if f == CNT or f == LEN or f == END else -1
    if keep >= 0:
        seqtab[keep, SLEN] = 0
        actmeta[seqtab[keep, SROW], 0] = 0
        actmeta[seqtab[keep, SROW], 1] = 0


@kernel
def k_clear(nodes, chash, ehash, meta, seqtab, actmeta):
    """clear_tables for ArrayTree.clear (no sequence kept)."""
    clear_tables(nodes, chash, ehash, meta, seqtab, actmeta, -1)


@inline
def extend_suffix(nodes, groups, eps, chash, ehash, meta, tokens, seqtab, node, token, slot, n):
    """tree.SuffixTree._extend_suffix on rows."""
    child = h_get(chash, ckey(node, token))
    is_root = node == 0
    if child < 0:
        if nodes[node, CNT] == 1 and not is_root:  # a leaf only this suffix reaches: grow it
            nodes[node, LEN] += 1
            nodes[node, END] = n
            ep_set(nodes, eps, ehash, meta, node, slot, n)
            return node
        new = new_node(nodes, meta, 1, 1, slot, n, node)
        ep_set(nodes, eps, ehash, meta, new, slot, n)
        meta[M_CLIVE] += h_put(chash, ckey(node, token), new)
        if not is_root:
            ep_del(nodes, eps, ehash, meta, node, slot)
        if nodes[node, HEAD] < 0:
            nodes[node, HEAD] = new
            nodes[node, TAIL] = new
            gset(nodes, groups, meta, new, new_group(groups, meta, new))
        else:
            insert_after(nodes, groups, meta, new, nodes[node, TAIL])
        return new
    if (
        nodes[node, CNT] == nodes[child, CNT] + 1 and not is_root
    ):  # node's only child; this suffix ends at node
        if nodes[child, LEN] == 1:  # fuse node into child
            parent = nodes[node, PAR]
            key = token_at(nodes, tokens, seqtab, node, 0)
            nodes[child, CNT] += 1
            nodes[child, LEN] = nodes[node, LEN] + 1
            nodes[child, REF] = slot
            nodes[child, END] = n
            ep_set(nodes, eps, ehash, meta, child, slot, n)
            nodes[child, PAR] = parent
            replace_in_siblings(nodes, groups, meta, node, child)
            h_put(chash, ckey(parent, key), child)
            meta[M_CLIVE] -= h_del(chash, ckey(node, token))
            free_node(nodes, groups, eps, ehash, meta, node)
            return child
        nodes[node, LEN] += 1  # node grows into child by one token
        if meta[M_ENDPOINTS]:
            eps[ep_find(nodes, eps, ehash, node, slot), EEND] += 1
        nodes[node, REF] = slot
        nodes[node, END] = n
        nodes[child, LEN] -= 1
        first = token_at(nodes, tokens, seqtab, child, 0)
        if first != token:
            h_del(chash, ckey(node, token))
            h_put(chash, ckey(node, first), child)
        return node
    if nodes[child, LEN] == 1:
        if not is_root:
            ep_del(nodes, eps, ehash, meta, node, slot)
        ep_set(nodes, eps, ehash, meta, child, slot, n)
        increment_count(nodes, groups, meta, child)
        return child
    new = new_node(nodes, meta, nodes[child, CNT], 1, slot, n, node)  # split child after its first token
    replace_in_siblings(nodes, groups, meta, child, new)
    h_put(chash, ckey(node, token), new)
    nodes[child, LEN] -= 1
    meta[M_CLIVE] += h_put(chash, ckey(new, token_at(nodes, tokens, seqtab, child, 0)), child)
    nodes[child, PAR] = new
    if not is_root:
        ep_del(nodes, eps, ehash, meta, node, slot)
    ep_set(nodes, eps, ehash, meta, new, slot, n)
    nodes[new, HEAD] = child
    nodes[new, TAIL] = child
    gset(nodes, groups, meta, child, new_group(groups, meta, child))
    increment_count(nodes, groups, meta, new)
    return new


@kernel
def k_extend(nodes, groups, eps, chash, ehash, meta, tokens, seqtab, active, actmeta, slot, new, restart):
    """Append ``new`` to open sequence ``slot`` (tree.SuffixTree.append per token, active nodes in a ring)
    while the tables have room for one more token (else ArrayTree._make_room grows them); the number appended.
    ``restart``: first empty the tree but for that sequence, itself emptied (ArrayTree.restart: a request's
    start is one call)."""
    if restart:
        clear_tables(nodes, chash, ehash, meta, seqtab, actmeta, slot)
    depth = active.shape[1]
    row = seqtab[slot, SROW]
    base = seqtab[slot, SSTART]
    need = depth + 1
    for t in range(len(new)):
        if (
            seqtab[slot, SLEN] >= seqtab[slot, SCAP]
            or meta[M_NHWM] + need > len(nodes)
            or meta[M_GHWM] + 3 * need > len(groups)
            or 2 * (meta[M_CLIVE] + need) > len(chash) - 1
            or (
                meta[M_ENDPOINTS]
                and (meta[M_EHWM] + need > len(eps) or 2 * (meta[M_ELIVE] + 2 * need) > len(ehash) - 1)
            )
        ):
            return t
        token = new[t]
        n0 = seqtab[slot, SLEN]
        nodes[0, CNT] += 1  # the new suffix starts at the root (no endpoint kept there: it moves on at once)
        start, count = actmeta[row, 0], actmeta[row, 1]
        if count == depth:  # the oldest suffix reached max_depth: it stops growing
            start = start + 1 if start + 1 < depth else 0
            count -= 1
        k = start + count
        active[row, k - depth if k >= depth else k] = 0
        count += 1
        actmeta[row, 0], actmeta[row, 1] = start, count
        tokens[base + n0] = token
        n = n0 + 1
        seqtab[slot, SLEN] = n
        k = start
        for _ in range(count):
            node = active[row, k]
            if nodes[node, CNT] == 1 and node != 0:  # a leaf only this suffix reaches: grow it
                nodes[node, LEN] += 1
                nodes[node, END] = n
                r = nodes[node, EPH]
                if r >= 0 and eps[r, ESEQ] == slot:  # its one endpoint, found without the hash table
                    eps[r, EEND] = n
                else:
                    ep_set(nodes, eps, ehash, meta, node, slot, n)
            else:
                active[row, k] = extend_suffix(
                    nodes, groups, eps, chash, ehash, meta, tokens, seqtab, node, token, slot, n
                )
            k = k + 1 if k + 1 < depth else 0
    return len(new)


@inline
def free_subtree(nodes, groups, eps, chash, ehash, meta, tokens, seqtab, top):
    """Free ``top`` (already out of its parent) and everything below it, children first, without a stack: a
    node's first child is unlinked and descended into; a node without children left is freed, then its parent
    is resumed."""
    node = top
    while True:
        c = nodes[node, HEAD]
        if c >= 0:
            meta[M_CLIVE] -= h_del(chash, ckey(node, token_at(nodes, tokens, seqtab, c, 0)))
            nodes[node, HEAD] = nodes[c, NEXT]
            node = c
            continue
        parent = nodes[node, PAR]
        free_node(nodes, groups, eps, ehash, meta, node)
        if node == top:
            return
        node = parent


@kernel
def k_remove(nodes, groups, eps, chash, ehash, meta, tokens, seqtab, slot, path):
    """tree.SuffixTree.remove on rows (any leaf below a node serves to re-point it); ``path``: scratch for
    max_depth + 1 nodes."""
    base, n = seqtab[slot, SSTART], seqtab[slot, SLEN]
    for start in range(n):
        node = 0
        nodes[0, CNT] -= 1
        idx = start
        plen = 0
        while idx < n:
            tok = tokens[base + idx]
            child = h_get(chash, ckey(node, tok))
            if child < 0:
                break
            if nodes[child, CNT] > 1:
                decrement_count(nodes, groups, meta, child)
            else:  # the child and its whole subtree go
                remove_from_siblings(nodes, groups, meta, child)
                meta[M_CLIVE] -= h_del(chash, ckey(node, tok))
                free_subtree(nodes, groups, eps, chash, ehash, meta, tokens, seqtab, child)
                break
            ep_del(nodes, eps, ehash, meta, child, slot)
            idx += nodes[child, LEN]
            node = child
            path[plen] = node
            plen += 1
        only = nodes[node, HEAD]
        if node != 0 and only >= 0 and only == nodes[node, TAIL] and nodes[node, CNT] == nodes[only, CNT]:
            # no suffix ends at node any more: merge it into its child
            key = token_at(nodes, tokens, seqtab, node, 0)
            old_key = token_at(nodes, tokens, seqtab, only, 0)
            parent = nodes[node, PAR]
            nodes[only, LEN] += nodes[node, LEN]
            nodes[only, PAR] = parent
            replace_in_siblings(nodes, groups, meta, node, only)
            h_put(chash, ckey(parent, key), only)
            meta[M_CLIVE] -= h_del(chash, ckey(node, old_key))
            free_node(nodes, groups, eps, ehash, meta, node)
            node = only
            path[plen - 1] = node
        leaf, distance = node, 0
        while nodes[leaf, HEAD] >= 0:
            leaf = nodes[leaf, HEAD]
            distance += nodes[leaf, LEN]
        r = nodes[leaf, EPH]
        if r < 0 or ep_get(nodes, eps, ehash, leaf, slot) >= 0:
            continue  # visited again later in this removal
        ref, end = eps[r, ESEQ], eps[r, EEND] - distance
        for k in range(plen - 1, -1, -1):
            p = path[k]
            if nodes[p, REF] == slot:
                nodes[p, REF] = ref
                nodes[p, END] = end
            end -= nodes[p, LEN]


# ---- lookup and speculation ----------------------------------------------------------------------------


@inline
def match_positions(nodes, chash, tokens, seqtab, ctx, start, pos_node, pos_off, npos):
    """Append the positions of ctx's tails of length start, start + 1, ... < len(ctx) while they occur."""
    n = len(ctx)
    for p in range(start, n):
        i = n - p
        node = h_get(chash, ckey(0, ctx[i]))
        if node < 0:
            break
        k = 0
        while True:
            length = nodes[node, LEN]
            k = min(length, n - i)
            s = seqtab[nodes[node, REF], SSTART] + nodes[node, END] - length
            for j in range(k):
                if tokens[s + j] != ctx[i + j]:
                    node = -1
                    break
            if node < 0:
                break
            i += k
            if i == n:
                break
            node = h_get(chash, ckey(node, ctx[i]))
            if node < 0:
                break
        if node < 0:
            break
        pos_node[npos] = node
        pos_off[npos] = k
        npos += 1
    return npos


@inline
def tail_positions(nodes, chash, tokens, seqtab, active, actmeta, slot, ctx, pos_node, pos_off):
    """SuffixTree.tail_positions: from ``slot``'s active nodes when ctx ends with that open sequence."""
    m = len(ctx)
    if slot < 0 or seqtab[slot, SROW] < 0 or m == 0:
        return 0
    length, base = seqtab[slot, SLEN], seqtab[slot, SSTART]
    if length == 0 or tokens[base + length - 1] != ctx[m - 1]:
        return 0
    n = min(length, m)
    for j in range(n):
        if tokens[base + length - n + j] != ctx[m - n + j]:
            return 0
    row = seqtab[slot, SROW]
    depth = active.shape[1]
    start, count = actmeta[row, 0], actmeta[row, 1]
    npos = min(count, n, m - 1)
    for q in range(npos):  # newest active node first: tails of length 1, 2, ...
        node = active[row, (start + count - 1 - q) % depth]
        pos_node[q] = node
        pos_off[q] = nodes[node, LEN]
    if n == length and n < m - 1:
        npos = match_positions(nodes, chash, tokens, seqtab, ctx, n + 1, pos_node, pos_off, npos)
    return npos


@inline
def _f32(x):
    return np.float64(np.float32(x))


@inline
def path_draft(nodes, tokens, seqtab, node, offset, max_tokens, min_prob, out_tok, out_prob, build):
    """SuffixTree.speculate_path (``build``) / _path_score: (number of tokens, score)."""
    score, prob, n = 0.0, 1.0, 0
    while n < max_tokens and prob >= min_prob:
        rest = nodes[node, LEN] - offset
        if rest > 0:
            k = min(rest, max_tokens - n)
            if build:
                s = seqtab[nodes[node, REF], SSTART] + nodes[node, END] - nodes[node, LEN] + offset
                for j in range(k):
                    out_tok[n + j] = tokens[s + j]
                    out_prob[n + j] = prob
            if prob == 1.0 and score < 16_777_216:
                score += k
            else:
                for _ in range(k):
                    score = _f32(score + prob)
            n += k
            offset += k
        else:
            child = nodes[node, HEAD]
            if child < 0:
                break
            prob = _f32(prob * _f32(nodes[child, CNT] / nodes[node, CNT]))
            node, offset = child, 0
    return n, score


@inline
def _heap_less(hp, hi, a, b):
    return hp[a] < hp[b] or (hp[a] == hp[b] and hi[a, 0] < hi[b, 0])


@inline
def _heap_swap(hp, hi, a, b):
    hp[a], hp[b] = hp[b], hp[a]
    for f in range(4):
        hi[a, f], hi[b, f] = hi[b, f], hi[a, f]


@inline
def _heap_push(hp, hi, size, p, order, node, off, parent):
    """Push (p, order) -> (node, off, parent) onto the min-heap of ``size`` entries; the new size."""
    i = size
    hp[i] = p
    hi[i, 0], hi[i, 1], hi[i, 2], hi[i, 3] = order, node, off, parent
    while i > 0 and _heap_less(hp, hi, i, (i - 1) // 2):
        _heap_swap(hp, hi, i, (i - 1) // 2)
        i = (i - 1) // 2
    return size + 1


@inline
def _heap_pop(hp, hi, size):
    """Move the smallest (p, order) entry to index ``size - 1``; the new size."""
    last = size - 1
    _heap_swap(hp, hi, 0, last)
    i = 0
    while True:
        small, left, right = i, 2 * i + 1, 2 * i + 2
        if left < last and _heap_less(hp, hi, left, small):
            small = left
        if right < last and _heap_less(hp, hi, right, small):
            small = right
        if small == i:
            return last
        _heap_swap(hp, hi, i, small)
        i = small


@inline
def tree_draft(nodes, tokens, seqtab, node, offset, max_tokens, min_prob, out_tok, out_par, out_prob, hp, hi):
    """SuffixTree.speculate_tree: best-first expansion on the heap (hp, hi); (number of tokens, score), or
    (-1, 0.0) when the heap is full (the caller gives a bigger one)."""
    size = _heap_push(hp, hi, 0, -1.0, 0, node, offset, -1)
    order, n, score = 1, 0, 0.0
    while size > 0 and n < max_tokens:
        size = _heap_pop(hp, hi, size)
        neg_p, nd, o, parent = hp[size], hi[size, 1], hi[size, 2], hi[size, 3]
        if o < nodes[nd, LEN]:
            out_tok[n] = token_at(nodes, tokens, seqtab, nd, o)
            out_par[n] = parent
            out_prob[n] = -neg_p
            n += 1
            score = _f32(score - neg_p)
            size = _heap_push(hp, hi, size, neg_p, order, nd, o + 1, n - 1)  # popped one, so it fits
            order += 1
        else:
            child = nodes[nd, HEAD]
            while child >= 0:
                p = _f32(_f32(-neg_p * nodes[child, CNT]) / nodes[nd, CNT])
                if p < min_prob:
                    break
                if size == len(hp):
                    return -1, 0.0
                size = _heap_push(hp, hi, size, -p, order, child, 0, parent)
                order += 1
                child = nodes[child, NEXT]
    return n, score


@kernel
def k_speculate(
    nodes,
    chash,
    tokens,
    seqtab,
    active,
    actmeta,
    slot,
    ctx,
    walk,
    order,
    max_spec,
    min_prob,
    tree,
    ints,
    probs,
    hp,
    hi,
):
    """Best draft over ``ctx``'s tails (SuffixTree.speculate_open): (tokens, score, match_len), its tokens and
    parents in rows 0-1 of ``ints`` and its probabilities in row 0 of ``probs``; (-1, 0.0, 0) when the heap
    (``hp``, ``hi``) was too small for a tree draft.  Scratch: ``ints`` rows 2-3 and ``probs`` row 1 hold a
    tree draft being scored, rows 4-5 the match positions (node, offset); both have max(max_spec, len(ctx))
    columns or more."""
    pos_node, pos_off = ints[4], ints[5]
    npos = tail_positions(nodes, chash, tokens, seqtab, active, actmeta, slot, ctx, pos_node, pos_off)
    if npos == 0 and walk:
        npos = match_positions(nodes, chash, tokens, seqtab, ctx, 1, pos_node, pos_off, 0)
    best_score, best_p, best_n, best_node, best_off, best_budget = -1.0, 0, 0, 0, 0, 0
    slack = 1 + 1e-5 if tree else 1.0
    for r in range(len(order)):
        bound, p, budget = order[r, 0], order[r, 1], order[r, 2]
        if p > npos:
            continue
        b = bound * slack
        if b < best_score or (b == best_score and p < best_p):
            break
        node, off = pos_node[p - 1], pos_off[p - 1]
        if tree:  # a tree draft is built to be scored
            n, score = tree_draft(
                nodes, tokens, seqtab, node, off, budget, min_prob, ints[2], ints[3], probs[1], hp, hi
            )
            if n < 0:
                return -1, 0.0, 0
        else:
            n, score = path_draft(
                nodes, tokens, seqtab, node, off, budget, min_prob, ints[0], probs[0], False
            )
        if score > best_score or (score == best_score and p > best_p):
            best_score, best_p, best_n = score, p, n
            best_node, best_off, best_budget = node, off, budget
            if tree:
                for i in range(n):
                    ints[0, i], ints[1, i], probs[0, i] = ints[2, i], ints[3, i], probs[1, i]
    if best_p == 0:
        return 0, 0.0, 0
    if not tree:
        best_n, best_score = path_draft(
            nodes, tokens, seqtab, best_node, best_off, best_budget, min_prob, ints[0], probs[0], True
        )
        for i in range(best_n):
            ints[1, i] = i - 1
    return best_n, best_score, best_p


@jit
def k_to_arrays(nodes, eps, slot_index):
    """Breadth-first flattening in sibling order (artifact.tree_to_arrays): parent, count, length, ref, end and
    endpoint (node, sequence, end) rows, sequences as indices through ``slot_index``."""
    out = np.empty((len(nodes), 5), np.int64)
    queue = np.empty(len(nodes), np.int64)
    out[0, 0], out[0, 1], out[0, 2], out[0, 3], out[0, 4] = -1, nodes[0, CNT], 0, -1, 0
    queue[0], head, tail = 0, 0, 1
    ep_rows = []
    while head < tail:
        node = queue[head]
        r = nodes[node, EPH]
        while r >= 0:
            ep_rows.append((head, slot_index[eps[r, ESEQ]], eps[r, EEND]))
            r = eps[r, ENEXT]
        c = nodes[node, HEAD]
        while c >= 0:
            out[tail, 0], out[tail, 1], out[tail, 2] = head, nodes[c, CNT], nodes[c, LEN]
            out[tail, 3], out[tail, 4] = slot_index[nodes[c, REF]], nodes[c, END]
            queue[tail] = c
            tail += 1
            c = nodes[c, NEXT]
        head += 1
    eout = np.empty((len(ep_rows), 3), np.int64)
    for i in range(len(ep_rows)):
        eout[i, 0], eout[i, 1], eout[i, 2] = ep_rows[i]
    return out[:tail], eout


@jit
def k_from_arrays(nodes, groups, eps, chash, ehash, meta, columns, first, ep_rows):
    """Inverse of k_to_arrays into empty tables (sequence index = slot); the first node out of count order
    (1-based), or 0."""
    nodes[0, CNT] = columns[0, 1]
    for i in range(1, len(columns)):
        p, c = columns[i, 0], columns[i, 1]
        node = new_node(nodes, meta, c, columns[i, 2], columns[i, 3], columns[i, 4], p)
        meta[M_CLIVE] += h_put(chash, ckey(p, first[i]), node)
        last = nodes[p, TAIL]
        if last < 0:
            nodes[p, HEAD] = node
            gset(nodes, groups, meta, node, new_group(groups, meta, node))
        else:
            if nodes[last, CNT] < c:
                return i
            nodes[last, NEXT] = node
            nodes[node, PREV] = last
            if nodes[last, CNT] == c:
                gset(nodes, groups, meta, node, nodes[last, GRP])
            else:
                g = new_group(groups, meta, node)
                gset(nodes, groups, meta, node, g)
                groups[g, GPREV] = nodes[last, GRP]
                groups[nodes[last, GRP], GNEXT] = g
        nodes[p, TAIL] = node
    for i in range(len(ep_rows)):
        ep_set(nodes, eps, ehash, meta, ep_rows[i, 0], ep_rows[i, 1], ep_rows[i, 2])
    return 0


# ---- the Python side -----------------------------------------------------------------------------------


def _through_entry(name: str, kernel):
    """``kernel`` for this module's global ``name``: called through numba's dispatcher once, which then rebinds
    ``name`` to the compiled entry point.  The dispatcher types every argument on every call (~5 µs for the 14
    arguments here, as much as a whole append) and a Python wrapper would add a frame to every call; ArrayTree
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
    """Read-only view seq id -> token array (a copy) of an :class:`ArrayTree`'s sequences."""

    def __init__(self, tree: ArrayTree) -> None:
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


class ArrayTree:
    """:class:`.tree.SuffixTree` with the same methods and drafts, in numpy tables updated by numba kernels.

    >>> t = ArrayTree(max_depth=8); t.extend(0, [1, 2, 3, 1, 2, 4])
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
    def for_request(cls, max_depth: int) -> ArrayTree:
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
        """:meth:`.tree.SuffixTree.speculate_open` (same arguments, same draft)."""
        slot = -1 if seq_id is None else self._slot.get(seq_id, -1)
        ctx = _tokens(context)
        order = _order_array(self.max_depth, max_spec, factor, offset)
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
    ) -> ArrayTree:
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


_ORDERS: dict[tuple, np.ndarray] = {}


def _order_array(max_depth: int, max_spec: int, factor: float, offset: float) -> np.ndarray:
    """tree._search_order for every match length < max_depth as an (n, 3) int64 array (kernels skip lengths
    beyond the positions found: a filtered sorted list stays sorted)."""
    key = (max_depth, max_spec, factor, offset)
    if (out := _ORDERS.get(key)) is None:
        rows = _search_order(max_depth, max_depth, max_spec, factor, offset)
        out = _ORDERS[key] = np.array(rows, np.int64).reshape(-1, 3)
    return out
