"""kvcompress: cropping a TaleCache (speculative decoding) undoes the last forward pass exactly."""

from __future__ import annotations

import pytest
import torch
from helpers.tale import HEAD_DIM, tiny_config, tiny_model_and_factors, two_tier_policy
from transformers import LlamaForCausalLM

from kvcompress import TaleCache, uniform_policy
from kvcompress.quant import QTensor

LOSSY = two_tier_policy(8, window=6)


@pytest.fixture(scope="module")
def model_and_factors():
    return tiny_model_and_factors()


def state(cache: TaleCache) -> list[torch.Tensor]:
    """Every tensor a TaleCache's layers hold (exact K/V, significance, tier codes), in a fixed order."""
    out = []
    for layer in cache.layers:
        out += [layer.exact_k, layer.exact_v, layer.acc, layer.cnt, layer.tier_ids]
        out += [t for q in (*layer.tier_k, *layer.tier_v) if isinstance(q, QTensor) for t in q.tensors()]
    return out


def assert_same_state(a: TaleCache, b: TaleCache) -> None:
    assert [layer.length for layer in a.layers] == [layer.length for layer in b.layers]
    assert [layer.n_compressed for layer in a.layers] == [layer.n_compressed for layer in b.layers]
    for x, y in zip(state(a), state(b), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("prefill", [20, 90])  # 90 > OBSERVED_QUERIES: the prefill observes its last rows
def test_crop_equals_never_appending_the_cropped_tokens(model_and_factors, prefill):
    model, factors = model_and_factors
    ids = torch.randint(0, 96, (1, prefill + 40))
    plain = TaleCache(factors, LOSSY, model.config, model=model)
    spec = TaleCache(factors, LOSSY, model.config, model=model)
    spec.activate_past_recording()

    # the first pass carries 5 draft tokens, of which 2 are rejected
    model(ids[:, : prefill + 3], cache=plain)
    model(ids[:, : prefill + 5], cache=spec)
    spec.crop(-2)
    assert_same_state(spec, plain)
    pos = prefill + 3
    for accepted in (3, 0, 2, 4, 1, 3, 0, 2):  # verify passes: 1 + 4 drafts, `accepted` of them kept
        model(ids[:, pos : pos + accepted + 1], cache=plain)
        model(ids[:, pos : pos + 5], cache=spec)
        spec.crop(-(4 - accepted))
        assert_same_state(spec, plain)
        pos += accepted + 1
    assert spec.layers[0].n_compressed > 10  # the crops happened across compressions
    nxt = ids[:, pos : pos + 1]
    torch.testing.assert_close(model(nxt, cache=spec).logits, model(nxt, cache=plain).logits)


def generate_counting_passes(model, ids, cache, **kw) -> tuple[torch.Tensor, int]:
    passes = []
    hook = model.register_forward_hook(lambda *_: passes.append(1))
    try:
        out = model.generate(ids, max_new_tokens=40, do_sample=False, cache=cache, **kw)
    finally:
        hook.remove()
    return out, len(passes)


@torch.no_grad()
@pytest.mark.parametrize("speculation", ["prompt_lookup", "assistant"])
def test_speculative_generate_equals_plain_greedy(model_and_factors, speculation):
    """Full rank, unquantized: compression is lossless, so every token must match plain greedy decoding."""
    model, factors = model_and_factors
    torch.manual_seed(1)
    motif = torch.randint(3, 96, (1, 12))
    ids = torch.cat([motif] * 5, dim=1)  # repetitive prompt: prompt lookup proposes drafts from it
    exact = uniform_policy(HEAD_DIM, None, sinks=2, window=4, block=2)
    ref, _ = generate_counting_passes(model, ids, TaleCache(factors, exact, model.config, model=model))
    if speculation == "prompt_lookup":
        kw = {"prompt_lookup_num_tokens": 4}
    else:  # the target itself, one layer short: a draft model that agrees often, not always
        assistant = LlamaForCausalLM(tiny_config(num_hidden_layers=1)).eval()
        assistant.load_state_dict(model.state_dict(), strict=False)
        kw = {"assistant_model": assistant}
    cache = TaleCache(factors, exact, model.config, model=model)
    got, passes = generate_counting_passes(model, ids, cache, **kw)
    assert torch.equal(got, ref)
    assert passes < 35  # drafts were accepted: fewer target passes than tokens
    assert cache.layers[0].n_compressed > 80


@torch.no_grad()
def test_crop_outside_the_last_pass_is_refused(model_and_factors):
    model, factors = model_and_factors
    ids = torch.randint(0, 96, (1, 40))
    cache = TaleCache(factors, LOSSY, model.config, model=model)
    model(ids[:, :30], cache=cache)
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-1)
    cache.activate_past_recording()
    model(ids[:, 30:33], cache=cache)
    with pytest.raises(ValueError, match="crop removes 4 tokens but the last forward pass added 3"):
        cache.crop(-4)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)
    cache.crop(-1)
    with pytest.raises(ValueError, match="already settled"):
        cache.crop(-1)
    assert cache.get_seq_length() == 32
