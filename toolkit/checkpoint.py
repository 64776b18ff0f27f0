"""The model a user names: a local Hugging Face folder or a Hub model id, checked before any work.

Every entry point that reads a model goes through ``open_checkpoint()``, so a model is found and a bad one
refused the same way everywhere, in one line that names the problem and the fix, before anything is loaded
or written:

* a name that is not an existing path but has the shape of a Hub id (``org/name``, optionally
  ``org/name@revision``) is fetched with ``huggingface_hub.snapshot_download``, which honours
  ``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and the stored login or ``HF_TOKEN``; only the files a
  checkpoint needs are fetched (weights, configs, tokenizer, card, licence files; never ``original/``);
  a gated, missing or not-yet-cached id gets its own message;
* the folder must hold a readable ``config.json`` of a family the toolkit supports (``FAMILIES``: Llama,
  Mistral, Qwen2, Qwen3, and their SwiftKV forms), safetensors weights whose every file is complete
  (``safe_open`` checks the header against the file size: a truncated download is caught without reading
  the tensors), and a tokenizer; a quantized checkpoint (FP8, GPTQ, ...) is refused by name where the
  caller cannot load it.

``Checkpoint.provenance()`` is what the outputs record about their source: the folder, and for a Hub model
(fetched, or a folder inside the Hub cache) its id and the commit it resolved to.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .cliargs import UsageError, looks_like_hub_id

# base model_type -> (SwiftKV model_type, architecture class, config class)
FAMILIES = {
    "llama": ("llama_swiftkv", "LlamaSwiftKVForCausalLM", "LlamaSwiftKVConfig"),
    "mistral": ("llama_swiftkv", "LlamaSwiftKVForCausalLM", "LlamaSwiftKVConfig"),  # same weights as Llama
    "qwen2": ("qwen2_swiftkv", "Qwen2SwiftKVForCausalLM", "Qwen2SwiftKVConfig"),
    "qwen3": ("qwen3_swiftkv", "Qwen3SwiftKVForCausalLM", "Qwen3SwiftKVConfig"),
}
MODEL_TYPES = (*FAMILIES, *sorted({swift for swift, _, _ in FAMILIES.values()}))
# the files a checkpoint is made of; a Hub repo's other files (e.g. Llama's original/ consolidated weights)
# are never fetched
HUB_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.txt",
    "*.jinja",
    "*.md",
    "LICENSE*",
    "USE_POLICY*",
    "NOTICE*",
)
HUB_IGNORE = ("original/*",)
# any one of these makes a tokenizer transformers can load
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_HUB_CACHE_PATH = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]{40})$")
_HUB_FIX = "log in with `hf auth login` or set HF_TOKEN"


class CheckpointError(UsageError):
    """A model that cannot be used; the message is one line naming the problem and, after 'to resolve', the fix."""


@dataclass(frozen=True)
class Checkpoint:
    """A checked model folder and where it came from."""

    path: Path
    config: dict
    repo_id: str | None = None
    revision: str | None = None

    @property
    def name(self) -> str:
        """What to call the model in reports and cards: its Hub id, or its folder."""
        return self.repo_id or str(self.path)

    def provenance(self) -> dict:
        return {"source": str(self.path), "source_id": self.repo_id, "source_revision": self.revision}


def hub_origin(path: Path) -> tuple[str | None, str | None]:
    """(repo id, commit) of a folder inside the Hugging Face cache (``models--org--name/snapshots/COMMIT``)."""
    match = _HUB_CACHE_PATH.search(path.resolve().as_posix())
    return (f"{match['org']}/{match['name']}", match["rev"]) if match else (None, None)


def download(name: str, weights: bool = True) -> Path:
    """The local snapshot of Hub model ``name`` (``org/model[@revision]``), fetched if it is not cached
    (without ``weights``: only its configs, tokenizer, card and licence files)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, _, revision = name.partition("@")
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision or None,
                allow_patterns=[p for p in HUB_PATTERNS if weights or p != "*.safetensors"],
                ignore_patterns=list(HUB_IGNORE),
            )
        )
    except GatedRepoError:
        raise CheckpointError(
            f"model {repo_id} is gated on the Hugging Face Hub (to resolve, accept its licence at "
            f"https://huggingface.co/{repo_id}, then {_HUB_FIX})"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo_id} is neither a local folder nor a model on the Hugging Face Hub (to resolve, check the "
            f"path or the model id; for a private model, {_HUB_FIX})"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(
            f"model {repo_id} has no revision {revision!r} (to resolve, pass a branch, tag or commit of it)"
        ) from None
    except IncompleteSnapshotError:
        raise CheckpointError(
            f"the cached copy of {repo_id} in {constants.HF_HUB_CACHE} is incomplete and the Hub cannot be "
            f"reached (to resolve, complete it with network access: `hf download {repo_id}`)"
        ) from None
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise CheckpointError(
            f"model {repo_id} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and the Hub cannot be "
            f"reached{offline} (to resolve, download it once with network access, `hf download {repo_id}`, "
            "with the same HF_HOME, or pass a local folder)"
        ) from None


def read_config(path: Path) -> dict:
    """A checkpoint folder's config.json as a dict, with one-line errors for a missing or unreadable file."""
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory (to resolve, pass a Hugging Face checkpoint folder or a model id)"
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{path} has no config.json (to resolve, pass a Hugging Face checkpoint folder, "
            "the one save_pretrained writes)"
        )
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"{e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
        raise CheckpointError(
            f"{config_path} is corrupt ({where}) (to resolve, restore it from the model's source, "
            "e.g. download the model again)"
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{config_path} is not a JSON object (to resolve, restore it from the model's source)"
        )
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (from its index when sharded)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{index} is corrupt (to resolve, download the model again or re-save it with save_pretrained)"
            ) from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{path} lacks weight file(s) listed in its index: {', '.join(missing[:3])} "
                "(to resolve, download the model again; an interrupted download leaves shards out)"
            )
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
    found = f" (it has {', '.join(sorted(other)[:2])}: pickled weights are never loaded)" if other else ""
    raise CheckpointError(
        f"{path} has no safetensors weights{found} (to resolve, re-save the model with "
        "save_pretrained(safe_serialization=True))"
    )


