"""``python -m eval harness|quality|tasks|report|vllm-args``: thin CLIs over the eval functions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EPILOG = """examples:
  python -m eval tasks out/tasks                       # write the offline ShareGPT tasks for lm-eval
  python -m eval harness --model out/smollm2-swiftkv50 --tasks sharegpt_ppl,sharegpt_mc --tasks-dir out/tasks
  lm_eval --model hf --model_args pretrained=out/smollm2-swiftkv50,trust_remote_code=True \\
      --include_path out/tasks --tasks sharegpt_ppl --device cpu
  python -m eval quality out/smollm2-swiftkv50         # KL / agreement / perplexity against its teacher
  python -m eval report out/demo                       # report.md + PNGs from out/demo/run.json
  python -m eval vllm-args out/smollm2-swiftkv50 --suffix-cache out/suffix-cache --ranker out/ranker
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m eval",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    tasks = sub.add_parser("tasks", help="write the offline lm-eval tasks")
    tasks.add_argument("dst", type=Path)
    tasks.add_argument("--n-docs", type=int, default=100)
    harness = sub.add_parser("harness", help="lm-eval with our model types registered in-process")
    harness.add_argument("--model", required=True)
    harness.add_argument("--tasks", required=True, help="comma-separated task names")
    harness.add_argument(
        "--tasks-dir", type=Path, default=Path("out/tasks"), help="written by `tasks` if missing"
    )
    harness.add_argument("--limit", type=int, default=None)
    harness.add_argument("--max-length", type=int, default=1024)
    quality = sub.add_parser(
        "quality", help="KL, agreement, perplexity and greedy agreement against the teacher"
    )
    quality.add_argument("model")
    quality.add_argument("--conversations", type=int, default=32)
    quality.add_argument("--prompts", type=int, default=8)
    report = sub.add_parser("report", help="report.md and PNG plots from RUN_DIR/run.json")
    report.add_argument("run_dir", type=Path)
    report.add_argument("--baseline", help="accepted for compatibility; the run records its own baseline")
    serve = sub.add_parser(
        "vllm-args", help="print the vLLM serve command for a checkpoint and its artifacts"
    )
    serve.add_argument("checkpoint", type=Path)
    serve.add_argument("--suffix-cache", type=Path, help="from `python -m eval.serving.suffix build`")
    serve.add_argument("--ranker", type=Path, help="from `python -m eval.serving.ranking train`")
    serve.add_argument("--cpu", action="store_true", help="add vLLM CPU backend settings")
    serve.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)

    try:
        if args.command == "tasks":
            from .tasks import write_tasks

            print(write_tasks(args.dst, args.n_docs))
        elif args.command == "harness":
            from .harness import run_harness
            from .tasks import TASKS, write_tasks

            if not all((args.tasks_dir / f"{t}.yaml").is_file() for t in TASKS):
                write_tasks(args.tasks_dir)
            result = run_harness(
                args.model, args.tasks.split(","), args.tasks_dir, args.limit, args.max_length
            )
            print(json.dumps(result, indent=2))
        elif args.command == "quality":
            from .quality import evaluate_quality

            print(
                json.dumps(evaluate_quality(args.model, args.conversations, n_prompts=args.prompts), indent=2)
            )
        elif args.command == "vllm-args":
            from .serving.vllm.args import serve_command

            print(serve_command(args.checkpoint, args.suffix_cache, args.ranker, args.cpu, args.port).shell())
        else:
            from .report import write_report

            print(write_report(args.run_dir))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"eval {args.command}: error: {e}")


if __name__ == "__main__":
    main()
