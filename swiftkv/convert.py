"""Rewrite a Hugging Face decoder checkpoint into SwiftKV form, one safetensors shard at a time.

The converter never instantiates the model.  The new weights (ARCHITECTURE.md) are ``norm_swiftkv`` = a copy
of layer l's input_layernorm, ``q_proj_swiftkv`` = a copy of q_proj, group leaders' ``k/v_proj_swiftkv`` =
the mean of the group's k/v_proj.  Output shard i is source shard i (cast to ``dtype``) plus every new tensor
whose inputs have all been read by then, so at any moment the converter holds exactly:

* the shard being rewritten (its tensors, read one by one and cast) and the new tensors written with it;
* the inputs of new tensors still waiting for a later shard: the k/v_proj of an AcrossKV group whose layers
  span shards (at most g - 1 layers' k and v) or layer l's input norm.  Nothing else of an earlier shard.

So peak memory is the largest shard plus its new tensors (``scripts/bench_convert.py`` measures it), and a 70B
checkpoint converts on a machine that could not load it.

The output is a normal HF folder: every original weight (the teacher) and the new ones in standard shards
(``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``), config.json
with the SwiftKV fields and ``auto_map``, the remote-code files (so stock transformers opens it with
``trust_remote_code=True``), the tokenizer and generation files, and provenance.json.  Written to a temp
folder and renamed.  Refused before anything is written: quantized sources (their scales would not follow the
averaged and copied weights), sliding-window attention (SwiftKV layers attend over the whole prompt), missing
or corrupt weights; any refusal leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from toolkit.artifacts import (
    atomic_output_dir,
    check_destination,
    write_json_atomic,
    write_provenance,
)
from toolkit.checkpoint import FAMILIES, read_config, weight_files

from .card import CARD_FILE, copy_licence_files, source_identity, write_card

logger = logging.getLogger(__name__)
# provenance.json's "stage" of a conversion: a checkpoint never trained (distill applies its K/V init to it)
CONVERT_STAGE = "swiftkv convert"

# families whose attention normalizes each query/key head (their SwiftKV layers get q/k_norm_swiftkv)
HEAD_NORM_FAMILIES = ("qwen3_swiftkv",)
REMOTE_CODE_FILES = ("configuration_swiftkv.py", "modeling_swiftkv.py")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# files of the source that are rewritten rather than copied
_REWRITTEN = ("config.json", "model.safetensors.index.json", "provenance.json", CARD_FILE)
# tensor names that only quantized checkpoints carry (FP8, GPTQ/AWQ, compressed-tensors)
QUANTIZED_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "qweight", "qzeros", "scales")
_QUANTIZED_FIX = (
    "to resolve, dequantize first, or convert the unquantized checkpoint and serve it with vLLM's "
    "online FP8 (--quantization fp8)"
)


class ConversionError(ValueError):
    """A refused conversion; the message is one line naming the input and the fix."""


def resolve_num_key_value_layers(
    num_layers: int, num_key_value_layers: int | None, swiftkv_fraction: float | None, group_size: int
) -> int:
    """Pick l from an explicit value or from the fraction of layers that become SwiftKV layers.

    A fraction is rounded so that the SwiftKV layer count is a multiple of the group size; an explicit l
    is checked, never adjusted.
    """
    if (num_key_value_layers is None) == (swiftkv_fraction is None):
        raise ConversionError("pass exactly one of --num-key-value-layers and --swiftkv-fraction")
    if group_size < 1:
        raise ConversionError(f"--group-size must be >= 1, got {group_size}")
    if swiftkv_fraction is not None:
        if not 0.0 <= swiftkv_fraction < 1.0:
            raise ConversionError(f"--swiftkv-fraction must be in [0, 1), got {swiftkv_fraction}")
        num_key_value_layers = num_layers - group_size * round(swiftkv_fraction * num_layers / group_size)
    l = num_key_value_layers
    if not 1 <= l <= num_layers:
        raise ConversionError(
            f"num_key_value_layers={l} is outside [1, {num_layers}] for this {num_layers}-layer model"
        )
    if (num_layers - l) % group_size:
        raise ConversionError(
            f"group size {group_size} does not divide the {num_layers - l} SwiftKV layers "
            f"({num_layers} layers - num_key_value_layers {l}); choose another --group-size or l"
        )
    return l


def swiftkv_config(base: dict, num_key_value_layers: int, group_size: int) -> dict:
    """The SwiftKV config.json for a base config.json (refuses unsupported or already-SwiftKV sources)."""
    model_type = base.get("model_type")
    if str(model_type).endswith("_swiftkv") or "num_key_value_layers" in base:
        raise ConversionError(
            f"source is already a SwiftKV checkpoint (model_type {model_type!r}); convert the original"
        )
    if model_type not in FAMILIES:
        raise ConversionError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    quantization = base.get("quantization_config")
    if quantization:
        method = (
            quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
        )
        raise ConversionError(f"source is quantized ({method}); {_QUANTIZED_FIX}")
    sliding = sliding_window_layers(base)
    if sliding:
        raise ConversionError(
            f"source uses sliding-window attention ({sliding}), which SwiftKV does not support; to resolve, "
            "convert a full-attention checkpoint (sliding_window null or >= max_position_embeddings)"
        )
    swift_type, arch, _ = FAMILIES[model_type]
    # Mistral maps onto Llama, which has no sliding window: drop the (null or unlimited) field
    config = {k: v for k, v in base.items() if k != "sliding_window" or model_type != "mistral"}
    config.update(
        model_type=swift_type,
        architectures=[arch],
        num_key_value_layers=num_key_value_layers,
        key_value_group_size=group_size,
        swiftkv=True,
        auto_map=auto_map(swift_type),
    )
    return config


def sliding_window_layers(base: dict) -> str | None:
    """Which layers of a base config.json attend through a sliding window (a short description), or None.

    ``layer_types`` (transformers 5) names each layer's attention.  Qwen2-style configs (with
    ``use_sliding_window``) slide only where it is true: the ``sliding_attention`` entries of ``layer_types``,
    or, in older configs without it, layers >= ``max_window_layers``.  Mistral-style configs slide on every
    layer whenever ``sliding_window`` is below ``max_position_embeddings``.
    """
    types = base.get("layer_types") or []
    sliding = [i for i, t in enumerate(types) if t != "full_attention"]
    if sliding:
        return f"layer_types marks {len(sliding)} layer(s) {types[sliding[0]]!r}"
    window, max_positions = base.get("sliding_window"), base.get("max_position_embeddings")
    if window is None or (max_positions is not None and window >= max_positions):
        return None
    if "use_sliding_window" not in base:
        return f"sliding_window={window} < max_position_embeddings={max_positions}"
    first = base.get("max_window_layers") or 0
    if not base["use_sliding_window"] or types or first >= base.get("num_hidden_layers", 0):
        return None
    return f"use_sliding_window with sliding_window={window} on layers >= {first}"


def auto_map(swiftkv_model_type: str) -> dict[str, str]:
    """The config.json ``auto_map`` that lets stock transformers load the remote-code classes."""
    arch, config_cls = next((a, c) for t, a, c in FAMILIES.values() if t == swiftkv_model_type)
    return {
        "AutoConfig": f"configuration_swiftkv.{config_cls}",
        "AutoModelForCausalLM": f"modeling_swiftkv.{arch}",
    }


def _source_shards(src: Path) -> list[tuple[Path, list[str]]]:
    """The source's weight files with their tensor names, read from the safetensors headers only.

    Refuses quantized weights here, before any work: names that only quantized checkpoints carry, or
    float8 tensors.
    """
    shards = []
    for path in weight_files(src):
        try:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
                float8 = [k for k in names if f.get_slice(k).get_dtype().startswith("F8")]
        except Exception as e:  # safetensors raises its own error types for truncated or garbled files
            raise ConversionError(
                f"weights file {path} is corrupt or truncated ({type(e).__name__}: {e})"
            ) from None
        quantized = [k for k in names if k.endswith(QUANTIZED_SUFFIXES)] + float8
        if quantized:
            raise ConversionError(
                f"source weights are quantized ({quantized[0]} in {path.name}); {_QUANTIZED_FIX}"
            )
        shards.append((path, names))
    return shards


def _load_shard(path: Path, dtype: torch.dtype | None, bar: tqdm) -> dict[str, torch.Tensor]:
    """Every tensor of one shard, each cast as it is read (one uncast tensor at a time)."""
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {}
            for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_tensor(k)
                tensors[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
                bar.update(1)
            return tensors
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        raise ConversionError(
            f"weights file {path} is corrupt or truncated ({type(e).__name__}: {e})"
        ) from None


def swiftkv_sources(
    num_layers: int, num_key_value_layers: int, group_size: int, has_bias: bool, head_norms: bool = False
) -> dict[str, tuple[str, ...]]:
    """Each new SwiftKV tensor and the base tensors it starts from (one: a copy; several: their mean)."""
    l, out = num_key_value_layers, {}
    # with l = L there is no layer l: the (unused) norm then starts as the final norm, which x_L feeds
    norm = f"model.layers.{l}.input_layernorm.weight" if l < num_layers else "model.norm.weight"
    out["model.norm_swiftkv.weight"] = (norm,)
    suffixes = ("weight", "bias") if has_bias else ("weight",)
    for j in range(l, num_layers):
        for s in suffixes:
            out[f"model.layers.{j}.self_attn.q_proj_swiftkv.{s}"] = (
                f"model.layers.{j}.self_attn.q_proj.{s}",
            )
    for leader in range(l, num_layers, group_size):
        for proj in ("k_proj", "v_proj"):
            for s in suffixes:
                out[f"model.layers.{leader}.self_attn.{proj}_swiftkv.{s}"] = tuple(
                    f"model.layers.{j}.self_attn.{proj}.{s}" for j in range(leader, leader + group_size)
                )
    if head_norms:  # q_norm_swiftkv = a copy of q_norm, a leader's k_norm_swiftkv = the group's mean k_norm
        for j in range(l, num_layers):
            out[f"model.layers.{j}.self_attn.q_norm_swiftkv.weight"] = (
                f"model.layers.{j}.self_attn.q_norm.weight",
            )
        for leader in range(l, num_layers, group_size):
            out[f"model.layers.{leader}.self_attn.k_norm_swiftkv.weight"] = tuple(
                f"model.layers.{j}.self_attn.k_norm.weight" for j in range(leader, leader + group_size)
            )
    return out


def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A copy of one tensor, or the mean of several (accumulated in float32, cast back)."""
    if len(tensors) == 1:
        return tensors[0].clone()
    return torch.stack([t.float() for t in tensors]).mean(0).to(tensors[0].dtype)


