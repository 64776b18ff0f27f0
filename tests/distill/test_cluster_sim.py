"""Cluster simulator invariants, trace round trip, launch configs that accelerate/DeepSpeed accept, CLI."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from distill.cluster.cli import main
from distill.cluster.simulator import simulate
from distill.cluster.spec import Cluster
from distill.cluster.trace import generate_trace, read_trace, write_trace

CLUSTER = Cluster.model_validate(
    {
        "gpu_types": [
            {"name": "big", "nodes": 1, "gpus_per_node": 8, "memory_gb": 80, "tflops": 3.0},
            {"name": "mid", "nodes": 3, "gpus_per_node": 4, "memory_gb": 48, "tflops": 1.5},
            {"name": "small", "nodes": 2, "gpus_per_node": 4, "memory_gb": 16, "tflops": 0.6},
        ]
    }
)
ROUND = 60.0


@pytest.fixture(scope="module")
def trace():
    return generate_trace(CLUSTER, num_jobs=16, hours=1.0, seed=3)


@pytest.mark.parametrize("policy", ["sia", "gavel", "fifo"])
def test_simulator_invariants(trace, policy):
    res = simulate(CLUSTER, trace, policy, ROUND)
    assert not res.unfinished and len(res.jct) == len(trace)
    by_name = {j.name: j for j in trace}
    done = defaultdict(float)
    last_end = defaultdict(float)
    for seg in sorted(res.segments, key=lambda s: (s.job, s.start)):
        job = by_name[seg.job]
        assert seg.start >= job.arrival_s  # never runs before it arrives
        assert seg.start >= last_end[seg.job] - 1e-9  # one configuration at a time
        assert seg.throughput == pytest.approx(job.throughput(seg.config))
        assert seg.end <= res.finish[seg.job] + 1e-9
        last_end[seg.job] = seg.end
        done[seg.job] += seg.throughput * (seg.end - seg.start)
    for name, job in by_name.items():  # work conserved: exactly the job's work, no more, no less
        assert done[name] == pytest.approx(job.work, rel=1e-9)
        assert res.jct[name] == pytest.approx(res.finish[name] - job.arrival_s)
    caps = {t.name: t.capacity for t in CLUSTER.gpu_types}
    for _, usage in res.usage:
        assert all(usage[t] <= caps[t] for t in caps)
    busy = sum(s.config.gpus * (s.end - s.start) for s in res.segments)
    assert res.gpu_seconds >= busy - 1e-6  # restart time is paid for too
    m = res.metrics()
    assert m["jobs_done"] == len(trace) and m["avg_jct_h"] <= m["p99_jct_h"] <= m["makespan_h"]


def test_fixed_request_policies_never_resize(trace):
    requested = {j.name: j.requested_gpus for j in trace}
    for policy in ("gavel", "fifo"):
        res = simulate(CLUSTER, trace, policy, ROUND)
        assert all(s.config.gpus == requested[s.job] for s in res.segments)
    fifo = simulate(CLUSTER, trace, "fifo", ROUND)
    configs = defaultdict(set)
    for s in fifo.segments:
        configs[s.job].add(s.config)
    assert all(len(c) == 1 for c in configs.values())  # FIFO never preempts or migrates


def test_trace_round_trip_and_seed(tmp_path, trace):
    path = tmp_path / "t.csv"
    write_trace(path, trace)
    assert read_trace(path, CLUSTER) == trace
    assert generate_trace(CLUSTER, 16, 1.0, seed=3) == trace
    assert generate_trace(CLUSTER, 16, 1.0, seed=4) != trace
    path.write_text(path.read_text().replace("thr1_mid", "thr1_other"))
    with pytest.raises(ValueError, match="missing columns"):
        read_trace(path, CLUSTER)


def test_cli_plan_launch_configs_and_simulate(tmp_path, capsys):
    import yaml
    from accelerate.commands.config.config_args import ClusterConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        yaml.safe_dump({"gpu_types": [t.model_dump(exclude_none=True) for t in CLUSTER.gpu_types]})
    )
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        yaml.safe_dump(
            {
                "jobs": [
                    {
                        "name": "wide",
                        "activation_gb": 4.0,
                        "recipe": "r.yaml",
                        "student_params_b": 1.5,
                        "max_gpus": 8,
                        "observed": [
                            {"gpu_type": "big", "gpus": 1, "throughput": 20.0},
                            {"gpu_type": "mid", "gpus": 1, "throughput": 12.0},
                            {"gpu_type": "mid", "gpus": 4, "throughput": 46.0},
                            {"gpu_type": "mid", "gpus": 8, "throughput": 80.0},
                        ],
                    },
                    {"name": "fresh", "student_params_b": 0.1, "activation_gb": 4.0},
                ]
            }
        )
    )
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cluster), str(jobs), "--out", str(plan)]) == 0
    entries = {e["name"]: e for e in json.loads(plan.read_text())["jobs"]}
    # profile runs of "fresh" hold 1 GPU per type, so "big" has 7 left: 8 x mid (80/s, measured) beats
    # 4 x big (20 · 46/12 = 76.7/s by the ratio rule)
    assert (entries["wide"]["gpu_type"], entries["wide"]["gpus"], entries["wide"]["nodes"]) == ("mid", 8, 2)
    assert {f"fresh@profile-{t}" for t in ("big", "mid", "small")} == set(entries) - {"wide"}
    out = tmp_path / "launch"
    assert main(["launch-configs", str(plan), "--out", str(out)]) == 0
    for name, e in entries.items():
        acc = ClusterConfig.from_yaml_file(out / name / "accelerate.yaml")
        assert (acc.num_processes, acc.num_machines) == (e["gpus"], e["nodes"])
        assert acc.deepspeed_config["deepspeed_config_file"] == str((out / name / "deepspeed.json").resolve())
        ds = json.loads((out / name / "deepspeed.json").read_text())
        assert DeepSpeedZeroConfig(**ds["zero_optimization"]).stage == e["zero_stage"]
    wide = ClusterConfig.from_yaml_file(out / "wide" / "accelerate.yaml")
    assert (wide.main_process_ip, wide.gpu_ids) == ("mid-0", "all")
    assert "MACHINE_RANK=1 on mid-1" in (out / "wide" / "launch.sh").read_text()
    assert main(["launch-configs", str(plan), "--out", str(out)]) == 2  # refuses to overwrite without --force
    assert "not empty" in capsys.readouterr().err
    trace = tmp_path / "trace.csv"
    assert main(["trace", str(cluster), "--out", str(trace), "--limit", "6", "--hours", "0.5"]) == 0
    sim = tmp_path / "sim"
    assert main(["simulate", str(cluster), str(trace), "--policy", "sia,fifo", "--out", str(sim)]) == 0
    metrics = json.loads((sim / "metrics.json").read_text())["policies"]
    assert set(metrics) == {"sia", "fifo"} and (sim / "jct.png").stat().st_size > 0
    assert main(["simulate", str(cluster), str(trace), "--policy", "sia,nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
