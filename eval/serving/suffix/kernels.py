"""The suffix tree's numba kernels: the tree in flat numpy tables, updated and searched in compiled code.

One file on purpose (1,000 lines): numba's on-disk cache (``cache=True``) checks only the file that defines a
kernel (its modification time and size), not the files of the helpers it inlines, so a helper edited in another
file would leave every process loading the old kernel from ``__pycache__``.  Every kernel and every helper it
inlines therefore live here; :mod:`.tree` is the Python class around them, :mod:`.draft` the arithmetic they share.

The tree.  Conceptually a trie of every suffix of every stored sequence, cut at ``max_depth`` tokens, whose node
counts say how many of those (truncated) suffixes pass through or end at the node.  Chains of single-child nodes
with equal counts are compressed into one node that points into a stored sequence (its tokens are the ``LEN``
tokens of sequence ``REF`` ending at ``END``).  The compressed form is canonical: a node boundary exists exactly
where the trie branches or where a suffix ends, so every suffix ends at the end of a node.  The rules are those of
arctic-inference's C++ ``SuffixTree`` (the reference SuffixDecoding implementation), so drafts are the same token
for token (tests/eval/serving/suffix/test_arctic_reference.py):

* each still-growing suffix of a sequence is held as the node it ends at (its *active nodes*, a ring per open
  sequence), which makes appending O(max_depth) and gives the match position of every tail in O(1);
* each node records where suffixes end in it (endpoints: sequence -> end index), so removing a sequence
  re-points the nodes that referenced it to a live sequence and the removed tokens are freed;
* children are kept in a list ordered by decreasing count (equal counts grouped, ties in the order the
  reference's updates produce), so the most frequent child is ``HEAD`` and tree drafts stop early;
* probabilities and scores are computed in float32 in the reference's order of operations.

Layout: node fields are the columns of one int32 table (``NODE_FIELDS``); a node's children are found in
an open-addressing hash table keyed by (parent, token), its suffix endpoints in a linked list of records
(found by (node, sequence slot) in a second hash table when a node has two or more); equal-count sibling
groups are rows of a group table, reference-counted by their members.  Freed rows go on free lists (linked
through the ``NEXT`` column).  Each sequence's tokens live in a segment of one token pool (moved to the end,
doubled, when it outgrows its segment); removed and moved-away segments are reclaimed by compaction.  Kernels
never grow a table: appending stops before a token that might not fit (one token adds at most max_depth + 1
rows anywhere), the Python side grows what is short and resumes.  A request's tree keeps no endpoints (only
removal and artifacts read them) and is emptied in O(1) (counters, the root's row, and the hash tables by a
generation step).  The first use compiles the kernels (about a minute and a half; numba caches them in
``__pycache__`` for later processes, which then load in seconds).
"""

from __future__ import annotations

import numba
import numpy as np

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
# finished request's tree is reused without touching its rows: SuffixTree.restart, clear).


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


# ---- the ordered sibling list (a port of the reference's linked-list updates, on rows) ----------------
# A node's children are a doubly linked list (HEAD/TAIL, NEXT/PREV) in decreasing count; runs of equal counts
# are groups (GRP), whose GHEAD is the run's first node.  A count change moves a node to the front or the back
# of its new run in the reference's order, which decides ties between equally frequent children.


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
    """clear_tables for SuffixTree.clear (no sequence kept)."""
    clear_tables(nodes, chash, ehash, meta, seqtab, actmeta, -1)


@inline
def extend_suffix(nodes, groups, eps, chash, ehash, meta, tokens, seqtab, node, token, slot, n):
    """Extend the suffix of ``slot`` that ends at the end of ``node`` by ``token`` (the sequence's token n - 1);
    the node it ends at now.  A leaf only this suffix reaches grows; a node whose only child continues the suffix
    fuses into that child (child of length 1) or grows into it by one token; an existing child of length 1 takes
    the suffix; a longer child is split after its first token; otherwise a new leaf is added."""
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
    """Append ``new`` to open sequence ``slot`` (per token: a new suffix at the root, the oldest one
    dropped at max_depth, every active suffix extended by the token; active nodes in a ring) while the tables have
    room for one more token (else SuffixTree._make_room grows them); the number appended.  ``restart``: first
    empty the tree but for that sequence, itself emptied (SuffixTree.restart: a request's
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
    """Remove every suffix of ``slot``: walk each from the root decrementing counts (a node reached only by it
    goes with its subtree), merge a node no suffix ends at any more into its only child, and re-point the nodes
    on the walk that referenced ``slot`` to a live sequence found through a leaf's endpoint (any leaf below a
    node serves).  ``path``: scratch for max_depth + 1 nodes."""
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
    """Positions of ``ctx``'s tails (lengths 1 .. len(ctx) - 1) from open sequence ``slot``'s active nodes, O(1)
    each, when ctx ends with that sequence (tails reaching back past its start are walked); 0 when it does not."""
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
    """Path draft: follow the most frequent child while the probability stays >= min_prob; (number of tokens,
    score), the draft written to out_tok/out_prob only with ``build`` (drafts are scored first, the winner built)."""
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
    """Tree draft: best-first expansion, the ``max_tokens`` most probable continuations (each with its
    ancestors), on the heap (hp, hi); (number of tokens, score), or
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
    """Best draft over ``ctx``'s tails (SuffixTree.speculate_open): the highest score, ties to the longer match,
    match lengths tried in ``order`` (draft.search_order) until none left can win.  Returns (tokens, score,
    match_len), its tokens and parents in rows 0-1 of ``ints`` and its probabilities in row 0 of ``probs``;
    (-1, 0.0, 0) when the heap
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
