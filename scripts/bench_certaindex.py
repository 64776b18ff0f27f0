"""Certaindex token savings against full-budget baselines measured in the same run.

Problems are arithmetic word problems generated with a seed (``eval.serving.certaindex.data.arithmetic``): small
enough that SmolLM2-135M solves some, with exact integer answers.  Per problem, interleaved:

* CoT: the full-budget chain (no probes) and the early-exit chain (probe after each chunk, exit rule of the
  preset), same chunking and seeds, so the early-exit chain is a prefix of the full one;
* SC: full-budget self-consistency (``--sc-samples`` samples) and certaindex-adaptive SC (threshold
  ``--sc-threshold``), same rounds and seeds, so the adaptive samples are a prefix of the full ones.  The
  adaptive arm is run for real on the first ``--sc-real`` problems and checked against ``sc.replay`` of the
  full run; the rest are replayed (exact by construction, see tests/eval/serving/certaindex/test_backends.py).

Reports accuracy, tokens per problem (CoT early exit: main + probe tokens), the token ratio against the
baseline, per-problem medians and how many answers flipped right->wrong / wrong->right.  Tokens are counts,
not timings; wall seconds are shown for information only.  Per-problem records are appended to
``OUT.jsonl.partial`` as each problem finishes (``eval.serving.certaindex.records``), so rerunning the same command
after an interruption continues where it stopped.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from toolkit.assets import model_dir
from toolkit.cliargs import ArgumentParser, add_dtype, add_limit, add_out, add_seed, existing_path, run

EPILOG = """examples:
  flock /tmp/bench.lock python scripts/bench_certaindex.py \\
      ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct --limit 16 --out out/bench/certaindex.json
  python scripts/bench_certaindex.py MODEL_DIR --skip-sc --preset high --cot-max-tokens 512
"""


def _arm(name: str, records: list[dict], baseline: list[dict] | None = None) -> dict:
    tokens = [r["tokens"] for r in records]
    row = {
        "arm": name,
        "accuracy": sum(r["correct"] for r in records) / len(records),
        "mean_tokens": statistics.fmean(tokens),
        "median_tokens": statistics.median(tokens),
        "median_seconds": statistics.median(r["seconds"] for r in records),
    }
    if baseline is not None:
        row["token_ratio"] = sum(tokens) / max(1, sum(r["tokens"] for r in baseline))
        row["lost"] = sum(b["correct"] and not r["correct"] for r, b in zip(records, baseline, strict=True))
        row["gained"] = sum(r["correct"] and not b["correct"] for r, b in zip(records, baseline, strict=True))
    return row


def solve_cot(backend, p, i: int, args) -> dict:
    """One problem's full-budget and early-exit chains (same chunk seeds, so early is a prefix of full)."""
    from eval.serving.certaindex.answers import answers_equal
    from eval.serving.certaindex.backends import Sampling
    from eval.serving.certaindex.certainty import preset
    from eval.serving.certaindex.cot import run_cot

    window, chunk = preset(args.preset)
    prompt = backend.chat_format(p.prompt_text())
    record = {}
    for arm, exit_early in (("cot_full", False), ("cot_early", True)):
        t = time.perf_counter()
        r = run_cot(backend, prompt, max_tokens=args.cot_max_tokens, window=window, chunk=chunk,
                    early_exit=exit_early, sampling=Sampling(args.temperature, args.top_p, args.seed + i))  # fmt: skip
        record[arm] = {"answer": r.answer, "correct": answers_equal(r.answer, p.answer),
                       "tokens": r.main_tokens + r.probe_tokens, "main_tokens": r.main_tokens,
                       "probe_tokens": r.probe_tokens, "probe_input_tokens": r.probe_input_tokens,
                       "probe_answers": r.probe_answers, "exited_early": r.exited_early,
                       "seconds": time.perf_counter() - t}  # fmt: skip
    full, early = record["cot_full"], record["cot_early"]
    print(f"cot {p.id}: ref {p.answer} | full {full['answer']!r} {full['tokens']} tok | "
          f"early {early['answer']!r} {early['main_tokens']}+{early['probe_tokens']} tok", flush=True)  # fmt: skip
    return record


