"""``scripts/bench_serve.py`` end to end in smoke mode, so it cannot rot: tiny checkpoints (built here, with the
embedded SmolLM2 tokenizer) served by vLLM's OpenAI server on CPU, driven by vLLM's own benchmark client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.ci import NO_SUFFIX_REFERENCE
from helpers.models import tiny_base

import swiftkv.convert
from swiftkv.convert import read_config
from swiftkv.flops import Shape, ideal_workload_speedup

SCRIPT = ROOT / "scripts" / "bench_serve.py"
# head_dim 32: vLLM's CPU attention supports head sizes >= 32
TINY = dict(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=6)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2) -> tuple[Path, Path]:
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("bench-serve")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tiny_base("llama", **TINY, vocab_size=len(tokenizer)).save_pretrained(tmp / "base")
    tokenizer.save_pretrained(tmp / "base")
    model = swiftkv.convert.convert(tmp / "base", tmp / "skv", swiftkv_fraction=0.5)
    tokenizer.save_pretrained(model)
    return model, tmp / "base"


def script(python: Path | str, *argv: str, tmp: Path) -> subprocess.CompletedProcess:
    """The script as a user runs it, with this checkout's packages first on the path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    return subprocess.run(
        [str(python), str(SCRIPT), *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )


def gone(group: int) -> bool:
    """No live process (zombies waiting for their reaper aside) is left in process group ``group``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, ...
            return False
    return True


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.smollm2
def test_load_smoke(checkpoints, vllm_python, sharegpt, tmp_path):
    model, original = checkpoints
    out = tmp_path / "serve.json"
    run = script(vllm_python, "load", str(model), str(original), "--smoke", "--out", str(out), tmp=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert sorted((r["workload"], r["model"]) for r in runs) == [
        ("random", "original"), ("random", "swiftkv"), ("sharegpt", "original"), ("sharegpt", "swiftkv"),
    ]  # fmt: skip
    for r in runs:
        assert r["rate"] == "inf" and r["completed"] == 2 and r["failed"] == 0 and r["errors"] == []
        assert r["command"].startswith("vllm bench serve --backend vllm --base-url http://127.0.0.1:PORT")
        if r["workload"] == "random":
            assert r["input_lens"] == [128, 128] and r["output_lens"] == [16, 16]
        else:  # held-out conversations cut to 96-160 tokens, a tenth of that generated (EOS ignored)
            assert all(90 <= n <= 166 for n in r["input_lens"])
            assert all(9 <= n <= 16 for n in r["output_lens"])
    by = {(r["workload"], r["model"]): r for r in runs}
    assert (
        by["sharegpt", "original"]["input_lens"] == by["sharegpt", "swiftkv"]["input_lens"]
    )  # same requests

    shape = Shape.from_config(read_config(model))
    for row in result["rows"]:
        mine = by[row["workload"], "swiftkv"]
        o, s = by[row["workload"], "original"], mine
        assert row["throughput_ratio"] == pytest.approx(
            s["total_token_throughput"] / o["total_token_throughput"]
        )
        assert row["tpot_ratio"] == pytest.approx(s["p50_tpot_ms"] / o["p50_tpot_ms"])
        assert row["flop_ideal"] == pytest.approx(
            ideal_workload_speedup(shape, zip(mine["input_lens"], mine["output_lens"], strict=True))
        )
        assert row["flop_ideal"] > 1.0
    assert result["targets"]["no failed request"] == [0, True]
    assert "| sharegpt | inf |" in run.stdout and "no failed request: 0 (met)" in run.stdout
    assert all(gone(pid) for pid in result["meta"]["server_pids"].values())  # both process groups stopped
    engine = result["meta"]["engine"]
    assert "--no-enable-prefix-caching" in engine and "--enforce-eager" in engine

    plot = script(sys.executable, "plot", str(out), tmp=tmp_path)  # where matplotlib is
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.smollm2
def test_servers_exit_when_the_benchmark_is_killed(checkpoints, vllm_python, sharegpt, tmp_path):
    """SIGKILL of the benchmark once its first server is up (engine running) and its second is starting leaves
    no server behind (each is told to exit when its parent dies, and takes its engine with it)."""
    import re
    import selectors
    import signal
    import time

    model, original = checkpoints
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    argv = [
        str(vllm_python),
        str(SCRIPT),
        "load",
        str(model),
        str(original),
        "--smoke",
        "--out",
        str(tmp_path / "x"),
    ]
    bench = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    started, up, deadline = [], [], time.monotonic() + 900
    with selectors.DefaultSelector() as sel:
        sel.register(bench.stderr, selectors.EVENT_READ)
        while len(started) < 2 and time.monotonic() < deadline and bench.poll() is None:
            if sel.select(timeout=5):
                line = bench.stderr.readline()
                started += [int(g) for g in re.findall(r"server \(process group (\d+)\) starting", line)]
                up += [int(g) for g in re.findall(r"server \(process group (\d+)\) up", line)]
    running = [g for g in started if not gone(g)]
    bench.kill()
    bench.wait()
    assert len(started) == 2 and up == started[:1], (
        "the first server did not come up before the second started"
    )
    assert running == started  # both were running when the benchmark died
    deadline = time.monotonic() + 120
    while not all(gone(g) for g in started) and time.monotonic() < deadline:
        time.sleep(2)
    left = [g for g in started if not gone(g)]
    for g in left:  # clean up before failing
        os.killpg(g, signal.SIGKILL)
    assert not left, f"server process groups {left} outlived the benchmark"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.smollm2
def test_ranking_smoke(checkpoints, vllm_python, tmp_path):
    """Ranker scores from the core venv; FCFS, oracle and ranker priorities on the real server beside the
    simulator; every request generates its trace's reply length."""
    from helpers.ranking import trained_ranker

    from eval.serving.ranking.predictors import Ranker

    model, original = checkpoints
    ranker = trained_ranker(
        original, tmp_path / "ranker"
    )  # a swiftkv-head on x_l, served through the conversion
    scored = tmp_path / "requests.jsonl"
    argv = ("scores", str(ranker), str(tmp_path / "ranker-traces"), "--model", str(model), "--requests", "4",
            "--out", str(scored))  # fmt: skip
    run = script(sys.executable, *argv, tmp=tmp_path)  # the core venv, as a user runs it
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in scored.read_text().splitlines()]
    expected = Ranker(ranker, model).score([r["prompt"] for r in rows])
    assert [r["score"] for r in rows] == pytest.approx(expected.tolist())
    out = tmp_path / "ranking.json"
    argv = ("ranking", str(model), "--traces", str(scored), "--requests", "4", "--rate", "8", "--repeats", "1",
            "--kv-tokens", "512", "--enforce-eager", "--out", str(out))  # fmt: skip
    run = script(vllm_python, *argv, tmp=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["arm"] for r in result["runs"]] == ["fcfs", "oracle", "ltr"]
    lengths = sorted(r["output_len"] for r in rows)
    for r in result["runs"]:  # every request generated exactly its trace's reply length
        assert r["completed"] == 4 and r["failed"] == 0 and sorted(r["output_lens"]) == lengths
        assert r["mean_latency_s"] == pytest.approx(sum(r["latencies"]) / 4)
    assert result["meta"]["kv_tokens"] > 0  # the capacity the server reports, which the simulator is given
    for arm in ("fcfs", "oracle", "ltr"):
        assert result["rows"][arm]["sim_mean_latency_s"] > 0
    assert "--scheduling-policy" not in result["meta"]["engine"]  # only the priority server adds it


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.smollm2
def test_suffix_smoke(checkpoints, vllm_python, sharegpt, tmp_path):
    """vLLM's suffix method (arctic-inference's C++ tree, built outside the repository as for
    tests/eval/serving/suffix/test_arctic_reference.py) against no speculation; greedy replies agree."""
    site = os.environ.get("SUFFIX_REFERENCE_PATH")
    if not site:
        pytest.skip(NO_SUFFIX_REFERENCE)
    model, _ = checkpoints
    out = tmp_path / "suffix.json"
    argv = ("suffix", str(model), "--arctic-path", site, "--tasks", "2", "--rounds", "2", "--output-len", "16",
            "--repeats", "1", "--max-task-chars", "300", "--max-model-len", "256", "--kv-cache-mib", "128",
            "--enforce-eager", "--out", str(out))  # fmt: skip
    run = script(vllm_python, *argv, tmp=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted((r["round"], r["model"]) for r in result["runs"]) == [
        (0, "plain"), (0, "suffix"), (1, "plain"), (1, "suffix"),
    ]  # fmt: skip
    assert all(r["completed"] == 2 and r["failed"] == 0 for r in result["runs"])
    assert (
        result["rows"]["suffix"]["accepted_per_draft"] >= 0
        and result["rows"]["plain"]["acceptance_rate"] == 0
    )
    assert result["meta"]["spec"] == {"method": "suffix"}


def test_suffix_without_arctic_is_refused_in_one_line(tmp_path, tiny_llama_dir):
    out = tmp_path / "x.json"
    run = script(sys.executable, "suffix", str(tiny_llama_dir), "--out", str(out), tmp=tmp_path)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1
    assert "needs arctic_inference.suffix_decoding" in run.stderr and not out.exists()


def test_bad_rates_are_refused_in_one_line(tmp_path, tiny_llama_dir):
    out = tmp_path / "x.json"
    argv = ("load", str(tiny_llama_dir), str(tiny_llama_dir), "--rates", "0.5x,2", "--out", str(out))
    run = script(sys.executable, *argv, tmp=tmp_path)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1
    assert "add inf to --rates" in run.stderr and not out.exists()
