"""Reconstruction-free attention over a ``TaleLayer`` and its registration as ``attn_implementation='tale'``.

For a compressed token with key coefficients ``c`` (``k̂ = U_k[:, :r] c``) the score is
``q·k̂ = (q U_k)[:r]·c``: each query is projected once into the basis (``q U_k``, ``(…, d)``) and every tier
takes the first ``rank_t`` columns of it, so full keys are never rebuilt.  Values are folded after the
weighted sum: ``Σ_j p_j v̂_j = U_v (Σ_j p_j c_j)``; the per-tier sums are accumulated in coefficient space
(padded to ``d``) and mapped back once.  Exact tokens (sinks and window) are scored alongside, and one
softmax runs over all columns, so the result equals softmax attention over the reconstructed K/V
(``tests/kvcompress/test_tale.py`` checks this) while the transient memory is ``O(n·rank)`` instead of ``O(n·d)``.

The same pass records token significance (``TaleLayer.record_significance``) for the exact tokens and
then lets the layer compress what left the window (a pass recorded for undo keeps its queries instead and
observes at ``TaleLayer.crop``).  Tier scores and value sums of a decode step's few query rows come from
``kvcompress.kernels`` (fused byte-table / unpack-and-dot kernels when numba is installed), written into one score buffer.  A prefill over exact tokens only observes significance
from its last ``OBSERVED_QUERIES`` queries (SnapKV-style observation window) and runs the other queries
through ``sdpa``: every prompt token outside the window is then judged by the same number of queries, as a
decoded token is by the queries that arrive while it sits in the window, and prefill costs what sdpa costs.  Queries are processed in chunks so a long prefill
never materializes the full ``q × n`` score matrix.  GQA is handled by folding a KV head's query heads
into the query dimension (no ``repeat_kv``).

The attention function falls back to ``sdpa`` when the keys do not come from a ``TaleLayer`` (no cache,
or a ``DynamicCache``), so a model switched to ``'tale'`` still runs normally without a ``TaleCache``.
The mask function is transformers' ``sdpa_mask`` with the causal skip disabled: TALE needs a real mask
because its columns (exact vs. compressed) are not in one contiguous causal layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .cache import ATTN_IMPLEMENTATION, TaleLayer, observed_rows
from .scores import QUERY_CHUNK, column_probs, mask_rows


def _allowed_mask(mask: torch.Tensor | None, b: int, q: int, kv_len: int, device) -> torch.Tensor | None:
    """Boolean ``(b, 1, q, kv_len)`` mask, True = attend (accepts bool, additive float, or None = causal);
    None when every query row sees every key (an unpadded decode step), which spares the mask work.

    transformers builds one mask a forward pass and hands it to every layer, so whether it hides anything is
    decided once a pass and kept on the tensor (with its version, so an in-place edit is seen)."""
    if mask is None:
        if q == 1:
            return None
        rows = torch.arange(kv_len - q, kv_len, device=device)[:, None]
        return (torch.arange(kv_len, device=device)[None, :] <= rows).expand(b, 1, q, kv_len)
    key, seen = (mask._version, kv_len), getattr(mask, "tale_all_visible", None)
    if seen == (key, True):
        return None
    allowed = (mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2)[..., -kv_len:]
    if seen is None or seen[0] != key:
        seen = mask.tale_all_visible = (key, bool(allowed.all()))
    return None if seen[1] else allowed.expand(b, 1, q, kv_len)


def attend(layer: TaleLayer, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of ``query`` ``(b, hq, q, d)`` over everything ``layer`` holds; returns ``(b, q, hq, d)``."""
    b, hq, q, d = query.shape
    g = hq // layer.exact_k.shape[1]
    allowed = _allowed_mask(mask, b, q, layer.length, query.device)
    prefill = layer.n_compressed == 0
    start, stop = observed_rows(q, prefill)
    outs = []
    if start:
        # Prefill over exact tokens only: sdpa for all but the last queries, which also record significance.
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, :start],
                layer.exact_k,
                layer.exact_v,
                attn_mask=mask_rows(allowed, slice(None, start)),
                scale=scaling,
                enable_gqa=True,
            )
        )
    record = not layer.record_past  # a recorded pass observes its significance when it is settled (crop)
    outs += [
        _attend_chunk(
            layer,
            query[:, :, i : i + QUERY_CHUNK],
            mask_rows(allowed, slice(i, i + QUERY_CHUNK)),
            scaling,
            g,
            record,
        )
        for i in range(start, stop, QUERY_CHUNK)
    ]
    if layer.record_past:
        layer.hold_pass(query, allowed, scaling, prefill)
    layer.finish_read()
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def _attend_chunk(
    layer: TaleLayer, query: torch.Tensor, allowed: torch.Tensor | None, scaling: float, g: int, record: bool
) -> torch.Tensor:
    b, hq, q, _ = query.shape
    h = hq // g
    probs, tiers, exact_allowed, visible = column_probs(layer, query, allowed, scaling, g)
    exact_probs = probs[..., : layer.exact_k.shape[-2]]
    if record:
        layer.record_significance(exact_probs, exact_allowed, visible, g)

    out = exact_probs @ layer.exact_v.float()
    if tiers:
        folded = out.new_zeros(b, h, g * q, layer.value_map.shape[-1])
        for t, offset in tiers:
            kernels.tier_values(probs, layer.tier_v[t], folded, offset)
        out = out + folded @ layer.value_map.transpose(-1, -2)
    return out.reshape(b, hq, q, -1)


def tale_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: TALE attention for ``TaleLayer`` keys, sdpa otherwise."""
    layer = getattr(key, "tale_layer", None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return attend(layer, query, attention_mask, scaling), None


def _tale_mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``'tale'`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tale_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _tale_mask)


def enable_tale(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` to TALE attention (works with any cache; reconstruction-free with a ``TaleCache``)."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
