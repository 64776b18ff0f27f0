"""Memory/quality Pareto of TALE policies at one served length, in one command: calibrate, sweep, table, plot.

Why one command: the target "KV ≥ 9x smaller than fp16 at ≤ 3% perplexity" depends on the served length
(the exact sinks and window, and the 9 B a token of scales, zero points and tier id, are amortized over it;
docs/kvcompress.md) and on factors calibrated at that length (post-RoPE keys rotate with position), so the
command fixes both:

1. factors are calibrated on --calibration-limit sequences of --max-length tokens of the train split's
   conversations into --factors (reused when it holds a calibration with the same settings; an interrupted
   calibration resumes);
2. every method of --methods is measured on two text sets of --prefix + --continuation tokens a sequence
   (kvcompress.evaluate.measure_sequence): --limit held-out ShareGPT sequences, and --docs-limit sequences
   of Python's standard-library documentation (a long-context text that is not chat: the module and member
   docstrings of eval.prompt_heavy_data.STDLIB_MODULES, read by a fresh interpreter, joined in that order
   and cut into sequences): perplexity increase over the full cache on the continuation, and KV memory
   against fp16 at the end, exact K/V counted at 16 bits;
3. every (set, sequence, method) result is appended to OUT.records.jsonl as soon as it is measured (a
   sequence cut short keeps its finished methods), and a run skips what is there: a sweep longer than one sitting is split into runs of --budget-minutes (a run
   starts no sequence it cannot finish in that time, by the last sequence's duration), the same command
   each time;
4. OUT.json (everything), OUT.md (per set: the table with bootstrap 95% intervals of the perplexity
   increase, paired over sequences, the Pareto-optimal rows and the verdict) and OUT.png (memory ratio
   against perplexity increase on ShareGPT, with the 9x and 3% target lines).

Run time on the project's 2-core CPU, float32, 2 threads, idle (2026-12-07): calibration ~9 s a 4,096-token
sequence; a 4,096 + 256-token sequence 16-18 s with the full cache and one TALE method, ~6 s more for each
further TALE-family method (16 chunks over 4k tokens of tiers).

examples:
  python scripts/bench_kvcompress_pareto.py MODEL --factors out/kv4k --out out/bench/kv_pareto
  python scripts/bench_kvcompress_pareto.py MODEL --factors out/kv_smoke --calibration-limit 1 \\
      --max-length 512 --limit 1 --prefix 512 --continuation 32 --methods full,tale:0.25 --out out/smoke
"""

from __future__ import annotations

import json
import math
import random
import sys
import textwrap
import time
from pathlib import Path

import torch

import swiftkv  # noqa: F401  (registers the SwiftKV model types, so a SwiftKV checkpoint loads)
from kvcompress.cache import TaleCache
from kvcompress.calibrate import calibrate, chat_sequences
from kvcompress.defaults import SENSITIVITY_SAMPLES
from kvcompress.evaluate import make_method, measure_sequence, method_list, summarize
from kvcompress.factors import load_factors
from toolkit.artifacts import read_provenance, save_figure, write_json_atomic, write_text_atomic
from toolkit.cliargs import ArgumentParser, add_dtype, add_limit, add_model, add_out, run

