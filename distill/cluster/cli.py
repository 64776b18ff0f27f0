"""Command line of the cluster planner: ``plan``, ``launch-configs``, ``trace``, ``simulate``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EPILOG = """examples:
  python -m distill.cluster plan recipes/cluster/cluster.yaml recipes/cluster/jobs.yaml --out plan.json
  python -m distill.cluster launch-configs plan.json launch/
  python -m distill.cluster trace recipes/cluster/cluster.yaml trace.csv --jobs 160 --hours 8 --seed 0
  python -m distill.cluster simulate recipes/cluster/cluster.yaml trace.csv --policy sia,gavel,fifo \\
      --round 60 --out sim/
"""


def _plan(args: argparse.Namespace) -> None:
    from swiftkv.artifacts import write_json_atomic

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

    path = Path(args.plan)
    if not path.is_file():
        raise ValueError(f"{path}: no such plan; to resolve, run `python -m distill.cluster plan` first")
    dirs = write_launch_configs(json.loads(path.read_text()), args.out, force=args.force)
    print(f"wrote {len(dirs)} job folders under {args.out}")


def _trace(args: argparse.Namespace) -> None:
    from .spec import load_cluster
    from .trace import generate_trace, write_trace

    jobs = generate_trace(load_cluster(args.cluster), args.jobs, args.hours, args.seed)
    write_trace(args.out, jobs)
    print(f"wrote {len(jobs)} jobs to {args.out}")


def _simulate(args: argparse.Namespace) -> None:
    from swiftkv.artifacts import write_json_atomic

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


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        prog="python -m distill.cluster",
        description="Sia-style heterogeneity-aware, goodput-optimized planning of distillation jobs.",
        epilog=EPILOG,
        formatter_class=fmt,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    commands = {
        "plan": (_plan, "allocate and place jobs for the coming round"),
        "launch-configs": (_launch, "accelerate/DeepSpeed configs per planned job"),
        "trace": (_trace, "generate a seeded synthetic (Philly-like) trace CSV"),
        "simulate": (_simulate, "replay a trace under policies; JCT table and plot"),
    }
    p = {}
    for name, (func, text) in commands.items():
        p[name] = sub.add_parser(name, help=text, description=text, epilog=EPILOG, formatter_class=fmt)
        p[name].set_defaults(func=func)
    p["plan"].add_argument("cluster", help="cluster.yaml (GPU types, nodes, GPUs per node, memory)")
    p["plan"].add_argument("jobs", help="jobs.yaml (recipes, model sizes, measured throughputs, placement)")
    p["plan"].add_argument("--out", default="plan.json", help="plan JSON to write (default plan.json)")
    p["plan"].add_argument(
        "--explore", type=int, default=2, help="max GPUs = this x largest measured (default 2)"
    )
    p["plan"].add_argument("--time-limit", type=float, default=10.0, help="solver time limit, s (default 10)")
    p["launch-configs"].add_argument("plan", help="plan.json written by `plan`")
    p["launch-configs"].add_argument("out", help="output folder (one sub-folder per job)")
    p["launch-configs"].add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p["trace"].add_argument("cluster", help="cluster.yaml (type names and tflops)")
    p["trace"].add_argument("out", help="trace CSV to write")
    p["trace"].add_argument("--jobs", type=int, default=160, help="number of jobs (default 160)")
    p["trace"].add_argument("--hours", type=float, default=8.0, help="arrival window (default 8)")
    p["trace"].add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p["simulate"].add_argument("cluster", help="cluster.yaml")
    p["simulate"].add_argument("trace", help="trace CSV (from `trace`)")
    p["simulate"].add_argument("--policy", default="sia,gavel,fifo", help="comma-separated: sia, gavel, fifo")
    p["simulate"].add_argument("--round", type=float, default=60.0, help="round length, s (default 60)")
    p["simulate"].add_argument("--max-rounds", type=int, default=None, help="stop after this many rounds")
    p["simulate"].add_argument("--out", default=None, help="folder for metrics.json and jct.png")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
