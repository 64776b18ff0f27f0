"""The main job: convert -> distill -> evaluate -> report, resumable, for the embedded default or any model.

``run_job(config)`` runs every stage through ``toolkit.stages.run_stage``: a stage is skipped when its inputs
are unchanged and reruns (with everything downstream) when they change; an interrupted distillation resumes
from its last checkpoint.  It writes ``RUN_DIR/run.json`` (schema below) and ``RUN_DIR/report.md`` from it.

A ``JobConfig`` holds everything the job needs and validates itself; ``FULL`` and ``QUICK`` are its two
presets (``job_config`` applies a user's choices to one of them).  For each SwiftKV fraction the job

1. converts the model (``convert-NAME``: ``swiftkv.convert`` with the recipe's layout and exact K/V window),
   the checkpoint whose quality the report shows as "before";
2. distills that checkpoint (``distill-NAME``, a ``distill.runs`` stage: the trainer applies the recipe's
   K/V init to the fresh conversion), in this process or under ``accelerate launch`` on every GPU a
   ``launch`` config names; the distillation's recipe is the shipped one with a typed update (the source,
   the fraction, the steps, the output folder), written beside the run;

then measures every checkpoint: quality against its own teacher (``eval.quality``; it also writes the numbers
into each SwiftKV folder's model card), prefill and decode speed (``eval.speed``) and lm-eval tasks
(``eval.harness``).  The model is the embedded SmolLM2-135M-Instruct unless one is named (a folder or a Hub
id, checked by ``toolkit.checkpoint``); the recipe and the ``launch`` accelerate config are files or shipped
names (``distill.shipped.find``).  ``device`` and ``dtype`` place the evaluation stages; the distillation runs as
its recipe says.

``run.json``: ``{"meta": {model, machine, threads, device, dtype, date, prefill_lengths, seconds, quick},
"commands": [the commands that reproduce each stage], "variants": [{name, dir, num_layers, swiftkv_layers,
group_size, kv_bytes_per_token, ideal_prefill_speedup: {n: x}, quality, quality_before, speed: {prefill_s,
prefill_speedup, decode_s, decode_ratio}, lm_eval, distill}]}``.
"""

from __future__ import annotations

import platform
import shlex
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_RECIPE = "swiftkv_smollm2_cpu.yaml"
QUALITY_ARGS = ("n_conversations", "seq_len", "n_prompts", "max_new_tokens")
JOB_EPILOG = """examples:
  swiftkv run                 # SmolLM2-135M-Instruct, SwiftKV 25% and 50%, ~30 min on 2 cores
  swiftkv run --quick         # tiny settings (a few minutes; the tests run this)
  swiftkv run --out out/demo --fractions 0.5 --distill-steps 60
  swiftkv run meta-llama/Llama-3.1-8B-Instruct --recipe swiftkv_llama3.1_8b --fractions 0.5 \\
      --launch accelerate/8gpu_zero2 --device auto --dtype bfloat16 --out out/llama8b
"""


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QualitySettings(_Settings):
    """``eval.quality.evaluate_quality``'s sample sizes."""

    n_conversations: int = Field(ge=1, description="held-out conversations for KL, agreement, perplexity")
    seq_len: int = Field(ge=16, description="tokens of each conversation scored")
    n_prompts: int = Field(ge=0, description="held-out prompts for greedy agreement of free generation")
    max_new_tokens: int = Field(ge=1, description="tokens generated per prompt")
    band_replies: int = Field(
        ge=0, description="prompt-heavy: held-out replies per prompt-length band (1-2k, 2-4k, 4-8k tokens)"
    )
    bands: list[tuple[int, int]] = Field(
        description="prompt-heavy: prompt-length bands [lo, hi) of the replies"
    )
    retrieval_lengths: list[int] = Field(description="prompt-heavy: prompt lengths of the retrieval tasks")
    retrieval_samples: int = Field(ge=0, description="prompt-heavy: samples per retrieval task and length")
    documents: int = Field(ge=0, description="prompt-heavy: documents with the teacher's own reply scored")

    def prompt_heavy(self) -> dict | None:
        """``eval.prompt_heavy.prompt_heavy_metrics``'s settings (None: none measured)."""
        if not (self.band_replies or self.retrieval_samples or self.documents):
            return None
        return {
            "band_replies": self.band_replies,
            "bands": [tuple(b) for b in self.bands],
            "retrieval_lengths": self.retrieval_lengths,
            "retrieval_samples": self.retrieval_samples,
            "documents": self.documents,
        }


