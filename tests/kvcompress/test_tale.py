"""kvcompress: TALE cache equivalences, quantizer bounds, memory accounting, policy/factor errors."""

from __future__ import annotations

import pytest
import torch
from helpers.tale import HEAD_DIM, tiny_config, tiny_model_and_factors
from transformers import DynamicCache, LlamaForCausalLM

from kvcompress import Policy, TaleCache, Tier, enable_tale, identity_factors, uniform_policy
from kvcompress.attention import attend
from kvcompress.cache import RESERVED_BLOCKS
from kvcompress.calibrate import factors_from_model
from kvcompress.quant import QTensor, dequantize, quantize

SMOLLM2_POLICY = Policy.from_budget(
    0.625, [4, 4], 64, window=32, block=16
)  # 25% full rank, 75% K32/V48, int4


@pytest.fixture(scope="module")
def model_and_factors():
    return tiny_model_and_factors()


def tiered_policy(bits=(8, 4, 2), window=6, block=4, value_bits=None) -> Policy:
    ranks = (16, 8, 8)
    return Policy(
        sinks=2,
        window=window,
        block=block,
        tiers=[
            Tier(k_rank=r, v_rank=r, bits=b, v_bits=vb, fraction=f)
            for r, b, vb, f in zip(ranks, bits, value_bits or bits, (0.25, 0.25, 0.5), strict=True)
        ],
    )


def run_chunks(model, ids, cache, first: int, step: int) -> torch.Tensor:
    logits = [model(ids[:, :first], cache=cache).logits]
    for i in range(first, ids.shape[1], step):
        logits.append(model(ids[:, i : i + step], cache=cache).logits)
    return torch.cat(logits, dim=1)


