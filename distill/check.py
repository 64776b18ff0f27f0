"""``swiftkv check RECIPE [key=value ...]``: will this run work, and does it fit, before launch?

Reads only small files, so a 405B check runs on a laptop: the recipe (validated), the model's ``config.json``
and its weights files' headers (``--model-config`` when the model folder is not on this machine; a Hub id
fetches only its config and tokenizer), the tokenizer files, the accelerate config (``--config``: process and
machine count, DeepSpeed stage, offload, buckets) and the first ``--limit`` rows of every data source.  Prints
per-source sample and assistant-token counts, the per-GPU memory plan of ``distill.memory`` and the run's size
of ``distill.budget`` (rows, optimizer steps, positions, hours at a stated per-GPU throughput); exits 2 with
one line when the recipe is invalid, a source yields no trainable row or cannot be read (hub sources need
network, gated ones a login; ``--no-data`` skips the row check and says so), or the plan does not fit
``--gpu-memory`` GB per GPU (after a reserve for the CUDA context, NCCL and fragmentation).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from swiftkv.convert import resolve_num_key_value_layers
from swiftkv.flops import Shape
from toolkit.checkpoint import Checkpoint, open_checkpoint
from toolkit.cliargs import ArgumentParser, UsageError, add_limit, existing_path, looks_like_hub_id, run

from .budget import DEFAULT_TFLOPS, plan_budget
from .memory import GB, Batch, Parallel, Params, activations, comm_buffers, lstsq_init, model_states
from .recipe import Recipe
from .shipped import find, load_recipe_or_usage

RESERVE = 0.10  # share of each GPU kept for the CUDA context, NCCL buffers and allocator fragmentation
EPILOG = """examples:
  swiftkv check swiftkv_llama3.1_8b --config accelerate/8gpu_zero2          # shipped names (`swiftkv recipes`)
  swiftkv check swiftkv_llama3.3_70b --config accelerate/8gpu_zero3 \\
      --model-config /path/to/Llama-3.3-70B-Instruct/config.json --no-data
  swiftkv check swiftkv_llama3.1_405b --config accelerate/128gpu_16nodes_zero3 \\
      --model-config model_configs/llama3.1_405b --no-data --sample-tokens 1000 --tflops 300
  swiftkv check my_recipe.yaml data.seq_len=1024 --gpu-memory 24                # a file
"""


class IntermixedParser(ArgumentParser):
    """Overrides may come before or after the options (``RECIPE --config X key=value``)."""

    def parse_args(self, args=None, namespace=None):
        return self.parse_intermixed_args(args, namespace)


def build_parser() -> ArgumentParser:
    parser = IntermixedParser(
        prog="swiftkv check",
        description="Validate a distillation recipe, its data and its per-GPU memory plan (no weights loaded).",
        epilog=EPILOG,
    )
    parser.add_argument("recipe", help="YAML recipe: a file or a shipped name (`swiftkv recipes`)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.seq_len=4096")
    parser.add_argument(
        "--config", help="accelerate config YAML: a file or a shipped name (default: one process)"
    )
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU (default: 80)")
    parser.add_argument(
        "--model-config",
        help="config.json to use when model.source is not on this machine: a file or a shipped name",
    )
    parser.add_argument("--tokenizer", type=existing_path, help="tokenizer folder (default: the model's)")
    parser.add_argument("--no-data", action="store_true", help="skip reading rows of the data sources")
    parser.add_argument(
        "--sample-tokens",
        type=float,
        help="mean tokens per training sample for the run's size (default: measured on the rows read; without "
        "data and without this, steps and hours are not estimated)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        help="training samples when a source has no max_samples (default: the sum of data.sources[].max_samples)",
    )
    parser.add_argument(
        "--tflops",
        type=float,
        default=DEFAULT_TFLOPS,
        help=f"achieved TFLOP/s per GPU the hours are computed at (default: {DEFAULT_TFLOPS:g}, an assumption)",
    )
    add_limit(parser, 8, "rows read per data source")
    return parser


def open_source(recipe: Recipe, tokenizer: bool) -> Checkpoint:
    """``model.source`` checked as every entry point checks a model (``toolkit.checkpoint``): a local folder
    with its weights' headers (a folder of only config.json and tokenizer, for a check on a laptop, is
    fine), a Hub id by its config and tokenizer only (no weights are downloaded)."""
    source = recipe.model.source
    hub = looks_like_hub_id(source)
    local = Path(source).expanduser()
    if not hub and not local.exists():
        raise UsageError(
            f"model.source {source} is not on this machine "
            "(to resolve, pass --model-config PATH/config.json of that model)"
        )
    weights = not hub and (
        any(local.glob("*.safetensors")) or (local / "model.safetensors.index.json").is_file()
    )
    return open_checkpoint(source, weights=weights, tokenizer=tokenizer)


def model_config_of(recipe: Recipe, path: Path | None) -> dict:
    """The model's config.json: ``path`` when given, else the one in ``model.source`` (never any weights)."""
    if path is None:
        return open_source(recipe, tokenizer=False).config
    path = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{path} is not valid JSON ({e.msg}) (to resolve, pass the model's config.json)"
        ) from None


