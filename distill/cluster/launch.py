"""``launch-configs``: turn a plan into the files the real launcher reads, one folder per job.

Each job folder gets ``accelerate.yaml`` (written by accelerate's own ``ClusterConfig``, so it loads with
``accelerate launch --config_file``), ``deepspeed.json`` (ZeRO stage chosen by the planner from model size
and GPU memory; batch sizes, clipping and bf16 left ``"auto"`` for accelerate to fill from the recipe; ZeRO-3's
bucket sizes left at DeepSpeed's defaults, because accelerate can fill their ``"auto"`` only from a
``model.config``, which the distillation objective does not have) and
``launch.sh`` (``MACHINE_RANK=k`` on the k-th listed host).  The output folder is complete or absent.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

BASE_PORT = 29500
PROFILE_STEPS = 20
"""Optimizer steps of a profile run (enough to read a steady samples/s from the training log)."""


def deepspeed_config(stage: int) -> dict[str, Any]:
    """DeepSpeed JSON for a ZeRO stage; everything the recipe decides stays ``"auto"``."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }


def accelerate_config(entry: dict[str, Any], ds_path: Path, port: int) -> Any:
    """accelerate ``ClusterConfig`` for one plan entry (DeepSpeed, one process per GPU).

    Mixed precision is left to the recipe (``train.mixed_precision``), as in recipes/accelerate/*.yaml.
    """
    from accelerate.commands.config.config_args import ClusterConfig

    multi = entry["nodes"] > 1
    ds: dict[str, Any] = {"deepspeed_config_file": str(ds_path), "zero3_init_flag": entry["zero_stage"] == 3}
    if multi:
        ds["deepspeed_multinode_launcher"] = "standard"
    gpu_ids = "all" if multi else ",".join(str(g) for g in next(iter(entry["placement"].values())))
    return ClusterConfig(
        compute_environment="LOCAL_MACHINE",
        distributed_type="DEEPSPEED",
        mixed_precision=None,
        use_cpu=False,
        debug=False,
        num_processes=entry["gpus"],
        num_machines=entry["nodes"],
        machine_rank=0,
        gpu_ids=gpu_ids,
        main_process_ip=entry["hosts"][0] if multi else None,
        main_process_port=port,
        rdzv_backend="static",
        same_network=True,
        deepspeed_config=ds,
    )


def _launch_script(entry: dict[str, Any], job_dir: Path) -> str:
    hosts = "\n".join(f"#   MACHINE_RANK={k} on {h}" for k, h in enumerate(entry["hosts"]))
    recipe = shlex.quote(entry["recipe"]) if entry["recipe"] else "RECIPE.yaml"
    if entry["profile"]:  # a short run with its own output folder, so it never touches the job's checkpoints
        recipe += f" train.max_steps={PROFILE_STEPS} " + shlex.quote(f"output_dir={job_dir / 'profile_run'}")
    return (
        "#!/usr/bin/env bash\n"
        f"# {entry['name']}: {entry['gpus']} x {entry['gpu_type']} on {entry['nodes']} node(s), "
        f"ZeRO-{entry['zero_stage']}{' (profile run: record samples/s in jobs.yaml)' if entry['profile'] else ''}\n"
        f"{hosts}\nset -euo pipefail\n"
        f"accelerate launch --config_file {shlex.quote(str(job_dir / 'accelerate.yaml'))} "
        f'--machine_rank "${{MACHINE_RANK:-0}}" -m distill {recipe} "$@"\n'
    )


def write_launch_configs(plan: dict[str, Any], out: Path | str, force: bool = False) -> list[Path]:
    """Write one folder per planned job under ``out``; return the job folders (final paths)."""
    from toolkit.artifacts import atomic_output_dir

    if not plan.get("jobs"):
        raise ValueError("plan has no allocated jobs; to resolve, run `plan` with free GPUs or fewer jobs")
    final = Path(out).resolve()
    dirs = []
    with atomic_output_dir(final, force) as tmp:
        for k, entry in enumerate(plan["jobs"]):
            if entry["zero_stage"] is None:
                raise ValueError(f"job {entry['name']!r} has no ZeRO stage that fits; to resolve, re-plan it")
            (tmp / entry["name"]).mkdir()
            job_dir = final / entry["name"]
            (tmp / entry["name"] / "deepspeed.json").write_text(
                json.dumps(deepspeed_config(entry["zero_stage"]), indent=2) + "\n"
            )
            accelerate_config(entry, job_dir / "deepspeed.json", BASE_PORT + k).to_yaml_file(
                tmp / entry["name"] / "accelerate.yaml"
            )
            script = tmp / entry["name"] / "launch.sh"
            script.write_text(_launch_script(entry, job_dir))
            script.chmod(0o755)
            dirs.append(job_dir)
        (tmp / "plan.json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    return dirs
