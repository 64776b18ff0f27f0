"""``swiftkv gpu-check-vllm``: the SwiftKV vLLM plugin on one GPU, a verdict a user can trust before serving a SwiftKV checkpoint.

vLLM replays CUDA graphs on the memory they were captured with, GPUs use vLLM's V2 model runner by default, and
neither runs on the CPU machines this toolkit is tested on, so this one command decides on a user's GPU what the
CPU tests cannot.  It serves tiny random checkpoints in bf16 (seeded, built here) and checks, row by row in order
of value, that the SwiftKV path gives the same per-token log-probabilities of greedy continuations

* with fast prefill on and vLLM's default compilation and CUDA graphs, as with fast prefill off in eager mode
  (the same math, every row through every layer; exact K/V need fast prefill, so their twin is eager with it
  on), and
* as transformers in fp32 on the same checkpoint (``swiftkv``'s own model, teacher-forced on vLLM's tokens with
  the same prefill chunking, exact K/V included),

within tolerances set from the original model's own spread (the control row: vLLM's own Llama, graphs against
eager and against transformers), which runs first: without it nothing can be judged, so a time budget that cuts
the run short still judges the rows before the cut.  Each engine serves one workload, in this order: four short
prompts (5-20 tokens, 54 in all: one prefill step small enough for a captured piecewise CUDA graph, see
``simulate_counter``), twelve prompts of 8-300 tokens (half repetitive, so n-gram drafts match), the same prompts
again (prefix-cache hits), and one prompt of 4,096 tokens alone (chunked prefill over two steps).  Rows: the
control, then SwiftKV 50%, AcrossKV g = 2 and exact K/V (W = 8) x plain, n-gram speculation and an FP8 KV cache;
then preemption (a KV cache too small for the batch), Qwen2 and Qwen3, and vLLM's V1 model runner forced
(``VLLM_USE_V2_MODEL_RUNNER=0``; V2 is the default on GPUs).  Each row records the model runner (V1/V2) and the
attention backend its engine actually used, the decode stack's calls per CUDA-graph mode (``PIECEWISE
gathered``: graphs replayed on the gathered logits rows), wall times and the largest differences; a compiled
SwiftKV engine with fast prefill on whose decode stack never replayed a graph on gathered rows fails its row (the
speed SwiftKV is served for), and so does a row that ran on another runner than it names.  The FP8 KV-cache rows
have no independent reference (transformers keeps K/V unquantized): they are judged against their twin engine
only, which runs the same FP8 code, and the verdict labels them "consistency only".

Engines start in a clean environment: only the variables in ``ENGINE_ENVIRONMENT`` (paths, caches, the device
selection, vLLM's CPU-build settings) pass from the user's shell, then the row's own (``Row.env``), so a
``VLLM_ATTENTION_BACKEND`` or ``VLLM_USE_V2_MODEL_RUNNER`` left in the shell cannot change what a row checks.

The verdict is ``ok`` only when every row ran and passed; a row not run (time budget, a failed engine start
counts as FAIL) makes it ``incomplete``.  Exit status: 0 ok, 1 FAIL, 3 incomplete, 4 no CUDA GPU (one line,
nothing run).  A row starts only if its estimate still fits the budget (``--budget-s``, default 2,400 s).  The
estimates are not measured (no GPU was lent to this project): ``Row.estimate_s`` = 90 s, from about 50 s for a
compiled engine start of these tiny models (torch.compile of two units, warm after the first engine of a
checkpoint, and the capture of vLLM's default sizes), 20 s for the eager one and a few seconds each for the
workload and the transformers reference; 16 rows make 24 minutes (estimated), and the default budget leaves two
thirds more.  Every row records its wall times, so the first real run shows how far off the estimates are.  The
plugin supports vLLM 0.32 and 0.33 (``SUPPORTED_VLLM``); the report records the version that ran.

Run from the serving environment (vLLM and this package installed there with ``pip install --no-deps``): it
imports only what the plugin needs (vLLM, torch, transformers and ``swiftkv``); ``swiftkv gpu-check`` runs it
there.  The transformers reference runs in ``--reference-python`` (default: this interpreter), which needs the
transformers this package pins: vLLM often pins an older one, so point it at the environment where this package is
installed with its dependencies (``swiftkv gpu-check`` passes its own); one process there serves every row's
reference (``ReferenceProcess``, in :mod:`.gpu_check_reference` with the checkpoints).  ``--cpu`` runs the same
rows on vLLM's CPU build (fp32, eager, no graphs: the row logic, not the GPU) and ``--rows`` picks rows by name.

    python -m eval.serving.vllm.gpu_check --reference-python .venv/bin/python --out gpu_check_vllm.json
    swiftkv gpu-check-vllm --cpu --rows swiftkv50,control --reference-python .venv/bin/python \\
        --out /tmp/check.json   # what a test runs (the same command)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.cliargs import ArgumentParser, UsageError

from .gpu_check_reference import TINY, WINDOW, ReferenceProcess, build_checkpoints, reference_unusable

# how the children start (``python -m``: ``__name__`` is ``__main__`` there)
MODULE = "eval.serving.vllm.gpu_check"
# the folder this package is imported from (a checkout or site-packages): the engines import the same code
PACKAGE_ROOT = Path(__file__).resolve().parents[3]

MAX_TOKENS = 32
LONG_PROMPT = 4096  # the long-context pass: at least 4k tokens
CHUNK = 2048  # max_num_batched_tokens: the batch prefills in one step, the long prompt in two
# max_model_len: the long prompt, its continuation and as much again for speculative drafts
ENGINE = dict(dtype="bfloat16", seed=0, max_model_len=LONG_PROMPT + 2 * MAX_TOKENS, max_num_batched_tokens=CHUNK,
              max_num_seqs=32, gpu_memory_utilization=0.3, skip_tokenizer_init=True,
              enable_prefix_caching=True)  # fmt: skip
CPU_ENGINE = dict(
    dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 28, gpu_memory_utilization=None
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
FAST_PREFILL_OFF = {"hf_overrides": {"swiftkv_fast_prefill": False}, "enforce_eager": True}
EAGER = {"enforce_eager": True}
V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
# the smallest tolerances (nats per token): a control that happens to agree exactly does not make any bf16
# rounding a failure; otherwise TOLERANCE_FACTOR x the control's own spread
FLOOR = {"engines": 0.02, "reference": 0.05}
TOLERANCE_FACTOR = 3.0
STATUS = {"ok": 0, "FAIL": 1, "incomplete": 3, "no GPU": 4}
# the decode stack's calls replayed as piecewise CUDA graphs on gathered rows
GATHERED_GRAPHS = "PIECEWISE gathered"
# the minor versions the plugin is written and checked against (docs/serving.md)
SUPPORTED_VLLM = ("0.32", "0.33")
# What an engine inherits from the user's shell: where things are (paths, caches, sockets), which device, how many
# OpenMP threads, and the settings vLLM's CPU build needs; everything else (VLLM_*, SWIFTKV_*, TORCH_*, ...) is
# left out, so the row's own ``env`` is all that differs from vLLM's defaults.
ENGINE_ENVIRONMENT = (
    "PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "XDG_CACHE_HOME", "LD_LIBRARY_PATH", "CUDA_HOME",
    "CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
    "VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH", "OMP_NUM_THREADS",
)  # fmt: skip
# vLLM's CPU build: cores reserved and bound (eval.serving.vllm.cpu)
ENGINE_ENVIRONMENT_PREFIXES = ("VLLM_CPU_",)


@dataclass(frozen=True)
class Row:
    """One check: a checkpoint served with ``engine`` (and ``env``) next to its fast-prefill-off eager twin."""

    name: str
    model: str  # a key of build_checkpoints
    engine: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    # compared with transformers fp32 (not with an FP8 KV cache: other numbers by design)
    reference: bool = True
    long: bool = True  # the LONG_PROMPT pass (not where the KV cache is made too small for it)
    twin: dict = field(default_factory=lambda: dict(FAST_PREFILL_OFF))  # the engine the row is compared with
    estimate_s: float = 90.0  # compiled start + eager start + the workload + the reference (module docstring)
    # the model runner the row checks on a GPU: V2 is vLLM's default there (VllmConfig.use_v2_model_runner)
    runner: str = "V2"


def plan() -> list[Row]:
    """The control first (its spread sets every tolerance: without it nothing is judged), then the rows in order
    of value, what most users serve first."""
    rows = [Row("control", "original")]
    for variant, engine in (
        ("", {}),
        ("-ngram", {"speculative_config": NGRAM}),
        ("-fp8", {"kv_cache_dtype": "fp8"}),
    ):
        for model in ("swiftkv50", "swiftkv50_g2", "swiftkv50_exact"):
            twin = EAGER if model.endswith("_exact") else FAST_PREFILL_OFF
            rows.append(Row(model + variant, model, engine, reference=variant != "-fp8", twin=twin))
    rows += [
        # 24 blocks of 16 tokens: the batch (twelve prompts of up to 300 tokens and 32 new each) needs more
        Row(
            "swiftkv50-preempt",
            "swiftkv50",
            {"num_gpu_blocks_override": 24, "block_size": 16, "max_model_len": 384},
            long=False,
        ),
        Row("qwen2-swiftkv50", "qwen2_swiftkv50"),
        Row("qwen3-swiftkv50_g2", "qwen3_swiftkv50_g2"),
        Row("swiftkv50-v1", "swiftkv50", env=V1, runner="V1"),
        Row("swiftkv50-ngram-v1", "swiftkv50", {"speculative_config": NGRAM}, V1, runner="V1"),
        Row("swiftkv50_exact-v1", "swiftkv50_exact", env=V1, twin=EAGER, runner="V1"),
    ]
    return rows


# -- the workload and one engine (in a child process) --------------------------------------------------------------
def prompts(vocab: int) -> list[list[int]]:
    """Twelve prompts of 8 to 300 tokens, half of them repetitive (n-gram drafts find matches there)."""
    out = []
    for i, n in enumerate([8, 300, 40, 120, 16, 200, 64, 24, 180, 96, 32, 250]):
        period = 5 + i if i % 2 else n
        out.append([3 + (7 * j + 13 * i) % period % (vocab - 3) for j in range(n)])
    return out


def long_prompt(vocab: int) -> list[int]:
    return [3 + (31 * j + j // 7) % (vocab - 3) for j in range(LONG_PROMPT)]


# 54 tokens: one prefill step within vLLM's default capture sizes (``simulate_counter``)
SHORT = (5, 12, 20, 17)


def short_prompts(vocab: int) -> list[list[int]]:
    """Four prompts whose prefill is one step of 54 tokens: at ``max_num_seqs`` 32 vLLM captures graphs up to 64
    tokens, and every other pass's prefill steps are larger, so this is the step whose decode stack replays a
    piecewise graph on gathered rows (one shorter than the exact-K/V window, so min(q_len, W) is exercised)."""
    return [[3 + (11 * j + 17 * i + 1) % (vocab - 3) for j in range(n)] for i, n in enumerate(SHORT)]


PASSES = ("short", "batch", "again", "long")  # in the order an engine serves them


def workload(vocab: int, long: bool = True) -> dict[str, list[list[int]]]:
    """Each pass's prompts (``long``: the 4,096-token pass, not where the KV cache is made too small for it)."""
    return {"short": short_prompts(vocab), "batch": prompts(vocab), "again": prompts(vocab),
            "long": [long_prompt(vocab)] if long else []}  # fmt: skip


