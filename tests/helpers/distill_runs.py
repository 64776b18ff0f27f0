"""Helpers of the tests that run real distillations of the tiny chat model (tests/conftest.py builds it):
recipes, launches to the end or to a fault point (helpers.faults), and what a run leaves on disk.

``REFERENCE`` are the settings of the one uninterrupted single-process run that the session shares
(conftest's ``distill_reference``): every kill/resume, SCAR and elastic test that runs these settings compares
its resumed losses with that run's log instead of training its own reference.  Checkpoint and logging settings
are not part of a run's fingerprint (``distill.train.fingerprint``), so a test may change them and still
compare: the losses do not depend on them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.data import build_datasets
from distill.objective import DistillationObjective
from distill.recipe import load_recipe
from helpers.faults import PY, ROOT, Job, env
from swiftkv.convert import to_swiftkv

# 36 training rows, micro-batch 2, grad_accum 2: 6 steps of 4 sequences inside one epoch; a linear schedule,
# so a resume that restored the wrong step's learning rate shows in the losses; checkpoints at 2, 4, 6 kept
REFERENCE = dict(every=2, keep=3, schedule="linear", grad_accum=2)


def write_recipe(
    tmp_path: Path,
    model: Path,
    data: Path,
    out: Path,
    init: str = "copy",
    every: int = 3,
    keep: int = 2,
    schedule: str = "constant",
    **train,
) -> Path:
    recipe = {
        "output_dir": str(out),
        "model": {
            "source": str(model),
            "swiftkv": {"num_key_value_layers": 3, "group_size": 1, "init": init},
        },
        "data": {"sources": [{"path": str(data)}], "seq_len": 64, "holdout": 0.1},
        "loss": {"chunk_tokens": 32},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0, "schedule": schedule},
        "train": {"micro_batch_size": 2, "max_steps": 6, **train},
        "checkpoint": {"every_steps": every, "keep": keep},
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


def distill(recipe: Path, *overrides: str, expect: int = 0) -> str:
    """``swiftkv distill RECIPE OVERRIDES`` in one process; its stdout and stderr."""
    result = run([PY, "-m", "distill", str(recipe), *overrides], expect)
    return result.stdout + result.stderr


def refused(capsys, recipe: Path, *overrides: str, alone: bool = True) -> str:
    """``swiftkv distill RECIPE OVERRIDES`` run in this process (no Python start to pay), expected to refuse
    with status 2 before any training; its error, the last stderr line (``alone``: the only one)."""
    from accelerate.state import AcceleratorState

    from distill.__main__ import main

    capsys.readouterr()
    try:
        assert main([str(recipe), *overrides]) == 2
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next run starts its own
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "to resolve" in err[-1], err
    assert len(err) == 1 or not alone, err
    return err[-1]


def killed_at(tmp_path: Path, at: str, *target: str, **launch) -> Job:
    """Run ``target`` (``-m distill RECIPE ...``) on ``launch``'s processes until every rank is at the fault
    point ``at``, then SIGKILL all of them (helpers.faults); the Job, for its output."""
    with Job(tmp_path / "launches", target, at=at, **launch) as job:
        return job.kill_at_point()


def launched(
    tmp_path: Path, config: str | None, recipe: Path, *overrides: str, processes: int = 2, **kw
) -> Job:
    """``swiftkv distill RECIPE OVERRIDES`` run to the end on ``processes`` ranks: accelerate launch with one
    of the shipped CPU configs, or torch.distributed.run (DDP) without one; the finished Job, for its output."""
    target = kw.pop("target", ("-m", "distill"))
    with Job(tmp_path / "launches", (*target, recipe, *overrides), processes, config, **kw) as job:
        return job.finish()


def complete_checkpoints(out: Path) -> list[str]:
    return sorted(p.parent.name for p in (out / "checkpoints").glob("step_*/trainer_state.json"))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, float]:
    """Step -> logged loss (a resumed run's record replaces the killed run's of the same step)."""
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def final_kl(out: Path) -> float:
    return json.loads((out / "final_metrics.json").read_text())["eval_kl"]


def held_out_kl_falls(out: Path) -> bool:
    before = records(out)[0]
    return before["step"] == 0 and final_kl(out) < 0.9 * before["eval_kl"]


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


def start_from(reference: Path, step: int, out: Path) -> None:
    """A new output folder holding only ``reference``'s checkpoint of ``step`` (and its converted model)."""
    shutil.copytree(reference / "checkpoints" / f"step_{step}", out / "checkpoints" / f"step_{step}")
    shutil.copytree(reference / "converted", out / "converted")


def check_export(recipe_path: Path, model_dir: Path, out: Path, every_one: bool = True) -> None:
    """Only SwiftKV weights changed (``every_one``: all of them, else some); the exported model reproduces
    the in-memory held-out metrics."""
    exported = load_file(out / "model" / "model.safetensors")
    start = to_swiftkv(AutoModelForCausalLM.from_pretrained(model_dir), 3, 1).state_dict()
    trainable = {k for k in exported if "swiftkv" in k}
    changed = [not torch.equal(exported[k], start[k]) for k in trainable]
    assert trainable and (all(changed) if every_one else any(changed))
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


def resume_matches(text: str, out: Path, reference: Path, step: int, before: tuple[int, int]) -> None:
    """An elastic resume of ``out`` from its checkpoint of ``step``, written on ``before`` = (processes,
    grad_accum): the conversion and resume are reported, and every logged loss and the final held-out KL
    equal ``reference``'s."""
    import pytest

    ckpt = out / "checkpoints" / f"step_{step}"
    m, b = before
    assert f"converted checkpoint {ckpt} from {m} to " in text and f"(grad_accum {b} -> " in text, text[
        -2000:
    ]
    assert f"resumed from {ckpt} at step {step}" in text
    want, got = losses(reference), losses(out)
    assert sorted(got) == list(range(step + 1, max(want) + 1))
    for s, loss in got.items():
        assert loss == pytest.approx(want[s], rel=1e-5, abs=1e-6), s
    assert final_kl(out) == pytest.approx(final_kl(reference), rel=1e-5)
