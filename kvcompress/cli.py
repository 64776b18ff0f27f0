"""``kvcompress`` command line: a thin argparse layer over ``kvcompress.calibrate``."""

from __future__ import annotations

from toolkit.cliargs import (
    ArgumentParser,
    add_checkpoint,
    add_force,
    add_limit,
    add_out,
    command_parser,
    int_list,
    run,
)

from . import defaults as D

EPILOG = """examples:
  swiftkv kvcompress calibrate models/smollm2 --out out/kv --data sharegpt --limit 64 --max-length 4096 --bits 4,2,2
  swiftkv kvcompress calibrate models/smollm2 --out out/kv --limit 32 --max-length 256 --force
then:
  python -c "from kvcompress import load_compressed; m, cache = load_compressed('models/smollm2', 'out/kv')"
"""


def build_parser() -> ArgumentParser:
    parser, sub = command_parser(
        "swiftkv kvcompress", "Token-adaptive low-rank + multi-level quantized KV cache (TALE).", EPILOG
    )
    cal = sub.add_parser("calibrate", help="compute low-rank KV factors and a default policy")
    add_checkpoint(cal, "model_dir", help="model folder or Hub id (Llama family, or a SwiftKV checkpoint)")
    add_out(cal, help="factors directory to write (complete or absent)")
    cal.add_argument(
        "--data", default=D.DATA, help=f"'sharegpt' or a JSONL of conversations (default: {D.DATA})"
    )
    add_limit(cal, D.SAMPLES, "calibration sequences (conversations joined to --max-length tokens)")
    cal.add_argument(
        "--max-length",
        type=int,
        default=D.MAX_LENGTH,
        help=f"tokens per calibration sequence: the context length you serve (default: {D.MAX_LENGTH})",
    )
    cal.add_argument(
        "--rank-budget",
        type=float,
        default=D.RANK_BUDGET,
        help=f"average key rank / head_dim of compressed tokens (default: {D.RANK_BUDGET})",
    )
    cal.add_argument(
        "--bits",
        type=int_list,
        default=list(D.BITS),
        help=f"bit width per tier, most significant first (default: {','.join(map(str, D.BITS))})",
    )
    cal.add_argument(
        "--value-bits",
        type=int_list,
        default=list(D.VALUE_BITS),
        help="the values' bit width per tier, as many as --bits (default: "
        f"{','.join(map(str, D.VALUE_BITS))}; pass the same list as --bits to store values like keys)",
    )
    cal.add_argument(
        "--scales",
        default=D.SCALES,
        help=f"key and value scales of every tier: t per token, c per channel over groups of tokens (default: {D.SCALES})",
    )
    cal.add_argument(
        "--sinks", type=int, default=D.SINKS, help=f"attention-sink tokens kept exact (default: {D.SINKS})"
    )
    cal.add_argument(
        "--window", type=int, default=D.WINDOW, help=f"recent tokens kept exact (default: {D.WINDOW})"
    )
    cal.add_argument(
        "--block",
        type=int,
        default=D.BLOCK,
        help=f"compress once this many tokens left the window (default: {D.BLOCK})",
    )
    cal.add_argument(
        "--sensitivity-samples",
        type=int,
        default=D.SENSITIVITY_SAMPLES,
        help="calibration sequences on which each layer's cost of key truncation is measured, to move key rank "
        f"to the layers that need it at the same memory (0: the same ranks in every layer; default: {D.SENSITIVITY_SAMPLES})",
    )
    add_force(cal)
    return parser


# keyword options of calibrate(), named as on the command line
OPTIONS = (
    "data",
    "max_length",
    "rank_budget",
    "bits",
    "value_bits",
    "scales",
    "sinks",
    "window",
    "block",
    "sensitivity_samples",
    "force",
)


def _calibrate(args) -> str:
    from toolkit.checkpoint import open_checkpoint

    from .calibrate import calibrate

    model_dir = open_checkpoint(args.model_dir).path
    options = {name: getattr(args, name) for name in OPTIONS}
    return f"wrote {calibrate(model_dir, args.out, samples=args.limit, **options)}"


def main(argv: list[str] | None = None) -> int:
    return run(_calibrate, build_parser(), argv)
