"""Plans that launch: precision-aware placement, DeepSpeed configs without unfillable "auto" values, and a
plan's own accelerate + DeepSpeed files running a real 2-process ZeRO-3 distillation for 2 steps."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml
from helpers import ROOT
from helpers.distill_runs import check_export
from helpers.faults import Job as Launch
from helpers.faults import reserve_port

from distill.cluster.cli import main
from distill.cluster.configs import job_configs, require_fit
from distill.cluster.launch import deepspeed_config
from distill.cluster.spec import Cluster, Job

MIXED = Cluster.model_validate(
    {
        "gpu_types": [
            {"name": "a100", "nodes": 1, "gpus_per_node": 8, "memory_gb": 80},
            {"name": "t4", "nodes": 2, "gpus_per_node": 4, "memory_gb": 16, "bf16": False},
        ]
    }
)


def test_bf16_jobs_never_get_gpus_without_bf16():
    bf16 = Job(name="bf16", student_params_b=0.1, activation_gb=1.0)
    fp16 = Job(name="fp16", student_params_b=0.1, activation_gb=1.0, mixed_precision="fp16")
    assert {c.gpu_type for c in job_configs(bf16, MIXED)} == {"a100"}
    assert {c.gpu_type for c in job_configs(fp16, MIXED)} == {"a100", "t4"}
    t4_only = Cluster.model_validate({"gpu_types": [MIXED.gpu_types[1].model_dump()]})
    with pytest.raises(ValueError, match="trains in bf16 but no GPU type of the cluster has bf16") as e:
        require_fit(bf16, t4_only)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_configs_leave_only_recipe_fields_auto(stage):
    """accelerate fills "auto" from the recipe (batch, accumulation, clipping, precision); ZeRO-3 bucket sizes
    could only come from ``model.config``, which the distillation objective lacks, so none may be "auto"."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = deepspeed_config(stage)
    assert "auto" not in json.dumps(ds["zero_optimization"])
    assert DeepSpeedZeroConfig(**ds["zero_optimization"]).stage == stage


def _tiny_recipe(tmp_path: Path, model: Path, data: Path) -> Path:
    recipe = {
        "output_dir": str(tmp_path / "run"),
        "model": {"source": str(model), "swiftkv": {"num_key_value_layers": 3, "group_size": 1}},
        "data": {"sources": [{"path": str(data)}], "seq_len": 64, "holdout": 0.1},
        "loss": {"chunk_tokens": 32},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0, "schedule": "constant"},
        "train": {"micro_batch_size": 2, "max_steps": 2},
        "checkpoint": {"every_steps": 2, "keep": 1},
        "log": {"every_steps": 1, "eval_batches": 2},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    return path


@pytest.mark.slow
@pytest.mark.smollm2
def test_a_planned_zero3_job_launches_and_trains(tiny_chat_model, chat_data, tmp_path):
    """plan -> launch-configs -> the plan's launch.sh, unchanged, on 2 CPU processes (gloo)."""
    cluster = tmp_path / "cluster.yaml"  # two 1.5 GB "GPUs": only ZeRO-3 over both fits the job
    cluster.write_text(
        yaml.safe_dump({"gpu_types": [{"name": "cpu", "nodes": 1, "gpus_per_node": 2, "memory_gb": 1.5}]})
    )
    job = {
        "name": "tiny",
        "recipe": str(_tiny_recipe(tmp_path, tiny_chat_model, chat_data)),
        "student_params_b": 0.1,
        "teacher_params_b": 0.5,
        "activation_gb": 0.0,  # memory by bytes per parameter (a tiny recipe's estimate fits ZeRO-0 anywhere)
        "mixed_precision": "no",
        "max_gpus": 2,
        "observed": [
            {"gpu_type": "cpu", "gpus": 1, "throughput": 1.0},
            {"gpu_type": "cpu", "gpus": 2, "throughput": 1.9},
        ],
    }
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({"jobs": [job]}))
    assert main(["plan", str(cluster), str(jobs), "--out", str(tmp_path / "plan.json")]) == 0
    (entry,) = json.loads((tmp_path / "plan.json").read_text())["jobs"]
    assert (entry["gpus"], entry["zero_stage"]) == (2, 3)
    assert main(["launch-configs", str(tmp_path / "plan.json"), "--out", str(tmp_path / "launch")]) == 0
    # the plan's port (29500 for its first job) is the only change: this machine may run two launches at once
    config = tmp_path / "launch" / "tiny" / "accelerate.yaml"
    settings = yaml.safe_load(config.read_text())
    assert settings["main_process_port"] == 29500
    with reserve_port() as port:
        config.write_text(yaml.safe_dump({**settings, "main_process_port": port.getsockname()[1]}))
        # the script runs `accelerate` from PATH: the venv's, first there (tests/conftest.py)
        launch = ["bash", tmp_path / "launch" / "tiny" / "launch.sh"]
        with Launch.command(tmp_path, launch, port) as job:
            job.finish()
    steps = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2]
    # the export holds trained SwiftKV weights only, and reproduces the run's held-out metrics
    check_export(tmp_path / "recipe.yaml", tiny_chat_model, tmp_path / "run")


