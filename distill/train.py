"""The distillation run: one loop for 1 or N processes, plain or DeepSpeed ZeRO-1/2/3, through accelerate.

    setup()   the checkpoint to resume from (checked against the recipe before anything expensive; on
              another world size with the same global batch, see ``distill.elastic``), model (a SwiftKV
              checkpoint, or a base one converted on the fly; ZeRO-3 partitioned at load when the accelerate
              config says zero3_init_flag), the least-squares K/V init (layer by
              layer, on every rank), trainable set, gradient checkpointing, data, optimizer, schedule,
              accelerator.prepare, and the resume itself
    loop()    forward (shared lower layers) -> KD loss -> backward -> clip -> step, with accumulation,
              JSONL logging, held-out metrics, checkpoints every N steps, and the final HF export

Checkpoints are ``accelerator.save_state`` folders written under a temp name and renamed when every rank has
finished, next to a ``trainer_state.json`` with the step and a fingerprint of the recipe fields that must
match to resume.  The schedule is a plain LambdaLR stepped once per optimizer step (registered for
checkpointing), so its length does not depend on the number of processes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from swiftkv.card import quality_section
from swiftkv.convert import (
    CONVERT_STAGE,
    convert,
    read_config,
    resolve_num_key_value_layers,
    save_pretrained_swiftkv,
)
from swiftkv.lstsq_init import fit_swiftkv_kv
from toolkit.artifacts import read_provenance, write_json_atomic
from toolkit.checkpoint import open_checkpoint
from toolkit.cliargs import UsageError

from .comm import AdaRevision, CommState, attach_comm_hook
from .comm.config import require_ddp_path
from .data import build_datasets, check_seq_len, check_sources, collate_rows
from .elastic import Resume, ResumeError, elastic_checkpoint, fresh, plan, world_state
from .local import distill_locally
from .objective import DistillationObjective, metrics_from_sums
from .recipe import Recipe
from .shipped import deepspeed_config

_RESUME_FIELDS = ("model", "data", "loss", "optim", "comm")
_RESUME_TRAIN_FIELDS = ("micro_batch_size", "grad_accum", "trainable", "lora", "seed")


_DATA_RUNTIME_FIELDS = {"num_proc", "cache_dir", "tokenize_timeout_minutes"}  # how data is built, not what


def fingerprint(recipe: Recipe) -> dict:
    """The recipe fields a checkpoint must match to resume (the world size is not one: see ``distill.elastic``)."""
    fields = {k: getattr(recipe, k).model_dump(mode="json") for k in _RESUME_FIELDS}
    fields["data"] = recipe.data.model_dump(mode="json", exclude=_DATA_RUNTIME_FIELDS)
    fields["train"] = {k: recipe.train.model_dump(mode="json")[k] for k in _RESUME_TRAIN_FIELDS}
    return fields


def fresh_conversion(source: Path) -> bool:
    """Whether ``source`` is a SwiftKV checkpoint as ``swiftkv convert`` wrote it (never trained): the recipe's
    K/V init (``model.swiftkv.init``) applies to it."""
    return read_provenance(source).get("stage") == CONVERT_STAGE


def source_folder(recipe: Recipe, accelerator: Accelerator) -> Path:
    """``model.source`` on this machine: a folder as given, a Hub id fetched once, by the main process, into
    the Hugging Face cache."""
    with accelerator.main_process_first():
        return open_checkpoint(recipe.model.source).path


def converted_source(recipe: Recipe, accelerator: Accelerator, source: Path) -> Path:
    """The SwiftKV checkpoint to start from, given the source folder.  A base source is first converted on
    disk into ``output_dir/converted`` (by the main process, atomically), so that loading is always a plain
    ``from_pretrained``, which also handles ZeRO-3 partitioned initialization.  A fresh conversion given as the
    source (the main job converts in a stage of its own) must have the layout ``model.swiftkv`` asks for."""
    config = read_config(source)
    opts = recipe.model.swiftkv
    if "num_key_value_layers" in config:
        if opts is not None and fresh_conversion(source):
            check_layout(recipe, config)
        return source
    if opts is None:
        raise ValueError(
            f"model.source {source} is not a SwiftKV checkpoint; set model.swiftkv to convert it"
        )
    converted = Path(recipe.output_dir) / "converted"
    with accelerator.main_process_first():
        if accelerator.is_main_process and not (converted / "config.json").is_file():
            convert(
                source,
                converted,
                num_key_value_layers=opts.num_key_value_layers,
                swiftkv_fraction=opts.fraction,
                group_size=opts.group_size,
                exact_kv_window=recipe.model.exact_kv_window or 0,  # the start of the run, in its regime
                force=True,
            )
    return converted


def check_layout(recipe: Recipe, config: dict) -> None:
    """Refuse a converted source whose SwiftKV layers or AcrossKV groups differ from ``model.swiftkv``."""
    opts = recipe.model.swiftkv
    want = resolve_num_key_value_layers(
        config["num_hidden_layers"], opts.num_key_value_layers, opts.fraction, opts.group_size
    )
    have = (config["num_key_value_layers"], config.get("key_value_group_size", 1))
    if have != (want, opts.group_size):
        raise UsageError(
            f"model.source {recipe.model.source} has num_key_value_layers {have[0]} and group size {have[1]}, "
            f"but model.swiftkv asks for {want} and {opts.group_size} (to resolve, convert with the recipe's "
            "layout or change model.swiftkv)"
        )


def init_swiftkv(recipe: Recipe, accelerator: Accelerator, model, rows) -> None:
    """Start a freshly converted model's SwiftKV projections closer to the teacher than the copies:
    ``model.swiftkv.init: lstsq`` fits the K/V projections to the teacher's keys/values on the first
    ``init_rows`` training rows (``swiftkv.lstsq_init``), then ``local_steps > 0`` trains each group's projections
    on the teacher's attention outputs of the first ``local_rows`` rows (``distill.local``).  Every rank takes
    part on its share of the rows, layer by layer on its device (ZeRO-3: one gathered layer or group at a
    time), so the whole model never has to fit on one device."""
    opts = recipe.model.swiftkv
    batch, rank, world = recipe.train.micro_batch_size, accelerator.process_index, accelerator.num_processes

    def share(n: int) -> list:
        n = min(n, len(rows))
        return [rows[i : min(i + batch, n)] for i in range(rank * batch, n, world * batch)]

    if opts.init == "lstsq":
        stats = fit_swiftkv_kv(model, share(opts.init_rows), opts.init_ridge, device=accelerator.device)
        accelerator.print(f"least-squares K/V init: {stats}")
    if opts.local_steps:
        stats = distill_locally(
            model, share(opts.local_rows), opts.local_steps, opts.local_lr, device=accelerator.device
        )
        accelerator.print(f"local distillation: {stats}")


def tokenizing_first(accelerator: Accelerator, cache_dir: str | None):
    """The context the ranks build the data in: one main process per datasets cache folder goes first, the
    other ranks then find its Arrow files.  Whether the folder is shared is looked at, not assumed: the main
    process writes a marker file in it and every rank says whether it sees it.  Seen by all (one node, or a
    cache on a filesystem every node mounts): the main process tokenizes, once per run.  Otherwise (node-local
    caches): each node's local main process tokenizes into its own folder, once per node.  Mixed setups, where
    only some nodes share a folder, are not detected: give every node its own folder, or all the same one."""
    if accelerator.num_processes == 1:
        return accelerator.main_process_first()
    import datasets
    from accelerate.utils import broadcast_object_list, gather_object

    folder = Path(os.path.expanduser(cache_dir or datasets.config.HF_DATASETS_CACHE))
    marker = folder / f".shared-{broadcast_object_list([uuid.uuid4().hex])[0]}"
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        marker.touch()
    accelerator.wait_for_everyone()
    shared = all(gather_object([marker.exists()]))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink()
    accelerator.print(
        "data: tokenized by the main process (the datasets cache is shared by every rank)"
        if shared
        else "data: tokenized by each node's main process (node-local datasets caches)"
    )
    return accelerator.main_process_first() if shared else accelerator.local_main_process_first()


def check_exact_kv(recipe: Recipe, source_config: dict) -> None:
    """Refuse ``model.exact_kv_window`` on a SwiftKV source with AcrossKV groups, before any expensive work (a
    base source is checked by the recipe against ``model.swiftkv.group_size``)."""
    window, groups = recipe.model.exact_kv_window, source_config.get("key_value_group_size", 1)
    if window and "num_key_value_layers" in source_config and groups > 1:
        raise UsageError(
            f"model.exact_kv_window={window} needs key_value_group_size 1, but {recipe.model.source} has AcrossKV "
            f"groups of {groups} (to resolve, set model.exact_kv_window=0 or start from a checkpoint without groups)"
        )


def load_model(recipe: Recipe, source: Path):
    """The SwiftKV model in student mode, with the recipe's exact K/V window (saved with the checkpoint)."""
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=getattr(torch, recipe.model.dtype), attn_implementation=recipe.model.attn_implementation
    )
    if recipe.model.exact_kv_window is not None:
        model.config.exact_kv_window = recipe.model.exact_kv_window
    model.set_mode("student")
    return model


