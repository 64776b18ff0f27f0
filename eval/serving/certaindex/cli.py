"""``swiftkv certaindex {cot,sc,calibrate,serve}``: thin CLI over ``cot``, ``sc`` and ``server``.

Per-problem results are resumable (``records.run_resumable``: an interrupted run continues where it
stopped); when every problem is done ``OUT`` holds the records and ``OUT.summary.json`` the summary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from toolkit.cliargs import (
    ArgumentParser,
    add_dtype,
    add_limit,
    add_out,
    add_seed,
    command_parser,
    existing_path,
    run,
)

from .answers import answers_equal
from .backends import Backend, Sampling
from .certainty import PRESETS, preset
from .data import Problem, resolve_problems
from .engines import load_backend
from .records import run_resumable

EPILOG = """examples:
  swiftkv certaindex cot ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct \\
      --data arith:20:0 --preset mid --max-tokens 256 --out cot.jsonl
  swiftkv certaindex cot http://127.0.0.1:8000/v1 --tokenizer MODEL_DIR --data problems.jsonl --out cot.jsonl
  swiftkv certaindex sc MODEL_DIR --data mc.jsonl --max-samples 16 --threshold 0.8 --out sc.jsonl
  swiftkv certaindex calibrate MODEL_DIR --data dev.jsonl --max-samples 16 --out dev.jsonl
  swiftkv certaindex serve MODEL_DIR --port 8000     # OpenAI-compatible test server
"""


def _summary(records: list[dict], keys: tuple[str, ...]) -> dict:
    n = len(records)
    summary = {"problems": n, "accuracy": sum(r["correct"] for r in records) / max(n, 1)}
    summary.update({f"mean_{k}": sum(r[k] for r in records) / max(n, 1) for k in keys})
    return summary


def _write_summary(out: Path, summary: dict) -> None:
    from toolkit.artifacts import write_json_atomic

    write_json_atomic(out.with_name(out.name + ".summary.json"), summary)
    print(json.dumps(summary, indent=2, sort_keys=True))


def _cmd_cot(args: argparse.Namespace, backend: Backend, problems: list[Problem]) -> None:
    from .cot import run_cot

    window, chunk = preset(args.preset)
    window, chunk = args.window or window, args.chunk or chunk
    sampling = Sampling(args.temperature, args.top_p, args.seed)

    def solve(p: Problem) -> dict:
        result = run_cot(
            backend,
            backend.chat_format(p.prompt_text()),
            max_tokens=args.max_tokens,
            window=window,
            chunk=chunk,
            early_exit=not args.no_early_exit,
            sampling=sampling,
            choices=len(p.choices or ()),
        )
        return {**result.to_dict(), "correct": answers_equal(result.answer, p.answer)}

    options = {**vars(args), "window": window, "chunk": chunk}
    records = run_resumable(problems, solve, args.out, _jsonable(options))
    summary = _summary(records, ("main_tokens", "probe_tokens", "saved_tokens"))
    summary["early_exit_rate"] = sum(r["exited_early"] for r in records) / max(len(records), 1)
    _write_summary(args.out, {**summary, "options": _jsonable(options)})


def _sc_records(
    args: argparse.Namespace, backend: Backend, problems: list[Problem], threshold: float | None
) -> list[dict]:
    from .sc import run_sc

    sampling = Sampling(args.temperature, args.top_p, args.seed)

    def solve(p: Problem) -> dict:
        result = run_sc(
            backend,
            backend.chat_format(p.prompt_text()),
            max_samples=args.max_samples,
            step=args.step,
            threshold=threshold,
            max_tokens=args.max_tokens,
            sampling=sampling,
            choices=len(p.choices or ()),
        )
        return {**result.to_dict(), "correct": answers_equal(result.answer, p.answer)}

    return run_resumable(problems, solve, args.out, _jsonable({**vars(args), "threshold": threshold}))


def _cmd_sc(args: argparse.Namespace, backend: Backend, problems: list[Problem]) -> None:
    records = _sc_records(args, backend, problems, None if args.threshold > 1 else args.threshold)
    _write_summary(args.out, {**_summary(records, ("samples", "tokens")), "options": _jsonable(vars(args))})


def _cmd_calibrate(args: argparse.Namespace, backend: Backend, problems: list[Problem]) -> None:
    from .sc import ScResult, calibrate

    records = _sc_records(args, backend, problems, None)
    runs = [ScResult.from_dict(r) for r in records]
    best, points = calibrate(
        runs,
        [r["reference"] for r in records],
        args.step,
        target_accuracy=args.target_accuracy,
        tolerance=args.tolerance,
    )
    print(f"{'threshold':>9} {'accuracy':>8} {'mean tokens':>11}")
    for p in points:
        print(f"{'full' if p.threshold is None else p.threshold:>9} {p.accuracy:8.3f} {p.mean_tokens:11.1f}")
    summary = {"chosen": vars(best), "points": [vars(p) for p in points], "options": _jsonable(vars(args))}
    _write_summary(args.out, summary)


def _cmd_serve(args: argparse.Namespace) -> None:
    from .hf_backend import HFBackend
    from .server import make_server

    server = make_server(
        HFBackend.from_pretrained(args.model, args.dtype), Path(args.model).name, args.host, args.port
    )
    print(
        f"serving {args.model} at http://{server.server_address[0]}:{server.server_address[1]}/v1", flush=True
    )
    server.serve_forever()


def _jsonable(options: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in options.items() if k != "func"}


def model_or_url(text: str) -> str:
    """argparse type: an ``http(s)://`` endpoint, or a model folder that must exist."""
    return text if text.startswith(("http://", "https://")) else str(existing_path(text))