def swiftkv_weights(
    get, num_layers: int, num_key_value_layers: int, group_size: int, has_bias: bool, head_norms: bool = False
):
    """The new SwiftKV tensors, initialized as the design says, from a name -> tensor getter."""
    recipe = swiftkv_sources(num_layers, num_key_value_layers, group_size, has_bias, head_norms)
    return {name: combine([get(k) for k in sources]) for name, sources in recipe.items()}


def _write_shards(
    tmp: Path, shards: list[tuple[Path, list[str]]], recipe: dict[str, tuple[str, ...]], dtype
) -> tuple[dict[str, str], int]:
    """Write output shard i = source shard i + the new tensors its reading completes.

    Returns the weight map (tensor -> file) and the total bytes written, for the index.

    ``held`` keeps, across shards, only the inputs of new tensors that still wait for a later shard.
    """
    users: dict[str, set[str]] = {}
    for name, sources in recipe.items():
        for k in sources:
            users.setdefault(k, set()).add(name)
    todo, held, weight_map, total_size = dict(recipe), {}, {}, 0
    bar = tqdm(total=sum(len(names) for _, names in shards), desc="convert", unit="tensor")
    for i, (path, _) in enumerate(shards, 1):
        bar.set_postfix_str(f"shard {i}/{len(shards)}")
        tensors = _load_shard(path, dtype, bar)
        held.update((k, v) for k, v in tensors.items() if k in users)
        for name in [n for n, sources in todo.items() if all(k in held for k in sources)]:
            tensors[name] = combine([held[k] for k in todo.pop(name)])
        held = {k: v for k, v in held.items() if users[k] & todo.keys()}
        out = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, tmp / out, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, out))
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors  # before the next shard is read
    bar.close()
    return weight_map, total_size


