"""``swiftkv convert`` and ``swiftkv info``: thin argparse layers over ``convert()`` and ``flops``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

EPILOG = """examples:
  swiftkv convert ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct out/smollm2-swiftkv50 --swiftkv-fraction 0.5
  swiftkv convert SRC out/llama-8b-swiftkv --num-key-value-layers 16 --group-size 2 --dtype bfloat16
  swiftkv info out/smollm2-swiftkv50
"""


def _info(model_dir: Path, lengths: list[int]) -> str:
    from .convert import read_config
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
        f"group size {s.group_size} -> {s.groups} KV groups",
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="swiftkv",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser(
        "convert",
        help="rewrite a HF checkpoint into SwiftKV form",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    conv.add_argument("src", type=Path, help="source HF checkpoint folder (safetensors)")
    conv.add_argument("dst", type=Path, help="output folder (must be absent or empty unless --force)")
    which = conv.add_mutually_exclusive_group(required=True)
    which.add_argument("--num-key-value-layers", type=int, help="l: layers 0..l-1 stay normal")
    which.add_argument("--swiftkv-fraction", type=float, help="fraction of layers that become SwiftKV layers")
    conv.add_argument("--group-size", type=int, default=1, help="AcrossKV: SwiftKV layers sharing one K/V")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    conv.add_argument("--force", action="store_true", help="replace a non-empty destination")
    info = sub.add_parser("info", help="print the layout and the prefill FLOP / KV-byte savings")
    info.add_argument("model_dir", type=Path)
    info.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048, 4096]
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from .convert import ConversionError, convert

    try:
        if args.command == "convert":
            out = convert(
                args.src,
                args.dst,
                num_key_value_layers=args.num_key_value_layers,
                swiftkv_fraction=args.swiftkv_fraction,
                group_size=args.group_size,
                dtype=args.dtype,
                force=args.force,
            )
            print(_info(out, [512, 2048]))
        else:
            print(_info(args.model_dir, args.lengths))
    except (ConversionError, FileExistsError) as e:
        sys.exit(f"swiftkv {args.command}: error: {e}")


if __name__ == "__main__":
    main()