class SpeedSettings(_Settings):
    """``eval.speed``'s interleaved prefill and decode timings."""

    lengths: list[int] = Field(min_length=1, description="prompt lengths of the prefill timings")
    repeats: int = Field(ge=1)
    decode_context: int = Field(ge=1, description="tokens in the cache before the timed decode steps")
    decode_steps: int = Field(ge=1)


class HarnessSettings(_Settings):
    """lm-eval on the offline ShareGPT tasks (``eval.tasks``)."""

    limit: int = Field(ge=1, description="documents per task")
    max_length: int = Field(ge=16)


class JobConfig(_Settings):
    """Everything the main job runs with; ``FULL`` and ``QUICK`` are the presets."""

    model: str | None = Field(None, description="a folder or a Hub id; None: the embedded SmolLM2")
    recipe: str = Field(DEFAULT_RECIPE, description="a shipped recipe's name or a recipe file")
    out: Path | None = Field(None, description="run folder (default out/demo, out/demo-quick)")
    fractions: list[float] = Field(min_length=1, description="SwiftKV fractions, each in (0, 1)")
    distill_steps: int | None = Field(None, ge=1, description="optimizer steps (None: the recipe's)")
    distill_overrides: list[str] = Field(default_factory=list, description="recipe key=value overrides")
    quality: QualitySettings
    speed: SpeedSettings
    harness: HarnessSettings
    n_docs: int = Field(ge=1, description="documents written per lm-eval task")
    quick: bool = False
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    launch: Path | None = Field(None, description="accelerate config: distill under `accelerate launch`")

    @field_validator("fractions")
    @classmethod
    def _in_unit_interval(cls, fractions: list[float]) -> list[float]:
        if not all(0.0 < f < 1.0 for f in fractions):
            raise ValueError(f"fractions {fractions} must lie in (0, 1), e.g. 0.25,0.5")
        return fractions

    @property
    def run_dir(self) -> Path:
        return (self.out or Path("out/demo-quick" if self.quick else "out/demo")).resolve()

    def command(self) -> str:
        """The ``swiftkv run`` command line that reproduces this job."""
        preset = QUICK if self.quick else FULL
        parts = ["swiftkv", "run", *([self.model] if self.model else []), "--out", str(self.run_dir)]
        for flag, value, default in (
            ("--recipe", self.recipe, DEFAULT_RECIPE),
            ("--fractions", ",".join(map(str, self.fractions)), ",".join(map(str, preset.fractions))),
            ("--distill-steps", self.distill_steps, preset.distill_steps),
            ("--device", self.device, "cpu"),
            ("--dtype", self.dtype, "float32"),
            ("--launch", self.launch, None),
        ):
            if value != default:
                parts += [flag, str(value)]
        return shlex.join([*parts, *(["--quick"] if self.quick else [])])


