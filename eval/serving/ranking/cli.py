"""``swiftkv ranking``: traces, labels, train, evaluate, proxy, calibrate, simulate (thin argparse over the functions)."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Literal, get_args, get_origin

from toolkit.cliargs import (
    ArgumentParser,
    UsageError,
    add_checkpoint,
    add_dtype,
    add_force,
    add_limit,
    add_model,
    add_out,
    add_seed,
    command_parser,
    existing_path,
    float_list,
    int_list,
    positive_float,
    run,
)

EPILOG = """examples:
  swiftkv ranking traces MODEL --out out/traces --data sharegpt --limit 2000 --max-new-tokens 512
  swiftkv ranking labels MODEL --out out/sharegpt-lengths                      # recorded ShareGPT reply lengths
  swiftkv ranking train out/sharegpt-lengths --out out/ranker-ngram --kind ngram  # cheap, for the proxy
  swiftkv ranking proxy out/ranker-ngram --upstream http://127.0.0.1:8000 --port 8100
  swiftkv ranking proxy-overhead out/ranker-ngram --prompt-tokens 1000             # ms added per request
  swiftkv ranking train out/traces --out out/ranker --kind swiftkv-head       # x_{L//2} of the traces' model
  swiftkv ranking train out/traces --out out/ranker-lm --kind small-lm --backbone-layers 8 --lr 1e-4
  swiftkv ranking train out/traces --out out/ranker-cls --objective buckets    # classification baseline
  swiftkv ranking evaluate out/ranker out/traces                              # Kendall's tau, held-out
  swiftkv ranking evaluate out/ranker-ngram out/heldout --split all --with out/ranker-head   # and combined
  swiftkv ranking calibrate MODEL --out out/cost.json                              # transformers step times
  swiftkv ranking calibrate --server http://127.0.0.1:8000 --out out/cost-vllm.json  # a vLLM server's
  swiftkv ranking simulate out/ranker out/traces --rate 2,8,32 --policy fcfs,ltr,oracle --cost-model out/cost.json
