"""Choose the ranking proxy's aging constant in the simulator of vLLM's priority scheduler.

Sustained overload: ``--requests`` held-out requests (sampled with replacement, their recorded lengths) arrive as
a Poisson process at ``--rate-x`` times FCFS's saturated request rate; FCFS, the ranker without aging and the
ranker with each ``--aging`` constant (seconds of waiting worth one unit of predicted log length) run on the same
requests and arrival times, per seed.  The scheduler is vLLM's (``SimConfig(preemption="memory")``: running
requests stay, waiting ones are admitted by priority, KV evictions recompute) with the benchmark server's budget,
batch cap and KV cache, or ``--kv-capacity 0`` for unlimited memory (no recompute) to show what recompute
preemption adds.  The chosen constant has the lowest mean latency among those whose worst latency is within
``--bound`` times FCFS's in every seed.  No server runs: a quality measurement, not a timing one.

    .venv/bin/python scripts/bench_rank_aging.py out/ranker-ngram-all out/sg-heldout --cost-model cost.json \\
        --requests 600 --seeds 0,1,2,3,4 --agings 15,30,60,120,240,480 --out out/bench/rank-aging.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.cliargs import ArgumentParser, add_out, existing_path, float_list, int_list, run  # noqa: E402

# the 2026-12-04 calibration of the benchmark's vLLM CPU server (docs/results/ranking.md): decode steps of
# 36-52 ms at batch 1-16, 1.5 ms a prompt token
SERVER_COST = {"base": 0.0349, "prefill_token": 0.0015, "decode_token": 0.001067}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="scripts/bench_rank_aging.py", description=__doc__)
    p.add_argument("ranker", type=existing_path, help="ranker directory (the proxy's)")
    p.add_argument(
        "traces", type=existing_path, help="traces the ranker was not trained on (e.g. held-out records)"
    )
    p.add_argument(
        "--cost-model", type=existing_path, help="cost-model JSON (default: the 2026-12-04 server's)"
    )
    p.add_argument("--rate-x", type=float, default=1.3, help="multiple of FCFS's saturated request rate")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--seeds", type=int_list, default=[0, 1, 2, 3, 4])
    p.add_argument("--agings", type=float_list, default=[15, 30, 60, 120, 240, 480], help="aging_s values")
    p.add_argument("--bound", type=float, default=2.0, help="worst latency allowed, in FCFS's worst")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-capacity", type=int, default=3584, help="KV tokens (0: unlimited, no recompute)")
    p.add_argument("--preemption", choices=["memory", "priority"], default="memory",
                   help="memory: vLLM's scheduler; priority: the paper's, re-ranked every iteration")  # fmt: skip
    add_out(p)
    return p


def table(rows: list[dict]) -> list[str]:
    """Per arm: mean over seeds of mean / p99 / max latency and the worst max, beside FCFS's."""
    import numpy as np

    lines = ["| arm | mean s | p99 s | max s (mean of seeds) | worst max s | worst max / FCFS's (same seed) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    fcfs = {r["seed"]: r["max_s"] for r in rows if r["policy"] == "fcfs"}
    arms = dict.fromkeys((r["policy"], r["aging_s"]) for r in rows)
    for policy, aging in arms:
        got = [r for r in rows if (r["policy"], r["aging_s"]) == (policy, aging)]
        name = policy if policy == "fcfs" else "ranker" + (f", aging {aging:g} s" if aging else ", no aging")
        mean = {k: float(np.mean([r[k] for r in got])) for k in ("mean_s", "p99_s", "max_s")}
        ratio = max(r["max_s"] / fcfs[r["seed"]] for r in got)
        lines.append(f"| {name} | {mean['mean_s']:.1f} | {mean['p99_s']:.0f} | {mean['max_s']:.0f} | "
                     f"{max(r['max_s'] for r in got):.0f} | {ratio:.2f}x |")  # fmt: skip
    return lines


def _command(args) -> str:
    import numpy as np

    from eval.serving.ranking.simulator import CostModel, SimConfig, aging_sweep, choose_aging
    from eval.serving.ranking.train import held_out_traces, load_ranker
    from toolkit.artifacts import write_json_atomic

    traces = held_out_traces(args.ranker, args.traces, "all")
    scores = load_ranker(args.ranker, args.traces).score([t.prompt for t in traces])
    cost = CostModel.load(args.cost_model) if args.cost_model else CostModel.from_dict(SERVER_COST)
    config = SimConfig(
        args.max_num_batched_tokens,
        args.max_num_seqs,
        10**9,
        1,
        args.kv_capacity or None,
        preemption=args.preemption,
    )  # fmt: skip  (no paper guard: vLLM has none)
    start = time.time()
    rows = aging_sweep(np.array([t.prompt_len for t in traces]), np.array([t.output_len for t in traces]), scores,
                       args.agings, args.rate_x, args.requests, cost, config, args.seeds)  # fmt: skip
    chosen = choose_aging(rows, args.bound)
    said = "none holds it" if chosen is None else f"{chosen:g}"
    lines = table(rows) + [
        f"chosen aging_s: {said} (the lowest mean with worst latency <= {args.bound:g}x FCFS's)"
    ]
    meta = {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "cost_model": cost.__dict__,
            "config": config.__dict__, "traces": len(traces), "sim_s": time.time() - start, "chosen_aging_s": chosen}  # fmt: skip
    write_json_atomic(args.out, {"meta": meta, "rows": rows, "table": lines})
    return "\n".join(lines) + f"\nwrote {args.out} ({meta['sim_s']:.0f} s of simulation)"


def main(argv: list[str] | None = None) -> int:
    return run(_command, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
