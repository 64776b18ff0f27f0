"""Fused kernels for a decode step over bit-packed tier coefficients (numba).

Why: in PyTorch, every decode step unpacks each tier's codes into float tensors (several temporaries the
size of the tier) before the matmul, so a compressed cache does more memory traffic per step than the full
cache it replaces.  These kernels read each packed byte once and never unpack it:

- ``tier_scores``: ``q · ĉ`` for every stored token, ``ĉ = codes · scale + zero`` per group, computed as
  ``Σ_g scale_g (codes_g · q_g) + zero_g Σ q_g``.  For 2/4-bit codes ``codes_g · q_g`` is a sum of table
  lookups, one per byte: ``table[j, byte]`` holds that byte's ``8 // bits`` codes dotted with the query's
  matching components, built once per step (256 entries a byte position), so a token costs one lookup a
  byte instead of unpacking and multiplying every code.  8-bit codes, and tiers too short to amortize
  the tables (``TABLE_TOKENS``), are unpacked in registers and dotted directly.
- ``tier_values``: ``Σ_n p_n ĉ_n``.  The transpose of the same trick: each token adds its weight
  ``p_n scale_n`` to a histogram bin per byte (``hist[j, byte]``), the zero points to one sum per group,
  and the bins are expanded into coefficients once per step.
- Channel scales (one scale and zero per rank position for a group of tokens, ``quant.quantize`` with
  ``token_group``): ``q · ĉ = (q ⊙ scale_g) · codes + q · zero_g``, so per group the query is scaled once;
  values accumulate ``Σ p codes`` and ``Σ p`` per group and apply the group's scale and zero once.  A group's
  codes are unpacked once into a rank-major block (``group_codes``), so both the unpacking and the products
  run along tokens over contiguous memory: ~2x faster than unpacking and dotting token by token, whose few
  bytes a token leave the vector units idle.  (Byte tables would be rebuilt per group: no gain.)
- Scales and zero points stay fp16 in memory (numba has no float16): the kernels read their bits as
  uint16 through a 65536-entry float32 table (``HALF``), so no per-step conversion of whole tiers.

Both write into slices of buffers the caller owns (``out[..., offset:offset + n]`` for scores, the first
``rank`` columns for values), so the attention of a decode step allocates no per-tier temporaries.  They
serve the few query rows of a decode or verify step (``SMALL_ROWS``); a prefill chunk has hundreds of rows
and goes to the dequantize + matmul path, where BLAS wins.  Without numba, for unquantized tiers, or for
quantization groups that split a byte, the same functions take that path, so results never depend on the
extra (``tests/kvcompress/test_tale.py`` compares both).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba.extending import register_jitable

from . import quant

SMALL_ROWS = 16  # query rows (query heads x tokens) up to which the fused kernels are used
TABLE_TOKENS = 1024  # tokens from which a 2/4-bit tier uses byte tables (256 entries a byte to build)

HALF = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@functools.cache
def _compiled(bits: int) -> tuple:
    """``(scores, values)`` kernels with ``bits`` fixed at compile time: the unpacking loops then have constant
    shifts and trip counts and vectorize (a runtime bit width measured ~10x slower for 8-bit codes)."""
    per, low = 8 // bits, (1 << bits) - 1

    @register_jitable  # plain function in the closure: the kernels stay cacheable
    def unpack(packed, lo, hi, codes):  # pragma: no cover - compiled
        """Bytes ``lo..hi`` of one token into ``codes[0:]`` (float32), ``per`` codes a byte, lowest bits first."""
        for j in range(hi - lo):
            byte = packed[lo + j]
            for k in range(per):
                codes[j * per + k] = (byte >> (k * bits)) & low

    @register_jitable  # plain function in the closure: the kernels stay cacheable
    def byte_tables(q, nbytes, table):  # pragma: no cover - compiled
        """``table[i, j, v]``: byte value ``v`` at byte position ``j`` decoded and dotted with row ``i`` of ``q``."""
        for i in range(q.shape[0]):
            for j in range(nbytes):
                for v in range(256):
                    s = np.float32(0.0)
                    for k in range(per):
                        s += np.float32((v >> (k * bits)) & low) * q[i, j * per + k]
                    table[i, j, v] = s

    @register_jitable  # plain function in the closure: the kernels stay cacheable
    def group_codes(packed, b, h, t0, nt, pb, ct):  # pragma: no cover - compiled
        """Codes of tokens ``t0..t0+nt`` of head ``(b, h)`` into ``ct[c, :nt]`` (float32), one row a rank position.

        Bytes are first transposed to ``pb[j, :nt]``, so the shifts and masks run along tokens over contiguous
        memory (vectorized) instead of code by code within one token's few bytes."""
        for tt in range(nt):
            row = packed[b, h, t0 + tt]
            for j in range(row.shape[0]):
                pb[j, tt] = row[j]
        for j in range(pb.shape[0]):
            src = pb[j]
            for k in range(per):
                dst = ct[j * per + k]
                for tt in range(nt):
                    dst[tt] = (src[tt] >> (k * bits)) & low

    @register_jitable  # plain function in the closure: the kernels stay cacheable
    def group_buffers(packed, starts):  # pragma: no cover - compiled
        """Scratch for ``group_codes`` sized for the longest group, rank rows padded with zeros to a multiple of 4."""
        n, nbytes, longest = packed.shape[2], packed.shape[3], 0
        for g in range(starts.shape[0]):
            stop = starts[g + 1] if g + 1 < starts.shape[0] else n
            longest = max(longest, stop - starts[g])
        rows = -(-nbytes * per // 4) * 4
        return np.empty((nbytes, longest), np.uint8), np.zeros((rows, longest), np.float32)

    @numba.njit(cache=True, fastmath=True, nogil=True)
    def scores(packed, scale, zero, q, tables, half, out, offset):  # pragma: no cover - compiled
        n, nbytes, rows, groups = packed.shape[2], packed.shape[3], q.shape[2], scale.shape[3]
        size, per_group = nbytes * per // groups, nbytes // groups
        table = np.empty((rows, nbytes if tables else 0, 256), np.float32)
        qsum, codes = np.empty((rows, groups), np.float32), np.empty(nbytes * per, np.float32)
        for b in range(packed.shape[0]):
            for h in range(packed.shape[1]):
                qh, oh = q[b, h], out[b, h]
                for i in range(rows):
                    for g in range(groups):
                        qsum[i, g] = qh[i, g * size : (g + 1) * size].sum()
                if tables:
                    byte_tables(qh, nbytes, table)
                for g in range(groups):  # groups outermost: one flat pass over the tokens per group
                    lo, hi, c0 = g * per_group, (g + 1) * per_group, g * size
                    for t in range(n):
                        row = packed[b, h, t]
                        if not tables:
                            unpack(row, lo, hi, codes)
                        sc, zc = half[scale[b, h, t, g]], half[zero[b, h, t, g]]
                        for i in range(rows):
                            dot = np.float32(0.0)
                            if tables:
                                for j in range(lo, hi):
                                    dot += table[i, j, row[j]]
                            else:  # a group's codes and query components from 0: this loop vectorizes
                                qg = qh[i, c0 : c0 + size]
                                for c in range(size):
                                    dot += codes[c] * qg[c]
                            value = sc * dot + zc * qsum[i, g]
                            oh[i, offset + t] = value if g == 0 else oh[i, offset + t] + value

    @numba.njit(cache=True, fastmath=True, nogil=True)
    def values(packed, scale, zero, p, tables, half, out, offset):  # pragma: no cover - compiled
        n, nbytes, rows, groups = packed.shape[2], packed.shape[3], p.shape[2], scale.shape[3]
        size, per_group = nbytes * per // groups, nbytes // groups
        hist = np.zeros((rows, nbytes if tables else 0, 256), np.float32)
        zsum, codes = np.zeros((rows, groups), np.float32), np.empty(nbytes * per, np.float32)
        for b in range(packed.shape[0]):
            for h in range(packed.shape[1]):
                ph, oh = p[b, h], out[b, h]
                for g in range(groups):
                    lo, hi, c0 = g * per_group, (g + 1) * per_group, g * size
                    for t in range(n):
                        row = packed[b, h, t]
                        if not tables:
                            unpack(row, lo, hi, codes)
                        sc, zc = half[scale[b, h, t, g]], half[zero[b, h, t, g]]
                        for i in range(rows):
                            w = ph[i, offset + t]
                            zsum[i, g] += w * zc
                            ws = w * sc
                            if tables:
                                for j in range(lo, hi):
                                    hist[i, j, row[j]] += ws
                            else:
                                og = oh[i, c0 : c0 + size]
                                for c in range(size):
                                    og[c] += ws * codes[c]
                for i in range(rows):  # expand the histograms, add the zero points, reset both
                    for j in range(hist.shape[1]):
                        for v in range(256):
                            w = hist[i, j, v]
                            if w != 0.0:
                                hist[i, j, v] = 0.0
                                for k in range(per):
                                    oh[i, j * per + k] += w * np.float32((v >> (k * bits)) & low)
                    for g in range(groups):
                        oh[i, g * size : (g + 1) * size] += zsum[i, g]
                        zsum[i, g] = 0.0

    @numba.njit(cache=True, fastmath=True, nogil=True)
    def channel_scores(packed, scale, zero, starts, q, half, out, offset):  # pragma: no cover - compiled
        n, rank, rows, groups = packed.shape[2], packed.shape[3] * per, q.shape[2], scale.shape[2]
        pb, ct = group_buffers(packed, starts)
        qs = np.zeros(ct.shape[0], np.float32)  # padding rank positions stay 0
        for b in range(packed.shape[0]):
            for h in range(packed.shape[1]):
                qh, oh = q[b, h], out[b, h]
                for g in range(groups):
                    t0 = starts[g]
                    nt = (starts[g + 1] if g + 1 < groups else n) - t0
                    group_codes(packed, b, h, t0, nt, pb, ct)
                    for i in range(rows):
                        o = oh[i, offset + t0 : offset + t0 + nt]
                        z = np.float32(0.0)
                        for c in range(rank):
                            qs[c] = qh[i, c] * half[scale[b, h, g, c]]
                            z += qh[i, c] * half[zero[b, h, g, c]]
                        o[:] = z
                        for c in range(0, ct.shape[0], 4):  # four rank positions a pass over the scores
                            s0, s1, s2, s3 = qs[c], qs[c + 1], qs[c + 2], qs[c + 3]
                            c0, c1, c2, c3 = ct[c], ct[c + 1], ct[c + 2], ct[c + 3]
                            for tt in range(nt):
                                o[tt] += s0 * c0[tt] + s1 * c1[tt] + s2 * c2[tt] + s3 * c3[tt]

    @numba.njit(cache=True, fastmath=True, nogil=True)
    def channel_values(packed, scale, zero, starts, p, half, out, offset):  # pragma: no cover - compiled
        n, rank, rows, groups = packed.shape[2], packed.shape[3] * per, p.shape[2], scale.shape[2]
        pb, ct = group_buffers(packed, starts)
        for b in range(packed.shape[0]):
            for h in range(packed.shape[1]):
                ph, oh = p[b, h], out[b, h]
                for g in range(groups):
                    t0 = starts[g]
                    nt = (starts[g + 1] if g + 1 < groups else n) - t0
                    group_codes(packed, b, h, t0, nt, pb, ct)
                    for i in range(rows):
                        w = ph[i, offset + t0 : offset + t0 + nt]
                        psum = w.sum()
                        for c in range(rank):
                            codes, d = ct[c], np.float32(0.0)
                            for tt in range(nt):
                                d += w[tt] * codes[tt]
                            oh[i, c] += half[scale[b, h, g, c]] * d + half[zero[b, h, g, c]] * psum

    return scores, values, channel_scores, channel_values


def _fused(tier: quant.QTensor, rows: int) -> bool:
    groups = None if tier.scale is None else tier.scale.shape[-1]
    return (
        tier.bits in quant.INT_BITS
        and rows <= SMALL_ROWS
        and tier.data.device.type == "cpu"
        and len(tier) > 0
        and (tier.per_channel or tier.data.shape[-1] % groups == 0)  # every group is whole bytes
    )


def _arrays(tier: quant.QTensor) -> tuple:
    """The numpy views the kernels read (codes, fp16 bits of scale and zero), made once per stored tier.

    A tier is a new ``QTensor`` after every append, so the views are kept on it: a decode step then costs
    no tensor-to-array conversions for the (unchanged) tiers."""
    arrays = getattr(tier, "_kernel_arrays", None)
    if arrays is None:
        bits = (t.view(torch.int16).numpy().view(np.uint16) for t in (tier.scale, tier.zero))
        starts = (tier.starts.numpy(),) if tier.per_channel else ()
        arrays = tier._kernel_arrays = (tier.data.numpy(), *bits, *starts)
    return arrays


def _run(which: int, tier: quant.QTensor, rows: torch.Tensor, out: torch.Tensor, offset: int) -> None:
    """Kernel ``which`` (0 scores, 1 values) over ``tier``'s codes and fp16 scale/zero bits with float32
    ``rows``, writing into ``out``; byte tables only for per-token scales of tiers long enough to amortize
    them (``TABLE_TOKENS``)."""
    if tier.per_channel:
        _compiled(tier.bits)[2 + which](*_arrays(tier), rows.numpy(), HALF, out.numpy(), offset)
        return
    tables = tier.bits < 8 and len(tier) >= TABLE_TOKENS
    _compiled(tier.bits)[which](*_arrays(tier), rows.numpy(), tables, HALF, out.numpy(), offset)


def tier_scores(q: torch.Tensor, tier: quant.QTensor, out: torch.Tensor, offset: int) -> None:
    """Write the scores of queries ``q`` ``(b, h, rows, ≥ rank)`` (first ``rank`` components used) against a
    tier's key coefficients into ``out[..., offset : offset + n]`` (float32, contiguous ``(b, h, rows, ·)``)."""
    if _fused(tier, q.shape[-2]) and q.is_contiguous() and q.dtype == torch.float32:
        _run(0, tier, q, out, offset)
    else:
        out[..., offset : offset + len(tier)] = q[..., : tier.rank] @ quant.dequantize(tier).transpose(-1, -2)


def tier_values(p: torch.Tensor, tier: quant.QTensor, out: torch.Tensor, offset: int) -> None:
    """Add probabilities ``p[..., offset : offset + n]`` times a tier's value coefficients to
    ``out[..., :rank]`` (both float32, contiguous ``(b, h, rows, ·)``)."""
    if _fused(tier, p.shape[-2]) and p.is_contiguous() and p.dtype == torch.float32:
        _run(1, tier, p, out, offset)
    else:
        out[..., : tier.rank] += p[..., offset : offset + len(tier)] @ quant.dequantize(tier)
