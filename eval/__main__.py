"""``python -m eval run|tasks|harness|quality|report|vllm-args``: thin CLIs over the eval functions."""

from __future__ import annotations

import json

from swiftkv.cliargs import (
    ArgumentParser,
    add_limit,
    add_model,
    add_out,
    command_parser,
    existing_path,
    float_list,
    run,
)

EPILOG = """examples:
  python -m eval run --quick                           # the main job: convert -> distill -> evaluate -> report
  python -m eval tasks --out out/tasks                 # write the offline ShareGPT tasks for lm-eval
  python -m eval harness out/smollm2-swiftkv50 --tasks sharegpt_ppl,sharegpt_mc --tasks-dir out/tasks
  lm_eval --model hf --model_args pretrained=out/smollm2-swiftkv50,trust_remote_code=True \\
      --include_path out/tasks --tasks sharegpt_ppl --device cpu
  python -m eval quality out/smollm2-swiftkv50         # KL / agreement / perplexity against its teacher
  python -m eval report out/demo                       # report.md + PNGs from out/demo/run.json
  python -m eval report out/demo --curve out/curve/swiftkv25 out/curve/swiftkv50   # + longer runs' curves
  python -m eval vllm-args out/smollm2-swiftkv50 --suffix-cache out/suffix-cache --ranker out/ranker
"""


def build_parser() -> ArgumentParser:
    from .job import JOB_EPILOG

    parser, sub = command_parser("python -m eval", __doc__, EPILOG)
    job = sub.add_parser("run", help="the main job on the embedded default (resumable)", epilog=JOB_EPILOG)
    add_out(job, help="run folder (default out/demo, out/demo-quick with --quick)", required=False)
    job.add_argument("--quick", action="store_true", help="tiny settings (CI)")
    job.add_argument("--fractions", type=float_list, default=None, help="SwiftKV fractions, e.g. 0.25,0.5")
    job.add_argument(
        "--distill-steps", type=int, default=None, help="optimizer steps (default: the recipe's)"
    )
    tasks = sub.add_parser("tasks", help="write the offline lm-eval tasks")
    add_out(tasks, "out/tasks", help="tasks folder (default out/tasks)")
    add_limit(tasks, 100, "documents per task")
    harness = sub.add_parser("harness", help="lm-eval with our model types registered in-process")
    add_model(harness)
    harness.add_argument("--tasks", required=True, help="comma-separated task names")
    harness.add_argument("--tasks-dir", default="out/tasks", help="written by `tasks` if missing")
    add_limit(harness, None, "documents per task")
    harness.add_argument("--max-length", type=int, default=1024)
    quality = sub.add_parser(
        "quality", help="KL, agreement, perplexity and greedy agreement against the teacher"
    )
    add_model(quality, help="SwiftKV checkpoint (compared with its own teacher mode)")
    add_limit(quality, 32, "held-out conversations")
    quality.add_argument("--prompts", type=int, default=8, help="prompts for greedy agreement (default: 8)")
    report = sub.add_parser("report", help="report.md and PNG plots from RUN_DIR/run.json")
    add_model(report, "run_dir", help="run folder holding run.json")
    report.add_argument(
        "--curve",
        nargs="+",
        type=existing_path,
        default=[],
        metavar="DIR",
        help="output folders of longer distillations whose held-out curves join the report's",
    )
    serve = sub.add_parser(
        "vllm-args", help="print the vLLM serve command for a checkpoint and its artifacts"
    )
    add_model(serve, "checkpoint")
    serve.add_argument(
        "--suffix-cache", type=existing_path, help="from `python -m eval.serving.suffix build`"
    )
    serve.add_argument("--ranker", type=existing_path, help="from `python -m eval.serving.ranking train`")
    serve.add_argument("--cpu", action="store_true", help="add vLLM CPU backend settings")
    serve.add_argument("--port", type=int, default=8000)
    return parser


def _command(args) -> str:
    if args.command == "run":
        from .job import run_job

        return str(run_job(args.out, args.quick, args.fractions, args.distill_steps))
    if args.command == "tasks":
        from .tasks import write_tasks

        return str(write_tasks(args.out, args.limit))
    if args.command == "harness":
        from pathlib import Path

        from .harness import run_harness
        from .tasks import TASKS, write_tasks

        tasks_dir = Path(args.tasks_dir)
        if not all((tasks_dir / f"{t}.yaml").is_file() for t in TASKS):
            write_tasks(tasks_dir)
        return json.dumps(
            run_harness(args.model, args.tasks.split(","), tasks_dir, args.limit, args.max_length), indent=2
        )
    if args.command == "quality":
        from .quality import evaluate_quality

        return json.dumps(evaluate_quality(args.model, args.limit, n_prompts=args.prompts), indent=2)
    if args.command == "vllm-args":
        from .serving.vllm.args import serve_command

        return serve_command(args.checkpoint, args.suffix_cache, args.ranker, args.cpu, args.port).shell()
    from .report import write_report

    return str(write_report(args.run_dir, args.curve))


def main(argv: list[str] | None = None) -> int:
    return run(_command, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