FULL = JobConfig(
    fractions=[0.25, 0.5],
    quality=QualitySettings(
        n_conversations=32,
        seq_len=512,
        n_prompts=8,
        max_new_tokens=32,
        band_replies=12,
        bands=[(1024, 2048), (2048, 4096)],
        retrieval_lengths=[1024, 2048],
        retrieval_samples=6,
        documents=6,
    ),
    speed=SpeedSettings(lengths=[512, 1024, 2048], repeats=3, decode_context=1024, decode_steps=10),
    harness=HarnessSettings(limit=50, max_length=1024),
    n_docs=100,
)
QUICK = JobConfig(
    fractions=[0.5],
    distill_steps=4,
    distill_overrides=[
        "data.sources.0.max_samples=40",
        "data.seq_len=128",
        "model.swiftkv.init_rows=8",
        "checkpoint.every_steps=4",
        "log.eval_batches=2",
        "log.every_steps=1",
        "log.eval_every_steps=null",
    ],
    quality=QualitySettings(
        n_conversations=4,
        seq_len=128,
        n_prompts=2,
        max_new_tokens=8,
        band_replies=1,
        bands=[(512, 1024)],
        retrieval_lengths=[512],
        retrieval_samples=1,
        documents=1,
    ),
    speed=SpeedSettings(lengths=[128, 256], repeats=1, decode_context=128, decode_steps=3),
    harness=HarnessSettings(limit=5, max_length=256),
    n_docs=10,
    quick=True,
)


def job_config(quick: bool = False, **choices) -> JobConfig:
    """The ``QUICK`` or ``FULL`` preset with a user's choices (``None`` keeps the preset's), validated; a bad
    choice is one ``UsageError`` line."""
    from toolkit.cliargs import UsageError

    preset = QUICK if quick else FULL
    fields = {**preset.model_dump(), **{k: v for k, v in choices.items() if v is not None}}
    try:
        return JobConfig.model_validate(fields)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(map(str, error["loc"])) or "job"
        message = error["msg"].removeprefix("Value error, ")
        raise UsageError(
            f"{where}: {message} (to resolve, pass another --{where.split('.')[0].replace('_', '-')})"
        ) from None


