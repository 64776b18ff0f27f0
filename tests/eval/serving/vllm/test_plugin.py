"""The SwiftKV vLLM plugin on vLLM's CPU build, against our transformers path.

Greedy tokens equal the transformers path's under what a loaded server does: prefix-cache hits with the rest of
a prompt chunked over several steps beside running decodes, recompute after preemption, n-gram speculative
decoding with chunked prefill, compiled Qwen2 and Qwen3 (AcrossKV), tensor parallel 2 with a replicated and with
split KV heads; the SwiftKV decode stack always runs on the model's static buffers (rows at offset 0) under a
batch descriptor of the rows it gets, which is what vLLM's CUDA graphs need (CPU captures none; see
docs/serving.md); with fast prefill off, prompt log-probabilities equal the transformers path's and lm-eval's
``vllm`` backend scores a log-likelihood task; with it on, such a request is refused and the engine serves on.
Also: FP8 KV-cache scales shared by every layer that reads a group's cache, EAGLE-3 auxiliary states, teacher
mode, a missing SwiftKV weight refused by name, a registration that cannot break vLLM, the OpenAI server, and
every vLLM internal the plugin uses resolved in the installed vLLM.  Exact K/V (``exact_kv_window``; one more
vLLM process): the transformers tokens compiled and eager, chunked (the rows by position, not by chunk), with
prefix hits that stop below the window, Qwen3 and n-gram speculation (``test_exact_schedule.py``: chunking,
preemption and prefix hits against each request served alone).  The weight-name routing, the head split, the exact rows and the config hook are
checked without vLLM.

vLLM lives in its own venv (``scripts/setup_vllm_cpu.sh`` makes .venv-vllm; it pins transformers < 5.20), so the
checkpoints and the reference tokens are made here and all engines run in ONE subprocess there
(``python -m tests.helpers.vllm_cases --cases``), which pays vLLM's import once.  One file on purpose (~1,260 lines):
that process is a module fixture, and a file's tests stay on one xdist worker (``--dist loadfile``), so a second file
would start a second process and pay it again (~15 s of CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT
from helpers.ci import NO_FP8_KV_ON_THIS_CPU, VLLM_PYTHON, cpu_runs_fp8_kv
from helpers.models import tiny_base
from helpers.vllm_cases import fixed_folder, run_cases
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import swiftkv.convert
from eval.serving.vllm import (
    FAST_PREFILL_ENV,
    PROMPT_LOGPROBS_REFUSED,
    SwiftKVConfigHook,
    fast_prefill_reason,
    fast_prefill_refusal,
    refuse_prompt_logprobs,
)
from eval.serving.vllm.cpu import cpu_environment
from eval.serving.vllm.layout import (
    TO_VLLM,
    Route,
    SwiftKVLayout,
    exact_rows,
    kv_head_slice,
    kv_head_split,
    padded_count,
)
from swiftkv.configuration_swiftkv import LlamaSwiftKVConfig, Qwen2SwiftKVConfig, Qwen3SwiftKVConfig


def needs_vllm(test):
    """Runs in the vLLM venv (fails under CI=true if missing) with the embedded SmolLM2's cases in the same
    process; a vLLM start is slow."""
    return pytest.mark.slow(pytest.mark.vllm(pytest.mark.smollm2(test)))


# head_dim 32: vLLM's CPU attention supports head sizes >= 32
TINY = dict(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=6)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [(7 * i) % 120 + 3 for i in range(70)]]  # mixed lengths
MAX_TOKENS = 8
# vLLM's CPU attention needs blocks of 32: the 70-token prompt fills two, so a second pass hits the prefix cache;
# 32-token steps chunk it
CACHED = {"block_size": 32, "enable_prefix_caching": True, "max_num_batched_tokens": 32}
# A loaded server in miniature: prefix cache, 32-token steps and room for 12 blocks of 32 tokens (1,536 bytes per
# token over 6 caches), so the second batch (5 requests needing 17 blocks) is preempted and recomputed
LOADED = {**CACHED, "max_num_seqs": 8, "kv_cache_memory_bytes": 12 * 32 * 1536, "max_model_len": 256,
          "disable_log_stats": False}  # fmt: skip
LONG = list(range(5, 75))  # fills two blocks
SHORTS = [list(range(s, s + 20)) for s in (3, 30, 50, 70)]
BUSY = [
    *SHORTS,
    LONG + list(range(90, 110)),
]  # short ones decode while the long one's uncached rest is chunked
# repetitive prompts, so vLLM's n-gram proposer drafts tokens that the target then verifies
SPEC_PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 2 + [5, 6, 7], [12, 13] * 4, [(7 * i) % 120 + 3 for i in range(40)]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
MISSING = "layers.5.self_attn.q_proj_swiftkv.weight"
TINY_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id")  # fmt: skip
AUX_LAYERS = [1, 3, 5]  # after layers 0 and 2 (x_l: l = 3 of 6) and after layer 4 (a SwiftKV layer)
SCORING = {"hf_overrides": {"swiftkv_fast_prefill": False}}  # the per-engine switch
FP8_SCALES = {"layers.0.self_attn.k_scale": 0.5, "layers.3.self_attn.k_proj_swiftkv.k_scale": 0.25,
              "layers.3.self_attn.k_scale": 0.125, "layers.5.self_attn.v_scale": 0.75}  # fmt: skip
# Exact K/V (exact_kv_window W): a 40-token prompt alone is prefilled in 32-token steps as 32 + 8 (its positions
# 40-W..39 exact, as in one step) and generates 30 tokens; it caches only its first block (positions 0-31, below
# its window), so the second prompt, the first plus its continuation (70 tokens), hits that block alone and
# prefills 32..69 itself: the first request's window and generated tokens are SwiftKV prompt tokens to it, as
# when it is served alone
WINDOW_PROMPT = [(11 * i) % 100 + 3 for i in range(40)]
WINDOW_TOKENS = 30
EXACT_MISSING = "layers.4.self_attn.v_proj.weight"  # the teacher V of a SwiftKV layer, needed with exact K/V


def prompt_window(length: int, window: int) -> set[int]:
    """The prompt positions a request stores exact K/V at, however it is scheduled: its prompt's last ``window``."""
    return set(range(max(0, length - window), length))


