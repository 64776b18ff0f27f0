"""CLI: ``python -m eval.serving.suffix build|generate|export-vllm`` (thin layer over :mod:`.stages`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .cache import SpecConfig

EPILOG = """examples:
  python -m eval.serving.suffix build out/suffix-cache --data sharegpt --model MODEL_DIR --limit 2000
  python -m eval.serving.suffix build out/suffix-cache --model MODEL_DIR --responses-from teacher-generations.jsonl
  python -m eval.serving.suffix generate --model MODEL_DIR --cache out/suffix-cache --prompts prompts.jsonl --mode tree
  python -m eval.serving.suffix export-vllm out/suffix-cache > spec.json
  vllm serve MODEL_DIR --speculative-config "$(python -m eval.serving.suffix export-vllm out/suffix-cache)"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval.serving.suffix",
        description="SuffixDecoding: build suffix caches, generate with them, export the vLLM config.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "build",
        help="build a global suffix tree from responses",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("out", help="output directory (written complete or not at all)")
    b.add_argument("--model", required=True, help="model (or tokenizer) directory whose tokenizer to use")
    b.add_argument(
        "--data", default="sharegpt", help="ShareGPT-style JSONL or 'sharegpt' (assistant turns are used)"
    )
    b.add_argument("--responses-from", help="JSONL of teacher generations to use instead of --data")
    b.add_argument(
        "--limit", type=int, default=2000, help="conversations / generation records to read (default 2000)"
    )
    b.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    _spec_args(b)
    g = sub.add_parser(
        "generate",
        help="speculative greedy generation",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument("--model", required=True)
    g.add_argument(
        "--prompts", required=True, help='JSONL with {"prompt": str} or {"messages": [...]} per line'
    )
    g.add_argument("--cache", help="a built suffix cache (default: start empty)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    _spec_args(g)
    e = sub.add_parser("export-vllm", help="print the vLLM speculative_config JSON for a cache")
    e.add_argument("cache")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from . import stages

    try:
        if args.command == "build":
            out = stages.build(
                args.out,
                args.model,
                args.data,
                args.responses_from,
                args.limit,
                _spec_config(args),
                args.force,
            )
            print(out)
        elif args.command == "generate":
            base = stages.read_meta(args.cache)["config"] if args.cache else None
            for record in stages.generate(
                args.model, args.prompts, args.cache, args.max_new_tokens, _spec_config(args, base)
            ):
                print(json.dumps(record), flush=True)
        else:
            print(json.dumps(stages.export_vllm(args.cache)))
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
