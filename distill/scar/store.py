"""Durable, atomic storage of a rank's running checkpoint: one safetensors file per saved block version and
a JSON manifest written last.

A save writes new block files under fresh names (``<index>.s<step>.safetensors``: temp file, fsync, rename,
fsync of the folder), then replaces the manifest the same way, and only then deletes the files the old
manifest pointed to.  A writer killed at any point therefore leaves the previous manifest and every file it
names intact; files no manifest names are removed when the checkpoint is opened again.  The manifest holds
each file's SHA-256, checked whenever a block is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "scar-running-checkpoint/2"  # 2: byte budget credit
MANIFEST = "manifest.json"


class CorruptBlockError(RuntimeError):
    """A block file is missing, truncated or does not match its checksum."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either the old file or the complete new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_block(folder: Path, filename: str, payload: dict[str, torch.Tensor]) -> dict:
    """Serialize one block; return its manifest entry (file, sha256, bytes)."""
    data = st_save(payload)
    write_atomic(folder / filename, data)
    return {"file": filename, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def read_block(folder: Path, entry: dict) -> dict[str, torch.Tensor]:
    """Read and verify one block file against its manifest entry."""
    path = folder / entry["file"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorruptBlockError(f"{path} is missing") from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorruptBlockError(f"{path} does not match its checksum ({len(data)}/{entry['bytes']} bytes)")
    return st_load(data)


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a running checkpoint ({manifest.get('format')!r}); "
            "to resolve, point checkpoint.scar at an empty folder"
        )
    return manifest


def write_manifest(folder: Path, manifest: dict) -> None:
    write_atomic(folder / MANIFEST, json.dumps({"format": FORMAT, **manifest}, indent=1).encode())


def remove_unreferenced(folder: Path, manifest: dict | None) -> None:
    """Delete block files and temp files that the manifest does not name (left by superseded or killed saves)."""
    keep = {MANIFEST} | {e["file"] for e in (manifest or {}).get("blocks", {}).values()}
    for path in folder.iterdir():
        if path.is_file() and path.name not in keep:
            path.unlink(missing_ok=True)
