"""kvcompress on a SwiftKV model: AcrossKV groups are stored and compressed once, results stay exact at full rank."""

from __future__ import annotations

import torch
from conftest import tiny_base
from transformers import DynamicCache

from kvcompress import TaleCache, enable_tale, uniform_policy
from kvcompress.calibrate import factors_from_model
from swiftkv.convert import to_swiftkv


@torch.no_grad()
def test_swiftkv_acrosskv_full_rank_matches_dynamic_cache():
    torch.manual_seed(0)
    model = to_swiftkv(tiny_base("llama"), 2, 2).eval()  # layers 2..5 in two AcrossKV groups (leaders 2, 4)
    factors = factors_from_model(model, [torch.randint(3, 128, (1, 48)) for _ in range(3)])
    assert sorted(factors.layers) == [0, 1, 2, 4]  # only layers that write KV were calibrated

    ids = torch.randint(3, 128, (1, 70))
    ref_cache = DynamicCache(config=model.config)
    ref = [model(ids[:, :40], cache=ref_cache).logits[:, -1:]]
    ref += [model(ids[:, i : i + 1], cache=ref_cache).logits for i in range(40, 70)]

    enable_tale(model)
    cache = TaleCache(
        factors, uniform_policy(16, None, sinks=2, window=5, block=3), model.config, model=model
    )
    got = [model(ids[:, :40], cache=cache).logits[:, -1:]]
    got += [model(ids[:, i : i + 1], cache=cache).logits for i in range(40, 70)]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(ref, 1), atol=2e-5, rtol=1e-4)

    assert [layer.is_initialized for layer in cache.layers] == [True, True, True, False, True, False]
    assert cache.layers[2].readers == 2 and cache.layers[2].n_compressed > 50
    assert cache.layers[3].nbytes() == 0  # followers hold nothing: the group is compressed once