def step(prompts, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    return {"prompts": prompts, "max_tokens": max_tokens, **extra}


def reference(
    path: Path, mode: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, chunk: int | None = None
) -> list[list[int]]:
    """Greedy continuations from our transformers inference path (one prompt at a time, no padding; ``chunk``:
    prefill in chunks of that many tokens, as vLLM does one request alone with ``max_num_batched_tokens=chunk``)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_mode(mode)
    model.generation_config.eos_token_id = None  # like vLLM's ignore_eos: EOS may be generated, not banned
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
            prefill_chunk_size=chunk,
        )  # fmt: skip
        out.append(gen[0, len(prompt) :].tolist())
    return out


def exact_greedy(path: Path, prompt: list[int], exact: set[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy continuation from the independent reference student (``helpers/reference.py``) with exact K/V
    at the prompt positions ``exact`` and at every generated one: the by-hand counterpart of a vLLM request whose
    exact rows came partly from prefix-cache hits."""
    from helpers.reference import student_logits

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            mask = torch.tensor([[i in exact or i >= len(prompt) for i in range(len(ids))]])
            ids.append(int(student_logits(model, torch.tensor([ids]), None, mask)[0, -1].argmax()))
    return ids[len(prompt) :]


def token_logprobs(path: Path, prompts) -> list[list[float]]:
    """Each prompt token's log-probability given the tokens before it, from our transformers student path (a
    full forward: every token through every layer with the SwiftKV K/V)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_mode("student")
    out = []
    with torch.no_grad():
        for prompt in prompts:
            logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
            out.append([logprobs[i - 1, t].item() for i, t in enumerate(prompt) if i > 0])
    return out


def layer_outputs(path: Path, prompt: list[int]) -> dict[int, torch.Tensor]:
    """Hidden states after every decoder layer of our transformers student path on ``prompt`` (a full forward),
    keyed like vLLM's auxiliary layers: i = after layer i - 1."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_mode("student")
    outputs = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(
            lambda _m, _a, out, i=i: outputs.__setitem__(i + 1, out[0] if isinstance(out, tuple) else out)
        )
    with torch.no_grad():
        model(torch.tensor([prompt]))
    return {i: h[0] for i, h in outputs.items()}


def tiny_qwen3(path: Path) -> Path:
    """A tiny random Qwen3 with non-trivial q/k head norms (transformers initializes them to ones)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    base = tiny_base("llama", **TINY)
    torch.manual_seed(0)
    config = Qwen3Config(**{k: v for k, v in base.config.to_dict().items() if k in TINY_KEYS}, head_dim=32)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    return path


def edit_checkpoint(src: Path, dst: Path, config=None, drop: str | None = None, add=None) -> Path:
    """A copy of ``src`` with config.json keys replaced, one tensor dropped, or tensors added."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop or add:
        (shard,) = dst.glob("*.safetensors")
        tensors = load_file(shard)
        tensors.pop("model." + drop) if drop else tensors.update(add)
        save_file(tensors, shard, metadata={"format": "pt"})
        shutil.rmtree(dst / "model.safetensors.index.json", ignore_errors=True)
    return dst


def fp8_kv_checkpoint(src: Path, dst: Path) -> Path:
    """``src`` with a compressed-tensors FP8 KV-cache scheme (weights stay unquantized) and per-tensor K/V scales
    in both places a checkpoint carries them: on a layer's attention and on the SwiftKV K projection."""
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    quantization = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                    "kv_cache_scheme": scheme, "ignore": [], "quantization_status": "compressed"}  # fmt: skip
    scales = {"model." + name: torch.tensor(value) for name, value in FP8_SCALES.items()}
    return edit_checkpoint(src, dst, config={"quantization_config": quantization}, add=scales)


@pytest.fixture(scope="module")
def compiled_dir() -> Iterator[Path]:
    """Where the checkpoints of compiled engines are built: the same path every run (``fixed_folder``)."""
    with fixed_folder("vllm-plugin") as folder:
        yield folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_python, smollm2, compiled_dir):
    tmp = tmp_path_factory.mktemp("vllm")
    tiny_base("llama", **TINY).save_pretrained(tmp / "base")
    g1 = swiftkv.convert.convert(tmp / "base", tmp / "g1", swiftkv_fraction=0.5)
    tiny_base("llama", **{**TINY, "num_key_value_heads": 2}).save_pretrained(tmp / "base-2kv")
    split = swiftkv.convert.convert(tmp / "base-2kv", tmp / "split", swiftkv_fraction=0.5, group_size=3)
    tiny_base("qwen2", **TINY).save_pretrained(tmp / "qwen2-base")
    qwen2 = swiftkv.convert.convert(tmp / "qwen2-base", compiled_dir / "qwen2", swiftkv_fraction=0.5)
    qwen3 = swiftkv.convert.convert(
        tiny_qwen3(tmp / "qwen3-base"), compiled_dir / "qwen3", swiftkv_fraction=0.5, group_size=3
    )
    teacher = edit_checkpoint(g1, tmp / "teacher", config={"swiftkv": False})
    missing = edit_checkpoint(g1, tmp / "missing", drop=MISSING)
    fp8 = fp8_kv_checkpoint(g1, tmp / "fp8")
    smol = swiftkv.convert.convert(smollm2, tmp / "smol50", swiftkv_fraction=0.5)
    smol_teacher = edit_checkpoint(smol, tmp / "smol-teacher", config={"swiftkv": False})
    smol_prompts = [[1, 9690, 198] + [(37 * i) % 40000 + 100 for i in range(n)] for n in (5, 60, 300)]
    compiled = {**CACHED, "enforce_eager": False}
    cases = {
        # the CUDA attention branch (custom ops), every step recorded, a loaded server's batches
        "loaded": dict(
            model=str(g1),
            engine=LOADED,
            opaque=True,
            record=True,
            steps=[step([LONG], 4), step(BUSY, 48), step([[5, 6, 7]], 2, prompt_logprobs=1), step(PROMPTS)],
        ),
        "scoring": dict(
            model=str(g1),
            engine=SCORING,
            record=True,
            aux_layers=AUX_LAYERS,
            steps=[step(PROMPTS), step(PROMPTS, 1, prompt_logprobs=1)],
        ),
        "qwen2": dict(model=str(qwen2), engine=compiled, steps=[step(PROMPTS), step(PROMPTS)]),
        "qwen3": dict(model=str(qwen3), engine=compiled, steps=[step(PROMPTS), step(PROMPTS)]),
        "teacher": dict(model=str(teacher), engine=CACHED, steps=[step(PROMPTS)]),
        "missing": dict(model=str(missing), steps=[]),
        **(
            {
                "fp8": dict(
                    model=str(fp8), engine={"kv_cache_dtype": "fp8"}, scales=True, steps=[step(PROMPTS)]
                )
            }
            if cpu_runs_fp8_kv()
            else {}
        ),
        # 2 ranks, 1 KV head: replicated on both; 2 KV heads: one per rank, with AcrossKV groups of 3
        "tp2_replicated": dict(model=str(g1), engine={"tensor_parallel_size": 2}, steps=[step(PROMPTS)]),
        "tp2_split": dict(model=str(split), engine={"tensor_parallel_size": 2}, steps=[step(PROMPTS)]),
        "smol_stock": dict(model=str(smollm2), engine={"max_model_len": 512}, steps=[step(smol_prompts, 6)]),
        "smol_teacher": dict(
            model=str(smol_teacher), engine={"max_model_len": 512}, steps=[step(smol_prompts, 6)]
        ),  # fmt: skip
        "smol_student": dict(
            model=str(smol),
            engine={**CACHED, "max_model_len": 512},
            steps=[step(smol_prompts, 6), step(smol_prompts, 6)],
        ),  # fmt: skip
        # last: an engine started after a speculative one in the same process fails in vLLM 0.32
        "spec": dict(
            model=str(g1),
            engine={"speculative_config": NGRAM, "max_num_batched_tokens": 16},
            record=True,
            steps=[step(SPEC_PROMPTS, 12)],
        ),  # fmt: skip
    }
    results = dict(zip(cases, run_cases(list(cases.values()), tmp), strict=True))
    refs = {
        "g1": reference(g1, "student"),
        "long": reference(g1, "student", [LONG], 4),
        "busy": reference(g1, "student", BUSY, 48),
        "split": reference(split, "student"),
        "qwen2": reference(qwen2, "student"),
        "qwen3": reference(qwen3, "student"),
        "qwen3_teacher": reference(qwen3, "teacher"),
        "teacher": reference(g1, "teacher"),
        "logprobs": token_logprobs(g1, PROMPTS),
        "aux": [layer_outputs(g1, p) for p in PROMPTS],
        "spec": reference(g1, "student", SPEC_PROMPTS, 12),
        "smol": reference(smol, "student", smol_prompts, 6),
    }
    return results, refs


def tokens(result: dict) -> list:
    """Each step's greedy tokens (or its error), after checking that the engine started."""
    assert "error" not in result, result["error"]
    return [s.get("tokens", s.get("error")) for s in result["steps"]]


def assert_static_decode_inputs(calls: dict) -> None:
    """Every call of the decode stack read the model's static buffers at offset 0 (CUDA graphs replay on the
    addresses they were captured with) and ran under a batch descriptor of the rows it was given."""
    assert calls["decode"] and None not in calls["buffers"]
    for call in calls["decode"]:
        assert call["ptrs"] == calls["buffers"], call
        assert call["descriptor"] in (None, call["rows"][0]), call


# -- without vLLM --------------------------------------------------------------------------------------------


