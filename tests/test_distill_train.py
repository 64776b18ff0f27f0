"""Real distillation runs on a tiny model: single process, kill-and-resume, and 2-process DeepSpeed ZeRO-2/3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.data import build_datasets
from distill.objective import DistillationObjective
from distill.recipe import load_recipe
from distill.train import KILL_ENV
from swiftkv.convert import to_swiftkv

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def write_recipe(tmp_path: Path, model: Path, data: Path, out: Path, init: str = "copy", **train) -> Path:
    recipe = {
        "output_dir": str(out),
        "model": {
            "source": str(model),
            "swiftkv": {"num_key_value_layers": 3, "group_size": 1, "init": init},
        },
        "data": {"sources": [{"path": str(data)}], "seq_len": 64, "holdout": 0.1},
        "loss": {"chunk_tokens": 32},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0, "schedule": "constant"},
        "train": {"micro_batch_size": 2, "max_steps": 6, **train},
        "checkpoint": {"every_steps": 3, "keep": 2},
        "log": {"every_steps": 1, "eval_batches": 100},
    }
    path = tmp_path / f"recipe-{out.name}.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def run(cmd: list[str], env_extra: dict | None = None, expect: int = 0) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        **(env_extra or {}),
    }
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def held_out_kl_falls(out: Path) -> bool:
    before = records(out)[0]
    after = json.loads((out / "final_metrics.json").read_text())
    return before["step"] == 0 and after["eval_kl"] < 0.9 * before["eval_kl"]


def check_export(recipe_path: Path, model_dir: Path, out: Path) -> None:
    """Only SwiftKV weights changed; the exported model reproduces the in-memory held-out metrics."""
    exported = load_file(out / "model" / "model.safetensors")
    start = to_swiftkv(AutoModelForCausalLM.from_pretrained(model_dir), 3, 1).state_dict()
    if (out / "initialized").is_dir():  # init: lstsq fitted the K/V projections before training
        initialized = load_file(out / "initialized" / "model.safetensors")
        fitted = {k for k in initialized if not torch.equal(initialized[k], start[k])}
        assert fitted == {k for k in start if "k_proj_swiftkv" in k or "v_proj_swiftkv" in k}
        start = initialized
    trainable = {k for k in exported if "swiftkv" in k}
    assert trainable and all(not torch.equal(exported[k], start[k]) for k in trainable)
    for k, v in exported.items():
        if k not in trainable:
            assert torch.equal(v, start[k]), f"{k} changed"
    kl, top1 = held_out_metrics(recipe_path, out / "model")
    final = json.loads((out / "final_metrics.json").read_text())
    assert abs(final["eval_kl"] - kl) < 1e-4
    assert abs(final["eval_top1_agreement"] - top1) < 1e-6


def held_out_metrics(recipe_path: Path, model_dir: Path) -> tuple[float, float]:
    """Held-out KL(teacher || student) and top-1 agreement of a SwiftKV checkpoint, as the trainer counts them."""
    recipe = load_recipe(recipe_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    _, held = build_datasets(recipe.data, AutoTokenizer.from_pretrained(model_dir))
    objective = DistillationObjective(model, recipe.loss).eval()
    with torch.no_grad():
        sums = sum(
            objective(
                held["input_ids"][i : i + 2], held["position_ids"][i : i + 2], held["loss_mask"][i : i + 2]
            )["metrics"]
            for i in range(0, len(held["input_ids"]), 2)
        )
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()


def test_single_process_run_kill_and_resume(tiny_chat_model, chat_data, tmp_path):
    full = write_recipe(tmp_path, tiny_chat_model, chat_data, tmp_path / "full")
    run([PY, "-m", "distill", str(full)])
    reference = losses(tmp_path / "full")
    assert len(reference) == 6
    assert held_out_kl_falls(tmp_path / "full")
    check_export(full, tiny_chat_model, tmp_path / "full")

    killed = write_recipe(tmp_path, tiny_chat_model, chat_data, tmp_path / "killed")
    run([PY, "-m", "distill", str(killed)], {KILL_ENV: "4"}, expect=17)
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["step_3"]
    assert not (tmp_path / "killed" / "model").exists()
    result = run([PY, "-m", "distill", str(killed)])
    assert "resumed from" in result.stdout + result.stderr
    resumed = losses(tmp_path / "killed")
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step

    # a checkpoint from another recipe is refused by name, before any training
    result = run([PY, "-m", "distill", str(killed), "data.seq_len=96"], expect=2)
    assert "was written by a different recipe (differs in: data)" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_process_deepspeed(tiny_chat_model, chat_data, tmp_path, stage):
    """ZeRO-3 also starts from the least-squares init, which the main process fits outside partitioning."""
    out = tmp_path / f"zero{stage}"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, init="lstsq" if stage == 3 else "copy")
    run(
        [
            PY,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            f"recipes/accelerate/cpu_2proc_zero{stage}.yaml",
            "-m",
            "distill",
            str(recipe),
        ]
    )
    steps = losses(out)
    assert len(steps) == 6
    if stage == 3:  # the fit alone removes most of the KL the copy init has; training then goes on from there
        assert held_out_metrics(recipe, out / "converted")[0] > 3 * records(out)[0]["eval_kl"]
        assert json.loads((out / "final_metrics.json").read_text())["eval_kl"] < records(out)[0]["eval_kl"]
    else:
        assert not (out / "initialized").exists() and held_out_kl_falls(out)
    check_export(recipe, tiny_chat_model, out)


@pytest.mark.slow
def test_two_process_ddp_with_managed_communication_and_adarevision(tiny_chat_model, chat_data, tmp_path):
    out = tmp_path / "ddp"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out)
    overrides = [
        "comm.hook=managed",
        "comm.budget=0.1",
        "comm.priority=relative-magnitude",
        "optim.type=adarevision",
        "optim.lr=0.05",
    ]
    run(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "distill",
            str(recipe),
            *overrides,
        ]
    )
    logged = [r for r in records(out) if "comm_byte_ratio" in r]
    assert len(logged) == 6 and all(r["comm_byte_ratio"] < 0.2 for r in logged)
    assert (out / "model" / "model.safetensors").is_file()


def test_running_checkpoint_in_the_loop(tiny_chat_model, chat_data, tmp_path):
    out = tmp_path / "scar"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out)
    scar = ["checkpoint.scar={fraction: 0.5, every_steps: 2, block: tensor, select: max-change}"]
    run([PY, "-m", "distill", str(recipe), *scar], {KILL_ENV: "5"}, expect=17)
    manifests = list((out / "scar").rglob("manifest.json"))
    assert manifests, "no running checkpoint written"
    run([PY, "-m", "distill", str(recipe), *scar])  # resumes from step 3 plus the newer running blocks
    assert (out / "model" / "model.safetensors").is_file()
