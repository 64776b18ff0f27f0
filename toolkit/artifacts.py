"""Artifact hygiene shared by every stage: a written directory is complete or absent.

Every stage (convert, calibrate, distill export, eval report) writes into a sibling temp directory and
renames it into place only after everything succeeded, so a crash or a refused input never leaves a
half-written output.  Each artifact also records what made it in ``provenance.json`` beside config.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROVENANCE_FILE = "provenance.json"


def cache_dir() -> Path:
    """Root of the user cache for fetched assets (``$SWIFTKV_CACHE`` or ``~/.cache/swiftkv-toolkit``)."""
    root = os.environ.get("SWIFTKV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "swiftkv-toolkit"
    )
    return Path(root)


def check_destination(dst: str | os.PathLike, force: bool = False) -> Path:
    """Refuse a non-empty destination unless ``force``; return it as a Path."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"destination {dst} exists and is not a directory; choose another path")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise FileExistsError(
            f"destination {dst} is not empty; to resolve, pass --force or choose another path"
        )
    return dst


@contextlib.contextmanager
def atomic_output_dir(dst: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temp directory next to ``dst``; on success replace ``dst`` with it, on error delete it."""
    dst = check_destination(dst, force)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks (model files are large)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temp file and rename, so readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json_atomic(path: str | os.PathLike, payload: Any) -> Path:
    """``payload`` as indented JSON at ``path``, written atomically."""
    return write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """A matplotlib figure as ``path`` (its suffix picks the format), written atomically, then closed."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_provenance(out_dir: str | os.PathLike, stage: str, **fields: Any) -> None:
    """Record which stage, package version and options produced the artifact in ``out_dir``."""
    from . import __version__

    write_json_atomic(
        Path(out_dir) / PROVENANCE_FILE, {"stage": stage, "swiftkv_version": __version__, **fields}
    )


def read_provenance(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Return the provenance record of an artifact, or an empty dict when it has none."""
    path = Path(model_dir) / PROVENANCE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