def solve_sc(backend, p, i: int, args) -> dict:
    """One problem's full-budget SC and its certaindex-adaptive prefix (replayed; run for real and checked
    against the replay on the first ``--sc-real`` problems)."""
    from eval.serving.certaindex.answers import answers_equal
    from eval.serving.certaindex.backends import Sampling
    from eval.serving.certaindex.sc import replay, run_sc

    def arm(r, seconds: float) -> dict:
        return {**r.to_dict(), "correct": answers_equal(r.answer, p.answer), "seconds": seconds}

    prompt = backend.chat_format(p.prompt_text())
    kwargs = dict(max_samples=args.sc_samples, step=args.sc_step, max_tokens=args.sc_max_tokens,
                  sampling=Sampling(args.temperature, args.top_p, args.seed + 1000 * i))  # fmt: skip
    t = time.perf_counter()
    whole = run_sc(backend, prompt, threshold=None, **kwargs)
    full = arm(whole, time.perf_counter() - t)
    replayed = replay(whole, args.sc_step, args.sc_threshold)
    seconds = float("nan")
    if i < args.sc_real:
        t = time.perf_counter()
        real = run_sc(backend, prompt, threshold=args.sc_threshold, **kwargs)
        seconds = time.perf_counter() - t
        if real.to_dict() != replayed.to_dict():
            raise AssertionError(f"{p.id}: adaptive SC differs from the replay of the full run")
    print(
        f"sc {p.id}: ref {p.answer} | full {whole.answer!r} {whole.tokens} tok | "
        f"adaptive {replayed.answer!r} {replayed.tokens} tok ({len(replayed.answers)} samples)",
        flush=True,
    )
    return {"sc_full": full, "sc_adaptive": {**arm(replayed, seconds), "real_run": i < args.sc_real}}


def cot_rows(records: list[dict], args) -> list[dict]:
    full, early = [r["cot_full"] for r in records], [r["cot_early"] for r in records]
    rows = [
        _arm(f"CoT full budget ({args.cot_max_tokens})", full),
        _arm(f"CoT early exit ({args.preset})", early, full),
    ]
    rows[1]["early_exit_rate"] = sum(r["exited_early"] for r in early) / len(early)
    rows[1]["probe_token_share"] = sum(r["probe_tokens"] for r in early) / max(
        1, sum(r["tokens"] for r in early)
    )
    return rows


def sc_rows(records: list[dict], args) -> list[dict]:
    full, adaptive = [r["sc_full"] for r in records], [r["sc_adaptive"] for r in records]
    rows = [_arm(f"SC full budget ({args.sc_samples} samples)", full),
            _arm(f"SC certaindex >= {args.sc_threshold}", adaptive, full)]  # fmt: skip
    real = [r["seconds"] for r in adaptive if r["real_run"]]
    rows[1]["median_seconds"] = statistics.median(real) if real else None
    rows[1]["mean_samples"] = statistics.fmean(r["samples"] for r in adaptive)
    return rows + sc_calibrated_rows(records, args) if len(records) >= 2 else rows


