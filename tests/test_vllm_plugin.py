"""The SwiftKV vLLM plugin on vLLM's CPU build: greedy tokens equal our transformers path (Llama and Qwen2,
prefix cache on and off, chunked prefill, n-gram speculative decoding, compiled, tensor parallel with more
ranks than KV heads), prompt rows really skip layers >= l, AcrossKV keeps one cache per group, EAGLE-3
auxiliary hidden states are the transformers layer outputs, teacher mode is the original model, a checkpoint
missing a SwiftKV weight is refused by name, and the OpenAI server answers through the plugin.  The weight-name
routing (quantization tensors included) and the tensor-parallel head split are checked without vLLM.

vLLM lives in its own venv (``scripts/setup_vllm_cpu.sh`` makes .venv-vllm; it pins transformers < 5.20), so
the checkpoints and the reference tokens are made here and all vLLM engines run in ONE subprocess there
(``python -m tests.vllm_cases --cases``), which pays vLLM's import once.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import VLLM_PYTHON, tiny_base
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import swiftkv.convert
from eval.serving.vllm.cpu import cpu_environment
from eval.serving.vllm.layout import TO_VLLM, Route, SwiftKVLayout, kv_head_split
from swiftkv.configuration_swiftkv import LlamaSwiftKVConfig

ROOT = Path(__file__).resolve().parents[1]


def needs_vllm(test):
    """Runs in the vLLM venv (fixture ``vllm_python``: fails under CI=true if missing); a vLLM start is slow."""
    return pytest.mark.slow(pytest.mark.vllm(test))


# head_dim 32: vLLM's CPU attention supports head sizes >= 32
TINY = dict(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=6)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [(7 * i) % 120 + 3 for i in range(70)]]  # mixed lengths
MAX_TOKENS = 8
# block 32: the 70-token prompt fills two blocks, so the second pass hits the prefix cache
CACHED = {"block_size": 32, "enable_prefix_caching": True}
# no prefix cache, and 16-token steps: the long prompt is prefilled in chunks next to decoding requests
CHUNKED = {"block_size": 32, "enable_prefix_caching": False, "max_num_batched_tokens": 16, "max_num_seqs": 4}
# repetitive prompts, so vLLM's n-gram proposer drafts tokens that the target then verifies
SPEC_PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 2 + [5, 6, 7], [12, 13] * 4]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
MISSING = "layers.5.self_attn.q_proj_swiftkv.weight"
TINY_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id")  # fmt: skip
COMPILED = {**CACHED, "enforce_eager": False}
AUX_LAYERS = [1, 3, 5]  # after layers 0 and 2 (x_l: l = 3 of 6) and after layer 4 (a SwiftKV layer)


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


def layer_outputs(path: Path, prompt: list[int]) -> dict[int, torch.Tensor]:
    """Hidden states after every decoder layer of our transformers student path on ``prompt`` (keyed like vLLM's
    auxiliary layers: i = after layer i - 1); layers >= l see only the rows that path keeps (the last)."""
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
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
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


def edit_checkpoint(src: Path, dst: Path, config=None, drop: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop:
        (shard,) = dst.glob("*.safetensors")
        tensors = load_file(shard)
        del tensors["model." + drop]
        save_file(tensors, shard, metadata={"format": "pt"})
        shutil.rmtree(dst / "model.safetensors.index.json", ignore_errors=True)
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_python):
    tmp = tmp_path_factory.mktemp("vllm")
    tiny_base("llama", **TINY).save_pretrained(tmp / "base")
    g1 = swiftkv.convert.convert(tmp / "base", tmp / "g1", swiftkv_fraction=0.5)
    g3 = swiftkv.convert.convert(tmp / "base", tmp / "g3", swiftkv_fraction=0.5, group_size=3)
    tiny_base("qwen2", **TINY).save_pretrained(tmp / "qwen2-base")
    qwen2 = swiftkv.convert.convert(tmp / "qwen2-base", tmp / "qwen2", swiftkv_fraction=0.5)
    qwen3 = swiftkv.convert.convert(
        tiny_qwen3(tmp / "qwen3-base"), tmp / "qwen3", swiftkv_fraction=0.5, group_size=3
    )
    teacher = edit_checkpoint(g1, tmp / "teacher", config={"swiftkv": False})
    missing = edit_checkpoint(g1, tmp / "missing", drop=MISSING)
    cases = {
        "cached": dict(model=str(g1), engine=CACHED, repeat=2, rows=True),
        "chunked": dict(model=str(qwen2), engine=CHUNKED),
        "qwen3": dict(model=str(qwen3), engine=CACHED, repeat=2),
        "acrosskv": dict(model=str(g3), engine=CACHED),
        "teacher": dict(model=str(teacher), engine=CACHED),
        "missing": dict(model=str(missing)),
    }
    cases["compiled"] = dict(model=str(g3), engine=COMPILED, repeat=2)
    cases["tp2"] = dict(model=str(g1), engine={"tensor_parallel_size": 2})  # 2 ranks, 1 KV head: replicated
    cases["aux"] = dict(model=str(g1), engine=CACHED, aux_layers=AUX_LAYERS)
    for case in cases.values():
        case.update(prompts=PROMPTS, max_tokens=MAX_TOKENS)
    # last: an engine started after a speculative one in the same process fails in vLLM 0.32
    cases["spec"] = dict(
        model=str(g1), engine={"speculative_config": NGRAM}, prompts=SPEC_PROMPTS, max_tokens=12, rows=True
    )
    results = dict(zip(cases, run_cases(list(cases.values()), tmp), strict=True))
    refs = {
        "g1": reference(g1, "student"),
        "g3": reference(g3, "student"),
        "qwen2": reference(qwen2, "student"),
        "qwen3": reference(qwen3, "student"),
        "qwen3_teacher": reference(qwen3, "teacher"),
        "aux": [layer_outputs(g1, p) for p in PROMPTS],
        "teacher": reference(g1, "teacher"),
        "spec": reference(g1, "student", SPEC_PROMPTS, 12),
    }
    return results, refs


def test_kv_heads_are_split_or_replicated_like_vllms_qkv_linear():
    """Finding 8 at the loader level: for every (ranks, KV heads) each rank loads whole heads, the per-rank count
    is vLLM's ``max(1, heads // tp)``, and together the ranks hold every head (replicated when tp > heads)."""
    head_dim = 4
    for tp in (1, 2, 4, 8):
        for heads in (1, 2, 4, 8):
            per_rank, replicas = kv_head_split(heads, tp)
            assert per_rank == max(1, heads // tp) and per_rank * tp == heads * replicas
            weight = torch.arange(heads * head_dim).repeat_interleave(
                1
            )  # row r belongs to head r // head_dim
            held = set()
            for rank in range(tp):
                size = per_rank * head_dim  # MergedColumnParallelLinear's narrow at the head rank
                rows = weight.narrow(0, rank // replicas * size, size)
                assert len(rows) == size
                assert (rows // head_dim).unique().numel() == per_rank  # whole heads only
                held |= set((rows // head_dim).tolist())
            assert held == set(range(heads))
    with pytest.raises(ValueError, match="num_key_value_heads=6 is not divisible by tensor_parallel_size=4"):
        kv_head_split(6, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=6 is not a multiple of num_key_value_heads=4"):
        kv_head_split(4, 6)


def test_quantized_and_swiftkv_names_are_routed():
    """Finding 10: every tensor of a SwiftKV projection (FP8's weight_scale / input_scale, KV-cache scales)
    goes where its weight goes, as vLLM's Llama loader does for q/k/v; unused teacher tensors are skipped."""
    layout = SwiftKVLayout(
        LlamaSwiftKVConfig(num_hidden_layers=8, num_key_value_layers=4, key_value_group_size=2, swiftkv=True)
    )
    attn = "layers.{}.self_attn."
    expected = {
        attn.format(6) + "k_proj_swiftkv.weight": Route("kv_proj_swiftkv.weight", 2),
        attn.format(6) + "k_proj_swiftkv.weight_scale": Route("kv_proj_swiftkv.weight_scale", 2),
        attn.format(4) + "v_proj_swiftkv.input_scale": Route("kv_proj_swiftkv.input_scale", 1),
        attn.format(4) + "v_proj_swiftkv.weight_zero_point": Route("kv_proj_swiftkv.weight_zero_point", 1),
        attn.format(6) + "k_proj_swiftkv.k_scale": Route("swiftkv_kv.6.k_scale"),
        attn.format(5) + "q_proj_swiftkv.weight_scale": Route(attn.format(5) + "q_proj_swiftkv.weight_scale"),
        attn.format(5) + "k_proj_swiftkv.weight_scale": None,  # AcrossKV non-leader: its group uses layer 4's
        attn.format(5) + "k_proj.weight_scale": None,  # the teacher's K of a SwiftKV layer is never used
        attn.format(6) + "q_norm.weight": None,
        attn.format(3) + "k_proj.weight_scale": TO_VLLM,  # layers < l: vLLM's Llama loader (into qkv_proj)
        "layers.6.mlp.down_proj.weight_scale": TO_VLLM,
        "norm_swiftkv.weight": Route("norm_swiftkv.weight"),
        attn.format(6) + "k_norm_swiftkv.weight": Route("k_norm_swiftkv.1.weight"),
    }
    assert {name: layout.route(name) for name in expected} == expected


@needs_vllm
def test_greedy_equals_transformers_with_prefix_cache_and_real_skipping(runs):
    results, refs = runs
    first, second = results["cached"]["tokens"]
    assert first == refs["g1"]
    assert second == refs["g1"]  # second pass reads the long prompt's blocks from the prefix cache
    assert refs["g1"] != refs["teacher"]  # the SwiftKV path really differs from the original model
    rows = results["cached"]["rows"]
    # every forward sends at most one row per request through layers >= l (the prefill step has 79 tokens)
    assert rows and max(rows) <= len(PROMPTS)


@needs_vllm
def test_qwen2_biases_with_chunked_prefill_without_prefix_cache(runs):
    results, refs = runs
    assert results["chunked"]["tokens"] == [refs["qwen2"]]


@needs_vllm
def test_qwen3_head_norms_with_acrosskv(runs):
    results, refs = runs
    assert results["qwen3"]["tokens"] == [refs["qwen3"], refs["qwen3"]]
    assert refs["qwen3"] != refs["qwen3_teacher"]


@needs_vllm
def test_compiled_plugin_equals_transformers(runs):
    """Finding 9: with vLLM's compilation on (CPU: one inductor graph per unit) both stacks are compiled and the
    tokens are the transformers path's, prefix cache hits included."""
    results, refs = runs
    assert results["compiled"]["tokens"] == [refs["g3"], refs["g3"]]
    assert results["compiled"]["compiled"] == ["SwiftKVDecodeStack", "SwiftKVPrefillStack"]
    assert results["acrosskv"]["compiled"] == []  # enforce_eager: nothing compiled


@needs_vllm
def test_tensor_parallel_with_more_ranks_than_kv_heads(runs):
    """Finding 8: 2 ranks, 1 KV head: the SwiftKV K/V head is replicated on both ranks, not cut in halves."""
    results, refs = runs
    assert "error" not in results["tp2"], results["tp2"].get("error")
    assert results["tp2"]["tokens"] == [refs["g1"]]


@needs_vllm
def test_eagle3_auxiliary_hidden_states_are_the_layer_outputs(runs):
    """Finding 10: the model returns the hidden states after the requested layers; on the prompt step they equal
    the transformers layer outputs on every prompt row below l, and on the logits row (the last) above it."""
    results, refs = runs
    assert results["aux"]["tokens"] == [refs["g1"]]
    prefill = results["aux"]["aux"][0]  # the first forward: every prompt, whole, one after the other
    assert len(prefill) == len(AUX_LAYERS)
    starts = [sum(map(len, PROMPTS[:i])) for i in range(len(PROMPTS))]
    for layer, states in zip(AUX_LAYERS, prefill, strict=True):
        states = torch.tensor(states)
        for start, prompt, expected in zip(starts, PROMPTS, refs["aux"], strict=True):
            got = states[start : start + len(prompt)]
            if layer <= 3:
                torch.testing.assert_close(got, expected[layer], atol=1e-4, rtol=1e-4)
            else:
                torch.testing.assert_close(got[-1], expected[layer][-1], atol=1e-4, rtol=1e-4)


@needs_vllm
def test_acrosskv_group_of_three(runs):
    results, refs = runs
    assert results["acrosskv"]["tokens"] == [refs["g3"]]
    # one cache per group: 3 normal layers + 1 group of 3 SwiftKV layers (g=1 keeps all 6)
    assert (results["acrosskv"]["kv_layers"], results["cached"]["kv_layers"]) == (4, 6)


@needs_vllm
def test_teacher_mode_is_the_original_model(runs):
    results, refs = runs
    assert results["teacher"]["tokens"] == [refs["teacher"]]


@needs_vllm
def test_missing_swiftkv_weight_is_refused_by_name(runs):
    results, _ = runs
    assert "model." + MISSING in results["missing"]["error"]


@needs_vllm
def test_speculative_decoding_keeps_draft_rows(runs):
    results, refs = runs
    assert results["spec"]["tokens"] == [refs["spec"]]
    assert results["spec"]["rows"][0] == len(SPEC_PROMPTS)  # the prefill step: one row per request
    # draft tokens were verified: some forward sent more than one row per request through layers >= l
    assert max(results["spec"]["rows"]) > len(SPEC_PROMPTS)


@needs_vllm
@pytest.mark.smollm2
def test_smollm2_student_equals_transformers_with_and_without_prefix_cache(smollm2, vllm_python, tmp_path):
    prompts = [[1, 9690, 198] + [(37 * i) % 40000 + 100 for i in range(n)] for n in (5, 60, 300)]
    student = swiftkv.convert.convert(smollm2, tmp_path / "skv50", swiftkv_fraction=0.5)
    teacher = edit_checkpoint(student, tmp_path / "teacher", config={"swiftkv": False})
    engine = {"max_model_len": 512, "enable_prefix_caching": False}
    cases = [
        dict(model=str(m), engine=engine, prompts=prompts, max_tokens=6) for m in (smollm2, teacher, student)
    ]  # and the student with the prefix cache, twice: the second pass prefills from cached blocks
    cases.append(dict(cases[-1], engine={**engine, "enable_prefix_caching": True}, repeat=2))
    stock, as_teacher, as_student, cached = (r["tokens"] for r in run_cases(cases, tmp_path))
    assert as_teacher == stock
    expected = reference(student, "student", prompts, 6)
    assert as_student == [expected] and cached == [expected, expected]


@needs_vllm
@pytest.mark.smollm2
def test_openai_server_answers_through_the_plugin(smollm2, vllm_python, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tiny_base("llama", **TINY, vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    model = swiftkv.convert.convert(tmp_path / "base", tmp_path / "skv", swiftkv_fraction=0.5)
    tokenizer.save_pretrained(model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **cpu_environment(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine in a child process
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--enforce-eager",
           "--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up in 300 s"
            try:
                urllib.request.urlopen(base + "/models", timeout=5)
                break
            except OSError:
                time.sleep(2)
        body = {"model": str(model), "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            base + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        assert answer["usage"]["completion_tokens"] == 4
        assert "LlamaSwiftKVForCausalLM" in (tmp_path / "server.log").read_text()
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
