"""Resumable stages for multi-step jobs (the demo): a finished stage is skipped, a changed one reruns.

Each stage records ``{key, inputs, result}`` in ``RUN/stages/NAME.json`` (atomically, after it succeeded).  The
key is a hash of the stage's inputs, and a stage that depends on another puts that stage's key among its inputs,
so a change anywhere reruns everything downstream of it and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit.artifacts import write_json_atomic


def stage_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_stage(
    run_dir: Path, name: str, inputs: dict[str, Any], fn: Callable[[], Any], output: Path | None = None
) -> tuple[str, Any]:
    """Return (key, result) of stage ``name``, running ``fn`` only if no record with the same key exists.

    ``output``: a folder the stage writes; it is removed before a rerun with different inputs (so stale
    partial state, such as checkpoints of another recipe, is never resumed), but kept for a rerun with the
    same inputs (so an interrupted stage resumes).
    """
    key = stage_key(inputs)
    record = run_dir / "stages" / f"{name}.json"
    if record.is_file():
        saved = json.loads(record.read_text())
        if saved["key"] == key:
            print(f"[{name}] up to date, skipped", flush=True)
            return key, saved["result"]
        if output is not None:
            shutil.rmtree(output, ignore_errors=True)
        record.unlink()
    elif (
        output is not None
        and (output / ".stage_key").is_file()
        and (output / ".stage_key").read_text() != key
    ):
        shutil.rmtree(output, ignore_errors=True)
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        (output / ".stage_key").write_text(key)
    print(f"[{name}] running", flush=True)
    result = fn()
    write_json_atomic(record, {"key": key, "inputs": inputs, "result": result})
    return key, result
