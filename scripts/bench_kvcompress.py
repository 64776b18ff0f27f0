"""Benchmark TALE against simple KV-cache baselines on held-out ShareGPT text (memory / quality / latency).

Quality: each held-out sequence (the held-out split of the embedded ShareGPT, chat
formatted and joined) is split into --prefix tokens (prefilled, then compressed) and a continuation fed in
--chunk-token steps; perplexity, KL to the uncompressed model and top-1 agreement are measured on the
continuation.  Memory: bytes the cache really holds at the end, as a ratio to an fp16 KV cache of the same
tokens.  Latency: median whole-model decode-step time after prefilling --latency-contexts tokens (one
prefill per context, shared by the methods), methods interleaved in every round, as a ratio to the first
method in the same run (every method on --threads torch threads; TALE's fused numba kernels run on one),
with the KV memory each cache holds and the process's peak memory.  Attention latency: the same, for one layer's cache update + attention over --attention-contexts
cached tokens of random K/V (the part of a step that differs between caches, timed without a long prefill).

Contexts beyond the model's max_position_embeddings are timed as they are: a default (unscaled) RoPE
computes its angles for any position, so a step there does the arithmetic of a longer-context model of the
same shape, but its outputs (the greedy tokens decoded) mean nothing.  The table marks such contexts.
Memory/quality across policies at one served length: scripts/bench_kvcompress_pareto.py.

examples:
  python scripts/bench_kvcompress.py MODEL out/kv --out out/bench_kv.json
  python scripts/bench_kvcompress.py MODEL out/kv --methods full,tale:0.25,quant:4 \\
      --limit 2 --latency-contexts 2048 --repeats 1
  OMP_NUM_THREADS=1 python scripts/bench_kvcompress.py MODEL out/kv --limit 0 --attention-contexts '' \\
      --latency-contexts 2048,8192,16384 --latency-methods full,hf-fp8,tale:0.25 --dtype float32
"""

from __future__ import annotations

import os
import resource
import statistics
import sys

import torch

from kvcompress import evaluate
from kvcompress.attention import enable_tale
from kvcompress.calibrate import accumulate, chat_sequences
from kvcompress.continuation import SharedPrefill
from kvcompress.evaluate import (
    attention_step_seconds,
    decode_step_seconds,
    energy_error,
    kv_bytes,
    make_method,
    method_list,
    weight_svd_bases,
)
from kvcompress.factors import load_factors
from toolkit.cliargs import ArgumentParser, add_dtype, add_limit, add_model, add_out, int_list, run

DEFAULT_METHODS = "full,hf-fp8,quant:4,quant:2,lowrank:8:16,lowrank:16:16,lowrank:16:4,lowrank:24:4,tale:0.25,tale:0.375,tale:0.5"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__)
    add_model(p)
    add_model(p, "factors", help="factors directory from `swiftkv kvcompress calibrate`")
    p.add_argument(
        "--methods", type=method_list, default=DEFAULT_METHODS, help="comma list (see kvcompress.evaluate)"
    )
    add_limit(p, 6, "held-out sequences for quality")
    p.add_argument("--prefix", type=int, default=1024, help="prefilled tokens per sequence")
    p.add_argument("--continuation", type=int, default=256, help="scored tokens per sequence")
    p.add_argument("--chunk", type=int, default=16, help="continuation tokens per forward")
    p.add_argument(
        "--latency-contexts",
        type=int_list,
        default=[2048, 8192, 16384],
        help="comma list; empty to skip (beyond the model's max_position_embeddings: timing only, see above)",
    )
    p.add_argument(
        "--latency-methods", type=method_list, default="full,hf-fp8,quant:4,tale:0.25", help="comma list"
    )
    p.add_argument("--decode-steps", type=int, default=32, help="timed steps per round (32: one block)")
    p.add_argument(
        "--attention-contexts",
        type=int_list,
        default=[2048, 4096, 8192],
        help="comma list; one layer's decode attention timed without a prefill; empty to skip",
    )
    p.add_argument("--attention-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (the median is reported)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    add_dtype(p, "bfloat16", ("bfloat16", "float32"))
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: small decode ops do not wait on busy cores)"
    )
    p.add_argument(
        "--prefill-threads",
        type=int,
        default=os.cpu_count(),
        help="torch threads of the latency's shared prefill (not timed; default: every core)",
    )
    p.add_argument(
        "--compare-bases", action="store_true", help="held-out energy lost: calibrated PCA vs weight SVD"
    )
    add_out(p, help="write the results as JSON here", required=False)
    return p


