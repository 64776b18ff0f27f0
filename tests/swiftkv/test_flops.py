"""FLOP accounting against torch's own FLOP counter, and the KV-byte arithmetic."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_base, to_swiftkv
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache

from swiftkv.flops import (
    Shape,
    decode_flops,
    ideal_prefill_speedup,
    ideal_workload_speedup,
    kv_bytes_per_token,
    prefill_flops_original,
    prefill_flops_swiftkv,
    request_flops,
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


def _served(model, prompt: int, output: int) -> tuple[int, int]:
    """FLOPs of a prefill (last row's logits) and of the ``output - 1`` decode steps after it, counted by torch."""
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 128, (1, prompt + output))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids[:, :prompt], cache=cache, use_cache=True, logits_to_keep=1)
    prefill = counter.get_total_flops()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        for i in range(prompt, prompt + output - 1):
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
    return prefill, counter.get_total_flops()


@pytest.mark.parametrize("l, g, window", [(2, 2, 0), (3, 1, 0), (3, 1, 4)])
def test_served_request_flops_match_torch_counter(l, g, window):
    base = tiny_base("llama")
    model = to_swiftkv(base, l=l, g=g)
    model.config.exact_kv_window = window
    for m in (base, model):
        m.set_attn_implementation("eager")
    s = Shape.from_config(model.config)
    assert s.exact_kv_window == window and s.original == Shape.from_config(base.config)
    prompt, output = 9, 5
    for m, shape, lower in ((base, s.original, s.layers), (model, s, l)):
        prefill, decode = _served(m, prompt, output)
        # eager's waste: the full square of scores, not the causal triangle (the window's rows: a full
        # rectangle of rows x prompt in each layer >= l)
        unit = 2 * 2 * s.heads * s.head_dim
        square = unit * (prompt * prompt - prompt * (prompt + 1) // 2)
        rows = window if shape is s else 0
        square_upper = (s.layers - lower) * unit * (rows * prompt - (rows * prompt - rows * (rows - 1) // 2))
        assert prefill == prefill_flops_swiftkv(shape, prompt) + lower * square + square_upper
        assert decode == sum(decode_flops(shape, c) for c in range(prompt, prompt + output - 1))
        assert request_flops(shape, prompt, output) == prefill + decode - lower * square - square_upper
    assert prefill_flops_swiftkv(s.original, prompt) == prefill_flops_original(s, prompt)
    ratio = ideal_workload_speedup(s, [(prompt, output), (3, 1)])
    total = request_flops(s.original, prompt, output) + request_flops(s.original, 3, 1)
    assert ratio == total / (request_flops(s, prompt, output) + request_flops(s, 3, 1))


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
    # decode costs both models about the same, so a 10:1 workload gains less than its prefill alone
    assert 1.0 < ideal_workload_speedup(half, [(2048, 205)]) < ideal_prefill_speedup(half, 2048)
    assert ideal_workload_speedup(half, [(2048, 1)]) == ideal_prefill_speedup(half, 2048)


def test_the_exact_kv_window_costs_its_rows_through_the_upper_layers():
    from dataclasses import replace

    cfg = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, num_key_value_layers=16)  # fmt: skip
    half = Shape.from_config(cfg)
    windowed = replace(half, exact_kv_window=32)
    assert (
        Shape.from_config({**cfg, "exact_kv_window": 32}) == windowed and windowed.original == half.original
    )
    # W = 1 is the last prompt token, which runs the upper layers anyway (plus its own k/v there)
    assert ideal_prefill_speedup(replace(half, exact_kv_window=1), 2048) == pytest.approx(
        ideal_prefill_speedup(half, 2048), rel=1e-4
    )
    assert 1.88 < ideal_prefill_speedup(windowed, 2048) < 1.91 < ideal_prefill_speedup(half, 2048)