TARGET_RATIO = 9.0  # x smaller than fp16 (the TALE paper's 9.1x on Llama-3.1-8B)
TARGET_PPL_PCT = 3.0  # perplexity increase over the full cache, %
PARETO_METHODS = ",".join(  # the baselines and the TALE front of 2026-12-07 (docs/results/kvcompress.md)
    [
        "full",
        "hf-fp8",
        "quant:4",
        "kivi:4",
        "kivi:2",
        "tiers:64/64@4x0.1+56/64@4/2x0.3+32/40@4/2x0.6:cc",
        "tale:0.625:4-4-2/4-2-2:cc",
        "tale:0.5:4-4-4/4-2-2:cc",
        "tale:0.5:4-4-2/4-2-2:cc",
        "tale:0.5:4-2-2:cc",
        "tale:0.375:4-4-2/4-2-2:cc",
        "tale:0.375:4-2-2:cc",
        "tiers:64/64@4x0.05+32/48@2x0.35+16/24@2x0.6:cc",
        "tale:0.3:4-2-2:cc",
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
    p.add_argument(
        "--sensitivity-samples",
        type=int,
        default=SENSITIVITY_SAMPLES,
        help="calibration sequences for the per-layer key sensitivity (kvcompress.allocate; 0: uniform ranks; "
        f"default: {SENSITIVITY_SAMPLES})",
    )
    p.add_argument(
        "--methods", type=method_list, default=PARETO_METHODS, help="comma list, the reference (full) first"
    )
    add_limit(p, 16, "held-out ShareGPT sequences")
    p.add_argument(
        "--docs-limit",
        type=int,
        default=8,
        help="sequences of Python's standard-library documentation (default: 8)",
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=20.0,
        help="start no sequence that would end past this many minutes; rerun the command to go on (default: 20)",
    )
    p.add_argument(
        "--bootstrap", type=int, default=2000, help="bootstrap resamples of the sequences (default: 2000)"
    )
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
    settings = {
        "samples": args.calibration_limit,
        "max_length": args.max_length,
        "sinks": args.sinks,
        "sensitivity_samples": args.sensitivity_samples,
    }
    if args.factors.is_dir() and any(args.factors.iterdir()):
        found = read_provenance(args.factors)
        held = {k: found.get(k) for k in [*settings, "data"]}
        if held != {**settings, "data": "sharegpt"}:
            raise ValueError(
                f"{args.factors} holds a calibration with {held}, this run asks for {settings} on sharegpt; "
                "to resolve, pass another --factors or remove it"
            )
        return found
    calibrate(args.model, args.factors, **settings)  # the settings are calibrate()'s keywords
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
        "| method | tiers | KV x smaller than fp16 | Δ perplexity [95% CI] | KL | top-1 | Pareto |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in sorted(rows.items(), key=lambda kv: kv[1]["ratio_vs_fp16"]):
        lo, hi = r.get("ppl_increase_ci", (0.0, 0.0))
        out.append(
            f"| `{m}` | {policies[m]} | {r['ratio_vs_fp16']:.2f}× | {r['ppl_increase_pct']:+.2f}% "
            f"[{lo:+.2f}, {hi:+.2f}] | {r['kl']:.4f} | {r['top1_agree']:.3f} | {'yes' if m in front else ''} |"
        )
    return "\n".join([*out, "", line, ""])


def bootstrap_interval(records: list[dict], method: str, reference: str, draws: int, seed: int = 0) -> tuple:
    """95% percentile interval of the perplexity increase of ``method`` over ``reference``, resampling whole
    sequences with replacement (both methods' tokens of a sequence stay paired)."""
    seqs = [r for r in records if method in r and reference in r]
    rng, deltas = random.Random(seed), []
    for _ in range(draws):
        pick = [rng.choice(seqs) for _ in seqs]
        n = sum(r[method]["n"] for r in pick)
        gap = sum(r[method]["nll"] - r[reference]["nll"] for r in pick) / n
        deltas.append(100 * (math.exp(gap) - 1))
    deltas.sort()
    return deltas[int(0.025 * draws)], deltas[min(draws - 1, int(0.975 * draws))]


VARIANTS = {"pca": "the PCA key basis", "uniform": "the same key ranks in every layer"}


def versus_variants(rows: dict[str, dict], records: list[dict], draws: int) -> dict[str, dict]:
    """Every method measured also as ``METHOD:pca`` (keys in the PCA basis) or ``METHOD:uniform`` (the same
    key ranks in every layer), on the same factors: its perplexity change against that variant and the paired
    95% interval, i.e. what the key basis fitted to the queries, or the key ranks moved between layers by
    sensitivity, gain on these sequences.  Keyed by the variant's name."""
    return {
        f"{m}:{flag}": {
            "ppl_change_pct": 100 * (rows[m]["ppl"] / rows[f"{m}:{flag}"]["ppl"] - 1),
            "ci": bootstrap_interval(records, m, f"{m}:{flag}", draws),
        }
        for m in rows
        for flag in VARIANTS
        if f"{m}:{flag}" in rows
    }


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


def text_sets(tokenizer, args) -> dict[str, list[torch.Tensor]]:
    """The evaluation texts, ``(1, prefix + continuation)`` token tensors per set name."""
    length = args.prefix + args.continuation
    sets = {"sharegpt": list(chat_sequences(tokenizer, length, args.limit, split="heldout"))}
    if args.docs_limit:
        from eval.prompt_heavy_data import STDLIB_MODULES, stdlib_texts

        texts = stdlib_texts()
        ids = tokenizer("\n\n".join(texts[m] for m in STDLIB_MODULES), add_special_tokens=False).input_ids
        sets["stdlib"] = [
            torch.tensor([ids[i : i + length]]) for i in range(0, len(ids) - length + 1, length)
        ][: args.docs_limit]
    for name, seqs in sets.items():
        wanted = args.limit if name == "sharegpt" else args.docs_limit
        if len(seqs) < wanted:
            raise ValueError(
                f"only {len(seqs)} {name} sequences of {length} tokens; to resolve, lower the limit"
            )
    return sets


def read_records(path: Path) -> dict[tuple[str, int], dict]:
    """``(set, sequence) -> {method: result}`` from the records file (JSON lines; absent: empty)."""
    records: dict[tuple[str, int], dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            records.setdefault((row["set"], row["seq"]), {})[row["method"]] = row["result"]
    return records


def measure(model, factors, sets, methods: list[str], args, path: Path, progress) -> dict:
    """Measure what ``path`` does not hold yet, appending each result; stop before a sequence that would end
    past ``--budget-minutes``.  Returns all records."""
    records, began, last = read_records(path), time.monotonic(), 0.0
    for name, seqs in sets.items():
        for i, ids in enumerate(seqs):
            done = records.get((name, i), {})
            todo = [m for m in methods if m not in done]
            if not todo:
                continue
            if time.monotonic() - began + last > 60 * args.budget_minutes:
                progress(f"budget of {args.budget_minutes:g} min reached: rerun the same command to go on")
                return records
            start = time.monotonic()

            def keep(method: str, result: dict, name=name, i=i, todo=todo) -> None:
                if method in todo:  # the reference reruns for KL when only other methods were due
                    with path.open("a") as f:
                        f.write(
                            json.dumps({"set": name, "seq": i, "method": method, "result": result}) + "\n"
                        )
                    records.setdefault((name, i), {})[method] = result

            ordered = [methods[0], *[m for m in todo if m != methods[0]]]
            measure_sequence(
                model, ids, factors, ordered, args.prefix, args.chunk, args.sinks, args.window, keep
            )
            last = time.monotonic() - start
            progress(f"{name} sequence {i + 1}/{len(seqs)}: {len(todo)} methods in {last:.0f} s")
    return records


def pareto(args) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    methods = args.methods
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
            "".join(
                cache.policy.describe().split(" [", 1)[-1].rsplit("]", 1)
            )  # the tiers, any key ranks by layer
            if isinstance(cache, TaleCache)
            else ""
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sets = text_sets(tok, args)
    progress = lambda line: print(f"  {line}", file=sys.stderr, flush=True)  # noqa: E731
    records = measure(model, factors, sets, methods, args, out.with_suffix(".records.jsonl"), progress)
    described = {
        "sharegpt": f"{args.limit} held-out ShareGPT sequences",
        "stdlib": f"{args.docs_limit} sequences of Python's standard-library documentation",
    }
    tables, report = [], {}
    for name in sets:
        held = [r for (s_, _), r in sorted(records.items()) if s_ == name]
        rows = summarize(held, methods)
        for m, r in rows.items():
            r["ppl_increase_ci"] = bootstrap_interval(held, m, methods[0], args.bootstrap)
        front, line = pareto_front(rows), verdict(rows)
        versus = versus_variants(rows, held, args.bootstrap)
        header = (
            f"{Path(args.model).name}, {args.dtype}; factors from {provenance.get('samples')} x "
            f"{provenance.get('max_length')} train-split tokens; {described[name]} of {args.prefix} + "
            f"{args.continuation} tokens (chunks of {args.chunk}; measured: "
            f"{min((r['sequences'] for r in rows.values()), default=0)}); memory at the end, exact K/V counted at "
            f"16 bits; sinks {args.sinks}, window {args.window}; 95% CI: bootstrap over sequences, paired"
        )
        report[name] = {
            "rows": {m: {**r, "tiers": policies[m], "pareto": m in front} for m, r in rows.items()},
            "verdict": line,
            "versus_variants": versus,
        }
        tables.append(markdown(rows, policies, front, f"### {name}\n\n{header}", line))
        tables += [
            f"`{v.rsplit(':', 1)[0]}` against {VARIANTS[v.rsplit(':', 1)[1]]} (`{v}`), paired: perplexity "
            f"{d['ppl_change_pct']:+.2f}% [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]\n"
            for v, d in versus.items()
        ]
        if name == "sharegpt":
            plot(rows, front, header, out.with_suffix(".png"))
    write_json_atomic(
        out.with_suffix(".json"),
        {
            "args": vars(args),
            "calibration": provenance,
            "target": {"ratio_vs_fp16": TARGET_RATIO, "ppl_increase_pct": TARGET_PPL_PCT},
            "sets": report,
        },
    )
    table = "\n".join(tables)
    write_text_atomic(out.with_suffix(".md"), table)
    return f"{table}\nwrote {out.with_suffix('.json')}, .md, .png"


def main(argv: list[str] | None = None) -> int:
    return run(pareto, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