def quality(model, tok, factors, args) -> dict[str, dict]:
    return evaluate.quality(
        model,
        tok,
        factors,
        args.methods,
        args.limit,
        args.prefix,
        args.continuation,
        args.chunk,
        args.sinks,
        args.window,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )


def interleaved(methods: list[str], states: dict, seconds, repeats: int, label: str) -> dict[str, dict]:
    """Per method, the median over ``repeats`` rounds of the mean of ``seconds(states[method])``, every round
    running every method once (interleaved A/B), with the ratio to the first method of the same run.

    ``states`` holds each method's state for one context (a prefilled cache); the rounds continue it.
    """
    rounds = {m: [] for m in methods}
    for r in range(repeats):
        for m in methods:
            rounds[m].append(statistics.mean(seconds(states[m])))
            print(f"  {label}: repeat {r + 1} {m} {rounds[m][-1] * 1e3:.3f} ms", file=sys.stderr, flush=True)
    base = statistics.median(rounds[methods[0]])
    return {
        m: {
            "ms": 1e3 * statistics.median(rounds[m]),
            "ratio_vs_" + methods[0]: statistics.median(rounds[m]) / base,
            "rounds_ms": [1e3 * x for x in rounds[m]],
        }
        for m in methods
    }


def peak_rss_gib() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def latency(model, tok, factors, args) -> dict[str, dict]:
    """Whole-model decode steps (the model's own forward of one token) after prefilling held-out text.

    Per context, the prompt is prefilled once (``SharedPrefill``, on ``--prefill-threads``: it is not timed)
    and handed to every method's cache as its own prefill would leave it; every round then times
    ``--decode-steps`` steps on each cache (32 = one compression block, so TALE's compressions are in the
    mean in their real proportion).  Contexts run one after the other, so each context's peak memory is
    the process's peak after it (recorded with the KV memory each cache holds after its prefill).
    """
    methods = args.latency_methods
    factories = {m: make_method(m, model, factors, args.sinks, args.window) for m in methods}
    out: dict[str, dict] = {m: {} for m in methods}
    for ctx in args.latency_contexts:
        ids = next(chat_sequences(tok, ctx, 1, split="heldout", offset=1000))
        torch.set_num_threads(args.prefill_threads)
        shared = SharedPrefill(model, ids)
        torch.set_num_threads(args.threads)
        states, kv_mib = {}, {}
        for m in methods:
            select_attention(model, m)
            cache = factories[m]()
            token = shared.start(cache)[:, -1:].argmax(-1)
            # warm-up, not counted: one round, so its compression and every kernel signature are loaded
            _, token = decode_step_seconds(model, token, cache, args.decode_steps)
            states[m], kv_mib[m] = {"method": m, "cache": cache, "token": token}, kv_bytes(cache) / 2**20
        del shared

        def seconds(state):
            select_attention(model, state["method"])
            times, state["token"] = decode_step_seconds(
                model, state["token"], state["cache"], args.decode_steps
            )
            return times

        timed = interleaved(methods, states, seconds, args.repeats, f"latency ctx {ctx}")
        del states
        peak = peak_rss_gib()
        for m in methods:
            out[m][str(ctx)] = {**timed[m], "kv_mib": kv_mib[m], "peak_rss_gib": peak}
    return out


def attention_latency(model, factors, args) -> dict[str, dict]:
    """One layer's decode-step attention (cache update included) per method and context."""
    methods = args.latency_methods
    factories = {m: make_method(m, model, factors, args.sinks, args.window) for m in methods}
    seeds = iter(range(1 << 30))
    for m in methods:  # warm-up (kernel loading), not counted
        attention_step_seconds(model, factories[m](), min(args.attention_contexts), 2, 0)

    def seconds(state):
        m, ctx = state
        return attention_step_seconds(model, factories[m](), ctx, args.attention_steps, next(seeds))

    out: dict[str, dict] = {m: {} for m in methods}
    for ctx in args.attention_contexts:
        states = {m: (m, ctx) for m in methods}
        for m, row in interleaved(methods, states, seconds, args.repeats, f"attention ctx {ctx}").items():
            out[m][str(ctx)] = row
    return out


def select_attention(model, method: str) -> None:
    """The attention ``make_method`` sets for ``method`` (sdpa for transformers' caches, TALE otherwise)."""
    if method in ("full", "hf-fp8"):
        model.set_attn_implementation("sdpa")
    else:
        enable_tale(model)


