"""The model's own reply lengths, sampled by vLLM (much faster than transformers' generate on this CPU).

Run with the vLLM venv's python.  Takes the prompts of a traces directory (e.g. the recorded ShareGPT lengths
of ``ranking labels``), samples one reply to each as a chat turn with the served model (temperature, top-p and
a length cap as given), and writes traces (``prompt``, ``prompt_len``, ``output_len``, ``finished``) with a
``meta.json`` naming the model and the cap, which ``ranking train`` / ``evaluate`` read.  Prints the fraction of
replies that hit the cap (the issue's bar: at most 10%).

    .venv-vllm/bin/python scripts/bench_rank_traces.py MODEL out/sg-train --out out/own-traces --limit 600 \\
        --max-new-tokens 1536 --temperature 0.7 --top-p 0.9
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("prompts", type=Path, help="traces directory or JSONL whose prompts to answer")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--limit", type=int, default=600)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=1536)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    source = args.prompts / "traces.jsonl" if args.prompts.is_dir() else args.prompts
    if not source.is_file() or not args.model.is_dir():
        print(
            f"{source} or {args.model} not found; to resolve, pass a traces directory and a model",
            file=sys.stderr,
        )
        return 2
    import os

    from eval.serving.vllm.cpu import cpu_environment, make_llm

    os.environ.update(cpu_environment(tempfile.mkdtemp(prefix="rank-traces-")))
    from vllm import SamplingParams

    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("prompt_len", 0) <= args.max_prompt_tokens][: args.limit]
    llm = make_llm(args.model, max_model_len=args.max_prompt_tokens + args.max_new_tokens + 64,
                   kv_cache_memory_bytes=1 << 30, dtype="float32")  # fmt: skip
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens,
                            seed=args.seed)  # fmt: skip
    outputs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in rows], params, use_tqdm=True)
    args.out.mkdir(parents=True, exist_ok=True)
    capped = 0
    with open(args.out / "traces.jsonl", "w") as f:
        for r, out in zip(rows, outputs, strict=True):
            done = out.outputs[0].finish_reason == "stop"
            capped += not done
            f.write(json.dumps({"prompt": r["prompt"], "prompt_len": r["prompt_len"],
                                "output_len": len(out.outputs[0].token_ids), "finished": done}) + "\n")  # fmt: skip
    meta = {"model": str(args.model.resolve()), "data": str(source), "source": "own-generations-vllm",
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "seed": args.seed}  # fmt: skip
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"{len(rows)} replies, {capped / len(rows):.1%} hit the {args.max_new_tokens}-token cap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