def test_kv_heads_are_split_or_replicated_like_vllms_qkv_linear():
    """For every (ranks, KV heads) the plugin's own head slice gives each rank whole heads, vLLM's
    ``max(1, heads // tp)`` of them, and together the ranks hold every head (replicated when tp > heads)."""
    for tp in (1, 2, 4, 8):
        for heads in (1, 2, 4, 8):
            per_rank, replicas = kv_head_split(heads, tp)
            assert per_rank == max(1, heads // tp) and per_rank * tp == heads * replicas
            slices = [kv_head_slice(rank, heads, tp) for rank in range(tp)]
            assert all(len(s) == per_rank and 0 <= s.start and s.stop <= heads for s in slices)
            held = [h for s in slices for h in s]
            assert sorted(set(held)) == list(range(heads)) and len(held) == heads * replicas
    assert [list(kv_head_slice(r, 2, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    with pytest.raises(ValueError, match="num_key_value_heads=6 is not divisible by tensor_parallel_size=4"):
        kv_head_split(6, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=6 is not a multiple of num_key_value_heads=4"):
        kv_head_split(4, 6)


def test_quantized_and_swiftkv_names_are_routed():
    """Every tensor of a SwiftKV projection (FP8's weight_scale / input_scale, KV-cache scales) goes where its
    weight goes, as vLLM's Llama loader does for q/k/v; unused teacher tensors are skipped."""
    layout = SwiftKVLayout(
        LlamaSwiftKVConfig(num_hidden_layers=8, num_key_value_layers=4, key_value_group_size=2, swiftkv=True)
    )
    attn = "layers.{}.self_attn."
    expected = {
        attn.format(6) + "k_proj_swiftkv.weight": Route("kv_proj_swiftkv.weight", 2),
        attn.format(6) + "k_proj_swiftkv.weight_scale": Route("kv_proj_swiftkv.weight_scale", 2),
        attn.format(4) + "v_proj_swiftkv.input_scale": Route("kv_proj_swiftkv.input_scale", 1),
        attn.format(4) + "v_proj_swiftkv.weight_zero_point": Route("kv_proj_swiftkv.weight_zero_point", 1),
        attn.format(6) + "k_proj_swiftkv.k_scale": Route(
            "swiftkv_kv.6.k_scale"
        ),  # KV-cache scales: the holder
        attn.format(6) + "v_proj_swiftkv.attn.v_scale": Route(
            "swiftkv_kv.6.v_scale"
        ),  # after vLLM's name mapper
        attn.format(4) + "k_proj_swiftkv.output_scale": Route("swiftkv_kv.4.k_scale"),  # compressed-tensors
        attn.format(5) + "q_proj_swiftkv.output_scale": Route(attn.format(5) + "attn.q_scale"),
        attn.format(5) + "k_proj_swiftkv.attn.k_scale": None,  # AcrossKV non-leader: no cache of its own
        attn.format(2) + "k_proj_swiftkv.attn.k_scale": None,  # below l: no SwiftKV K
        attn.format(5) + "q_proj_swiftkv.weight_scale": Route(attn.format(5) + "q_proj_swiftkv.weight_scale"),
        attn.format(5) + "k_proj_swiftkv.weight_scale": None,  # AcrossKV non-leader: its group uses layer 4's
        attn.format(5) + "k_proj.weight_scale": None,  # the teacher's K of a SwiftKV layer is never used
        attn.format(6) + "q_norm.weight": None,
        attn.format(5) + "k_scale": TO_VLLM,  # the layer's own attention scale: vLLM's loader, then shared
        attn.format(3) + "k_proj.weight_scale": TO_VLLM,  # layers < l: vLLM's Llama loader (into qkv_proj)
        "layers.6.mlp.down_proj.weight_scale": TO_VLLM,
        "norm_swiftkv.weight": Route("norm_swiftkv.weight"),
        attn.format(6) + "k_norm_swiftkv.weight": Route("k_norm_swiftkv.1.weight"),
    }
    assert {name: layout.route(name) for name in expected} == expected


def test_exact_kv_weights_are_routed_and_required():
    """With exact K/V every layer >= l takes the teacher's k/v (weights, biases, quantization tensors) into its
    fused ``exact_kv_proj`` and Qwen3's k_norm into ``exact_k_norm``, their KV-cache scales onto the layer's
    attention (shared with its holder); the teacher q stays unused; the checkpoint must carry them."""
    attn = "layers.{}.self_attn."
    qwen3 = SwiftKVLayout(
        Qwen3SwiftKVConfig(num_hidden_layers=6, num_key_value_layers=3, swiftkv=True, exact_kv_window=3)
    )
    expected = {
        attn.format(4) + "k_proj.weight": Route(attn.format(4) + "exact_kv_proj.weight", 0),
        attn.format(4) + "v_proj.weight": Route(attn.format(4) + "exact_kv_proj.weight", 1),
        attn.format(5) + "v_proj.weight_scale": Route(attn.format(5) + "exact_kv_proj.weight_scale", 1),
        attn.format(3) + "k_norm.weight": Route(attn.format(3) + "exact_k_norm.weight"),
        attn.format(5) + "k_proj.k_scale": Route(attn.format(5) + "attn.k_scale"),
        attn.format(5) + "v_proj.attn.v_scale": Route(attn.format(5) + "attn.v_scale"),
        attn.format(3) + "k_proj.output_scale": Route(attn.format(3) + "attn.k_scale"),
        attn.format(4) + "q_proj.weight": None,  # queries stay q_proj_swiftkv
        attn.format(4) + "q_norm.weight": None,
        attn.format(2) + "k_proj.weight": TO_VLLM,  # below l: vLLM's own loader, as without exact K/V
        attn.format(4) + "k_proj_swiftkv.weight": Route("kv_proj_swiftkv.weight", 2),
    }
    assert {name: qwen3.route(name) for name in expected} == expected
    required = qwen3.required_weights()
    for j in (3, 4, 5):
        assert {attn.format(j) + n for n in ("k_proj.weight", "v_proj.weight", "k_norm.weight")} <= required
    assert not any(n.startswith(attn.format(2)) for n in required)
    qwen2_config = Qwen2SwiftKVConfig(
        num_hidden_layers=6, num_key_value_layers=3, swiftkv=True, exact_kv_window=1
    )
    qwen2_config.qkv_bias = True  # as Qwen2SwiftKVForCausalLM sets it for vLLM's Llama layers
    qwen2 = SwiftKVLayout(qwen2_config)
    assert qwen2.route(attn.format(3) + "v_proj.bias") == Route(attn.format(3) + "exact_kv_proj.bias", 1)
    assert attn.format(3) + "k_proj.bias" in qwen2.required_weights()
    published = SwiftKVLayout(LlamaSwiftKVConfig(num_hidden_layers=6, num_key_value_layers=3, swiftkv=True))
    assert published.route(attn.format(4) + "k_proj.weight") is None
    assert published.route(attn.format(5) + "k_proj.k_scale") is None
    assert attn.format(4) + "k_proj.weight" not in published.required_weights()


def test_exact_rows_hold_every_logits_row():
    """Whole prompts of 7 and 2 tokens, the last 70-token chunk of a prompt, and vLLM's empty padding request: each
    prompt's last min(q_len, W) rows, in order; verifications of 1 + 2 drafts (past the prompt): every row.  The
    rows always hold the logits rows (the last row of each request); padding to a captured size only up to the
    static buffers.  (By position, whatever the chunking: test_exact_schedule.py.)"""
    starts, seq_lens, prompts = [0, 7, 9, 79, 79], [7, 2, 100, 0], [7, 2, 100, 0]
    assert exact_rows(starts, seq_lens, prompts, 3) == ([4, 5, 6, 7, 8, 76, 77, 78], [True] * 8, 3)
    assert exact_rows(starts, seq_lens, prompts, 1) == ([6, 8, 78], [True] * 3, 1)
    assert exact_rows([0, 3, 6], [20, 30], [17, 27], 3) == ([0, 1, 2, 3, 4, 5], [True] * 6, 3)
    for window in (1, 2, 5, 80):
        rows, _, _ = exact_rows(starts, seq_lens, prompts, window)
        assert {end - 1 for end in starts[1:]} <= set(rows) and rows == sorted(set(rows))
    assert padded_count(5, [1, 2, 4, 8, 16], 512) == 8
    assert padded_count(17, [1, 2, 4, 8, 16], 512) == 17  # above every captured size: unpadded
    assert padded_count(5, [8], 6) == 5  # a captured size beyond the buffers is never used
    assert padded_count(5, [], 512) == 5


def engine_config(
    *, swiftkv=True, l=3, spec=None, drafts=2, adaptive=False, dbo=False, cudagraph="FULL_AND_PIECEWISE",
    runner="generate", **hf,
):  # fmt: skip
    """The parts of a VllmConfig the config hook reads: a checkpoint of 6 layers, l of them normal."""
    hf_config = SimpleNamespace(swiftkv=swiftkv, num_key_value_layers=l, num_hidden_layers=6, **hf)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf_config, runner_type=runner, architecture="LlamaSwiftKVForCausalLM"
        ),
        speculative_config=None
        if spec is None
        else SimpleNamespace(
            method=spec,
            use_eagle=lambda: spec == "eagle3",
            num_speculative_tokens=drafts,
            enable_adaptive_verification=adaptive,
        ),  # fmt: skip
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=cudagraph)),
        cache_config=SimpleNamespace(kv_sharing_fast_prefill=None),
        parallel_config=SimpleNamespace(use_ubatching=dbo),
    )


@pytest.mark.parametrize(
    "config, env, fast_prefill",
    [
        (engine_config(), None, True),
        (engine_config(swiftkv=False), None, False),  # teacher mode
        (engine_config(l=6), None, False),  # l = L: nothing to skip
        (engine_config(spec="eagle3"), None, False),  # EAGLE drafts from every prompt row
        (engine_config(spec="ngram"), None, True),
        (engine_config(cudagraph="FULL"), None, False),  # mixed steps replayed whole
        (engine_config(), "0", False),
        (engine_config(), "1", True),
        (engine_config(swiftkv_fast_prefill=False), None, False),  # hf_overrides, per engine
        (engine_config(swiftkv_fast_prefill=True), "0", True),  # the engine's choice beats the environment
    ],
)
def test_config_hook_decides_fast_prefill(monkeypatch, config, env, fast_prefill):
    if env is None:
        monkeypatch.delenv(FAST_PREFILL_ENV, raising=False)
    else:
        monkeypatch.setenv(FAST_PREFILL_ENV, env)
    SwiftKVConfigHook.verify_and_update_config(config)
    assert config.cache_config.kv_sharing_fast_prefill is fast_prefill
    assert (fast_prefill_reason(config) is None) is fast_prefill


def test_config_hook_refuses_bad_switches_and_pooling(monkeypatch):
    monkeypatch.setenv(FAST_PREFILL_ENV, "yes")
    with pytest.raises(ValueError, match=r"SWIFTKV_FAST_PREFILL='yes' is not 0 or 1 \(to resolve"):
        SwiftKVConfigHook.verify_and_update_config(engine_config())
    monkeypatch.delenv(FAST_PREFILL_ENV)
    with pytest.raises(ValueError, match="swiftkv_fast_prefill='no' is not a boolean"):
        SwiftKVConfigHook.verify_and_update_config(engine_config(swiftkv_fast_prefill="no"))
    with pytest.raises(ValueError, match="cannot run as a pooling model.*SWIFTKV_FAST_PREFILL=0"):
        SwiftKVConfigHook.verify_and_update_config(engine_config(runner="pooling"))
    monkeypatch.setenv(FAST_PREFILL_ENV, "0")
    SwiftKVConfigHook.verify_and_update_config(pooling := engine_config(runner="pooling"))
    assert pooling.cache_config.kv_sharing_fast_prefill is False  # every row through every layer: allowed


@pytest.mark.parametrize(
    "config, refused",
    [
        (engine_config(exact_kv_window=3), None),
        (engine_config(exact_kv_window=3, spec="ngram", drafts=2), None),  # W = 1 + drafts
        (engine_config(exact_kv_window=1, spec="ngram", drafts=4), None),  # W = 1: the logits rows
        (engine_config(exact_kv_window=2, spec="ngram", drafts=2), "shorter than a speculative verification"),
        (engine_config(exact_kv_window=3, spec="eagle3"), "needs SwiftKV fast prefill, which is off here"),
        (engine_config(exact_kv_window=3, cudagraph="FULL"), "needs SwiftKV fast prefill"),
        (engine_config(exact_kv_window=3, swiftkv_fast_prefill=False), "needs SwiftKV fast prefill"),
        (engine_config(exact_kv_window=3, spec="ngram", adaptive=True), "adaptive verification"),
        (engine_config(exact_kv_window=1, spec="ngram", adaptive=True), "adaptive verification"),
        (engine_config(exact_kv_window=1, dbo=True), "micro-batching"),
        (engine_config(exact_kv_window=3, swiftkv=False, swiftkv_fast_prefill=False), None),  # teacher mode
    ],
)
def test_config_hook_refuses_what_exact_kv_cannot_serve(monkeypatch, config, refused):
    """Exact K/V need the rows fast prefill runs: with it off (EAGLE, FULL graphs, the switch) the engine is
    refused in one line, and so are a window shorter than a verification, adaptive verification and
    micro-batching; teacher mode ignores the window."""
    monkeypatch.delenv(FAST_PREFILL_ENV, raising=False)
    if refused is None:
        SwiftKVConfigHook.verify_and_update_config(config)
        return
    with pytest.raises(ValueError, match=rf"exact_kv_window=\d .*{refused}.*\(to resolve, "):
        SwiftKVConfigHook.verify_and_update_config(config)


@pytest.mark.parametrize(
    ("mode", "compile_mode", "backend", "dcp", "refused"),
    [
        ("FULL_AND_PIECEWISE", "VLLM_COMPILE", "FLASH_ATTN", 1, None),
        ("PIECEWISE", "VLLM_COMPILE", "TRITON_ATTN", 1, None),
        # what vLLM's set_splitting_ops_for_v1 makes of the default after the hook without splitting ops (the
        # test below runs vLLM's own code)
        ("FULL", "VLLM_COMPILE", "FLASH_ATTN", 1, "cudagraph_mode resolved to FULL after the SwiftKV config"),
        (
            "FULL_AND_PIECEWISE",
            "VLLM_COMPILE",
            "FLASHINFER",
            1,
            "the FLASHINFER attention backend plans on host",
        ),
        ("FULL_AND_PIECEWISE", "VLLM_COMPILE", "FLASH_ATTN", 2, "decode context parallel reads host copies"),
    ],
)
def test_fast_prefill_is_refused_where_vllm_resolved_it_unsafe_after_the_hook(
    mode, compile_mode, backend, dcp, refused
):
    """The config hook decides fast prefill before vLLM resolves the CUDA-graph mode: a default that becomes FULL
    later is caught when the model is built, as are backends that read the fast-prefill offsets on the host."""
    config = engine_config()
    SwiftKVConfigHook.verify_and_update_config(config)
    assert config.cache_config.kv_sharing_fast_prefill is True
    config.compilation_config = SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode), mode=compile_mode)
    config.parallel_config.decode_context_parallel_size = dcp
    reason = fast_prefill_refusal(config, backend)
    if refused is None:
        assert reason is None
    else:
        assert reason.startswith(refused) and "(to resolve, " in reason and f"{FAST_PREFILL_ENV}=0" in reason
    config.cache_config.kv_sharing_fast_prefill = False  # fast prefill off: nothing to refuse
    assert fast_prefill_refusal(config, backend) is None


