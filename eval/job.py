"""The main job: convert -> distill -> evaluate -> report, resumable, for the embedded default or any model.

``run_job()`` runs every stage through ``toolkit.stages.run_stage``: a stage is skipped when its inputs are
unchanged and reruns (with everything downstream) when they change; an interrupted distillation resumes from
its last checkpoint.  It writes ``RUN_DIR/run.json`` (schema below) and ``RUN_DIR/report.md`` from it.

The model is the embedded SmolLM2-135M-Instruct unless one is named (a folder or a Hub id, checked by
``toolkit.checkpoint``); the distillation recipe is a shipped one (package data of ``distill``, so a
non-editable install has them too: ``distill.recipe.recipe_path``) or a path.  ``device`` and
``dtype`` place the evaluation stages (quality, speed, lm-eval; ``eval.quality.load_for_eval``); the
distillation runs as its recipe says (``model.dtype``, ``train.mixed_precision``): in this process (one GPU
when there is one), or with ``launch`` under ``accelerate launch`` on every GPU its config names.  The
quality stage also writes its numbers into each SwiftKV folder's model card.

``run.json``: ``{"meta": {model, machine, threads, device, dtype, date, prefill_lengths, seconds, quick},
"commands": [the commands that reproduce each stage], "variants": [{name, dir, num_layers, swiftkv_layers,
group_size, kv_bytes_per_token, ideal_prefill_speedup: {n: x}, quality, quality_before, speed: {prefill_s,
prefill_speedup, decode_s, decode_ratio}, lm_eval, distill}]}``.
"""

from __future__ import annotations

import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

DEFAULT_RECIPE = "swiftkv_smollm2_cpu.yaml"
LAUNCH_EXAMPLE = "recipes/accelerate/8gpu_zero2.yaml"
JOB_EPILOG = """examples:
  swiftkv run                 # SmolLM2-135M-Instruct, SwiftKV 25% and 50%, ~30 min on 2 cores
  swiftkv run --quick         # tiny settings (a few minutes; the tests run this)
  swiftkv run --out out/demo --fractions 0.5 --distill-steps 60
  swiftkv run meta-llama/Llama-3.1-8B-Instruct --recipe swiftkv_llama3.1_8b.yaml --fractions 0.5 \\
      --launch recipes/accelerate/8gpu_zero2.yaml --device auto --dtype bfloat16 --out out/llama8b
"""

FULL = dict(
    fractions=[0.25, 0.5],
    distill_steps=None,  # the recipe's
    distill=[],
    quality=dict(n_conversations=32, seq_len=512, n_prompts=8, max_new_tokens=32, n_long=8),
    lengths=[512, 1024, 2048],
    repeats=3,
    decode_context=1024,
    decode_steps=10,
    harness=dict(limit=50, max_length=1024),
    n_docs=100,
)
QUICK = dict(
    fractions=[0.5],
    distill_steps=4,
    distill=[
        "data.sources.0.max_samples=40",
        "data.seq_len=128",
        "checkpoint.every_steps=4",
        "log.eval_batches=2",
        "log.every_steps=1",
        "log.eval_every_steps=null",
    ],
    quality=dict(n_conversations=4, seq_len=128, n_prompts=2, max_new_tokens=8, n_long=1),
    lengths=[128, 256],
    repeats=1,
    decode_context=128,
    decode_steps=3,
    harness=dict(limit=5, max_length=256),
    n_docs=10,
)


class LaunchError(RuntimeError):
    """A distillation under ``accelerate launch`` failed; its own error is on stderr above this one."""


def job_settings(quick: bool, fractions: list[float] | None, distill_steps: int | None) -> dict:
    """The job's settings: the full or quick preset with the user's overrides, validated."""
    cfg = dict(QUICK if quick else FULL, quick=quick)
    if fractions is not None:
        if not fractions or not all(0.0 < f < 1.0 for f in fractions):
            raise ValueError(
                f"fractions {fractions} must lie in (0, 1) (to resolve, pass e.g. --fractions 0.25,0.5)"
            )
        cfg["fractions"] = fractions
    if distill_steps is not None:
        if distill_steps < 1:
            raise ValueError(f"distill_steps={distill_steps} (to resolve, pass a positive number of steps)")
        cfg["distill_steps"] = distill_steps
    return cfg


