"""One distillation as a resumable stage: what the main job runs for each fraction and the sweep for each
candidate.

``distill_stage`` trains ``recipe`` in this process (on every process of an ``accelerate launch``) or, with
``launch``, as ``accelerate launch --config_file LAUNCH -m distill RECIPE.yaml`` on the devices that config
names.  The launched recipe is the typed one written out beside the run (``RUN/recipes/NAME.yaml``), so the
child trains exactly what the stage's key was computed from.  Either way the stage's result is what the
trainer wrote into ``output_dir``: the final held-out metrics and the curve of held-out evaluations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from toolkit.stages import run_stage

from .recipe import Recipe


class LaunchError(RuntimeError):
    """A distillation under ``accelerate launch`` failed; its own error is on stderr above this one."""


def read_curve(out: str | Path) -> list[dict]:
    """The held-out evaluations of a distillation (``out/log.jsonl``) that carry their token count, one per step
    in step order; a resumed run's records replace those the interrupted run wrote for the same steps."""
    path = Path(out) / "log.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; to resolve, pass the output_dir of a distillation run")
    by_step = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "eval_kl" in record and "train_tokens" in record:
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]


def distillation_result(out: str | Path) -> dict:
    """What a finished distillation in ``out`` measured: ``final_metrics.json``, the held-out KL before the
    first step (``initial_eval_kl``, when step 0 was evaluated) and the curve."""
    out = Path(out)
    curve = read_curve(out)
    initial = curve[0]["eval_kl"] if curve and curve[0]["step"] == 0 else None
    final = json.loads((out / "final_metrics.json").read_text())
    return {"model": str(out / "model"), "initial_eval_kl": initial, **final, "curve": curve}


def launch_command(recipe_file: Path, launch: Path) -> list[str]:
    """``python -m accelerate.commands.launch ... -m distill RECIPE`` (``--quiet``: a failed one-process
    launch shows the distillation's own error, not the launcher's traceback)."""
    launcher = ["-m", "accelerate.commands.launch", "--quiet", "--config_file", str(launch)]
    return [sys.executable, *launcher, "-m", "distill", str(recipe_file)]


def _run(recipe: Recipe, recipe_file: Path, launch: Path | None, end_training: bool) -> dict:
    if launch is None:
        from .train import train

        train(recipe, end_training)
    else:
        status = subprocess.run(launch_command(recipe_file, launch)).returncode
        if status != 0:
            raise LaunchError(
                f"the distillation into {recipe.output_dir} failed under accelerate launch (exit status "
                f"{status}) (to resolve, fix the error printed above and run the job again: the stages already "
                "done are skipped)"
            )
    return distillation_result(recipe.output_dir)


def distill_stage(
    run_dir: Path,
    name: str,
    recipe: Recipe,
    inputs: dict | None = None,
    launch: Path | None = None,
    end_training: bool = True,
) -> tuple[str, dict]:
    """(key, result) of the stage ``name`` that distills ``recipe`` into its ``output_dir``: skipped when done
    with the same recipe and ``inputs`` (e.g. the key of the stage that made its source), resumed from its
    checkpoints after an interruption, rerun from scratch when either changed.  ``end_training=False`` keeps
    the processes' group for the next stage (the sweep's candidates)."""
    from accelerate import PartialState

    state = PartialState()
    recipe_file = Path(run_dir) / "recipes" / f"{name}.yaml"
    if state.is_main_process:
        recipe_file.parent.mkdir(parents=True, exist_ok=True)
        recipe_file.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    return run_stage(
        run_dir,
        name,
        {"recipe": recipe.model_dump(mode="json"), **(inputs or {})},
        lambda: _run(recipe, recipe_file, launch, end_training),
        output=Path(recipe.output_dir),
        main=state.is_main_process,
        barrier=state.wait_for_everyone,
    )
