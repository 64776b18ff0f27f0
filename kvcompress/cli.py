"""``kvcompress`` command line: a thin argparse layer over ``kvcompress.calibrate``."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  kvcompress calibrate models/smollm2 out/kv --data sharegpt --samples 256 --rank-budget 0.25 --bits 8,4,2
  kvcompress calibrate models/smollm2 out/kv --samples 32 --max-length 256 --force
then:
  python -c "from kvcompress import load_compressed; m, cache = load_compressed('models/smollm2', 'out/kv')"
"""


def _bits(text: str) -> list[int]:
    try:
        return [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bits {text!r} is not a comma list of integers; e.g. 8,4,2"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcompress",
        description="Token-adaptive low-rank + multi-level quantized KV cache (TALE).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser(
        "calibrate",
        help="compute low-rank KV factors and a default policy",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cal.add_argument("model_dir", help="Hugging Face model directory (Llama family, or a SwiftKV checkpoint)")
    cal.add_argument("out_dir", help="factors directory to write (complete or absent)")
    cal.add_argument(
        "--data", default="sharegpt", help="'sharegpt' or a JSONL of conversations (default: sharegpt)"
    )
    cal.add_argument("--samples", type=int, default=256, help="calibration conversations (default: 256)")
    cal.add_argument("--max-length", type=int, default=512, help="tokens per conversation (default: 512)")
    cal.add_argument(
        "--rank-budget", type=float, default=0.25, help="average rank / head_dim of compressed tokens"
    )
    cal.add_argument(
        "--bits", type=_bits, default=[8, 4, 2], help="bit width per tier, most significant first"
    )
    cal.add_argument("--sinks", type=int, default=4, help="attention-sink tokens kept exact (default: 4)")
    cal.add_argument("--window", type=int, default=64, help="recent tokens kept exact (default: 64)")
    cal.add_argument(
        "--block", type=int, default=32, help="compress once this many tokens left the window (default: 32)"
    )
    cal.add_argument("--force", action="store_true", help="replace a non-empty out_dir")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .calibrate import calibrate

    try:
        out = calibrate(
            args.model_dir,
            args.out_dir,
            data=args.data,
            samples=args.samples,
            max_length=args.max_length,
            rank_budget=args.rank_budget,
            bits=args.bits,
            sinks=args.sinks,
            window=args.window,
            block=args.block,
            force=args.force,
        )
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"kvcompress calibrate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
