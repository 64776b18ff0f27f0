"""Benchmark SuffixDecoding against plain greedy and transformers' prompt-lookup decoding (batch 1, CPU).

Workloads: ``agentic-refine`` (the model revises its own previous answer, round after round: the case
SuffixDecoding targets) and ``sharegpt`` (held-out ShareGPT first turns).  Every request runs every method,
in an order rotated per request (interleaved A/B), and all methods must produce the same greedy tokens.
The suffix caches persist across requests, so the global tree holds earlier responses, as in serving.

``streams`` times the cache alone (no model) on three kinds of synthetic copy-heavy token streams (200- and
2,000-token prompts of a repeated motif, and ``agentic``: tasks refined round after round, each prompt holding the
earlier answers): our tree (``compiled``: numba kernels) and the C++ reference
(arctic-inference 0.3.0's SuffixDecodingCache, built outside the repository; ``--reference DIR`` or
SUFFIX_REFERENCE_PATH names the folder holding ``arctic_inference/``; its column is skipped, saying so, when
absent).  All caches see the same streams (a draft's tokens are accepted while they equal the stream, plus one),
interleaved request by request, in repeats with fresh caches, garbage collection off while timing; medians of
the per-operation times (setup: an empty request's ``start_request``; prompt: ``start_request`` per prompt token,
its tree's allocation included; append per token, both trees; ``speculate()`` per call; finish: a request's
``finish_request``, the reference's ``stop_request``, which frees its request tree), ratios to the reference,
bytes per cached token of the global tree.

    SUFFIX_REFERENCE_PATH=SITE flock /tmp/bench.lock python scripts/bench_suffix.py . --workload streams --out s.json
    flock /tmp/bench.lock python scripts/bench_suffix.py MODEL_DIR --workload both --out bench.json
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.serving.suffix.artifact import load_cache
from eval.serving.suffix.cache import SpecConfig, SuffixCache
from eval.serving.suffix.decode import speculative_generate
from eval.serving.suffix.stages import chat_ids
from toolkit.assets import iter_prompts
from toolkit.cliargs import ArgumentParser, add_limit, add_model, add_out, existing_path, run

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


def _noisy(rng: random.Random, tokens: list[int]) -> list[int]:
    """``tokens`` with 5% of them replaced by random ones."""
    return [t if rng.random() > 0.05 else rng.randrange(32000) for t in tokens]


def synthetic_streams(n: int, prompt_len: int = 200, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) pairs: a 40-token motif repeated, 5% of tokens replaced (copy-heavy)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(32000) for _ in range(40)]
        prompt = _noisy(rng, (motif * (prompt_len // 40 + 1))[:prompt_len])
        out.append((prompt, _noisy(rng, (motif * 8)[:300])))
    return out


def agentic_streams(n: int, rounds: int = 4, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``n`` requests of tasks refined over ``rounds``: a round's prompt is the task, then each earlier answer
    and a fixed revise instruction; its response is the last answer with 5% of tokens changed (round 0's: 300
    fresh tokens), so it copies from its own prompt and from the global tree (agentic-refine without a model)."""
    rng = random.Random(seed)
    revise = [rng.randrange(32000) for _ in range(20)]
    out: list[tuple[list[int], list[int]]] = []
    while len(out) < n:
        prompt = [rng.randrange(32000) for _ in range(60)]
        answer = [rng.randrange(32000) for _ in range(300)]
        for _ in range(min(rounds, n - len(out))):
            out.append((prompt, answer))
            prompt, answer = prompt + answer + revise, _noisy(rng, answer)
    return out


STREAM_KINDS = {
    "prompt-200": lambda n: synthetic_streams(n, 200),
    "prompt-2000": lambda n: synthetic_streams(n, 2000),
    "agentic": agentic_streams,
}
ACC_KEYS = (
    "t_setup",
    "t_prompt",
    "t_spec",
    "t_app",
    "t_finish",
    "requests",
    "steps",
    "appended",
    "prompt_tokens",
)
SETUP_ID = -1  # request id of the empty request that times the per-request setup


