"""Benchmark of SCAR partial recovery: iteration cost of partial failures (numbers for the report, not a test).

A trial trains a problem to a random failure step t_f (every strategy's checkpoint follows the same run; the
first, complete save follows the first optimizer step, as in training), loses a random 25-50% of the
parameter blocks (values and optimizer state zeroed) just before the save due at t_f, recovers each
strategy's way from its own files (``distill.scar.RunningCheckpoint``), and trains on.  The *iteration cost*
is the number of extra steps until the loss is back to the uninterrupted run's loss at t_f (linearly
interpolated between steps; a full rollback to step c costs exactly t_f - c).  Strategies, at equal
checkpoint bytes (full every F steps vs a byte budget of fraction f every f*F steps; the bytes/step column
checks it):

  full+rollback      full checkpoint, every block and the optimizer rolled back (the traditional baseline)
  full+partial       full checkpoint, only the lost blocks restored
  scar-<select>      prioritized running checkpoint (max-change = SCAR; round-robin, random), partial recovery

Problems: ``lsq``, full-batch least squares with heavy-ball momentum (convex, linear rate: the setting of
SCAR's bound), 16 equal blocks whose feature scales spread over ``--spread`` decades (how unevenly blocks
keep moving, which is what prioritizing exploits); ``swiftkv``, full-batch SwiftKV distillation
(KL + MSE, AdamW) of a tiny random Llama's SwiftKV projections, row blocks of unequal bytes.  Reduction =
1 - mean cost / mean cost of full+rollback over the same trials, with a paired bootstrap 95% interval;
|delta| is the median Euclidean norm of the recovered state minus the lost live state (SCAR's perturbation).

    flock -s /tmp/bench.lock python scripts/bench_scar.py --problems lsq --spread 2 --trials 100 --threads 1 \
        --workdir /dev/shm --out out/bench/scar_lsq_spread2.json
    flock -s /tmp/bench.lock python scripts/bench_scar.py --problems swiftkv --trials 12 \
        --workdir /dev/shm --out out/bench/scar_swiftkv.json
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy
import scipy.stats
import torch
from tqdm.auto import tqdm

from distill.scar.config import ScarConfig
from distill.scar.faults import damage_blocks, pick_blocks
from distill.scar.running import RunningCheckpoint
from swiftkv.artifacts import write_json_atomic
from swiftkv.cliargs import ArgumentParser, add_out, existing_path, run

STRATEGIES = ("full+rollback", "full+partial", "scar-max-change", "scar-round-robin", "scar-random")


@dataclass
class Problem:
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    step: Callable[[], float]  # one optimizer step; returns the loss before it
    loss: Callable[[], float]
    block: str
    rows_per_block: int


def lsq_problem(
    seed: int, spread: float = 2.0, blocks: int = 16, rows: int = 8, outputs: int = 32, samples: int = 512
) -> Problem:
    """Feature scales of the blocks spread over ``spread`` decades: how unevenly the blocks keep moving."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-spread / 2, spread / 2, blocks).repeat_interleave(rows)
    x = torch.randn(samples, blocks * rows, generator=gen, dtype=torch.float64) * scales
    y = x @ torch.randn(blocks * rows, outputs, generator=gen, dtype=torch.float64)
    y += 0.1 * torch.randn(y.shape, generator=gen, dtype=torch.float64)
    params = {
        f"w{i}": torch.nn.Parameter(torch.zeros(rows, outputs, dtype=torch.float64)) for i in range(blocks)
    }
    lipschitz = torch.linalg.eigvalsh(x.T @ x / samples).max().item()
    opt = torch.optim.SGD(params.values(), lr=0.5 / lipschitz, momentum=0.5)

    def loss() -> torch.Tensor:
        w = torch.cat(list(params.values()))
        return 0.5 * (x @ w - y).pow(2).sum(1).mean()

    def step() -> float:
        value = loss()
        value.backward()
        opt.step()
        opt.zero_grad()
        return value.item()

    return Problem(params, opt, step, lambda: loss().item(), "tensor", rows)