def run_job(
    run_dir: Path | None = None,
    quick: bool = False,
    fractions: list[float] | None = None,
    distill_steps: int | None = None,
    model: str | Path | None = None,
    recipe: str | Path = DEFAULT_RECIPE,
    device: str = "cpu",
    dtype: str = "float32",
    launch: str | Path | None = None,
) -> Path:
    """Run (or resume) the main job on ``model`` (default: the embedded SmolLM2) with ``recipe`` into ``run_dir``
    (default ``out/demo``, ``out/demo-quick`` with ``quick``); return the path of its ``report.md``.

    ``launch``: an accelerate config; each distillation then runs as ``accelerate launch --config_file LAUNCH
    -m distill ...`` (all the GPUs it names) instead of in this process."""
    from distill.check import load_recipe_or_usage
    from distill.recipe import recipe_path
    from swiftkv.card import quality_section, set_quality
    from toolkit.artifacts import read_provenance
    from toolkit.assets import fetch_model, fetch_sharegpt
    from toolkit.checkpoint import open_checkpoint
    from toolkit.cliargs import UsageError
    from toolkit.stages import run_stage

    from .harness import run_harness
    from .quality import check_placement, evaluate_quality
    from .report import write_report
    from .tasks import write_tasks

    cfg = job_settings(quick, fractions, distill_steps)
    check_placement(device, dtype)
    if launch is not None and not Path(launch).is_file():
        raise UsageError(
            f"accelerate config {launch} not found (to resolve, pass a file such as {LAUNCH_EXAMPLE})"
        )
    recipe_file = recipe_path(recipe)
    load_recipe_or_usage(recipe_file, [])  # a bad recipe is refused before any work
    source = open_checkpoint(model) if model is not None else None
    run_dir = Path(run_dir or ("out/demo-quick" if quick else "out/demo")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    base = source.path if source is not None else fetch_model()
    fetch_sharegpt()
    flags = "".join(
        [
            f" {source.name}" if source is not None else "",
            f" --recipe {recipe}" if str(recipe) != DEFAULT_RECIPE else "",
            f" --device {device}" if device != "cpu" else "",
            f" --dtype {dtype}" if dtype != "float32" else "",
            f" --launch {launch}" if launch is not None else "",
            " --quick" if quick else "",
        ]
    )
    commands = [f"swiftkv run --out {run_dir}{flags}"]
    t0 = time.time()
    if source is not None:
        base_key = f"{source.name}@{source.revision}" if source.revision else str(base)
    else:
        base_key = read_provenance(base).get("gguf_sha256", str(base))
    placement = {"device": device, "dtype": dtype}
    tasks_key, tasks_dir = run_stage(
        run_dir,
        "tasks",
        {"n_docs": cfg["n_docs"], "data": "sharegpt"},
        lambda: str(write_tasks(run_dir / "tasks", cfg["n_docs"])),
    )

    variants = [dict(name="original", dir=str(base), fraction=0.0, key=base_key)]
    for fraction in cfg["fractions"]:
        name = f"swiftkv{round(fraction * 100)}"
        out = run_dir / f"distill-{name}"
        steps = [f"train.max_steps={cfg['distill_steps']}"] if cfg["distill_steps"] else []
        overrides = [
            f"model.source={base}",
            f"model.swiftkv.fraction={fraction}",
            f"output_dir={out}",
            *steps,
            *cfg["distill"],
        ]
        loaded = load_recipe_or_usage(recipe_file, overrides)
        command = ["-m", "distill", str(recipe_file), *overrides]
        if launch is not None:
            # --quiet: a failed one-process launch shows the distillation's error, not the launcher's trace
            launcher = ["-m", "accelerate.commands.launch", "--quiet", "--config_file", str(launch)]
            command = [*launcher, *command]
        commands.append(shlex.join(["python", *command]))
        key, result = run_stage(
            run_dir,
            f"distill-{name}",
            {"recipe": loaded.model_dump(mode="json"), "base": base_key},
            lambda loaded=loaded, command=command: _distill(loaded, command if launch is not None else None),
            output=out,
        )
        variants.append(
            dict(
                name=f"{name}-converted",
                dir=str(out / "converted"),
                fraction=fraction,
                key=key,
                before_of=name,
            )
        )
        variants.append(dict(name=name, dir=result["model"], fraction=fraction, key=key, distill=result))

    for v in variants:
        # before distillation only the all-prompt numbers are reported (the report's "before -> after")
        settings = {**cfg["quality"], "served": False, "n_prompts": 0} if "before_of" in v else cfg["quality"]
        _, v["quality"] = run_stage(
            run_dir,
            f"quality-{v['name']}",
            {"model": v["key"], "cfg": settings, **placement},
            lambda v=v, settings=settings: evaluate_quality(v["dir"], **settings, **placement),
        )
        if v["fraction"]:  # the SwiftKV folders this job wrote (never the user's model) carry the numbers
            set_quality(
                Path(v["dir"]),
                quality_section(
                    v["quality"],
                    f"`swiftkv run` ({dtype} on {device}): on {cfg['quality']['n_conversations']} "
                    "held-out ShareGPT conversations against the teacher (KL at T = 1, top-1 agreement, "
                    "perplexities; all prompt: every position as a prompt token; served: each reply with "
                    "everything before it as prompt, as a server computes it) and greedy agreement on "
                    f"{cfg['quality']['n_prompts']} held-out prompts.",
                ),
            )
    measured = [v for v in variants if "before_of" not in v]
    speed_inputs = {
        "models": [v["key"] for v in measured],
        **{k: cfg[k] for k in ("lengths", "repeats", "decode_context", "decode_steps")},
        **placement,
    }
    _, speed = run_stage(run_dir, "speed", speed_inputs, lambda: _speed(measured, cfg, device, dtype))
    for v in measured:
        _, v["lm_eval"] = run_stage(
            run_dir,
            f"lm_eval-{v['name']}",
            {"model": v["key"], "tasks": tasks_key, **cfg["harness"], **placement},
            lambda v=v: run_harness(
                v["dir"],
                ["sharegpt_ppl", "sharegpt_mc"],
                tasks_dir,
                batch_size=4,
                **cfg["harness"],
                **placement,
            ),
        )
        commands.append(
            f"swiftkv harness {v['dir']} --tasks sharegpt_ppl,sharegpt_mc "
            f"--tasks-dir {tasks_dir} --limit {cfg['harness']['limit']} --device {device} --dtype {dtype}"
        )
    commands.append(f"swiftkv report {run_dir}")
    name = source.name if source is not None else str(base)
    write_run_json(run_dir, name, cfg, measured, variants, speed, commands, time.time() - t0, device, dtype)
    return write_report(run_dir)


def _distill(recipe, command: list[str] | None = None) -> dict:
    """Run one distillation, in this process or (``command``) as ``python COMMAND``, and read back its result."""
    from distill.train import train

    from .report import read_curve

    if command is None:
        model_dir = train(recipe)
    else:
        status = subprocess.run([sys.executable, *command]).returncode
        if status != 0:
            raise LaunchError(
                f"the distillation into {recipe.output_dir} failed under accelerate launch (exit status "
                f"{status}) (to resolve, fix the error printed above and run the job again: the stages "
                "already done are skipped)"
            )
        model_dir = Path(recipe.output_dir) / "model"
    out = Path(recipe.output_dir)
    final = json.loads((out / "final_metrics.json").read_text())
    curve = read_curve(out)
    initial = curve[0]["eval_kl"] if curve and curve[0]["step"] == 0 else None
    return {"model": str(model_dir), "initial_eval_kl": initial, **final, "curve": curve}


def _speed(measured: list[dict], cfg: dict, device: str, dtype: str) -> dict:
    """Prefill and decode times of every measured variant, interleaved (``eval.speed``), as ratios to the original."""
    from .quality import load_for_eval
    from .speed import decode_times, prefill_times

    models = {v["name"]: load_for_eval(v["dir"], device, dtype)[0] for v in measured}
    out = {name: {"prefill_s": {}} for name in models}
    for n in cfg["lengths"]:
        for name, t in prefill_times(models, 1, n, cfg["repeats"]).items():
            out[name]["prefill_s"][str(n)] = t
    for name, t in decode_times(models, cfg["decode_context"], cfg["decode_steps"], cfg["repeats"]).items():
        out[name]["decode_s"] = t
    for name in models:
        out[name]["prefill_speedup"] = {
            n: out["original"]["prefill_s"][n] / t for n, t in out[name]["prefill_s"].items()
        }
        out[name]["decode_ratio"] = out[name]["decode_s"] / out["original"]["decode_s"]
    return out


def write_run_json(
    run_dir, model, cfg, measured, variants, speed, commands, seconds, device="cpu", dtype="float32"
) -> None:
    """``RUN_DIR/run.json`` (the schema in the module docstring), written atomically."""
    from swiftkv.convert import read_config
    from swiftkv.flops import Shape, ideal_prefill_speedup, kv_bytes_per_token
    from toolkit.artifacts import write_json_atomic

    rows = []
    quality = {v["name"]: v["quality"] for v in variants}
    for v in measured:
        shape = Shape.from_config(read_config(Path(v["dir"])))
        rows.append(
            dict(
                name=v["name"],
                dir=v["dir"],
                num_layers=shape.layers,
                swiftkv_layers=shape.layers - shape.num_key_value_layers,
                group_size=shape.group_size,
                kv_bytes_per_token=kv_bytes_per_token(shape, 2, v["name"] != "original"),
                ideal_prefill_speedup={str(n): ideal_prefill_speedup(shape, n) for n in cfg["lengths"]},
                quality=v["quality"],
                quality_before=quality.get(f"{v['name']}-converted"),
                speed=speed[v["name"]],
                lm_eval=v.get("lm_eval"),
                distill=v.get("distill"),
            )
        )
    if device == "cpu" or not torch.cuda.is_available():
        machine = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    else:
        machine = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    meta = dict(
        model=model,
        machine=machine,
        threads=torch.get_num_threads(),
        device=device,
        dtype=dtype,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        prefill_lengths=cfg["lengths"],
        seconds=round(seconds),
        quick=cfg["quick"],
    )
    write_json_atomic(run_dir / "run.json", {"meta": meta, "commands": commands, "variants": rows})
