"""Model cards and licence files of every checkpoint the toolkit writes, so an output folder can be published.

A converted or distilled folder gets a ``README.md`` written with ``huggingface_hub.ModelCard``: metadata
(``base_model``, the licence fields carried from the source's own card, ``library_name``, tags) and a body
with the SwiftKV layout, how the folder was made (the converter's options or the distillation recipe), the
quality measured on it when something measured it, and how to load and serve it.  The source's licence files
(``LICENSE*``, ``LICENCE*``, ``USE_POLICY*``, ``NOTICE*``) are copied beside it: Llama's licence, for one,
requires passing them on with derivatives.  The source's own README is not copied: it describes another
model.

``base_model`` is the Hub id of the source when known (fetched from the Hub, a folder in the Hub cache, or
recorded in the source's ``provenance.json``); a local folder with no known id leaves it out rather than
naming a path the Hub cannot resolve (and never copies the source card's own ``base_model``, which names
the source's base, not the source).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml

from toolkit.artifacts import read_provenance
from toolkit.checkpoint import hub_origin

CARD_FILE = "README.md"
LICENCE_PATTERNS = ("LICENSE*", "LICENCE*", "USE_POLICY*", "NOTICE*")
LICENCE_FIELDS = ("license", "license_name", "license_link")
QUALITY_HEADING = "## Measured quality"


def licence_files(src: Path) -> list[Path]:
    """The licence files at the top of a checkpoint folder, sorted by name."""
    return sorted({p for pattern in LICENCE_PATTERNS for p in src.glob(pattern) if p.is_file()})


def copy_licence_files(src: Path, dst: Path) -> list[str]:
    """Copy ``src``'s licence files into ``dst``; return their names."""
    names = []
    for path in licence_files(src):
        shutil.copyfile(path, dst / path.name)
        names.append(path.name)
    return names


def card_metadata(folder: Path) -> dict:
    """The metadata block of a folder's README.md (empty when it has none or it does not parse)."""
    from huggingface_hub import ModelCard

    path = folder / CARD_FILE
    if not path.is_file():
        return {}
    try:
        return ModelCard.load(path, ignore_metadata_errors=True).data.to_dict()
    except (ValueError, yaml.YAMLError, UnicodeDecodeError):
        return {}


def source_identity(src: Path) -> tuple[str | None, str | None]:
    """(Hub id, revision) of a checkpoint folder: its place in the Hub cache, else what its
    ``provenance.json`` records (a folder made here from a Hub model), else (None, None)."""
    repo_id, revision = hub_origin(src)
    if repo_id:
        return repo_id, revision
    recorded = read_provenance(src)
    return recorded.get("source_id"), recorded.get("source_revision")


def model_name(folder: Path) -> str:
    """What the model in a folder is called: its Hub id (``source_identity``), else, for a folder made here
    from another (``provenance.json`` records that folder's absolute path), the name of the model it was made
    from, followed back to the original; else the folder's own name."""
    seen = {folder}
    while True:
        repo_id, _ = source_identity(folder)
        made_from = Path(str(read_provenance(folder).get("source", "")))
        if repo_id or not made_from.is_absolute() or made_from in seen:
            return repo_id or folder.name
        seen.add(made_from)
        folder = made_from


def _title(src: Path, config: dict) -> str:
    """The card's title: the source model's name and the SwiftKV variant (not the output folder's name,
    which is often just ``model`` or ``converted``)."""
    from .flops import Shape

    shape = Shape.from_config(config)
    title = f"{model_name(src)}, SwiftKV {(shape.layers - shape.num_key_value_layers) / shape.layers:.0%}"
    title += f", AcrossKV group size {shape.group_size}" if shape.group_size > 1 else ""
    return title + (f", exact K/V W = {shape.exact_kv_window}" if shape.exact_kv_window else "")