def swiftkv_shape(config: dict, recipe: Recipe) -> Shape:
    """The SwiftKV shape: a SwiftKV config as it is, a base config with the recipe's ``model.swiftkv``."""
    if "num_key_value_layers" in config:
        return Shape.from_config(config)
    opts = recipe.model.swiftkv
    if opts is None:
        raise UsageError(
            "model.source is not a SwiftKV checkpoint and the recipe has no model.swiftkv "
            "(to resolve, set model.swiftkv.num_key_value_layers or model.swiftkv.fraction)"
        )
    l = resolve_num_key_value_layers(
        config["num_hidden_layers"], opts.num_key_value_layers, opts.fraction, opts.group_size
    )
    return Shape.from_config({**config, "num_key_value_layers": l, "key_value_group_size": opts.group_size})


def parallel_plan(path: Path | None) -> Parallel:
    """Process count, ZeRO stage, offload and buckets from an accelerate config (and its DeepSpeed JSON)."""
    if path is None:
        return Parallel()
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        cfg = None
    if not isinstance(cfg, dict):
        raise UsageError(
            f"{path} is not an accelerate config mapping (to resolve, pass `accelerate config` output)"
        )
    processes = int(cfg.get("num_processes") or 1)
    nodes = int(cfg.get("num_machines") or 1)
    if processes % nodes:
        raise UsageError(
            f"{path}: num_processes {processes} is not a multiple of num_machines {nodes} "
            "(to resolve, set num_processes to GPUs per node x num_machines)"
        )
    if cfg.get("distributed_type") != "DEEPSPEED":
        return Parallel(processes=processes, nodes=nodes)
    ds_cfg = cfg.get("deepspeed_config") or {}
    ds_file = ds_cfg.get("deepspeed_config_file")
    if ds_file:
        ds_path = find(ds_file, "DeepSpeed config")  # a shipped config names recipes/deepspeed/NAME.json
        try:
            ds = json.loads(ds_path.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(
                f"{ds_path} is not valid JSON ({e.msg}) (to resolve, fix the DeepSpeed config)"
            ) from None
    else:  # accelerate's inline keys
        ds = {
            "zero_optimization": {
                "stage": ds_cfg.get("zero_stage", 2),
                "offload_optimizer": {"device": ds_cfg.get("offload_optimizer_device", "none")},
                "offload_param": {"device": ds_cfg.get("offload_param_device", "none")},
            }
        }
    return Parallel.from_deepspeed(processes, ds, nodes)


def _resolvable(message: str) -> str:
    return (
        message if "to resolve" in message else f"{message} (to resolve, check the source, or pass --no-data)"
    )


def data_report(recipe: Recipe, tokenizer_dir: Path, rows: int) -> tuple[list[str], float]:
    """Per-source counts over the first ``rows`` records and the mean tokens per trainable sample (sources
    weighted by their ``weight``); UsageError for a source that cannot be read or yields no trainable sample
    (named, with the columns it has)."""
    from transformers import AutoTokenizer

    from .data import DataError, check_sources, source_stats

    try:
        check_sources(recipe.data)  # gated sources without a login, missing files: before any download
    except DataError as e:
        raise UsageError(_resolvable(str(e))) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError):
        raise UsageError(
            f"no tokenizer in {tokenizer_dir} (to resolve, pass --tokenizer DIR with the model's tokenizer "
            "files, or --no-data)"
        ) from None
    lines = [
        f"data: first {rows} rows of each source (tokenizer {tokenizer_dir})",
        f"  {'source':<44} {'format':<10} {'rows':>5} {'samples':>7} {'assistant tokens':>16}",
    ]
    means = []
    for source in recipe.data.sources:
        try:
            stats = source_stats(source, tokenizer, rows, recipe.data.seq_len, recipe.data.loss_on)
        except DataError as e:
            raise UsageError(_resolvable(str(e))) from None
        if stats["samples"] == 0 or stats["assistant_tokens"] == 0:
            raise UsageError(
                f"data source {source.path!r} yields no trainable sample in its first {stats['rows']} rows "
                f"(format {stats['format']}, columns: {', '.join(stats['columns'])}) "
                "(to resolve, set data.sources[].format to its layout or fix the source)"
            )
        lines.append(
            f"  {source.path:<44} {stats['format']:<10} {stats['rows']:>5} {stats['samples']:>7} "
            f"{stats['assistant_tokens']:>16}"
        )
        means.append((source.weight, stats["tokens"] / stats["samples"]))
    return lines, sum(w * m for w, m in means) / sum(w for w, _ in means)


