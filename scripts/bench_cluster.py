"""Benchmark of the Sia planner in the round-based simulator (numbers for the report, not a test).

1. 64-GPU heterogeneous cluster (recipes/cluster/cluster.yaml), seeded 160-job synthetic traces: average and
   p99 JCT, makespan, GPU-hours of Sia vs the baselines (Pollux-like elastic, Gavel with per-job tuned sizes,
   Gavel with the users' requests, FIFO; every re-allocation pays the job's restart cost), policies run back to
   back per seed; the ratio is Sia's average JCT reduction against the best baseline of the same seed, median
   over seeds.
2. Policy runtime: the same cluster and trace scaled 32x (2048 GPUs, 5120 jobs, same load per GPU), Sia for
   ``--rounds-2048`` rounds; median over the second half of the rounds (steady state, not the empty start).

    flock /tmp/bench.lock python scripts/bench_cluster.py --seeds 0 1 2 --out bench_cluster.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from distill.cluster import simulator
from distill.cluster.sia import goodput_matrix, solve
from distill.cluster.simulator import simulate
from distill.cluster.spec import Cluster, load_cluster
from distill.cluster.trace import generate_trace
from toolkit.cliargs import ArgumentParser, add_limit, add_out, existing_path, run

POLICIES = ("sia", "pollux", "gavel-tuned", "gavel", "fifo")
BASELINES = POLICIES[1:]


def scaled(cluster: Cluster, factor: int) -> Cluster:
    return Cluster(gpu_types=[t.model_copy(update={"nodes": t.nodes * factor}) for t in cluster.gpu_types])


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("cluster", nargs="?", type=existing_path, default="recipes/cluster/cluster.yaml")
    add_limit(ap, 160, "jobs per trace")
    ap.add_argument("--hours", type=float, default=8.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--round", type=float, default=60.0)
    ap.add_argument("--scale", type=int, default=32, help="cluster/trace multiplier for the runtime test")
    ap.add_argument("--rounds-2048", type=int, default=120)
    ap.add_argument("--time-limit", type=float, default=1.0, help="HiGHS time limit per round (s)")
    ap.add_argument("--skip-jct", action="store_true", help="only the 2048-GPU runtime test")
    add_out(ap, "bench_cluster.json")
    return ap


def bench(args) -> None:

    cluster = load_cluster(args.cluster)
    rows: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    reductions: list[float] = []
    for seed in [] if args.skip_jct else args.seeds:
        trace = generate_trace(cluster, args.limit, args.hours, seed)
        per_seed = {}
        for policy in POLICIES:  # interleaved: every seed runs all policies back to back
            t0 = time.perf_counter()
            m = simulate(cluster, trace, policy, args.round).metrics()
            m["sim_s"] = time.perf_counter() - t0
            rows[policy].append(m)
            per_seed[policy] = m
        best = min(per_seed[p]["avg_jct_h"] for p in BASELINES)
        reductions.append(1 - per_seed["sia"]["avg_jct_h"] / best)
        print(
            f"seed {seed}: "
            + ", ".join(f"{p} {per_seed[p]['avg_jct_h']:.3f} h" for p in POLICIES)
            + f"  -> Sia {100 * reductions[-1]:.1f}% lower than best baseline"
        )

    cols = ["avg_jct_h", "p99_jct_h", "makespan_h", "gpu_hours", "policy_ms_median", "policy_ms_max"]
    med = {p: {c: float(np.median([r[c] for r in rows[p]])) for c in cols} for p in POLICIES}
    print(
        f"\n{cluster.total_gpus} GPUs, {args.limit} jobs, {args.hours} h arrivals, seeds {args.seeds} (medians)"
    )
    print(f"{'policy':<8}" + "".join(f"{c:>18}" for c in cols) + f"{'avg JCT vs sia':>16}")
    for p in POLICIES:
        ratio = med[p]["avg_jct_h"] / med["sia"]["avg_jct_h"]
        print(f"{p:<8}" + "".join(f"{med[p][c]:>18.3f}" for c in cols) + f"{ratio:>15.2f}x")
    strongest = min(BASELINES, key=lambda p: med[p]["avg_jct_h"]) if reductions else None
    print(
        f"Sia average-JCT reduction vs the best baseline of each seed: median {100 * np.median(reductions):.1f}% "
        f"(per seed {[round(100 * r, 1) for r in reductions]}); strongest baseline by median: {strongest}"
    )

    big = scaled(cluster, args.scale)
    trace = generate_trace(big, args.limit * args.scale, args.hours, args.seeds[0])
    stats: list[tuple[int, float | None]] = []

    def sia_recorded(jobs, cl):  # the Sia policy, also recording job count and HiGHS's final gap
        problem = goodput_matrix(jobs, cl)
        choice = solve(problem, cl, time_limit_s=args.time_limit)
        stats.append((len(jobs), problem.mip_gap))
        return {s.name: None if j is None else problem.configs[j] for s, j in zip(jobs, choice, strict=True)}

    simulator.POLICIES["sia-recorded"] = sia_recorded
    res = simulate(big, trace, "sia-recorded", args.round, max_rounds=args.rounds_2048, progress=True)
    half = len(res.policy_runtime_s) // 2
    steady, steady_stats = res.policy_runtime_s[half:], stats[half:]
    runtime = {
        "gpus": big.total_gpus,
        "rounds_measured": f"{half}..{len(res.policy_runtime_s)}",
        "median_s": float(np.median(steady)),
        "p90_s": float(np.percentile(steady, 90)),
        "max_s": float(np.max(steady)),
        "median_active_jobs": float(np.median([n for n, _ in steady_stats])),
        "time_limit_s": args.time_limit,
        "rounds_at_time_limit": int(sum(t >= args.time_limit for t in steady)),
        "max_final_gap": float(max(g or 0.0 for _, g in steady_stats)),
        "gpus_allocated_last_round": sum(res.usage[-1][1].values()),
    }
    print(
        f"\nSia policy runtime at {big.total_gpus} GPUs, rounds {runtime['rounds_measured']} "
        f"(median {runtime['median_active_jobs']:.0f} active jobs, {runtime['gpus_allocated_last_round']} GPUs "
        f"allocated at the end): median {runtime['median_s']:.3f} s, p90 {runtime['p90_s']:.3f} s, "
        f"max {runtime['max_s']:.3f} s; {runtime['rounds_at_time_limit']} rounds stopped at the "
        f"{args.time_limit} s solver limit, worst final gap {100 * runtime['max_final_gap']:.3f}%"
    )
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "medians": med,
                "per_seed": rows,
                "reductions": reductions,
                "runtime_2048": runtime,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