def drive_request(cache, r: int, prompt, response, reference: bool, acc: dict) -> None:
    """Replay one request through one cache, adding per-operation times and counts to ``acc``; an empty
    request before it times the per-request setup (tree allocation and bookkeeping, no prompt)."""
    cfg = SpecConfig()
    stop = cache.stop_request if reference else cache.finish_request
    t0 = time.perf_counter()
    cache.start_request(SETUP_ID, [])
    acc["t_setup"] += time.perf_counter() - t0
    stop(SETUP_ID)
    if reference:  # its cache keeps finished requests' ids (ours forgets them): let the next setup reuse it
        cache.evict_cached_response(SETUP_ID)
    t0 = time.perf_counter()
    cache.start_request(r, prompt)
    acc["t_prompt"] += time.perf_counter() - t0
    acc["requests"] += 1
    acc["prompt_tokens"] += len(prompt)
    ctx, i = list(prompt), 0
    while i < len(response):
        t0 = time.perf_counter()
        if reference:
            draft = cache.speculate(r, ctx, cfg.max_spec, cfg.factor, cfg.offset, cfg.min_token_prob, False)
            tokens = draft.token_ids
        else:
            tokens = cache.speculate(r, ctx).tokens
        acc["t_spec"] += time.perf_counter() - t0
        k = 0
        while k < len(tokens) and i + k < len(response) and tokens[k] == response[i + k]:
            k += 1
        new = response[i : i + k + 1]
        t0 = time.perf_counter()
        cache.add_active_response(r, new) if reference else cache.append(r, new)
        acc["t_app"] += time.perf_counter() - t0
        acc["steps"] += 1
        acc["appended"] += len(new)
        ctx += new
        i += len(new)
    t0 = time.perf_counter()
    stop(r)
    acc["t_finish"] += time.perf_counter() - t0


def summary(acc: dict) -> dict:
    return {
        "steps": acc["steps"],
        "tokens_per_step": acc["appended"] / acc["steps"],
        "us_per_setup": 1e6 * acc["t_setup"] / acc["requests"],
        "us_per_prompt_token": 1e6 * acc["t_prompt"] / acc["prompt_tokens"],
        "us_per_appended_token": 1e6 * acc["t_app"] / acc["appended"],
        "us_per_speculate": 1e6 * acc["t_spec"] / acc["steps"],
        "us_per_finish": 1e6 * acc["t_finish"] / acc["requests"],
    }


def reference_cache_class(path: str | None):
    """arctic-inference's SuffixDecodingCache from ``path`` (a folder holding arctic_inference/), or None."""
    if not path:
        return None
    sys.path.insert(0, path)
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        print(f"reference not importable from {path} ({e}); its column is skipped", file=sys.stderr)
        return None
    finally:
        sys.path.remove(path)
    return SuffixDecodingCache


STREAM_CACHES = ("compiled", "reference")
TIMED = ("us_per_setup", "us_per_prompt_token", "us_per_appended_token", "us_per_speculate", "us_per_finish")


def stream_caches(args) -> dict:
    """Makers of the caches to time, by name: ours (its kernels loaded here, outside the timing) and the
    reference (when built); says which are left out."""
    makers = {"compiled": lambda: SuffixCache(SpecConfig())}
    drive_request(makers["compiled"](), 0, *synthetic_streams(1)[0], False, dict.fromkeys(ACC_KEYS, 0))
    ref_cls = reference_cache_class(args.reference)
    if ref_cls is not None:
        makers["reference"] = lambda: ref_cls(SpecConfig().max_depth, SpecConfig().max_cached_requests)
    else:
        print(
            "no C++ reference (--reference / SUFFIX_REFERENCE_PATH): its column is skipped", file=sys.stderr
        )
    return {name: make for name, make in makers.items() if name in args.caches}