def select_trainable(model, recipe: Recipe):
    """Freeze everything but the trainable set; LoRA wraps the SwiftKV projections with peft adapters.

    With ``train.gradient_checkpointing`` every decoder layer recomputes its activations in backward
    (transformers' non-reentrant checkpointing, which needs no input that requires grad, so it also works
    for peft and for the frozen shared lower layers)."""
    if recipe.train.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    names = set(model.swiftkv_parameter_names())
    if recipe.train.trainable == "lora":
        from peft import LoraConfig, get_peft_model

        lora = recipe.train.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=r".*_proj_swiftkv"
            ),
        )
        model.base_model.model.model.norm_swiftkv.weight.requires_grad_(True)
        return model
    for name, param in model.named_parameters():
        param.requires_grad_(name in names)
    return model


@dataclass
class Run:
    recipe: Recipe
    accelerator: Accelerator
    objective: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_loader: DataLoader
    eval_loader: DataLoader
    max_steps: int
    start_step: int
    out: Path
    comm: CommState | None = None
    scar: object | None = None  # distill.scar.running.RunningCheckpoint
    recovered: bool = False  # resumed from SCAR's running checkpoint: a mix of block versions, not one step's
    source: Path | None = None  # the folder the model was loaded from (its licence files and card travel on)


def _schedule(recipe: Recipe, max_steps: int):
    warmup = math.ceil(recipe.optim.warmup_ratio * max_steps)
    decay = max(1, min(max_steps - warmup, round(recipe.optim.decay_ratio * max_steps)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if recipe.optim.schedule == "wsd":  # stable, then linear to 0 over the last `decay` steps
            return min(1.0, max(0.0, (max_steps - step) / decay))
        progress = (step - warmup) / max(1, max_steps - warmup)
        if recipe.optim.schedule == "linear":
            return max(0.0, 1.0 - progress)
        if recipe.optim.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def latest_checkpoint(out: Path) -> Path | None:
    done = sorted(
        (out / "checkpoints").glob("step_*/trainer_state.json"), key=lambda p: int(p.parent.name[5:])
    )
    return done[-1].parent if done else None


def zero_stage(accelerator: Accelerator) -> int:
    plugin = accelerator.state.deepspeed_plugin
    return plugin.zero_stage if plugin is not None else 0


def resume_point(recipe: Recipe, num_processes: int, stage: int) -> Resume:
    """The latest complete checkpoint, its step and this launch's grad_accum (a fresh start without one);
    raises ResumeError when it was written by another recipe or cannot continue on this launch."""
    ckpt = latest_checkpoint(Path(recipe.output_dir)) if recipe.checkpoint.resume == "auto" else None
    if ckpt is None:
        return fresh(recipe, num_processes)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    saved, expected = state["fingerprint"], fingerprint(recipe)
    if saved != expected:
        differ = sorted(k for k in expected if saved.get(k) != expected[k])
        raise ResumeError(
            f"checkpoint {ckpt} was written by a different recipe (differs in: {', '.join(differ)}); "
            "to resolve, use a new output_dir or checkpoint.resume=never"
        )
    return plan(ckpt, state, recipe, num_processes, stage)


def check_trackers(names: list[str]) -> None:
    """Refuse a ``log.report_to`` tracker that is not installed (accelerate would drop it silently)."""
    from accelerate.tracking import get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    missing = [n for n in names if n not in available]
    if missing:
        raise UsageError(
            f"log.report_to names {', '.join(missing)}, not installed here (to resolve, `pip install "
            f"{' '.join(missing)}`, or remove it from log.report_to)"
        )


def tracker_config(recipe: Recipe) -> dict:
    """The recipe as flat ``section.key: scalar`` pairs (what trackers' hyperparameter tables take)."""
    flat = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        elif node is not None:
            flat[prefix[:-1]] = node if isinstance(node, int | float | str | bool) else json.dumps(node)

    walk("", recipe.model_dump(mode="json"))
    return flat


def setup(recipe: Recipe) -> Run:
    check_trackers(recipe.log.report_to)
    # gloo on CPU; the handler must only be passed to multi-process launches (else accelerate expects a group),
    # and without DeepSpeed accelerate only wraps a CPU model in DDP when told cpu=True
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cpu_multi = multi and not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):  # before the Accelerator reads it
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = deepspeed_config(
            os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
        )
    group = InitProcessGroupKwargs(
        # long enough for the main process to tokenize the data while the other ranks wait at a barrier
        backend="gloo" if cpu_multi else "nccl",
        timeout=timedelta(minutes=recipe.data.tokenize_timeout_minutes),
    )
    accelerator = Accelerator(
        cpu=cpu_multi and not deepspeed,
        gradient_accumulation_steps=recipe.train.grad_accum,
        mixed_precision=recipe.train.mixed_precision,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[group] if multi else [],
        log_with=recipe.log.report_to or None,
        project_config=ProjectConfiguration(logging_dir=str(Path(recipe.output_dir) / "trackers")),
    )
    require_ddp_path(recipe.comm, deepspeed, accelerator.num_processes)  # before any expensive work
    resume = resume_point(recipe, accelerator.num_processes, zero_stage(accelerator))
    ckpt, start_step = resume.checkpoint, resume.step
    accelerator.gradient_accumulation_steps = resume.grad_accum  # the global batch of the checkpoint
    check_sources(recipe.data)  # a gated source without a login, a missing file: before the conversion
    base = source_folder(recipe, accelerator)
    check_seq_len(recipe.data, read_config(base).get("max_position_embeddings"))  # before the conversion
    check_exact_kv(recipe, read_config(base))
    ds_plugin = accelerator.state.deepspeed_plugin
    if ds_plugin is not None:
        if resume.elastic:
            ds_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}
        if recipe.train.trainable == "lora" and ds_plugin.zero_stage == 3:
            raise ValueError(
                "train.trainable=lora is not supported with ZeRO-3 (to resolve, use ZeRO-2 or trainable=swiftkv)"
            )
        ds_plugin.deepspeed_config["gradient_clipping"] = recipe.optim.grad_clip or 0.0
    set_seed(recipe.train.seed)
    out = Path(recipe.output_dir)
    source = converted_source(recipe, accelerator, base)
    tokenizer = AutoTokenizer.from_pretrained(source)
    with tokenizing_first(accelerator, recipe.data.cache_dir):
        train_rows, eval_rows = build_datasets(
            recipe.data, tokenizer, read_config(source).get("max_position_embeddings")
        )
    model = load_model(recipe, source)
    opts = recipe.model.swiftkv
    if ckpt is None and opts is not None and fresh_conversion(source):
        init_swiftkv(recipe, accelerator, model, train_rows)  # a trained SwiftKV source is kept as it is
    model = select_trainable(model, recipe)
    train_loader = DataLoader(  # rows stay in the datasets cache (Arrow, memory-mapped), read row by row
        train_rows,
        batch_size=recipe.train.micro_batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(recipe.data.seed),
        collate_fn=collate_rows,
    )
    eval_loader = DataLoader(eval_rows, batch_size=recipe.train.micro_batch_size, collate_fn=collate_rows)
    objective = DistillationObjective(model, recipe.loss, recipe.train.shared_lower_layers)
    params = [p for p in objective.parameters() if p.requires_grad]
    if recipe.optim.type == "adarevision":
        optimizer = AdaRevision(params, lr=recipe.optim.lr, delay=recipe.comm.staleness)
    else:
        optimizer = torch.optim.AdamW(
            params, lr=recipe.optim.lr, betas=recipe.optim.betas, weight_decay=recipe.optim.weight_decay
        )
    objective, optimizer, train_loader, eval_loader = accelerator.prepare(
        objective, optimizer, train_loader, eval_loader
    )
    comm = attach_comm_hook(objective, recipe.comm)  # None on one process or DeepSpeed with the default comm
    steps_per_epoch = max(1, len(train_loader) // accelerator.gradient_accumulation_steps)
    max_steps = recipe.train.max_steps or math.ceil(recipe.train.epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(recipe, max_steps))
    accelerator.register_for_checkpointing(scheduler)  # first: custom_checkpoint_0 on every world size
    if comm is not None and not resume.elastic:
        accelerator.register_for_checkpointing(comm)  # residuals and in-flight averages survive a resume

    if ckpt is not None:
        load_dir = ckpt
        if resume.elastic:
            with accelerator.main_process_first():  # the main process converts, the others find it done
                load_dir = elastic_checkpoint(ckpt)
            accelerator.print(resume.describe())
        accelerator.load_state(str(load_dir))
        if resume.elastic:  # the micro-batch counter placing accumulation boundaries comes from rank i's
            accelerator.step = start_step * resume.grad_accum  # RNG file, counted at the other world size
        accelerator.print(f"resumed from {ckpt} at step {start_step}")
    if comm is not None and resume.elastic:
        accelerator.register_for_checkpointing(comm)  # another world size's per-rank state is not loaded
    full_step = start_step
    scar, start_step = _running_checkpoint(recipe, accelerator, objective, optimizer, scheduler, full_step)
    return Run(
        recipe,
        accelerator,
        objective,
        tokenizer,
        optimizer,
        scheduler,
        train_loader,
        eval_loader,
        max_steps,
        start_step,
        out,
        comm,
        scar,
        recovered=start_step != full_step,
        source=source,
    )


def _running_checkpoint(
    recipe: Recipe, accelerator: Accelerator, objective, optimizer, scheduler, full_step: int
) -> tuple[object | None, int]:
    """SCAR's prioritized running checkpoint over the blocks this rank owns (its ZeRO partition, or a share
    of the trainable parameters), and the step to resume at.  On resume every rank opens its folder and
    all ranks decide together (one gather: no rank hangs): any rank's error stops every rank with that
    line; otherwise the run resumes at the oldest rank's last running save, with every block saved after
    the full checkpoint at its newest copy, the others (and damaged ones, one warning line) at the full
    checkpoint's values, and the learning rate and optimizer step counters of that step.  Without a full
    checkpoint the base is the fresh start (step 0), and the folder's ``recipe.json`` must match."""
    if recipe.checkpoint.scar is None:
        return None, full_step
    import sys

    from accelerate.utils import gather_object

    from toolkit.cliargs import one_line

    from .scar.running import (
        RunningCheckpoint,
        advance_step_counters,
        broadcast_from_owners,
        owned_by_rank,
        step_counters,
    )
    from .scar.zero import push_to_model, zero_partitions

    rank, world = accelerator.process_index, accelerator.num_processes
    zero = accelerator.state.deepspeed_plugin is not None
    if zero:
        tensors, base_opt = zero_partitions(optimizer.optimizer)
    else:
        trainable = [
            (n, p) for n, p in accelerator.unwrap_model(objective).named_parameters() if p.requires_grad
        ]
        tensors, base_opt = owned_by_rank(trainable, rank, world), optimizer.optimizer
    folder = Path(recipe.output_dir) / "scar"
    accelerator.wait_for_everyone()
    ranks = {p.name for p in folder.glob("rank_*")}
    written_by = (
        json.loads((folder / "recipe.json").read_text()) if (folder / "recipe.json").is_file() else None
    )
    accelerator.wait_for_everyone()  # every rank has looked before the main process may change them
    resume = recipe.checkpoint.resume == "auto" and bool(ranks)
    if resume and ranks != {f"rank_{r:05d}" for r in range(world)}:  # written on another world size
        accelerator.print(f"warning: {folder} was written by {len(ranks)} processes: resuming without it")
        if accelerator.is_main_process:
            shutil.rmtree(folder)
        accelerator.wait_for_everyone()
        resume = False
    if resume and written_by != fingerprint(recipe) and (written_by is not None or full_step == 0):
        raise ResumeError(
            f"running checkpoint {folder} was written by a different recipe; to resolve, use a new "
            "output_dir or checkpoint.resume=never"
        )
    scar, error = None, ""
    try:
        scar = RunningCheckpoint(folder, tensors, recipe.checkpoint.scar, base_opt, rank, resume=resume)
    except (ValueError, OSError) as e:  # a damaged manifest, other block settings than the saved ones
        error = f"rank {rank}: {one_line(e)}"
    reports = gather_object([(error, scar.step if scar is not None and scar.step is not None else -1)])
    errors = [e for e, _ in reports if e]
    if errors:
        raise ResumeError(f"running checkpoint not resumable ({errors[0]})")
    if accelerator.is_main_process:
        write_json_atomic(folder / "recipe.json", fingerprint(recipe))
    start = max(full_step, min(s for _, s in reports)) if resume else full_step
    if start == full_step:
        return scar, full_step
    counters = step_counters(base_opt)
    damaged = scar.resume_onto(full_step)
    if damaged:
        print(
            f"warning: rank {rank}: {len(damaged)} running checkpoint block(s) missing or damaged "
            f"({', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}); taken from the full checkpoint "
            f"of step {full_step}" + (" (the fresh start)" if full_step == 0 else ""),
            file=sys.stderr,
        )
    if zero:
        push_to_model(optimizer.optimizer)
    elif world > 1:
        broadcast_from_owners(trainable, optimizer.optimizer)
    advance_step_counters(base_opt, counters, start - full_step)
    scheduler.last_epoch = start
    for group, base_lr, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base_lr * factor(start)
    accelerator.print(f"resumed running checkpoint {folder} at step {start}")
    return scar, start


def save_checkpoint(run: Run, step: int) -> None:
    acc, root = run.accelerator, run.out / "checkpoints"
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    acc.wait_for_everyone()
    if acc.is_main_process:
        write_json_atomic(
            tmp / "trainer_state.json",
            {
                "step": step,
                "fingerprint": fingerprint(run.recipe),
                **world_state(
                    run.recipe, acc.num_processes, acc.gradient_accumulation_steps, zero_stage(acc)
                ),
            },
        )
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step_*"), key=lambda p: int(p.name[5:]))[: -run.recipe.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Held-out KL(teacher || student) at T=1, top-1 agreement and both perplexities, over counted tokens."""
    run.objective.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=run.accelerator.device)
    for i, (ids, pos, mask) in enumerate(run.eval_loader):
        if i >= run.recipe.log.eval_batches:
            break
        sums += run.objective(ids, pos, mask)["metrics"]
    run.objective.train()
    return {f"eval_{k}": v for k, v in metrics_from_sums(run.accelerator.reduce(sums, "sum")).items()}