def swiftkv_problem(seed: int, spread: float) -> Problem:
    del spread  # the model decides how its blocks move
    from transformers import LlamaConfig, LlamaForCausalLM

    from distill.objective import DistillationObjective
    from distill.recipe import LossSection
    from swiftkv.convert import to_swiftkv

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    model = to_swiftkv(LlamaForCausalLM(config), 2)
    model.set_mode("student")
    names = set(model.swiftkv_parameter_names())
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
    objective = DistillationObjective(model, LossSection(temperature=1.0, chunk_tokens=256)).train()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (4, 24), generator=gen)
    pos = torch.arange(24).expand(4, 24)
    mask = torch.ones_like(ids)
    params = {n: p for n, p in model.named_parameters() if n in names}
    opt = torch.optim.AdamW(params.values(), lr=3e-3, weight_decay=0.0)

    def step() -> float:
        value = objective(ids, pos, mask)["loss"]
        value.backward()
        opt.step()
        opt.zero_grad()
        return value.item()

    def loss() -> float:
        with torch.no_grad():
            return objective(ids, pos, mask)["loss"].item()

    return Problem(params, opt, step, loss, "row-block", 16)


PROBLEMS = {"lsq": lsq_problem, "swiftkv": swiftkv_problem}


def strategy_config(name: str, problem: Problem, full_every: int, fraction: float) -> ScarConfig:
    shape = {"block": problem.block, "rows_per_block": problem.rows_per_block}
    if name.startswith("full"):
        return ScarConfig(fraction=1.0, every_steps=full_every, **shape)
    return ScarConfig.equal_budget(full_every, fraction, select=name.removeprefix("scar-"), **shape)


def iteration_cost(problem: Problem, target: float, cap: int) -> float:
    previous = problem.loss()
    if previous <= target:
        return 0.0
    for k in range(1, cap + 1):
        problem.step()
        current = problem.loss()
        if current <= target:
            return k - 1 + (previous - target) / (previous - current)
        previous = current
    return float("inf")