# -- vLLM's capture sizes and steps, in miniature (pure: the CPU tests check the workload against them) -------------
# VllmConfig._set_cudagraph_sizes: 1,024 on Blackwell (SM100), which this check is not for
DEFAULT_MAX_CAPTURE = 512
BLOCK = 16  # vLLM's default KV-cache block on GPUs: prefix-cache hits are whole blocks


def capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, drafts: int = 0, v1: bool = False
) -> list[int]:
    """The CUDA-graph capture sizes vLLM 0.32/0.33 picks by default (neither ``cudagraph_capture_sizes`` nor
    ``max_cudagraph_capture_size`` given, performance mode "balanced", not Blackwell, fixed speculation), as
    ``VllmConfig._set_cudagraph_sizes`` (vllm/config/vllm.py) computes them: 1, 2, 4, multiples of 8 below 256 and
    of 16 from 256, up to min(2 x max_num_seqs x (1 + drafts), 512, max_num_batched_tokens), plus
    max_num_batched_tokens where it fits and the uniform decode sizes.  On the V1 runner with speculation,
    ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`` (vllm/config/compilation.py, called from
    ``resolve_cudagraph_mode_and_sizes``) then rounds them up to multiples of 1 + drafts; V2 keeps them."""
    query = 1 + drafts
    largest = min(max_num_seqs * query * 2, DEFAULT_MAX_CAPTURE)
    decode: list[int] = []
    if query > 1:
        reqs = min(max_num_seqs, DEFAULT_MAX_CAPTURE)
        counts = {n for n in (1, 2, 4) if n <= reqs} | set(range(8, min(reqs + 1, 256), 8))
        counts |= set(range(256, reqs + 1, 16)) | {reqs}
        decode = [n * query for n in counts if n * query <= largest]
    elif max_num_seqs <= largest:
        decode = [max_num_seqs]
    largest = min(max_num_batched_tokens, largest)
    sizes = {n for n in (1, 2, 4) if n <= largest}
    if largest >= 8:
        sizes |= set(range(8, min(largest + 1, 256), 8))
    if largest >= 256:
        sizes |= set(range(256, largest + 1, 16))
    if max_num_batched_tokens <= largest:
        sizes.add(max_num_batched_tokens)
    sizes |= {n for n in decode if n <= max_num_batched_tokens}
    sizes = sorted(sizes)
    if v1 and query > 1:
        top = sizes[-1]
        sizes = sorted({-(-n // query) * query for n in sizes if -(-n // query) * query <= top}) or [query]
    return sizes


def schedule(
    lengths: list[int], cached: list[int], max_tokens: int, max_num_seqs: int, budget: int
) -> list[list[tuple[int, bool]]]:
    """The steps vLLM's scheduler makes of requests submitted together: per step, each scheduled request's
    (query tokens, prefill?).  As ``vllm.v1.core.sched.scheduler.Scheduler.schedule``: running requests first, then
    waiting ones in arrival order while fewer than ``max_num_seqs`` run, within ``budget`` tokens a step (a prompt
    that does not fit is chunked); a request's first token is sampled by the step that ends its prompt.  No
    speculative drafts and no preemption (the passes this decides fit the KV cache)."""
    computed, generated = list(cached), [0] * len(lengths)
    waiting, running, steps = list(range(len(lengths))), [], []
    while waiting or running:
        left, step, scheduled = budget, [], []
        for i in running:
            n = min(lengths[i] - computed[i], left) if computed[i] < lengths[i] else min(1, left)
            if n:
                step.append((n, computed[i] < lengths[i]))
                scheduled.append((i, n))
                left -= n
        while waiting and left and len(running) < max_num_seqs:
            i = waiting.pop(0)
            n = min(lengths[i] - computed[i], left)
            running.append(i)
            step.append((n, True))
            scheduled.append((i, n))
            left -= n
        for i, n in scheduled:
            computed[i] += n if computed[i] < lengths[i] else 0
            generated[i] += computed[i] >= lengths[i]
        running = [i for i in running if generated[i] < max_tokens]
        steps.append(step)
    return steps


def padded(n: int, sizes: list[int]) -> int:
    """``n`` tokens padded to the smallest capture size that holds them (``n`` past the largest)."""
    return min((s for s in sizes if s >= n), default=n)


def counter_key(
    step: list[tuple[int, bool]], sizes: list[int], max_num_seqs: int, drafts: int, window: int
) -> str | None:
    """What ``serve``'s counter records for the decode stack in one step, or None where vLLM replays a FULL graph
    (the model's Python, the counter included, does not run).

    The runner (``CudagraphDispatcher.dispatch`` in V1, ``CudaGraphManager.dispatch`` in V2) replays a uniform
    decode step (every request 1 + drafts tokens) as a FULL graph, any other step of at most the largest capture
    size as PIECEWISE graphs of its padded size, and runs larger ones without graphs.  The decode stack gets the
    logits rows (one per request here), or with an exact-K/V window W > 1 in a step with a prefill each request's
    last min(q_len, W) rows (``PromptWindow``), padded to a capture size (V1 ``_prepare_kv_sharing_fast_prefill``,
    V2 ``FastPrefillHelper.prepare``), and keeps the step's mode only where that size was captured
    (``LlamaSwiftKVModel._graph_batch``); its rows are gathered when fewer than the step's."""
    lengths = [n for n, _ in step]
    tokens, query = sum(lengths), 1 + drafts
    if tokens > sizes[-1]:
        mode, size = "NONE", tokens
    else:
        mode, size = "PIECEWISE", padded(tokens, sizes)
        if max(lengths) == query and tokens == query * len(lengths) and size <= max_num_seqs * query:
            return None  # FULL
    prefill = any(p for _, p in step)
    rows = sum(min(n, window) for n in lengths) if window > 1 and prefill else len(lengths)
    rows = padded(rows, sizes) if rows <= sizes[-1] else rows
    if mode == "PIECEWISE" and rows not in sizes:
        mode = "NONE"
    return mode + (" gathered" if rows < size else "")


def simulate_counter(row: Row, passes: tuple[str, ...] = PASSES) -> dict[str, int]:
    """``serve``'s counter for ``row``'s compiled engine on a GPU, predicted: the decode stack's calls per mode over
    ``passes`` of the workload (the again pass hits every whole block of its prompts but the last token's)."""
    engine = {**ENGINE, **row.engine}
    spec = engine.get("speculative_config") or {}
    drafts = spec.get("num_speculative_tokens", 0)
    v1 = row.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
    sizes = capture_sizes(engine["max_num_seqs"], engine["max_num_batched_tokens"], drafts, v1)
    window = WINDOW if row.model.endswith("_exact") else 0
    block = engine.get("block_size", BLOCK)
    keys: dict[str, int] = {}
    for name in passes:
        lengths = [len(p) for p in workload(TINY["vocab_size"], row.long)[name]]
        cached = [(n - 1) // block * block if name == "again" else 0 for n in lengths]
        for step in schedule(
            lengths, cached, MAX_TOKENS, engine["max_num_seqs"], engine["max_num_batched_tokens"]
        ):
            key = counter_key(step, sizes, engine["max_num_seqs"], drafts, window)
            if key is not None:
                keys[key] = keys.get(key, 0) + 1
    return keys


def runner_version(mro_modules: list[str]) -> str:
    """V1 or V2 from the modules of a model runner's class and its bases: V1 is ``vllm.v1.worker.gpu_model_runner``
    (the CPU build's V1 runner subclasses it), V2 lives in the ``vllm.v1.worker.gpu`` package (the CPU build's in
    ``vllm.v1.worker.cpu``)."""
    if "vllm.v1.worker.gpu_model_runner" in mro_modules:
        return "V1"
    if any(m.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")) for m in mro_modules):
        return "V2"
    return f"unknown ({mro_modules[0]})"


def runner_modules(worker) -> list[str]:
    """In a vLLM worker (``LLM.collective_rpc``): the modules of its model runner's class and bases."""
    return [c.__module__ for c in type(worker.model_runner).__mro__]


def attention_backend(model) -> str:
    """In a vLLM worker (``LLM.apply_model``): the attention backend of the model's first attention layer (every
    layer of these checkpoints takes the same one)."""
    return next(m.attn_backend.get_name() for m in model.modules() if hasattr(m, "attn_backend"))


def serve(model: str, engine: dict, long: bool = True) -> dict:
    """One engine in this process: per pass (``PASSES``) each request's greedy tokens, their log-probabilities and
    the runner-up's (top-2), its prefix-cache hits; the decode stack's calls per CUDA-graph mode (installed after
    start-up, so graph captures are not counted), vLLM's preemptions, and the model runner and attention backend
    the engine actually used."""
    from vllm import LLM, SamplingParams
    from vllm.forward_context import get_forward_context

    llm = LLM(
        model=model,
        **{k: v for k, v in {**ENGINE, "disable_log_stats": False, **engine}.items() if v is not None},
    )
    modes: dict[str, int] = {}

    def count_modes(module) -> None:
        inner = getattr(module, "model", None)
        if not hasattr(inner, "decode_stack"):  # the original model: vLLM's own Llama
            return
        step_rows = [0]
        prefill_call, decode_call = type(inner.prefill_stack).__call__, type(inner.decode_stack).__call__

        def prefill(self, input_ids, positions, *rest):
            step_rows[0] = len(positions)
            return prefill_call(self, input_ids, positions, *rest)

        def decode(self, positions, *rest):
            mode = get_forward_context().cudagraph_runtime_mode.name
            key = mode + (" gathered" if len(positions) < step_rows[0] else "")
            modes[key] = modes.get(key, 0) + 1
            return decode_call(self, positions, *rest)

        type(inner.prefill_stack).__call__, type(inner.decode_stack).__call__ = prefill, decode

    llm.apply_model(count_modes)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=2
    )
    vocab = TINY["vocab_size"]

    def run(batch: list[list[int]]) -> list[dict]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        out = []
        for o in outputs:
            tokens = list(o.outputs[0].token_ids)
            steps = o.outputs[0].logprobs
            out.append({
                "tokens": tokens,
                "logprobs": [step[t].logprob for step, t in zip(steps, tokens, strict=True)],
                "top2": [sorted(((k, v.logprob) for k, v in step.items()), key=lambda kv: -kv[1])[:2] for step in steps],
                "cached": o.num_cached_tokens or 0,
            })  # fmt: skip
        return out

    passes = {name: run(batch) if batch else [] for name, batch in workload(vocab, long).items()}
    preempted = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    return {"passes": passes, "decode_stack_calls": modes, "preemptions": preempted,
            "runner": runner_version(llm.collective_rpc(runner_modules)[0]),
            "attention_backend": llm.apply_model(attention_backend)[0]}  # fmt: skip


def engine_environment(shell: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """A child engine's environment: the allowed variables of ``shell`` (``ENGINE_ENVIRONMENT``), this check's own
    settings (the engine in the child's process, this package's files importable, no network: the checkpoints are local),
    then the row's ``env``."""
    kept = {
        k: v for k, v in shell.items() if k in ENGINE_ENVIRONMENT or k.startswith(ENGINE_ENVIRONMENT_PREFIXES)
    }
    own = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(PACKAGE_ROOT), "HF_HUB_OFFLINE": "1"}
    return {**kept, **own, **env}


def run_engine(model: Path, engine: dict, env: dict, tmp: Path, timeout_s: float, long: bool = True) -> dict:
    """``serve`` in a child process (vLLM cannot start an engine after a speculative one in one process), in a
    clean environment (``engine_environment``)."""
    out = tmp / f"engine-{time.monotonic_ns()}.json"
    child_env = engine_environment(dict(os.environ), env)
    spec = json.dumps({"model": str(model), "long": long, **engine})
    cmd = [sys.executable, "-m", MODULE, "--engine", spec, "--out", str(out)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {
            "error": f"the engine did not finish within {timeout_s:.0f} s",
            "wall_s": time.monotonic() - t0,
        }
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:], "wall_s": time.monotonic() - t0}
    return {**json.loads(out.read_text()), "wall_s": time.monotonic() - t0}


# -- comparisons, tolerances and the verdict (pure: the CPU tests check them) -----------------------------------------
def engine_diff(a: list[dict], b: list[dict]) -> dict:
    """Two engines' requests: the largest log-probability difference over each common prefix of greedy tokens,
    and at each divergence the larger of the two engines' own gaps between their pick and the other's (how far
    from a tie the divergence is; infinite when the other's pick is not in the engine's top 2)."""
    diff, tie_gap, diverged = 0.0, 0.0, 0
    for x, y in zip(a, b, strict=True):
        for i, (tx, ty) in enumerate(zip(x["tokens"], y["tokens"], strict=True)):
            if tx != ty:
                gaps = []
                for mine, other in ((x, ty), (y, tx)):
                    top = dict(map(tuple, mine["top2"][i]))
                    gaps.append(top[mine["tokens"][i]] - top[other] if other in top else float("inf"))
                tie_gap, diverged = max(tie_gap, *gaps), diverged + 1
                break
            diff = max(diff, abs(x["logprobs"][i] - y["logprobs"][i]))
    return {"max_abs": diff, "divergences": diverged, "tie_gap": tie_gap}


def reference_diff(served: list[dict], reference: list[dict]) -> dict:
    """vLLM's log-probabilities of its own tokens against the reference's of the same tokens (teacher-forced, so
    every token compares), and the largest gap between vLLM's pick and the reference's best."""
    diff = max((abs(a - b) for s, r in zip(served, reference, strict=True)
                for a, b in zip(s["logprobs"], r["logprobs"], strict=True)), default=0.0)  # fmt: skip
    tie_gap = max((g for r in reference for g in r["gaps"]), default=0.0)
    return {"max_abs": diff, "tie_gap": tie_gap}


def tolerances(control: dict | None) -> dict[str, float] | None:
    """From the control row's spreads (None without a control: nothing can be judged)."""
    if control is None or control.get("status") != "ran":
        return None
    spread = {"engines": control["engines"]["max_abs"], "reference": control["reference"]["max_abs"]}
    return {k: max(FLOOR[k], TOLERANCE_FACTOR * v) for k, v in spread.items()}


def judge(row: dict, tol: dict[str, float]) -> tuple[str, list[str]]:
    """``ok`` or ``FAIL`` and why, for a row that ran."""
    why = []
    engines = row["engines"]
    if engines["max_abs"] > tol["engines"] or engines["tie_gap"] > tol["engines"]:
        why.append(f"against its twin engine: {engines['max_abs']:.4f} (divergence gap {engines['tie_gap']:.4f}) "
                   f"> {tol['engines']:.4f}")  # fmt: skip
    ref = row.get("reference")
    if ref is not None and (ref["max_abs"] > tol["reference"] or ref["tie_gap"] > tol["reference"]):
        why.append(
            f"vs transformers fp32: {ref['max_abs']:.4f} (gap {ref['tie_gap']:.4f}) > {tol['reference']:.4f}"
        )
    calls = row.get("decode_stack_calls", {})
    if row.get("graphs_expected") and not calls.get(GATHERED_GRAPHS):
        seen = ", ".join(f"{k} {v}" for k, v in sorted(calls.items())) or "none"
        why.append(
            f"the decode stack never replayed a piecewise CUDA graph on gathered rows (its calls: {seen})"
        )
    expected = row.get("runner_expected")
    if expected and row.get("runner") != expected:
        why.append(f"the engine ran on the {row.get('runner')} model runner, not {expected} (vLLM's log says why it "
                   "fell back)")  # fmt: skip
    preempt = row["name"].endswith("-preempt")
    if not row["prefix_hits"] and not preempt:  # a cache too small for the batch may evict every block
        why.append("the second pass hit no prefix-cache block")
    if preempt and not row["preemptions"]:
        why.append("no request was preempted")
    return ("FAIL" if why else "ok"), why


def verdict(rows: list[dict]) -> tuple[str, dict[str, float] | None]:
    """Judge every row that ran against the control's tolerances; ``incomplete`` if any row (or the control) did
    not run, ``FAIL`` if any row failed (a failure is reported even when others did not run).  A row without the
    transformers reference (an FP8 KV cache) is judged ``consistency only``: against its twin engine, which runs
    the same FP8 code, so an error both share passes (``consistency_only`` lists them)."""
    tol = tolerances(next((r for r in rows if r["name"] == "control"), None))
    for r in rows:
        if r["status"] == "ran" and tol is not None:
            r["status"], r["why"] = judge(r, tol)
            r["judged"] = "against transformers fp32 and the twin" if "reference" in r else "consistency only"
    if any(r["status"] == "FAIL" for r in rows):
        return "FAIL", tol
    if tol is None or any(r["status"] != "ok" for r in rows):
        return "incomplete", tol
    return "ok", tol


def consistency_only(rows: list[dict]) -> list[str]:
    """The rows judged only against an engine running the same code (``verdict``): what the verdict labels."""
    return [r["name"] for r in rows if r.get("judged") == "consistency only"]


def run_rows(
    rows: list[Row],
    serve_row: Callable[[Row], dict],
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> list[dict]:
    """Run rows in order while the budget allows starting the next one (its estimate must fit too); the rest are
    recorded as not run."""
    start, out = clock(), []
    for row in rows:
        elapsed = clock() - start
        if elapsed + row.estimate_s > budget_s:
            out.append({"name": row.name, "status": "not run",
                        "why": [f"time budget: {elapsed:.0f} s + {row.estimate_s:.0f} s > {budget_s:.0f} s"]})  # fmt: skip
            continue
        out.append({"name": row.name, **serve_row(row)})
    return out


def graphs_expected(row: Row, engine: dict, cpu: bool) -> bool:
    """Whether ``engine`` must replay the decode stack's piecewise CUDA graphs on gathered rows: a SwiftKV
    checkpoint (the control is vLLM's own Llama, without a decode stack) with fast prefill on, compiled with
    vLLM's default CUDA graphs on a GPU (vLLM's CPU build captures none)."""
    fast_prefill = engine.get("hf_overrides", {}).get("swiftkv_fast_prefill", True)
    return not cpu and row.model != "original" and fast_prefill and not engine.get("enforce_eager")


def served_row(
    row: Row,
    checkpoints: dict[str, Path],
    tmp: Path,
    cpu: bool,
    timeout_s: float,
    reference: ReferenceProcess,
) -> dict:
    """Both engines of a row, the transformers reference, and the raw comparisons (``status`` ``ran`` or FAIL);
    ``graphs_expected`` says whether ``judge`` asks for graphs replayed on gathered rows."""
    base = {**(CPU_ENGINE if cpu else {}), **row.engine}
    fast = run_engine(checkpoints[row.model], base, row.env, tmp, timeout_s, row.long)
    slow = run_engine(checkpoints[row.model], {**base, **row.twin}, row.env, tmp, timeout_s, row.long)
    result = {
        "model": row.model,
        "wall_s": {"fast_prefill": fast["wall_s"], "twin": slow["wall_s"]},
        "twin": row.twin,
        "env": row.env,
        "graphs_expected": graphs_expected(row, base, cpu),
        # vLLM's CPU build has no Triton, so it always runs V1: only a GPU run is held to the row's runner
        "runner_expected": None if cpu else row.runner,
        **{k: fast[k] for k in ("runner", "attention_backend") if k in fast},
    }
    if "error" in fast or "error" in slow:
        return {
            **result,
            "status": "FAIL",
            "why": [f"an engine failed: {(fast.get('error') or slow['error'])[-600:]}"],
        }
    requests = [r for name in PASSES for r in fast["passes"][name]]
    engines = engine_diff(requests, [r for name in PASSES for r in slow["passes"][name]])
    result.update(status="ran", engines=engines, decode_stack_calls=fast["decode_stack_calls"],
                  preemptions=fast["preemptions"], prefix_hits=sum(r["cached"] for r in fast["passes"]["again"]))  # fmt: skip
    if row.reference:
        inputs = [p for batch in workload(TINY["vocab_size"], row.long).values() for p in batch]
        t0 = time.monotonic()
        pairs = [(p, r["tokens"]) for p, r in zip(inputs, requests, strict=True)]
        ref = reference.run(checkpoints[row.model], pairs, timeout_s)
        if "error" in ref:
            return {
                **result,
                "status": "FAIL",
                "why": [f"the transformers reference failed: {ref['error'][-600:]}"],
            }
        result["reference"] = reference_diff(requests, ref["requests"])
        result["wall_s"]["reference"] = time.monotonic() - t0
    return result


def check(budget_s: float, cpu: bool, names: list[str] | None, reference_python: str) -> dict:
    rows = plan()
    if names is not None:
        rows = [r for r in rows if r.name in names]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoints = build_checkpoints(tmp / "models", "float32" if cpu else "bfloat16")
        reference = ReferenceProcess(reference_python, tmp, CHUNK)
        try:
            results = run_rows(
                rows, lambda row: served_row(row, checkpoints, tmp, cpu, 900, reference), budget_s
            )
        finally:
            reference.close()
    status, tol = verdict(results)
    if names is not None and status == "ok" and len(rows) < len(plan()):
        status = "incomplete"  # a chosen subset never says ok
    import vllm

    return {"verdict": status, "tolerances": tol, "rows": results, "consistency_only": consistency_only(results),
            "budget_s": budget_s, "elapsed_s": time.monotonic() - started,
            "device": "cpu (vLLM's CPU build)" if cpu else "cuda", "vllm_version": vllm.__version__,
            "vllm_supported": vllm.__version__.startswith(SUPPORTED_VLLM),
            "engine_environment": sorted(engine_environment(dict(os.environ), {}))}  # fmt: skip


def print_table(report: dict) -> None:
    print("\n| row | status | runner, attention | vs twin engine (max, divergences) | vs transformers fp32 | "
          "prefix hits | decode stack calls | s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        e, ref = r.get("engines"), r.get("reference")
        engines = f"{e['max_abs']:.4f}, {e['divergences']}" if e else "-"
        vs_ref = f"{ref['max_abs']:.4f}" if ref else ("consistency only" if r.get("judged") else "-")
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r.get("decode_stack_calls", {}).items())) or "-"
        wall = sum(r.get("wall_s", {}).values())
        ran = f"{r.get('runner', '-')}, {r.get('attention_backend', '-')}"
        print(f"| {r['name']} | {r['status']} | {ran} | {engines} | {vs_ref} | {r.get('prefix_hits', '-')} | {calls} "
              f"| {wall:.0f} |")  # fmt: skip
        for why in r.get("why", []):
            print(f"  {r['name']}: {why}")
    tol = report["tolerances"]
    if tol:
        print(
            f"tolerances (from the control): vs twin {tol['engines']:.4f}, vs transformers {tol['reference']:.4f}"
        )
    if not report["vllm_supported"]:
        print(f"note: vLLM {report['vllm_version']} is not a version the plugin supports ({', '.join(SUPPORTED_VLLM)}): "
              "a failure may be the version's, not the plugin's")  # fmt: skip
    labels = ", ".join(report["consistency_only"])
    label = f"; consistency only (no independent reference): {labels}" if labels else ""
    print(f"verdict: {report['verdict']}{label} ({report['elapsed_s']:.0f} s, vLLM {report['vllm_version']})")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="swiftkv gpu-check-vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/gpu_check_vllm.json"))
    parser.add_argument(
        "--budget-s", type=float, default=2400.0, help="no row starts that would end past this"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="vLLM's CPU build, fp32 and eager (the row logic only)"
    )
    parser.add_argument(
        "--rows", type=lambda s: s.split(","), help="only these rows (the verdict is then at best incomplete)"
    )
    parser.add_argument(
        "--reference-python",
        default=sys.executable,
        help="the interpreter for the transformers reference: one with this package's own transformers "
        "(default: this one)",
    )
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: one engine, in a child process
    try:
        args = parser.parse_args(argv)
        unknown = sorted(set(args.rows or ()) - {r.name for r in plan()})
        if unknown:
            raise UsageError(
                f"unknown rows {', '.join(unknown)} (to resolve, pick from {', '.join(r.name for r in plan())})"
            )
    except SystemExit as e:  # --help (0) or a usage error already printed (2)
        return int(e.code or 0)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.engine:
        engine = json.loads(args.engine)
        args.out.write_text(json.dumps(serve(engine.pop("model"), engine, engine.pop("long"))))
        return 0
    if importlib.util.find_spec("vllm") is None:  # found, not imported: a refusal costs no vLLM import
        print("error: vLLM is not installed in this environment (to resolve, run this from the serving "
              "environment, where vLLM and this package are installed)", file=sys.stderr)  # fmt: skip
        return 2
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no GPU: no CUDA device is visible, nothing was checked (to resolve, run on a GPU machine, or pass "
              "--cpu for the row logic on vLLM's CPU build)", file=sys.stderr)  # fmt: skip
        return STATUS["no GPU"]
    unusable = reference_unusable(args.reference_python)
    if unusable:
        print(f"error: {args.reference_python} cannot run the transformers reference: {unusable} (to resolve, "
              "pass --reference-python with the python of an environment where this package is installed with "
              "its dependencies)", file=sys.stderr)  # fmt: skip
        return 2
    report = check(args.budget_s, args.cpu, args.rows, args.reference_python)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return STATUS[report["verdict"]]


if __name__ == "__main__":
    raise SystemExit(main())