def _layout_table(config: dict) -> list[str]:
    from .flops import Shape, kv_bytes_per_token

    shape = Shape.from_config(config)
    L, l = shape.layers, shape.num_key_value_layers
    return [
        "| layers | num_key_value_layers (l) | SwiftKV layers | key_value_group_size | exact_kv_window "
        "| KV bytes/token (16-bit) |",
        "|---|---|---|---|---|---|",
        f"| {L} | {l} | {l}..{L - 1} ({L - l}, {(L - l) / L:.0%}) | {shape.group_size} "
        f"| {shape.exact_kv_window or 'off'} "
        f"| {kv_bytes_per_token(shape)} (original {kv_bytes_per_token(shape, swiftkv=False)}) |",
        *(
            [
                "",
                f"Exact K/V (W = {shape.exact_kv_window}): the tokens that run layers {l}..{L - 1} anyway (every "
                f"generated and speculative token, and the last {shape.exact_kv_window} prompt tokens of each "
                "prefill) store the original layer's own keys and values there; the other prompt tokens keep "
                "SwiftKV's.",
            ]
            if shape.exact_kv_window
            else []
        ),
    ]


def _numbers(metrics: dict, prefix: str = "") -> list[tuple[str, float]]:
    """The numeric leaves of nested metrics, named by their path (``served first16 kl``)."""
    out = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            out += _numbers(value, f"{prefix}{key} ")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append((f"{prefix}{key}", value))
    return out


def quality_section(metrics: dict, caption: str) -> list[str]:
    """A card section with the numeric metrics of one measurement (nested ones by their path) and what they
    were measured on."""
    rows = [f"| {k} | {v:.4g} |" for k, v in _numbers(metrics)]
    return [QUALITY_HEADING, "", caption, "", "| metric | value |", "|---|---|", *rows, ""]


def write_card(
    dst: Path,
    src: Path,
    config: dict,
    made_by: list[str],
    *,
    name: str,
    quality: list[str] = (),
) -> Path:
    """Write ``dst/README.md`` for the SwiftKV checkpoint in ``dst`` made from ``src``; return its path.

    ``made_by``: Markdown lines saying how (the command or recipe); ``name``: the folder's final name, for
    the loading example (``dst`` may be the temp folder it is written in); ``quality``: a ``quality_section``.
    """
    from huggingface_hub import ModelCard, ModelCardData

    from toolkit import __version__

    base, revision = source_identity(src)
    inherited = card_metadata(src)
    data = ModelCardData(
        base_model=base,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["swiftkv", "swiftkv-toolkit"],
        **{k: inherited[k] for k in LICENCE_FIELDS if inherited.get(k)},
    )
    licences = [p.name for p in licence_files(dst)]
    origin = f"`{base}`" if base else f"the local checkpoint `{src.name}`"
    if base and revision:
        origin += f" (revision `{revision}`)"
    body = [
        f"# {_title(src, config)}",
        "",
        f"A SwiftKV version of {origin}, made with swiftkv-toolkit {__version__}. Prompt tokens skip the "
        "later layers: their keys and values come from one earlier layer's output, so prefill costs less; "
        'generated tokens run every layer. The original weights are all kept: `set_mode("teacher")` runs '
        "the exact original model.",
        "",
        "## Layout",
        "",
        *_layout_table(config),
        "",
        "## How it was made",
        "",
        *made_by,
        "",
        *quality,
        "## Use",
        "",
        "```python",
        "import swiftkv, transformers  # swiftkv registers the model classes; without it: trust_remote_code=True",
        "",
        f'model = transformers.AutoModelForCausalLM.from_pretrained("{name}")',
        "```",
        "",
        "Serve it with vLLM from an environment where swiftkv-toolkit is installed next to vLLM (its plugin "
        f"registers the SwiftKV model classes): `python -m vllm.entrypoints.openai.api_server --model {name}`.",
        "",
        "## Licence",
        "",
        (
            f"The licence of the base model applies ({data.license or data.license_name or 'see its card'})"
            + (
                f"; its terms travel with this folder: {', '.join(f'`{n}`' for n in licences)}."
                if licences
                else "."
            )
        ),
        "",
    ]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))
    path = dst / CARD_FILE
    card.save(path)
    return path


def set_quality(model_dir: Path, quality: list[str]) -> None:
    """Replace (or add) the measured-quality section of the card in ``model_dir``, atomically (a folder
    written before cards existed has none, and is left as it is)."""
    path = Path(model_dir) / CARD_FILE
    if not path.is_file():
        return
    lines = path.read_text().split("\n")
    if QUALITY_HEADING in lines:
        start = lines.index(QUALITY_HEADING)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    else:
        start = end = next((i for i, line in enumerate(lines) if line == "## Use"), len(lines))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("\n".join([*lines[:start], *quality, *lines[end:]]))
    os.replace(tmp, path)