@torch.no_grad()
def test_full_rank_unquantized_reproduces_baseline_logits(model_and_factors):
    model, factors = model_and_factors
    ids = torch.randint(0, 96, (1, 110))  # a prefill longer than OBSERVED_QUERIES takes the sdpa path
    model.set_attn_implementation("sdpa")
    ref = run_chunks(model, ids, DynamicCache(config=model.config), 80, 3)
    enable_tale(model)
    cache = TaleCache(
        factors, uniform_policy(HEAD_DIM, None, sinks=2, window=5, block=3), model.config, model=model
    )
    got = run_chunks(model, ids, cache, 80, 3)
    assert cache.stats()["tiers"][0] > 90  # most tokens really went through the low-rank path
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_left_padded_batch_matches_dynamic_cache(model_and_factors):
    model, factors = model_and_factors
    ids = torch.randint(0, 96, (2, 90))
    mask = torch.ones_like(ids)
    mask[1, :12] = 0  # padding reaches past the sinks into the compressed range
    model.set_attn_implementation("sdpa")
    ref = model(ids, attention_mask=mask, cache=DynamicCache(config=model.config)).logits
    enable_tale(model)
    cache = TaleCache(
        factors, uniform_policy(HEAD_DIM, None, sinks=2, window=4, block=2), model.config, model=model
    )
    model(ids[:, :80], attention_mask=mask[:, :80], cache=cache)
    got = model(ids[:, 80:], attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(got[0], ref[0, 80:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1, 80:], atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_unpadded_decode_skips_the_mask_and_keeps_the_masked_paths_state(model_and_factors):
    """A decode step whose every key is visible takes the path without mask work; it must leave the same
    significance, tiers and logits as the masked path, which the same row takes beside a left-padded one."""
    model, factors = model_and_factors
    enable_tale(model)
    ids = torch.randint(0, 96, (2, 60))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    caches = [TaleCache(factors, tiered_policy(), model.config, model=model) for _ in range(2)]
    alone = [model(ids[:1, :20], cache=caches[0]).logits[:, -1]]
    beside = [model(ids[:, :20], attention_mask=mask[:, :20], cache=caches[1]).logits[:1, -1]]
    for i in range(20, 60):
        alone.append(model(ids[:1, i : i + 1], cache=caches[0]).logits[:, -1])
        step = model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=caches[1])
        beside.append(step.logits[:1, -1])
    torch.testing.assert_close(torch.cat(alone), torch.cat(beside), atol=2e-5, rtol=1e-4)
    one, two = caches[0].layers[1], caches[1].layers[1]
    assert one.n_compressed == two.n_compressed > 30  # both crossed several compressions
    torch.testing.assert_close(one.acc, two.acc[:1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one.cnt, two.cnt[:1])
    for a, b in zip(one.tier_k + one.tier_v, two.tier_k + two.tier_v, strict=True):
        assert torch.equal(a.data, b.data[:1])


@torch.no_grad()
def test_generate_with_full_rank_cache_matches_plain_generate(model_and_factors):
    model, factors = model_and_factors
    ids = torch.randint(0, 96, (1, 24))
    cache = TaleCache(
        factors, uniform_policy(HEAD_DIM, None, sinks=2, window=4, block=2), model.config, model=model
    )
    got = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    enable_tale(model)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("table_tokens", [0, 10**6])  # byte tables, direct unpacking
@pytest.mark.parametrize("value_bits", [None, (2, 8, 4)])  # values at the keys' bits, at their own
@torch.no_grad()
def test_reconstruction_free_attention_equals_attention_over_reconstructed_kv(
    model_and_factors, table_tokens, value_bits, monkeypatch
):
    from kvcompress import kernels

    monkeypatch.setattr(kernels, "TABLE_TOKENS", table_tokens)
    model, factors = model_and_factors
    policy = tiered_policy(value_bits=value_bits)
    cache = TaleCache(factors, policy, model.config, model=model)
    model(torch.randint(0, 96, (1, 64)), cache=cache)
    layer = cache.layers[1]
    assert all(q is not None for q in layer.tier_k)  # every tier is populated
    assert [(k.bits, v.bits) for k, v in zip(layer.tier_k, layer.tier_v, strict=True)] == [
        (t.bits, t.v_bits) for t in policy.tiers
    ]
    keys, values = layer.reconstruct()

    query = torch.randn(1, 4, 1, HEAD_DIM)
    new_k, new_v = torch.randn(1, 2, 1, HEAD_DIM), torch.randn(1, 2, 1, HEAD_DIM)
    keys, values = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
    k_rep, v_rep = keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1)
    ref = torch.softmax(query @ k_rep.transpose(-1, -2) * HEAD_DIM**-0.5, -1) @ v_rep

    held = sum(t.untyped_storage().nbytes() for q in (*layer.tier_k, *layer.tier_v) for t in q.tensors())
    layer.update(new_k, new_v)
    got = attend(layer, query, None, HEAD_DIM**-0.5)
    torch.testing.assert_close(got.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)
    assert held < (keys.numel() + values.numel()) * 2  # compressed tiers are smaller than fp16 K/V


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [None, 8])
def test_quantize_error_is_at_most_half_a_step(bits, group_size):
    x = torch.randn(3, 5, 7, 16) * torch.linspace(0.1, 10, 16)
    q = quantize(x, bits, group_size)
    err = (dequantize(q) - x).abs()
    groups = 16 // (group_size or 16)
    grouped = x.reshape(3, 5, 7, groups, -1)
    step = (grouped.amax(-1) - grouped.amin(-1)) / (2**bits - 1)
    bound = (step / 2 * 1.01 + 1e-3 * grouped.abs().amax(-1)).repeat_interleave(16 // groups, -1)
    assert bool((err <= bound).all())
    assert q.data.dtype == torch.uint8 and q.data.shape[-1] == 16 * bits // 8  # really packed


@pytest.mark.parametrize("spread", [0.0, 1e-6])
def test_constant_groups_keep_a_nonzero_fp16_scale(spread):
    """A group with (almost) no range: its fp16 scale must stay > 0, so codes are 0..levels, not 0/0."""
    x = torch.full((2, 3, 16), 0.75)
    x[..., 0] += spread
    q = quantize(x, 4)
    assert bool((q.scale > 0).all()) and torch.isfinite(q.scale).all()
    assert torch.allclose(dequantize(q), x, atol=1e-3)


def test_quantize_passthrough_and_fp16():
    x = torch.randn(2, 3, 8)
    assert torch.equal(dequantize(quantize(x, None)), x)
    assert torch.equal(dequantize(quantize(x, 16)), x.half().float())


def _all_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from a layer's attributes (lists and QTensors included), excluding factors."""
    out = []
    items = vars(obj).items() if hasattr(obj, "__dict__") else []
    for name, value in items:
        if name in ("factors", "policy", "key_map", "key_query_map", "value_map"):
            continue
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, QTensor):
                out += v.tensors()
    return out


