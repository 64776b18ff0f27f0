"""Speculative greedy decoding with suffix-cache drafts equals plain greedy decoding token for token."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.models import tiny_base

from eval.serving.suffix.cache import SpecConfig, SuffixCache
from eval.serving.suffix.decode import speculative_generate


def greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def repetitive_prompt(seed: int, vocab: int = 128) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(3, vocab) for _ in range(10)]
    return motif * 3 + [rng.randrange(3, vocab) for _ in range(4)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["path", "tree"])
def test_speculative_output_equals_greedy(family, mode):
    model = tiny_base(family, num_hidden_layers=2)
    model.generation_config.eos_token_id = None
    cache = SuffixCache(SpecConfig(mode=mode, max_spec=8, min_token_prob=0.05))
    steps = emitted = 0
    for r in range(3):  # one cache across requests: later ones also draft from the global tree
        prompt = repetitive_prompt(r % 2)  # repeat prompts so the previous response is in the global tree
        stats = speculative_generate(model, prompt, 32, cache, request_id=r)
        assert stats.tokens == greedy(model, prompt, 32)
        steps, emitted = steps + stats.steps, emitted + len(stats.tokens) - 1
    assert emitted / steps > 1.5  # drafts were accepted, so verification really ran multi-token passes
    assert cache.num_responses == 3


@pytest.mark.parametrize("mode", ["path", "tree"])
def test_swiftkv_model_with_acrosskv_cache_rolls_back(mode):
    from swiftkv.convert import to_swiftkv

    model = to_swiftkv(tiny_base("llama"), num_key_value_layers=2, group_size=2)
    model.generation_config.eos_token_id = None
    cache = SuffixCache(SpecConfig(mode=mode, max_spec=8, min_token_prob=0.05))
    prompt = repetitive_prompt(3)
    stats = speculative_generate(model, prompt, 32, cache)
    assert stats.tokens == greedy(model, prompt, 32)
    assert stats.steps < len(stats.tokens) - 1


@pytest.mark.parametrize("mode", ["path", "tree"])
def test_swiftkv_model_with_exact_kv_window_smaller_than_the_draft_equals_greedy(mode):
    """With exact K/V (W = 2) and drafts of up to 8 tokens, the verification forward asks for every row's logits
    (logits_to_keep), so the pending and draft tokens, all generated, store exact K/V as plain decoding does."""
    from helpers.models import to_swiftkv

    model = to_swiftkv(tiny_base("llama"), l=2)
    model.config.exact_kv_window = 2
    model.generation_config.eos_token_id = None
    cache = SuffixCache(SpecConfig(mode=mode, max_spec=8, min_token_prob=0.05))
    prompt = repetitive_prompt(3)
    stats = speculative_generate(model, prompt, 32, cache)
    assert stats.tokens == greedy(model, prompt, 32)
    assert stats.steps < len(stats.tokens) - 1


def test_tree_draft_with_accepted_branch_laid_out_second():
    """A more frequent wrong branch comes first in the layout; the right one is accepted and fed again."""
    model = tiny_base("llama", num_hidden_layers=2)
    model.generation_config.eos_token_id = None
    prompt = repetitive_prompt(5)
    ref = greedy(model, prompt, 12)
    tail = prompt[-3:] + ref[:1]
    wrong = [(t + 1) % 128 for t in ref[1:4]]
    cache = SuffixCache(SpecConfig(mode="tree", factor=4.0, max_spec=8, min_token_prob=0.1))
    for _ in range(3):
        cache.add_response(tail + wrong)
    cache.add_response(tail + ref[1:5])
    stats = speculative_generate(model, prompt, 12, cache)
    assert stats.tokens == ref
    assert stats.refed > 0


def test_stops_at_eos_like_generate():
    model = tiny_base("llama", num_hidden_layers=2)
    model.generation_config.eos_token_id = None
    prompt = repetitive_prompt(1)
    free = greedy(model, prompt, 30)
    eos = free[7]  # a token greedy decoding emits: generation must stop right after its first occurrence
    model.generation_config.eos_token_id = eos
    stats = speculative_generate(model, prompt, 30, SuffixCache(SpecConfig(max_spec=8)))
    assert stats.tokens == greedy(model, prompt, 30)
    assert stats.tokens[-1] == eos and eos not in stats.tokens[:-1]


@pytest.mark.smollm2
def test_smollm2_self_refinement_equals_greedy(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.serving.suffix.stages import chat_ids

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    draft = "The cat sat on the mat. The cat was happy. The dog sat on the rug."
    prompt = chat_ids(tok, [{"role": "user", "content": f"Rewrite this text, fixing any errors:\n{draft}"}])
    stats = speculative_generate(model, prompt, 24, SuffixCache(SpecConfig(mode="tree")))
    assert stats.tokens == greedy(model, prompt, 24)
    assert stats.steps < len(stats.tokens) - 1  # the copy was drafted and accepted


@pytest.mark.parametrize("window", [8, None])
def test_sliding_window_models_are_refused_by_name(window):
    """A tiny Mistral with sliding_window set: refused before any forward; without a window it decodes."""
    from helpers.models import TINY
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**{**TINY, "sliding_window": window})).eval()
    model.generation_config.eos_token_id = None
    prompt = repetitive_prompt(1)
    if window is not None:
        with pytest.raises(ValueError, match="sliding_window=8"):
            speculative_generate(model, prompt, 32, SuffixCache(SpecConfig(max_spec=8)))
        return
    stats = speculative_generate(model, prompt, 32, SuffixCache(SpecConfig(max_spec=8, min_token_prob=0.05)))
    assert stats.tokens == greedy(model, prompt, 32)