def run_job(config: JobConfig = FULL) -> Path:
    """Run (or resume) the main job ``config`` into ``config.run_dir``; return the path of its ``report.md``."""
    import torch

    from distill.shipped import find, load_recipe_or_usage
    from toolkit.artifacts import read_provenance
    from toolkit.assets import fetch_model, fetch_sharegpt
    from toolkit.checkpoint import open_checkpoint
    from toolkit.stages import run_stage

    from .harness import run_harness
    from .quality import check_placement, evaluate_quality, evaluate_variants
    from .report import write_report
    from .tasks import write_tasks

    check_placement(config.device, config.dtype)
    if config.launch is not None:  # a file or a shipped name, launched as the file it resolves to
        config = config.model_copy(update={"launch": find(config.launch, "accelerate config")})
    recipe_file = find(config.recipe, "recipe")
    recipe = load_recipe_or_usage(recipe_file, config.distill_overrides)  # refused before any work
    source = open_checkpoint(config.model) if config.model is not None else None
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    base = source.path if source is not None else fetch_model()
    fetch_sharegpt()
    if source is not None:
        base_key = f"{source.name}@{source.revision}" if source.revision else str(base)
    else:
        base_key = read_provenance(base).get("gguf_sha256", str(base))
    placement = {"device": config.device, "dtype": config.dtype}
    commands = [config.command()]
    t0 = time.time()
    tasks_key, tasks_dir = run_stage(
        run_dir,
        "tasks",
        {"n_docs": config.n_docs, "data": "sharegpt"},
        lambda: str(write_tasks(run_dir / "tasks", config.n_docs)),
    )

    variants = [dict(name="original", dir=str(base), fraction=0.0, key=base_key)]
    for fraction in config.fractions:
        name = f"swiftkv{round(fraction * 100)}"
        converted, convert_key = _convert_stage(run_dir, name, base, base_key, recipe, fraction)
        key, result = _distill_stage(run_dir, name, recipe, fraction, converted, convert_key, config)
        variants.append(
            dict(name=f"{name}-converted", dir=str(converted), fraction=fraction, key=convert_key)
        )
        variants.append(dict(name=name, dir=result["model"], fraction=fraction, key=key, distill=result))
        student = run_dir / "recipes" / f"distill-{name}.yaml"
        launcher = ["accelerate", "launch", "--config_file", str(config.launch), "-m", "distill"]
        commands += [
            f"swiftkv convert {base} {converted} --swiftkv-fraction {fraction}"
            + (f" --exact-kv-window {recipe.model.exact_kv_window}" if recipe.model.exact_kv_window else ""),
            shlex.join([*(launcher if config.launch else ["swiftkv", "distill"]), str(student)]),
        ]

    # every checkpoint scored in one stage, one teacher pass per sample (the converted ones: all prompt only,
    # the report's "before")
    swiftkv_variants = [v for v in variants if v["fraction"]]
    before = frozenset(v["name"] for v in swiftkv_variants if v["name"].endswith("-converted"))
    settings = {k: v for k, v in config.quality.model_dump().items() if k in QUALITY_ARGS}
    settings["prompt_heavy"] = config.quality.prompt_heavy()
    _, qualities = run_stage(
        run_dir,
        "quality",
        {"models": {v["name"]: v["key"] for v in variants}, "cfg": config.quality.model_dump(), **placement},
        lambda: {
            "original": evaluate_quality(base, **{**settings, "prompt_heavy": None}, **placement),
            **evaluate_variants(
                base, {v["name"]: v["dir"] for v in swiftkv_variants}, before, **settings, **placement
            ),
        },
    )
    for v in variants:
        v["quality"] = qualities[v["name"]]
        if v["fraction"] and v["name"] not in before:  # the SwiftKV folders this job wrote carry the numbers
            _card_quality(Path(v["dir"]), v["quality"], config)
    measured = [v for v in variants if not v["name"].endswith("-converted")]
    speed_inputs = {"models": [v["key"] for v in measured], **config.speed.model_dump(), **placement}
    _, speed = run_stage(run_dir, "speed", speed_inputs, lambda: _speed(measured, config))
    for v in measured:
        _, v["lm_eval"] = run_stage(
            run_dir,
            f"lm_eval-{v['name']}",
            {"model": v["key"], "tasks": tasks_key, **config.harness.model_dump(), **placement},
            lambda v=v: run_harness(
                v["dir"],
                ["sharegpt_ppl", "sharegpt_mc"],
                tasks_dir,
                batch_size=4,
                **config.harness.model_dump(),
                **placement,
            ),
        )
        commands.append(
            f"swiftkv harness {v['dir']} --tasks sharegpt_ppl,sharegpt_mc --tasks-dir {tasks_dir} "
            f"--limit {config.harness.limit} --device {config.device} --dtype {config.dtype}"
        )
    commands.append(f"swiftkv report {run_dir}")
    name = source.name if source is not None else str(base)
    write_run_json(run_dir, name, config, measured, variants, speed, commands, time.time() - t0)
    return write_report(run_dir)


def _convert_stage(run_dir: Path, name: str, base: Path, base_key: str, recipe, fraction: float):
    """(folder, key) of ``convert-NAME``: the model in SwiftKV form at ``fraction`` with the recipe's AcrossKV
    groups and exact K/V window, before any training."""
    from swiftkv.convert import convert
    from toolkit.stages import run_stage

    group_size = recipe.model.swiftkv.group_size if recipe.model.swiftkv else 1
    window = recipe.model.exact_kv_window or 0
    out = run_dir / f"convert-{name}"
    layout = {"fraction": fraction, "group_size": group_size, "exact_kv_window": window}
    key, folder = run_stage(
        run_dir,
        f"convert-{name}",
        {"base": base_key, **layout},
        lambda: str(
            convert(
                base,
                out,
                swiftkv_fraction=fraction,
                group_size=group_size,
                exact_kv_window=window,
                force=True,
            )
        ),
    )
    return Path(folder), key


