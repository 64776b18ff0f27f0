"""Rewrite a Hugging Face decoder checkpoint into SwiftKV form, tensor by tensor.

The converter never instantiates the model: it streams the source safetensors shard by shard, casts them,
and adds the new weights (ARCHITECTURE.md): ``norm_swiftkv`` = a copy of layer l's input_layernorm,
``q_proj_swiftkv`` = a copy of q_proj, group leaders' ``k/v_proj_swiftkv`` = the mean of the group's k/v_proj.
So memory stays at one shard, and a 70B checkpoint converts on a machine that could not load it.

The output is a normal HF folder: every original weight (the teacher), the new ones, config.json with the
SwiftKV fields and ``auto_map``, the remote-code files (so stock transformers opens it with
``trust_remote_code=True``), the tokenizer and generation files, and provenance.json.  Written to a temp
folder and renamed; any refusal leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .artifacts import atomic_output_dir, check_destination, write_json_atomic, write_provenance

logger = logging.getLogger(__name__)

# base model_type -> (SwiftKV model_type, architecture class, config class)
FAMILIES = {
    "llama": ("llama_swiftkv", "LlamaSwiftKVForCausalLM", "LlamaSwiftKVConfig"),
    "mistral": ("llama_swiftkv", "LlamaSwiftKVForCausalLM", "LlamaSwiftKVConfig"),  # same weights as Llama
    "qwen2": ("qwen2_swiftkv", "Qwen2SwiftKVForCausalLM", "Qwen2SwiftKVConfig"),
}
REMOTE_CODE_FILES = ("configuration_swiftkv.py", "modeling_swiftkv.py")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# files of the source that are rewritten rather than copied
_REWRITTEN = ("config.json", "model.safetensors.index.json", "provenance.json")


class ConversionError(ValueError):
    """A refused conversion; the message is one line naming the input and the fix."""


def read_config(src: Path) -> dict:
    """Load a checkpoint's config.json with one-line errors for a missing or unreadable file."""
    if not src.is_dir():
        raise ConversionError(f"source {src} is not a directory; pass a Hugging Face checkpoint folder")
    path = src / "config.json"
    if not path.is_file():
        raise ConversionError(f"source {src} has no config.json; pass a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"source {path} is corrupt ({e.msg} at line {e.lineno})") from None


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
    if model_type == "mistral" and base.get("sliding_window") is not None:
        raise ConversionError(
            "Mistral checkpoints with a sliding window are not supported (sliding_window must be null)"
        )
    if model_type == "qwen2" and base.get("use_sliding_window"):
        raise ConversionError("Qwen2 checkpoints with use_sliding_window=true are not supported")
    swift_type, arch, _ = FAMILIES[model_type]
    config = {k: v for k, v in base.items() if k not in ("sliding_window",) or model_type != "mistral"}
    config.update(
        model_type=swift_type,
        architectures=[arch],
        num_key_value_layers=num_key_value_layers,
        key_value_group_size=group_size,
        swiftkv=True,
        auto_map=auto_map(swift_type),
    )
    return config


def auto_map(swiftkv_model_type: str) -> dict[str, str]:
    """The config.json ``auto_map`` that lets stock transformers load the remote-code classes."""
    arch, config_cls = next((a, c) for t, a, c in FAMILIES.values() if t == swiftkv_model_type)
    return {
        "AutoConfig": f"configuration_swiftkv.{config_cls}",
        "AutoModelForCausalLM": f"modeling_swiftkv.{arch}",
    }


def _weight_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError):
            raise ConversionError(f"{index} is corrupt; re-save the source with save_pretrained") from None
        files = [src / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"source {src} lacks shard(s) listed in its index: {', '.join(missing)}")
        return files
    if (src / "model.safetensors").is_file():
        return [src / "model.safetensors"]
    raise ConversionError(
        f"source {src} has no safetensors weights; to resolve, re-save it with save_pretrained(safe_serialization=True)"
    )