def sc_calibrated_rows(records: list[dict], args) -> list[dict]:
    """The threshold ``sc.calibrate`` picks on the first half of the problems (full-budget accuracy minus one
    point), applied to the second half: the issue's calibrate-then-deploy use, without extra generation."""
    from eval.serving.certaindex.answers import answers_equal
    from eval.serving.certaindex.sc import ScResult, calibrate, replay

    half = len(records) // 2
    dev, test = records[:half], records[half:]
    best, _ = calibrate(
        [ScResult.from_dict(r["sc_full"]) for r in dev], [r["reference"] for r in dev], args.sc_step
    )
    full = [r["sc_full"] for r in test]
    chosen = []
    for r in test:
        result = replay(ScResult.from_dict(r["sc_full"]), args.sc_step, best.threshold)
        chosen.append(
            {**result.to_dict(), "correct": answers_equal(result.answer, r["reference"]), "seconds": 0.0}
        )
    label = "full" if best.threshold is None else f">= {best.threshold}"
    rows = [_arm(f"SC full, test half ({len(test)})", full),
            _arm(f"SC dev-calibrated {label}, test half", chosen, full)]  # fmt: skip
    rows[1]["median_seconds"] = None
    rows[1]["mean_samples"] = statistics.fmean(r["samples"] for r in chosen)
    rows[1]["dev_threshold"] = best.threshold
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'arm':<32} {'acc':>6} {'mean tok':>9} {'median tok':>10} {'ratio':>6} {'lost':>4} {'gain':>4} {'med s':>7}"
    )
    for r in rows:
        ratio = f"{r['token_ratio']:.2f}" if "token_ratio" in r else "1.00"
        secs = f"{r['median_seconds']:.1f}" if r.get("median_seconds") is not None else "-"
        print(f"{r['arm']:<32} {r['accuracy']:6.3f} {r['mean_tokens']:9.1f} {r['median_tokens']:10.1f} {ratio:>6} "
              f"{r.get('lost', '-'):>4} {r.get('gained', '-'):>4} {secs:>7}")  # fmt: skip


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], epilog=EPILOG)
    parser.add_argument(
        "model", nargs="?", type=existing_path, default=str(model_dir()), help="default: SmolLM2"
    )
    add_dtype(parser, "float32", ("float32", "bfloat16"))
    add_limit(parser, 16, "generated problems")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the generated problems")
    add_seed(parser)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--preset", default="crazy", help="CoT exit preset (W, chunk)")
    parser.add_argument("--cot-max-tokens", type=int, default=256)
    parser.add_argument("--sc-samples", type=int, default=8)
    parser.add_argument("--sc-step", type=int, default=2)
    parser.add_argument("--sc-threshold", type=float, default=0.8)
    parser.add_argument("--sc-max-tokens", type=int, default=128)
    parser.add_argument(
        "--sc-real", type=int, default=2, help="problems whose adaptive SC also runs for real"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; on a shared, oversubscribed CPU one thread avoids spinning OpenMP barriers",
    )
    parser.add_argument("--skip-cot", action="store_true")
    parser.add_argument("--skip-sc", action="store_true")
    add_out(
        parser,
        "out/bench/certaindex.json",
        help="rows and options as JSON; per-problem records go to OUT with suffix .jsonl (resumable)",
    )
    return parser


def bench(args) -> None:

    import torch

    from eval.serving.certaindex.data import arithmetic
    from eval.serving.certaindex.hf_backend import HFBackend
    from eval.serving.certaindex.records import run_resumable
    from toolkit.artifacts import write_json_atomic

    torch.set_num_threads(args.threads)
    backend = HFBackend.from_pretrained(args.model, args.dtype)
    problems = arithmetic(args.limit, args.data_seed)
    arms = [arm for arm, skip in (((solve_cot, cot_rows), args.skip_cot), ((solve_sc, sc_rows), args.skip_sc))
            if not skip]  # fmt: skip
    index = {p.id: i for i, p in enumerate(problems)}

    def solve(p) -> dict:
        return {k: v for solve_one, _ in arms for k, v in solve_one(backend, p, index[p.id], args).items()}

    # --limit only cuts the seeded problem list (problem i and its seeds do not depend on it), so it stays
    # out of the resume header: rerun with fewer problems to summarize an interrupted run's finished ones.
    options = {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "limit")
    }
    records = run_resumable(problems, solve, args.out.with_suffix(".jsonl"), options)
    rows = [row for _, make_rows in arms for row in make_rows(records, args)]
    print_table(rows)
    write_json_atomic(
        args.out, {"rows": rows, "options": {**options, "limit": args.limit, "out": str(args.out)}}
    )


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
