"""Fixtures and hooks only (what the tests share as code is in ``helpers``): the same random state for every
test, tiny models and chats built in the test, the embedded SmolLM2 and ShareGPT, the vLLM venv, and the CI=true
rules (``helpers.ci``): a missing asset or an unlisted skip fails under CI instead of skipping."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.artifacts import cache_dir

# torch.compile's kernels (flex_attention, the compiled static-cache decode) cached where the next session, and
# its subprocesses, find them: beside the embedded assets, not in a temp folder that may be cleaned.  Named before
# the helpers' imports: importing a transformers model class makes torch's inductor write its temp-folder default
# into the environment, which a later setdefault would keep
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "torchinductor"))
pytest.register_assert_rewrite("helpers")  # before the first helper's import: its asserts explain themselves
from helpers.ci import MARKED_FIXTURES, VLLM_VENV_PYTHON, require, unlisted_skip  # noqa: E402
from helpers.models import tiny_base  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's cache beside the kernels': every vLLM process of the suite (some 20) otherwise inspects each model class again in a
# subprocess of its own (~10 s each), and compiles again what an earlier run compiled
os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
# One OpenMP thread per core in all: each of N xdist workers, and every process it starts (launches, servers, the
# job's subprocesses, which inherit OMP_NUM_THREADS), gets cores // N threads.  Two 2-thread processes on two cores
# spin-wait for each other's cores: a CPU-bound file ran 6-9x slower beside its twin than with one thread each
# (docs/results/test-lanes.md).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads = max(1, min(2, len(os.sched_getaffinity(0))) // _workers)
torch.set_num_threads(_threads)
if _workers > 1:
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    # vLLM's CPU build binds its workers' OpenMP threads to every core of the node whatever OMP_NUM_THREADS says
    # ("auto"); "nobind" leaves them to OMP_NUM_THREADS, as every other process of the suite
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# vLLM servers run their model worker inside the engine's process, as a one-GPU server does, not in a third process of
# its own as vLLM's CPU build starts it (~10 s of CPU a server: its vLLM import); bench_serve.server_env follows this
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# DeepSpeed's CPU ops built for this venv alone: a second checkout on the machine (a fresh clone's CI run) builds them
# with its own paths, and in a shared folder each build's command line made the other's stale (~50 CPU-s a rebuild)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# The tests and every process they start run as in an activated venv: its bin first on PATH.  Otherwise a launch
# script that runs `accelerate` from PATH (the cluster launcher's) and every other launch reach different ninja
# builds (the venv's 1.13, the system's 1.11) that do not read each other's build log, and DeepSpeed's CPU
# communication op was compiled again at each switch, ~70 s of CPU each (docs/results/test-lanes.md).
_bin = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _bin:
    os.environ["PATH"] = os.pathsep.join(filter(None, [_bin, os.environ.get("PATH")]))
# the checkout, as this file's place says (test_ci_rules.py runs a copy of it where no vLLM venv is beside it)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def seeded_rngs() -> None:
    """Every test starts from the same random state (Python, NumPy, torch), whichever tests ran before it."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-llama"
    tiny_base("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from toolkit.assets import model_dir

    path = model_dir()
    require((path / "config.json").is_file(), f"embedded SmolLM2 at {path}", "run `swiftkv fetch model`")
    return path


@pytest.fixture(scope="session")
def sharegpt() -> Path:
    from toolkit.assets import sharegpt_path

    path = sharegpt_path()
    require(path.is_file(), f"ShareGPT at {path}", "run `swiftkv fetch sharegpt`")
    return path


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    path = ROOT / VLLM_VENV_PYTHON
    require(path.exists(), f"the vLLM venv at {path}", "run `bash scripts/setup_vllm_cpu.sh`")
    return path


def _fail_unlisted_skip(report) -> None:
    reason = unlisted_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under CI=true: {reason} (to resolve, install what the test needs, or add the reason to "
            "ALLOWED_CI_SKIPS in tests/helpers/ci.py if CI can never have it)"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_unlisted_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_unlisted_skip(report)
    return report


# Seconds each of the longest files held a worker in a full run (2026-12-06, docs/results/test-lanes.md): the
# order in which they start.  A file not listed weighs 5 s per slow test, 10 s per slow vLLM test.
FILE_SECONDS = {
    "tests/eval/serving/vllm/test_plugin.py": 405, "tests/distill/test_train.py": 281,
    "tests/scripts/test_bench_serve.py": 225, "tests/eval/test_job.py": 155,
    "tests/eval/serving/vllm/test_gpu_check_vllm.py": 154, "tests/scripts/test_bench_rank_proxy.py": 106,
    "tests/distill/test_scar_loop.py": 76, "tests/distill/test_check.py": 75, "tests/distill/test_elastic.py": 64,
    "tests/distill/test_cluster_launch.py": 63, "tests/distill/test_multinode.py": 61,
    "tests/distill/test_scar.py": 57, "tests/eval/serving/vllm/test_exact_schedule.py": 57,
    "tests/eval/test_gpu_check.py": 53, "tests/eval/serving/ranking/test_proxy_vllm.py": 52,
    "tests/distill/test_sweep.py": 51,
    "tests/eval/serving/ranking/test_proxy_hardening.py": 26,  # its timeouts: wall time, hardly any CPU
}  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (a file's own order kept), and xdist keeps this order (``--no-loadscope-reorder``):
    the two workers start on the longest files and finish on short ones, instead of one worker still running a
    long file late in the run while the other has nothing left."""
    cost: dict[str, int] = {}
    for item in items:
        if item.get_closest_marker("slow"):
            cost[item.location[0]] = cost.get(item.location[0], 0) + (
                10 if item.get_closest_marker("vllm") else 5
            )
    cost.update(FILE_SECONDS)
    items.sort(key=lambda item: -cost.get(item.location[0], 0))  # stable: a file's order stays


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that needs an asset carries its marker, so ``-m "not smollm2"`` / ``"not vllm"`` deselects it."""
    for fixture, marker in MARKED_FIXTURES.items():
        if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None:
            pytest.fail(
                f"{item.nodeid} uses the {fixture} fixture: mark it @pytest.mark.{marker}", pytrace=False
            )


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2) -> Path:
    """A tiny random Llama with the embedded SmolLM2 tokenizer (so chat templates are real)."""
    from helpers.models import tiny_chat_base
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tiny_chat_base(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    import json

    from helpers.chat import CONVERSATIONS

    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """HF_HOME in the test's folder, offline, holding ``helpers.hub.HUB_REPO`` (a tiny chat model,
    ``helpers.chat``) as a download leaves it (``helpers.hub``); returns (HF_HOME, commit)."""
    from helpers.chat import save_chat_model
    from helpers.hub import HUB_REPO, add_to_cache
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    commit = add_to_cache(home / "hub", HUB_REPO, save_chat_model(tmp_path / "upload"))
    return home, commit


@pytest.fixture(scope="session")
def distill_reference(tmp_path_factory, tiny_chat_model, chat_data) -> Path:
    """The output folder of one uninterrupted single-process distillation of the tiny chat model with
    ``helpers.distill_runs.REFERENCE`` settings, run once per session: the kill/resume, SCAR and elastic tests
    compare their resumed runs with its losses and copy its checkpoints.  Read only."""
    from helpers.distill_runs import REFERENCE, distill, write_recipe

    root = tmp_path_factory.mktemp("distill-reference")
    out = root / "reference"
    distill(write_recipe(root, tiny_chat_model, chat_data, out, **REFERENCE))
    return out
