"""``swiftkv run|tasks|harness|quality|report|vllm-args`` (through the front door, ``toolkit.cli``): thin CLIs
over the eval functions."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.cliargs import (
    EVAL_DEVICES,
    EVAL_DTYPES,
    ArgumentParser,
    add_checkpoint,
    add_limit,
    add_model,
    add_out,
    command_parser,
    existing_path,
    float_list,
    int_list,
    run,
)

EPILOG = """examples:
  swiftkv run --quick                           # the main job: convert -> distill -> evaluate -> report
  swiftkv run MODEL --recipe swiftkv_llama3.1_8b --device auto --dtype bfloat16 --out out/mine
  swiftkv tasks --out out/tasks                 # write the offline ShareGPT tasks for lm-eval
  swiftkv harness out/smollm2-swiftkv50 --tasks sharegpt_ppl,sharegpt_mc --tasks-dir out/tasks
  lm_eval --model hf --model_args pretrained=out/smollm2-swiftkv50,trust_remote_code=True \\
      --include_path out/tasks --tasks sharegpt_ppl --device cpu
  swiftkv quality out/smollm2-swiftkv50         # KL / agreement / perplexity against its teacher
  swiftkv quality out/llama8b/model --device auto --dtype bfloat16 --batch-size 8   # on the GPUs
  swiftkv report out/demo                       # report.md + PNGs from out/demo/run.json
  swiftkv report out/demo --curve out/curve/swiftkv25 out/curve/swiftkv50   # + longer runs' curves
  swiftkv vllm-args out/smollm2-swiftkv50 --suffix-cache out/suffix-cache --ranker out/ranker
"""


def add_placement(parser: ArgumentParser, batch_size: int | None = 4) -> None:
    """``--device``, ``--dtype`` (and ``--batch-size``) of the evaluation commands (``eval.quality``)."""
    parser.add_argument(
        "--device",
        choices=EVAL_DEVICES,
        default="cpu",
        help="cpu, cuda (one GPU) or auto (device_map=auto over all visible GPUs) (default: cpu)",
    )
    parser.add_argument("--dtype", choices=EVAL_DTYPES, default="float32", help="default: float32")
    if batch_size is not None:
        parser.add_argument(
            "--batch-size",
            type=int,
            default=batch_size,
            help=f"sequences per forward (default: {batch_size})",
        )


def build_parser() -> ArgumentParser:
    from .job import DEFAULT_RECIPE, JOB_EPILOG

    parser, sub = command_parser("swiftkv", __doc__, EPILOG)
    job = sub.add_parser("run", help="the main job, on the embedded default or your model", epilog=JOB_EPILOG)
    add_checkpoint(
        job,
        nargs="?",
        default=None,
        help="a model folder or Hub id (default: the embedded SmolLM2-135M-Instruct)",
    )
    job.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help=f"distillation recipe: a file or a shipped name (default: {DEFAULT_RECIPE})",
    )
    job.add_argument(
        "--launch",
        type=Path,
        help="accelerate config, a file or a shipped name (`swiftkv recipes`): run each distillation under "
        "`accelerate launch` (e.g. all 8 GPUs) instead of in this process",
    )
    add_placement(job, batch_size=None)
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
    add_checkpoint(harness)
    harness.add_argument("--tasks", required=True, help="comma-separated task names")
    harness.add_argument("--tasks-dir", default="out/tasks", help="written by `tasks` if missing")
    add_limit(harness, None, "documents per task")
    harness.add_argument("--max-length", type=int, default=1024)
    add_placement(harness)
    quality = sub.add_parser(
        "quality", help="KL, agreement, perplexity and greedy agreement against the teacher"
    )
    add_checkpoint(quality, help="SwiftKV checkpoint (compared with its own teacher mode): folder or Hub id")
    add_limit(quality, 32, "held-out conversations")
    quality.add_argument("--prompts", type=int, default=8, help="prompts for greedy agreement (default: 8)")
    quality.add_argument(
        "--data",
        default="sharegpt",
        help="held-out conversations: 'sharegpt' (its held-out split) or a JSONL file of your own, used whole",
    )
    quality.add_argument(
        "--prompt-heavy",
        type=int,
        default=0,
        metavar="N",
        help="also score after long prompts (eval.prompt_heavy): N held-out replies per prompt-length band "
        "(1-2k, 2-4k, 4-8k tokens), N documents, N // 2 samples per retrieval task and length (default: 0, off)",
    )
    quality.add_argument(
        "--retrieval-lengths",
        type=int_list,
        default=[1024, 2048, 4096, 8192],
        metavar="N,N",
        help="prompt lengths of the retrieval tasks (default: 1024,2048,4096,8192; those past the model's "
        "positions are left out)",
    )
    add_placement(quality)
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
    add_checkpoint(serve, "checkpoint")
    serve.add_argument("--suffix-cache", type=existing_path, help="from `swiftkv suffix build`")
    serve.add_argument("--ranker", type=existing_path, help="from `swiftkv ranking train`")
    serve.add_argument("--cpu", action="store_true", help="add vLLM CPU backend settings")
    serve.add_argument("--port", type=int, default=8000)
    return parser


def job_from_args(args):
    """The ``JobConfig`` of ``swiftkv run``'s arguments: a preset with the user's choices (``eval.job``)."""
    from .job import job_config

    return job_config(
        args.quick,
        model=args.model,
        recipe=args.recipe,
        out=args.out,
        fractions=args.fractions,
        distill_steps=args.distill_steps,
        device=args.device,
        dtype=args.dtype,
        launch=args.launch,
    )


def _command(args) -> str:
    from toolkit.checkpoint import open_checkpoint

    if args.command == "run":
        from .job import run_job

        return str(run_job(job_from_args(args)))
    if args.command == "tasks":
        from .tasks import write_tasks

        return str(write_tasks(args.out, args.limit))
    if args.command == "harness":
        from pathlib import Path

        from .harness import run_harness
        from .quality import check_placement
        from .tasks import TASKS, write_tasks

        check_placement(args.device, args.dtype)
        model = open_checkpoint(args.model).path
        tasks_dir = Path(args.tasks_dir)
        if not all((tasks_dir / f"{t}.yaml").is_file() for t in TASKS):
            write_tasks(tasks_dir)
        results = run_harness(
            model,
            args.tasks.split(","),
            tasks_dir,
            args.limit,
            args.max_length,
            args.batch_size,
            args.device,
            args.dtype,
        )
        return json.dumps(results, indent=2)
    if args.command == "quality":
        from toolkit.assets import resolve_data_path

        from .prompt_heavy import prompt_heavy_settings
        from .quality import check_placement, evaluate_quality

        check_placement(args.device, args.dtype)
        resolve_data_path(args.data)
        model = open_checkpoint(args.model).path
        result = evaluate_quality(
            model,
            args.limit,
            n_prompts=args.prompts,
            device=args.device,
            dtype=args.dtype,
            batch_size=args.batch_size,
            data=args.data,
            prompt_heavy=prompt_heavy_settings(args.prompt_heavy, args.retrieval_lengths),
        )
        return json.dumps(result, indent=2)
    if args.command == "vllm-args":
        from .serving.vllm.args import serve_command

        checkpoint = open_checkpoint(args.checkpoint, quantized=True).path  # vLLM serves FP8 checkpoints
        return serve_command(checkpoint, args.suffix_cache, args.ranker, args.cpu, args.port).shell()
    from .report import write_report

    return str(write_report(args.run_dir, args.curve))


def main(argv: list[str] | None = None) -> int:
    from distill.runs import LaunchError

    return run(_command, build_parser(), argv, errors=(LaunchError,))
