"""Ranking benchmark: Kendall's tau of both predictors and the bucket baseline, and simulated SJF latency.

Per split seed (a different held-out split each), trains the swiftkv-head with ListMLE and as a bucket
classifier, and (for the first ``--small-lm-seeds`` seeds, it is slow on a CPU) the small LM; reports the
median tau and its ratio to the bucket baseline of the same kind.  Then simulates FCFS / LTR (first
seed's swiftkv-head and small LM) / oracle on the held-out requests at offered loads given as multiples of
the cost model's decode capacity, interleaving the policies over arrival seeds and taking medians, in two
KV settings: unlimited memory with free preemption, and ``--kv-capacity`` tokens where a preempted request
loses its KV and prefills again (preemptive SJF pays for preempting; FCFS rarely does).

  python scripts/bench_ranking.py out/traces --work out/bench_ranking --out out/bench_ranking.json
  python scripts/bench_ranking.py out/traces --seeds 3 --small-lm-seeds 1 --small-lm-layers 8 \\
      --cost-model out/cost.json --loads 0.5,1,2
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from eval.serving.ranking.simulator import CostModel, SimConfig, kv_setting, run_policies
from eval.serving.ranking.train import (
    TrainConfig,
    evaluate_ranker,
    held_out_traces,
    load_ranker,
    train_ranker,
)
from toolkit.cliargs import ArgumentParser, add_model, add_out, existing_path, float_list, run


def tau_table(args) -> tuple[dict[str, list[dict]], dict[str, Path]]:
    kinds = {
        "swiftkv-head": dict(epochs=args.head_epochs),
        "small-lm": dict(
            epochs=args.small_lm_epochs, backbone_layers=args.small_lm_layers, lr=args.small_lm_lr
        ),
    }
    variants = {
        f"{kind} {objective}": dict(kind=kind, objective=objective, **options)
        for kind, options in kinds.items()
        for objective in ("listmle", "buckets")
    }
    taus: dict[str, list[dict]] = {name: [] for name in variants}
    first: dict[str, Path] = {}
    for seed in range(args.seeds):  # interleaved: every variant on the same split before the next split
        for name, options in variants.items():
            if options["kind"] == "small-lm" and seed >= args.small_lm_seeds:
                continue
            out = args.work / f"{name.replace(' ', '-')}-s{seed}"
            if not (out / "ranker.json").is_file():
                config = TrainConfig(
                    seed=seed,
                    max_prompt_tokens=args.max_prompt_tokens,
                    list_size=args.list_size,
                    held_out=args.held_out,
                    **options,
                )
                train_ranker(args.traces, out, config, force=True)
            taus[name].append(evaluate_ranker(out, args.traces))
            first.setdefault(name, out)
            print(f"seed {seed} {name}: tau {taus[name][-1]['kendall_tau']:.3f}", flush=True)
    return taus, first


def latency_table(args, rankers: dict[str, Path]) -> list[dict]:
    """Median latency per policy, load and KV setting: unlimited memory with free preemption, then
    ``--kv-capacity`` tokens with recompute on preemption; ratios are against FCFS of the same setting."""
    cost = CostModel.load(args.cost_model) if args.cost_model else CostModel()
    traces = held_out_traces(next(iter(rankers.values())), args.traces)
    prompt_len = np.array([t.prompt_len for t in traces])
    output_len = np.array([t.output_len for t in traces])
    scores = {
        name: load_ranker(path, args.traces).score([t.prompt for t in traces])
        for name, path in rankers.items()
    }
    # capacity (req/s): a request's share of full-batch decode iterations plus its prefill tokens
    per_request = output_len.mean() * cost.iteration(0, args.max_batch) / args.max_batch
    capacity = 1.0 / (per_request + cost.prefill_token * prompt_len.mean())
    policies = [("fcfs", scores[next(iter(scores))]), *scores.items(), ("oracle", -output_len)]
    rows = []
    for kv in (None, args.kv_capacity):
        config = SimConfig(args.token_budget, args.max_batch, kv_capacity=kv)
        for load in args.loads:
            rate = load * capacity
            runs: dict[str, list] = {}
            for seed in range(args.sim_seeds):
                for name, score in policies:
                    policy = "fcfs" if name == "fcfs" else "oracle" if name == "oracle" else "ltr"
                    (r,) = run_policies(
                        prompt_len,
                        output_len,
                        np.asarray(score, float),
                        [rate],
                        [policy],
                        args.requests,
                        cost,
                        config,
                        seed,
                    )
                    runs.setdefault(name, []).append(r)
            fcfs_mean = statistics.median(r.mean_latency_s for r in runs["fcfs"])
            fcfs_per_token = statistics.median(r.mean_latency_per_token_s for r in runs["fcfs"])
            for name, rs in runs.items():
                mean = statistics.median(r.mean_latency_s for r in rs)
                per_token = statistics.median(r.mean_latency_per_token_s for r in rs)
                rows.append(
                    {
                        "kv": kv_setting(kv),
                        "load": load,
                        "rate_req_s": rate,
                        "policy": name,
                        "mean_latency_s": mean,
                        "mean_latency_per_token_s": per_token,
                        "p90_latency_per_token_s": statistics.median(r.p90_latency_per_token_s for r in rs),
                        "throughput_tok_s": statistics.median(r.throughput_tok_s for r in rs),
                        "fcfs_over_policy_mean_latency": fcfs_mean / mean,
                        "fcfs_over_policy_mean_latency_per_token": fcfs_per_token / per_token,
                    }
                )
    return rows


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__)
    add_model(parser, "traces", help="traces directory (from `swiftkv ranking traces`)")
    parser.add_argument(
        "--work", type=Path, default=Path("out/bench_ranking"), help="trained rankers (reused)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="held-out splits for the swiftkv-head")
    parser.add_argument("--small-lm-seeds", type=int, default=1)
    parser.add_argument("--small-lm-layers", type=int, default=8)
    parser.add_argument("--small-lm-epochs", type=int, default=3)
    parser.add_argument("--small-lm-lr", type=float, default=1e-4)
    parser.add_argument("--head-epochs", type=int, default=30)
    parser.add_argument("--list-size", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--held-out", type=float, default=0.2, help="held-out fraction of each split")
    parser.add_argument("--cost-model", type=existing_path, help="JSON from `swiftkv ranking calibrate`")
    parser.add_argument("--loads", type=float_list, default=[0.5, 0.9, 1.5], help="offered load / capacity")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--sim-seeds", type=int, default=3)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument(
        "--kv-capacity",
        type=int,
        default=8192,
        help="KV tokens of the second simulated setting (recompute on preemption); the first is unlimited "
        "(8192 fp32 tokens of SmolLM2-135M are ~0.75 GiB)",
    )
    add_out(parser, help="write the tables as JSON", required=False)
    return parser


def bench(args) -> None:

    taus, rankers = tau_table(args)
    print(
        "\npredictor | median tau | splits | vs bucket baseline (same kind) | "
        "tie-free oracle tau | prompt-length tau | held-out at cap"
    )
    summary = {}
    for name, results in taus.items():
        if not results:
            continue
        values = [r["kendall_tau"] for r in results]
        base = [r["kendall_tau"] for r in taus[name.replace("listmle", "buckets")]]
        ratio = (
            statistics.median(values) / statistics.median(base)
            if base and statistics.median(base)
            else float("nan")
        )
        context = {
            key: statistics.median(r[key] for r in results)
            for key in ("tie_free_oracle_tau", "prompt_len_tau", "capped_fraction")
        }
        summary[name] = {
            "median_tau": statistics.median(values),
            "taus": values,
            "vs_buckets": ratio,
            **context,
        }
        print(
            f"{name} | {statistics.median(values):.3f} | {len(values)} | {ratio:.2f}x | "
            f"{context['tie_free_oracle_tau']:.3f} | {context['prompt_len_tau']:.3f} | "
            f"{context['capped_fraction']:.0%}"
        )
    listmle = {name: path for name, path in rankers.items() if "listmle" in name}
    rows = latency_table(args, listmle)
    print(f"\nsimulated serving (median of {args.sim_seeds} arrival seeds, {args.requests} requests)")
    print(
        "KV | load | req/s | policy | mean lat s | mean s/token | p90 s/token | tok/s | "
        "FCFS/policy mean s/token | FCFS/policy mean lat"
    )
    for r in rows:
        print(
            f"{r['kv']} | {r['load']:g} | {r['rate_req_s']:.3f} | {r['policy']} | {r['mean_latency_s']:.1f} | "
            f"{r['mean_latency_per_token_s']:.3f} | {r['p90_latency_per_token_s']:.3f} | "
            f"{r['throughput_tok_s']:.1f} | {r['fcfs_over_policy_mean_latency_per_token']:.2f}x | "
            f"{r['fcfs_over_policy_mean_latency']:.2f}x"
        )
    if args.out:
        from toolkit.artifacts import write_json_atomic

        write_json_atomic(args.out, {"args": vars(args), "tau": summary, "latency": rows})
        print(json.dumps({"written": str(args.out)}))


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
