"""``python -m distill check RECIPE [key=value ...]``: will this run work, and does it fit, before launch?

Reads only small files, so a 70B check runs on a laptop: the recipe (validated), the model's ``config.json``
(``--model-config`` when the model folder is not on this machine), the tokenizer files, the accelerate config
(``--config``: process count, DeepSpeed stage, offload, buckets) and the first ``--limit`` rows of every data
source.  Prints per-source sample and assistant-token counts and the per-GPU memory plan of ``distill.memory``;
exits 2 with one line when the recipe is invalid, a source yields no trainable row or cannot be read (hub
sources need network, gated ones a login; ``--no-data`` skips the row check and says so), or the plan does not
fit ``--gpu-memory`` GB per GPU (after a reserve for the CUDA context, NCCL and fragmentation).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from swiftkv.cliargs import ArgumentParser, UsageError, add_limit, existing_path, run
from swiftkv.convert import read_config, resolve_num_key_value_layers
from swiftkv.flops import Shape

from .memory import GB, Batch, Parallel, Params, activations, comm_buffers, lstsq_init, model_states
from .recipe import Recipe, RecipeError, load_recipe

RESERVE = 0.10  # share of each GPU kept for the CUDA context, NCCL buffers and allocator fragmentation
EPILOG = """examples:
  python -m distill check recipes/swiftkv_llama3.1_8b.yaml --config recipes/accelerate/8gpu_zero2.yaml
  python -m distill check recipes/swiftkv_llama3.3_70b.yaml --config recipes/accelerate/8gpu_zero3.yaml \\
      --model-config /path/to/Llama-3.3-70B-Instruct/config.json --no-data
  python -m distill check recipes/swiftkv_smollm2_cpu.yaml data.seq_len=1024 --gpu-memory 24
"""


class IntermixedParser(ArgumentParser):
    """Overrides may come before or after the options (``RECIPE --config X key=value``)."""

    def parse_args(self, args=None, namespace=None):
        return self.parse_intermixed_args(args, namespace)


def build_parser() -> ArgumentParser:
    parser = IntermixedParser(
        prog="python -m distill check",
        description="Validate a distillation recipe, its data and its per-GPU memory plan (no weights loaded).",
        epilog=EPILOG,
    )
    parser.add_argument("recipe", type=existing_path, help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.seq_len=4096")
    parser.add_argument("--config", type=existing_path, help="accelerate config YAML (default: one process)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU (default: 80)")
    parser.add_argument(
        "--model-config",
        type=existing_path,
        help="config.json to use when model.source is not on this machine",
    )
    parser.add_argument("--tokenizer", type=existing_path, help="tokenizer folder (default: the model's)")
    parser.add_argument("--no-data", action="store_true", help="skip reading rows of the data sources")
    add_limit(parser, 8, "rows read per data source")
    return parser


def load_recipe_or_usage(path: Path, overrides: list[str]) -> Recipe:
    """``load_recipe`` with every problem on one line, as the CLIs report bad input."""
    try:
        return load_recipe(path, overrides)
    except RecipeError as e:
        problems = [line.removeprefix("recipe error: ") for line in str(e).splitlines()]
        raise UsageError(
            f"recipe {path}: {'; '.join(problems)} (to resolve, fix the recipe or the key=value overrides)"
        ) from None


def model_config_of(recipe: Recipe, path: Path | None) -> dict:
    """The model's config.json: ``path`` when given, else the one in ``model.source`` (never any weights)."""
    if path is None:
        source = Path(recipe.model.source)
        if not (source / "config.json").is_file():
            raise UsageError(
                f"model.source {source} has no config.json on this machine "
                "(to resolve, pass --model-config PATH/config.json of that model)"
            )
        return read_config(source)
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
    if cfg.get("distributed_type") != "DEEPSPEED":
        return Parallel(processes=processes)
    ds_cfg = cfg.get("deepspeed_config") or {}
    ds_file = ds_cfg.get("deepspeed_config_file")
    if ds_file:
        ds_path = Path(ds_file)
        if not ds_path.is_file():
            raise UsageError(
                f"{path}: deepspeed_config_file {ds_file} not found "
                "(to resolve, run from the folder it is relative to, or fix the path)"
            )
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
    return Parallel.from_deepspeed(processes, ds)


def _resolvable(message: str) -> str:
    return (
        message if "to resolve" in message else f"{message} (to resolve, check the source, or pass --no-data)"
    )


def data_report(recipe: Recipe, tokenizer_dir: Path, rows: int) -> list[str]:
    """Per-source counts over the first ``rows`` records; UsageError for a source that cannot be read or
    yields no trainable sample (named, with the columns it has)."""
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
    return lines


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


def check(args) -> None:
    recipe = load_recipe_or_usage(args.recipe, args.overrides)
    config = model_config_of(recipe, args.model_config)
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
        fixes.append("lower train.micro_batch_size, data.seq_len or loss.chunk_tokens")
        fixes.append("use ZeRO-3 (with optimizer offload) or more GPUs")
        raise UsageError(
            f"the run needs {peak:.1f} GB per GPU, more than {usable:.1f} GB usable of {args.gpu_memory:g} GB "
            f"(to resolve, {'; '.join(fixes)})"
        )
    if args.no_data:
        print(f"data: not checked (--no-data): {len(recipe.data.sources)} sources' rows, layouts and logins")
        return
    if args.tokenizer is not None:
        tokenizer_dir = args.tokenizer
    elif args.model_config is not None:
        tokenizer_dir = args.model_config if args.model_config.is_dir() else args.model_config.parent
    else:
        tokenizer_dir = Path(recipe.model.source)
    print("\n".join(data_report(recipe, tokenizer_dir, args.limit)))


def main(argv: list[str] | None = None) -> int:
    return run(check, build_parser(), argv)
