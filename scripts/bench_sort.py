"""Multi-pivot quicksort table: counted comparisons/swaps/cache misses against theory, and compiled timings.

Counts come from the pure-Python path on random keys; theory is the exact cost recurrence of
``eval.serving.ranking.multipivot.expected_comparisons`` (same cutoff) and the literature's leading constants.
Timings use the numba path (all three sort by (key, position), like the scheduler), interleaved A/B
repeats, medians, against numpy's argsort measured in the same run.

  python scripts/bench_sort.py --out out/bench_sort.json
  python scripts/bench_sort.py --count-n 100000 --cache-n 65536 --time-n 1000000 --repeats 9
"""

from __future__ import annotations

import json
import math
import statistics
import time

import numpy as np

from eval.serving.ranking import multipivot as mp
from toolkit.cliargs import ArgumentParser, add_out, add_seed, run


def count_table(n: int, cache_n: int, block: int, blocks: int, cutoff: int, seed: int) -> list[dict]:
    keys = np.random.default_rng(seed).random(n)
    cache_keys = np.random.default_rng(seed + 1).random(cache_n)
    nlogn = n * math.log(n)
    miss_unit = (cache_n + 1) / block * math.log(cache_n / (block * blocks))
    rows = []
    for k in mp.PIVOTS:
        _, stats = mp.count_costs(keys, k, cutoff)
        _, cached = mp.count_costs(cache_keys, k, cutoff, cache=(block, blocks))
        lead_cmp, lead_swap, lead_miss = mp.LITERATURE[k]
        rows.append(
            {
                "pivots": k,
                "comparisons_per_nlnn": stats.comparisons / nlogn,
                "recurrence_per_nlnn": mp.expected_comparisons(n, k, cutoff) / nlogn,
                "literature_comparisons": lead_cmp,
                "swaps_per_nlnn": stats.swaps / nlogn,
                "literature_swaps": lead_swap,
                "misses_per_unit": cached.cache_misses / miss_unit,
                "literature_misses": lead_miss,
            }
        )
    return rows


def time_table(n: int, repeats: int, cutoff: int, seed: int) -> dict[str, float]:
    keys = np.random.default_rng(seed).random(n)
    expected = np.argsort(keys, kind="stable")
    runs = {
        "1-pivot": lambda: mp.argsort(keys, 1, cutoff),
        "2-pivot": lambda: mp.argsort(keys, 2, cutoff),
        "3-pivot": lambda: mp.argsort(keys, 3, cutoff),
        "numpy quicksort": lambda: np.argsort(keys, kind="quicksort"),
        "numpy stable": lambda: np.argsort(keys, kind="stable"),
    }
    for name, contender in runs.items():  # warm-up (numba compile) and a correctness check
        if "pivot" in name:
            assert np.array_equal(contender(), expected), name
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved: each repeat runs every contender once
        for name, contender in runs.items():
            start = time.perf_counter()
            contender()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--count-n", type=int, default=100_000)
    parser.add_argument("--cache-n", type=int, default=65_536, help="size of the LRU-simulated sort (slow)")
    parser.add_argument("--block", type=int, default=16, help="elements per cache block")
    parser.add_argument("--blocks", type=int, default=64, help="blocks in the simulated cache")
    parser.add_argument("--time-n", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cutoff", type=int, default=16, help="insertion sort below this size")
    add_seed(parser)
    add_out(parser, help="write the tables as JSON", required=False)
    return parser


def bench(args) -> None:

    rows = count_table(args.count_n, args.cache_n, args.block, args.blocks, args.cutoff, args.seed)
    print(
        f"counts on random keys, n={args.count_n} (cache: n={args.cache_n}, B={args.block}, M={args.block * args.blocks})"
    )
    print("pivots | cmp/nlnn | recurrence | lit. | swaps/nlnn | lit. | misses/((n+1)/B ln(n/M)) | lit.")
    for r in rows:
        print(
            f"{r['pivots']} | {r['comparisons_per_nlnn']:.3f} | {r['recurrence_per_nlnn']:.3f} | "
            f"{r['literature_comparisons']:.3f} | {r['swaps_per_nlnn']:.3f} | {r['literature_swaps']:.3f} | "
            f"{r['misses_per_unit']:.3f} | {r['literature_misses']:.3f}"
        )
    timing = time_table(args.time_n, args.repeats, args.cutoff, args.seed)
    base = timing["2-pivot"]
    print(f"\ncompiled argsort, n={args.time_n}, median of {args.repeats} interleaved repeats")
    print("sort | median s | vs 2-pivot | vs numpy quicksort")
    for name, t in timing.items():
        print(f"{name} | {t:.4f} | {t / base:.3f} | {t / timing['numpy quicksort']:.3f}")
    if args.out:
        from toolkit.artifacts import write_json_atomic

        write_json_atomic(args.out, {"args": vars(args), "counts": rows, "timing_s": timing})
        print(json.dumps({"written": str(args.out)}))


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
