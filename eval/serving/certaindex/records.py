"""Per-problem result files that survive interruption, shared by the CLI and the benchmark.

Records go to ``OUT.partial`` as they finish (one JSON line each, after a header line with the options), so
an interrupted run resumes where it stopped, and a run with other options refuses to mix into it.  When
every problem is done ``OUT`` is written (records only, problem order, temp file + rename) and the partial
file removed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from .data import Problem


def run_resumable(
    problems: list[Problem], solve: Callable[[Problem], dict], out: Path, options: dict
) -> list[dict]:
    """Solve every problem not yet in ``out.partial``; return all records in problem order.  ``solve``
    returns a problem's record; its ``id`` and ``reference`` (the problem's answer) are added here."""
    from tqdm import tqdm

    if out.exists():
        raise FileExistsError(f"{out} exists; to resolve, choose another --out or delete it")
    partial = out.with_name(out.name + ".partial")
    done: dict[str, dict] = {}
    if partial.exists():
        lines = [json.loads(x) for x in partial.read_text().splitlines() if x.strip()]
        if not lines or lines[0].get("options") != options:
            raise ValueError(
                f"{partial} was written with other options; to resolve, delete it or rerun with the same ones"
            )
        done = {r["id"]: r for r in lines[1:]}
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"options": options}) + "\n")
    with partial.open("a") as sink:
        for problem in tqdm(
            [p for p in problems if p.id not in done], desc=out.name, initial=len(done), total=len(problems)
        ):
            record = {"id": problem.id, "reference": problem.answer, **solve(problem)}
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            done[problem.id] = record
    records = [done[p.id] for p in problems]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, out)
    partial.unlink()
    return records