def export(run: Run, metrics: dict) -> Path:
    """Write the distilled model as a normal SwiftKV checkpoint in ``output_dir/model`` (ZeRO-3 gathered)."""
    acc = run.accelerator
    state = acc.get_state_dict(run.objective)  # gathers ZeRO-3 partitions on the main process
    if acc.is_main_process:
        objective = acc.unwrap_model(run.objective)
        model = objective.model
        state = {k.removeprefix("model."): v for k, v in state.items()}
        if run.recipe.train.trainable == "lora":
            model.load_state_dict(state)
            model = model.merge_and_unload()
            state = model.state_dict()
        model.set_mode("student")
        recipe = yaml.safe_dump(run.recipe.model_dump(mode="json", exclude={"output_dir"}), sort_keys=False)
        held_out = {k.removeprefix("eval_"): v for k, v in metrics.items() if k.startswith("eval_")}
        save_pretrained_swiftkv(
            model,
            run.out / "model",
            tokenizer=run.tokenizer,
            state_dict=state,
            force=True,
            provenance={"stage": "distill", "recipe": run.recipe.model_dump(mode="json"), **metrics},
            source=run.source,
            made_by=[
                "`python -m distill`: the SwiftKV projections trained to match the teacher (the same weights "
                "in original mode), every original weight frozen. The recipe:",
                "",
                "```yaml",
                recipe.rstrip(),
                "```",
            ],
            quality=quality_section(
                held_out,
                "At the end of distillation, on the recipe's held-out rows (`data.holdout`), against the "
                "teacher: KL(teacher || student) at T = 1, top-1 agreement, perplexities of both.",
            ),
        )
    acc.wait_for_everyone()
    return run.out / "model"


