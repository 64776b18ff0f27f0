"""The ranking proxy in front of a real vLLM server, measured with vLLM's own benchmark client.

Run with the vLLM venv's python.  One server with ``--scheduling-policy priority`` (a limited KV cache and batch
cap, so that requests queue); three arms against it, in alternating order per repeat:

* ``fcfs``: the client straight to the server (every request priority 0: arrival order, vLLM's FCFS);
* ``ranker``: through ``swiftkv ranking proxy RANKER`` (the core venv), priority from the ngram
  ranker on the prompt text;
* ``oracle``: through the proxy with ``--oracle`` (priority = ``max_tokens``, which the client sets to the true
  reply length): the ceiling.

The client runs ``--dataset-name sharegpt --dataset-path JSON --ignore-eos`` (each reply exactly its recorded
length), a burst (``inf``) or Poisson rates.  Reports mean / p50 / p90 end-to-end latency, failures and
preemptions (the server's ``vllm:num_preemptions_total``) per arm and the FCFS/arm ratios.

    .venv/bin/swiftkv ranking labels MODEL --out out/sg-heldout --records heldout \\
        --sharegpt-json out/sg-heldout.json
    .venv-vllm/bin/python scripts/bench_rank_proxy.py MODEL out/ranker-ngram out/sg-heldout.json \\
        --num-prompts 100 --rates inf --out out/bench/rank-proxy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve as bs  # noqa: E402  (the servers, the client and its summary)

CORE_PYTHON = bs.ROOT / ".venv" / "bin" / "python"
ARMS = ("fcfs", "ranker", "oracle")


def start_proxy(ranker: Path | None, upstream: str, work: Path, oracle: bool) -> tuple[subprocess.Popen, str]:
    port = bs._free_port()
    argv = [str(CORE_PYTHON), "-m", "toolkit", "ranking", "proxy", str(ranker or work / "none")]
    argv += ["--upstream", upstream, "--port", str(port)] + (["--oracle"] if oracle else [])
    log = open(work / f"proxy-{'oracle' if oracle else 'ranker'}.log", "w")
    env = {**os.environ, "PYTHONPATH": str(bs.ROOT)}
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=bs.ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                r.read()
            return process, url
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the proxy exited; see {log.name}") from None
            time.sleep(0.5)
    raise RuntimeError("the proxy did not come up in 120 s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="served model directory")
    p.add_argument("ranker", type=Path, help="ngram ranker directory")
    p.add_argument(
        "dataset", type=Path, help="ShareGPT JSON of held-out pairs (`ranking labels --sharegpt-json`)"
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--rates", default="inf", help="comma separated requests/s; inf = a burst")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--kv-cache-mib", type=int, default=160, help="small, so that requests queue")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", help="float32 (this CPU has no bf16 units)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    for path in (args.model, args.ranker, args.dataset):
        if not path.exists():
            print(f"{path} not found; to resolve, pass an existing path (see --help)", file=sys.stderr)
            return 2
    work = Path(tempfile.mkdtemp(prefix="rank-proxy-"))
    engine = ["--dtype", args.dtype, "--kv-cache-memory-bytes", str(args.kv_cache_mib << 20),
              "--max-model-len", "2048", "--seed", "0", "--enforce-eager", "--no-enable-prefix-caching",
              "--scheduling-policy", "priority", "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    runs = []
    with bs.serving("priority", args.model, engine, work, bs.server_env(work)) as server:
        proxies = {
            arm: start_proxy(args.ranker, server.url, work, arm == "oracle") for arm in ("ranker", "oracle")
        }
        try:
            targets = {"fcfs": server.url, **{arm: url for arm, (_, url) in proxies.items()}}
            for repeat in range(args.repeats):
                for rate in args.rates.split(","):
                    for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                        flags = ["--dataset-name", "sharegpt", "--dataset-path", str(args.dataset),
                                 "--num-prompts", str(args.num_prompts), "--request-rate", rate,
                                 "--ignore-eos", "--seed", str(repeat)]  # fmt: skip
                        before = server.counters()
                        target = types.SimpleNamespace(url=targets[arm], name=server.name, model=server.model)
                        result, client_argv = bs.bench_serve(target, flags, work / f"client-{arm}.log")
                        after = server.counters()
                        row = {"arm": arm, "rate": rate, "repeat": repeat, **bs.summary(result)}
                        row["preemptions"] = after[bs.COUNTERS[0]] - before[bs.COUNTERS[0]]
                        runs.append(row)
                        print(f"{rate} {arm}: mean {row['mean_e2el_ms'] / 1e3:.1f} s, p90 "
                              f"{row['p90_e2el_ms'] / 1e3:.1f} s, failed {row['failed']}, "
                              f"preemptions {row['preemptions']:.0f}", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            for process, _ in proxies.values():
                process.terminate()
                process.wait(timeout=30)
    table = ["| rate | arm | mean s | p50 s | p90 s | FCFS/arm mean | FCFS/arm p90 | preemptions | failed |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for rate in args.rates.split(","):
        med = {arm: {k: statistics.median(r[k] for r in runs if r["arm"] == arm and r["rate"] == rate)
                     for k in ("mean_e2el_ms", "p50_e2el_ms", "p90_e2el_ms", "preemptions", "failed")}
               for arm in ARMS}  # fmt: skip
        for arm in ARMS:
            m = med[arm]
            table.append(f"| {rate} | {arm} | {m['mean_e2el_ms'] / 1e3:.1f} | {m['p50_e2el_ms'] / 1e3:.1f} | "
                         f"{m['p90_e2el_ms'] / 1e3:.1f} | {med['fcfs']['mean_e2el_ms'] / m['mean_e2el_ms']:.2f}x | "
                         f"{med['fcfs']['p90_e2el_ms'] / m['p90_e2el_ms']:.2f}x | {m['preemptions']:.0f} | "
                         f"{m['failed']:.0f} |")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"engine": engine, "client": bs.client_command(client_argv), "runs": runs,
                                    "table": table}, indent=1))  # fmt: skip
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
