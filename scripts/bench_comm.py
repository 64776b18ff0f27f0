"""Benchmark: Bösen managed communication vs all-reduce and PowerSGD; AdaRevision vs tuned step sizes.

W CPU processes on gloo train the same small MLP student on a random-teacher regression task (each rank its
own data stream, a fixed held-out set).  Part 1: all-reduce runs ``--steps`` steps and its final held-out
loss is the target; every other hook runs until it reaches that loss (at most 3x the steps), and the table
reports the bytes per step and the bytes it sent until then against all-reduce's.  PowerSGD is compared at
equal bytes per step: for each ``--powersgd-ranks`` rank, a managed run gets the budget whose bytes per step
match that rank's measured steady-state bytes per step (``managed ~powersgd r=R``).  Part 2: with bounded staleness s, SGD with a
fixed or a 1/sqrt(t) step size over a grid of step sizes vs AdaRevision at one untuned step size; the table
reports the final held-out loss.  Repeats are interleaved over the configurations (one seed per repeat);
the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from distill.comm import AdaRevision, CommConfig, register_comm_hook
from toolkit.artifacts import write_json_atomic
from toolkit.cliargs import ArgumentParser, add_out, run

DIM, HIDDEN, OUT, BATCH = 32, 256, 8, 32


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


class Task:
    """y = teacher(x) + noise; rank-specific training batches, one held-out set."""

    def __init__(self, seed: int):
        self.teacher, self.seed = _mlp(10_000 + seed), seed
        gen = torch.Generator().manual_seed(20_000 + seed)
        self.eval_x = torch.randn(1024, DIM, generator=gen)
        with torch.no_grad():
            self.eval_y = self.teacher(self.eval_x)

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(hash((self.seed, rank, step)) & 0xFFFF_FFFF)
        x = torch.randn(BATCH, DIM, generator=gen)
        with torch.no_grad():
            return x, self.teacher(x) + 0.01 * torch.randn(BATCH, OUT, generator=gen)

    @torch.no_grad()
    def eval_loss(self, model: torch.nn.Module) -> float:
        return torch.nn.functional.mse_loss(model(self.eval_x), self.eval_y).item()


def train_one(task: Task, comm: CommConfig, make_opt, max_steps: int, target: float | None) -> dict:
    """Train until ``max_steps`` or until the held-out loss reaches ``target``; bytes and time to there."""
    ddp = DDP(_mlp(task.seed))
    state = register_comm_hook(ddp, comm)
    opt, sched = make_opt(list(ddp.parameters()))
    rank, t0, loss, step = dist.get_rank(), time.perf_counter(), float("nan"), 0
    for step in range(1, max_steps + 1):
        x, y = task.batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if sched:
            sched.step()
        if step % 10 == 0 or step == max_steps:
            loss = task.eval_loss(ddp.module)  # replicas are identical: every rank decides the same
            if target is not None and loss <= target:
                break
    return {
        "steps": step,
        "loss": loss,
        "reached": target is None or loss <= target,
        "bytes": state.bytes_sent,
        "step_bytes": state.last_step_bytes,  # steady state (PowerSGD's first steps are plain all-reduce)
        "seconds": time.perf_counter() - t0,
    }


def _sgd(lr: float, decay: bool = False, momentum: float = 0.0):
    def make(params):
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / math.sqrt(1 + t)) if decay else None
        return opt, sched

    return make


def _adarevision(lr: float, delay: int):
    return lambda params: (AdaRevision(params, lr=lr, delay=delay), None)


def matched_budget(payload_bytes: float, numel: int, block_size: int) -> float:
    """The managed (relative-magnitude) budget whose payload per step comes closest to ``payload_bytes``: it
    all-reduces one float32 score per block, then k blocks of float32 values."""
    blocks = math.ceil(numel / block_size)
    k = round((payload_bytes / 4 - blocks) / block_size)
    return min(blocks, max(1, k)) / blocks


def comm_configs(budgets: list[float]) -> list[tuple[str, CommConfig]]:
    """all-reduce, managed relative-magnitude at every budget, the other priorities at the first (the
    PowerSGD pairs are added by the worker, whose budgets depend on PowerSGD's measured bytes)."""
    out = [("allreduce", CommConfig())]
    for b in budgets:
        out.append((f"managed {b:g} relative-magnitude", CommConfig(hook="managed", budget=b)))
    for prio in ("magnitude", "random", "fifo"):
        out.append(
            (f"managed {budgets[0]:g} {prio}", CommConfig(hook="managed", budget=budgets[0], priority=prio))
        )
    return out


def stale_configs(s: int, grid: list[float], ada_lr: float) -> list[tuple[str, object]]:
    out = [(f"sgd fixed lr={lr:g}", _sgd(lr)) for lr in grid]
    out += [(f"sgd lr={lr:g}/sqrt(t)", _sgd(lr, decay=True)) for lr in grid]
    out += [(f"adagrad(no revision) lr={ada_lr:g}", _adarevision(ada_lr, 0))]
    return out + [(f"adarevision lr={ada_lr:g} (untuned)", _adarevision(ada_lr, s))]


def _worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    rows: list[dict] = []
    momentum_sgd = _sgd(args.lr, momentum=0.9)
    for rep in range(args.repeats):
        task = Task(seed=rep)
        base = train_one(task, CommConfig(), momentum_sgd, args.steps, None)
        rows.append({"part": "comm", "name": "allreduce", "repeat": rep, **base})
        for name, cfg in comm_configs(args.budgets)[1:]:
            res = train_one(task, cfg, momentum_sgd, 3 * args.steps, base["loss"])
            rows.append({"part": "comm", "name": name, "repeat": rep, **res})
        numel = sum(p.numel() for p in _mlp(0).parameters())
        for r in args.powersgd_ranks:
            cfg = CommConfig(hook="powersgd", powersgd_rank=r)
            res = train_one(task, cfg, momentum_sgd, 3 * args.steps, base["loss"])
            rows.append({"part": "comm", "name": f"powersgd r={r}", "repeat": rep, **res})
            ring = base["step_bytes"] / (4 * numel)  # wire bytes per payload byte, the same for every hook
            budget = matched_budget(res["step_bytes"] / ring, numel, CommConfig().block_size)
            cfg = CommConfig(hook="managed", budget=budget)
            res = train_one(task, cfg, momentum_sgd, 3 * args.steps, base["loss"])
            rows.append(
                {"part": "comm", "name": f"managed ~powersgd r={r}", "repeat": rep, "budget": budget, **res}
            )
        stale = CommConfig(staleness=args.staleness)
        for name, make in stale_configs(args.staleness, args.grid, args.ada_lr):
            rows.append(
                {
                    "part": "stale",
                    "name": name,
                    "repeat": rep,
                    **train_one(task, stale, make, args.steps, None),
                }
            )
        if rank == 0:
            print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def summarize(rows: list[dict]) -> dict:
    """Medians over repeats; byte ratios against all-reduce's bytes (all-reduce reaches its target at T)."""
    names = list(dict.fromkeys((r["part"], r["name"]) for r in rows))
    base = {r["repeat"]: r["bytes"] for r in rows if r["name"] == "allreduce"}
    table = []
    for part, name in names:
        mine = [r for r in rows if (r["part"], r["name"]) == (part, name)]
        entry = {
            "part": part,
            "name": name,
            "loss": statistics.median(r["loss"] for r in mine),
            "steps": statistics.median(r["steps"] for r in mine),
            "seconds": statistics.median(r["seconds"] for r in mine),
            "reached": sum(r["reached"] for r in mine),
            "repeats": len(mine),
        }
        if part == "comm":
            entry["kbytes_per_step"] = statistics.median(r["step_bytes"] for r in mine) / 1e3
            if "budget" in mine[0]:
                entry["name"] = f"{name} (budget {mine[0]['budget']:.3f})"
            entry["mbytes"] = statistics.median(r["bytes"] for r in mine) / 1e6
            entry["byte_ratio"] = statistics.median(r["bytes"] / base[r["repeat"]] for r in mine)
        table.append(entry)
    return {"rows": table}


def print_table(summary: dict, world: int, steps: int, staleness: int) -> None:
    print(
        f"\nPart 1: time to all-reduce's loss at {steps} steps, W={world} (reached = repeats that got there)"
    )
    print(
        f"{'config':44} {'KB/step':>8} {'steps':>6} {'MB sent':>9} {'vs allreduce':>12} {'seconds':>8} "
        f"{'reached':>8}"
    )
    for r in summary["rows"]:
        if r["part"] == "comm":
            print(
                f"{r['name']:44} {r['kbytes_per_step']:8.2f} {r['steps']:6.0f} {r['mbytes']:9.3f} "
                f"{r['byte_ratio']:12.3f} {r['seconds']:8.2f} {r['reached']:>4}/{r['repeats']}"
            )
    print(f"\nPart 2: held-out loss after {steps} steps with staleness s={staleness}, W={world}")
    stale = [r for r in summary["rows"] if r["part"] == "stale"]
    best = min(r["loss"] for r in stale if math.isfinite(r["loss"]))
    for r in stale:
        ratio = f"{r['loss'] / best:.2f}x best" if math.isfinite(r["loss"]) else "diverged"
        print(f"{r['name']:34} loss {r['loss']:.5f}  ({ratio})")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n  flock /tmp/bench.lock python scripts/bench_comm.py --world 2 --out comm.json\n"
        "  python scripts/bench_comm.py --world 4 --steps 150 --repeats 2 --budgets 0.1 0.3",
    )
    parser.add_argument("--world", type=int, default=2, help="processes (gloo, CPU)")
    parser.add_argument("--steps", type=int, default=300, help="all-reduce steps (sets the target loss)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD (momentum 0.9) step size in part 1")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.03, 0.3])
    parser.add_argument(
        "--powersgd-ranks", type=int, nargs="+", default=[1, 2], help="each paired with managed at its bytes"
    )
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--grid", type=float, nargs="+", default=[0.03, 0.1, 0.3, 1.0], help="tuned SGD lrs")
    parser.add_argument("--ada-lr", type=float, default=0.1, help="AdaRevision's single step size")
    add_out(parser, help="JSON with the raw rows and the medians", required=False)
    return parser


def bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "rows.json"
        mp.spawn(_worker, args=(args.world, f"file://{tmp}/store", args, str(raw)), nprocs=args.world)
        rows = json.loads(raw.read_text())
    summary = {"config": {k: v for k, v in vars(args).items() if k != "out"}, **summarize(rows), "raw": rows}
    print_table(summary, args.world, args.steps, args.staleness)
    if args.out:
        write_json_atomic(args.out, summary)


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
