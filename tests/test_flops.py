"""FLOP accounting against torch's own FLOP counter, and the KV-byte arithmetic."""

from __future__ import annotations

import torch
from conftest import tiny_base
from test_swiftkv_model import to_swiftkv
from torch.utils.flop_counter import FlopCounterMode

from swiftkv.flops import (
    Shape,
    ideal_prefill_speedup,
    kv_bytes_per_token,
    prefill_flops_original,
    prefill_flops_swiftkv,
)


def _measured(model, n: int) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(3, 128, (1, n)), use_cache=True, logits_to_keep=1)
    return counter.get_total_flops()


def test_prefill_flops_match_torch_counter():
    base = tiny_base("llama")
    model = to_swiftkv(base, l=2, g=2)
    for m in (base, model):  # torch's counter sees eager attention's matmuls (it skips CPU sdpa kernels)
        m.set_attn_implementation("eager")
    s = Shape.from_config(model.config)
    for n in (1, 17):
        # eager attention computes the full n x n score matrix; we count the causal half: add the difference
        square = 2 * 2 * s.heads * s.head_dim * (n * n - n * (n + 1) // 2)
        assert _measured(base, n) == prefill_flops_original(s, n) + s.layers * square
        assert _measured(model, n) == prefill_flops_swiftkv(s, n) + s.num_key_value_layers * square


def test_ideal_speedup_and_kv_bytes():
    cfg = dict(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    )
    full = Shape.from_config({**cfg, "num_key_value_layers": 32})
    half = Shape.from_config({**cfg, "num_key_value_layers": 16, "key_value_group_size": 2})
    assert ideal_prefill_speedup(full, 2048) == 1.0
    assert 1.8 < ideal_prefill_speedup(half, 2048) < 2.0
    assert kv_bytes_per_token(full) == 32 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(half) / kv_bytes_per_token(half, swiftkv=False) == (16 + 8) / 32
