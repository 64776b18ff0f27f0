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

``trainer`` measures SCAR inside the real trainer (``python -m distill``, one process): a tiny random Llama
with the SmolLM2 tokenizer (``--trainer-model tiny``) or the embedded SmolLM2-135M with SwiftKV 50%
(``smollm2``) distilled on ShareGPT, SIGKILLed from outside at a random moment of a random step (uniform in
time between two steps' log records, so a kill can land in the compute or in a save) and resumed.  The cost
is the number of completed steps lost: steps after the restart until the held-out KL is back at the
uninterrupted run's value at the last logged step (0 when the resumed state is already there; a resume from
the running checkpoint evaluates the recovered state first).  Full checkpoint + rollback (every F steps)
resumes at its last full checkpoint and replays the uninterrupted run exactly, so its cost is read off the
reference curve, counting a full checkpoint at the kill step as written (the baseline's best case).  The
SCAR run writes a full checkpoint every 2F steps and spends the other half of the baseline's bytes per step
on running saves (every ``--scar-every`` steps, the largest fraction that fits, at most 1), unless
``--fraction`` is given.

    OMP_NUM_THREADS=1 python scripts/bench_scar.py --problems trainer --trials 20 --full-every 8 \
        --workdir /dev/shm --out out/bench/scar_trainer.json
    OMP_NUM_THREADS=1 python scripts/bench_scar.py --problems trainer --trainer-model smollm2 --trials 8 \
        --full-every 8 --workdir /dev/shm --out out/bench/scar_trainer_smollm2.json
    flock -s /tmp/bench.lock python scripts/bench_scar.py --problems lsq --spread 2 --trials 100 --threads 1 \
        --workdir /dev/shm --out out/bench/scar_lsq_spread2.json
    flock -s /tmp/bench.lock python scripts/bench_scar.py --problems swiftkv --trials 12 \
        --workdir /dev/shm --out out/bench/scar_swiftkv.json
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy
import scipy.stats
import torch
from tqdm.auto import tqdm

from distill.runs import read_curve
from distill.scar.config import ScarConfig
from distill.scar.faults import damage_blocks, kill_process, pick_blocks
from distill.scar.running import RunningCheckpoint
from toolkit.artifacts import write_json_atomic
from toolkit.cliargs import ArgumentParser, add_out, existing_path, run

STRATEGIES = ("full+rollback", "full+partial", "scar-max-change", "scar-round-robin", "scar-random")


@dataclass
class Problem:
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    step: Callable[[], float]  # one optimizer step; returns the loss before it
    loss: Callable[[], float]
    block_bytes: int


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

    return Problem(params, opt, step, lambda: loss().item(), rows * outputs * 8)  # a block per tensor (fp64)


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

    return Problem(params, opt, step, loss, 16 * 64 * 4)  # blocks of 16 rows


PROBLEMS = {"lsq": lsq_problem, "swiftkv": swiftkv_problem}


def strategy_config(name: str, problem: Problem, full_every: int, fraction: float) -> ScarConfig:
    shape = {"block_bytes": problem.block_bytes}
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
            strategy_config(s, problem, args.full_every, args.fraction or 0.25),
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


def summarize(rows: list[dict], strategies=STRATEGIES) -> dict:
    base = [r["full+rollback"] for r in rows]
    out = {}
    for s in strategies:
        costs = [r[s] for r in rows]
        ci = scipy.stats.bootstrap(
            (costs, base), reduction, paired=True, method="percentile", n_resamples=2000, random_state=0
        ).confidence_interval
        out[s] = {
            "median_cost": statistics.median(costs),
            "mean_cost": statistics.fmean(costs),
            "reduction_vs_rollback": float(reduction(costs, base)),
            "reduction_ci95": [ci.low, ci.high],
            "median_delta": statistics.median(r.get(f"{s}_delta", 0.0) for r in rows),
            "bytes_per_step": statistics.median(r[f"{s}_bytes_per_step"] for r in rows),
        }
    return out


TRAINER_STRATEGIES = ("full+rollback", "scar-max-change")


def tiny_trainer_run(root: Path, args) -> dict:
    """A tiny random Llama with the embedded SmolLM2 tokenizer, saved under ``root``, and the recipe tree
    distilling it on ShareGPT (the real trainer, one process)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from toolkit.assets import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
            initializer_range=0.2,
        )
    )
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return {
        "model": {"source": str(root / "model"), "swiftkv": {"num_key_value_layers": 3, "group_size": 1}},
        "data": {"sources": [{"path": "sharegpt", "max_samples": 200}], "seq_len": 96, "holdout": 0.1},
        "loss": {"chunk_tokens": 96},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0, "schedule": "linear"},
        "train": {"micro_batch_size": 2, "max_steps": args.trainer_steps},
        "checkpoint": {"every_steps": args.full_every, "keep": 1},
        "log": {"every_steps": 1, "eval_every_steps": 1, "eval_batches": 2},
    }


def smollm2_trainer_run(root: Path, args) -> dict:
    """The CPU recipe's SwiftKV 50% distillation of the embedded SmolLM2-135M (its loss, optimizer and
    least-squares init), at a shorter sequence so that a trial takes minutes."""
    from toolkit.assets import model_dir

    return {
        "model": {
            "source": str(model_dir()),
            "swiftkv": {"fraction": 0.5, "group_size": 1, "init": "lstsq", "init_rows": 16},
            "dtype": "float32",
        },
        "data": {"sources": [{"path": "sharegpt", "max_samples": 300}], "seq_len": 128, "holdout": 0.05},
        "loss": {"temperature": 2.0, "mse_weight": 0.01, "chunk_tokens": 128},
        "optim": {"lr": 1e-3, "schedule": "linear", "warmup_ratio": 0.05, "grad_clip": 1.0},
        "train": {"micro_batch_size": 2, "max_steps": args.trainer_steps},
        "checkpoint": {"every_steps": args.full_every, "keep": 1},
        "log": {"every_steps": 1, "eval_every_steps": 1, "eval_batches": 2},
    }


TRAINER_MODELS = {"tiny": tiny_trainer_run, "smollm2": smollm2_trainer_run}


def write_trainer_recipe(path: Path, tree: dict, out: Path, full_every: int, scar: dict | None) -> Path:
    checkpoint = {**tree["checkpoint"], "every_steps": full_every, **({"scar": scar} if scar else {})}
    path.write_text(json.dumps({**tree, "output_dir": str(out), "checkpoint": checkpoint}))  # JSON is YAML
    return path


def trainer_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def held_out(out: Path) -> dict[int, float]:
    """Held-out KL per step from the run's log (``distill.runs.read_curve``: a resumed run's records replace
    the killed run's, and a resume from the running checkpoint logs the recovered state at its step)."""
    return {record["step"]: record["eval_kl"] for record in read_curve(out)}


