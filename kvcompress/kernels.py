"""Fused unpack-and-dot kernels for a decode step over bit-packed tier coefficients (numba, the ``fast`` extra).

Why: in PyTorch, every decode step unpacks each tier's codes into float tensors (several temporaries the
size of the tier) before the matmul, so a compressed cache does more memory traffic per step than the full
cache it replaces.  These kernels read each packed byte once and accumulate straight from it:

- ``tier_scores``: ``q · ĉ`` for every stored token, ``ĉ = codes · scale + zero`` per group, computed as
  ``Σ_g scale_g (codes_g · q_g) + zero_g Σ q_g`` (the zero point costs one multiply per group);
- ``tier_values``: ``Σ_n p_n ĉ_n``, the probability-weighted sum of the coefficients.

They are used for the few query rows of a decode or verify step (``SMALL_ROWS``); a prefill chunk has
hundreds of rows and goes to the dequantize + matmul path, where BLAS wins.  Without numba installed, or
for unquantized tiers, the same functions fall back to that path, so results never depend on the extra
(``tests/test_kvcompress.py`` compares both).
"""

from __future__ import annotations

import torch

from . import quant

try:
    import numba
    import numpy as np
except ImportError:  # the `fast` extra is optional
    numba = None

SMALL_ROWS = 16  # query rows (query heads x tokens) up to which the fused kernels are used

if numba is not None:

    @numba.njit(cache=True, fastmath=True, nogil=True)
    def _unpack(row, bits, codes):  # pragma: no cover - compiled
        """One token's packed bytes into ``codes`` (float32), ``8 // bits`` codes a byte, lowest bits first."""
        per, low = 8 // bits, (1 << bits) - 1
        for j in range(row.shape[0]):
            for k in range(per):
                codes[j * per + k] = (row[j] >> (k * bits)) & low

    @numba.njit(cache=True, fastmath=True, nogil=True)
    def _scores_kernel(packed, scale, zero, q, bits, out):  # pragma: no cover - compiled
        rows, rank, groups = q.shape[2], q.shape[3], scale.shape[3]
        size = rank // groups
        codes = np.empty(rank, np.float32)
        qsum = np.empty((rows, groups), np.float32)
        for b in range(packed.shape[0]):
            for h in range(packed.shape[1]):
                for i in range(rows):
                    for g in range(groups):
                        qsum[i, g] = q[b, h, i, g * size : (g + 1) * size].sum()
                for t in range(packed.shape[2]):
                    _unpack(packed[b, h, t], bits, codes)
                    for i in range(rows):
                        total = np.float32(0.0)
                        for g in range(groups):
                            dot = np.float32(0.0)
                            for c in range(g * size, (g + 1) * size):
                                dot += codes[c] * q[b, h, i, c]
                            total += scale[b, h, t, g] * dot + zero[b, h, t, g] * qsum[i, g]
                        out[b, h, i, t] = total

    @numba.njit(cache=True, fastmath=True, nogil=True)
    def _values_kernel(packed, scale, zero, p, bits, out):  # pragma: no cover - compiled
        rows, rank, groups = p.shape[2], out.shape[3], scale.shape[3]
        size = rank // groups
        codes = np.empty(rank, np.float32)
        for b in range(packed.shape[0]):
            for h in range(packed.shape[1]):
                for t in range(packed.shape[2]):
                    _unpack(packed[b, h, t], bits, codes)
                    for i in range(rows):
                        w = p[b, h, i, t]
                        if w == 0.0:
                            continue
                        for g in range(groups):
                            ws, wz = w * scale[b, h, t, g], w * zero[b, h, t, g]
                            for c in range(g * size, (g + 1) * size):
                                out[b, h, i, c] += ws * codes[c] + wz


def _fused(tier: quant.QTensor, rows: int) -> bool:
    return (
        numba is not None
        and tier.bits in quant.INT_BITS
        and rows <= SMALL_ROWS
        and tier.data.device.type == "cpu"
        and len(tier) > 0
    )


def _run(kernel, tier: quant.QTensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``kernel`` over ``tier``'s codes with float32 scale/zero and ``rows``, filling and returning ``out``."""
    arrays = (tier.data, tier.scale.float(), tier.zero.float(), rows.float().contiguous())
    kernel(*(a.numpy() for a in arrays), tier.bits, out.numpy())
    return out


def tier_scores(q: torch.Tensor, tier: quant.QTensor) -> torch.Tensor:
    """``(b, h, rows, n)`` float32 scores of queries ``q`` ``(b, h, rows, rank)`` against a tier's key coefficients."""
    if not _fused(tier, q.shape[-2]):
        return q @ quant.dequantize(tier).transpose(-1, -2)
    return _run(_scores_kernel, tier, q, torch.empty(*q.shape[:-1], len(tier)))


def tier_values(p: torch.Tensor, tier: quant.QTensor) -> torch.Tensor:
    """``(b, h, rows, rank)``: probabilities ``p`` ``(b, h, rows, n)`` times a tier's value coefficients."""
    if not _fused(tier, p.shape[-2]):
        return p @ quant.dequantize(tier)
    return _run(_values_kernel, tier, p, torch.zeros(*p.shape[:-1], tier.rank))