@torch.no_grad()
def test_memory_accounting_equals_bytes_held(model_and_factors):
    model, factors = model_and_factors
    policy = tiered_policy()
    cache = TaleCache(factors, policy, model.config, model=model)
    run_chunks(model, torch.randint(0, 96, (1, 120)), cache, 40, 1)
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in _all_tensors(layer))
    assert cache.nbytes() == held

    layer = cache.layers[0]
    n_exact, n_comp = layer.exact_k.shape[-2], layer.n_compressed
    exact_bytes = n_exact * 2 * (2 * HEAD_DIM * 4 + 4) + n_exact * 4  # K,V fp32 + acc per head, cnt per token
    # tiers keep spare capacity for RESERVED_BLOCKS more blocks (and 1/16 of their length), counted as held
    spare = max(RESERVED_BLOCKS * policy.block, n_comp // 16)
    predicted = exact_bytes + (n_comp + spare) * 2 * policy.compressed_bytes_per_token(4)
    assert exact_bytes + n_comp * 2 * policy.compressed_bytes_per_token(4) < layer.nbytes()
    assert layer.nbytes() == pytest.approx(predicted, rel=0.05)
    assert n_comp > 100 and n_exact <= 2 + 6 + 4


@torch.no_grad()
def test_shared_prefill_leaves_each_cache_as_its_own_prefill(model_and_factors):
    """The benchmarks prefill a prompt once (``SharedPrefill``) and hand it to every method's cache: a
    ``TaleCache`` then holds the same tiers and predicts the same continuation as after its own prefill, and
    transformers' caches (full and fp8) the same as theirs."""
    from transformers import QuantizedCache

    from kvcompress.continuation import SharedPrefill, continuation_logits

    model, factors = model_and_factors
    ids = torch.randint(0, 96, (1, 150))
    prefix = 120  # longer than OBSERVED_QUERIES: the TaleCache gets unobserved K/V, then the last rows run
    shared = SharedPrefill(model, ids[:, :prefix])
    assert model.config._attn_implementation == "tale"  # the shared prefill ran sdpa and switched back

    own, seeded = (TaleCache(factors, tiered_policy(), model.config, model=model) for _ in range(2))
    model(ids[:, :prefix], cache=own)
    shared.start(seeded)
    assert seeded.stats() == own.stats() and seeded.stats()["tiers"][-1] > 40
    for a, b in zip(own.layers, seeded.layers, strict=True):
        assert torch.equal(a.tier_ids, b.tier_ids)
    own, seeded = (TaleCache(factors, tiered_policy(), model.config, model=model) for _ in range(2))
    torch.testing.assert_close(  # chunks of 10 tokens (20 query rows): dequantize + matmul, nothing to compile
        continuation_logits(model, ids, seeded, prefix, 10, shared),
        continuation_logits(model, ids, own, prefix, 10),
        atol=1e-4,
        rtol=1e-4,
    )

    model.set_attn_implementation("sdpa")
    try:
        for make in (lambda: DynamicCache(config=model.config), lambda: QuantizedCache("fp8", model.config)):
            torch.testing.assert_close(
                continuation_logits(model, ids, make(), prefix, 3, shared),
                continuation_logits(model, ids, make(), prefix, 3),
                atol=1e-5,
                rtol=1e-5,
            )
    finally:
        enable_tale(model)


def test_a_float32_full_cache_counts_as_fp16_when_asked():
    """The quality table reports memory as a 16-bit model holds it, from float32 runs too: the full cache
    is then exactly the fp16 reference (1x), not half of it."""
    from kvcompress.evaluate import fp16_kv_bytes, kv_bytes

    config = tiny_config()
    cache = DynamicCache(config=config)
    for i in range(config.num_hidden_layers):
        cache.update(torch.randn(1, 2, 30, HEAD_DIM), torch.randn(1, 2, 30, HEAD_DIM), i)
    assert kv_bytes(cache, exact_element_bytes=2) == fp16_kv_bytes(config, 30)
    assert kv_bytes(cache) == 2 * fp16_kv_bytes(config, 30)


@torch.no_grad()
def test_most_significant_tokens_get_the_top_tier(model_and_factors):
    model, factors = model_and_factors
    cache = TaleCache(factors, tiered_policy(window=0, block=1000), model.config, model=model)
    model(torch.randint(0, 96, (1, 26)), cache=cache)  # block not reached: nothing compressed yet
    layer = cache.layers[0]
    assert layer.n_compressed == 0
    layer.acc = torch.rand_like(layer.acc)
    layer.cnt = torch.ones_like(layer.cnt)
    sig = layer.acc[..., 2:].clone()
    layer.policy = tiered_policy(window=0, block=1)
    layer.compress_overflow()
    top = layer.tier_positions(0).sort(-1).values
    want = sig.topk(len(layer.tier_k[0]), dim=-1).indices.sort(-1).values
    assert torch.equal(top, want)
    assert [len(q) for q in layer.tier_k] == layer.policy.tier_counts(24)


def test_identity_factors_make_a_per_token_quantizer(model_and_factors):
    model, _ = model_and_factors
    cache = TaleCache(
        identity_factors(model.config), uniform_policy(HEAD_DIM, 8, window=2, block=1), model.config, model
    )
    ids = torch.randint(0, 96, (1, 30))
    exact = DynamicCache(config=model.config)  # the same tokens, nothing compressed
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids, cache=exact)
    layer = cache.layers[0]
    s, c = layer.n_sinks, layer.n_compressed
    assert c > 20
    for got, want in zip(layer.reconstruct(), (exact.layers[0].keys, exact.layers[0].values), strict=True):
        assert torch.equal(got[..., :s, :], want[..., :s, :]) and torch.equal(
            got[..., s + c :, :], want[..., s + c :, :]
        )
        torch.testing.assert_close(got, want, atol=0.01 * want.abs().max().item(), rtol=0)  # 8 bits per token
        assert not torch.equal(got[..., s : s + c, :], want[..., s : s + c, :])  # really quantized


