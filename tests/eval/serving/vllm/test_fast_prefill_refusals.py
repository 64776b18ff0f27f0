"""Engines the plugin refuses at model build, in one line naming the fix, where vLLM would run SwiftKV's fast
prefill wrongly or drop it without a word: breakable CUDA graphs (set by ``VLLM_USE_BREAKABLE_CUDAGRAPH``, or by
``VLLM_BATCH_INVARIANT=1``), FlexAttention (host reads of the offsets fast prefill fills asynchronously, as
FlashInfer), and prefill context parallel (vLLM's V2 runner then skips fast prefill).  No vLLM needed: the checks
read a config's fields (``eval.serving.vllm.fast_prefill_refusal``); vLLM's source lines that decide each case are
quoted in its docstring."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eval.serving.vllm import FAST_PREFILL_ENV, fast_prefill_refusal


def built_config(
    mode: str = "FULL_AND_PIECEWISE", pcp: int = 1, fast_prefill: bool = True
) -> SimpleNamespace:
    """The parts of a resolved VllmConfig that ``fast_prefill_refusal`` reads, after the config hook."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(kv_sharing_fast_prefill=fast_prefill),
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode)),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=pcp),
    )


@pytest.mark.parametrize(
    ("mode", "backend", "breakable", "pcp", "refused", "fix"),
    [
        ("FULL_AND_PIECEWISE", "FLASH_ATTN", False, 1, None, None),
        ("FULL_AND_PIECEWISE", "FLASH_ATTN", True, 1, "breakable CUDA graphs", "VLLM_USE_BREAKABLE_CUDAGRAPH=0"),
        ("PIECEWISE", "FLASH_ATTN", True, 1, "breakable CUDA graphs", "VLLM_USE_BREAKABLE_CUDAGRAPH=0"),
        # no piecewise graphs for breakable ones to replace: mixed steps run eagerly, decode steps as FULL graphs
        ("FULL_DECODE_ONLY", "FLASH_ATTN", True, 1, None, None),
        ("NONE", "FLASH_ATTN", True, 1, None, None),
        ("FULL_AND_PIECEWISE", "FLEX_ATTENTION", False, 1, "the FLEX_ATTENTION attention backend plans on host",
         "--attention-backend FLASH_ATTN"),
        ("NONE", "FLEX_ATTENTION", False, 1, "the FLEX_ATTENTION attention backend plans on host",
         "--attention-backend FLASH_ATTN"),  # eager too: the host read is not a graph's
        ("FULL_AND_PIECEWISE", "FLASH_ATTN", False, 2, "prefill context parallel makes vLLM's V2 runner skip",
         "--prefill-context-parallel-size 1"),
    ],
)  # fmt: skip
def test_fast_prefill_refusals_name_the_fix(mode, backend, breakable, pcp, refused, fix):
    config = built_config(mode, pcp)
    reason = fast_prefill_refusal(config, backend, breakable_cudagraphs=breakable)
    if refused is None:
        assert reason is None
    else:
        assert reason.startswith(refused) and "\n" not in reason
        assert "(to resolve, " in reason and fix in reason and f"{FAST_PREFILL_ENV}=0" in reason
    # fast prefill off (every row through every layer): nothing of this matters
    config.cache_config.kv_sharing_fast_prefill = False
    assert fast_prefill_refusal(config, backend, breakable_cudagraphs=breakable) is None


def test_breakable_cudagraphs_refusal_names_batch_invariance():
    """``VLLM_BATCH_INVARIANT=1`` turns breakable graphs on by itself (``VllmConfig._maybe_enable_breakable_cudagraph``,
    after the config hook), so the line says so: a user who never set the breakable variable learns why."""
    reason = fast_prefill_refusal(built_config(), "FLASH_ATTN", breakable_cudagraphs=True)
    assert "VLLM_BATCH_INVARIANT=1 turns on unless it is set" in reason
