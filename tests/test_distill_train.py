"""Real distillation runs on a tiny model: single process, kill-and-resume, and 2-process DeepSpeed ZeRO-2/3."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import tiny_base
from fault_points import PY, ROOT, Job, env
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.data import build_datasets
from distill.objective import DistillationObjective
from distill.recipe import Recipe, RecipeError, load_recipe
from distill.train import fingerprint, select_trainable
from swiftkv.convert import to_swiftkv


def write_recipe(
    tmp_path: Path, model: Path, data: Path, out: Path, init: str = "copy", every: int = 3, **train
) -> Path:
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
        "checkpoint": {"every_steps": every, "keep": 2},
        "log": {"every_steps": 1, "eval_batches": 100},
    }
    path = tmp_path / f"recipe-{out.name}.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def run(cmd: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    """One process (its stdout and stderr read together: no pipe can fill while another is waited for)."""
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env(), timeout=900)
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def killed_at(tmp_path: Path, at: str, *target: str, **launch) -> None:
    """Run ``python -m distill`` (or ``target`` on ``launch``'s processes) until every rank is at ``at``,
    then SIGKILL all of them (tests/fault_points.py)."""
    with Job(tmp_path / "launches", target or ("-m", "distill"), at=at, **launch) as job:
        job.kill_at_point()


def complete_checkpoints(out: Path) -> list[str]:
    return sorted(p.parent.name for p in (out / "checkpoints").glob("step_*/trainer_state.json"))


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


def assert_resumes_as_uninterrupted(recipe: Path, out: Path, reference: dict[int, float]) -> None:
    """After a kill: no export, a resume from the latest complete checkpoint, the reference's losses after it."""
    assert not (out / "model").exists()
    resume_from = complete_checkpoints(out)[-1]
    result = run([PY, "-m", "distill", str(recipe)])
    assert f"resumed from {out / 'checkpoints' / resume_from} at step" in result.stdout + result.stderr
    resumed, first = losses(out), int(resume_from[5:]) + 1
    assert first < max(reference)
    for step in range(first, max(reference) + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step


@pytest.mark.smollm2
@pytest.mark.slow
def test_single_process_run_kill_and_resume(tiny_chat_model, chat_data, tmp_path):
    """SIGKILL after step 3 (before step 4's scheduler step), and once inside step 4's checkpoint write (resume
    from step 2, skipping the partial folder); both resume to the uninterrupted run's losses."""
    full = write_recipe(tmp_path, tiny_chat_model, chat_data, tmp_path / "full", every=2)
    run([PY, "-m", "distill", str(full)])
    reference = losses(tmp_path / "full")
    assert len(reference) == 6
    assert held_out_kl_falls(tmp_path / "full")
    check_export(full, tiny_chat_model, tmp_path / "full")

    out = tmp_path / "mid-epoch"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, every=2)
    killed_at(tmp_path, "step:4", "-m", "distill", recipe)
    assert_resumes_as_uninterrupted(recipe, out, reference)

    out = tmp_path / "mid-checkpoint"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, every=2)
    killed_at(tmp_path, "checkpoint:4", "-m", "distill", recipe)
    assert complete_checkpoints(out) == ["step_2"] and (out / "checkpoints" / ".step_4.tmp").is_dir()
    assert_resumes_as_uninterrupted(recipe, out, reference)

    # a checkpoint from another recipe is refused by name, before any training
    result = run([PY, "-m", "distill", str(recipe), "data.seq_len=96"], expect=2)
    assert "was written by a different recipe (differs in: data)" in result.stderr


def launched(
    tmp_path: Path, config: str | None, recipe: Path, *overrides: str, processes: int = 2, **kw
) -> Job:
    """``python -m distill RECIPE OVERRIDES`` run to the end on ``processes`` ranks: accelerate launch with one
    of the shipped CPU configs, or torch.distributed.run (DDP) without one; the finished Job, for its output."""
    target = kw.pop("target", ("-m", "distill"))
    with Job(tmp_path / "launches", (*target, recipe, *overrides), processes, config, **kw) as job:
        return job.finish()


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


