"""Benchmark SuffixDecoding against plain greedy and transformers' prompt-lookup decoding (batch 1, CPU).

Workloads: ``agentic-refine`` (the model revises its own previous answer, round after round: the case
SuffixDecoding targets) and ``sharegpt`` (held-out ShareGPT first turns).  Every request runs every method,
in an order rotated per request (interleaved A/B), and all methods must produce the same greedy tokens.
The suffix caches persist across requests, so the global tree holds earlier responses, as in serving.

    flock /tmp/bench.lock python scripts/bench_suffix.py MODEL_DIR --workload both --out bench.json
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.serving.suffix.artifact import load_cache
from eval.serving.suffix.cache import SpecConfig, SuffixCache
from eval.serving.suffix.decode import speculative_generate
from eval.serving.suffix.stages import chat_ids
from swiftkv.assets import iter_prompts
from swiftkv.cliargs import ArgumentParser, add_limit, add_model, add_out, existing_path, run

TASKS = [
    "Write a short product description for a reusable water bottle.",
    "Explain in one paragraph how a hash table works.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Write a short email asking a colleague to review a pull request.",
]
REVISE = "Revise your answer above: keep it the same length, fix any mistakes and improve the wording. Reply with the full revised text only."
METHODS = ["greedy", "prompt-lookup", "suffix-path", "suffix-tree"]


class ForwardCounter:
    """Counts forward passes of a model (decoding steps = forwards - 1 prefill)."""

    def __init__(self, model) -> None:
        self.n = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def run_method(method, model, ids, max_new, caches, counter, request_id):
    """One request with one method: (new tokens, seconds, forwards, suffix stats or None)."""
    counter.n = 0
    start = time.perf_counter()
    stats = None
    if method in ("greedy", "prompt-lookup"):
        extra = {"prompt_lookup_num_tokens": 10} if method == "prompt-lookup" else {}
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, **extra)
        tokens = out[0, len(ids) :].tolist()
    else:
        stats = speculative_generate(model, ids, max_new, caches[method], request_id=request_id)
        tokens = stats.tokens
    return tokens, time.perf_counter() - start, counter.n, stats


def sharegpt_prompts(tok, n: int, skip: int) -> list[list[int]]:
    """Chat-templated first turns of held-out ShareGPT conversations from index ``skip`` on, 16..384 tokens long."""
    prompts = []
    for i, text in enumerate(iter_prompts("sharegpt", split="heldout")):
        if i >= skip and 16 <= len(ids := chat_ids(tok, [{"role": "user", "content": text}])) <= 384:
            prompts.append(ids)
            if len(prompts) == n:
                break
    return prompts


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    counter = ForwardCounter(model)
    model.generate(
        torch.tensor([chat_ids(tok, [{"role": "user", "content": "Hi"}])]), max_new_tokens=4, do_sample=False
    )
    results = {}
    workloads = ["agentic-refine", "sharegpt"] if args.workload == "both" else [args.workload]
    for workload in workloads:
        caches = {}
        for method in ("suffix-path", "suffix-tree"):
            config = SpecConfig(mode=method.split("-")[1], max_spec=args.max_spec)
            caches[method] = (
                load_cache(args.cache, tok, config)
                if args.cache and workload == "sharegpt"
                else SuffixCache(config)
            )
        rows = {m: {"tokens": 0, "seconds": 0.0, "steps": 0, "per_request": []} for m in METHODS}
        spec = {"speculate_s": 0.0, "calls": 0, "append_s": 0.0, "appended": 0}
        mismatches = 0
        if workload == "sharegpt":
            requests = [[ids] for ids in sharegpt_prompts(tok, args.limit, args.heldout_from)]
        else:
            requests = [[task] for task in TASKS[: args.tasks]]
        rid = 0
        for chain in requests:
            messages = None
            for rnd in range(args.rounds if workload == "agentic-refine" else 1):
                if workload == "agentic-refine":
                    messages = messages or [{"role": "user", "content": chain[0]}]
                    ids = chat_ids(tok, messages)
                else:
                    ids = chain[0]
                outputs = {}
                order = METHODS[rid % len(METHODS) :] + METHODS[: rid % len(METHODS)]
                for method in order:
                    tokens, seconds, forwards, stats = run_method(
                        method, model, ids, args.max_new_tokens, caches, counter, rid
                    )
                    outputs[method] = tokens
                    row = rows[method]
                    row["tokens"] += len(tokens)
                    row["seconds"] += seconds
                    row["steps"] += forwards - 1
                    row["per_request"].append(len(tokens) / seconds)
                    if stats is not None:
                        spec["speculate_s"] += stats.speculate_s
                        spec["calls"] += stats.speculate_calls
                        spec["append_s"] += stats.append_s
                        spec["appended"] += stats.appended
                mismatches += sum(outputs[m] != outputs["greedy"] for m in METHODS)
                print(
                    f"  {workload} request {rid} round {rnd}: {len(outputs['greedy'])} tokens, "
                    + ", ".join(f"{m} {rows[m]['per_request'][-1]:.1f} tok/s" for m in METHODS),
                    flush=True,
                )
                if workload == "agentic-refine":
                    answer = tok.decode(outputs["greedy"], skip_special_tokens=True)
                    messages = messages + [
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": REVISE},
                    ]
                rid += 1
        base = rows["greedy"]
        table = {}
        for m in METHODS:
            r = rows[m]
            ratios = [a / b for a, b in zip(r["per_request"], base["per_request"], strict=True)]
            table[m] = {
                "tokens": r["tokens"],
                "tokens_per_s": r["tokens"] / r["seconds"],
                "tokens_per_step": (r["tokens"] - len(r["per_request"])) / max(r["steps"], 1),
                "speedup_total": (r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"]),
                "speedup_median": statistics.median(ratios),
            }
        results[workload] = {
            "requests": rid,
            "mismatches_vs_greedy": mismatches,
            "methods": table,
            "us_per_speculate": 1e6 * spec["speculate_s"] / max(spec["calls"], 1),
            "us_per_appended_token": 1e6 * spec["append_s"] / max(spec["appended"], 1),
        }
    return results


def print_table(results: dict) -> None:
    print(f"\n{'workload':15} {'method':14} {'tok/s':>7} {'tok/step':>9} {'speedup':>8} {'median':>7}")
    for workload, res in results.items():
        for m, r in res["methods"].items():
            print(
                f"{workload:15} {m:14} {r['tokens_per_s']:7.2f} {r['tokens_per_step']:9.2f} "
                f"{r['speedup_total']:7.2f}x {r['speedup_median']:6.2f}x"
            )
        print(
            f"{workload:15} speculate() {res['us_per_speculate']:.0f} us/call, append {res['us_per_appended_token']:.1f} "
            f"us/token, {res['mismatches_vs_greedy']} outputs differing from greedy, {res['requests']} requests"
        )


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n  flock /tmp/bench.lock python scripts/bench_suffix.py ~/.cache/swiftkv-toolkit/models/"
        "smollm2-135m-instruct --workload agentic-refine --out bench_suffix.json\n"
        "  python scripts/bench_suffix.py DIR --workload sharegpt --cache out/suffix-cache --limit 4",
    )
    add_model(p)
    p.add_argument("--workload", choices=["agentic-refine", "sharegpt", "both"], default="both")
    p.add_argument(
        "--cache",
        type=existing_path,
        help="pre-built suffix cache for the sharegpt workload (from `python -m eval.serving.suffix build`)",
    )
    p.add_argument("--tasks", type=int, default=2, help="agentic tasks (each refined --rounds times)")
    p.add_argument("--rounds", type=int, default=3)
    add_limit(p, 4, "held-out ShareGPT prompts")
    p.add_argument(
        "--heldout-from", type=int, default=0, help="first held-out ShareGPT conversation used for prompts"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-spec", type=int, default=SpecConfig().max_spec)
    p.add_argument("--threads", type=int, default=2)
    add_out(p, help="write the results as JSON", required=False)
    return p


def bench(args) -> None:
    results = measure(args)
    print_table(results)
    if args.out:
        from swiftkv.artifacts import write_json_atomic

        write_json_atomic(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
