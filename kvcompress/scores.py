"""Attention probabilities of query rows over everything a ``TaleLayer`` holds (exact tokens and compressed
tiers, scored in coefficient space by ``kvcompress.kernels``), and the significance they give its exact tokens.

Both the attention pass (``kvcompress.attention``) and a layer settling a recorded pass (``TaleLayer.settle``,
which observes the held queries later) use them, so they live below both: this module reads the layer through its
methods and imports ``kvcompress.cache`` for type hints only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import kernels

if TYPE_CHECKING:
    from .cache import TaleLayer

QUERY_CHUNK = 512  # query rows per chunk: a long prefill never materializes the full q x n score matrix


def mask_rows(allowed: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """Query rows ``rows`` of a ``(b, 1, q, n)`` mask (None, every key visible, stays None)."""
    return None if allowed is None else allowed[:, :, rows]


def observe(layer: TaleLayer, query: torch.Tensor, allowed: torch.Tensor | None, scaling: float) -> None:
    """Record the significance ``query`` rows (``allowed``: their ``(b, 1, q, length)`` mask, None = every key
    visible) give ``layer``'s exact tokens."""
    g = query.shape[1] // layer.exact_k.shape[1]
    n_exact = layer.exact_k.shape[-2]
    for i in range(0, query.shape[-2], QUERY_CHUNK):
        rows = slice(i, i + QUERY_CHUNK)
        probs, _, exact_allowed, visible = column_probs(
            layer, query[:, :, rows], mask_rows(allowed, rows), scaling, g
        )
        layer.record_significance(probs[..., :n_exact], exact_allowed, visible, g)


def column_probs(layer: TaleLayer, query: torch.Tensor, allowed: torch.Tensor | None, scaling: float, g: int):
    """Attention probabilities of a chunk of queries over ``[exact | tier 0 | tier 1 | ...]`` columns.

    One float32 buffer holds every column, so the tier kernels write their scores in place and one softmax
    runs over it (no per-tier temporaries, no concatenation).  Returns ``(probs, tiers, exact_allowed,
    visible)``: ``probs`` ``(b, h, g*q, n_exact + n_compressed)`` with the query heads of a KV head folded
    into rows, ``tiers`` the stored tiers with the offset of their columns, ``exact_allowed`` the exact
    columns of the mask and ``visible`` the keys each row sees.  ``allowed=None`` (every row sees every key,
    an unpadded decode step) skips all mask work: ``exact_allowed`` is then None and ``visible`` a number.
    """
    b, hq, q, d = query.shape
    h = hq // g
    qf = query.float().reshape(b, h, g * q, d) * scaling  # query heads of one KV head folded into rows
    n_exact = layer.exact_k.shape[-2]
    scores = qf.new_empty(b, h, g * q, n_exact + layer.n_compressed)
    exact_scores = qf @ layer.exact_k.float().transpose(-1, -2)
    if allowed is None:
        visible, exact_allowed = layer.length, None
        scores[..., :n_exact] = exact_scores
    else:
        allowed = allowed.unsqueeze(2).expand(b, 1, g, q, allowed.shape[-1]).reshape(b, 1, g * q, -1)
        visible = allowed.sum(-1, keepdim=True).clamp_min(1)
        exact_allowed = layer.exact_columns(allowed)
        scores[..., :n_exact] = exact_scores.masked_fill(~exact_allowed, float("-inf"))

    tiers, offset = [], n_exact
    stored = [t for t in range(len(layer.policy.tiers)) if layer.tier_k[t] is not None]
    if stored:
        s, c = layer.n_sinks, layer.n_compressed
        comp_allowed = None if allowed is None else allowed[..., s : s + c]
        needs_mask = comp_allowed is not None and not bool(comp_allowed.all())
        q_basis = qf @ layer.key_query_map  # (b, h, g*q, d): queries in the key basis
        for t in stored:
            n = len(layer.tier_k[t])
            kernels.tier_scores(q_basis, layer.tier_k[t], scores, offset)
            if needs_mask:
                pos = layer.tier_positions(t).unsqueeze(2).expand(b, h, g * q, -1)
                hidden = ~torch.gather(comp_allowed.expand(b, h, -1, -1), -1, pos)
                scores[..., offset : offset + n].masked_fill_(hidden, float("-inf"))
            tiers.append((t, offset))
            offset += n

    probs = torch.softmax(scores, dim=-1)
    if allowed is not None:
        probs.nan_to_num_(0.0)  # fully masked (padding) rows -> 0
    return probs, tiers, exact_allowed, visible
