"""Distillation step throughput: shared lower layers (ours) vs a naive two-forward-pass loop, same run.

Both compute the same loss and gradients (tests/distill/test_objective.py); the naive loop runs the teacher
and the student as two full forward passes, as the reference trainer does.  A third variant trains with exact
K/V (``--exact-kv-window``, the recipes' setting: the loss mask's replies and the window before each take exact
K/V in layers >= l), so its cost is measured beside the plain step.  Each repeat times one
optimizer-free training step (forward, KD loss, backward) of each variant in alternating order on the same
packed ShareGPT rows; the table reports medians.

    python scripts/bench_distill.py ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct --fraction 0.5
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.objective import DistillationObjective
from distill.recipe import LossSection
from eval.quality import held_out_rows
from eval.speed import interleaved
from swiftkv.convert import resolve_num_key_value_layers, to_swiftkv
from toolkit.cliargs import ArgumentParser, add_model, add_out, run


def step_seconds(objective: DistillationObjective, batch: tuple[torch.Tensor, ...]) -> float:
    objective.zero_grad(set_to_none=True)
    start = time.perf_counter()
    objective(*batch)["loss"].backward()
    return time.perf_counter() - start


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__)
    add_model(parser)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--exact-kv-window", type=int, default=32, help="the exact-K/V variant's window")
    add_out(parser, "out/bench/distill.json")
    return parser


def bench(args) -> None:

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    L = base.config.num_hidden_layers
    model = to_swiftkv(base, resolve_num_key_value_layers(L, None, args.fraction, 1), 1).train()
    names = set(model.swiftkv_parameter_names())
    for name, param in model.named_parameters():
        param.requires_grad_(name in names)
    rows = held_out_rows(tokenizer, n_conversations=64, seq_len=args.seq_len)
    batch = tuple(rows[k][: args.batch] for k in ("input_ids", "position_ids", "loss_mask"))
    exact = copy.deepcopy(model)
    exact.config.exact_kv_window = args.exact_kv_window
    variants = {
        "shared lower layers": DistillationObjective(model, LossSection(), shared_lower_layers=True),
        "naive two passes": DistillationObjective(model, LossSection(), shared_lower_layers=False),
        f"shared lower layers, exact K/V (W = {args.exact_kv_window})": DistillationObjective(
            exact, LossSection(), shared_lower_layers=True
        ),
    }
    for objective in variants.values():  # warm-up
        step_seconds(objective, batch)
    times = interleaved(variants, lambda o: step_seconds(o, batch), args.repeats)
    tokens = args.batch * args.seq_len
    base_t = times["naive two passes"]
    print(
        f"| trainer step ({args.batch}x{args.seq_len} tokens, SwiftKV {args.fraction:.0%}) | s/step | tokens/s | speedup |"
    )
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {tokens / t:.0f} | {base_t / t:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "seconds_per_step": times,
                "tokens_per_step": tokens,
                "threads": torch.get_num_threads(),
            },
            indent=2,
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
