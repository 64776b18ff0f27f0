"""``swiftkv gpu-check``: the SwiftKV transformers path on one GPU, in one command: prefill speed against the
FLOP-ideal, attention backend parity, StaticCache + torch.compile parity and peak memory.

Needs only the installed package (no network, no checkpoint, no checkout): nothing beyond torch, transformers and
this package is imported.  The model is a random-weight
Llama-3.1-8B shape in bf16, initialized directly on the GPU; the SwiftKV 25% and 50% variants are built in
memory by ``swiftkv.convert.to_swiftkv``, which reuses the original's weights (one 16 GB copy plus the small
new projections).  Checks, in this order:

1. attention parity: the last-token logits of a left-padded batch and 8 greedy tokens with ``eager`` and
   ``flash_attention_2`` against ``sdpa``, for every model (flash where ``flash_attn`` is installed, else the
   row says "not installed");
2. prefill latency (a fresh cache, ``logits_to_keep=1``, as ``generate()`` does) at 2k-32k tokens: CUDA
   events, one warm-up, the median of 3 interleaved repeats, against ``swiftkv.flops.ideal_prefill_speedup``,
   with the peak memory of each prefill (``torch.cuda.max_memory_allocated``);
3. StaticCache + torch.compile: 16 greedy tokens with ``cache_implementation="static"`` (transformers
   compiles the decode step, inductor with CUDA graphs) against the dynamic cache, on a short unpadded
   prompt; the SwiftKV models first, the original last as the control;
4. ``eval quality`` on the device (``eval.quality.evaluate_quality``, which also imports ``distill``'s data
   and objective modules: "not installed" where their dependencies are missing): a tiny random SwiftKV
   checkpoint with a byte-level chat tokenizer built offline (``toolkit.tokenizer``) on conversations written
   here, in bfloat16 against float32: KL within 0.01 and top-1 agreement within 0.05 of each other.

5. the vLLM plugin (``eval.serving.vllm.gpu_check``): per-token log-probabilities with vLLM's defaults against
   fast prefill off and against transformers, row by row, the control first (its docstring; about 25 minutes,
   estimated: no GPU run yet); ``--vllm only`` runs just this part, ``--vllm skip`` says it is not wanted (a
   transformers-only machine).  Rows judged only against an engine running the same code (the FP8 KV cache)
   are named "consistency only" beside the verdict.

vLLM pins an older transformers than this package, so two environments take part: this command runs in the
package's own (its transformers part, and the transformers reference of the vLLM rows), and the vLLM part
(``python -m eval.serving.vllm.gpu_check``, also ``swiftkv gpu-check-vllm``) runs in the serving environment
given as ``--vllm-python`` (a venv with ``pip install vllm``, then this package with ``pip install --no-deps .``,
which registers the plugin; docs/serving.md).  Before any work, ``--vllm only``
refuses in one line a ``--vllm-python`` without vLLM, and this interpreter where it cannot run the reference
(exit 2); under ``--vllm auto`` the same makes the vLLM section a setup error and the verdict ``incomplete``.

A time budget (``--budget-s``, 7 minutes) bounds the transformers part: a check or prompt length that would
start past it, or whose predicted time would pass ``--limit-s`` (8 minutes), is skipped and the output says so.
Prints a table, writes JSON (``--out``) with a verdict: ``ok`` only when every check ran and passed, ``FAIL``
when one failed, ``incomplete`` when one was skipped (the budget, the vLLM section not run without ``--vllm
skip``); a missing flash_attn is reported, not counted.  Exit status 0 ok, 1 FAIL, 2 setup error (one line), 3
incomplete, 4 no CUDA GPU (one line, nothing run).  ``--tiny`` runs the same code on the CPU with a tiny config
in seconds (what the tests run; its verdict is at best incomplete: the vLLM part does not run).

    swiftkv gpu-check --vllm-python ~/serve/bin/python --out gpu_check.json
    swiftkv gpu-check --vllm only --vllm-python ~/serve/bin/python --out gpu_check.json
    swiftkv gpu-check --tiny --compile-backend none --out /tmp/gpu_check.json   # what the test runs
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # the budget counts the imports too

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, CompileConfig, DynamicCache, LlamaConfig  # noqa: E402
from transformers.utils import is_flash_attn_2_available  # noqa: E402

from swiftkv.convert import resolve_num_key_value_layers, to_swiftkv  # noqa: E402
from swiftkv.flops import Shape, ideal_prefill_speedup  # noqa: E402
from toolkit.artifacts import write_json_atomic  # noqa: E402
from toolkit.cliargs import ArgumentParser, add_out, add_seed, int_list, run  # noqa: E402

from .serving.vllm import gpu_check as vllm_check  # noqa: E402  (the vLLM part: no vLLM or torch at import)
from .serving.vllm.gpu_check_reference import reference_unusable  # noqa: E402

# Llama-3.1-8B (config.json of meta-llama/Llama-3.1-8B), and a tiny config with the same structure
LLAMA31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    rms_norm_eps=1e-5,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
LM_HEAD_STD = 0.2  # peaked next-token distributions: greedy parity then tests the model, not bf16 ties
PARITY_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # max |diff| / max |logit|


class Clock:
    """Wall time since the start, and the budget rule for starting the next step."""

    def __init__(self, budget_s: float, limit_s: float):
        self.start, self.budget_s, self.limit_s = STARTED, budget_s, limit_s
        self.skipped: list[dict] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows(self, step: str, predicted_s: float = 0.0) -> bool:
        """Whether ``step`` may start; a refusal is recorded with its reason."""
        now = self.elapsed()
        if now > self.budget_s:
            reason = f"past the {self.budget_s:.0f} s budget at {now:.0f} s"
        elif now + predicted_s > self.limit_s:
            reason = f"predicted {predicted_s:.0f} s would pass the {self.limit_s:.0f} s limit at {now:.0f} s"
        else:
            return True
        self.skipped.append({"step": step, "reason": reason})
        print(f"skip {step}: {reason}", file=sys.stderr, flush=True)
        return False


def build_models(
    tiny: bool, dtype: torch.dtype, device: torch.device, fractions: list[float], group_size: int, seed: int
) -> dict[str, torch.nn.Module]:
    """The random-weight original (built on ``device``) and its SwiftKV variants sharing its weights."""
    config = LlamaConfig(
        **(TINY if tiny else LLAMA31_8B), bos_token_id=None, eos_token_id=None, pad_token_id=0
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device), torch.no_grad():  # transformers' own init (normal, std 0.02), on the device
        base = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        base.lm_head.weight.normal_(0, LM_HEAD_STD)
    base.generation_config.eos_token_id = None
    models = {"original": base}
    L = config.num_hidden_layers
    for fraction in fractions:
        l = resolve_num_key_value_layers(L, None, fraction, group_size)
        model = to_swiftkv(base, l, group_size)
        model.set_mode("student")
        model.generation_config.eos_token_id = None
        models[f"swiftkv{round(fraction * 100)}"] = model
    return models


def timed(fn, device: torch.device) -> float:
    """Seconds one call of ``fn`` takes (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def prefill(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What ``generate()`` does first: the prompt through a fresh cache, logits of the last token only."""
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=attention_mask,
            cache=DynamicCache(config=model.config),
            use_cache=True,
            logits_to_keep=1,
        )
    return out.logits[:, -1].float()


def greedy(model, ids, attention_mask, new_tokens: int, **kwargs) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[:, ids.shape[1] :].tolist()


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def left_padded_batch(vocab: int, length: int, pad: int, device, gen: torch.Generator):
    """Two prompts; the second is ``pad`` tokens shorter and left-padded (token 0, masked out)."""
    ids = torch.randint(3, vocab, (2, length), generator=gen).to(device)
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def attention_parity(models, dtype, device, clock: Clock, length: int, gen) -> list[dict]:
    rows = []
    ids, mask = left_padded_batch(models["original"].config.vocab_size, length, length // 4, device, gen)
    for name, model in models.items():
        ref_logits, ref_tokens = prefill(model, ids, mask), greedy(model, ids, mask, 8)
        for backend in ("eager", "flash_attention_2"):
            row = dict(model=name, backend=backend, reference="sdpa", length=length, batch=2)
            if backend == "flash_attention_2" and not is_flash_attn_2_available():
                rows.append({**row, "status": "not installed"})
                continue
            if not clock.allows(f"attention parity {name} {backend}"):
                rows.append({**row, "status": "skipped (time budget)"})
                continue
            try:
                model.set_attn_implementation(backend)
                logits, tokens = prefill(model, ids, mask), greedy(model, ids, mask, 8)
                diff = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
                same = tokens == ref_tokens and bool((logits.argmax(-1) == ref_logits.argmax(-1)).all())
                ok = same and diff <= PARITY_TOLERANCE[dtype]
                rows.append(
                    {**row, "status": "ok" if ok else "FAIL", "rel_max_diff": diff, "tokens_equal": same}
                )
            except Exception as e:  # a backend that breaks is a finding to report, not a crash
                rows.append({**row, "status": "FAIL", "error": f"{type(e).__name__}: {e}"[:500]})
            finally:
                model.set_attn_implementation("sdpa")
    return rows


def static_compile_parity(
    models, device, clock: Clock, backend: str, gen, new_tokens: int = 16
) -> list[dict]:
    rows = []
    ids = torch.randint(3, models["original"].config.vocab_size, (1, 12), generator=gen).to(device)
    mask = torch.ones_like(ids)
    last_s = 0.0  # the previous model's compile + generate: the prediction for the next one
    for name in [*list(models)[1:], "original"]:  # the SwiftKV models first; the original is the control
        model = models[name]
        row = dict(
            model=name, cache="static", compile_backend=backend, prompt=ids.shape[1], new_tokens=new_tokens
        )
        if not clock.allows(f"static+compile parity {name}", predicted_s=last_s):
            rows.append({**row, "status": "skipped (time budget)"})
            continue
        dynamic = greedy(model, ids, mask, new_tokens)
        if backend == "none":  # StaticCache alone
            compile_kwargs = {"disable_compile": True}
        else:
            config = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" else None)
            config._compile_all_devices = device.type != "cuda"  # transformers compiles on GPUs only
            compile_kwargs = {"compile_config": config}
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        t0 = time.monotonic()
        try:
            static = greedy(model, ids, mask, new_tokens, cache_implementation="static", **compile_kwargs)
            row["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
            equal = static == dynamic
            rows.append(
                {
                    **row,
                    "status": "ok" if equal else "FAIL",
                    "tokens_equal": equal,
                    "dynamic": dynamic[0],
                    "static": static[0],
                    "wall_s": time.monotonic() - t0,
                }
            )
        except Exception as e:
            rows.append({**row, "status": "FAIL", "error": f"{type(e).__name__}: {e}"[:500]})
        finally:
            last_s = time.monotonic() - t0
            torch._dynamo.reset()  # free the compiled graphs (and CUDA graphs) before the next model
    return rows


def prefill_latency(models, device, clock: Clock, lengths: list[int], repeats: int, gen) -> list[dict]:
    rows, last = [], None  # last: (length, wall seconds it took)
    vocab = models["original"].config.vocab_size
    for n in lengths:
        predicted = 0.0 if last is None else last[1] * (n / last[0]) ** 2  # attention-bound upper estimate
        if not clock.allows(f"prefill {n}", predicted):
            continue
        t0 = time.monotonic()
        ids = torch.randint(3, vocab, (1, n), generator=gen).to(device)
        peaks = {}
        for name, model in models.items():  # warm-up, and each model's own peak memory
            reset_peak(device)
            prefill(model, ids)
            peaks[name] = peak_memory(device)
        times = {name: [] for name in models}
        for r in range(repeats):  # interleaved, rotating the order, so a slow spell hits every model
            names = list(models)[r % len(models) :] + list(models)[: r % len(models)]
            for name in names:
                times[name].append(timed(lambda m=models[name], ids=ids: prefill(m, ids), device))
        base = statistics.median(times["original"])
        for name, model in models.items():
            t = statistics.median(times[name])
            ideal = ideal_prefill_speedup(Shape.from_config(model.config), n)
            rows.append(
                dict(
                    length=n,
                    model=name,
                    median_s=t,
                    times_s=times[name],
                    speedup=base / t,
                    ideal=ideal,
                    of_ideal=base / t / ideal,
                    peak_memory_bytes=peaks[name],
                )
            )
        last = (n, time.monotonic() - t0)
        print(f"prefill {n}: {last[1]:.1f} s", file=sys.stderr, flush=True)
    return rows


def eval_quality(device: torch.device, clock: Clock, seed: int) -> list[dict]:
    """``swiftkv quality`` on ``device`` in bfloat16 and float32 (check 4 of the module docstring)."""
    import json
    import tempfile

    if not clock.allows("eval quality"):
        return [{"status": "skipped (time budget)"}]
    try:
        from eval.quality import evaluate_quality
        from swiftkv.convert import save_pretrained_swiftkv
        from toolkit.tokenizer import byte_tokenizer
    except ImportError as e:  # eval needs distill's dependencies (pydantic, numpy, ...) beside torch
        return [{"status": "not installed", "error": f"{type(e).__name__}: {e}"}]
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        **{**TINY, "vocab_size": len(tokenizer)}, pad_token_id=0, eos_token_id=1, bos_token_id=2
    )
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(config).eval()
    base.lm_head.weight.data.normal_(0, LM_HEAD_STD)
    chats = [
        {"conversations": [{"from": "human", "value": f"Question {i}: what is {i} plus {i}? Explain."},
                           {"from": "gpt", "value": f"The answer is {2 * i}, because {i} + {i} = {2 * i}. " * 3}]}
        for i in range(16)
    ]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_pretrained_swiftkv(
            to_swiftkv(base, TINY["num_hidden_layers"] // 2), Path(tmp) / "m", tokenizer=tokenizer
        )
        data = Path(tmp) / "chats.jsonl"
        data.write_text("".join(json.dumps(c) + "\n" for c in chats))
        for dtype in ("float32", "bfloat16"):
            t0 = time.monotonic()
            result = evaluate_quality(
                model, 8, 128, n_prompts=2, max_new_tokens=8, device=device.type, dtype=dtype, data=data
            )
            rows.append({**result, "wall_s": time.monotonic() - t0})
    fp32, bf16 = rows
    ok = abs(bf16["kl"] - fp32["kl"]) <= 0.01 and abs(bf16["top1_agreement"] - fp32["top1_agreement"]) <= 0.05
    bf16["status"] = "ok" if ok else "FAIL"
    fp32["status"] = "ok"
    return rows


def print_report(report: dict) -> None:
    vllm = report["vllm"]
    if vllm["status"] != "ran":  # when it ran, the vLLM check printed its own table
        print(f"vLLM section {vllm['status']}: {vllm['reason']}")
    elif vllm.get("consistency_only"):
        names = ", ".join(vllm["consistency_only"])
        print(f"vLLM rows judged for consistency only (no independent reference): {names}")
    if "prefill" not in report:  # --vllm only
        print(f"verdict: {report['verdict']}")
        return
    gib = 1 << 30
    print(f"device {report['meta']['device']}, {report['meta']['shape']}, {report['meta']['dtype']}")
    print("\n| prompt | model | prefill ms | speedup | FLOP-ideal | of ideal | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in report["prefill"]:
        peak = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / gib:.1f}"
        print(
            f"| {r['length']} | {r['model']} | {r['median_s'] * 1000:.1f} | {r['speedup']:.2f}x | "
            f"{r['ideal']:.2f}x | {r['of_ideal']:.2f} | {peak} |"
        )
    print("\n| check | model | against | status | detail |")
    print("|---|---|---|---|---|")
    for r in report["attention_parity"]:
        detail = r.get("error") or (f"rel max diff {r['rel_max_diff']:.1e}" if "rel_max_diff" in r else "")
        print(f"| {r['backend']} | {r['model']} | sdpa | {r['status']} | {detail} |")
    for r in report["static_compile_parity"]:
        detail = r.get("error") or ("" if r.get("tokens_equal", True) else f"{r['static']} vs {r['dynamic']}")
        print(
            f"| static+compile ({r['compile_backend']}) | {r['model']} | dynamic | {r['status']} | {detail} |"
        )
    for r in report["eval_quality"]:
        detail = r.get("error") or (
            f"{r['dtype']}: KL {r['kl']:.4f}, top-1 {r['top1_agreement']:.3f}" if "kl" in r else ""
        )
        print(
            f"| eval quality ({r.get('device', '-')}) | tiny SwiftKV | float32 | {r['status']} | {detail} |"
        )
    for s in report["skipped"]:
        print(f"skipped {s['step']}: {s['reason']}")
    memory = report["memory"]
    if memory["peak_bytes"] is not None:
        print(f"\nweights {memory['weights_bytes'] / gib:.1f} GiB, peak {memory['peak_bytes'] / gib:.1f} GiB")
    print(f"elapsed {report['meta']['elapsed_s']:.0f} s; verdict: {report['verdict']}")


# the vLLM check's exit status when it refused to start, having said why in one line (else it reports)
REFUSED = {2: "setup error", 4: "no GPU"}
SERVING_ENV = (
    "pass --vllm-python with the python of the serving environment (a venv with `pip install vllm`, then this "
    "package with `pip install --no-deps .`: docs/serving.md), or --vllm skip"
)
VLLM_PROBE = """
import json
try:
    import torch
    cuda = torch.cuda.is_available()
except Exception:
    cuda = False
try:
    import vllm  # noqa: F401
    found = True
except Exception as e:
    found = f"{type(e).__name__}: {e}".splitlines()[0]
print(json.dumps({"cuda": cuda, "vllm": found}))
"""


def probe_python(python: str) -> dict:
    """What ``python`` sees: ``{"cuda": bool, "vllm": True or why not}``, or ``{"error": ...}`` if it cannot run."""
    try:
        proc = subprocess.run([python, "-c", VLLM_PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def setup_problem(
    probe: dict, cuda_here: bool, vllm_python: str, reference: str | None
) -> tuple[int, str] | None:
    """Why the vLLM section cannot start, as (exit status, one line), or None.  ``probe``: what ``vllm_python``
    sees (``probe_python``); ``cuda_here``: whether this interpreter sees a CUDA device; ``reference``: why this
    interpreter cannot run the transformers reference
    (``eval.serving.vllm.gpu_check_reference.reference_unusable``), or None."""
    if not cuda_here and not probe.get("cuda"):
        return NO_GPU, ("no GPU: no CUDA device is visible, nothing was checked (to resolve, run on a GPU machine "
                        "with the serving environment)")  # fmt: skip
    if "error" in probe:
        return (
            2,
            f"error: --vllm-python {vllm_python} does not run ({probe['error']}) (to resolve, {SERVING_ENV})",
        )
    if probe["vllm"] is not True:
        return (
            2,
            f"error: vLLM is not importable for {vllm_python} ({probe['vllm']}) (to resolve, {SERVING_ENV})",
        )
    if reference is not None:
        return 2, (f"error: {sys.executable} cannot run the transformers reference: {reference} (to resolve, run "
                   "swiftkv gpu-check with the python of the environment where this package is installed with its "
                   "dependencies, and give the serving environment's as --vllm-python)")  # fmt: skip
    return None


def vllm_setup(args, cuda_here: bool) -> tuple[int, str] | None:
    """``setup_problem`` for ``args.vllm_python`` and this interpreter (two short child processes)."""
    probe = probe_python(args.vllm_python)
    reference = None
    if probe.get("vllm") is True:
        reference = reference_unusable(sys.executable)
    return setup_problem(probe, cuda_here, args.vllm_python, reference)


def vllm_section(args) -> dict:
    """The vLLM check (``python -m eval.serving.vllm.gpu_check``) in ``--vllm-python``: its report and verdict,
    or why it did not run (a section not run leaves the verdict ``incomplete`` unless ``--vllm skip`` says it is not wanted).  A refusal
    to start (its exit 2 or 4, said in its own one line) is not a failure of the plugin: the section records its
    exit status (``exit``), which ``--vllm only`` exits with."""
    if args.vllm == "skip" or args.tiny:
        reason = "--tiny (CPU)" if args.tiny else "--vllm skip"
        return {
            "status": "skipped",
            "reason": reason,
            "verdict": "incomplete" if args.tiny else "ok",  # a CPU run never passes for a GPU check
        }
    if args.vllm == "auto":  # --vllm only checked this before any work (main)
        problem = vllm_setup(args, cuda_here=True)
        if problem is not None:
            return {
                "status": "setup error",
                "reason": problem[1].removeprefix("error: "),
                "verdict": "incomplete",
            }
    out = args.out.with_name(args.out.stem + "_vllm.json")
    out.unlink(missing_ok=True)
    proc = subprocess.run(
        [
            args.vllm_python,
            "-m",
            vllm_check.__name__,
            "--out",
            str(out),
            "--budget-s",
            str(args.vllm_budget_s),
            "--reference-python",
            sys.executable,
        ]  # fmt: skip  (the transformers reference: this environment)
    )
    if proc.returncode in REFUSED:
        reason = f"the vLLM check refused to start (exit {proc.returncode}; its line above says why)"
        return {
            "status": REFUSED[proc.returncode],
            "reason": reason,
            "verdict": "incomplete",
            "exit": proc.returncode,
        }
    if not out.is_file():
        reason = f"the vLLM check exited {proc.returncode} without a report"
        return {"status": "FAIL", "reason": reason, "verdict": "FAIL"}
    return {"status": "ran", **json.loads(out.read_text())}


def verdict(report: dict) -> str:
    """``FAIL`` if any check failed, ``incomplete`` if any was skipped (the time budget, a section not run),
    else ``ok``; a missing optional kernel (flash_attn "not installed") is reported, not counted."""
    rows = report["attention_parity"] + report["static_compile_parity"] + report["eval_quality"]
    statuses = {r["status"] for r in rows} | {report["vllm"]["verdict"]}
    if "FAIL" in statuses:
        return "FAIL"
    if report["skipped"] or statuses - {"ok", "not installed"}:
        return "incomplete"
    return "ok"


def check(args) -> dict:
    if args.vllm == "only":
        vllm = vllm_section(args)
        return {"vllm": vllm, "verdict": vllm["verdict"], "meta": {"command": " ".join(sys.argv)}}
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    clock = Clock(args.budget_s, args.limit_s)
    gen = torch.Generator().manual_seed(args.seed)
    models = build_models(args.tiny, dtype, device, args.fractions, args.group_size, args.seed)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    lengths = args.lengths or ([64, 128, 256, 512] if args.tiny else [2048, 8192, 16384, 32768])
    steps = dict(  # cheap and most wanted first; compile time is the unknown, so it goes last
        attention_parity=lambda: attention_parity(
            models, dtype, device, clock, 24 if args.tiny else 512, gen
        ),
        prefill=lambda: prefill_latency(models, device, clock, lengths, args.repeats, gen),
        static_compile_parity=lambda: static_compile_parity(models, device, clock, args.compile_backend, gen),
        eval_quality=lambda: eval_quality(device, clock, args.seed),
    )
    report, step_s, peaks = {}, {"build": clock.elapsed()}, {}
    for name, step in steps.items():
        t0 = clock.elapsed()
        report[name] = step()
        step_s[name] = clock.elapsed() - t0
        peaks[name] = peak_memory(device)  # since the last reset (prefill resets it per model)
    report["skipped"] = clock.skipped
    if device.type == "cuda":
        peak = max([*peaks.values(), *(r["peak_memory_bytes"] for r in report["prefill"])])
    else:
        peak = None
    report["memory"] = dict(weights_bytes=weights, peak_bytes=peak, step_peak_bytes=peaks)
    report["vllm"] = vllm_section(args)
    report["verdict"] = verdict(report)
    config = models["original"].config
    report["meta"] = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        shape="tiny" if args.tiny else "Llama-3.1-8B",
        layers=config.num_hidden_layers,
        variants={name: m.config.num_key_value_layers for name, m in models.items() if name != "original"},
        group_size=args.group_size,
        dtype=str(dtype).removeprefix("torch."),
        torch=torch.__version__,
        transformers=transformers.__version__,
        flash_attn=is_flash_attn_2_available(),
        budget_s=args.budget_s,
        limit_s=args.limit_s,
        elapsed_s=clock.elapsed(),
        step_s=step_s,
        command=" ".join(sys.argv),
    )
    return report


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="swiftkv gpu-check", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU (seconds)")
    parser.add_argument(
        "--lengths", type=int_list, default=None, help="prompt lengths (default 2k,8k,16k,32k)"
    )
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5])
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the static-cache decode (aot_eager: no codegen; none: StaticCache alone)",
    )
    parser.add_argument("--budget-s", type=float, default=420.0, help="no step starts after this")
    parser.add_argument(
        "--limit-s", type=float, default=480.0, help="no step starts that is predicted to pass this"
    )
    parser.add_argument(
        "--vllm",
        choices=("auto", "skip", "only"),
        default="auto",
        help="the vLLM section (default: if installed)",
    )
    parser.add_argument(
        "--vllm-python",
        default=sys.executable,
        help="the serving environment's python: vLLM, and this package installed with --no-deps (default: this one)",
    )
    parser.add_argument(
        "--vllm-budget-s",
        type=float,
        default=2400.0,
        help="the vLLM part's budget (swiftkv gpu-check-vllm --budget-s)",
    )
    add_seed(parser)
    add_out(parser, "out/gpu_check.json")
    return parser


STATUS = {"ok": 0, "FAIL": 1, "incomplete": 3}
NO_GPU = 4


def main(argv: list[str] | None = None) -> int:
    codes = []

    def command(args):
        report = check(args)
        refused = report["vllm"].get("exit")
        if args.vllm == "only" and refused is not None:  # the vLLM check said why in one line: nothing to add
            codes.append(refused)
            return None
        print_report(report)
        write_json_atomic(args.out, report)
        codes.append(STATUS[report["verdict"]])
        return f"wrote {args.out}"

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error already printed (2)
        return int(e.code or 0)
    if args.vllm == "only" and not args.tiny:  # the serving environment decides whether a GPU is there
        problem = vllm_setup(args, torch.cuda.is_available())
        if problem is not None:
            print(problem[1], file=sys.stderr)
            return problem[0]
    elif not args.tiny and not torch.cuda.is_available():
        print(
            "no GPU: no CUDA device is visible, nothing was checked (to resolve, run on a GPU machine, or pass "
            "--tiny for the CPU run of the check's own code)",
            file=sys.stderr,
        )
        return NO_GPU
    code = run(command, parser, argv)
    return codes[0] if code == 0 else code


if __name__ == "__main__":
    raise SystemExit(main())
