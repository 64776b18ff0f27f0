"""Command line of the cluster planner: ``plan``, ``launch-configs``, ``trace``, ``simulate``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from toolkit.cliargs import (
    ArgumentParser,
    add_force,
    add_limit,
    add_model,
    add_out,
    add_seed,
    command_parser,
    run,
)

EPILOG = """examples:
  swiftkv cluster plan cluster/cluster cluster/jobs --out plan.json        # shipped names (`swiftkv recipes`)
  swiftkv cluster launch-configs plan.json --out launch/
  swiftkv cluster trace cluster/cluster --out trace.csv --limit 160 --hours 8 --seed 0
  swiftkv cluster simulate cluster/cluster trace.csv --policy sia,gavel,fifo \\
      --round 60 --out sim/
"""


def _plan(args: argparse.Namespace) -> None:
    from toolkit.artifacts import write_json_atomic

    from .plan import plan
    from .spec import load_cluster, load_jobs

    cluster = load_cluster(args.cluster)
    result = plan(cluster, load_jobs(args.jobs, cluster), args.explore, args.time_limit)
    for e in result["jobs"]:
        where = " ".join(
            f"{h}:{','.join(map(str, g))}" for h, g in zip(e["hosts"], e["placement"].values(), strict=True)
        )
        print(f"{e['name']:<28} {e['gpus']:>3} x {e['gpu_type']:<8} ZeRO-{e['zero_stage']}  {where}")
    if result["unallocated"]:
        print("waiting:", ", ".join(result["unallocated"]))
    write_json_atomic(args.out, result)
    print(f"wrote {args.out} (policy {result['policy_runtime_s'] * 1e3:.1f} ms)")


def _launch(args: argparse.Namespace) -> None:
    from .launch import write_launch_configs

    dirs = write_launch_configs(json.loads(args.plan.read_text()), args.out, force=args.force)
    print(f"wrote {len(dirs)} job folders under {args.out}")


def _trace(args: argparse.Namespace) -> None:
    from .spec import load_cluster
    from .trace import generate_trace, write_trace

    jobs = generate_trace(load_cluster(args.cluster), args.limit, args.hours, args.seed)
    write_trace(args.out, jobs)
    print(f"wrote {len(jobs)} jobs to {args.out}")


def _simulate(args: argparse.Namespace) -> None:
    from toolkit.artifacts import write_json_atomic

    from .simulator import get_policy, simulate
    from .spec import load_cluster
    from .trace import read_trace

    cluster = load_cluster(args.cluster)
    trace = read_trace(args.trace, cluster)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for p in policies:
        get_policy(p)  # refuse unknown names before any work
    results = [simulate(cluster, trace, p, args.round, args.max_rounds, progress=True) for p in policies]
    table = {r.policy: r.metrics() for r in results}
    cols = list(next(iter(table.values())))
    print(f"{'policy':<8}" + "".join(f"{c:>18}" for c in cols))
    for p, m in table.items():
        print(f"{p:<8}" + "".join(f"{m[c]:>18.3f}" for c in cols))
    if args.out:
        from .plot import plot_results

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            out / "metrics.json", {"round_s": args.round, "trace": str(args.trace), "policies": table}
        )
        plot_results(results, out / "jct.png")
        print(f"wrote {out / 'metrics.json'} and {out / 'jct.png'}")


def build_parser() -> ArgumentParser:
    ap, sub = command_parser(
        "swiftkv cluster",
        "Sia-style heterogeneity-aware, goodput-optimized planning of distillation jobs.",
        EPILOG,
    )
    commands = {
        "plan": (_plan, "allocate and place jobs for the coming round"),
        "launch-configs": (_launch, "accelerate/DeepSpeed configs per planned job"),
        "trace": (_trace, "generate a seeded synthetic (Philly-like) trace CSV"),
        "simulate": (_simulate, "replay a trace under policies; JCT table and plot"),
    }
    p = {}
    for name, (func, text) in commands.items():
        p[name] = sub.add_parser(name, help=text, description=text)
        p[name].set_defaults(func=func)
    p["plan"].add_argument(
        "cluster", help="cluster.yaml (GPU types, nodes, GPUs per node, memory), or a shipped name"
    )
    p["plan"].add_argument(
        "jobs", help="jobs.yaml (recipes, model sizes, measured throughputs, placement), or a shipped name"
    )
    add_out(p["plan"], "plan.json", help="plan JSON to write (default plan.json)")
    p["plan"].add_argument(
        "--explore", type=int, default=2, help="max GPUs = this x largest measured (default 2)"
    )
    p["plan"].add_argument("--time-limit", type=float, default=10.0, help="solver time limit, s (default 10)")
    add_model(p["launch-configs"], "plan", help="plan.json written by `plan`")
    add_out(p["launch-configs"], help="output folder (one sub-folder per job)")
    add_force(p["launch-configs"])
    p["trace"].add_argument("cluster", help="cluster.yaml (type names and tflops), or a shipped name")
    add_out(p["trace"], help="trace CSV to write")
    add_limit(p["trace"], 160, "number of jobs")
    p["trace"].add_argument("--hours", type=float, default=8.0, help="arrival window (default 8)")
    add_seed(p["trace"])
    p["simulate"].add_argument("cluster", help="cluster.yaml, or a shipped name")
    add_model(p["simulate"], "trace", help="trace CSV (from `trace`)")
    p["simulate"].add_argument("--policy", default="sia,gavel,fifo", help="comma-separated: sia, gavel, fifo")
    p["simulate"].add_argument("--round", type=float, default=60.0, help="round length, s (default 60)")
    p["simulate"].add_argument("--max-rounds", type=int, default=None, help="stop after this many rounds")
    add_out(p["simulate"], help="folder for metrics.json and jct.png", required=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    return run(lambda args: args.func(args), build_parser(), argv)