def plan(recipe: Recipe, config: dict, par: Parallel) -> dict:
    """The memory plan of a recipe: parts in bytes, grouped, plus the settings they assume."""
    shape = swiftkv_shape(config, recipe)
    train = recipe.train
    checkpointing = train.gradient_checkpointing
    half = recipe.model.dtype != "float32" or (par.stage > 0 and train.mixed_precision == "bf16")
    w = 2 if half else 4
    a = 2 if half or train.mixed_precision == "bf16" else 4
    params = Params.of(shape, config, train.trainable, train.lora.r)
    batch = Batch(
        train.micro_batch_size,
        recipe.data.seq_len,
        recipe.loss.chunk_tokens,
        a,
        train.shared_lower_layers,
        recipe.model.attn_implementation,
        recipe.data.packing,
    )
    values = 2 if recipe.optim.type == "adamw" else 3 + recipe.comm.staleness
    acts = {c: activations(shape, batch, c) for c in (False, True)}
    init = recipe.model.swiftkv is not None and recipe.model.swiftkv.init == "lstsq"
    return {
        "shape": shape,
        "params": params,
        "checkpointing": checkpointing,
        "model states": model_states(params, par, w, values),
        "activations": acts[checkpointing],
        "activations total": {c: sum(v.values()) for c, v in acts.items()},
        "communication": comm_buffers(params, par, w),
        "lstsq init": lstsq_init(shape, params, batch, par, w) if init else {},
    }


def peak_gb(p: dict) -> float:
    """Per-GPU peak of a plan (GB): training, or the least-squares init before it if that is larger."""
    training = sum(sum(p[k].values()) for k in ("model states", "activations", "communication"))
    return max(training, sum(p["lstsq init"].values())) / GB


def _zero(par: Parallel) -> str:
    if par.stage == 0:
        return "DDP" if par.processes > 1 else "no DeepSpeed"
    offload = [k for k, on in (("optimizer", par.offload_optimizer), ("params", par.offload_params)) if on]
    return f"DeepSpeed ZeRO-{par.stage}" + (f" (offload: {', '.join(offload)} to CPU)" if offload else "")