def test_every_reallocation_costs_a_restart_and_new_baselines_run():
    """A job that only scales up (same type, more GPUs) still loses its restart time; the elastic and tuned
    baselines finish every job of a trace."""
    from distill.cluster.simulator import simulate
    from distill.cluster.trace import TraceJob, generate_trace

    cluster = Cluster.model_validate(
        {"gpu_types": [{"name": "g", "nodes": 1, "gpus_per_node": 4, "memory_gb": 80}]}
    )
    job = TraceJob("j", 0.0, "small", 0.0, 1, 4, 64, 0.0, 0.0, 120.0, 0.1, {"g": 1.0})
    job.work = 4.0 * 3600  # hours of work on 4 GPUs with no communication: an elastic policy scales it up
    res = simulate(cluster, [job], "sia", round_s=60.0)
    segments = sorted(res.segments, key=lambda s: s.start)
    assert segments[0].start == pytest.approx(job.restart_s)  # the first start pays it too
    moves = [(a, b) for a, b in itertools.pairwise(segments) if a.config != b.config]
    assert any(b.config.gpus > a.config.gpus for a, b in moves)  # it was scaled up at least once
    assert all(b.start - a.end >= job.restart_s - 1e-9 for a, b in moves)
    trace = generate_trace(MIXED, num_jobs=12, hours=1.0, seed=1)
    for policy in ("pollux", "gavel-tuned"):
        assert not simulate(MIXED, trace, policy, 60.0).unfinished


def test_recipe_jobs_fit_by_the_distill_check_estimate():
    """A job with a recipe fits where `distill check` says it fits: the 8B recipe at seq 8192 does not fit
    16 GB GPUs at any ZeRO stage (a fixed 4 GB for activations once let the planner put it there)."""
    from distill.check import model_config_of, peak_gb, plan
    from distill.cluster.configs import memory_per_gpu_gb
    from distill.memory import Parallel
    from distill.shipped import load_recipe_or_usage

    recipe, config = (
        ROOT / "recipes" / "swiftkv_llama3.1_8b.yaml",
        "recipes/model_configs/llama3.1_8b/config.json",
    )
    job = Job(name="8b", recipe=str(recipe), config_json=str(ROOT / config), mixed_precision="fp16")
    loaded = load_recipe_or_usage(recipe, [])
    expected = peak_gb(plan(loaded, model_config_of(loaded, ROOT / config), Parallel(processes=8, stage=2)))
    assert memory_per_gpu_gb(job, 8, 2) == pytest.approx(expected) and 20 < expected < 72
    small = Cluster.model_validate(
        {"gpu_types": [{"name": "t4", "nodes": 2, "gpus_per_node": 4, "memory_gb": 16}]}
    )
    assert job_configs(job, small) == []
    assert {c.gpus for c in job_configs(job, MIXED)} >= {1, 8}  # 80 GB GPUs hold it
    with pytest.raises(ValueError, match="neither a recipe"):
        Job(name="nothing")