@pytest.mark.smollm2
@pytest.mark.slow
def test_two_process_zero3_partitioned(tiny_chat_model, chat_data, tmp_path):
    """Every parameter a ZeRO-3 partition from load on (zero3_init_flag, persistence threshold 0), with the
    least-squares init fitted layer by layer on those partitions, grad_accum 4 and gradient checkpointing:
    held-out metrics in the run equal a single process's on the exported weights; SIGKILL of all ranks while
    a checkpoint is being written resumes to the same losses; resuming without DeepSpeed is refused."""
    settings = dict(init="lstsq", every=2, grad_accum=4, gradient_checkpointing=True)
    out = tmp_path / "zero3"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out, **settings)
    launched(
        tmp_path, "cpu_2proc_zero3", recipe, "log.eval_every_steps=2", target=["tests/distill_zero3_run.py"]
    )
    partitioning = json.loads((out / "partitioning.json").read_text())
    assert partitioning["parameters"] > 50 and partitioning["not_partitioned"] == []
    reference = losses(out)
    assert len(reference) == 6
    evals = [r for r in records(out) if "eval_kl" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 6]  # the last one is the final evaluation
    assert [r["train_tokens"] for r in evals] == [
        r["step"] * 64 * 2 * 4 * 2 for r in evals
    ]  # seq x batch x accum x ranks
    # the fit alone removes most of the KL the copy init has; training then goes on from there
    assert held_out_metrics(recipe, out / "converted")[0] > 3 * evals[0]["eval_kl"]
    assert json.loads((out / "final_metrics.json").read_text())["eval_kl"] < evals[0]["eval_kl"]
    check_export(recipe, tiny_chat_model, out)

    before = tree(out)
    result = run([PY, "-m", "distill", str(recipe), "log.eval_every_steps=2"], expect=2)
    assert "was written with DeepSpeed ZeRO-3, this launch runs no DeepSpeed" in result.stderr
    assert tree(out) == before

    killed = tmp_path / "zero3-killed"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, killed, **settings)
    launch = dict(processes=2, config="cpu_2proc_zero3")
    killed_at(tmp_path, "checkpoint:4", "-m", "distill", recipe, "log.eval_every_steps=2", **launch)
    assert complete_checkpoints(killed) == ["step_2"] and (killed / "checkpoints" / ".step_4.tmp").is_dir()
    job = launched(tmp_path, "cpu_2proc_zero3", recipe, "log.eval_every_steps=2")
    assert f"resumed from {killed / 'checkpoints' / 'step_2'} at step 2" in job.output()
    resumed = losses(killed)
    for step in (3, 4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


@pytest.mark.smollm2
@pytest.mark.slow
def test_two_process_zero2_lora_bf16(tiny_chat_model, chat_data, tmp_path):
    """LoRA on the SwiftKV projections, bf16 mixed precision and gradient checkpointing under ZeRO-2: the run
    trains (held-out KL falls) and exports the merged model."""
    out = tmp_path / "lora"
    recipe = write_recipe(
        tmp_path,
        tiny_chat_model,
        chat_data,
        out,
        trainable="lora",
        mixed_precision="bf16",
        grad_accum=4,
        gradient_checkpointing=True,
    )
    launched(tmp_path, "cpu_2proc_zero2", recipe, "optim.lr=1e-2")
    assert len(losses(out)) == 6 and held_out_kl_falls(out)
    exported = load_file(out / "model" / "model.safetensors")
    assert not any("lora" in k for k in exported)
    start = to_swiftkv(AutoModelForCausalLM.from_pretrained(tiny_chat_model), 3, 1).state_dict()
    changed = {k for k, v in exported.items() if not torch.equal(v.float(), start[k].to(v.dtype).float())}
    assert changed and all("swiftkv" in k for k in changed)


@pytest.mark.smollm2
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
    launched(tmp_path, None, recipe, *overrides)
    logged = [r for r in records(out) if "comm_byte_ratio" in r]
    assert len(logged) == 6 and all(r["comm_byte_ratio"] < 0.2 for r in logged)
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.smollm2
def test_running_checkpoint_in_the_loop(tiny_chat_model, chat_data, tmp_path):
    out = tmp_path / "scar"
    recipe = write_recipe(tmp_path, tiny_chat_model, chat_data, out)
    scar = ["checkpoint.scar={fraction: 0.5, every_steps: 2, select: max-change}", "log.eval_every_steps=1"]
    killed_at(tmp_path, "step:6", "-m", "distill", recipe, *scar)
    manifests = list((out / "scar").rglob("manifest.json"))
    assert manifests, "no running checkpoint written"
    result = run([PY, "-m", "distill", str(recipe), *scar])
    assert re.search(r"resumed running checkpoint \S+ at step 4\n", result.stdout), result.stdout
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    at_4 = [r for r in records if r["step"] == 4 and "eval_kl" in r]
    # the killed run's evaluation of step 4, then the recovered state's (a mix of blocks saved at steps 2
    # and 4 and the full checkpoint of step 3), evaluated before training on
    assert [r.get("resumed") for r in at_4] == [None, "running"]
    assert math.isfinite(at_4[1]["eval_kl"]) and at_4[1]["train_tokens"] == 4 * 2 * 64
    assert [r["step"] for r in records if "loss" in r][-2:] == [5, 6]
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("trainable", ["swiftkv", "lora"])
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(trainable):
    """Shared lower layers (frozen, run once) and the student's upper layers under transformers' checkpointing:
    the upper layers really run again in backward, and every trainable gradient is unchanged."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 40), generator=gen)
    pos = torch.arange(40).repeat(2, 1)
    mask = (torch.rand(2, 40, generator=gen) > 0.3).long()
    grads, calls = [], []
    for checkpointing in (False, True):
        recipe = Recipe.model_validate(
            {
                "output_dir": "unused",
                "model": {"source": "unused"},
                "data": {"sources": [{"path": "unused"}]},
                "loss": {"chunk_tokens": 16},
                "train": {"trainable": trainable, "gradient_checkpointing": checkpointing},
            }
        )
        model = to_swiftkv(tiny_base("llama", initializer_range=0.2), 3, 1)
        model.set_mode("student")
        torch.manual_seed(1)
        model = select_trainable(model, recipe)
        with torch.no_grad():  # LoRA's B starts at zero, which would leave A without a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        objective = DistillationObjective(model, recipe.loss).train()
        mlp = objective.causal_lm.model.layers[-1].mlp
        calls.append(0)
        mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))
        objective(ids, pos, mask)["loss"].backward()
        grads.append({n: p.grad for n, p in objective.named_parameters() if p.requires_grad})
    assert calls == [2, 3]  # teacher + student, then the student's recompute in backward
    assert grads[0].keys() == grads[1].keys() and all(g is not None for g in grads[1].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_trainable_all_is_refused_at_validation(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        json.dumps({"output_dir": "x", "model": {"source": "m"}, "data": {"sources": [{"path": "d"}]}})
    )
    with pytest.raises(RecipeError) as err:
        load_recipe(path, ["train.trainable=all"])
    assert str(err.value) == (
        "recipe error: train.trainable: trainable=all would train against a moving teacher (teacher and student "
        "share the live weights); use trainable=swiftkv or trainable=lora"
    )


def test_resume_fingerprint_ignores_how_the_data_is_built(tmp_path):
    """More tokenizer processes, another cache folder or a longer timeout still resume; other data does not."""
    path = tmp_path / "recipe.yaml"
    path.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "o"),
                "model": {"source": "m"},
                "data": {"sources": [{"path": "d"}]},
            }
        )
    )
    base = fingerprint(load_recipe(path))
    runtime = ["data.num_proc=7", f"data.cache_dir={tmp_path}", "data.tokenize_timeout_minutes=600"]
    assert fingerprint(load_recipe(path, runtime)) == base
    assert fingerprint(load_recipe(path, ["data.seq_len=64"])) != base