def format_plan(recipe: Recipe, par: Parallel, p: dict, gpu_memory: float) -> tuple[list[str], float]:
    """The printed plan and its peak (GB per GPU): training, or the least-squares init if larger."""
    s, params, train = p["shape"], p["params"], recipe.train
    lines = [
        f"model: {s.layers} layers, hidden {s.hidden}, heads {s.heads}/{s.kv_heads} x {s.head_dim}, "
        f"MLP {s.intermediate}, vocab {s.vocab}; SwiftKV l={s.num_key_value_layers}, {s.groups} K/V groups",
        f"parameters: {params.total / 1e9:.2f} B, trainable {params.trainable / 1e9:.3f} B "
        f"({100 * params.trainable / params.total:.1f}%, train.trainable={train.trainable})",
        f"run: {par.processes} process(es), {_zero(par)}; micro_batch {train.micro_batch_size} x seq_len "
        f"{recipe.data.seq_len}, grad_accum {train.grad_accum}, mixed_precision {train.mixed_precision}, "
        f"gradient checkpointing {'on' if p['checkpointing'] else 'off'}, KD chunk {recipe.loss.chunk_tokens} tokens",
        "per-GPU memory (GB = 1e9 bytes):",
    ]
    total = 0.0
    for title, part in (
        ("model states", p["model states"]),
        ("activations", p["activations"]),
        ("communication buffers", p["communication"]),
    ):
        if not part:
            continue
        sub = sum(part.values()) / GB
        total += sub
        lines.append(f"  {title:<40} {sub:8.2f}")
        lines += [f"    {name:<38} {v / GB:8.2f}" for name, v in part.items()]
    off, on = (p["activations total"][c] / GB for c in (False, True))
    lines.append(f"  (activations without checkpointing {off:.2f}, with {on:.2f})")
    lines.append(f"  {'training peak':<40} {total:8.2f}")
    peak = peak_gb(p)
    if p["lstsq init"]:
        init = sum(p["lstsq init"].values()) / GB
        lines.append(f"  {'least-squares init (before training)':<40} {init:8.2f}")
        lines += [f"    {name:<38} {v / GB:8.2f}" for name, v in p["lstsq init"].items()]
    budget = gpu_memory * (1 - RESERVE)
    verdict = "fits" if peak <= budget else "does NOT fit"
    lines.append(
        f"peak {peak:.2f} GB of {budget:.1f} GB usable per {gpu_memory:g} GB GPU "
        f"({100 * RESERVE:.0f}% reserved): {verdict}"
    )
    return lines, peak


def longest_seq_len(
    recipe: Recipe, config: dict, par: Parallel, usable_gb: float, step: int = 1024
) -> int | None:
    """The longest ``data.seq_len`` (a multiple of ``step``, below the recipe's) whose plan fits ``usable_gb``,
    everything else unchanged; None when not even ``step`` tokens fit."""

    def fits(n: int) -> bool:
        shorter = recipe.model_copy(update={"data": recipe.data.model_copy(update={"seq_len": n * step})})
        return peak_gb(plan(shorter, config, par)) <= usable_gb

    lo, hi = 0, (recipe.data.seq_len - 1) // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * step if lo and fits(lo) else None


def train_samples(recipe: Recipe, given: int | None) -> int | None:
    """Training samples: ``--samples``, else the sum of the sources' ``max_samples`` (None when one has none),
    less the held-out share."""
    caps = [s.max_samples for s in recipe.data.sources]
    total = given if given is not None else (None if None in caps else sum(caps))
    return None if total is None else int(total * (1 - recipe.data.holdout))