def test_errors_name_the_problem(model_and_factors):
    model, factors = model_and_factors
    with pytest.raises(ValueError, match="rank budget 1.5 is out of range"):
        Policy.from_budget(1.5, [8, 4, 2], HEAD_DIM)
    with pytest.raises(ValueError, match="sum to 1"):
        Policy(tiers=[Tier(k_rank=8, v_rank=8, bits=4, fraction=0.5)])
    with pytest.raises(ValueError, match="bits=3"):
        uniform_policy(8, 3)
    with pytest.raises(ValueError, match="head_dim is 16"):
        TaleCache(factors, uniform_policy(32, 8), model.config, model=model)
    other = LlamaForCausalLM(tiny_config(num_hidden_layers=3))
    with pytest.raises(ValueError, match="num_hidden_layers=2 but the model has num_hidden_layers=3"):
        TaleCache(factors, uniform_policy(8, 8), other.config)
    retrained = LlamaForCausalLM(tiny_config()).eval()
    retrained.set_attn_implementation("tale")
    with pytest.raises(ValueError, match="calibrated on other weights"):
        TaleCache(factors, uniform_policy(8, 8), retrained.config, model=retrained)
    plain = LlamaForCausalLM(tiny_config())
    plain.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="attn_implementation='sdpa'|enable_tale"):
        TaleCache(factors, uniform_policy(8, 8), plain.config, model=plain)


