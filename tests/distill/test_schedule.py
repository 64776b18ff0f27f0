"""Learning-rate schedules: the warmup-stable-decay curve, step by step, in the schedule and in a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from distill.recipe import OptimSection, RecipeError, load_recipe
from distill.train import _schedule


def expected_wsd(step: int, max_steps: int, warmup: int, decay: int, peak: float) -> float:
    """The specified curve: linear warmup to the peak over ``warmup`` steps, flat, then linear to 0 over the
    last ``decay`` steps (the lr used by optimizer step ``step + 1``)."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if step < max_steps - decay:
        return peak
    return peak * (max_steps - step) / decay


def recipe_file(tmp_path: Path, optim: dict, data: str = "sharegpt", **extra) -> Path:
    recipe = {
        "output_dir": str(tmp_path / "out"),
        "model": {"source": "unused"},
        "data": {"sources": [{"path": data}]},
        "optim": optim,
        **extra,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    return path


@pytest.mark.parametrize(
    "max_steps,warmup_ratio,decay_ratio", [(40, 0.1, 0.25), (7, 0.0, 0.5), (200, 0.05, 0.2)]
)
def test_wsd_lr_curve_is_warmup_then_flat_then_linear_to_zero(tmp_path, max_steps, warmup_ratio, decay_ratio):
    optim = {"lr": 2e-3, "schedule": "wsd", "warmup_ratio": warmup_ratio, "decay_ratio": decay_ratio}
    recipe = load_recipe(recipe_file(tmp_path, optim))
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(recipe, max_steps))
    seen = []
    for _ in range(max_steps + 1):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    warmup, decay = int(-(-warmup_ratio * max_steps // 1)), round(decay_ratio * max_steps)
    assert seen == pytest.approx(
        [expected_wsd(s, max_steps, warmup, decay, 2e-3) for s in range(max_steps + 1)]
    )
    assert seen[-1] == 0.0 and max(seen) == pytest.approx(2e-3)
    assert seen.count(pytest.approx(2e-3)) == max_steps - warmup - decay + 1  # the stable phase


def test_decay_ratio_is_validated():
    with pytest.raises(ValueError, match=r"warmup_ratio 0.5 \+ decay_ratio 0.6 exceed 1"):
        OptimSection(schedule="wsd", warmup_ratio=0.5, decay_ratio=0.6)
    linear = OptimSection(
        schedule="linear", decay_ratio=0.3
    )  # ignored: a saved recipe's dump validates again
    assert OptimSection.model_validate(linear.model_dump(mode="json")) == linear
    assert OptimSection(schedule="wsd").decay_ratio == 0.2


def test_recipe_errors_name_the_key(tmp_path):
    path = recipe_file(tmp_path, {"schedule": "wsd", "decay_ratio": 0})
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(e.value) == "recipe error: optim.decay_ratio: Input should be greater than 0"


@pytest.mark.smollm2
def test_a_wsd_run_logs_the_specified_lr_every_step(tiny_chat_model, chat_data, tmp_path):
    optim = {"lr": 3e-3, "schedule": "wsd", "warmup_ratio": 0.2, "decay_ratio": 0.3}
    path = recipe_file(
        tmp_path,
        optim,
        data=str(chat_data),
        model={"source": str(tiny_chat_model), "swiftkv": {"num_key_value_layers": 3}},
        train={"micro_batch_size": 2, "max_steps": 10},
        log={"every_steps": 1, "eval_batches": 1},
        checkpoint={"every_steps": 100},
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "distill", str(path), "data.seq_len=64"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logged = {}
    for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "lr" in record:
            logged[record["step"]] = record["lr"]
    # the record of step s holds the lr after s scheduler steps: the one optimizer step s + 1 uses
    assert logged == pytest.approx({s: expected_wsd(s, 10, 2, 3, 3e-3) for s in range(1, 11)})