def logged_steps(out: Path) -> list[int]:
    """Steps whose training record is in the log."""
    log = out / "log.jsonl"
    text = log.read_text() if log.is_file() else ""
    return [json.loads(line)["step"] for line in text.splitlines() if '"lr"' in line]


def train_until_killed(recipe: Path, out: Path, step: int, rng: random.Random) -> int:
    """Run the trainer and SIGKILL it (from outside) at a uniformly random moment between the log records of
    ``step`` and the next step (the next step's length taken as the last one's); returns the last step
    logged before the kill."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "distill", str(recipe)],
        env=trainer_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    seen: dict[int, float] = {}
    while step not in seen:
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) before step {step}")
        now = time.perf_counter()
        for s in logged_steps(out):
            seen.setdefault(s, now)
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, seen[step] - seen[step - 1]))
    kill_process(proc.pid)
    proc.wait()
    return max(logged_steps(out))


def steps_to_target(
    curve: dict[int, float], start: int, target: float, last: int
) -> tuple[float, float, bool]:
    """Steps run from the state at ``start`` until the held-out KL is back at ``target``: whole steps, and
    linearly interpolated between the two steps around the crossing (as in the side benchmark; a rollback
    along a falling curve costs exactly the steps it replays); 0 when the state is already there, censored
    at the end of the run (``last - start`` and False)."""
    if curve[start] <= target:
        return 0.0, 0.0, True
    for step in range(start + 1, last + 1):
        if curve[step] <= target:
            before = curve[step - 1]
            return float(step - start), step - 1 - start + (before - target) / (before - curve[step]), True
    return float(last - start), float(last - start), False


def trainer_trial(seed: int, args, root: Path, tree: dict, reference: dict, scar: dict) -> dict:
    """SIGKILL the SCAR run at a random moment, resume it, count the steps until the uninterrupted run's
    held-out KL at the last logged step is reached; full checkpoint + rollback resumes at the last full
    checkpoint and replays the uninterrupted run exactly (tests/distill/test_train.py), so its cost is read
    off the reference curve."""
    rng = random.Random(20_000 + seed)
    last = args.trainer_steps
    out = root / f"trainer-{seed}"
    recipe = write_trainer_recipe(root / f"trainer-{seed}.yaml", tree, out, 2 * args.full_every, scar)
    killed = train_until_killed(recipe, out, rng.randint(2, last - args.trainer_margin), rng)
    resumed = subprocess.run(
        [sys.executable, "-m", "distill", str(recipe)], env=trainer_env(), capture_output=True, text=True
    )
    if resumed.returncode:
        raise RuntimeError(resumed.stderr.strip().splitlines()[-1])
    start = int(
        [line for line in resumed.stdout.splitlines() if "resumed" in line][-1].rsplit("at step ", 1)[1]
    )
    target, curve = reference[killed], held_out(out)
    scar_steps, scar_interpolated, reached = steps_to_target(curve, start, target, last)
    full = killed // args.full_every * args.full_every
    rollback_steps, rollback_interpolated, _ = steps_to_target(reference, full, target, last)
    shutil.rmtree(out)
    return {
        "killed_after_step": killed,
        "resumed_at": start,
        "full_checkpoint_step": full,
        "scar_reached_target": reached,
        "full+rollback": rollback_steps,
        "scar-max-change": scar_steps,
        "interpolated": {"full+rollback": rollback_interpolated, "scar-max-change": scar_interpolated},
        "resumed_held_out_kl": {s: kl for s, kl in curve.items() if s >= start},
    }


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def trainer_bench(args, root: Path) -> dict:
    """The in-loop measurement: a reference run (its held-out curve, the size of a full checkpoint and of
    one copy of every running block), the running schedule at equal bytes, then the trials."""
    tree = TRAINER_MODELS[args.trainer_model](root, args)
    ref = root / "reference"
    all_blocks = {"fraction": 1.0, "every_steps": 1, "block_bytes": args.block_bytes}
    recipe = write_trainer_recipe(root / "reference.yaml", tree, ref, args.full_every, all_blocks)
    subprocess.run([sys.executable, "-m", "distill", str(recipe)], env=trainer_env(), check=True)
    reference = held_out(ref)
    full_bytes = folder_bytes(next((ref / "checkpoints").glob("step_*")))
    running_bytes = folder_bytes(ref / "scar" / "rank_00000")
    budget = full_bytes / (2 * args.full_every) * args.scar_every  # the half left by full saves every 2F
    fraction = args.fraction or round(min(1.0, budget / running_bytes), 4)
    scar = {"fraction": fraction, "every_steps": args.scar_every, "block_bytes": args.block_bytes}
    rows = []
    for seed in tqdm(range(args.trials), desc="trainer"):
        rows.append(trainer_trial(seed, args, root, tree, reference, scar))
        if args.out:  # trials take minutes each: what is done so far survives an interrupted run
            write_json_atomic(args.out, {"partial_rows": rows, "reference_held_out_kl": reference})
    for row in rows:
        row["full+rollback_bytes_per_step"] = full_bytes / args.full_every
        row["scar-max-change_bytes_per_step"] = (
            full_bytes / (2 * args.full_every) + fraction * running_bytes / args.scar_every
        )
    interpolated = [{**row, **row["interpolated"]} for row in rows]
    return {
        "rows": rows,
        "summary": summarize(rows, TRAINER_STRATEGIES),
        "summary_interpolated": summarize(interpolated, TRAINER_STRATEGIES),
        "scar": scar,
        "reference_held_out_kl": reference,
        "full_checkpoint_bytes": full_bytes,
        "running_checkpoint_bytes": running_bytes,
        "censored": sum(not r["scar_reached_target"] for r in rows),
    }


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n  python scripts/bench_scar.py --problems lsq --trials 10\n"
        "  flock /tmp/bench.lock python scripts/bench_scar.py --out bench_scar.json",
    )
    parser.add_argument(
        "--problems", nargs="+", choices=[*sorted(PROBLEMS), "trainer"], default=["lsq", "swiftkv"]
    )
    parser.add_argument("--trials", type=int, default=20, help="failures per problem (seeds 0..N-1)")
    parser.add_argument("--full-every", type=int, default=20, help="full checkpoint interval F (steps)")
    parser.add_argument(
        "--fraction",
        type=float,
        help="running save fraction f (default: 0.25; trainer: the most the equal byte budget allows)",
    )
    parser.add_argument("--warmup", type=int, default=40, help="first possible failure step")
    parser.add_argument("--spread", type=float, default=2.0, help="lsq: decades of block feature scales")
    parser.add_argument("--cap", type=int, default=500, help="give up recovering after this many steps")
    parser.add_argument("--trainer-steps", type=int, default=32, help="trainer: steps of each run")
    parser.add_argument("--trainer-margin", type=int, default=12, help="trainer: no kill in the last N steps")
    parser.add_argument(
        "--trainer-model", choices=sorted(TRAINER_MODELS), default="tiny", help="trainer: model"
    )
    parser.add_argument("--scar-every", type=int, default=1, help="trainer: running save interval (steps)")
    parser.add_argument("--block-bytes", type=int, default=4096, help="trainer: checkpoint.scar.block_bytes")
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
            if name == "trainer":
                result["problems"][name] = trainer_bench(args, Path(tmp))
                continue
            rows = [trial(name, seed, args, Path(tmp)) for seed in tqdm(range(args.trials), desc=name)]
            result["problems"][name] = {"rows": rows, "summary": summarize(rows)}
    print(
        "| problem | strategy | median cost | mean cost | reduction vs rollback (95% CI) | median |delta| | bytes/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, res in result["problems"].items():
        summaries = {name: res["summary"]}
        if "summary_interpolated" in res:
            summaries[f"{name} (interpolated)"] = res["summary_interpolated"]
        for label, summary in summaries.items():
            for s, v in summary.items():
                low, high = v["reduction_ci95"]
                print(
                    f"| {label} | {s} | {v['median_cost']:.2f} | {v['mean_cost']:.2f} | "
                    f"{v['reduction_vs_rollback']:.1%} ({low:.1%} to {high:.1%}) | {v['median_delta']:.4f} | "
                    f"{v['bytes_per_step']:.0f} |"
                )
    if args.out:
        write_json_atomic(args.out, result)


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
