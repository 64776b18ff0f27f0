"""The SwiftKV vLLM plugin on one GPU: greedy tokens with vLLM's default CUDA graphs equal ``enforce_eager``.

vLLM replays piecewise CUDA graphs on the memory they were captured with; a model that hands a compiled unit
other tensors than at capture returns wrong tokens only on GPUs (the CPU build captures no graphs).  This check
serves tiny random checkpoints in bf16 (the original Llama as the control, SwiftKV 50% and AcrossKV g = 2) with
the default compilation and CUDA graphs and with ``enforce_eager=True``, on a mixed workload whose every step
fits a captured size (so steps with prefill run the decode stack under piecewise graphs on gathered rows), and
compares the tokens; then the same with n-gram speculative decoding and with an FP8 KV cache.  Each engine runs
in a process of its own.  It also counts the decode stack's calls per CUDA-graph mode, so the table shows that
graphs were really replayed on gathered rows.

Run from the serving environment (vLLM and this package installed); ``scripts/gpu_check.py`` calls it and
skips it cleanly where vLLM is not installed.

    python scripts/gpu_check_vllm.py --out gpu_check_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)  # fmt: skip  (head_dim 64)
LM_HEAD_STD = 0.2  # peaked next-token distributions, so bf16 ties do not decide greedy tokens
ENGINE = dict(dtype="bfloat16", seed=0, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=32,
              gpu_memory_utilization=0.3, compilation_config={"max_cudagraph_capture_size": 512})  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VARIANTS = {"plain": {}, "ngram": {"speculative_config": NGRAM}, "fp8_kv": {"kv_cache_dtype": "fp8"}}
MAX_TOKENS = 32


def prompts(vocab: int) -> list[list[int]]:
    """Twelve prompts of 8 to 300 tokens, half of them repetitive (n-gram drafts find matches there)."""
    out = []
    for i, n in enumerate([8, 300, 40, 120, 16, 200, 64, 24, 180, 96, 32, 250]):
        period = 5 + i if i % 2 else n
        out.append([3 + (7 * j + 13 * i) % period % (vocab - 3) for j in range(n)])
    return out


def build_checkpoints(out: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import swiftkv.convert

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, bos_token_id=None, eos_token_id=None))
    with torch.no_grad():
        base.lm_head.weight.normal_(0, LM_HEAD_STD)
    base.to(torch.bfloat16).save_pretrained(out / "original")
    return {
        "original": out / "original",
        "swiftkv50": swiftkv.convert.convert(out / "original", out / "swiftkv50", swiftkv_fraction=0.5),
        "swiftkv50_g2": swiftkv.convert.convert(
            out / "original", out / "swiftkv50_g2", swiftkv_fraction=0.5, group_size=2
        ),
    }


def serve(model: str, engine: dict) -> dict:
    """One engine in this process: the greedy tokens, and the decode stack's calls per CUDA-graph mode (gathered:
    fewer rows than the step's tokens)."""
    from vllm import LLM, SamplingParams
    from vllm.forward_context import get_forward_context

    llm = LLM(model=model, skip_tokenizer_init=True, **{**ENGINE, **engine})
    modes: dict[str, int] = {}

    def count_modes(module) -> None:  # installed after start-up, so graph captures are not counted
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
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    vocab = TINY["vocab_size"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "decode_stack_calls": modes}


def run_engine(model: Path, engine: dict, tmp: Path) -> dict:
    """``serve`` in a child process (vLLM 0.32 cannot start an engine after a speculative one in one process)."""
    out = tmp / f"engine-{time.monotonic_ns()}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        __file__,
        "--engine",
        json.dumps({"model": str(model), **engine}),
        "--out",
        str(out),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:], "wall_s": time.monotonic() - t0}
    return {**json.loads(out.read_text()), "wall_s": time.monotonic() - t0}


def check(budget_s: float) -> dict:
    started, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoints = build_checkpoints(tmp)
        for variant, engine in VARIANTS.items():
            for name, path in checkpoints.items():
                row = {"model": name, "variant": variant}
                if time.monotonic() - started > budget_s:
                    rows.append({**row, "status": "skipped (time budget)"})
                    continue
                graphs = run_engine(path, engine, tmp)
                eager = run_engine(path, {**engine, "enforce_eager": True}, tmp)
                row.update(graphs_s=graphs["wall_s"], eager_s=eager["wall_s"])
                if "error" in graphs or "error" in eager:
                    rows.append({**row, "status": "FAIL", "error": graphs.get("error") or eager["error"]})
                    continue
                pairs = [
                    (a, b)
                    for ga, gb in zip(graphs["tokens"], eager["tokens"], strict=True)
                    for a, b in zip(ga, gb, strict=True)
                ]
                equal = graphs["tokens"] == eager["tokens"]
                rows.append({**row, "status": "ok" if equal else "FAIL", "tokens_equal": equal,
                             "token_agreement": sum(a == b for a, b in pairs) / len(pairs),
                             "decode_stack_calls": graphs["decode_stack_calls"]})  # fmt: skip
    return {
        "rows": rows,
        "ok": all(r["status"] != "FAIL" for r in rows),
        "elapsed_s": time.monotonic() - started,
    }


def print_table(report: dict) -> None:
    print("\n| model | variant | CUDA graphs = eager | token agreement | decode stack calls (graphs) |")
    print("|---|---|---|---|---|")
    for r in report["rows"]:
        agreement = f"{r['token_agreement']:.3f}" if "token_agreement" in r else "-"
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r.get("decode_stack_calls", {}).items())) or "-"
        print(f"| {r['model']} | {r['variant']} | {r['status']} | {agreement} | {calls} |")
        if "error" in r:
            print(f"  error: {r['error'][-300:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/gpu_check_vllm.json"))
    parser.add_argument("--budget-s", type=float, default=240.0, help="no engine pair starts after this")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: one engine, in a child process
    args = parser.parse_args(argv)
    if args.engine:
        engine = json.loads(args.engine)
        args.out.write_text(json.dumps(serve(engine.pop("model"), engine)))
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("error: vLLM is not installed in this environment (to resolve, run this from the serving "
              "environment, where vLLM and this package are installed)", file=sys.stderr)  # fmt: skip
        return 2
    report = check(args.budget_s)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
