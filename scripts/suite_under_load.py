"""Run a pytest lane several times while busy processes hold every core: does the suite survive a loaded box?

The kill-and-resume tests, the vLLM servers and the multi-process launches wait on files, barriers and
held ports instead of wall-clock guesses; this is the check that they do.  One busy process per core (a
pure-Python spin loop, ``nice 0`` like the tests) runs for the whole time and is stopped at the end, also
when this script is interrupted.  Prints one line per run (status, minutes) and a JSON summary with ``--out``.

    python scripts/suite_under_load.py --runs 2 -- -q -m slow
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from toolkit.cliargs import ArgumentParser, UsageError, add_out, run

REPO = Path(__file__).resolve().parents[1]


def spin() -> None:
    while True:
        pass


def lane_under_load(pytest_args: list[str], runs: int, hogs: int) -> list[dict]:
    """Run ``pytest PYTEST_ARGS`` ``runs`` times while ``hogs`` busy processes run; one record per run."""
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(hogs)]
    for process in busy:
        process.start()
    records = []
    try:
        for i in range(runs):
            start = time.perf_counter()
            status = subprocess.call([sys.executable, "-m", "pytest", *pytest_args], cwd=REPO)
            minutes = (time.perf_counter() - start) / 60
            records.append({"run": i + 1, "status": status, "minutes": round(minutes, 1)})
            print(
                f"run {i + 1}/{runs} under {hogs} busy processes: status {status}, {minutes:.1f} min",
                flush=True,
            )
    finally:
        for process in busy:
            process.terminate()
        for process in busy:
            process.join()
    return records


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="suite_under_load.py", description=__doc__)
    parser.add_argument("--runs", type=int, default=2, help="how many times to run the lane (default: 2)")
    parser.add_argument(
        "--hogs", type=int, default=os.cpu_count() or 1, help="busy processes (default: cores)"
    )
    add_out(parser, required=False, help="JSON summary")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="pytest's arguments, after --")
    return parser


def command(args: argparse.Namespace) -> str:
    if args.runs < 1 or args.hogs < 0:
        raise UsageError(
            f"--runs {args.runs} / --hogs {args.hogs} (to resolve, give --runs >= 1 and --hogs >= 0)"
        )
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    records = lane_under_load(pytest_args, args.runs, args.hogs)
    if args.out:
        summary = {"pytest_args": pytest_args, "hogs": args.hogs, "runs": records}
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    failed = [r["run"] for r in records if r["status"] != 0]
    if failed:
        raise SystemExit(1)
    return f"all {len(records)} runs passed under {args.hogs} busy processes"


def main(argv: list[str] | None = None) -> int:
    return run(command, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