def test_prompt_logprobs_are_refused_only_with_fast_prefill():
    config = engine_config()
    config.cache_config.kv_sharing_fast_prefill = True
    for asked in (0, 1):  # 0 asks for the prompt tokens' own log-probabilities (vLLM's server lets 0 through)
        with pytest.raises(ValueError, match="SWIFTKV_FAST_PREFILL=0"):
            refuse_prompt_logprobs(config, SimpleNamespace(prompt_logprobs=asked))
    refuse_prompt_logprobs(config, SimpleNamespace(prompt_logprobs=None))
    config.cache_config.kv_sharing_fast_prefill = False
    refuse_prompt_logprobs(config, SimpleNamespace(prompt_logprobs=1))
    config.cache_config.kv_sharing_fast_prefill = True
    config.model_config.architecture = "Gemma3nForCausalLM"  # another model's engine: not ours to refuse
    refuse_prompt_logprobs(config, SimpleNamespace(prompt_logprobs=1))


# -- one vLLM process, many engines ----------------------------------------------------------------------------


@needs_vllm
def test_loaded_server_batches_equal_transformers(runs):
    """Prefix-cache hits with the rest of the prompt chunked beside running decodes, and recompute after
    preemption, through the CUDA branch of the attention calls: the transformers path's tokens."""
    results, refs = runs
    loaded = results["loaded"]
    assert tokens(loaded)[:2] == [refs["long"], refs["busy"]]
    assert loaded["steps"][1]["cached"][-1] == 64  # the long prompt's two full blocks came from the cache
    assert loaded["preemptions"] > 0
    calls = loaded["calls"][0]
    # at most one row per request entered layers >= l, and prompt rows were really left out
    assert all(call["rows"][0] <= len(BUSY) for call in calls["decode"])
    assert any(call["rows"][0] < n for call, n in zip(calls["decode"], calls["tokens"], strict=True))


