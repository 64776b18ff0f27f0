"""Memory/quality Pareto of TALE policies at one served length, in one command: calibrate, sweep, table, plot.

Why one command: the target "KV ≥ 9x smaller than fp16 at ≤ 3% perplexity" depends on the served length
(the exact sinks and window, and the 9 B a token of scales, zero points and tier id, are amortized over it;
docs/kvcompress.md) and on factors calibrated at that length (post-RoPE keys rotate with position), so the
command fixes both:

1. factors are calibrated on --calibration-limit sequences of --max-length tokens of the train split's
   conversations into --factors (reused when it holds a calibration with the same settings; an interrupted
   calibration resumes);
2. every method of --methods is measured on --limit held-out sequences of --prefix + --continuation tokens
   (kvcompress.evaluate.quality, as scripts/bench_kvcompress.py does): perplexity increase over the full
   cache on the continuation, and KV memory against fp16 at the end, exact K/V counted at 16 bits;
3. OUT.json (everything), OUT.md (the table, Pareto-optimal rows and the verdict) and OUT.png (memory ratio
   against perplexity increase, with the 9x and 3% target lines).

The default sweep spans ~5x to ~11x at 4,352 tokens: rank budgets x bit mixes around the 9x point, two
explicit tier mixes, and transformers' fp8 cache and per-token int4 as references.

Run time with the defaults on the project's 2-core CPU, float32: ~30 min on an idle machine (calibration
~1 min a 4,096-token sequence; per held-out sequence one ~30 s prefill, then ~20 s per TALE-family method
(16 chunks over 4k tokens of tiers) and a few seconds each for full and fp8), about twice that when the
machine is shared.  --limit 2 halves the sweep, --methods narrows it.

examples:
  python scripts/bench_kvcompress_pareto.py MODEL --factors out/kv4k --out out/bench/kv_pareto
  python scripts/bench_kvcompress_pareto.py MODEL --factors out/kv_smoke --calibration-limit 1 \\
      --max-length 512 --limit 1 --prefix 512 --continuation 32 --methods full,tale:0.25 --out out/smoke
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import torch

from kvcompress.cache import TaleCache
from kvcompress.calibrate import calibrate
from kvcompress.evaluate import make_method, quality
from kvcompress.factors import load_factors
from toolkit.artifacts import read_provenance, save_figure, write_json_atomic, write_text_atomic
from toolkit.cliargs import ArgumentParser, add_dtype, add_limit, add_model, add_out, run

TARGET_RATIO = 9.0  # x smaller than fp16 (the TALE paper's 9.1x on Llama-3.1-8B)
TARGET_PPL_PCT = 3.0  # perplexity increase over the full cache, %
PARETO_METHODS = ",".join(
    [
        "full",
        "hf-fp8",
        "quant:4",
        "tale:0.5:8-4-2",
        "tale:0.375:8-4-2",
        "tale:0.25",
        "tale:0.375:4-2-2",
        "tale:0.25:4-4-2",
        "tale:0.3:4-2-2",
        "tale:0.25:4-2-2",
        "tale:0.2:4-2-2",
        "tiers:64/64@4x0.05+32/32@2x0.25+8/16@2x0.7",
        "tiers:32/48@4x0.1+16/24@2x0.3+8/16@2x0.6",
        "tale:0.25:2-2-2",
        "tale:0.2:2-2-2",
    ]
)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__)
    add_model(p)
    p.add_argument("--factors", type=Path, required=True, help="factors directory: calibrated here if absent")
    p.add_argument(
        "--calibration-limit",
        type=int,
        default=8,
        help="calibration sequences (default: 8, 32k tokens at 4k)",
    )
    p.add_argument(
        "--max-length", type=int, default=4096, help="tokens per calibration sequence: the served length"
    )
    p.add_argument("--methods", default=PARETO_METHODS, help="comma list, the reference (full) first")
    add_limit(p, 4, "held-out sequences")
    p.add_argument("--prefix", type=int, default=4096, help="prefilled tokens per sequence (default: 4096)")
    p.add_argument("--continuation", type=int, default=256, help="scored tokens per sequence (default: 256)")
    p.add_argument("--chunk", type=int, default=16, help="continuation tokens per forward (default: 16)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    add_dtype(p, "float32", ("float32", "bfloat16"))
    add_out(p, help="output path without suffix: writes OUT.json, OUT.md and OUT.png")
    return p


def calibrated(args) -> dict:
    """Calibrate into ``--factors`` unless it already holds a calibration with these settings; its provenance."""
    settings = {"samples": args.calibration_limit, "max_length": args.max_length, "sinks": args.sinks}
    if args.factors.is_dir() and any(args.factors.iterdir()):
        found = read_provenance(args.factors)
        held = {k: found.get(k) for k in [*settings, "data"]}
        if held != {**settings, "data": "sharegpt"}:
            raise ValueError(
                f"{args.factors} holds a calibration with {held}, this run asks for {settings} on sharegpt; "
                "to resolve, pass another --factors or remove it"
            )
        return found
    calibrate(
        args.model, args.factors, samples=args.calibration_limit, max_length=args.max_length, sinks=args.sinks
    )
    return read_provenance(args.factors)


def pareto_front(rows: dict[str, dict]) -> set[str]:
    """Methods no other method beats on both memory ratio (higher) and perplexity increase (lower)."""

    def dominated(a: dict) -> bool:
        return any(
            b["ratio_vs_fp16"] >= a["ratio_vs_fp16"]
            and b["ppl_increase_pct"] <= a["ppl_increase_pct"]
            and (b["ratio_vs_fp16"], b["ppl_increase_pct"]) != (a["ratio_vs_fp16"], a["ppl_increase_pct"])
            for b in rows.values()
        )

    return {m for m, r in rows.items() if not dominated(r)}


def verdict(rows: dict[str, dict]) -> str:
    """Whether a method meets the target, else how close each side of it gets."""
    meets = [
        m
        for m, r in rows.items()
        if r["ratio_vs_fp16"] >= TARGET_RATIO and r["ppl_increase_pct"] <= TARGET_PPL_PCT
    ]
    if meets:
        best = max(meets, key=lambda m: rows[m]["ratio_vs_fp16"])
        return (
            f"target met: {best} is {rows[best]['ratio_vs_fp16']:.2f}x smaller than fp16 at "
            f"{rows[best]['ppl_increase_pct']:+.2f}% perplexity"
        )
    parts = []
    within = [m for m, r in rows.items() if r["ppl_increase_pct"] <= TARGET_PPL_PCT and m != "full"]
    if within:
        m = max(within, key=lambda m: rows[m]["ratio_vs_fp16"])
        parts.append(
            f"within +{TARGET_PPL_PCT:g}% perplexity the smallest is {m} at {rows[m]['ratio_vs_fp16']:.2f}x"
        )
    small = [m for m, r in rows.items() if r["ratio_vs_fp16"] >= TARGET_RATIO]
    if small:
        m = min(small, key=lambda m: rows[m]["ppl_increase_pct"])
        parts.append(f"at ≥ {TARGET_RATIO:g}x the best is {m} at {rows[m]['ppl_increase_pct']:+.2f}%")
    return "target not met: " + ("; ".join(parts) or "no method reaches either side")


def markdown(rows: dict[str, dict], policies: dict[str, str], front: set[str], header: str, line: str) -> str:
    out = [
        header,
        "",
        "| method | tiers | KV x smaller than fp16 | Δ perplexity | KL | top-1 | Pareto |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in sorted(rows.items(), key=lambda kv: kv[1]["ratio_vs_fp16"]):
        out.append(
            f"| `{m}` | {policies[m]} | {r['ratio_vs_fp16']:.2f}× | {r['ppl_increase_pct']:+.2f}% | "
            f"{r['kl']:.4f} | {r['top1_agree']:.3f} | {'yes' if m in front else ''} |"
        )
    return "\n".join([*out, "", line, ""])


def plot(rows: dict[str, dict], front: set[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    points = {m: (r["ratio_vs_fp16"], r["ppl_increase_pct"]) for m, r in rows.items() if m != "full"}
    for m, (x, y) in points.items():
        ax.scatter(x, y, color="tab:blue" if m.startswith(("tale", "tiers")) else "tab:gray", zorder=3)
        ax.annotate(m, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    edge = sorted(points[m] for m in front if m in points)
    if edge:
        ax.plot(*zip(*edge, strict=True), color="tab:blue", alpha=0.5, label="Pareto front")
    ax.axvline(TARGET_RATIO, color="tab:red", ls="--", lw=1, label=f"{TARGET_RATIO:g}x smaller")
    ax.axhline(TARGET_PPL_PCT, color="tab:red", ls=":", lw=1, label=f"+{TARGET_PPL_PCT:g}% perplexity")
    ax.set_xlabel("KV memory: x smaller than fp16 (exact K/V at 16 bits)")
    ax.set_ylabel("perplexity increase over the full cache, %")
    ax.set_yscale("symlog", linthresh=1.0)
    bottom, top = ax.get_ylim()
    right = max(TARGET_RATIO, *(x for x, _ in points.values())) + 0.5
    ax.fill_between(
        [TARGET_RATIO, right], bottom, TARGET_PPL_PCT, color="tab:green", alpha=0.08, label="target"
    )
    ax.set_ylim(bottom, top)
    ax.set_title(textwrap.fill(title, 110), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save_figure(fig, path)


def pareto(args) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    methods = args.methods.split(",")
    if methods[0] != "full":
        raise ValueError(f"--methods starts with {methods[0]!r}; to resolve, put the reference 'full' first")
    provenance = calibrated(args)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    factors = load_factors(args.factors)
    factors.check_model(model.config, model)
    policies = {}
    for m in methods:
        cache = make_method(m, model, factors, args.sinks, args.window)()
        policies[m] = (
            cache.policy.describe().split(" [")[-1].rstrip("]") if isinstance(cache, TaleCache) else ""
        )
    rows = quality(
        model,
        tok,
        factors,
        methods,
        args.limit,
        args.prefix,
        args.continuation,
        args.chunk,
        args.sinks,
        args.window,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )
    front, line = pareto_front(rows), verdict(rows)
    header = (
        f"{Path(args.model).name}, {args.dtype}; factors from {provenance.get('samples')} x "
        f"{provenance.get('max_length')} train-split tokens; {args.limit} held-out ShareGPT sequences of "
        f"{args.prefix} + {args.continuation} tokens (chunks of {args.chunk}); memory at the end, exact K/V "
        f"counted at 16 bits; sinks {args.sinks}, window {args.window}"
    )
    out = Path(args.out)
    write_json_atomic(
        out.with_suffix(".json"),
        {
            "args": vars(args),
            "calibration": provenance,
            "target": {"ratio_vs_fp16": TARGET_RATIO, "ppl_increase_pct": TARGET_PPL_PCT},
            "rows": {m: {**r, "tiers": policies[m], "pareto": m in front} for m, r in rows.items()},
            "verdict": line,
        },
    )
    table = markdown(rows, policies, front, header, line)
    write_text_atomic(out.with_suffix(".md"), table)
    plot(rows, front, header, out.with_suffix(".png"))
    return f"{table}\nwrote {out.with_suffix('.json')}, .md, .png"


def main(argv: list[str] | None = None) -> int:
    return run(pareto, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
