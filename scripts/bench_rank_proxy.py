"""The ranking proxy in front of a real vLLM server, measured with vLLM's own benchmark client, beside the simulator.

Run with the vLLM venv's python; the proxies run in the core venv (``--core-python``).  One server with
``--scheduling-policy priority`` (a small KV cache and batch cap, so that requests queue); the ``--arms`` against
it, their order rotated from repeat to repeat (each arm in each position once every len(arms) repeats):

* ``fcfs``: the client straight to the server (every request priority 0: arrival order, vLLM's FCFS);
* ``ranker``: through ``python -m toolkit ranking proxy RANKER --aging-s 0``, priority from the ngram ranker on
  the prompt, no aging;
* ``ranker-aged``: the same proxy with ``--aging-s`` (the proxy's default): priority from the prediction and the
  arrival time, so that no request starves;
* ``oracle``: through the proxy with ``--oracle`` (priority = ``max_tokens``, which the client sets to the true
  reply length): the ceiling.

The client runs ``--dataset-name sharegpt --dataset-path JSON --ignore-eos`` (each reply exactly its recorded
length) at a burst (``inf``) and at Poisson rates, given in requests/s or as multiples of FCFS's request rate in
the burst (``0.5x``: the server's saturated rate, so ``1.5x`` is past saturation).  Per arm and rate: mean / p50 /
p90 / p99 / max end-to-end latency pooled over the repeats, each with a 95% bootstrap interval (requests resampled
within repeats resampled), failed requests, preemptions (the server's ``vllm:num_preemptions_total``), the proxy's
FCFS fallbacks (requests its ranker could not score), and the FCFS/arm ratios of mean, p90 and max with paired
bootstrap intervals (the same requests of a repeat in both arms).  The JSON (``--out``) is rewritten after every
run, so a long measurement that is stopped keeps what it measured; the table goes beside it as ``.md``.  The same
command again resumes it: the (repeat, rate, arm) runs already in ``--out`` are kept and skipped, with their cost
model and burst rate, so a measurement longer than one sitting is split into runs; more ``--repeats`` or ``--rates``
extend it, other settings are refused (they would pool runs of different measurements).

Beside each measured ratio, the simulator's (``eval.serving.ranking.simulator``) for the same requests and send
times, with the server's token budget, batch cap and KV cache, no starvation guard (vLLM has none), vLLM's
preemption (``SimConfig(preemption="memory")``: running requests stay, waiting ones are admitted by priority, KV
evictions recompute), the arm's aging, and a cost model measured on this very server first (``ranking calibrate
--server``; or ``--cost-model JSON``).

    .venv/bin/python -m toolkit ranking labels MODEL --out out/sg-heldout --records heldout \\
        --sharegpt-json out/sg-heldout.json
    .venv-vllm/bin/python scripts/bench_rank_proxy.py MODEL out/ranker-ngram out/sg-heldout.json \\
        --num-prompts 100 --rates inf,0.5x,1x,1.5x,2x --out out/bench/rank-proxy.json
    .venv-vllm/bin/python scripts/bench_rank_proxy.py MODEL out/ranker-ngram out/sg-heldout.json --smoke \\
        --out /tmp/rank-proxy-smoke.json                     # 6 requests of 8 tokens, one burst: the code paths
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
import bench_serve as bs  # noqa: E402  (the servers, the client and its summary)

from eval.serving.ranking.proxy import AGING_S  # noqa: E402
from toolkit.cliargs import ArgumentParser, UsageError, add_out, existing_path, positive_float, run  # noqa: E402

ARMS = ("fcfs", "ranker", "ranker-aged", "oracle")
POLICY = {"fcfs": "fcfs", "ranker": "ltr", "ranker-aged": "ltr", "oracle": "oracle"}  # the simulator's names
PROXY_OPTIONS = {
    "ranker": ["--aging-s", "0"],
    "oracle": ["--oracle", "--aging-s", "0"],
}  # ranker-aged: --aging-s
STATS = ("mean", "p50", "p90", "p99", "max")
RATIOS = ("mean", "p90", "max")  # FCFS/arm, with paired intervals
FALLBACK_MARKS = ("FCFS priority", "forwarded as is")  # the proxy's warnings for a request it did not score
SMOKE = dict(num_prompts=6, rates=["inf"], repeats=1, bootstrap=200)
SMOKE_OUTPUT_LEN = 8  # tokens per reply in a smoke run, whatever the recorded length
# the settings a resumed measurement must share with the runs already in --out (--rates and --repeats may grow)
SAME = ("model", "ranker", "dataset", "num_prompts", "arms", "aging_s", "seed", "kv_cache_mib", "max_num_seqs",
        "max_num_batched_tokens", "dtype", "smoke")  # fmt: skip
RUN_META = ("engine", "kv_tokens", "cost_model", "sim_config", "saturated_rps")  # kept on resume


def start_proxy(args, server, work: Path, arm: str) -> tuple[subprocess.Popen, str, Path]:
    """The proxy of ``arm`` in the core venv in front of ``server``, its ranker loaded, warmed up by one completion
    (whose priority a server without ``--scheduling-policy priority`` would refuse)."""
    upstream = server.url
    # the port held until the proxy listens on it (http.server binds with SO_REUSEADDR too)
    with contextlib.closing(bs._reserve_port()) as held:
        port = held.getsockname()[1]
        argv = [str(args.core_python), "-m", "toolkit", "ranking", "proxy", str(args.ranker)]
        argv += ["--upstream", upstream, "--port", str(port)]
        argv += PROXY_OPTIONS.get(arm, ["--aging-s", str(args.aging_s)])
        log = work / f"proxy-{arm}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's code, not an installed copy
        with open(log, "w") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                    r.read()
                break
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError(f"the proxy exited: {log.read_text()[-2000:]}") from None
                time.sleep(0.5)
        else:
            process.terminate()
            raise RuntimeError(f"the proxy did not come up in 120 s (log {log})")
    body = {"model": server.name, "prompt": "Say hi.", "max_tokens": 2}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        if "not loaded" in log.read_text():
            raise RuntimeError(f"the proxy did not load ranker {args.ranker}: {log.read_text()[-1000:]}")
        with urllib.request.urlopen(request, timeout=600) as r:
            r.read()
    except BaseException:
        process.terminate()
        raise
    return process, url, log


def client_flags(args, rate: float, repeat: int) -> list[str]:
    """The dataset and load flags of one client run (the same requests for every arm of a repeat)."""
    flags = ["--dataset-name", "sharegpt", "--dataset-path", str(args.dataset), "--num-prompts",
             str(args.num_prompts), "--request-rate", str(rate), "--ignore-eos", "--seed", str(args.seed + repeat)]  # fmt: skip
    return flags + (["--sharegpt-output-len", str(SMOKE_OUTPUT_LEN)] if args.smoke else [])


def sampled_requests(args, flags: list[str]):
    """The requests the client sends for ``flags``, in its order (vLLM's own sampling, same seed)."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    argv = ["--backend", "vllm", "--model", str(args.model), "--tokenizer", str(args.model), *flags]
    return get_samples(bs.client_parser().parse_args(argv), get_tokenizer(str(args.model)))


def simulated(run: dict, requests, scores, cost, config, aging_s: float | None = None) -> dict:
    """The simulator's latencies for one measured run: its requests, its send times, its arm's policy (and the
    proxy's aging for ``ranker-aged``)."""
    from dataclasses import replace

    import numpy as np

    from eval.serving.ranking.simulator import simulate

    config = replace(config, aging_s=aging_s if run["arm"] == "ranker-aged" else None)

    start = np.asarray(run["start_times"], float)
    order = np.argsort(start, kind="stable")
    arrival = start[order] - start.min()
    prompt = np.array([r.prompt_len for r in requests])[order]
    output = np.array([r.expected_output_len for r in requests])[order]
    finish = simulate(arrival, prompt, output, np.asarray(scores)[order], POLICY[run["arm"]], cost, config)
    latency = finish - arrival
    return {f"sim_{k}_s": float(v) for k, v in
            (("mean", latency.mean()), ("p50", np.median(latency)), ("p90", np.percentile(latency, 90)),
             ("max", latency.max()))}  # fmt: skip


def calibrated_cost(args, server, work: Path) -> dict:
    """The cost-model JSON: ``--cost-model``, else measured on ``server`` (batches and prompts within its
    limits, so that each decode batch runs at once and each prompt is prefilled in one step)."""
    from eval.serving.ranking.server_calibration import calibrate_server

    if args.cost_model:
        return json.loads(args.cost_model.read_text())
    seqs, budget = args.max_num_seqs, args.max_num_batched_tokens
    batches = sorted({1, max(1, seqs // 4), max(1, seqs // 2), seqs})
    prompts = sorted({64, 256, 512, min(1024, budget)} if not args.smoke else {16, 64})
    print(f"calibrating: decode batches {batches}, prompts {prompts}", file=sys.stderr, flush=True)
    cost = calibrate_server(
        server.url, server.name, tuple(batches), tuple(prompts), 48, 1 if args.smoke else 3
    )
    (work / "cost.json").write_text(json.dumps(cost))
    return cost


def rotate(arms: list[str], repeat: int) -> list[str]:
    """The arms' order in ``repeat``: rotated by one each repeat, so each arm runs in each position once every
    len(arms) repeats (a warming machine or a slow spell does not favour one arm)."""
    k = repeat % len(arms)
    return arms[k:] + arms[:k]


def previous(args) -> tuple[list[dict], dict]:
    """The runs already in ``--out`` and what was measured for them once (:data:`RUN_META`); none: ``[], {}``.
    Refuses a file of another measurement (a :data:`SAME` setting differs) before any server starts."""
    if not args.out.is_file():
        return [], {}
    try:
        saved = json.loads(args.out.read_text())
        meta, runs = saved["meta"], saved["runs"]
        keys = [(r["repeat"], r["rate"], r["arm"]) for r in runs]
    except (ValueError, KeyError, TypeError):
        raise UsageError(
            f"{args.out} is not a measurement of this script (to resolve, pass another --out)"
        ) from None
    for key in SAME:
        mine = getattr(args, key)
        mine = str(mine) if isinstance(mine, Path) else mine
        if meta.get(key) != mine:
            raise UsageError(f"{args.out} holds runs with --{key.replace('_', '-')} {meta.get(key)!r}, not {mine!r} "
                             "(to resolve, pass another --out, or the same settings to resume it)")  # fmt: skip
    if len(set(keys)) < len(keys):
        raise UsageError(f"{args.out} holds a run twice (to resolve, pass another --out)")
    if args.cost_model and json.loads(args.cost_model.read_text()) != meta.get("cost_model"):
        raise UsageError(
            f"{args.out} was simulated with another cost model (to resolve, leave out --cost-model)"
        )
    return runs, {k: meta[k] for k in RUN_META if k in meta}


def measure(args, work: Path, save=lambda runs, meta: None, done=(), run_meta=None) -> dict:
    """Start the server and the arms' proxies, calibrate, run every (repeat, rate, arm) not in ``done`` (the
    runs of an earlier sitting, measured with ``run_meta``); the runs and meta.  ``save(runs, meta)`` is called
    after every run."""
    from eval.serving.ranking.predictors import Ranker
    from eval.serving.ranking.simulator import CostModel, SimConfig

    runs = list(done)
    measured = {(r["repeat"], r["rate"], r["arm"]) for r in runs}
    plan = [(repeat, spec, rotate(args.arms, repeat)) for repeat in range(args.repeats)
            for spec in sorted(args.rates, key=lambda r: r != "inf")]  # fmt: skip
    todo = [(repeat, spec, arms) for repeat, spec, arms in plan
            if any((repeat, spec, arm) not in measured for arm in arms)]  # fmt: skip
    if not todo:
        return {"meta": dict(run_meta or {}), "runs": runs}
    engine = ["--dtype", args.dtype, "--kv-cache-memory-bytes", str(args.kv_cache_mib << 20),
              "--max-model-len", "2048", "--seed", "0", "--enforce-eager", "--no-enable-prefix-caching",
              "--scheduling-policy", "priority", "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    ranker = Ranker(args.ranker)
    with (
        bs.serving("priority", args.model, engine, work, bs.server_env(work)) as server,
        contextlib.ExitStack() as stack,
    ):
        # before the proxies: nothing else runs on the server; a resumed measurement keeps its cost model
        cost = (run_meta or {}).get("cost_model") or calibrated_cost(args, server, work)
        config = SimConfig(args.max_num_batched_tokens, args.max_num_seqs, 10**9, 1, server.kv_tokens(),
                           preemption="memory")  # fmt: skip
        proxies = {}
        for arm in args.arms:
            if arm != "fcfs":
                process, url, log = start_proxy(args, server, work, arm)
                stack.callback(process.wait, 30)
                stack.callback(process.terminate)
                proxies[arm] = (url, log)
        targets = {"fcfs": server.url, **{arm: url for arm, (url, _) in proxies.items()}}
        meta = {
            "engine": engine,
            "kv_tokens": server.kv_tokens(),
            "cost_model": cost,
            "sim_config": config.__dict__,
            "saturated_rps": (run_meta or {}).get("saturated_rps"),
        }  # fmt: skip  (FCFS's request rate in the burst: what "1x" means)
        for repeat, spec, arms in todo:
            rate = bs._resolve(spec, meta["saturated_rps"])
            flags = client_flags(args, rate, repeat)
            requests = sampled_requests(args, flags)
            scores = ranker.score([r.prompt for r in requests])
            for arm in arms:
                if (repeat, spec, arm) in measured:
                    continue
                marks = _fallbacks(proxies[arm][1]) if arm in proxies else 0
                before = server.counters()
                target = types.SimpleNamespace(url=targets[arm], name=server.name, model=server.model)
                result, argv = bs.bench_serve(target, flags, work / f"client-{arm}.log")
                after = server.counters()
                if result["input_lens"] != [r.prompt_len for r in requests]:
                    raise RuntimeError("the client sent other requests than vLLM's sampling gave this script")
                run = {"arm": arm, "rate": spec, "rate_rps": rate, "repeat": repeat, **bs.summary(result),
                       "start_times": result["start_times"], "command": bs.client_command(argv),
                       "latencies_s": [x if not e else None for x, e in zip(result["latencies"], result["errors"], strict=True)],
                       "preemptions": after[bs.COUNTERS[0]] - before[bs.COUNTERS[0]],
                       "ended": time.strftime("%Y-%m-%d %H:%M"),
                       "proxy_fallbacks": _fallbacks(proxies[arm][1]) - marks if arm in proxies else 0}  # fmt: skip
                run.update(simulated(run, requests, scores, CostModel.from_dict(cost), config, args.aging_s))
                runs.append(run)
                print(f"{spec} {arm}: mean {run['mean_e2el_ms'] / 1e3:.1f} s (simulated {run['sim_mean_s']:.1f}),"
                      f" p90 {run['p90_e2el_ms'] / 1e3:.1f} s, max {max(filter(None, run['latencies_s']), default=0):.1f} s, "
                      f"failed {run['failed']}, preemptions {run['preemptions']:.0f}", file=sys.stderr, flush=True)  # fmt: skip
                if spec == "inf" and arm == "fcfs" and meta["saturated_rps"] is None:
                    meta["saturated_rps"] = result["request_throughput"]
                save(runs, meta)
    return {"meta": meta, "runs": runs}


def _fallbacks(log: Path) -> int:
    """Requests the proxy forwarded in FCFS order so far (its warnings in ``log``)."""
    return sum(
        any(m in line for m in FALLBACK_MARKS) for line in log.read_text(errors="replace").splitlines()
    )


def _stat(name: str):
    """The statistic ``name`` of STATS over latencies with NaN for failed requests."""
    import numpy as np

    if name == "mean":
        return np.nanmean
    if name == "max":
        return np.nanmax
    q = float(name[1:])
    return lambda x: np.nanpercentile(x, q)


def bootstrap(
    groups: list, stat, paired: list | None = None, n: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``stat`` of the pooled ``groups`` (one latency array per repeat) and its 95% interval: repeats resampled,
    then requests within each; with ``paired`` (the same requests of each repeat in another arm), the ratio
    ``stat(paired) / stat(groups)`` on the same resampled requests."""
    import numpy as np

    groups = [np.asarray(g, float) for g in groups]
    others = [np.asarray(g, float) for g in paired] if paired is not None else None

    def value(a, b):
        return stat(b) / stat(a) if b is not None else stat(a)

    point = value(np.concatenate(groups), None if others is None else np.concatenate(others))
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n):
        reps = rng.integers(0, len(groups), len(groups))
        idx = [rng.integers(0, len(groups[r]), len(groups[r])) for r in reps]
        a = np.concatenate([groups[r][i] for r, i in zip(reps, idx, strict=True)])
        b = None if others is None else np.concatenate([others[r][i] for r, i in zip(reps, idx, strict=True)])
        draws.append(value(a, b))
    lo, hi = np.nanpercentile(draws, [2.5, 97.5])
    return float(point), float(lo), float(hi)


def summarize(args, runs: list[dict]) -> list[dict]:
    """Per rate and arm: STATS of the latencies pooled over repeats, FCFS/arm RATIOS (paired, by repeat), each
    with its bootstrap interval; the simulator's mean and max ratios (medians over repeats); counters summed."""
    import numpy as np

    rows = []
    for spec in sorted(dict.fromkeys(r["rate"] for r in runs), key=lambda r: r != "inf"):
        by = {
            arm: {r["repeat"]: r for r in runs if r["arm"] == arm and r["rate"] == spec} for arm in args.arms
        }

        def latencies(arm: str, repeats, by=by) -> list[list[float]]:
            return [[np.nan if x is None else x for x in by[arm][k]["latencies_s"]] for k in repeats]

        for arm, mine in by.items():
            if not mine:
                continue
            row = {"rate": spec, "arm": arm, "repeats": len(mine),
                   "requests": sum(len(r["latencies_s"]) for r in mine.values()),
                   **{k: sum(r[k] for r in mine.values()) for k in ("failed", "preemptions", "proxy_fallbacks")}}  # fmt: skip
            for name in STATS:
                row[f"{name}_s"] = bootstrap(latencies(arm, sorted(mine)), _stat(name), n=args.bootstrap)
            shared = sorted(set(mine) & set(by["fcfs"]))
            if arm != "fcfs" and shared:
                base, own = latencies("fcfs", shared), latencies(arm, shared)
                for name in RATIOS:
                    row[f"fcfs_over_arm_{name}"] = bootstrap(own, _stat(name), base, args.bootstrap)
                for name in ("mean", "max"):
                    key = f"sim_{name}_s"
                    row[f"sim_fcfs_over_arm_{name}"] = statistics.median(
                        by["fcfs"][k][key] / mine[k][key] for k in shared
                    )
            rows.append(row)
    return rows


def table(rows: list[dict]) -> list[str]:
    """The rows of :func:`summarize` as markdown: latencies with [95% interval], FCFS/arm ratios beside the
    simulator's."""

    def ci(v, unit=""):
        return (
            f"{v[0]:.1f}{unit} [{v[1]:.1f}, {v[2]:.1f}]"
            if unit == ""
            else f"{v[0]:.2f}x [{v[1]:.2f}, {v[2]:.2f}]"
        )

    lines = ["| rate | arm | runs × requests | mean s | p50 s | p90 s | p99 s | max s | FCFS/arm mean (sim) | "
             "FCFS/arm p90 | FCFS/arm max (sim) | preemptions | failed | proxy fallbacks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ratios = " | ".join(
            (ci(r[f"fcfs_over_arm_{k}"], "x") + (f" ({r[f'sim_fcfs_over_arm_{k}']:.2f}x)" if k != "p90" else ""))
            if f"fcfs_over_arm_{k}" in r else "1.00x" for k in RATIOS)  # fmt: skip
        lines.append(f"| {r['rate']} | {r['arm']} | {r['repeats']} × {r['requests'] // r['repeats']} | "
                     + " | ".join(ci(r[f"{k}_s"]) for k in STATS)
                     + f" | {ratios} | {r['preemptions']:.0f} | {r['failed']:.0f} | {r['proxy_fallbacks']:.0f} |")  # fmt: skip
    return lines


def _arms(text: str) -> list[str]:
    """argparse type: a comma list of ARMS, each once."""
    arms = [a.strip() for a in text.split(",") if a.strip()]
    if not arms or len(set(arms)) < len(arms) or not set(arms) <= set(ARMS):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of distinct arms among {', '.join(ARMS)}"
        )
    return arms


def _positive(text: str) -> int:
    """argparse type: an integer >= 1 (refused before any server starts)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="scripts/bench_rank_proxy.py", description=__doc__)
    p.add_argument("model", type=existing_path, help="served model directory")
    p.add_argument("ranker", type=existing_path, help="ngram ranker directory (`ranking train --kind ngram`)")
    p.add_argument("dataset", type=existing_path, help="ShareGPT JSON of held-out pairs (`ranking labels --sharegpt-json`)")  # fmt: skip
    p.add_argument("--num-prompts", type=_positive, default=100)
    p.add_argument("--rates", type=bs.rate_list, default=["inf", "0.5x", "1x", "1.5x", "2x"],
                   help="requests/s, inf (a burst) or multiples of FCFS's burst rate like 1.5x (default inf,0.5x,1x,1.5x,2x)")  # fmt: skip
    p.add_argument("--repeats", type=_positive, default=3, help="arm order rotated from repeat to repeat")
    p.add_argument(
        "--arms",
        type=_arms,
        default=list(ARMS),
        help=f"comma separated, fcfs among them (default {','.join(ARMS)})",
    )
    p.add_argument(
        "--aging-s",
        type=positive_float,
        default=AGING_S,
        help=f"the ranker-aged arm's proxy --aging-s (default {AGING_S:g})",
    )
    p.add_argument("--bootstrap", type=_positive, default=2000, help="bootstrap resamples per interval")
    p.add_argument("--seed", type=int, default=0, help="the client's sampling and arrivals; + repeat")
    p.add_argument("--kv-cache-mib", type=_positive, default=160, help="small, so that requests queue")
    p.add_argument("--max-num-seqs", type=_positive, default=16)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048)
    p.add_argument("--dtype", default="float32", help="float32 (this CPU has no bf16 units)")
    p.add_argument("--cost-model", type=existing_path, help="simulator cost model JSON (default: measure this server)")  # fmt: skip
    p.add_argument("--core-python", type=Path, default=ROOT / ".venv" / "bin" / "python",
                   help="python of the core venv, which runs the proxies (default: .venv/bin/python here)")  # fmt: skip
    p.add_argument(
        "--smoke", action="store_true", help="6 requests of 8 tokens, one burst, a short calibration"
    )
    add_out(p)
    return p


def _command(args) -> str:
    if args.smoke:
        vars(args).update(SMOKE)
    if not args.core_python.is_file():
        raise UsageError(
            f"{args.core_python} not found (to resolve, pass --core-python CORE_VENV/bin/python)"
        )
    if "fcfs" not in args.arms:
        raise UsageError("the ratios are FCFS's over each arm's (to resolve, keep fcfs in --arms)")
    if any(r.endswith("x") for r in args.rates) and "inf" not in args.rates:
        raise UsageError("rates like 1.5x are multiples of the burst's rate (to resolve, add inf to --rates)")
    # `timeout` and kill: unwind, stopping the server and the proxies
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    done, run_meta = previous(args)
    work = Path(tempfile.mkdtemp(prefix="rank-proxy-", dir="/tmp"))  # vLLM's ipc sockets: a short path
    try:
        result = measure(args, work, lambda runs, meta: save(args, runs, meta), done, run_meta)
    except BaseException:
        print(f"server, proxy and client logs kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    lines = save(args, result["runs"], result["meta"])
    return "\n".join(lines) + f"\nwrote {args.out} and {args.out.with_suffix('.md')}"


def save(args, runs: list[dict], run_meta: dict) -> list[str]:
    """The JSON (meta, runs, summary rows, table) and the table as ``.md`` beside it; the table's lines."""
    rows = summarize(args, runs) if runs else []
    lines = table(rows)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "load_average": os.getloadavg(),
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, **run_meta}  # fmt: skip
    bs.write_json(args.out, {"meta": meta, "runs": runs, "summary": rows, "table": lines})
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    return run(_command, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