def _distill_stage(
    run_dir: Path, name: str, recipe, fraction: float, converted: Path, convert_key: str, config
):
    """(key, result) of ``distill-NAME``: the recipe, typed, with the converted checkpoint as its source."""
    from distill.recipe import SwiftKVOptions
    from distill.runs import distill_stage

    opts = recipe.model.swiftkv or SwiftKVOptions(fraction=fraction)
    swiftkv = opts.model_copy(update={"fraction": fraction, "num_key_value_layers": None})
    model = recipe.model.model_copy(update={"source": str(converted), "swiftkv": swiftkv})
    train = recipe.train.model_copy(update={"max_steps": config.distill_steps or recipe.train.max_steps})
    student = recipe.model_copy(
        update={"model": model, "train": train, "output_dir": str(run_dir / f"distill-{name}")}
    )
    return distill_stage(run_dir, f"distill-{name}", student, {"source": convert_key}, config.launch)


def _card_quality(model_dir: Path, quality: dict, config: JobConfig) -> None:
    from swiftkv.card import quality_section, set_quality

    set_quality(
        model_dir,
        quality_section(
            quality,
            f"`swiftkv run` ({config.dtype} on {config.device}): on {config.quality.n_conversations} held-out "
            "ShareGPT conversations against the teacher (KL at T = 1, top-1 agreement, perplexities; all prompt: "
            "every position as a prompt token; served: each reply with everything before it as prompt, as a "
            f"server computes it) and greedy agreement on {config.quality.n_prompts} held-out prompts.",
        ),
    )


def _speed(measured: list[dict], config: JobConfig) -> dict:
    """Prefill and decode times of every measured variant, interleaved (``eval.speed``), as ratios to the original."""
    from .quality import load_for_eval
    from .speed import decode_times, prefill_times

    settings = config.speed
    models = {v["name"]: load_for_eval(v["dir"], config.device, config.dtype)[0] for v in measured}
    out = {name: {"prefill_s": {}} for name in models}
    for n in settings.lengths:
        for name, t in prefill_times(models, 1, n, settings.repeats).items():
            out[name]["prefill_s"][str(n)] = t
    for name, t in decode_times(
        models, settings.decode_context, settings.decode_steps, settings.repeats
    ).items():
        out[name]["decode_s"] = t
    for name in models:
        out[name]["prefill_speedup"] = {
            n: out["original"]["prefill_s"][n] / t for n, t in out[name]["prefill_s"].items()
        }
        out[name]["decode_ratio"] = out[name]["decode_s"] / out["original"]["decode_s"]
    return out


def write_run_json(
    run_dir: Path, model: str, config: JobConfig, measured, variants, speed, commands, seconds: float
) -> None:
    """``RUN_DIR/run.json`` (the schema in the module docstring), written atomically."""
    import torch

    from swiftkv.flops import Shape, ideal_prefill_speedup, kv_bytes_per_token
    from toolkit.artifacts import write_json_atomic
    from toolkit.checkpoint import read_config

    rows = []
    quality = {v["name"]: v["quality"] for v in variants}
    lengths = config.speed.lengths
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
                ideal_prefill_speedup={str(n): ideal_prefill_speedup(shape, n) for n in lengths},
                quality=v["quality"],
                quality_before=quality.get(f"{v['name']}-converted"),
                speed=speed[v["name"]],
                lm_eval=v.get("lm_eval"),
                distill=v.get("distill"),
            )
        )
    if config.device == "cpu" or not torch.cuda.is_available():
        machine = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    else:
        machine = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    meta = dict(
        model=model,
        machine=machine,
        threads=torch.get_num_threads(),
        device=config.device,
        dtype=config.dtype,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        prefill_lengths=lengths,
        seconds=round(seconds),
        quick=config.quick,
    )
    write_json_atomic(run_dir / "run.json", {"meta": meta, "commands": commands, "variants": rows})
