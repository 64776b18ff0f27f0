"""Key ranks per layer: the policy's own validation, the cache storing each layer's rank, the measured
sensitivity, and the allocation against a brute-force optimum of the same model."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaForCausalLM

from kvcompress import Policy, Tier
from kvcompress.allocate import SENSITIVITY_KEY, allocate_key_ranks, key_sensitivity
from kvcompress.cache import TaleCache
from kvcompress.calibrate import factors_from_model
from kvcompress.evaluate import make_method
from kvcompress.factors import Factors, LayerFactors
from tests.helpers.tale import HEAD_DIM, tiny_config, tiny_model_and_factors, two_tier_policy


def test_layer_key_ranks_validate_and_survive_json():
    policy = two_tier_policy(8, window=8).model_copy(update={"layer_key_ranks": {1: [16, 4]}})
    policy = Policy.model_validate_json(policy.model_dump_json())  # JSON keys are strings
    assert policy.key_ranks(1) == [16, 4] and policy.key_ranks(0) == [16, 8]
    assert "key ranks by layer 16-16/4-4" in policy.describe()
    tiers = policy.model_dump()["tiers"]
    with pytest.raises(ValueError, match="layer 1 has 1 key ranks for 2 tiers; to resolve"):
        Policy(tiers=tiers, layer_key_ranks={1: [4]})
    with pytest.raises(ValueError, match="whole bytes"):
        Policy(tiers=tiers, layer_key_ranks={1: [16, 3]})
    with pytest.raises(ValueError, match="layer 0 asks for key rank 24 but head_dim is 16"):
        Policy(tiers=tiers, layer_key_ranks={0: [24, 8]}).check_head_dim(HEAD_DIM)


def test_the_cache_stores_each_layers_own_key_rank():
    model, factors = tiny_model_and_factors()
    policy = two_tier_policy(8, window=8).model_copy(update={"layer_key_ranks": {1: [16, 4]}})
    cache = TaleCache(factors, policy, model.config, model=model)
    with torch.no_grad():
        model(torch.randint(0, 96, (1, 60)), cache=cache)
    low = [layer.tier_k[1] for layer in cache.layers]
    assert low[0].data.shape[-1] == 8 * 4 // 8 and low[1].data.shape[-1] == 4 * 4 // 8  # int4 codes, packed
    assert cache.layers[1].nbytes() < cache.layers[0].nbytes()
    assert policy.compressed_bytes_per_token(4, layer=1) < policy.compressed_bytes_per_token(4, layer=0)


def test_sensitivity_is_zero_without_key_truncation_and_positive_with_it():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    for layer in model.model.layers:  # sharp attention, so a truncated key moves the output
        layer.self_attn.k_proj.weight.data *= 8
    factors = factors_from_model(model, [torch.randint(0, 96, (1, 80)) for _ in range(4)])
    sequences = [torch.randint(0, 96, (1, 72)) for _ in range(2)]
    keep_keys = Policy(
        sinks=2,
        window=8,
        block=4,
        tiers=[Tier(k_rank=HEAD_DIM, v_rank=4, bits=8, fraction=1.0)],
    )
    measured = key_sensitivity(model, factors, keep_keys, sequences, continuation=16)
    assert measured["kl"] == {"0": 0.0, "1": 0.0} and measured["ranks"] == [HEAD_DIM]
    cut_keys = keep_keys.model_copy(update={"tiers": [Tier(k_rank=4, v_rank=4, bits=8, fraction=1.0)]})
    measured = key_sensitivity(model, factors, cut_keys, sequences, continuation=16)
    assert all(kl > 1e-6 for kl in measured["kl"].values()), measured  # rounding: ~1e-8

    # the sums a resumed run starts from count as if measured in it
    first = key_sensitivity(model, factors, cut_keys, sequences[:1], continuation=16)
    summed = {int(k): v * 16 for k, v in first["kl"].items()}
    resumed = key_sensitivity(model, factors, cut_keys, sequences[1:], 16, summed=summed, tokens=16)
    for layer, kl in measured["kl"].items():
        assert resumed["kl"][layer] == pytest.approx(kl, rel=1e-5)


def _spectral_factors(spectra: list[list[float]]) -> Factors:
    """PCA-only factors whose layers have the given key energies (one KV head, identity bases)."""
    layers = {}
    for i, energy in enumerate(spectra):
        eye, scale = torch.eye(len(energy))[None], torch.tensor(energy).sqrt()[None]
        layers[i] = LayerFactors(eye, scale, eye, scale)
    return Factors(layers, {"head_dim": len(spectra[0])})


def test_allocation_is_the_optimum_of_its_cost_model():
    """Brute force over every per-layer offset at no more key coefficients than the uniform policy."""
    torch.manual_seed(0)
    spectra = [sorted(torch.rand(16).pow(p).tolist(), reverse=True) for p in (1, 3, 6)]
    factors = _spectral_factors(spectra)
    policy = two_tier_policy(8, window=8)
    fractions = [0.25, 0.75]
    sensitivity = {"kl": {"0": 0.02, "1": 0.3, "2": 0.05}, "ranks": [16, 8], "fractions": fractions}

    def tail(layer: int, rank: int) -> float:
        return sum(spectra[layer][rank:])

    def cost(layer: int, low_rank: int) -> float:
        weight = sensitivity["kl"][str(layer)] / (fractions[1] * tail(layer, 8))
        return weight * fractions[1] * tail(layer, low_rank)

    choices = range(2, 17, 2)
    best = min(
        (sum(cost(i, r) for i, r in enumerate(ranks)), ranks)
        for ranks in itertools.product(choices, repeat=3)
        if sum(ranks) <= 3 * 8
    )
    got = allocate_key_ranks(policy, factors, sensitivity, step=2)
    ranks = [got.key_ranks(i)[1] for i in range(3)]
    assert [got.key_ranks(i)[0] for i in range(3)] == [16, 16, 16]  # full-rank tiers stay full
    assert sum(ranks) == 24
    assert sum(cost(i, r) for i, r in enumerate(ranks)) == pytest.approx(best[0], rel=1e-9)
    assert ranks[1] > ranks[0]  # the sensitive layer gains rank


def test_without_a_measured_cost_the_policy_is_kept_and_a_bad_measurement_is_refused():
    factors = _spectral_factors([[4.0, 2.0, 1.0, 0.5] * 4] * 2)
    policy = two_tier_policy(8, window=8)
    flat = {"kl": {"0": 0.0, "1": 0.0}, "ranks": [16, 8], "fractions": [0.25, 0.75]}
    assert allocate_key_ranks(policy, factors, flat) == policy
    for bad in (
        {**flat, "ranks": [16]},
        {**flat, "ranks": [32, 8]},
        {**flat, "kl": {"0": -1.0}},
        {"kl": 1},
        [],
    ):
        with pytest.raises(ValueError, match="is not a measurement kvcompress wrote; to resolve, re-run"):
            allocate_key_ranks(policy, factors, bad)


def test_methods_are_allocated_from_the_factors_unless_uniform():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(hidden_size=128)).eval()  # head_dim 32: room for steps of 8
    factors = factors_from_model(model, [torch.randint(0, 96, (1, 80)) for _ in range(2)])
    factors.meta[SENSITIVITY_KEY] = {"kl": {"0": 1.0, "1": 0.001}, "ranks": [32, 16], "fractions": [0.5, 0.5]}
    spec = "tiers:32/32@8x0.5+16/16@4x0.5"
    allocated = make_method(spec, model, factors)().policy
    uniform = make_method(f"{spec}:uniform", model, factors)().policy
    assert allocated.key_ranks(0)[1] > allocated.key_ranks(1)[1] and uniform.layer_key_ranks == {}
    assert make_method(f"{spec}:pca:uniform", model, factors)().policy.scored_keys is False
