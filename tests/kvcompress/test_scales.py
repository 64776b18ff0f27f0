"""kvcompress: per-channel scales over groups of tokens (the format, its kernels, its bytes) and the KIVI-style
cache built on them, checked against a direct numpy implementation of KIVI's description."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.tale import HEAD_DIM, tiny_model_and_factors
from transformers import DynamicCache

from kvcompress import Policy, TaleCache, Tier
from kvcompress.evaluate import make_method
from kvcompress.quant import QTensor, append, dequantize, quantize


@pytest.fixture(scope="module")
def model_and_factors():
    return tiny_model_and_factors()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_channel_scales_error_is_at_most_half_a_step_of_each_group_and_channel(bits):
    x = torch.randn(2, 3, 70, 16) * torch.logspace(
        1, -2, 16
    )  # ranges falling along the rank, as PCA coefficients
    q = quantize(x, bits, token_group=32)
    assert q.starts.tolist() == [0, 32, 64] and q.scale.shape == (
        2,
        3,
        3,
        16,
    )  # the last group holds 6 tokens
    err = (dequantize(q) - x).abs()
    for g, (lo, hi) in enumerate([(0, 32), (32, 64), (64, 70)]):
        part = x[..., lo:hi, :]
        step = (part.amax(-2) - part.amin(-2)) / (2**bits - 1)  # (2, 3, 16): one step per channel
        bound = step / 2 * 1.01 + 1e-3 * part.abs().amax(-2)
        assert bool((err[..., lo:hi, :] <= bound.unsqueeze(-2)).all()), g
    # the point of it: a low-energy channel keeps its own step instead of the first channel's
    assert err[..., -1].max() < 0.01 * err[..., 0].max()


@pytest.mark.parametrize("bits,rank", [(2, 16), (4, 18), (8, 17)])
def test_channel_scale_kernels_equal_dequantize_then_matmul(bits, rank):
    """Scores and value sums of the fused kernels over channel-scaled tiers (groups from two appends, the
    tier a prefix view of spare capacity; ranks that are not a multiple of the kernels' four rank positions a
    pass) equal dequantize + matmul, other columns untouched."""
    from kvcompress import kernels

    pytest.importorskip("numba")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 77, rank) * torch.linspace(4, 0.1, rank)
    tier = append(
        quantize(x[..., :70, :], bits, token_group=32), quantize(x[..., 70:, :], bits, token_group=32), 8
    )
    assert tier.starts.tolist() == [0, 32, 64, 70] and kernels._fused(tier, 5)
    q, p = torch.randn(2, 3, 5, 24), torch.softmax(torch.randn(2, 3, 5, 80), -1)
    coeffs = dequantize(tier)
    scores = torch.full((2, 3, 5, 81), 7.0)
    kernels.tier_scores(q, tier, scores, 3)
    torch.testing.assert_close(
        scores[..., 3:80], q[..., :rank] @ coeffs.transpose(-1, -2), atol=1e-4, rtol=1e-4
    )
    assert bool((scores[..., :3] == 7).all() and (scores[..., 80:] == 7).all())
    values = torch.ones(2, 3, 5, 24)
    kernels.tier_values(p, tier, values, 3)
    torch.testing.assert_close(values[..., :rank], 1 + p[..., 3:] @ coeffs, atol=1e-5, rtol=1e-4)
    assert bool((values[..., rank:] == 1).all())


def _view_bytes(q: QTensor) -> int:
    return sum(t.numel() * t.element_size() for t in q.tensors())


@pytest.mark.parametrize(
    "k_scales,v_scales,k_bits,v_bits",
    [
        ("channel", "token", 2, 2),
        ("channel", "channel", 2, 2),
        ("token", "token", 2, 2),
        ("channel", "channel", 2, 4),
        ("channel", "token", 4, 2),
    ],
)
def test_bytes_per_token_are_the_bytes_stored(k_scales, v_scales, k_bits, v_bits):
    """``Policy.compressed_bytes_per_token`` is what the stored tensors of full channel groups take (plus one
    int32 group start per group and tier, shared by the heads), for every mix of scales and of K/V bits."""
    tier = Tier(
        k_rank=16, v_rank=24, bits=k_bits, v_bits=v_bits, fraction=1.0, k_scales=k_scales, v_scales=v_scales
    )
    policy = Policy(tiers=[tier], token_group=32, group_size=8)
    b, h, n = 1, 3, 128
    stored = [
        quantize(torch.randn(b, h, n, r), bits, policy.group_size, policy.token_group_of(s))
        for r, s, bits in ((16, k_scales, k_bits), (24, v_scales, v_bits))
    ]
    starts = sum(q.starts.numel() * 4 for q in stored if q.per_channel)
    per_token = (sum(_view_bytes(q) for q in stored) - starts) / (b * h * n)
    assert per_token == policy.compressed_bytes_per_token(4)
    assert starts == 4 * n // 32 * ((k_scales == "channel") + (v_scales == "channel"))


def test_three_tiers_pack_their_ids_in_two_bits(model_and_factors):
    """Tier ids cost 2 bits a token (packed), and the cache's counted bytes are exactly its tensors' storages."""
    model, factors = model_and_factors
    tiers = [
        Tier(k_rank=HEAD_DIM, v_rank=HEAD_DIM, bits=8, fraction=0.25),
        Tier(k_rank=8, v_rank=8, bits=4, fraction=0.25, k_scales="channel"),
        Tier(k_rank=8, v_rank=8, bits=2, fraction=0.5, k_scales="channel", v_scales="channel"),
    ]
    policy = Policy(sinks=2, window=6, block=4, token_group=8, tiers=tiers)
    cache = TaleCache(factors, policy, model.config, model=model)
    ids = torch.randint(0, 96, (1, 90))
    with torch.no_grad():
        model(ids[:, :40], cache=cache)
        for i in range(40, 90):
            model(ids[:, i : i + 1], cache=cache)
    layer = cache.layers[0]
    assert layer.n_compressed % 4 == 0 and layer.tier_ids.shape[-1] == layer.n_compressed // 4
    counts = torch.bincount(layer.tier_of()[0, 0].long(), minlength=3).tolist()
    assert counts == [len(q) for q in layer.tier_k]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in layer.held_tensors()}
    assert layer.nbytes() == sum(held.values())


def kivi_reference(x: np.ndarray, bits: int, group: int, axis: str) -> np.ndarray:
    """KIVI's quantize-dequantize (Liu et al. 2024, Sec. 3): ``x`` ``(heads, n, d)``, n a multiple of ``group``.

    ``axis="channel"`` (keys): per channel over each group of ``group`` consecutive tokens; ``"token"``
    (values): per token over each group of ``group`` consecutive channels.  Asymmetric min/max, fp16 scale
    and zero point."""
    levels = 2**bits - 1
    h, n, d = x.shape
    grouped = x.reshape(h, n // group, group, d) if axis == "channel" else x.reshape(h, n, d // group, group)
    reduce = 2 if axis == "channel" else 3
    lo, hi = grouped.min(reduce, keepdims=True), grouped.max(reduce, keepdims=True)
    scale = np.maximum((hi - lo) / levels, np.finfo(np.float16).tiny).astype(np.float16).astype(np.float32)
    zero = lo.astype(np.float16).astype(np.float32)
    codes = np.clip(np.round((grouped - zero) / scale), 0, levels)
    return (codes * scale + zero).reshape(h, n, d)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_cache_equals_numpy_kivi(model_and_factors, bits):
    """The ``kivi`` method on a tiny Llama: layer 0's stored K/V (the same input in both caches) equal KIVI's
    quantization computed in numpy: keys per channel in groups of G tokens, values per token in groups of G
    channels; the residual of the R most recent tokens (and up to G - 1 more waiting) exact; bytes as
    counted from the format."""
    model, factors = model_and_factors
    residual, group = 16, 8
    spec = f"kivi:{bits}:{residual}:{group}"
    cache = make_method(spec, model, factors)()
    reference = DynamicCache(config=model.config)
    ids = torch.randint(0, 96, (1, 61))
    with torch.no_grad():
        for kv in (reference, cache):  # the same passes, so layer 0's K/V are bit-identical inputs
            model.set_attn_implementation("sdpa" if kv is reference else "tale")
            model(ids[:, :40], cache=kv)
            for i in range(40, 61):
                model(ids[:, i : i + 1], cache=kv)
    layer = cache.layers[0]
    n, c = 61, layer.n_compressed
    assert c == (n - residual) // group * group  # whole groups of tokens older than the residual
    keys, values = (t[0].double().numpy() for t in (reference.layers[0].keys, reference.layers[0].values))
    got_k, got_v = (t[0].numpy() for t in layer.reconstruct())
    assert np.array_equal(got_k[:, c:], keys[:, c:].astype(np.float32))  # the residual stays exact
    assert np.array_equal(got_v[:, c:], values[:, c:].astype(np.float32))
    for got, x, axis in ((got_k, keys, "channel"), (got_v, values, "token")):
        want = kivi_reference(x[:, :c].astype(np.float32), bits, group, axis)
        step = np.abs(x[:, :c]).max() / 2 ** (bits - 1)
        assert np.abs(got[:, :c] - want).max() <= 1e-3 * step  # the same grid, up to float rounding
    h, d = keys.shape[0], HEAD_DIM
    exact = (n - c) * h * d * 4 * 2 + (n - c) * h * 4 + (n - c) * 4  # float32 K/V, acc, cnt
    codes = 2 * c * h * d * bits // 8
    scales = (c // group) * h * d * 2 * 2 + c * h * (
        d // group
    ) * 2 * 2  # fp16 scale+zero: K per channel, V per token
    starts = 4 * (c // group)
    used = sum(t.numel() * t.element_size() for t in layer.held_tensors())
    assert used == exact + codes + scales + starts