def check_weights(files: list[Path]) -> None:
    """Every weights file opens and is as long as its header says (headers only: no tensor is read)."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own error type for truncated or garbled files
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(
                f"weights file {file} is corrupt or truncated ({detail}) (to resolve, download the model "
                "again or re-save it with save_pretrained)"
            ) from None


def quantization(config: dict) -> str | None:
    """The quantization method of a config.json (``compressed-tensors``, ``fp8``, ``gptq``, ...), or None."""
    q = config.get("quantization_config")
    if not q:
        return None
    return str(q.get("quant_method", "unknown") if isinstance(q, dict) else q)


def check(
    path: Path,
    *,
    weights: bool = True,
    tokenizer: bool = True,
    quantized: bool = False,
    model_types: tuple[str, ...] | None = MODEL_TYPES,
) -> dict:
    """Check a checkpoint folder and return its config (see the module docstring for what is checked);
    ``model_types=None`` takes any family (a command that only generates with transformers or tokenizes)."""
    config = read_config(path)
    model_type = config.get("model_type")
    if model_types is not None and model_type not in model_types:
        names = ", ".join(t for t in model_types if not t.endswith("_swiftkv"))
        raise CheckpointError(
            f"{path} is a {model_type!r} checkpoint, a family this command does not support "
            f"(to resolve, pass a checkpoint of model_type {names}, or a SwiftKV conversion of one)"
        )
    method = quantization(config)
    if method and not quantized:
        raise CheckpointError(
            f"{path} is quantized ({method}), which the transformers path here does not load (to resolve, "
            "serve it with vLLM (`swiftkv vllm-args` prints the command), or use its unquantized "
            "checkpoint: for Snowflake's *-FP8 models, the same id without -FP8)"
        )
    if weights:
        check_weights(weight_files(path))
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}) (to resolve, copy the tokenizer "
            "files of the model it was made from into it, or save one with tokenizer.save_pretrained)"
        )
    return config


def open_checkpoint(name: str | Path, **checks) -> Checkpoint:
    """Find ``name`` (a folder or a Hub id), check it (``check``'s keyword arguments) and describe it."""
    text = str(name)
    if looks_like_hub_id(text):
        path = download(text, weights=checks.get("weights", True))
    else:
        path = Path(text).expanduser()
        if not path.exists():
            raise CheckpointError(f"{path} not found (to resolve, check the path, or pass a Hub model id)")
    config = check(path, **checks)
    repo_id, revision = hub_origin(path)
    return Checkpoint(path, config, repo_id, revision)
