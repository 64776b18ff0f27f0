"""Resumable stages, the one resume scheme of the main job and the fraction sweep.

Each stage records ``{key, inputs, result}`` in ``RUN/stages/NAME.json`` (atomically, after it succeeded).  The
key is a hash of the stage's inputs, and a stage that depends on another puts that stage's key among its inputs,
so a change anywhere reruns everything downstream of it and nothing else.  A stage that writes a folder names
it as ``output``: the folder is kept for a rerun with the same inputs (an interrupted distillation resumes from
its checkpoints) and removed before a rerun with other inputs (stale state of another recipe is never resumed).

Under ``accelerate launch`` every process runs the same stages: the main process alone writes and removes
(``main``), and ``barrier`` holds the others until it has, so every process sees the same folders.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .artifacts import write_json_atomic

KEY_FILE = ".stage_key"


def stage_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_record(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "stages" / f"{name}.json"


def finished(run_dir: Path, name: str, inputs: dict[str, Any]) -> tuple[bool, Any]:
    """(whether stage ``name`` finished with these inputs, its result if so), without running anything."""
    record = stage_record(run_dir, name)
    if record.is_file():
        saved = json.loads(record.read_text())
        if saved["key"] == stage_key(inputs):
            return True, saved["result"]
    return False, None


def run_stage(
    run_dir: Path,
    name: str,
    inputs: dict[str, Any],
    fn: Callable[[], Any],
    output: Path | None = None,
    main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[str, Any]:
    """Return (key, result) of stage ``name``, running ``fn`` only if no record with the same key exists.

    ``output``: the folder the stage writes (see the module docstring).  ``main``/``barrier``: this process's
    part under several processes (each calls ``run_stage``; ``fn`` runs on all of them, its result is
    recorded by the main one).
    """
    key = stage_key(inputs)
    done, result = finished(run_dir, name, inputs)
    if done:
        print(f"[{name}] up to date, skipped", flush=True)
        return key, result
    record = stage_record(run_dir, name)
    if main:
        if output is not None:
            marker = output / KEY_FILE
            # finished with other inputs, or begun with other inputs: nothing in the folder is this stage's
            if record.is_file() or (marker.is_file() and marker.read_text() != key):
                shutil.rmtree(output, ignore_errors=True)
            output.mkdir(parents=True, exist_ok=True)
            marker.write_text(key)
        record.unlink(missing_ok=True)
    barrier()
    print(f"[{name}] running", flush=True)
    result = fn()
    if main:
        write_json_atomic(record, {"key": key, "inputs": inputs, "result": result})
    barrier()
    return key, result