def print_latency(title: str, lat: dict[str, dict], digits: int, trained: int | None = None) -> None:
    """The table of medians and ratios; contexts beyond ``trained`` positions are marked with ``*``."""
    contexts = [c + ("*" if trained and int(c) > trained else "") for c in next(iter(lat.values()))]
    print(f"\n{title} (median; ratio vs first method)")
    print(f"{'method':<16}" + "".join(f"{c:>18}" for c in contexts))
    for m, per in lat.items():
        ratios = [next(x for k, x in v.items() if k.startswith("ratio_vs_")) for v in per.values()]
        cells = [f"{v['ms']:.{digits}f} ({r:.2f}x)" for v, r in zip(per.values(), ratios, strict=True)]
        print(f"{m:<16}" + "".join(f"{c:>18}" for c in cells))


def compare_bases(model, tok, factors, ranks=(16, 32, 48)) -> dict[str, dict]:
    """Held-out energy each basis loses at each rank, averaged over layers and heads."""
    moments = accumulate(model, chat_sequences(tok, 512, 4, split="heldout", offset=500))
    heads = factors.meta["num_key_value_heads"]
    rows: dict[str, dict] = {}
    for idx, (km, vm, n) in moments.layers.items():
        wk, wv = weight_svd_bases(model, idx, heads)
        lf = factors.layers[idx]
        bases = {"K calibrated (post-RoPE)": (km, lf.key_basis), "K weight SVD": (km, wk)}
        bases |= {"V calibrated": (vm, lf.value_basis), "V weight SVD": (vm, wv)}
        for name, (moment, basis) in bases.items():
            for r in ranks:
                rows.setdefault(name, {}).setdefault(r, []).append(energy_error(moment / n, basis, r))
    return {name: {r: statistics.mean(v) for r, v in per.items()} for name, per in rows.items()}


def bench(args) -> None:
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    factors = load_factors(args.factors)
    factors.check_model(model.config, model)
    q = quality(model, tok, factors, args) if args.limit else {}
    lat = latency(model, tok, factors, args) if args.latency_contexts else {}
    attn = attention_latency(model, factors, args) if args.attention_contexts else {}
    bases = compare_bases(model, tok, factors) if args.compare_bases else {}

    if q:
        print(
            f"\nquality: {args.limit} held-out ShareGPT sequences, prefix {args.prefix}, continuation {args.continuation}"
        )
        w = max(len(m) for m in q) + 2
        print(f"{'method':<{w}}{'KV x vs fp16':>13}{'ppl':>10}{'Δppl %':>9}{'KL':>9}{'top1':>8}")
        for m, r in q.items():
            print(
                f"{m:<{w}}{r['ratio_vs_fp16']:>13.2f}{r['ppl']:>10.3f}{r['ppl_increase_pct']:>9.2f}"
                f"{r['kl']:>9.4f}{r['top1_agree']:>8.3f}"
            )
    if lat:
        trained = model.config.max_position_embeddings
        print_latency("decode ms/step", lat, 1, trained)
        print(f"{'KV MiB held':<16}" + "".join(f"{c:>18}" for c in next(iter(lat.values()))))
        for m, per in lat.items():
            print(f"{m:<16}" + "".join(f"{v['kv_mib']:>18.1f}" for v in per.values()))
        peaks = next(iter(lat.values()))
        print(
            "peak RSS after each context: "
            + ", ".join(f"{c}: {v['peak_rss_gib']:.2f} GiB" for c, v in peaks.items())
        )
        if max(args.latency_contexts) > trained:
            rope = (model.config.rope_parameters or {}).get("rope_type", "default")
            print(
                f"* beyond the model's max_position_embeddings ({trained}); its RoPE ({rope}) is computed for any "
                "position, so these steps time the same arithmetic, but their outputs are not meaningful"
            )
    if attn:
        print_latency("one layer's decode-step attention + cache update, ms", attn, 3)
    if bases:
        print("\nheld-out energy lost by a rank-r basis (mean over layers/heads)")
        print(f"{'basis':<28}" + "".join(f"{'r=' + str(r):>9}" for r in next(iter(bases.values()))))
        for name, per in bases.items():
            print(f"{name:<28}" + "".join(f"{v:>9.3f}" for v in per.values()))
    if args.out:
        from toolkit.artifacts import write_json_atomic

        write_json_atomic(
            args.out,
            {
                "args": vars(args),
                "quality": q,
                "latency": lat,
                "max_position_embeddings": model.config.max_position_embeddings,
                "attention_latency": attn,
                "bases": bases,
                "anchor": "TALE paper: 9.1x",
            },
        )


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