def build_parser() -> ArgumentParser:
    parser, sub = command_parser("swiftkv certaindex", __doc__.splitlines()[0], EPILOG)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "model", type=model_or_url, help="transformers model dir, or http://host:port/v1 endpoint"
    )
    add_dtype(common, "float32", ("float32", "bfloat16", "float16"))
    solve = argparse.ArgumentParser(add_help=False, parents=[common])
    solve.add_argument("--tokenizer", help="HF dir or id for the chat template when MODEL is a URL")
    solve.add_argument(
        "--data", required=True, help="JSONL of {id, question, answer[, choices]}, or arith:N[:SEED]"
    )
    add_limit(solve, None, "use only the first N problems")
    add_out(solve, help="per-problem JSONL; summary goes to OUT.summary.json")
    solve.add_argument("--max-tokens", type=int, default=1024, help="token budget of one chain")
    solve.add_argument("--temperature", type=float, default=0.6)
    solve.add_argument("--top-p", type=float, default=0.95)
    add_seed(solve)

    cot = sub.add_parser(
        "cot", parents=[solve], help="chain of thought with probe-in-the-middle early exit", epilog=EPILOG
    )
    cot.add_argument("--preset", default="mid", choices=list(PRESETS), help="(W, chunk): " + str(PRESETS))
    cot.add_argument("--window", type=int, help="override W: consecutive agreeing probes needed to exit")
    cot.add_argument("--chunk", type=int, help="override the chunk size in tokens")
    cot.add_argument(
        "--no-early-exit", action="store_true", help="full-budget baseline with the same chunking"
    )
    cot.set_defaults(func=_cmd_cot)
    for name, func, text in (
        ("sc", _cmd_sc, "certaindex-adaptive self-consistency"),
        ("calibrate", _cmd_calibrate, "pick the certaindex threshold on a dev split"),
    ):
        p = sub.add_parser(name, parents=[solve], help=text)
        p.add_argument("--max-samples", type=int, default=16)
        p.add_argument(
            "--step", type=int, default=4, help="samples drawn per round between certaindex checks"
        )
        p.set_defaults(func=func)
        if name == "sc":
            p.add_argument(
                "--threshold", type=float, default=0.8, help="stop at certaindex >= this (> 1: full budget)"
            )
        else:
            p.add_argument(
                "--target-accuracy",
                type=float,
                help="dev accuracy to keep (default: full budget - tolerance)",
            )
            p.add_argument("--tolerance", type=float, default=0.01)
    serve = sub.add_parser("serve", parents=[common], help="OpenAI-compatible completions server (loopback)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(func=_cmd_serve)
    return parser


def _command(args: argparse.Namespace) -> None:
    if args.command == "serve":
        return args.func(args)
    problems = resolve_problems(args.data, args.limit)
    backend = load_backend(args.model, tokenizer=args.tokenizer, dtype=args.dtype)
    args.func(args, backend, problems)


def main(argv: list[str] | None = None) -> int:
    return run(_command, build_parser(), argv)
