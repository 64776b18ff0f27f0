"""``scripts/bench_rank_proxy.py``: refusals in one line before any server starts; the simulator beside each run
with the arm's own policy; the table's ratios; and (slow) the whole measurement in smoke mode on vLLM's CPU server
with a tiny checkpoint, so it cannot rot."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from helpers import ROOT

SCRIPT = ROOT / "scripts" / "bench_rank_proxy.py"
sys.path.insert(0, str(ROOT / "scripts"))
import bench_rank_proxy as brp  # noqa: E402


def script(python: Path | str, *argv: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    return subprocess.run(
        [str(python), str(SCRIPT), *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--core-python", "/nonexistent/python"], "pass --core-python"),
        (["--rates", "1.5x"], "add inf to --rates"),
        (["--num-prompts", "0"], "not a positive integer"),
    ],
)
def test_bad_input_is_refused_in_one_line(tmp_path, extra, message):
    out = tmp_path / "x.json"
    argv = (
        str(tmp_path),
        str(tmp_path),
        str(SCRIPT),
        "--core-python",
        sys.executable,
        *extra,
        "--out",
        str(out),
    )
    run = script(sys.executable, *argv, tmp=tmp_path)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: ") and message in run.stderr and not out.exists()


def stored(tmp_path: Path, argv: list[str], runs: list[dict]) -> Path:
    """``--out`` as an earlier sitting of ``argv`` left it: its settings, what it measured once, ``runs``."""
    args = brp.build_parser().parse_args(argv)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    meta.update(engine=["--scheduling-policy", "priority"], kv_tokens=3584, cost_model={"source": "test"},
                sim_config={}, saturated_rps=0.4)  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "runs": runs, "summary": [], "table": []}))
    return args.out


def latency_runs(arms: list[str], repeats: int, n: int = 40) -> list[dict]:
    """Runs of a burst: FCFS's latencies, and each other arm's half of them, request by request."""
    import numpy as np

    runs = []
    for repeat in range(repeats):
        base = np.random.default_rng(repeat).exponential(20.0, n)
        for arm in arms:
            factor = 1.0 if arm == "fcfs" else 0.5
            runs.append({"arm": arm, "rate": "inf", "repeat": repeat, "latencies_s": list(base * factor),
                         "failed": 0, "preemptions": 2.0, "proxy_fallbacks": 0, "sim_mean_s": 10.0 * factor,
                         "sim_max_s": 30.0 * factor})  # fmt: skip
    return runs


def test_a_finished_measurement_is_summarized_again_without_a_server(tmp_path):
    """The same command over a measurement whose runs are all there: nothing is measured (the model here is
    an empty folder, so a server would not start), the runs and their cost model are kept, the table is
    recomputed from them."""
    out = tmp_path / "m.json"
    argv = [str(tmp_path), str(tmp_path), str(SCRIPT), "--core-python", sys.executable, "--arms", "fcfs,oracle",
            "--rates", "inf", "--repeats", "2", "--num-prompts", "40", "--bootstrap", "200", "--out", str(out)]  # fmt: skip
    runs = latency_runs(["fcfs", "oracle"], 2)
    stored(tmp_path, argv, runs)
    run = script(sys.executable, *argv, tmp=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "starting" not in run.stderr  # no server
    result = json.loads(out.read_text())
    assert result["runs"] == runs and result["meta"]["cost_model"] == {"source": "test"}
    oracle = next(r for r in result["summary"] if r["arm"] == "oracle")
    assert oracle["repeats"] == 2 and oracle["fcfs_over_arm_mean"][0] == pytest.approx(2.0)
    assert out.with_suffix(".md").read_text().count("| oracle |") == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (["--seed", "1"], "holds runs with --seed 0, not 1"),
        (["--arms", "fcfs,ranker"], "holds runs with --arms"),
        (["--num-prompts", "41"], "holds runs with --num-prompts 40, not 41"),
        ("not json", "is not a measurement of this script"),
        ("twice", "holds a run twice"),
    ],
)
def test_a_resume_of_another_measurement_is_refused(tmp_path, change, message):
    """Runs of other settings would be pooled with the new ones: refused in one line before any server
    starts, the file left as it was."""
    out = tmp_path / "m.json"
    argv = [str(tmp_path), str(tmp_path), str(SCRIPT), "--core-python", sys.executable, "--arms", "fcfs,oracle",
            "--rates", "inf", "--repeats", "1", "--num-prompts", "40", "--out", str(out)]  # fmt: skip
    runs = latency_runs(["fcfs", "oracle"], 1)
    stored(tmp_path, argv, runs + runs[:1] if change == "twice" else runs)
    if change == "not json":
        out.write_text("{")
    before = out.read_text()
    run = script(sys.executable, *(argv + change if isinstance(change, list) else argv), tmp=tmp_path)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    assert message in run.stderr and "to resolve" in run.stderr and out.read_text() == before


def test_each_arm_is_simulated_with_its_own_policy():
    """A burst of one long request first and four short ones: FCFS serves the long one first, the ranker (whose
    scores here say the opposite of the truth) last-first, the oracle shortest first; the aged ranker with an
    aging far shorter than the run is FCFS again."""
    from eval.serving.ranking.simulator import CostModel, SimConfig

    requests = [types.SimpleNamespace(prompt_len=10, expected_output_len=n) for n in (200, 5, 5, 5, 5)]
    wrong_scores = [1.0, -1.0, -1.0, -1.0, -1.0]  # higher = shorter: the long one ranked shortest
    config = SimConfig(token_budget=64, max_batch=1, starvation_threshold=10**9, quantum=1)
    starts = [5.0, 5.1, 5.2, 5.3, 5.4]
    sims = {
        arm: brp.simulated(
            {"arm": arm, "start_times": starts}, requests, wrong_scores, CostModel(), config, 1e-4
        )
        for arm in brp.ARMS
    }
    assert (
        sims["oracle"]["sim_mean_s"]
        < sims["fcfs"]["sim_mean_s"]
        == pytest.approx(sims["ranker"]["sim_mean_s"])
    )
    assert sims["ranker-aged"]["sim_mean_s"] == pytest.approx(sims["fcfs"]["sim_mean_s"])
    assert sims["oracle"]["sim_p50_s"] < sims["oracle"]["sim_p90_s"] <= sims["oracle"]["sim_max_s"]


def test_arm_order_rotates_through_every_position():
    arms = list(brp.ARMS)
    orders = [brp.rotate(arms, r) for r in range(len(arms))]
    for position in range(len(arms)):
        assert sorted(order[position] for order in orders) == sorted(arms)
    assert brp.rotate(arms, len(arms)) == arms


def test_summary_pools_repeats_with_bootstrap_intervals():
    import numpy as np

    rng = np.random.default_rng(0)
    base = [rng.exponential(20.0, 50) for _ in range(3)]
    runs = []
    for repeat, lat in enumerate(base):
        for arm, factor in (("fcfs", 1.0), ("ranker", 0.5), ("oracle", 0.25)):
            latencies = list(lat * factor)
            if arm == "ranker" and repeat == 0:
                latencies[0] = None  # a failed request
            runs.append({"arm": arm, "rate": "inf", "repeat": repeat, "latencies_s": latencies, "failed": 0,
                         "preemptions": 1.0, "proxy_fallbacks": 0, "sim_mean_s": 10.0 * factor,
                         "sim_max_s": 30.0 * factor})  # fmt: skip
    args = types.SimpleNamespace(arms=["fcfs", "ranker", "oracle"], bootstrap=300)
    rows = {r["arm"]: r for r in brp.summarize(args, runs)}
    pooled = np.concatenate(base)
    assert rows["fcfs"]["mean_s"][0] == pytest.approx(pooled.mean())
    assert rows["fcfs"]["max_s"][0] == pytest.approx(pooled.max())
    assert rows["fcfs"]["p99_s"][0] == pytest.approx(np.percentile(pooled, 99))
    for name in brp.STATS:
        point, lo, hi = rows["fcfs"][f"{name}_s"]
        assert lo <= point <= hi
    point, lo, hi = rows["oracle"]["fcfs_over_arm_mean"]
    assert (
        point == pytest.approx(4.0) and lo == pytest.approx(4.0) and hi == pytest.approx(4.0)
    )  # paired: exact
    assert rows["ranker"]["fcfs_over_arm_max"][0] == pytest.approx(2.0)
    assert rows["ranker"]["requests"] == 150 and rows["ranker"]["sim_fcfs_over_arm_mean"] == pytest.approx(
        2.0
    )
    lines = brp.table(list(rows.values()))
    oracle = next(line for line in lines if "| oracle |" in line).split(" | ")
    assert oracle[2] == "3 × 50" and oracle[8] == "4.00x [4.00, 4.00] (4.00x)"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.smollm2
def test_smoke(smollm2, sharegpt, vllm_python, tmp_path):
    """SmolLM2 served with --scheduling-policy priority; the ngram ranker of recorded lengths in the proxy; every
    arm completes its requests and the simulator runs with the given cost model.  The server's calibration is a
    timing of an idle machine (on a loaded one a batch's streams need not overlap): its rules are tested against
    a fake vLLM of known step times (tests/eval/serving/ranking/test_server_calibration.py)."""
    from eval.serving.ranking.labels import sharegpt_lengths, unique_pairs, write_sharegpt_json
    from eval.serving.ranking.simulator import CostModel
    from eval.serving.ranking.train import TrainConfig, train_ranker

    sharegpt_lengths(smollm2, tmp_path / "lengths", records="train", limit=300)
    ranker = train_ranker(tmp_path / "lengths", tmp_path / "ranker", TrainConfig(kind="ngram", ngram_bits=16))
    # held-out pairs with short prompts (<= 200 characters, some 50 tokens): the smoke is about the code paths,
    # and prefilling ShareGPT's long prompts (up to the client's 1,024 tokens) was most of the engine's work
    short = [(p, r) for p, r in unique_pairs("sharegpt", "heldout") if len(p) <= 200]
    dataset = write_sharegpt_json(short[:200], tmp_path / "heldout.json")
    out, cost = tmp_path / "result.json", tmp_path / "cost.json"
    cost.write_text(json.dumps({**dataclasses.asdict(CostModel(0.02, 1e-4, 2e-3)), "source": "test"}))
    argv = (
        str(smollm2),
        str(ranker),
        str(dataset),
        "--smoke",
        "--cost-model",
        str(cost),
        "--core-python",
        sys.executable,
        "--out",
        str(out),
    )
    run = script(vllm_python, *argv, tmp=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["arm"] for r in result["runs"]] == list(brp.ARMS)
    assert len(result["summary"]) == len(brp.ARMS) and out.with_suffix(".md").is_file()
    for r in result["runs"]:
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_lens"] == [brp.SMOKE_OUTPUT_LEN] * 6
        assert r["proxy_fallbacks"] == 0 and r["sim_mean_s"] > 0
    assert result["meta"]["cost_model"] == json.loads(cost.read_text()) and result["meta"]["kv_tokens"] > 0
    assert len(result["table"]) == 2 + len(brp.ARMS) and "--scheduling-policy" in result["meta"]["engine"]

    # stopped before its last run: the same command measures that run only and keeps the others
    kept = result["runs"][:-1]
    out.write_text(json.dumps({**result, "runs": kept}))
    run = script(vllm_python, *argv, tmp=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    resumed = json.loads(out.read_text())
    assert resumed["runs"][:-1] == kept and resumed["runs"][-1]["arm"] == result["runs"][-1]["arm"]
    assert (
        resumed["runs"][-1]["completed"] == 6 and resumed["meta"]["kv_tokens"] == result["meta"]["kv_tokens"]
    )
    assert sum(f"inf {arm}:" in run.stderr for arm in brp.ARMS) == 1  # one run measured
    assert len(resumed["summary"]) == len(brp.ARMS)