def measure_stream_kind(makers: dict, streams, repeats: int) -> dict:
    """One kind of stream through every cache, interleaved request by request (order rotated), ``repeats``
    times with fresh caches; medians, bytes per cached token of the global tree, ratios to the reference."""
    runs: dict[str, list[dict]] = {name: [] for name in makers}
    memory = {}
    names = list(makers)
    for rep in range(repeats):
        caches = {name: make() for name, make in makers.items()}
        accs = {name: dict.fromkeys(ACC_KEYS, 0) for name in names}
        gc.collect()
        gc.disable()  # as timeit does: a collection would land on whichever cache's step comes next
        for r, (prompt, response) in enumerate(streams):
            k = (r + rep) % len(names)
            for name in names[k:] + names[:k]:
                drive_request(caches[name], r, prompt, response, name == "reference", accs[name])
        gc.enable()
        for name, cache in caches.items():
            runs[name].append(summary(accs[name]))
            if name == "reference":
                memory[name] = cache._global_tree.estimate_memory()
            else:
                memory[name] = cache.global_tree.nbytes()
    n_tokens = sum(len(response) for _, response in streams)
    out = {}
    for name, rows in runs.items():
        out[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[name]["bytes_per_cached_token"] = memory[name] / n_tokens
    if "reference" in out:
        out["ratio_vs_reference"] = {
            name: {k: out[name][k] / out["reference"][k] for k in TIMED}
            for name in runs
            if name != "reference"
        }
    out["same_step_count"] = len({out[name]["steps"] for name in runs}) == 1
    return out


def measure_streams(args) -> dict:
    """Cache-only timings on each kind of synthetic stream (:data:`STREAM_KINDS`), ``--streams`` requests each."""
    makers = stream_caches(args)
    return {
        kind: measure_stream_kind(makers, STREAM_KINDS[kind](args.streams), args.repeats)
        for kind in args.kinds
    }


def measure(args) -> dict:
    results = {}
    if args.workload in ("streams", "all"):
        results["streams"] = measure_streams(args)
    if args.workload == "streams":
        return results
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    counter = ForwardCounter(model)
    model.generate(
        torch.tensor([chat_ids(tok, [{"role": "user", "content": "Hi"}])]), max_new_tokens=4, do_sample=False
    )
    workloads = ["agentic-refine", "sharegpt"] if args.workload in ("both", "all") else [args.workload]
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


def print_streams(res: dict) -> None:
    """Per kind of stream: one row per cache, then each cache's ratios to the reference (the target is <= 1.5x)."""
    print(
        f"\n{'stream':12} {'cache':10} {'steps':>6} {'tok/step':>8} {'setup us':>9} {'prompt us':>9} "
        f"{'append us':>9} {'spec us':>9} {'finish us':>9} {'B/token':>8}"
    )
    for kind, r in res.items():
        for name in STREAM_CACHES:
            if name in r:
                row = r[name]
                print(
                    f"{kind:12} {name:10} {row['steps']:6d} {row['tokens_per_step']:8.2f} "
                    + " ".join(f"{row[k]:9.2f}" for k in TIMED)
                    + f" {row['bytes_per_cached_token']:8.0f}"
                )
        for name, ratios in r.get("ratio_vs_reference", {}).items():
            cells = " ".join(f"{ratios[k]:8.2f}x" for k in TIMED)
            print(f"{kind:12} {name + '/ref':10} {'':6} {'':8} {cells}")
        if not r["same_step_count"]:
            print(f"{kind:12} the caches took different numbers of steps: their drafts differ")


def print_table(results: dict) -> None:
    if "streams" in results:
        print_streams(results["streams"])
    print(f"\n{'workload':15} {'method':14} {'tok/s':>7} {'tok/step':>9} {'speedup':>8} {'median':>7}")
    for workload, res in results.items():
        if workload == "streams":
            continue
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
    p.add_argument(
        "--workload", choices=["agentic-refine", "sharegpt", "both", "streams", "all"], default="all"
    )
    p.add_argument(
        "--reference",
        default=os.environ.get("SUFFIX_REFERENCE_PATH"),
        help="folder holding the built arctic_inference/ package (default: $SUFFIX_REFERENCE_PATH)",
    )
    p.add_argument("--streams", type=int, default=50, help="synthetic requests per kind of stream")
    p.add_argument(
        "--kinds", nargs="+", choices=list(STREAM_KINDS), default=list(STREAM_KINDS), help="kinds of stream"
    )
    p.add_argument(
        "--caches",
        nargs="+",
        choices=STREAM_CACHES,
        default=list(STREAM_CACHES),
        help="caches to time on streams",
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the streams workload")
    p.add_argument(
        "--cache",
        type=existing_path,
        help="pre-built suffix cache for the sharegpt workload (from `swiftkv suffix build`)",
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
        from toolkit.artifacts import write_json_atomic

        write_json_atomic(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