def test_value_bits_default_to_the_keys_and_are_named_apart():
    """Values take their own bit width where a tier gives one; a policy written before ``v_bits`` existed
    (no such field in its JSON) stores values like keys; the specs and the description say which is which."""
    from kvcompress.evaluate import parse_bits, parse_tiers

    policy = Policy.from_budget(0.5, [4, 2, 2], 64, value_bits=[4, 4, 2])
    assert [(t.bits, t.v_bits) for t in policy.tiers] == [(4, 4), (2, 4), (2, 2)]
    assert "30%@r40/64x2/4b" in policy.describe() and "10%@r64/64x4b" in policy.describe()
    assert Policy.model_validate_json(policy.model_dump_json()) == policy
    old = policy.model_dump()
    for tier in old["tiers"]:
        del tier["v_bits"]
    assert [t.v_bits for t in Policy.model_validate(old).tiers] == [4, 2, 2]
    assert parse_bits("4-2-2/4-4-2") == ([4, 2, 2], [4, 4, 2]) and parse_bits("8-4") == ([8, 4], None)
    tiers = parse_tiers("64/64@4x0.1+40/64@2/4x0.9")
    assert [(t.bits, t.v_bits) for t in tiers] == [(4, 4), (2, 4)]
    with pytest.raises(ValueError, match="2 value bit widths for 3 tiers"):
        Policy.from_budget(0.5, [4, 2, 2], 64, value_bits=[4, 4])
    with pytest.raises(ValueError, match="bits=3"):
        Policy(tiers=[Tier(k_rank=8, v_rank=8, bits=4, v_bits=3, fraction=1.0)])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kivi:2:pca", "drop them or use tale, tiers, lowrank"),
        ("quant:4:uniform", "drop them"),
        ("full:pca", "drop them"),
        ("tale", "malformed method 'tale'"),
        ("tale:half", "malformed"),
        ("tale:0.5:4-x-2", "malformed"),
        ("tale:0.5:4-2-2:zz", "malformed"),
        ("tiers:32/48@4", "malformed"),
        ("tiers:32/48@4x0.3+16@2x0.7", "malformed"),
        ("quant:4:8", "malformed"),
        ("lowrank:16", "malformed"),
        ("kivi:2:128:32:1", "malformed"),
        ("full:1", "malformed"),
        ("tail:0.5", "unknown method 'tail:0.5'"),
    ],
)
def test_method_specs_are_checked_without_a_model(spec, message):
    """A benchmark reads its --methods before it loads or calibrates anything: a misspelt spec, or a flag that
    would be silently inert (keys' basis or rank allocation on a method without calibrated factors), is refused
    in one line naming the fix."""
    import argparse

    from kvcompress.evaluate import method_list, parse_method

    with pytest.raises(ValueError, match=message):
        parse_method(spec)
    with pytest.raises(argparse.ArgumentTypeError, match="to resolve"):
        method_list(f"full,{spec}")
    good = (
        "full, tale:0.5:4-4-2/4-2-2:cc:64:16:pca:uniform,tiers:64/64@4x0.1+32/40@4/2x0.9:ct,kivi:2:64,quant:4"
    )
    assert method_list(good + ",lowrank:16:4:pca,hf-fp8")[1] == "tale:0.5:4-4-2/4-2-2:cc:64:16:pca:uniform"
    assert parse_method("tale:0.5:4-2-2:cc:uniform:pca") == (
        "tale",
        ["0.5", "4-2-2", "cc"],
        {"pca", "uniform"},
    )


def test_budget_sets_average_rank():
    policy = Policy.from_budget(0.25, [8, 4, 2], 64)
    mean_rank = sum(t.fraction * t.k_rank for t in policy.tiers)
    assert [t.bits for t in policy.tiers] == [8, 4, 2]
    assert policy.tiers[0].k_rank > policy.tiers[-1].k_rank
    assert mean_rank == pytest.approx(16, rel=0.25)


