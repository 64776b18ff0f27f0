"""A tiny model with TALE (kvcompress) attention: its config, the factors calibrated on random tokens, and a
lossy two-tier policy."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcompress import Policy, Tier, enable_tale
from kvcompress.calibrate import factors_from_model

HEAD_DIM = 16  # tiny_config's: hidden 64 over 4 heads


def tiny_config(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaConfig(**{**base, **kw})


def tiny_model_and_factors():
    """A tiny random Llama switched to TALE attention, and factors calibrated on random tokens."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    factors = factors_from_model(model, [torch.randint(0, 96, (1, 80)) for _ in range(4)])
    enable_tale(model)
    return model, factors


def two_tier_policy(low_rank: int, window: int, block: int = 4) -> Policy:
    """A lossy policy: a quarter of each block at full rank in int8, the rest at ``low_rank`` in int4."""
    return Policy(
        sinks=2,
        window=window,
        block=block,
        tiers=[
            Tier(k_rank=HEAD_DIM, v_rank=HEAD_DIM, bits=8, fraction=0.25),
            Tier(k_rank=low_rank, v_rank=low_rank, bits=4, fraction=0.75),
        ],
    )