def _load_shard(path: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        raise ConversionError(
            f"weights file {path} is corrupt or truncated ({type(e).__name__}: {e})"
        ) from None
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    return tensors


def swiftkv_weights(get, num_layers: int, num_key_value_layers: int, group_size: int, has_bias: bool):
    """The new SwiftKV tensors, initialized as the design says, from a name -> tensor getter."""
    l, out = num_key_value_layers, {}
    # with l = L there is no layer l: the (unused) norm then starts as the final norm, which x_L feeds
    norm = f"model.layers.{l}.input_layernorm.weight" if l < num_layers else "model.norm.weight"
    out["model.norm_swiftkv.weight"] = get(norm).clone()
    suffixes = ("weight", "bias") if has_bias else ("weight",)
    for j in range(l, num_layers):
        for s in suffixes:
            out[f"model.layers.{j}.self_attn.q_proj_swiftkv.{s}"] = get(
                f"model.layers.{j}.self_attn.q_proj.{s}"
            ).clone()
    for leader in range(l, num_layers, group_size):
        for proj in ("k_proj", "v_proj"):
            for s in suffixes:
                group = [
                    get(f"model.layers.{j}.self_attn.{proj}.{s}") for j in range(leader, leader + group_size)
                ]
                mean = torch.stack([t.float() for t in group]).mean(0).to(group[0].dtype)
                out[f"model.layers.{leader}.self_attn.{proj}_swiftkv.{s}"] = mean
    return out


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
) -> Path:
    """Save a SwiftKV model as a complete checkpoint folder (weights, config with ``auto_map``, remote code,
    tokenizer, provenance), atomically."""
    model.config.auto_map = auto_map(model.config.model_type)
    with atomic_output_dir(dst, force=force) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_remote_code(tmp)
        write_provenance(tmp, **(provenance or {"stage": "save"}))
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
    dtype: str = "auto",
    force: bool = False,
) -> Path:
    """Convert the HF checkpoint ``src`` into a SwiftKV checkpoint at ``dst`` and return ``dst``."""
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    base = read_config(src)
    num_layers = base.get("num_hidden_layers")
    if not isinstance(num_layers, int):
        raise ConversionError(f"source config {src / 'config.json'} has no integer num_hidden_layers")
    l = resolve_num_key_value_layers(num_layers, num_key_value_layers, swiftkv_fraction, group_size)
    config = swiftkv_config(base, l, group_size)
    files = _weight_files(src)
    check_destination(dst, force)
    torch_dtype = DTYPES[dtype]
    if torch_dtype is not None:
        config["dtype"] = dtype
    has_bias = config["model_type"] == "qwen2_swiftkv" or bool(base.get("attention_bias"))

    with atomic_output_dir(dst, force=force) as tmp:
        weight_map: dict[str, str] = {}
        needed: dict[str, torch.Tensor] = {}
        total = len(files) + (len(files) > 1)
        for i, path in enumerate(files, 1):
            tensors = _load_shard(path, torch_dtype)
            name = "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
            needed.update({k: v for k, v in tensors.items() if ".self_attn." in k or "norm" in k})
            if total > 1:
                save_file(tensors, tmp / name, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, name))
                del tensors

        def get(key: str) -> torch.Tensor:
            if key not in needed:
                raise ConversionError(
                    f"source weights lack {key}; the checkpoint does not match its config.json"
                )
            return needed[key]

        new = swiftkv_weights(get, num_layers, l, group_size, has_bias)
        if total == 1:
            save_file({**tensors, **new}, tmp / "model.safetensors", metadata={"format": "pt"})
        else:
            name = f"model-{total:05d}-of-{total:05d}.safetensors"
            save_file(new, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(new, name))
            write_json_atomic(
                tmp / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map}
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
        write_provenance(
            tmp,
            "swiftkv convert",
            source=str(src.resolve()),
            source_model_type=base["model_type"],
            num_key_value_layers=l,
            key_value_group_size=group_size,
            swiftkv_fraction=swiftkv_fraction,
            dtype=dtype,
        )
    logger.info("wrote %s (l=%d of %d layers, group size %d)", dst, l, num_layers, group_size)
    return dst