@pytest.mark.smollm2
@torch.no_grad()
def test_smollm2_tale_keeps_quality_at_several_x_smaller_kv(smollm2, sharegpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompress.calibrate import chat_sequences
    from kvcompress.continuation import compare, continuation_logits
    from kvcompress.evaluate import fp16_kv_bytes

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    factors = factors_from_model(model, chat_sequences(tok, 640, 2), skip=4)
    ids = next(chat_sequences(tok, 640, 1, split="heldout"))
    ref = continuation_logits(model, ids, DynamicCache(config=model.config), 512, 64)
    enable_tale(model)
    cache = TaleCache(factors, SMOLLM2_POLICY, model.config, model=model)
    got = continuation_logits(model, ids, cache, 512, 64)
    scores, base = compare(got, ref, ids[:, 512:]), compare(ref, ref, ids[:, 512:])
    ppl_ratio = float(torch.tensor((scores["nll"] - base["nll"]) / scores["n"]).exp())
    assert fp16_kv_bytes(model.config, 639) / cache.nbytes() > 2.5  # the exact window is fp32 here
    # held-out text (the calibration reads only the train split): +14% perplexity and 0.91 agreement measured
    assert ppl_ratio < 1.2 and scores["agree"] / scores["n"] > 0.85


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [None, 8])
@pytest.mark.parametrize("table_tokens", [0, 10**6])
def test_fused_kernels_equal_dequantize_then_matmul(bits, group_size, table_tokens, monkeypatch):
    """The kernels (byte tables or direct unpacking) write the same scores / add the same value sums as
    dequantize + matmul, into slices of the caller's buffers (other columns untouched), from a
    spare-capacity view."""
    from kvcompress import kernels
    from kvcompress.quant import append

    pytest.importorskip("numba")
    monkeypatch.setattr(kernels, "TABLE_TOKENS", table_tokens)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 37, 16) * torch.linspace(0.1, 4, 16)
    tier = append(quantize(x[..., :30, :], bits, group_size), quantize(x[..., 30:, :], bits, group_size), 8)
    assert not tier.scale.is_contiguous()  # a prefix view of a larger buffer, as the cache holds them
    assert kernels._fused(tier, 5)
    q, p = torch.randn(2, 3, 5, 24), torch.softmax(torch.randn(2, 3, 5, 40), -1)
    coeffs = dequantize(tier)
    scores = torch.full((2, 3, 5, 41), 7.0)
    kernels.tier_scores(q, tier, scores, 3)
    torch.testing.assert_close(
        scores[..., 3:40], q[..., :16] @ coeffs.transpose(-1, -2), atol=1e-4, rtol=1e-4
    )
    assert bool((scores[..., :3] == 7).all() and (scores[..., 40:] == 7).all())
    values = torch.ones(2, 3, 5, 24)
    kernels.tier_values(p, tier, values, 3)
    torch.testing.assert_close(values[..., :16], 1 + p[..., 3:] @ coeffs, atol=1e-5, rtol=1e-4)
    assert bool((values[..., 16:] == 1).all())


def test_append_writes_into_spare_capacity():
    from kvcompress.quant import append

    parts = [quantize(torch.randn(1, 2, n, 16), 4) for n in (10, 3, 3)]
    store = append(None, parts[0], reserve=6)
    ptr = store.data.untyped_storage().data_ptr()
    for part in parts[1:]:
        store = append(store, part, reserve=6)
    assert store.data.untyped_storage().data_ptr() == ptr  # both blocks fit the reserve: nothing was copied
    assert torch.equal(dequantize(store), torch.cat([dequantize(p) for p in parts], dim=-2))
    grown = append(store, quantize(torch.randn(1, 2, 5, 16), 4), reserve=6)
    assert grown.data.untyped_storage().data_ptr() != ptr and len(grown) == 21
    assert torch.equal(dequantize(grown)[..., :16, :], dequantize(store))