@needs_vllm
def test_decode_stack_runs_on_static_buffers_in_every_kind_of_step(runs):
    """Prefill, mixed, chunked, all-rows and speculative steps: the decode stack's inputs are the same static
    buffers, rows at offset 0, and the batch descriptor says how many rows it runs."""
    results, _ = runs
    for case in ("loaded", "scoring", "spec"):
        for calls in results[case]["calls"]:
            assert_static_decode_inputs(calls)
    scoring = results["scoring"]["calls"][0]  # fast prefill off: every row, every step
    assert [call["rows"][0] for call in scoring["decode"]] == scoring["tokens"]


@needs_vllm
def test_prompt_logprobs_refused_with_fast_prefill_and_the_engine_serves_on(runs):
    results, refs = runs
    refused, after = results["loaded"]["steps"][2:]
    assert refused["error"] == f"VLLMValidationError: {PROMPT_LOGPROBS_REFUSED} (parameter=prompt_logprobs)"
    assert after["tokens"] == refs["g1"]


@needs_vllm
def test_prompt_logprobs_with_fast_prefill_off_equal_transformers(runs):
    """``hf_overrides={"swiftkv_fast_prefill": false}``: every prompt row runs the upper layers, so vLLM's prompt
    log-probabilities are the transformers path's token log-likelihoods (fp32, within 1e-4)."""
    results, refs = runs
    greedy, scored = results["scoring"]["steps"]
    assert greedy["tokens"] == refs["g1"]
    for got, expected in zip(scored["prompt_logprobs"], refs["logprobs"], strict=True):
        assert got[0] is None  # the first token has no context
        torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(expected), atol=1e-4, rtol=0)


@needs_vllm
def test_eagle3_auxiliary_hidden_states_are_the_layer_outputs(runs):
    """With fast prefill off (as under EAGLE) the model returns the hidden states after the requested layers for
    every prompt row, and they equal the transformers layer outputs, above l too."""
    results, refs = runs
    prefill = results["scoring"]["aux"][0]  # the first forward: every prompt, whole, one after the other
    assert len(prefill) == len(AUX_LAYERS)
    starts = [sum(map(len, PROMPTS[:i])) for i in range(len(PROMPTS))]
    for layer, states in zip(AUX_LAYERS, prefill, strict=True):
        states = torch.tensor(states)
        for start, prompt, expected in zip(starts, PROMPTS, refs["aux"], strict=True):
            torch.testing.assert_close(
                states[start : start + len(prompt)], expected[layer], atol=1e-4, rtol=1e-4
            )


@needs_vllm
def test_compiled_qwen2_and_qwen3_equal_transformers(runs):
    """vLLM's compilation on (CPU: one inductor graph per unit): both stacks compiled, Qwen2's biases and Qwen3's
    head norms with AcrossKV g = 3 (one cache per group), prefix-cache hits on the second pass."""
    results, refs = runs
    for name in ("qwen2", "qwen3"):
        assert tokens(results[name]) == [refs[name], refs[name]]
        assert results[name]["compiled"] == ["SwiftKVDecodeStack", "SwiftKVPrefillStack"]
        assert results[name]["steps"][1]["cached"][-1] == 64
    assert refs["qwen3"] != refs["qwen3_teacher"]
    assert (results["qwen3"]["kv_layers"], results["qwen2"]["kv_layers"]) == (4, 6)  # 3 + 1 group; 3 + 3
    assert results["teacher"]["compiled"] == []  # enforce_eager: nothing compiled


@needs_vllm
def test_tensor_parallel_replicated_and_split_kv_heads(runs):
    """2 ranks and 1 KV head: the SwiftKV K/V head on both ranks, not cut in halves; 2 KV heads with AcrossKV
    groups of 3: one head per rank."""
    results, refs = runs
    assert tokens(results["tp2_replicated"]) == [refs["g1"]]
    assert tokens(results["tp2_split"]) == [refs["split"]]


@needs_vllm
def test_fp8_kv_scales_are_shared_by_every_layer_reading_a_cache(runs):
    """A checkpoint whose K/V scales differ per layer: the holder that writes a group's cache and every layer
    that reads it use one scale, the largest the checkpoint gives for the group."""
    results, _ = runs
    if "fp8" not in results:
        pytest.skip(NO_FP8_KV_ON_THIS_CPU)
    assert len(tokens(results["fp8"])[0]) == len(PROMPTS)
    scales = results["fp8"]["scales"]
    for layer in scales.values():
        holder = scales[layer["reads"]]
        assert (layer["k"], layer["v"]) == (holder["k"], holder["v"])
    by_layer = {
        name.split(".layers.")[-1].split(".")[0]: s for name, s in scales.items() if ".layers." in name
    }
    assert by_layer["0"]["k"] == 0.5  # a normal layer keeps its own
    assert by_layer["3"]["k"] == 0.25 and by_layer["3"]["v"] == 1.0  # max(0.25 on k_proj_swiftkv, 0.125)
    assert by_layer["5"]["v"] == 0.75 and by_layer["4"]["v"] == 1.0  # each g=1 group its own


@needs_vllm
def test_teacher_mode_and_missing_weight(runs):
    results, refs = runs
    assert tokens(results["teacher"]) == [refs["teacher"]]
    assert refs["g1"] != refs["teacher"]  # the SwiftKV path really differs from the original model
    assert "model." + MISSING in results["missing"]["error"]


@needs_vllm
def test_speculative_decoding_with_chunked_prefill(runs):
    results, refs = runs
    assert tokens(results["spec"]) == [refs["spec"]]
    decode = results["spec"]["calls"][0]["decode"]
    assert decode[0]["rows"][0] <= len(SPEC_PROMPTS)  # a chunk of prefill: at most one row per request
    assert max(call["rows"][0] for call in decode) > len(SPEC_PROMPTS)  # draft tokens were verified


@needs_vllm
def test_smollm2_student_and_teacher(runs):
    results, refs = runs
    stock, teacher, student = (tokens(results[f"smol_{n}"]) for n in ("stock", "teacher", "student"))
    assert teacher == stock
    assert student == [refs["smol"], refs["smol"]]  # the second pass prefills from cached blocks
    assert results["smol_student"]["steps"][1]["cached"][-1] > 0


# -- exact K/V: one more vLLM process (its speculative engine must come last too) ---------------------------


