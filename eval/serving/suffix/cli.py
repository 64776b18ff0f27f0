"""CLI: ``swiftkv suffix build|generate|export-vllm`` (thin layer over :mod:`.stages`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from toolkit.cliargs import (
    ArgumentParser,
    add_checkpoint,
    add_force,
    add_limit,
    add_model,
    add_out,
    command_parser,
    existing_path,
    run,
)

from .artifact import vllm_dropped_settings
from .cache import SpecConfig

EPILOG = """examples:
  swiftkv suffix build MODEL_DIR --out out/suffix-cache --data sharegpt --limit 2000
  swiftkv suffix build MODEL_DIR --out out/suffix-cache --responses-from teacher-generations.jsonl
  swiftkv suffix generate MODEL_DIR --cache out/suffix-cache --prompts prompts.jsonl --mode tree
  swiftkv suffix export-vllm out/suffix-cache > spec.json
  vllm serve MODEL_DIR --speculative-config "$(swiftkv suffix export-vllm out/suffix-cache)"
"""


def _spec_args(p: argparse.ArgumentParser) -> None:
    defaults = SpecConfig()
    for name, field in SpecConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "mode":
            p.add_argument(
                flag, choices=["path", "tree"], default=None, help=f"{field.description} (default path)"
            )
        else:
            kind = type(getattr(defaults, name))
            p.add_argument(
                flag, type=kind, default=None, help=f"{field.description} (default {getattr(defaults, name)})"
            )


def _spec_config(args: argparse.Namespace, base: dict | None = None) -> SpecConfig:
    values = dict(base or {})
    values.update({k: v for k in SpecConfig.model_fields if (v := getattr(args, k)) is not None})
    return SpecConfig(**values)


def build_parser() -> ArgumentParser:
    parser, sub = command_parser(
        "swiftkv suffix",
        "SuffixDecoding: build suffix caches, generate with them, export the vLLM config.",
        EPILOG,
    )
    b = sub.add_parser("build", help="build a global suffix tree from responses")
    add_checkpoint(b, help="model folder or Hub id (org/name[@revision]) whose tokenizer to use")
    add_out(b, help="output directory (written complete or not at all)")
    b.add_argument(
        "--data", default="sharegpt", help="ShareGPT-style JSONL or 'sharegpt' (assistant turns are used)"
    )
    b.add_argument(
        "--responses-from", type=existing_path, help="JSONL of teacher generations to use instead of --data"
    )
    add_limit(b, 2000, "conversations / generation records to read")
    add_force(b)
    _spec_args(b)
    g = sub.add_parser("generate", help="speculative greedy generation")
    add_checkpoint(g)
    g.add_argument(
        "--prompts",
        type=existing_path,
        required=True,
        help='JSONL with {"prompt": str} or {"messages": [...]} per line',
    )
    g.add_argument("--cache", type=existing_path, help="a built suffix cache (default: start empty)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    _spec_args(g)
    e = sub.add_parser("export-vllm", help="print the vLLM speculative_config JSON for a cache")
    add_model(e, "cache", help="a built suffix cache")
    return parser


def _command(args: argparse.Namespace) -> str | None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from toolkit.checkpoint import open_checkpoint

    from . import stages

    if args.command == "build":
        # only the tokenizer is read: a Hub id is fetched without its weights; any model family
        model = open_checkpoint(args.model, weights=False, model_types=None).path
        return str(
            stages.build(
                args.out,
                model,
                args.data,
                args.responses_from,
                args.limit,
                _spec_config(args),
                args.force,
            )
        )
    if args.command == "generate":
        model = open_checkpoint(args.model, model_types=None).path
        base = stages.read_meta(args.cache)["config"] if args.cache else None
        for record in stages.generate(
            model, args.prompts, args.cache, args.max_new_tokens, _spec_config(args, base)
        ):
            print(json.dumps(record), flush=True)
        return None
    dropped = vllm_dropped_settings(stages.read_meta(args.cache))
    if dropped:
        print(f"warning: vLLM ignores {', '.join(dropped)}", file=sys.stderr)
    return json.dumps(stages.export_vllm(args.cache))


def main(argv: list[str] | None = None) -> int:
    return run(_command, build_parser(), argv)