def train(recipe: Recipe, end_training: bool = True) -> Path:
    """Run (or resume) a distillation and return the exported model folder.  ``end_training=False`` keeps
    the process group for another run in the same processes (``distill.sweep``)."""
    return loop(setup(recipe), end_training)


def loop(run: Run, end_training: bool = True) -> Path:
    """The training loop of a set-up run, the final held-out metrics and the export."""
    acc, cfg = run.accelerator, run.recipe
    log_path = run.out / "log.jsonl"
    if acc.is_main_process:
        run.out.mkdir(parents=True, exist_ok=True)
        if run.start_step == 0 and log_path.exists():
            log_path.unlink()
    step, tokens, t0 = run.start_step, 0, time.perf_counter()
    epoch_batches = len(run.train_loader)
    skip = (step * acc.gradient_accumulation_steps) % max(epoch_batches, 1)
    epoch = (step * acc.gradient_accumulation_steps) // max(epoch_batches, 1)
    parts = []  # this step's micro-batch losses: the logged loss is their mean, the same on any world size
    # tokens processed per optimizer step (every position of the global batch): the x of the quality curve,
    # the same on any world size because an elastic resume keeps the global batch
    step_tokens = (
        cfg.data.seq_len * cfg.train.micro_batch_size * acc.gradient_accumulation_steps * acc.num_processes
    )

    # the trackers get the same numbers as log.jsonl, which stays the source of the reports
    if cfg.log.report_to:
        acc.init_trackers(run.out.name, config=tracker_config(cfg))

    def log(record: dict) -> None:
        if acc.is_main_process:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
            acc.log(numbers, step=record["step"])

    if step == 0:
        log({"step": 0, "train_tokens": 0, **evaluate(run)})
    elif run.recovered and cfg.log.eval_every_steps:
        # the recovered state (SCAR's bounded perturbation), evaluated before training on: what it cost
        log({"step": step, "train_tokens": step * step_tokens, "resumed": "running", **evaluate(run)})
    bar = tqdm(total=run.max_steps, initial=step, desc="distill", disable=not acc.is_local_main_process)
    run.objective.train()
    while step < run.max_steps:
        run.train_loader.set_epoch(epoch)
        loader = acc.skip_first_batches(run.train_loader, skip) if skip else run.train_loader
        for ids, pos, mask in loader:
            with acc.accumulate(run.objective):
                out = run.objective(ids, pos, mask)
                acc.backward(out["loss"])
                if acc.sync_gradients and cfg.optim.grad_clip and acc.state.deepspeed_plugin is None:
                    acc.clip_grad_norm_(
                        [p for p in run.objective.parameters() if p.requires_grad], cfg.optim.grad_clip
                    )
                run.optimizer.step()
                run.optimizer.zero_grad()
            tokens += int(mask.sum()) * acc.num_processes
            parts.append(torch.stack([out["loss"].detach(), out["kl"], out["mse"]]))
            if not acc.sync_gradients:
                continue
            step_losses, parts = torch.stack(parts).mean(0), []
            run.scheduler.step()
            step += 1
            bar.update(1)
            record = {"step": step, "lr": run.scheduler.get_last_lr()[0]}
            if step % cfg.log.every_steps == 0 or step == run.max_steps:
                losses = acc.reduce(step_losses, "mean")
                elapsed = time.perf_counter() - t0
                record.update(
                    loss=losses[0].item(),
                    kl=losses[1].item(),
                    mse=losses[2].item(),
                    counted_tokens_per_s=tokens / elapsed,
                )
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                if run.comm is not None:
                    record.update(run.comm.summary())
            if cfg.log.eval_every_steps and step % cfg.log.eval_every_steps == 0 and step < run.max_steps:
                record.update(train_tokens=step * step_tokens, **evaluate(run))
            if len(record) > 2:
                log(record)
            if step % cfg.checkpoint.every_steps == 0 or step == run.max_steps:
                save_checkpoint(run, step)
            if run.scar is not None:
                run.scar.maybe_save(step)  # no collectives: each rank writes only its own blocks
            if step >= run.max_steps:
                break
        epoch, skip = epoch + 1, 0
    bar.close()
    metrics = evaluate(run)
    log({"step": step, "train_tokens": step * step_tokens, **metrics})  # the curve's last point
    metrics["train_seconds"] = time.perf_counter() - t0
    if acc.is_main_process:
        write_json_atomic(run.out / "final_metrics.json", metrics)
    path = export(run, metrics)
    if end_training:
        acc.end_training()
    return path