def needs_vllm_engines(test):
    return pytest.mark.slow(pytest.mark.vllm(test))


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory, vllm_python, compiled_dir):
    """The tiny g = 1 checkpoint with exact_kv_window 3 (compiled) and 1 (eager) over a short batch, a chunked
    prompt and a prompt that hits blocks holding its exact rows; a Qwen3 with W = 3; W = 3 under n-gram
    speculation; and what is refused."""
    tmp = tmp_path_factory.mktemp("vllm-exact")
    tiny_base("llama", **TINY).save_pretrained(tmp / "base")
    g1 = swiftkv.convert.convert(tmp / "base", tmp / "g1", swiftkv_fraction=0.5)
    paths = {w: edit_checkpoint(g1, folder / f"w{w}", config={"exact_kv_window": w})
             for w, folder in ((3, compiled_dir), (1, tmp))}  # fmt: skip
    qwen3 = swiftkv.convert.convert(
        tiny_qwen3(tmp / "qwen3-base"), tmp / "qwen3", swiftkv_fraction=0.5, exact_kv_window=3
    )
    missing = edit_checkpoint(paths[3], tmp / "w3-missing", drop=EXACT_MISSING)
    refs = {"w0": reference(g1, "student", PROMPTS[:2]), "qwen3": reference(qwen3, "student")}
    refs["spec"] = reference(paths[3], "student", SPEC_PROMPTS, 12)
    seconds = {}
    for w, path in paths.items():
        first = reference(path, "student", [WINDOW_PROMPT], WINDOW_TOKENS)[0]  # the prompt in one forward
        seconds[w] = second = WINDOW_PROMPT + first
        refs[w] = [
            reference(path, "student", PROMPTS[:2]),
            [first],
            [exact_greedy(path, second, prompt_window(len(second), w))],
        ]
        refs[f"{w}_by_hand"] = exact_greedy(path, WINDOW_PROMPT, prompt_window(len(WINDOW_PROMPT), w))

    def window_steps(w: int) -> list[dict]:
        return [step(PROMPTS[:2]), step([WINDOW_PROMPT], WINDOW_TOKENS), step([seconds[w]])]

    cases = {
        "w3": dict(
            model=str(paths[3]), engine={**CACHED, "enforce_eager": False}, record=True, steps=window_steps(3)
        ),
        "w1": dict(model=str(paths[1]), engine=CACHED, record=True, steps=window_steps(1)),
        "qwen3": dict(model=str(qwen3), steps=[step(PROMPTS)]),
        "missing": dict(model=str(missing), steps=[]),
        "scoring": dict(model=str(paths[3]), engine=SCORING, steps=[]),
        # last: an engine started after a speculative one in the same process fails in vLLM 0.32
        "spec": dict(
            model=str(paths[3]),
            engine={"speculative_config": NGRAM},
            record=True,
            steps=[step(SPEC_PROMPTS, 12)],
        ),  # fmt: skip
    }
    results = dict(zip(cases, run_cases(list(cases.values()), tmp), strict=True))
    return results, refs


@needs_vllm_engines
def test_exact_kv_tokens_equal_transformers(exact_runs):
    """W = 3 compiled and W = 1 eager: a batch of two prompts, a prompt chunked 32 + 8 (its last W positions
    exact, as when prefilled in one forward), and the transformers path's tokens; exact K/V change them."""
    results, refs = exact_runs
    for w in (3, 1):
        assert tokens(results[f"w{w}"])[:2] == refs[w][:2]
        # the by-hand reference agrees with generate()
        assert refs[f"{w}_by_hand"] == refs[w][1][0][:MAX_TOKENS]
    assert results["w3"]["compiled"] == ["SwiftKVDecodeStack", "SwiftKVPrefillStack"]
    assert refs[3][0] != refs["w0"] and refs[1][0] != refs["w0"]  # the option changes the continuations


@needs_vllm_engines
def test_exact_kv_prefix_hits_stop_below_the_window(exact_runs):
    """The first request cached only its block below its window (positions 0-31; its window and generated tokens
    hold exact rows and are never cached), so the second prompt hits that block alone and gets the tokens of the
    reference with exact K/V at its own window only: a hit gives what a miss gives."""
    results, refs = exact_runs
    for w in (3, 1):
        third = results[f"w{w}"]["steps"][2]
        assert third["cached"] == [32]
        assert third["tokens"] == refs[w][2]


@needs_vllm_engines
def test_exact_window_runs_more_rows_than_the_logits_rows(exact_runs):
    """W = 3: the first forward (prompts of 7 and 2 tokens) runs 3 + 2 rows through layers >= l, not the 2
    logits rows; W = 1 runs the logits rows.  The 40-token prompt alone: its first chunk (0-31, before the
    window) runs only its logits row, its second the last 3.  The decode stack reads the static buffers in every
    step."""
    results, _ = exact_runs
    first = {w: results[f"w{w}"]["calls"][0] for w in (3, 1)}
    assert first[3]["tokens"][0] == first[1]["tokens"][0] == 9
    assert first[3]["decode"][0]["rows"][0] == 5 and first[1]["decode"][0]["rows"][0] == 2
    chunked = [call["rows"][0] for call in first[3]["decode"]]
    assert [1, 3] in [chunked[i : i + 2] for i in range(len(chunked))]  # the 40-token prompt's two chunks
    for case in ("w3", "w1", "spec"):
        assert_static_decode_inputs(results[case]["calls"][0])


@needs_vllm_engines
def test_exact_kv_qwen3_and_ngram_speculation(exact_runs):
    """Qwen3 (the teacher's k_norm on exact keys) and W = 3 >= 1 + 2 drafts under n-gram speculation (the
    verified drafts store exact K/V; the prompts' windows too): the transformers path's tokens."""
    results, refs = exact_runs
    assert tokens(results["qwen3"]) == [refs["qwen3"]]
    assert tokens(results["spec"]) == [refs["spec"]]
    rows = [call["rows"][0] for call in results["spec"]["calls"][0]["decode"]]
    assert rows[0] == 3 * len(SPEC_PROMPTS)  # the prefill: each prompt's window
    assert max(rows[1:]) > len(SPEC_PROMPTS)  # draft tokens were verified


@needs_vllm_engines
def test_exact_kv_refusals_name_the_problem(exact_runs):
    """A checkpoint without a teacher V of a layer >= l is refused by name; fast prefill off is refused before
    the engine starts."""
    results, _ = exact_runs
    assert "model." + EXACT_MISSING in results["missing"]["error"]
    assert "exact_kv_window=3 needs SwiftKV fast prefill, which is off here" in results["scoring"]["error"]


# -- processes of their own ----------------------------------------------------------------------------------