def to_swiftkv(base, num_key_value_layers: int, group_size: int = 1):
    """In-memory conversion of a loaded base causal LM (for benchmarks, tests and on-the-fly recipes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base_config = base.config.to_dict()
    config = AutoConfig.for_model(**swiftkv_config(base_config, num_key_value_layers, group_size))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=base.dtype)
    state = base.state_dict()
    new = swiftkv_weights(
        state.__getitem__,
        config.num_hidden_layers,
        num_key_value_layers,
        group_size,
        has_bias=base.model.layers[0].self_attn.q_proj.bias is not None,
        head_norms=config.model_type in HEAD_NORM_FAMILIES,
    )
    model.load_state_dict({**state, **new}, strict=True, assign=True)
    model.model.rotary_emb = base.model.rotary_emb  # non-persistent buffers are not in the state dict
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval() if not base.training else model


def save_pretrained_swiftkv(
    model,
    dst: str | Path,
    *,
    tokenizer=None,
    state_dict=None,
    force: bool = False,
    provenance: dict | None = None,
    source: Path | None = None,
    made_by: list[str] = (),
    quality: list[str] = (),
) -> Path:
    """Save a SwiftKV model as a complete checkpoint folder (weights, config with ``auto_map``, remote code,
    tokenizer, provenance), atomically.  With ``source`` (the folder the model was loaded from) it also
    carries the source's licence files and writes a model card (``swiftkv.card``) with ``made_by`` and
    ``quality``, and the provenance records the source's Hub id and revision when known."""
    model.config.auto_map = auto_map(model.config.model_type)
    provenance = dict(provenance or {"stage": "save"})
    if source is not None:
        source_id, revision = source_identity(source)
        provenance.update(source=str(Path(source).resolve()), source_id=source_id, source_revision=revision)
    with atomic_output_dir(dst, force=force) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_remote_code(tmp)
        if source is not None:
            copy_licence_files(source, tmp)
            write_card(
                tmp,
                source,
                model.config.to_dict(),
                list(made_by),
                name=Path(dst).name,
                quality=list(quality),
            )
        write_provenance(tmp, **provenance)
    return Path(dst)


