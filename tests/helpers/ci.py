"""The CI=true rules that ``tests/conftest.py`` enforces: CI cannot pass by testing nothing.

Under ``CI=true`` a test whose asset is missing (the embedded SmolLM2 or ShareGPT, the vLLM venv) FAILS instead
of skipping, and any other skip fails unless its reason is listed in ``ALLOWED_CI_SKIPS``.  ``CI`` is read
when asked (``under_ci()``), not at import, so a test may run the rules with either value in one process.
"""

from __future__ import annotations

import os
from pathlib import Path

from helpers import ROOT

# where scripts/setup_vllm_cpu.sh builds the vLLM CPU venv, relative to the checkout
VLLM_VENV_PYTHON = Path(".venv-vllm", "bin", "python")
VLLM_PYTHON = ROOT / VLLM_VENV_PYTHON
# fixture -> the marker every test using it (directly or through another fixture) must carry
MARKED_FIXTURES = {"smollm2": "smollm2", "sharegpt": "smollm2", "vllm_python": "vllm"}

# Under CI=true a skip fails the run unless its reason is listed here: a missing optional extra (tensorboard), a
# broken import (DeepSpeed) or a new skip must not let CI pass by testing less.  Keep the list short.
# the C++ suffix-tree reference (arctic-inference's) is built outside the repository, never by CI (docs/serving.md)
NO_SUFFIX_REFERENCE = "SUFFIX_REFERENCE_PATH is not set (the C++ reference is built outside the repository)"
# vLLM's CPU attention refuses an FP8 KV cache without AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py,
# _get_attn_isa): a property of the machine CI happens to run on, decided before the engine starts
NO_FP8_KV_ON_THIS_CPU = "this CPU has neither AVX-512 nor AMX, which vLLM's CPU FP8 KV cache needs"
ALLOWED_CI_SKIPS = frozenset({NO_SUFFIX_REFERENCE, NO_FP8_KV_ON_THIS_CPU})


def under_ci() -> bool:
    """Whether this run is CI's (``CI=true``, ``1`` or ``yes``): missing assets and unlisted skips fail."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(available: bool, what: str, fix: str) -> None:
    """Skip a test whose asset is missing; with CI=true fail it."""
    import pytest

    if not available:
        if under_ci():
            pytest.fail(f"{what} is missing and CI=true (to resolve, {fix})", pytrace=False)
        pytest.skip(f"{what} is missing ({fix})")


def unlisted_skip(report) -> str | None:
    """The reason of a skip that CI=true does not allow, else None."""
    if not (under_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return None
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    return None if reason in ALLOWED_CI_SKIPS else reason


def cpu_runs_fp8_kv() -> bool:
    """Whether vLLM's CPU attention can hold an FP8 KV cache on this machine (the condition vLLM checks)."""
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
