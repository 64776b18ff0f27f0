"""SwiftKV model math: teacher = base model, inference path = training path, AcrossKV stores one K/V per group."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_base

from swiftkv import (
    LlamaSwiftKVConfig,
    LlamaSwiftKVForCausalLM,
    Qwen2SwiftKVConfig,
    Qwen2SwiftKVForCausalLM,
    convert,
)

CLASSES = {
    "llama": (LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM),
    "qwen2": (Qwen2SwiftKVConfig, Qwen2SwiftKVForCausalLM),
}
ATOL = 1e-5


def to_swiftkv(base, l: int, g: int = 1, perturb: bool = True):
    """Convert in memory, with the new weights perturbed so that the SwiftKV path really differs from the
    teacher (as after distillation)."""
    model = convert.to_swiftkv(base, l, g)
    if perturb:
        torch.manual_seed(1)
        with torch.no_grad():
            for name in model.swiftkv_parameter_names():
                param = model.get_parameter(name)
                param.add_(0.05 * torch.randn_like(param))
    return model


def left_padded_batch(lengths=(9, 5, 7), vocab=128, pad=0):
    torch.manual_seed(3)
    seqs = [torch.randint(3, vocab, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    return seqs, ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("l,g", [(3, 1), (2, 2), (6, 1)])
def test_teacher_mode_is_the_base_model(family, l, g):
    base = tiny_base(family)
    model = to_swiftkv(base, l, g)
    model.set_mode("teacher")
    ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, atol=ATOL, rtol=0)


def test_all_layers_normal_equals_base_in_student_mode():
    base = tiny_base("llama")
    model = to_swiftkv(base, l=6)
    ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, atol=ATOL, rtol=0)


def test_student_mode_differs_from_teacher():
    model = to_swiftkv(tiny_base("llama"), l=3)
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        student = model(ids).logits
        model.set_mode("teacher")
        assert (student - model(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("g", [1, 3])
def test_skip_ahead_prefill_equals_training_path(family, g):
    model = to_swiftkv(tiny_base(family), l=3, g=g)
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for keep in (1, 4):
            out = model(ids, use_cache=True, logits_to_keep=keep)
            assert out.logits.shape[1] == keep
            torch.testing.assert_close(out.logits, full[:, -keep:], atol=ATOL, rtol=0)
        # decode steps against the prefilled cache equal the full pass on the longer sequence
        cache = model(ids[:, :7], use_cache=True, logits_to_keep=1).cache
        for t in range(7, 11):
            step = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits
            torch.testing.assert_close(step[:, -1], full[:, t], atol=ATOL, rtol=0)


@pytest.mark.parametrize("g", [1, 3])
def test_left_padded_batch_matches_unpadded_sequences(g):
    model = to_swiftkv(tiny_base("llama"), l=3, g=g)
    seqs, ids, mask = left_padded_batch()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model(
            ids, attention_mask=mask, position_ids=position_ids, use_cache=True, logits_to_keep=1
        ).logits
        for i, s in enumerate(seqs):
            alone = model(s[None], use_cache=False).logits[:, -1]
            torch.testing.assert_close(batched[i, -1], alone[0], atol=ATOL, rtol=0)


def _greedy_without_cache(model, seq, steps):
    for _ in range(steps):
        logits = model(seq[None], use_cache=False).logits[0, -1]
        seq = torch.cat([seq, logits.argmax()[None]])
    return seq


@pytest.mark.parametrize("g", [1, 3])
def test_greedy_generate_equals_training_path_tokens(g):
    model = to_swiftkv(tiny_base("llama"), l=3, g=g)
    seqs, ids, mask = left_padded_batch()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        for i, s in enumerate(seqs):
            assert out[i, ids.shape[1] :].tolist() == _greedy_without_cache(model, s, 8)[len(s) :].tolist()


def test_sampling_generate_with_and_without_cache_agree():
    model = to_swiftkv(tiny_base("llama"), l=3, g=1)
    ids = torch.randint(3, 128, (2, 6))
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        outs.append(
            model.generate(
                ids,
                max_new_tokens=10,
                do_sample=True,
                top_k=0,
                use_cache=use_cache,
                pad_token_id=0,
                eos_token_id=None,
            )
        )
    assert outs[0].tolist() == outs[1].tolist()


@pytest.mark.parametrize("g,slots", [(1, 6), (3, 4)])
def test_acrosskv_cache_stores_one_kv_per_group(g, slots):
    model = to_swiftkv(tiny_base("llama"), l=3, g=g)
    with torch.no_grad():
        cache = model(torch.randint(3, 128, (1, 9)), use_cache=True, logits_to_keep=1).cache
    filled = [
        i for i, layer in enumerate(cache.layers) if layer.is_initialized and layer.get_seq_length() == 9
    ]
    assert filled == [0, 1, 2, *range(3, 6, g)]
    assert len(filled) == slots


def test_teacher_student_hidden_shares_lower_layers():
    base = tiny_base("llama")
    model = to_swiftkv(base, l=3, g=3)
    ids = torch.randint(3, 128, (2, 10))
    teacher, student, t_in, s_in = model.model.teacher_student_hidden(ids)
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(teacher), base(ids).logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(model.lm_head(student), model(ids).logits, atol=ATOL, rtol=0)
        hidden = base(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(t_in, hidden[-2], atol=ATOL, rtol=0)
    assert student.requires_grad and not teacher.requires_grad and s_in.requires_grad


def test_trainable_parameter_names_follow_the_design():
    model = to_swiftkv(tiny_base("llama"), l=2, g=2)
    expected = {"model.norm_swiftkv.weight"}
    expected |= {f"model.layers.{j}.self_attn.q_proj_swiftkv.weight" for j in range(2, 6)}
    expected |= {f"model.layers.{j}.self_attn.{p}_proj_swiftkv.weight" for j in (2, 4) for p in "kv"}
    assert set(model.swiftkv_parameter_names()) == expected
    with pytest.raises(ValueError, match="mode must be"):
        model.set_mode("student ")