def format_budget(
    recipe: Recipe,
    par: Parallel,
    p: dict,
    samples: int | None,
    sample_tokens: tuple[float, str] | None,
    tflops: float,
) -> list[str]:
    """The launch, and the run's rows, steps, positions and hours (``distill.budget``) when they can be sized."""
    train = recipe.train
    per_node = par.processes // par.nodes
    lines = [
        f"launch: {par.processes} process(es) on {par.nodes} node(s) x {per_node}; global batch "
        f"{train.micro_batch_size * train.grad_accum * par.processes} rows (micro_batch {train.micro_batch_size} x "
        f"grad_accum {train.grad_accum} x {par.processes} processes) of {recipe.data.seq_len} positions"
    ]
    missing = [
        what
        for what, value in (
            ("samples (--samples)", samples),
            ("tokens per sample (--sample-tokens)", sample_tokens),
        )
        if value is None
    ]
    if missing:
        return [*lines, f"size: not estimated (no {' and no '.join(missing)})"]
    b = plan_budget(
        p["shape"],
        p["params"].trainable,
        samples=samples,
        sample_tokens=sample_tokens[0],
        seq_len=recipe.data.seq_len,
        packing=recipe.data.packing,
        micro_batch=train.micro_batch_size,
        grad_accum=train.grad_accum,
        processes=par.processes,
        epochs=train.epochs,
        max_steps=train.max_steps,
        checkpointing=p["checkpointing"],
        shared_lower_layers=train.shared_lower_layers,
        tflops=tflops,
    )
    rows = "packed rows (lower bound)" if recipe.data.packing else "rows (one sample each, unpacked)"
    steps = f"train.max_steps={train.max_steps}" if train.max_steps else f"{train.epochs:g} epoch(s)"
    return [
        *lines,
        f"size: {b.samples:,} training samples x {b.sample_tokens:,.0f} tokens ({sample_tokens[1]}) -> "
        f"{b.rows:,} {rows} -> {b.steps:,} optimizer steps ({steps}), {b.tokens / 1e9:,.2f} B positions",
        f"time: {b.flops_per_row / 1e15:,.2f} PFLOP per row, {b.hours:,.1f} h on {b.processes} GPUs "
        f"({b.hours * b.processes:,.0f} GPU-hours) at {b.tflops:g} TFLOP/s per GPU (stated, not measured: --tflops)",
    ]


def check(args) -> None:
    recipe = load_recipe_or_usage(args.recipe, args.overrides)
    for name, kind in (("config", "accelerate config"), ("model_config", "model config")):
        if getattr(args, name) is not None:
            setattr(args, name, find(getattr(args, name), kind))
    source = None
    if args.model_config is None:
        source = open_source(recipe, tokenizer=args.tokenizer is None and not args.no_data)
    config = source.config if source is not None else model_config_of(recipe, args.model_config)
    par = parallel_plan(args.config)
    max_pos = config.get("max_position_embeddings")
    if max_pos is not None and recipe.data.seq_len > max_pos:
        raise UsageError(
            f"data.seq_len={recipe.data.seq_len} exceeds the model's max_position_embeddings={max_pos} "
            "(to resolve, lower data.seq_len)"
        )
    p = plan(recipe, config, par)
    lines, peak = format_plan(recipe, par, p, args.gpu_memory)
    print(f"recipe {args.recipe}: valid")
    print("\n".join(lines))
    usable = args.gpu_memory * (1 - RESERVE)
    if peak > usable:
        fixes = [] if p["checkpointing"] else ["turn on train.gradient_checkpointing"]
        longest = longest_seq_len(recipe, config, par, usable)
        if longest is not None:  # the row's activations are what does not fit: more GPUs would not help
            fixes.append(
                f"lower data.seq_len to {longest} or less; a row is never split across GPUs here, there is no "
                "sequence parallelism as in the reference's long-context recipes"
            )
        else:
            fixes.append("lower train.micro_batch_size, data.seq_len or loss.chunk_tokens")
            fixes.append("use ZeRO-3 (with optimizer offload) or more GPUs")
        raise UsageError(
            f"the run needs {peak:.1f} GB per GPU, more than {usable:.1f} GB usable of {args.gpu_memory:g} GB "
            f"(to resolve, {'; '.join(fixes)})"
        )
    sample_tokens = None if args.sample_tokens is None else (args.sample_tokens, "stated: --sample-tokens")
    if args.no_data:
        print(f"data: not checked (--no-data): {len(recipe.data.sources)} sources' rows, layouts and logins")
    else:
        if args.tokenizer is not None:
            tokenizer_dir = args.tokenizer
        elif args.model_config is not None:
            tokenizer_dir = args.model_config if args.model_config.is_dir() else args.model_config.parent
        else:
            tokenizer_dir = source.path
        data_lines, measured = data_report(recipe, tokenizer_dir, args.limit)
        print("\n".join(data_lines))
        if sample_tokens is None:
            sample_tokens = (measured, f"mean of the first {args.limit} rows per source")
    print(
        "\n".join(
            format_budget(recipe, par, p, train_samples(recipe, args.samples), sample_tokens, args.tflops)
        )
    )


def main(argv: list[str] | None = None) -> int:
    return run(check, build_parser(), argv)
