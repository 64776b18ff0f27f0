"""The SwiftKV vLLM plugin on vLLM's CPU build: greedy tokens equal our transformers path (Llama and Qwen2,
prefix cache on and off, chunked prefill, n-gram speculative decoding), prompt rows really skip layers >= l,
AcrossKV keeps one cache per group, teacher mode is the original model, a checkpoint missing a SwiftKV weight
is refused by name, and the OpenAI server answers through the plugin.

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
from conftest import tiny_base
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import swiftkv.convert
from tests.vllm_cases import cpu_environment

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}; run scripts/setup_vllm_cpu.sh"
)

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
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    tiny_base("llama", **TINY).save_pretrained(tmp / "base")
    g1 = swiftkv.convert.convert(tmp / "base", tmp / "g1", swiftkv_fraction=0.5)
    g3 = swiftkv.convert.convert(tmp / "base", tmp / "g3", swiftkv_fraction=0.5, group_size=3)
    tiny_base("qwen2", **TINY).save_pretrained(tmp / "qwen2-base")
    qwen2 = swiftkv.convert.convert(tmp / "qwen2-base", tmp / "qwen2", swiftkv_fraction=0.5)
    teacher = edit_checkpoint(g1, tmp / "teacher", config={"swiftkv": False})
    missing = edit_checkpoint(g1, tmp / "missing", drop=MISSING)
    cases = {
        "cached": dict(model=str(g1), engine=CACHED, repeat=2, rows=True),
        "chunked": dict(model=str(qwen2), engine=CHUNKED),
        "acrosskv": dict(model=str(g3), engine=CACHED),
        "teacher": dict(model=str(teacher), engine=CACHED),
        "missing": dict(model=str(missing)),
    }
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
        "teacher": reference(g1, "teacher"),
        "spec": reference(g1, "student", SPEC_PROMPTS, 12),
    }
    return results, refs


def test_greedy_equals_transformers_with_prefix_cache_and_real_skipping(runs):
    results, refs = runs
    first, second = results["cached"]["tokens"]
    assert first == refs["g1"]
    assert second == refs["g1"]  # second pass reads the long prompt's blocks from the prefix cache
    assert refs["g1"] != refs["teacher"]  # the SwiftKV path really differs from the original model
    rows = results["cached"]["rows"]
    # every forward sends at most one row per request through layers >= l (the prefill step has 79 tokens)
    assert rows and max(rows) <= len(PROMPTS)


def test_qwen2_biases_with_chunked_prefill_without_prefix_cache(runs):
    results, refs = runs
    assert results["chunked"]["tokens"] == [refs["qwen2"]]


def test_acrosskv_group_of_three(runs):
    results, refs = runs
    assert results["acrosskv"]["tokens"] == [refs["g3"]]
    # one cache per group: 3 normal layers + 1 group of 3 SwiftKV layers (g=1 keeps all 6)
    assert (results["acrosskv"]["kv_layers"], results["cached"]["kv_layers"]) == (4, 6)


def test_teacher_mode_is_the_original_model(runs):
    results, refs = runs
    assert results["teacher"]["tokens"] == [refs["teacher"]]


def test_missing_swiftkv_weight_is_refused_by_name(runs):
    results, _ = runs
    assert "model." + MISSING in results["missing"]["error"]


def test_speculative_decoding_keeps_draft_rows(runs):
    results, refs = runs
    assert results["spec"]["tokens"] == [refs["spec"]]
    assert results["spec"]["rows"][0] == len(SPEC_PROMPTS)  # the prefill step: one row per request
    # draft tokens were verified: some forward sent more than one row per request through layers >= l
    assert max(results["spec"]["rows"]) > len(SPEC_PROMPTS)


@pytest.mark.smollm2
def test_smollm2_student_equals_transformers_with_and_without_prefix_cache(smollm2, tmp_path):
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


@pytest.mark.slow
def test_openai_server_answers_through_the_plugin(smollm2, tmp_path):
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
