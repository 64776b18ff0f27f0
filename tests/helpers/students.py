"""The SwiftKV students that the equivalence tests compare with the independent reference (helpers.reference):
every family, AcrossKV group size and attention backend, including ``FLASH_2D``, a CPU stand-in that computes
what FlashAttention-2 computes from the mask format transformers hands it; their batches and caches."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from helpers.models import left_padded_batch, tiny_base, to_swiftkv
from helpers.reference import attention

ATOL = 2e-5
FAMILIES = ["llama", "qwen2", "qwen3"]
FLASH_2D = "flash_cpu_reference"  # "flash" in the name: generate() treats it as FlashAttention


def flash_2d_mask_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What FlashAttention-2 computes from what transformers hands it (masking_utils.flash_attention_mask): a
    2-D [batch, kv] padding mask or None; keys cut to the mask's width (static caches); queries aligned
    bottom-right.  Written with the reference's explicit attention, so it runs on CPU."""
    batch, _, q_len, _ = query.shape
    if attention_mask is not None:
        assert attention_mask.shape[0] == batch and attention_mask.dim() == 2, attention_mask.shape
        key, value = key[:, :, : attention_mask.shape[1]], value[:, :, : attention_mask.shape[1]]
        padding = attention_mask.bool()
    else:
        padding = torch.ones(batch, key.shape[2], dtype=torch.bool)
    kv_len = key.shape[2]
    causal = torch.arange(q_len)[:, None] + kv_len - q_len >= torch.arange(kv_len)[None]
    out = attention(query, key, value, causal[None] & padding[:, None])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLASH_2D, flash_2d_mask_attention)
AttentionMaskInterface.register(FLASH_2D, flash_attention_mask)


def student(family: str, g: int, impl: str, l: int = 2):
    model = to_swiftkv(tiny_base(family), l=l, g=g)
    if impl == FLASH_2D:  # set_attn_implementation would try to load a flash kernel for this name
        model.config._attn_implementation = impl
    else:
        model.set_attn_implementation(impl)
    return model


def reference_batches():
    """A left-padded batch and one unpadded prompt (where sdpa may skip the mask)."""
    _, ids, mask = left_padded_batch()
    single = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    return [(ids, mask), (single, torch.ones_like(single))]


def make_cache(kind: str, model, max_len: int = 32):
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    return DynamicCache(config=model.config)