def write_remote_code(dst: Path) -> None:
    """Copy the self-contained configuration/modeling files next to the weights (for trust_remote_code)."""
    here = Path(__file__).parent
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(here / name, dst / name)


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    num_key_value_layers: int | None = None,
    swiftkv_fraction: float | None = None,
    group_size: int = 1,
    exact_kv_window: int = 0,
    dtype: str = "auto",
    force: bool = False,
) -> Path:
    """Convert the HF checkpoint ``src`` into a SwiftKV checkpoint at ``dst`` and return ``dst``.
    ``exact_kv_window`` W >= 1 turns on exact K/V (``configuration_swiftkv``); 0 keeps the published semantics."""
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if exact_kv_window < 0 or (exact_kv_window and group_size > 1):
        raise ConversionError(
            f"--exact-kv-window {exact_kv_window} needs to be >= 0 and --group-size 1 (an AcrossKV group shares "
            "one K/V; exact K/V are per layer)"
        )
    base = read_config(src)
    num_layers = base.get("num_hidden_layers")
    if not isinstance(num_layers, int):
        raise ConversionError(f"source config {src / 'config.json'} has no integer num_hidden_layers")
    l = resolve_num_key_value_layers(num_layers, num_key_value_layers, swiftkv_fraction, group_size)
    config = swiftkv_config(base, l, group_size)
    if exact_kv_window:
        config["exact_kv_window"] = exact_kv_window
    shards = _source_shards(src)
    torch_dtype = DTYPES[dtype]
    if torch_dtype is not None:
        config["dtype"] = dtype
    has_bias = config["model_type"] == "qwen2_swiftkv" or bool(base.get("attention_bias"))
    recipe = swiftkv_sources(num_layers, l, group_size, has_bias, config["model_type"] in HEAD_NORM_FAMILIES)
    present = {k for _, names in shards for k in names}
    missing = sorted({k for sources in recipe.values() for k in sources} - present)
    if missing:
        raise ConversionError(
            f"source weights lack {missing[0]}; the checkpoint does not match its config.json"
        )
    check_destination(dst, force)

    with atomic_output_dir(dst, force=force) as tmp:
        weight_map, total_size = _write_shards(tmp, shards, recipe, torch_dtype)
        if len(shards) > 1:
            write_json_atomic(
                tmp / "model.safetensors.index.json",
                {"metadata": {"total_size": total_size}, "weight_map": weight_map},
            )

        for extra in src.iterdir():  # tokenizer, chat template, generation config, ...
            if (
                extra.is_file()
                and extra.name not in _REWRITTEN
                and not extra.name.endswith((".safetensors", ".bin"))
            ):
                shutil.copyfile(extra, tmp / extra.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_remote_code(tmp)
        source_id, revision = source_identity(src)
        made_by = [
            f"`swiftkv convert` with num_key_value_layers {l} of {num_layers}, key_value_group_size "
            f"{group_size}, exact_kv_window {exact_kv_window}, dtype {dtype}. The SwiftKV projections start as copies of the original's "
            "(queries, the norm) and group means (keys, values): not distilled yet; distill it "
            "(`python -m distill`) before serving it.",
        ]
        write_card(tmp, src, config, made_by, name=dst.name)
        write_provenance(
            tmp,
            CONVERT_STAGE,
            source=str(src.resolve()),
            source_id=source_id,
            source_revision=revision,
            source_model_type=base["model_type"],
            num_key_value_layers=l,
            key_value_group_size=group_size,
            exact_kv_window=exact_kv_window,
            swiftkv_fraction=swiftkv_fraction,
            dtype=dtype,
        )
    logger.info("wrote %s (l=%d of %d layers, group size %d)", dst, l, num_layers, group_size)
    return dst