def run_in_vllm_venv(
    script: str, tmp: Path, env: dict | None = None, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **cpu_environment(tmp), "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [str(VLLM_PYTHON), "-c", textwrap.dedent(script), *args], cwd=ROOT, env=full_env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


# Scripts that only import vLLM's modules and call them share one process (vLLM's import is ~10 s a process):
# each runs in a namespace of its own and its stdout is kept for its test; engines and patched registrations get
# processes of their own (above and below).
SHARED_PROCESS: dict[str, str] = {}
RUN_SHARED = """
import contextlib, io, json, sys, traceback
scripts, results = json.loads(open(sys.argv[1]).read()), {}
for name, script in scripts.items():
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(script, name, "exec"), {"__name__": name})
        results[name] = {"stdout": out.getvalue()}
    except BaseException:
        results[name] = {"stdout": out.getvalue(), "error": traceback.format_exc()}
open(sys.argv[2], "w").write(json.dumps(results))
"""


def in_shared_process(name: str, script: str) -> str:
    SHARED_PROCESS[name] = textwrap.dedent(script)
    return name


@pytest.fixture(scope="module")
def shared_process(tmp_path_factory, vllm_python) -> dict[str, dict]:
    """Every ``SHARED_PROCESS`` script run in one vLLM-venv process: name -> its stdout (and error, if it raised)."""
    tmp = tmp_path_factory.mktemp("vllm-shared")
    (tmp / "scripts.json").write_text(json.dumps(SHARED_PROCESS))
    proc = run_in_vllm_venv(RUN_SHARED, tmp, args=(str(tmp / "scripts.json"), str(tmp / "results.json")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "results.json").read_text())


def shared_result(results: dict[str, dict], name: str):
    """The JSON a shared script printed last, or the failure of the script."""
    run = results[name]
    assert "error" not in run, run["error"][-3000:]
    return json.loads(run["stdout"].strip().splitlines()[-1])


GRAPH_SIZES = in_shared_process(
    "graph_sizes",
    """
    import json
    from types import SimpleNamespace
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, ForwardContext, get_forward_context, override_forward_context
    from eval.serving.vllm.llama import LlamaSwiftKVModel

    config = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32], max_cudagraph_capture_size=32)
    model = SimpleNamespace(compilation_config=config)  # what the model keeps of its vllm_config
    config.adjust_cudagraph_sizes_for_spec_decode(3)  # after the model is built, as the V1 runner does
    modes = {}
    for size in (9, 8):
        context = ForwardContext({}, {}, {}, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                                 batch_descriptor=BatchDescriptor(num_tokens=40))
        with override_forward_context(context), LlamaSwiftKVModel._graph_batch(model, size):
            modes[size] = [get_forward_context().cudagraph_runtime_mode.name,
                           get_forward_context().batch_descriptor.num_tokens]
    print(json.dumps({"sizes": config.cudagraph_capture_sizes, "modes": modes}))
    """,
)


@pytest.mark.slow
@pytest.mark.vllm
def test_decode_stack_keeps_graphs_for_the_sizes_vllm_captures_under_speculation(shared_process):
    """vLLM's V1 runner rewrites the CUDA-graph capture sizes to multiples of 1 + num_speculative_tokens after the
    model is built (``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``, vLLM's own code here): the decode
    stack of a step with 9 gathered rows (2 drafts) must still replay piecewise graphs, and one of a size vLLM no
    longer captures (8) must not."""
    result = shared_result(shared_process, GRAPH_SIZES)
    assert result["sizes"] == [3, 6, 9, 18, 24]
    assert result["modes"] == {"9": ["PIECEWISE", 9], "8": ["NONE", 8]}


CONFIG_STEPS = in_shared_process(
    "config_steps",
    """
    import json
    from types import SimpleNamespace
    from vllm.config import CompilationConfig, PassConfig, VllmConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from eval.serving.vllm import SwiftKVConfigHook, fast_prefill_refusal

    cases = {  # case: (compilation mode, splitting ops, the attention + quant fusion pass)
        "default": (CompilationMode.VLLM_COMPILE, None, False),
        "no splitting ops": (CompilationMode.VLLM_COMPILE, [], False),
        "attention + quant fusion": (CompilationMode.VLLM_COMPILE, None, True),
        "no piecewise compilation": (CompilationMode.NONE, None, False),
    }
    results = {}
    for case, (mode, splitting_ops, fuse) in cases.items():
        compilation = CompilationConfig(
            mode=mode, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, splitting_ops=splitting_ops,
            pass_config=PassConfig(fuse_attn_quant=fuse),
        )
        hf_config = SimpleNamespace(swiftkv=True, num_key_value_layers=3, num_hidden_layers=6)
        config = SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf_config, runner_type="generate",
                                         architecture="LlamaSwiftKVForCausalLM"),
            speculative_config=None, compilation_config=compilation,
            cache_config=SimpleNamespace(kv_sharing_fast_prefill=None),
            parallel_config=SimpleNamespace(use_ubatching=False, decode_context_parallel_size=1),
        )  # the parts of a VllmConfig the hook and vLLM's two steps read
        SwiftKVConfigHook.verify_and_update_config(config)
        hook = [compilation.cudagraph_mode.name, config.cache_config.kv_sharing_fast_prefill]
        VllmConfig._normalize_piecewise_cudagraph_mode(config, breakable_cudagraph_enabled=False)
        compilation.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter", data_parallel_size=1)
        results[case] = [*hook, compilation.cudagraph_mode.name, fast_prefill_refusal(config, "FLASH_ATTN")]
    print(json.dumps(results))
    """,
)


@pytest.mark.slow
@pytest.mark.vllm
def test_fast_prefill_is_refused_where_vllms_own_config_code_makes_the_mode_full_after_the_hook(
    shared_process,
):
    """vLLM runs the model config hooks (``try_verify_and_update_config``) before it resolves the CUDA-graph mode:
    ``_normalize_piecewise_cudagraph_mode`` and ``CompilationConfig.set_splitting_ops_for_v1``, called in this
    order from ``VllmConfig.__post_init__`` after the hook, run here on vLLM's own ``CompilationConfig``.  The hook
    sees FULL_AND_PIECEWISE and turns fast prefill on; where vLLM then makes the mode FULL (no splitting ops, or
    the attention + quant fusion) the model build refuses it, and where it keeps piecewise graphs for mixed steps
    or runs them eagerly (FULL_DECODE_ONLY) it does not."""
    results = shared_result(shared_process, CONFIG_STEPS)
    resolved = {"default": "FULL_AND_PIECEWISE", "no splitting ops": "FULL", "attention + quant fusion": "FULL",
                "no piecewise compilation": "FULL_DECODE_ONLY"}  # fmt: skip
    for case, (hook_mode, fast_prefill, mode, refusal) in results.items():
        assert (hook_mode, fast_prefill, mode) == ("FULL_AND_PIECEWISE", True, resolved[case]), case
        if mode == "FULL":
            assert refusal.startswith("cudagraph_mode resolved to FULL after the SwiftKV config hook"), case
            assert "-cc.cudagraph_mode=FULL_DECODE_ONLY" in refusal
        else:
            assert refusal is None, case


FP8_QUERIES = in_shared_process(
    "fp8_queries",
    """
    import json
    from types import SimpleNamespace
    import torch
    import eval.serving.vllm.exact as exact

    seen = []

    def attention(query, key, value, output, layer_name, kv_cache_dummy_dep=None):
        seen.append(query)
        output.copy_(query.float())

    exact.unified_attention_with_output = attention  # the backend call, recorded
    scale, query = torch.tensor(0.5), torch.randn(3, 2 * 4, dtype=torch.bfloat16)
    quantized = (query / scale).to(torch.float8_e4m3fn)
    results = {}
    for case, quantizer, takes_fp8 in (("fp8 backend", True, True), ("other backend", True, False),
                                       ("no quantizer", False, True)):
        attn = SimpleNamespace(
            num_heads=2, head_size=4, use_direct_call=True, layer_name="layer", _q_scale=scale,
            query_quant=(lambda q, s: ((q / s).to(torch.float8_e4m3fn), None)) if quantizer else None,
            impl=SimpleNamespace(supports_quant_query_input=takes_fp8),
        )
        out = exact.attend_after(attn, query, query.new_empty(0))
        given = seen[-1].reshape(3, 8)
        results[case] = [str(given.dtype), str(out.dtype), torch.equal(given.float(), quantized.float()),
                         torch.equal(given.float(), query.float())]
    print(json.dumps(results))
    """,
)


@pytest.mark.slow
@pytest.mark.vllm
def test_exact_kv_attention_takes_queries_as_vllms_attention_layer_does(shared_process):
    """An FP8 KV cache on a backend that takes FP8 queries (FlashAttention 3, the default on H100/H200, and Triton
    on CUDA) gives each attention layer a query quantizer, which ``Attention.forward`` applies before the backend
    reads the cache with the q scale: the exact-K/V attention call (``attend_after``, which bypasses that forward)
    quantizes the same way, with the layer's ``_q_scale``, and returns the unquantized dtype; without a quantizer,
    or on a backend that takes no FP8 queries, the query goes in as it is."""
    result = shared_result(shared_process, FP8_QUERIES)
    assert result["fp8 backend"] == ["torch.float8_e4m3fn", "torch.bfloat16", True, False]
    assert result["other backend"] == ["torch.bfloat16", "torch.bfloat16", False, True]
    assert result["no quantizer"] == ["torch.bfloat16", "torch.bfloat16", False, True]


INTERNALS = in_shared_process(
    "internals",
    """
    import importlib, json
    from eval.serving.vllm.internals import USED
    missing = []
    for path in USED:
        module, qualname = path.split(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        missing += [path] if obj is None else []
    print(json.dumps(missing))
    """,
)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_internals_resolve_in_the_installed_vllm(shared_process, tmp_path):
    """Every name in ``internals.USED`` imports from the installed vLLM, and ``swiftkv check-vllm-api`` finds
    each with the parameters or members the plugin relies on (the check docs/serving.md records for vLLM 0.33);
    the command reports a renamed function and a renamed parameter in a copy of that tree."""
    assert shared_result(shared_process, INTERNALS) == []
    (installed,) = VLLM_PYTHON.parents[1].glob("lib/python*/site-packages/vllm")
    check = [sys.executable, "-m", "toolkit", "check-vllm-api"]
    ok = subprocess.run([*check, str(installed)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout
    copy = tmp_path / "vllm"
    shutil.copytree(
        installed, copy, ignore=lambda _d, names: [n for n in names if n.endswith((".so", ".pyc"))]
    )
    utils = copy / "utils" / "torch_utils.py"
    utils.write_text(utils.read_text().replace("def _encode_layer_name(", "def _encode_layer(", 1))
    attention = copy / "model_executor" / "layers" / "attention" / "attention.py"
    text = attention.read_text().replace(
        "def unified_kv_cache_update(\n    key:", "def unified_kv_cache_update(\n    k:"
    )
    attention.write_text(text)
    bad = subprocess.run([*check, str(copy)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "vllm.utils.torch_utils:_encode_layer_name -> <definition>" in bad.stdout
    assert "vllm.model_executor.layers.attention.attention:unified_kv_cache_update -> key" in bad.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_failed_registration_leaves_vllm_working(vllm_python, tmp_path):
    """vLLM calls general plugins unguarded: with a name the plugin needs patched away, loading the plugins
    logs one line and vLLM still serves a plain Llama; a SwiftKV architecture registered by another plugin
    (ArcticInference uses the same names) is left in place, and the log says which class serves it."""
    tiny_base("llama", **TINY).save_pretrained(tmp_path / "llama")
    proc = run_in_vllm_venv(
        f"""
        import vllm.entrypoints.llm  # vLLM's own modules keep their reference to InputProcessor
        import vllm.v1.engine.input_processor as intake
        saved = intake.InputProcessor
        del intake.InputProcessor  # as if a vLLM release had moved it
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # runs this distribution's entry point, like every vLLM process
        from vllm import ModelRegistry
        assert "LlamaSwiftKVForCausalLM" not in ModelRegistry.get_supported_archs()
        from eval.serving.vllm.cpu import make_llm
        from tests.helpers.vllm_cases import run_step
        print("TOKENS", run_step(make_llm("{tmp_path / "llama"}"), {{"prompts": [[5, 6, 7]], "max_tokens": 3}}))
        intake.InputProcessor = saved
        ModelRegistry.register_model("Qwen2SwiftKVForCausalLM", "arctic_inference.vllm.swiftkv:Other")
        from eval.serving.vllm import register
        register()
        print("OWNER", ModelRegistry.models["Qwen2SwiftKVForCausalLM"].module_name)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    failures = [line for line in out.splitlines() if "plugin is not registered" in line]
    assert len(failures) == 1 and "ImportError" in failures[0] and "InputProcessor" in failures[0]
    assert "TOKENS {'tokens': [[" in proc.stdout
    assert "OWNER arctic_inference.vllm.swiftkv" in proc.stdout
    assert (
        "Qwen2SwiftKVForCausalLM is already registered with vLLM as arctic_inference.vllm.swiftkv:Other"
        in out
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_lm_eval_vllm_backend_scores_a_loglikelihood_task(vllm_python, tmp_path):
    """``lm_eval --model vllm`` with fast prefill off (SWIFTKV_FAST_PREFILL=0) on a multiple-choice task: its
    accuracy and each choice's log-likelihood equal those from our transformers path."""
    tiny_base("llama", **TINY).save_pretrained(tmp_path / "base")
    model = swiftkv.convert.convert(tmp_path / "base", tmp_path / "skv", swiftkv_fraction=0.5)
    from helpers.chat import word_tokenizer

    word_tokenizer().save_pretrained(model)
    rows = [{"query": f"w{3 + i} w{5 + 2 * i} w{7 + i}", "choices": [f" w{10 + i}", f" w{20 + i}", f" w{30 + i}"],
             "gold": i % 3} for i in range(6)]  # fmt: skip
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny_mc.yaml").write_text(
        textwrap.dedent(f"""\
        task: tiny_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tmp_path / "task.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{query}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{gold}}}}"
        metric_list:
          - metric: acc
        """)
    )
    args = (f"pretrained={model},dtype=float32,enforce_eager=True,kv_cache_memory_bytes={64 << 20},"
            "max_model_len=128,seed=0")  # fmt: skip
    proc = subprocess.run(
        [str(VLLM_PYTHON.parent / "lm_eval"), "--model", "vllm", "--model_args", args, "--tasks", "tiny_mc",
         "--include_path", str(tmp_path), "--output_path", str(tmp_path / "results"), "--log_samples"],
        cwd=tmp_path, env={**os.environ, **cpu_environment(tmp_path), "PYTHONPATH": str(ROOT),
                           FAST_PREFILL_ENV: "0"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (samples,) = (tmp_path / "results").rglob("samples_tiny_mc_*.jsonl")
    scored = [json.loads(line) for line in samples.read_text().splitlines()]
    tokenizer = word_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    correct = 0
    for sample in sorted(scored, key=lambda s: s["doc_id"]):
        row = rows[sample["doc_id"]]
        expected = []
        for choice in row["choices"]:
            context, continuation = tokenizer.encode(row["query"]), tokenizer.encode(choice)
            with torch.no_grad():
                logits = hf(torch.tensor([context + continuation])).logits[0].log_softmax(-1)
            expected.append(sum(logits[len(context) + i - 1, t].item() for i, t in enumerate(continuation)))
        got = [float(loglikelihood) for loglikelihood, _greedy in sample["filtered_resps"]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-3, rtol=0)
        correct += max(range(3), key=expected.__getitem__) == row["gold"]
    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    assert json.loads(results_file.read_text())["results"]["tiny_mc"]["acc,none"] == pytest.approx(
        correct / 6
    )


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.smollm2
def test_openai_server_answers_through_the_plugin(smollm2, vllm_python, tmp_path):
    """The OpenAI server: a completion through the plugin; a request for prompt log-probabilities (0, which
    vLLM's own check lets through) is refused with a 400 and the server answers the next one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tiny_base("llama", **TINY, vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    model = swiftkv.convert.convert(tmp_path / "base", tmp_path / "skv", swiftkv_fraction=0.5)
    tokenizer.save_pretrained(model)
    env = {**os.environ, **cpu_environment(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--enforce-eager",
           "--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--uds", str(tmp_path / "server.sock")]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        opener = unix_socket_opener(tmp_path / "server.sock")
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up in 300 s"
            try:
                opener.open("http://localhost/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(1)

        def complete(**extra):
            body = {
                "model": str(model),
                "prompt": "Hello",
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            }
            request = urllib.request.Request(
                "http://localhost/v1/completions", json.dumps({**body, **extra}).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            return json.loads(opener.open(request, timeout=120).read())

        with pytest.raises(urllib.error.HTTPError) as refused:
            complete(prompt_logprobs=0)
        assert refused.value.code == 400 and "SWIFTKV_FAST_PREFILL=0" in refused.value.read().decode()
        assert complete()["usage"]["completion_tokens"] == 4
        assert "LlamaSwiftKVForCausalLM" in (tmp_path / "server.log").read_text()
    finally:
        with contextlib.suppress(
            ProcessLookupError
        ):  # a server that died already (its log is in the failure)
            os.killpg(server.pid, 9)
        server.wait(timeout=60)
        log.close()


def unix_socket_opener(path: Path) -> urllib.request.OpenerDirector:
    """urllib over a Unix socket: the server needs no TCP port (none to pick, none to collide)."""
    import http.client
    import socket

    class Connection(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(self.timeout)
            self.sock.connect(str(path))

    class Handler(urllib.request.HTTPHandler):  # replaces urllib's own HTTP handler in the opener
        def http_open(self, request):
            return self.do_open(Connection, request)

    return urllib.request.build_opener(Handler)
