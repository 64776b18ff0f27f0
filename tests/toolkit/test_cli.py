"""Every entry point refuses a missing input the same way: exit status 2, ONE stderr line
``error: ... (to resolve, ...)``, nothing on stdout, and no output written.

Sub-commands and scripts run in-process through ``main(argv)`` (a Python start costs seconds of CPU here);
every ``__main__`` hands ``main``'s status to the shell (checked in the source), and three real command lines
(``python -m distill`` as ``accelerate launch -m distill`` runs it, ``python -m toolkit``, and the README's
``swiftkv run`` through the console script) run as subprocesses: the only ones for these entry points
(tests/eval/test_job.py runs the main job in-process; test_front_door.py routes every command).
"""

from __future__ import annotations

import ast
import importlib
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from helpers import ROOT

MISSING, OUT = "{missing}", "{out}"

# (module with main(argv), argv): MISSING is an input path that does not exist, OUT the output to watch
CASES = [
    ("swiftkv.cli", ["convert", MISSING, OUT, "--swiftkv-fraction", "0.5"]),
    ("swiftkv.cli", ["info", MISSING]),
    ("kvcompress.cli", ["calibrate", MISSING, "--out", OUT]),
    ("distill.__main__", [MISSING, f"output_dir={OUT}"]),
    ("distill.__main__", ["check", MISSING]),
    ("distill.cluster.cli", ["plan", MISSING, MISSING, "--out", OUT]),
    ("distill.cluster.cli", ["launch-configs", MISSING, "--out", OUT]),
    ("distill.cluster.cli", ["trace", MISSING, "--out", OUT]),
    ("distill.cluster.cli", ["simulate", MISSING, MISSING, "--out", OUT]),
    ("eval.cli", ["run", "--out", OUT, "--fractions", "1.5"]),  # bad input, refused before any work
    ("eval.cli", ["harness", MISSING, "--tasks", "sharegpt_ppl", "--tasks-dir", OUT]),
    ("eval.cli", ["quality", MISSING]),
    ("eval.cli", ["report", MISSING]),
    ("eval.cli", ["vllm-args", MISSING]),
    ("eval.serving.suffix.cli", ["build", MISSING, "--out", OUT]),
    ("eval.serving.suffix.cli", ["generate", MISSING, "--prompts", MISSING]),
    ("eval.serving.suffix.cli", ["export-vllm", MISSING]),
    ("eval.serving.ranking.cli", ["traces", MISSING, "--out", OUT]),
    ("eval.serving.ranking.cli", ["train", MISSING, "--out", OUT]),
    ("eval.serving.ranking.cli", ["evaluate", MISSING, MISSING, "--out", OUT]),
    ("eval.serving.ranking.cli", ["calibrate", MISSING, "--out", OUT]),
    ("eval.serving.ranking.cli", ["simulate", MISSING, MISSING, "--out", OUT]),
    ("eval.serving.ranking.cli", ["proxy-overhead", MISSING]),
    *[
        ("eval.serving.certaindex.cli", [cmd, MISSING, "--data", "arith:2", "--out", OUT])
        for cmd in ("cot", "sc", "calibrate")
    ],
    ("eval.serving.certaindex.cli", ["serve", MISSING]),
    ("eval.serving.vllm.api_check", [MISSING]),
]

# scripts/*.py with an input path, loaded with runpy (they are files, not an importable package)
SCRIPTS = [
    ("bench_cluster.py", [MISSING, "--out", OUT]),
    ("bench_distill.py", [MISSING, "--out", OUT]),
    ("bench_kvcompress.py", [MISSING, MISSING, "--out", OUT]),
    ("bench_kvcompress_pareto.py", [MISSING, "--factors", OUT, "--out", OUT]),
    ("bench_prefill.py", [MISSING, "--out", OUT]),
    ("bench_ranking.py", [MISSING, "--out", OUT]),
    ("bench_rank_proxy.py", [MISSING, MISSING, MISSING, "--out", OUT]),
    ("bench_suffix.py", [MISSING, "--out", OUT]),
    ("bench_vllm.py", [MISSING, MISSING, "--out", OUT]),
    ("bench_certaindex.py", [MISSING, "--out", OUT]),
    ("bench_scar.py", ["--workdir", MISSING, "--out", OUT]),
]
# a few real command lines (each start imports torch: seconds of CPU), run side by side
PROCESSES = [
    [sys.executable, "-m", "distill", MISSING],
    [sys.executable, "-m", "toolkit", "report", MISSING],
    [str(Path(sys.executable).parent / "swiftkv"), "run", "--out", OUT, "--fractions", "0"],
]


def fill(argv: list[str], tmp_path: Path) -> list[str]:
    return [a.format(missing=tmp_path / "missing", out=tmp_path / "out") for a in argv]


def check_refusal(code: int, out: str, err: str, tmp_path: Path) -> None:
    assert code == 2, err
    assert out == "", out
    assert err.startswith("error: ") and err.count("\n") == 1 and "to resolve" in err, err
    assert list(tmp_path.iterdir()) == [], "an output appeared"


def ids(value) -> str:
    return value if isinstance(value, str) else " ".join(value)


@pytest.mark.parametrize(("module", "argv"), CASES, ids=ids)
def test_missing_input_is_refused_in_one_line(module, argv, tmp_path, capsys):
    main = importlib.import_module(module).main
    capsys.readouterr()
    code = main(fill(argv, tmp_path))
    out, err = capsys.readouterr()
    check_refusal(code, out, err, tmp_path)


@pytest.mark.parametrize(("script", "argv"), SCRIPTS, ids=ids)
def test_script_refuses_missing_input_in_one_line(script, argv, tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "scripts" / script), run_name="script_under_test")["main"]
    capsys.readouterr()
    code = main(fill(argv, tmp_path))
    out, err = capsys.readouterr()
    check_refusal(code, out, err, tmp_path)


def entry_files() -> list[Path]:
    """Every ``__main__.py``, every script, and every module with a ``__main__`` guard."""
    files = [
        p
        for room in ("toolkit", "swiftkv", "kvcompress", "distill", "eval", "scripts")
        for p in (ROOT / room).rglob("*.py")
    ]
    return sorted(
        p
        for p in files
        if p.name == "__main__.py" or "scripts" in p.parts or '__name__ == "__main__"' in p.read_text()
    )


@pytest.mark.parametrize("path", entry_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_entry_point_exits_with_the_status_main_returns(path):
    """``raise SystemExit(main(...))``: never ``sys.exit("message")`` or a bare ``main()`` that drops the status."""
    tree = ast.parse(path.read_text())
    raises = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Raise)
        and n.exc is not None
        and ast.unparse(n.exc).startswith("SystemExit(main(")
    ]
    calls = [
        ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
    ]
    assert raises and not [c for c in calls if c.startswith(("main(", "sys.exit("))], calls


def test_console_scripts_point_at_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for target in scripts.values():
        module, func = target.split(":")
        assert func == "main" and callable(importlib.import_module(module).main)


@pytest.mark.slow  # three Python starts side by side, each importing torch
def test_command_lines_refuse_in_one_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    running = []
    for i, cmd in enumerate(PROCESSES):
        folder = tmp_path / str(i)
        folder.mkdir()
        cmd = [cmd[0], *fill(cmd[1:], folder)]
        running.append(
            (cmd, folder, subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=-1, stderr=-1))
        )
    for cmd, folder, proc in running:
        out, err = proc.communicate(timeout=600)
        try:
            check_refusal(proc.returncode, out, err, folder)
        except AssertionError as e:
            raise AssertionError(f"{' '.join(cmd)}: {e}") from None
