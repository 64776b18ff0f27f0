"""Benchmark TALE against simple KV-cache baselines on held-out ShareGPT text (memory / quality / latency).

Quality: each held-out sequence (the held-out split of the embedded ShareGPT, chat
formatted and joined) is split into --prefix tokens (prefilled, then compressed) and a continuation fed in
--chunk-token steps; perplexity, KL to the uncompressed model and top-1 agreement are measured on the
continuation.  Memory: bytes the cache really holds at the end, as a ratio to an fp16 KV cache of the same
tokens.  Latency: median decode-step time after prefilling --latency-contexts tokens, methods interleaved
in every repeat, as a ratio to the full cache measured in the same run (every method on --threads torch
threads; TALE's fused kernels, used when numba is installed (the `fast` extra), run on one).  Attention
latency: the same, for one layer's cache update + attention over --attention-contexts cached tokens of
random K/V (the part of a step that differs between caches, timed without a long prefill).

examples:
  python scripts/bench_kvcompress.py MODEL out/kv --out out/bench_kv.json
  python scripts/bench_kvcompress.py MODEL out/kv --methods full,tale:0.25,quant:4 \\
      --limit 2 --latency-contexts 2048 --repeats 1
  python scripts/bench_kvcompress.py MODEL out/kv --limit 0 --latency-contexts "" --latency-methods full,tale:0.25
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvcompress import kernels
from kvcompress.attention import enable_tale
from kvcompress.calibrate import accumulate, chat_sequences
from kvcompress.evaluate import (
    attention_step_seconds,
    compare,
    continuation_logits,
    decode_step_seconds,
    energy_error,
    fp16_kv_bytes,
    kv_bytes,
    make_method,
    prefill,
    weight_svd_bases,
)
from kvcompress.factors import load_factors
from toolkit.cliargs import ArgumentParser, add_dtype, add_limit, add_model, add_out, int_list, run

DEFAULT_METHODS = "full,hf-fp8,quant:4,quant:2,lowrank:8:16,lowrank:16:16,lowrank:16:4,lowrank:24:4,tale:0.25,tale:0.375,tale:0.5"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__)
    add_model(p)
    add_model(p, "factors", help="factors directory from `swiftkv kvcompress calibrate`")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma list (see kvcompress.evaluate)")
    add_limit(p, 6, "held-out sequences for quality")
    p.add_argument("--prefix", type=int, default=1024, help="prefilled tokens per sequence")
    p.add_argument("--continuation", type=int, default=256, help="scored tokens per sequence")
    p.add_argument("--chunk", type=int, default=16, help="continuation tokens per forward")
    p.add_argument(
        "--latency-contexts", type=int_list, default=[2048, 4096, 8192], help="comma list; empty to skip"
    )
    p.add_argument("--latency-methods", default="full,hf-fp8,quant:4,tale:0.25", help="comma list")
    p.add_argument("--decode-steps", type=int, default=32, help="timed steps per round (32: one block)")
    p.add_argument(
        "--attention-contexts",
        type=int_list,
        default=[2048, 4096, 8192],
        help="comma list; one layer's decode attention timed without a prefill; empty to skip",
    )
    p.add_argument("--attention-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    add_dtype(p, "bfloat16", ("bfloat16", "float32"))
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: small decode ops do not wait on busy cores)"
    )
    p.add_argument(
        "--compare-bases", action="store_true", help="held-out energy lost: calibrated PCA vs weight SVD"
    )
    add_out(p, help="write the results as JSON here", required=False)
    return p


def quality(model, tok, factors, args) -> dict[str, dict]:
    methods = args.methods.split(",")
    seqs = list(chat_sequences(tok, args.prefix + args.continuation, args.limit, split="heldout"))
    totals = {
        m: {"nll": 0.0, "kl": 0.0, "agree": 0.0, "n": 0, "bytes": [], "fp16": [], "seconds": 0.0}
        for m in methods
    }
    for i, ids in enumerate(seqs):
        targets = ids[:, args.prefix :]
        ref = None
        for m in methods:  # "full" first gives the reference logits for this sequence
            factory = make_method(m, model, factors, args.sinks, args.window)
            cache = factory()
            start = time.perf_counter()
            logits = continuation_logits(model, ids, cache, args.prefix, args.chunk)
            totals[m]["seconds"] += time.perf_counter() - start
            ref = logits if ref is None else ref
            for k, v in compare(logits, ref, targets).items():
                totals[m][k] += v
            totals[m]["bytes"].append(kv_bytes(cache, exact_element_bytes=2))
            totals[m]["fp16"].append(fp16_kv_bytes(model.config, ids.shape[1] - 1))
        print(f"  quality: sequence {i + 1}/{len(seqs)} done", file=sys.stderr, flush=True)
    base_ppl = torch.tensor(totals[methods[0]]["nll"] / totals[methods[0]]["n"]).exp().item()
    rows = {}
    for m, t in totals.items():
        ppl = torch.tensor(t["nll"] / t["n"]).exp().item()
        rows[m] = {
            "ppl": ppl,
            "ppl_increase_pct": 100 * (ppl / base_ppl - 1),
            "kl": t["kl"] / t["n"],
            "top1_agree": t["agree"] / t["n"],
            "kv_bytes": statistics.median(t["bytes"]),
            "ratio_vs_fp16": statistics.median(f / b for f, b in zip(t["fp16"], t["bytes"], strict=True)),
            "seconds": t["seconds"],
        }
    return rows


def interleaved(methods: list[str], contexts, start, seconds, repeats: int, label: str) -> dict[str, dict]:
    """Per method and context, the median over ``repeats`` rounds of the mean of ``seconds(state)``, every
    round running every method once (interleaved A/B), with the ratio to the first method of the same run.

    ``start(method, ctx)`` makes a method's state once per context (a prefilled cache); the rounds continue it.
    """
    out: dict[str, dict] = {}
    for ctx in contexts:
        states = {m: start(m, ctx) for m in methods}
        rounds = {m: [] for m in methods}
        for r in range(repeats):
            for m in methods:
                rounds[m].append(statistics.mean(seconds(states[m])))
                print(
                    f"  {label}: ctx {ctx} repeat {r + 1} {m} {rounds[m][-1] * 1e3:.3f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        del states
        base = statistics.median(rounds[methods[0]])
        for m in methods:
            ms = statistics.median(rounds[m])
            out.setdefault(m, {})[str(ctx)] = {
                "ms": 1e3 * ms,
                "ratio_vs_" + methods[0]: ms / base,
                "rounds_ms": [1e3 * x for x in rounds[m]],
            }
    return out


def latency(model, tok, factors, args) -> dict[str, dict]:
    """Whole-model decode steps (the model's own forward of one token) after prefilling held-out text.

    Each method's cache is prefilled once per context; every round then times ``--decode-steps`` steps on
    it (32 = one compression block, so TALE's compressions are in the mean in their real proportion).
    """
    methods = args.latency_methods.split(",")
    factories = {m: make_method(m, model, factors, args.sinks, args.window) for m in methods}

    def start(m, ctx):
        select_attention(model, m)
        ids = next(chat_sequences(tok, ctx, 1, split="heldout", offset=1000))
        cache = factories[m]()
        token = prefill(model, ids, cache)
        _, token = decode_step_seconds(model, token, cache, 2)  # warm-up (kernel loading), not counted
        return {"method": m, "cache": cache, "token": token}

    def seconds(state):
        select_attention(model, state["method"])
        times, state["token"] = decode_step_seconds(model, state["token"], state["cache"], args.decode_steps)
        return times

    return interleaved(methods, args.latency_contexts, start, seconds, args.repeats, "latency")


def attention_latency(model, factors, args) -> dict[str, dict]:
    """One layer's decode-step attention (cache update included) per method and context."""
    methods = args.latency_methods.split(",")
    factories = {m: make_method(m, model, factors, args.sinks, args.window) for m in methods}
    seeds = iter(range(1 << 30))
    for m in methods:  # warm-up (kernel loading), not counted
        attention_step_seconds(model, factories[m](), min(args.attention_contexts), 2, 0)

    def seconds(state):
        m, ctx = state
        return attention_step_seconds(model, factories[m](), ctx, args.attention_steps, next(seeds))

    return interleaved(
        methods, args.attention_contexts, lambda m, ctx: (m, ctx), seconds, args.repeats, "attention"
    )


def select_attention(model, method: str) -> None:
    """The attention ``make_method`` sets for ``method`` (sdpa for transformers' caches, TALE otherwise)."""
    if method in ("full", "hf-fp8"):
        model.set_attn_implementation("sdpa")
    else:
        enable_tale(model)


def print_latency(title: str, lat: dict[str, dict], digits: int) -> None:
    contexts = list(next(iter(lat.values())))
    print(f"\n{title} (median; ratio vs first method)")
    print(f"{'method':<16}" + "".join(f"{c:>18}" for c in contexts))
    for m, per in lat.items():
        cells = [f"{v['ms']:.{digits}f} ({list(v.values())[1]:.2f}x)" for v in per.values()]
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
        print_latency("decode ms/step", lat, 1)
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
                "fused_kernels": kernels.numba is not None,
                "quality": q,
                "latency": lat,
                "attention_latency": attn,
                "bases": bases,
                "anchor": "TALE paper: 9.1x",
            },
        )


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
