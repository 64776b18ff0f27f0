"""SwiftKV model math: teacher = base model, inference path = training path, AcrossKV stores one K/V per group."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.chat import byte_tokenizer
from helpers.models import left_padded_batch, tiny_base, to_swiftkv
from transformers import AutoModelForCausalLM

from swiftkv import (
    LlamaSwiftKVConfig,
    LlamaSwiftKVForCausalLM,
    Qwen2SwiftKVConfig,
    Qwen2SwiftKVForCausalLM,
    Qwen3SwiftKVConfig,
    Qwen3SwiftKVForCausalLM,
    convert,
)
from swiftkv.cli import main as cli

CLASSES = {
    "llama": (LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM),
    "qwen2": (Qwen2SwiftKVConfig, Qwen2SwiftKVForCausalLM),
    "qwen3": (Qwen3SwiftKVConfig, Qwen3SwiftKVForCausalLM),
}
ATOL = 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
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


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
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


def test_past_key_values_keyword_is_the_cache():
    """transformers 5.x renamed past_key_values to cache; the old keyword must still carry the cache."""
    model = to_swiftkv(tiny_base("llama"), l=3, g=3)
    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        expected = model(ids[:, 6:], cache=model(ids[:, :6], use_cache=True).cache).logits
        got = model(ids[:, 6:], past_key_values=model(ids[:, :6], use_cache=True).cache).logits
        model.model(ids[:, 3:6], past_key_values=(cache := model(ids[:, :3], use_cache=True).cache))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert cache.get_seq_length() == 6  # the base model's forward took it too


def test_gradient_checkpointing_in_training_turns_the_cache_off_as_stock_llama():
    base = tiny_base("llama")
    model = to_swiftkv(base, l=3, g=3)
    ids = torch.randint(3, 128, (2, 10))
    for m in (base, model):
        m.gradient_checkpointing_enable()
        m.train()
        out = m(ids, use_cache=True)
        assert out.cache is None
        out.logits.sum().backward()
    assert model.model.layers[3].self_attn.k_proj_swiftkv.weight.grad is not None


def test_qwen3_swiftkv_layers_own_head_norms():
    """As the reference training code's Qwen3 model: q_norm_swiftkv on every SwiftKV layer, k_norm_swiftkv on
    each group leader, initialized from q_norm and the group's mean k_norm."""
    base = tiny_base("qwen3")
    model = convert.to_swiftkv(base, 2, 2)
    names = {n for n in model.swiftkv_parameter_names() if "_norm_swiftkv" in n and "layers" in n}
    assert names == {f"model.layers.{j}.self_attn.q_norm_swiftkv.weight" for j in range(2, 6)} | {
        f"model.layers.{j}.self_attn.k_norm_swiftkv.weight" for j in (2, 4)
    }
    attn = model.model.layers[4].self_attn
    torch.testing.assert_close(attn.q_norm_swiftkv.weight, base.model.layers[4].self_attn.q_norm.weight)
    mean = (base.model.layers[4].self_attn.k_norm.weight + base.model.layers[5].self_attn.k_norm.weight) / 2
    torch.testing.assert_close(attn.k_norm_swiftkv.weight, mean)


def test_qwen3_converts_and_loads_with_and_without_the_package(tmp_path):
    """`swiftkv convert` on a tiny Qwen3 checkpoint; teacher mode is stock Qwen3ForCausalLM; the checkpoint
    opens with trust_remote_code in a process that never imports swiftkv and gives the same logits."""
    src, dst = tmp_path / "qwen3", tmp_path / "swift"
    base = tiny_base("qwen3")
    base.save_pretrained(src)
    byte_tokenizer().save_pretrained(src)  # convert refuses a checkpoint without its tokenizer
    assert cli(["convert", str(src), str(dst), "--num-key-value-layers", "3", "--group-size", "3"]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "qwen3_swiftkv" and config["architectures"] == ["Qwen3SwiftKVForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert isinstance(model, Qwen3SwiftKVForCausalLM)
    ids = torch.arange(3, 13)[None]
    with torch.no_grad():
        student = float(model(ids).logits.sum())
        model.set_mode("teacher")
        torch.testing.assert_close(model(ids).logits, base(ids).logits, atol=ATOL, rtol=0)
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True).eval()\n"
        "assert 'swiftkv' not in sys.modules, 'the package was imported'\n"
        "with torch.no_grad(): print(type(m).__name__, float(m(torch.arange(3, 13)[None]).logits.sum()))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    name, total = result.stdout.split()
    assert name == "Qwen3SwiftKVForCausalLM" and abs(float(total) - student) < 1e-3