def trial(name: str, seed: int, args, root: Path) -> dict:
    """One failure, every strategy recovering from it; the run up to the failure is shared."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    fail = int(torch.randint(args.warmup, args.warmup + 4 * args.full_every, (1,), generator=gen))
    lost_share = 0.25 + 0.25 * torch.rand(1, generator=gen).item()
    problem = PROBLEMS[name](seed, spread=args.spread)
    ckpts = {
        s: RunningCheckpoint(
            root / f"{name}-{seed}-{s}",
            problem.params,
            strategy_config(s, problem, args.full_every, args.fraction),
            problem.optimizer,
        )
        for s in STRATEGIES
    }
    problem.step()
    for c in ckpts.values():
        c.maybe_save(1)  # complete first save after the first optimizer step, as in training: state exists
    initial_bytes = {s: c.bytes_written for s, c in ckpts.items()}
    for step in range(2, fail + 1):
        problem.step()
        if step < fail:  # the failure strikes before the save due at t_f
            for c in ckpts.values():
                c.maybe_save(step)
    target = problem.loss()
    live = (
        {k: p.detach().clone() for k, p in problem.params.items()},
        copy.deepcopy(problem.optimizer.state_dict()),
    )
    lost = pick_blocks(ckpts[STRATEGIES[0]].blocks, lost_share, gen)
    row = {"fail_step": fail, "lost_blocks": len(lost), "blocks": len(ckpts[STRATEGIES[0]].blocks)}
    order = STRATEGIES[seed % len(STRATEGIES) :] + STRATEGIES[: seed % len(STRATEGIES)]  # interleaved
    for s in order:
        with torch.no_grad():
            for k, p in problem.params.items():
                p.copy_(live[0][k])
        problem.optimizer.load_state_dict(copy.deepcopy(live[1]))
        damage_blocks(problem.params, lost, mode="zero")
        for b in lost:
            for value in problem.optimizer.state[problem.params[b.name]].values():
                if isinstance(value, torch.Tensor) and value.dim():
                    b.rows(value).zero_()
        ckpts[s].recover(None if s == "full+rollback" else {b.id for b in lost})
        row[f"{s}_delta"] = torch.linalg.vector_norm(
            torch.cat([(p.detach() - live[0][k]).flatten() for k, p in problem.params.items()])
        ).item()
        row[s] = iteration_cost(problem, target, args.cap)
        saves = (ckpts[s].version - 1) * ckpts[s].config.every_steps
        row[f"{s}_bytes_per_step"] = (ckpts[s].bytes_written - initial_bytes[s]) / max(1, saves)
    return row


def reduction(costs, base, axis=-1):
    """1 - mean cost / mean cost of full+rollback (paired over trials; vectorized for the bootstrap)."""
    return 1 - numpy.mean(costs, axis=axis) / numpy.mean(base, axis=axis)


def summarize(rows: list[dict]) -> dict:
    base = [r["full+rollback"] for r in rows]
    out = {}
    for s in STRATEGIES:
        costs = [r[s] for r in rows]
        ci = scipy.stats.bootstrap(
            (costs, base), reduction, paired=True, method="percentile", n_resamples=2000, random_state=0
        ).confidence_interval
        out[s] = {
            "median_cost": statistics.median(costs),
            "mean_cost": statistics.fmean(costs),
            "reduction_vs_rollback": float(reduction(costs, base)),
            "reduction_ci95": [ci.low, ci.high],
            "median_delta": statistics.median(r[f"{s}_delta"] for r in rows),
            "bytes_per_step": statistics.median(r[f"{s}_bytes_per_step"] for r in rows),
        }
    return out


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n  python scripts/bench_scar.py --problems lsq --trials 10\n"
        "  flock /tmp/bench.lock python scripts/bench_scar.py --out bench_scar.json",
    )
    parser.add_argument("--problems", nargs="+", choices=sorted(PROBLEMS), default=["lsq", "swiftkv"])
    parser.add_argument("--trials", type=int, default=20, help="failures per problem (seeds 0..N-1)")
    parser.add_argument("--full-every", type=int, default=20, help="full checkpoint interval F (steps)")
    parser.add_argument("--fraction", type=float, default=0.25, help="running save fraction f")
    parser.add_argument("--warmup", type=int, default=40, help="first possible failure step")
    parser.add_argument("--spread", type=float, default=2.0, help="lsq: decades of block feature scales")
    parser.add_argument("--cap", type=int, default=500, help="give up recovering after this many steps")
    parser.add_argument(
        "--workdir",
        type=existing_path,
        help="where the checkpoints go (default: system temp; /dev/shm skips disk fsyncs)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (1 is faster for lsq on a busy machine)"
    )
    add_out(parser, help="write the rows and summary as JSON", required=False)
    return parser


def bench(args) -> None:
    torch.set_num_threads(args.threads)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "problems": {}}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for name in args.problems:
            rows = [trial(name, seed, args, Path(tmp)) for seed in tqdm(range(args.trials), desc=name)]
            result["problems"][name] = {"rows": rows, "summary": summarize(rows)}
    print(
        "| problem | strategy | median cost | mean cost | reduction vs rollback (95% CI) | median |delta| | bytes/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, res in result["problems"].items():
        for s, v in res["summary"].items():
            low, high = v["reduction_ci95"]
            print(
                f"| {name} | {s} | {v['median_cost']:.2f} | {v['mean_cost']:.2f} | "
                f"{v['reduction_vs_rollback']:.1%} ({low:.1%} to {high:.1%}) | {v['median_delta']:.4f} | "
                f"{v['bytes_per_step']:.0f} |"
            )
    if args.out:
        write_json_atomic(args.out, result)


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
