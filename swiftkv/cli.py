"""``swiftkv convert|info`` (through the front door, ``toolkit.cli``): thin argparse layers over ``convert()``
and ``flops``."""

from __future__ import annotations

import logging
from pathlib import Path

from toolkit.cliargs import ArgumentParser, add_checkpoint, add_dtype, add_force, int_list, run, subcommands

EPILOG = """examples:
  swiftkv convert ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct out/smollm2-swiftkv50 --swiftkv-fraction 0.5
  swiftkv convert SRC out/llama-8b-swiftkv --num-key-value-layers 16 --group-size 2 --dtype bfloat16
  swiftkv convert SRC out/llama-8b-swiftkv50x --swiftkv-fraction 0.5 --exact-kv-window 32
  swiftkv info out/smollm2-swiftkv50
"""


def _info(model_dir: Path, lengths: list[int]) -> str:
    from toolkit.checkpoint import read_config

    from .flops import (
        Shape,
        ideal_prefill_speedup,
        kv_bytes_per_token,
        prefill_flops_original,
        prefill_flops_swiftkv,
    )

    config = read_config(model_dir)
    s = Shape.from_config(config)
    l, L = s.num_key_value_layers, s.layers
    lines = [
        f"{model_dir}: {config.get('model_type')}, {L} layers, hidden {s.hidden}, {s.heads}/{s.kv_heads} heads",
        f"layers 0..{l - 1} normal; layers {l}..{L - 1} SwiftKV ({L - l} layers, {(L - l) / L:.0%}), "
        f"group size {s.group_size} -> {s.groups} KV groups; exact K/V "
        + (
            f"for generated tokens and the last {s.exact_kv_window} prompt tokens"
            if s.exact_kv_window
            else "off"
        ),
        f"KV bytes/token (16-bit): original {kv_bytes_per_token(s, swiftkv=False)}, "
        f"SwiftKV {kv_bytes_per_token(s)} ({kv_bytes_per_token(s) / kv_bytes_per_token(s, swiftkv=False):.1%})",
        f"{'prompt':>8} {'orig GFLOP':>11} {'SwiftKV GFLOP':>14} {'ideal speedup':>14}",
    ]
    for n in lengths:
        lines.append(
            f"{n:>8} {prefill_flops_original(s, n) / 1e9:>11.1f} {prefill_flops_swiftkv(s, n) / 1e9:>14.1f} "
            f"{ideal_prefill_speedup(s, n):>13.2f}x"
        )
    return "\n".join(lines)


def _convert(args) -> str:
    from toolkit.checkpoint import open_checkpoint

    from .convert import convert

    source = open_checkpoint(args.src, quantized=True)  # convert() refuses quantized sources with its own fix
    out = convert(
        source.path,
        args.dst,
        num_key_value_layers=args.num_key_value_layers,
        swiftkv_fraction=args.swiftkv_fraction,
        group_size=args.group_size,
        exact_kv_window=args.exact_kv_window,
        dtype=args.dtype,
        force=args.force,
    )
    return _info(out, [512, 2048])


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="swiftkv", description=__doc__, epilog=EPILOG)
    sub = subcommands(parser)
    conv = sub.add_parser("convert", help="rewrite a HF checkpoint into SwiftKV form", epilog=EPILOG)
    add_checkpoint(
        conv, "src", help="source checkpoint: a folder (safetensors) or a Hub id (org/name[@revision])"
    )
    conv.add_argument("dst", type=Path, help="output folder (must be absent or empty unless --force)")
    which = conv.add_mutually_exclusive_group(required=True)
    which.add_argument("--num-key-value-layers", type=int, help="l: layers 0..l-1 stay normal")
    which.add_argument("--swiftkv-fraction", type=float, help="fraction of layers that become SwiftKV layers")
    conv.add_argument("--group-size", type=int, default=1, help="AcrossKV: SwiftKV layers sharing one K/V")
    conv.add_argument(
        "--exact-kv-window",
        type=int,
        default=0,
        metavar="W",
        help="exact K/V in layers >= l for generated tokens and the last W prompt tokens (default 0: off)",
    )
    add_dtype(conv)
    add_force(conv)
    info = sub.add_parser("info", help="print the layout and the prefill FLOP / KV-byte savings")
    add_checkpoint(info, "model_dir")
    info.add_argument("--lengths", type=int_list, default=[512, 1024, 2048, 4096])
    return parser


def main(argv: list[str] | None = None) -> int:
    from toolkit.checkpoint import open_checkpoint

    from .convert import ConversionError

    def command(args):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        if args.command == "convert":
            return _convert(args)
        checkpoint = open_checkpoint(args.model_dir, tokenizer=False)  # the layout needs no tokenizer
        return _info(checkpoint.path, args.lengths)

    return run(command, build_parser(), argv, errors=(ConversionError, RuntimeError))