"""


TORCH_DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> ArgumentParser:
    from .proxy import AGING_S, CLIENT_TIMEOUT, MAX_CONNECTIONS
    from .train import TrainConfig

    parser, sub = command_parser(
        "swiftkv ranking",
        "Learning-to-rank output lengths: traces, predictors (ListMLE), and an SJF scheduler simulator.",
        EPILOG,
    )

    p = sub.add_parser(
        "traces", help="sample (prompt, output length) pairs from the target model (resumable)"
    )
    add_checkpoint(p)
    add_out(p, help="traces directory (a rerun continues it)")
    p.add_argument("--data", default="sharegpt", help="`sharegpt` or a JSONL of conversations")
    add_limit(p, 2000, "prompts in total (a rerun continues to this count)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="length cap (the label cap)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    add_dtype(p, "float32", TORCH_DTYPES)
    add_seed(p)

    p = sub.add_parser(
        "labels", help="ShareGPT's recorded reply lengths in MODEL's tokenizer, as vLLM's client counts"
    )
    add_checkpoint(p)
    add_out(p, help="traces directory to write")
    p.add_argument("--data", default="sharegpt", help="`sharegpt` or a ShareGPT-format JSONL")
    p.add_argument("--records", choices=["train", "heldout", "all"], default="train", help="embedded split")
    p.add_argument("--limit", type=int, default=None, help="at most this many pairs")
    p.add_argument(
        "--sharegpt-json", help="also write the pairs as a ShareGPT JSON for vLLM's --dataset-path"
    )

    p = sub.add_parser(
        "proxy", help="OpenAI-compatible proxy: score each request, forward it with `priority`"
    )
    add_model(p, "ranker", help="ngram ranker directory (from `train --kind ngram`)")
    p.add_argument(
        "--upstream", required=True, help="vLLM server URL, started with --scheduling-policy priority"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--scale", type=float, default=1000.0, help="priority = -round(score * scale)")
    p.add_argument(
        "--oracle", action="store_true", help="benchmarks only: priority = the request's max_tokens"
    )
    p.add_argument(
        "--max-connections",
        type=_positive_int,
        default=MAX_CONNECTIONS,
        help=f"connections served at once; the next get a 503 (default {MAX_CONNECTIONS})",
    )
    p.add_argument(
        "--client-timeout",
        type=positive_float,
        default=CLIENT_TIMEOUT,
        help="seconds a client may take to send a request or idle between requests; then it is dropped "
        f"(default {CLIENT_TIMEOUT:g})",
    )
    p.add_argument(
        "--skip-upstream-check",
        action="store_true",
        help="start without probing that the upstream accepts a request priority",
    )
    p.add_argument(
        "--honour-client-priority",
        action="store_true",
        help="keep a priority the client sent (trusted clients only); by default the ranker's replaces it",
    )
    p.add_argument(
        "--aging-s",
        type=_non_negative_float,
        default=AGING_S,
        help="seconds of waiting worth one unit of predicted log length: a request that arrived this much "
        f"earlier outranks one predicted e times shorter, so none starves (0: off; default {AGING_S:g})",
    )

    p = sub.add_parser(
        "proxy-overhead", help="wall-clock ms the proxy adds per request (HTTP relay included, fake upstream)"
    )
    add_model(p, "ranker", help="ngram ranker directory")
    p.add_argument("--prompt-tokens", type=_positive_int, default=1000)
    p.add_argument("--repeats", type=_positive_int, default=300, help="requests each way")
    add_out(p, help="also write the result as JSON", required=False)

    p = sub.add_parser("train", help="train a ranker on the training split and export it")
    add_model(p, "traces", help="traces directory or JSONL with `prompt` and `output_len`")
    add_out(p, help="ranker directory (complete or absent)")
    add_force(p)
    for name, field in TrainConfig.model_fields.items():  # one flag per config field; pydantic validates
        annotation = field.annotation
        kind = (
            int if annotation in (int, int | None) else float if annotation in (float, float | None) else str
        )
        choices = get_args(annotation) if get_origin(annotation) is Literal else None
        help_text = f"{field.description or ''} (default {field.default})".strip()
        p.add_argument(
            "--" + name.replace("_", "-"), type=kind, choices=choices, default=None, help=help_text
        )

    p = sub.add_parser("evaluate", help="Kendall's tau on held-out prompts (or --split all for new traces)")
    add_model(p, "ranker", help="ranker directory (from `train`)")
    add_model(p, "traces", help="traces directory or JSONL")
    p.add_argument("--split", choices=["held-out", "all"], default="held-out")
    p.add_argument(
        "--with",
        dest="combine_with",
        type=existing_path,
        action="append",
        default=[],
        metavar="RANKER",
        help="another ranker to score the same prompts (those none was trained on) and combine with, by the mean "
        "of standardized scores (repeatable)",
    )
    add_out(p, help="also write the result as JSON (the table's numbers and more)", required=False)

    p = sub.add_parser(
        "calibrate",
        help="fit the simulator's cost model to step times: transformers forwards of MODEL, or a vLLM --server",
    )
    add_checkpoint(p, nargs="?", help="model to time in transformers (or pass --server instead)")
    add_out(p, help="cost-model JSON to write")
    p.add_argument("--repeats", type=_positive_int, default=3)
    add_dtype(p, "float32", TORCH_DTYPES)
    server = p.add_argument_group("a running vLLM server (timed requests through its OpenAI API)")
    server.add_argument("--server", help="its URL, e.g. http://127.0.0.1:8000")
    server.add_argument(
        "--served-model", help="the model name requests carry (default: the only one it lists)"
    )
    server.add_argument(
        "--batches",
        type=int_list,
        default=[1, 4, 8, 16],
        help="decoding sequences per step (<= --max-num-seqs)",
    )
    server.add_argument(
        "--prompt-lens",
        type=int_list,
        default=[64, 256, 512, 1024],
        help="prefill tokens (<= --max-num-batched-tokens)",
    )
    server.add_argument("--decode-tokens", type=_positive_int, default=48, help="tokens per decoding request")

    p = sub.add_parser("simulate", help="latency/throughput of FCFS, LTR-SJF and oracle SJF at Poisson rates")
    add_model(p, "ranker", help="ranker directory (from `train`)")
    add_model(p, "traces", help="traces directory or JSONL")
    p.add_argument("--rate", type=float_list, default=[2.0, 8.0, 32.0], help="requests/s, comma separated")
    p.add_argument("--policy", type=_names, default=["fcfs", "ltr", "oracle"], help="comma separated")
    p.add_argument(
        "--requests", type=int, default=500, help="requests per rate (sampled from held-out traces)"
    )
    p.add_argument(
        "--cost-model", type=existing_path, help="JSON from `calibrate` (default: SmolLM2 on a 2-core CPU)"
    )
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--starvation-threshold", type=int, default=200)
    p.add_argument("--quantum", type=int, default=10)
    p.add_argument(
        "--kv-capacity", type=int, help="KV tokens (default unlimited); preempted requests re-prefill"
    )
    p.add_argument(
        "--preemption",
        choices=["priority", "memory"],
        default="priority",
        help="priority: re-rank every iteration (the paper); memory: vLLM's (running requests stay)",
    )
    p.add_argument(
        "--aging-s", type=_non_negative_float, default=0.0, help="ltr aging, as the proxy's (0: off)"
    )
    p.add_argument("--split", choices=["held-out", "all"], default="held-out")
    add_seed(p)
    add_out(p, help="also write the results as JSON", required=False)
    return parser


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (checked before any work)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (checked before any work)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _command(args) -> str | None:
    from toolkit.artifacts import write_json_atomic
    from toolkit.checkpoint import open_checkpoint

    if args.command == "traces":
        from .traces import generate_traces

        return str(
            generate_traces(
                open_checkpoint(args.model, model_types=None).path,
                args.out,
                args.data,
                args.limit,
                args.max_new_tokens,
                args.max_prompt_tokens,
                args.batch_size,
                args.temperature,
                args.seed,
                args.dtype,
            )
        )
    if args.command == "labels":
        from .labels import sharegpt_lengths, unique_pairs, write_sharegpt_json

        file = sharegpt_lengths(args.model, args.out, args.data, args.records, args.limit)
        if args.sharegpt_json:
            write_sharegpt_json(unique_pairs(args.data, args.records), args.sharegpt_json)
        return str(file)
    if args.command == "proxy":
        from .proxy import serve

        serve(
            args.ranker,
            args.upstream,
            args.host,
            args.port,
            args.scale,
            args.oracle,
            max_connections=args.max_connections,
            client_timeout=args.client_timeout,
            check_upstream=not args.skip_upstream_check,
            honour_client_priority=args.honour_client_priority,
            aging_s=args.aging_s or None,
        )
        return None
    if args.command == "proxy-overhead":
        from .proxy import overhead_ms

        result = overhead_ms(args.ranker, args.prompt_tokens, args.repeats)
        if args.out:
            write_json_atomic(args.out, result)
        return json.dumps(result, indent=2)
    if args.command == "train":
        from .train import TrainConfig, train_ranker

        options = {k: v for k, v in vars(args).items() if k in TrainConfig.model_fields and v is not None}
        return str(train_ranker(args.traces, args.out, TrainConfig(**options), force=args.force))
    if args.command == "evaluate":
        from .train import evaluate_ranker, evaluation_table

        result = evaluate_ranker(args.ranker, args.traces, args.split, combine_with=tuple(args.combine_with))
        if args.out:
            write_json_atomic(args.out, result)
        return evaluation_table(result) + (f"\nwrote {args.out}" if args.out else "")
    if args.command == "calibrate":
        return _calibrate(args)
    return _simulate(args)


def _calibrate(args) -> str:
    """Cost model from transformers forwards of MODEL or from a running server's streams (exactly one)."""
    from dataclasses import asdict

    from toolkit.artifacts import write_json_atomic
    from toolkit.checkpoint import open_checkpoint

    if (args.model is None) == (args.server is None):
        raise UsageError("calibrate times either MODEL or a --server (to resolve, pass exactly one)")
    if args.server is None:
        from .simulator import calibrate_cost_model

        model = open_checkpoint(args.model, tokenizer=False, model_types=None).path  # times forwards only
        cost = asdict(calibrate_cost_model(model, args.repeats, args.dtype))
        write_json_atomic(args.out, {**cost, "model": str(args.model)})
        return json.dumps(cost)
    from .server_calibration import Endpoint, calibrate_server

    Endpoint.parse(args.server)  # a malformed URL is refused before any request
    result = calibrate_server(
        args.server,
        args.served_model,
        tuple(args.batches),
        tuple(args.prompt_lens),
        args.decode_tokens,
        args.repeats,
    )
    write_json_atomic(args.out, result)
    return json.dumps({k: result[k] for k in ("base", "prefill_token", "decode_token", "request_overhead_s")})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(_command, build_parser(), argv)


def _simulate(args) -> None:
    import numpy as np

    from toolkit.artifacts import write_json_atomic

    from .simulator import CostModel, SimConfig, results_json, results_table, run_policies
    from .train import held_out_traces, load_ranker

    traces = held_out_traces(args.ranker, args.traces, args.split)
    scores = load_ranker(args.ranker, args.traces).score([t.prompt for t in traces], progress=True)
    cost = CostModel.load(args.cost_model) if args.cost_model else CostModel()
    config = SimConfig(
        args.token_budget,
        args.max_batch,
        args.starvation_threshold,
        args.quantum,
        args.kv_capacity,
        args.preemption,
        args.aging_s or None,
    )
    results = run_policies(
        np.array([t.prompt_len for t in traces]),
        np.array([t.output_len for t in traces]),
        scores,
        args.rate,
        args.policy,
        args.requests,
        cost,
        config,
        args.seed,
    )
    print(results_table(results))
    if args.out:
        write_json_atomic(
            args.out,
            {"cost_model": cost.__dict__, "config": config.__dict__, "results": results_json(results)},
        )
