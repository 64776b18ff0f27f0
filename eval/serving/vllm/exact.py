"""Exact K/V (``exact_kv_window = W >= 1``) in vLLM: the rows that run layers >= l store their own K/V there.

The prefill stack writes SwiftKV K/V for every token into each layer's holder; in the decode stack each layer
j >= l computes its rows' exact K/V (the teacher's k/v projection on the layer's own normed input, Qwen3's k_norm,
RoPE) and overwrites their slots in holder j before its attention reads the cache.  Three pieces:

* ``write_exact_kv``: a custom op of this plugin (``torch.ops.swiftkv.write_exact_kv``) that writes K/V through
  the holder's backend (``do_kv_cache_update``) at the slots of the rows the decode stack runs.  vLLM's own
  ``unified_kv_cache_update`` cannot: it takes the slot mapping of the whole step from the forward context.  The
  model gathers those slots into a static buffer before the decode stack runs (``swiftkv_exact_slots`` on every
  holder; padding rows -1, which vLLM's cache kernels skip, as in its own dummy runs).  The op launches its kernel
  whenever the caches exist, with no test of per-step metadata: under piecewise CUDA graphs it is captured inside a
  graph piece and replayed on the same buffers, so a launch skipped at capture would be missing from every step.
* ``attend_after``: the KV-sharing layer's attention call, taking the write's (empty) result as
  ``kv_cache_dummy_dep``, as ``Attention.forward`` does with its own cache write, so torch.compile keeps the write
  before the read and does not drop it.
* ``PromptWindow`` (W > 1): vLLM builds the upper layers' attention metadata for the logits rows only
  (``make_kv_sharing_fast_prefill_common_attn_metadata``, called by the fast-prefill builder in both model
  runners); the window also needs the last W rows of each prompt chunk, so the model has vLLM build it for
  ``layout.exact_rows`` instead.  W = 1 needs nothing: the logits rows are the rows.

FP8 KV cache: exact K/V are quantized with the holder's scale, the one the whole group shares (the checkpoint's
scales on the teacher K/V projections of layers >= l count towards it); a scale calibrated on SwiftKV K/V only
may clip exact K/V.  Queries are quantized as vLLM's own attention layer quantizes them (``attend_after``).
"""

from __future__ import annotations

import functools
import weakref

import torch

from eval.serving.vllm.internals import (
    Attention,
    encode_layer_name,
    fast_prefill_utils,
    get_forward_context,
    unified_attention_with_output,
)
from eval.serving.vllm.layout import captured_sizes, exact_rows, padded_count

# the attribute of each holder that holds the static slot buffer of the decode stack's rows
SLOTS = "swiftkv_exact_slots"


def _write_exact_kv(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    holder = get_forward_context().no_compile_layers[layer_name]
    if holder.kv_cache.numel():  # empty only in vLLM's memory-profiling run, before the caches are allocated
        slots = getattr(holder, SLOTS)[: key.shape[0]]
        holder.impl.do_kv_cache_update(holder, key, value, holder.kv_cache, slots)
    return key.new_empty(0)


_LIBRARY = torch.library.Library("swiftkv", "FRAGMENT")
_LIBRARY.define("write_exact_kv(Tensor key, Tensor value, str layer_name) -> Tensor")
_LIBRARY.impl("write_exact_kv", _write_exact_kv, "CompositeExplicitAutograd")
torch.library.register_fake("swiftkv::write_exact_kv")(lambda key, value, layer_name: key.new_empty(0))


def write_exact_kv(key: torch.Tensor, value: torch.Tensor, holder: Attention) -> torch.Tensor:
    """Write ``key``/``value`` ([rows, kv heads * head size], the decode stack's rows) into ``holder``'s cache at
    its static slot buffer; returns the empty result ``attend_after`` orders the read after.  Called directly or
    through the custom op, as vLLM's attention calls its own cache write."""
    key = key.view(-1, holder.num_kv_heads, holder.head_size)
    value = value.view(-1, holder.num_kv_heads, holder.head_size)
    if holder.use_direct_call:
        return _write_exact_kv(key, value, holder.layer_name)
    return torch.ops.swiftkv.write_exact_kv(key, value, holder.layer_name)


def attend_after(attn: Attention, query: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    """``attn`` (a KV-sharing attention, which writes no cache) on ``query``, after the write that returned
    ``written``: vLLM's attention op with it as ``kv_cache_dummy_dep``.

    The query goes in as ``Attention.forward`` hands it over: quantized with the layer's q scale where the layer
    has a query quantizer and its backend takes FP8 queries (an FP8 KV cache on FlashAttention 3 or, on CUDA,
    Triton), whose kernels then read it with that scale; the output keeps the unquantized dtype."""
    hidden = attn.num_heads * attn.head_size
    output = torch.empty(query.shape[0], hidden, dtype=query.dtype, device=query.device)
    if attn.query_quant is not None and attn.impl.supports_quant_query_input:
        query, _ = attn.query_quant(query, attn._q_scale)
    query, out = (
        query.view(-1, attn.num_heads, attn.head_size),
        output.view(-1, attn.num_heads, attn.head_size),
    )
    if attn.use_direct_call:
        unified_attention_with_output(query, None, None, out, attn.layer_name, kv_cache_dummy_dep=written)
    else:
        name = encode_layer_name(attn.layer_name)
        torch.ops.vllm.unified_attention_with_output(query, None, None, out, name, kv_cache_dummy_dep=written)
    return out.view(-1, hidden)


class PromptWindow:
    """Has vLLM build the upper layers' attention metadata for ``layout.exact_rows`` (each request's last
    ``min(q_len, W)`` rows), padded to a captured CUDA-graph size with the last row repeated, in a static buffer.

    It rewrites the step's ``CommonAttentionMetadata`` in place (``logits_indices_padded``,
    ``num_logits_indices``, ``max_logits_per_req``): vLLM's fast-prefill builder keeps that object and hands the
    rows to the model with the metadata, which ``LlamaSwiftKVModel._decode_rows`` reads.  The runner samples from
    its own logits indices, a subset of these rows.  The rows come from ``query_start_loc_cpu``, without a device
    sync; a step vLLM does not arm (every row needs logits) is left as it is."""

    def __init__(self, window: int, rows: int, compilation_config, device: torch.device):
        self.window, self.compilation_config = (
            window,
            compilation_config,
        )  # its sizes read when used (llama.py)
        self.rows = torch.zeros(rows, dtype=torch.int32, device=device)

    def widen(self, common) -> None:
        if (
            common.logits_indices_padded is None
            or common.num_logits_indices is None
            or common.max_query_len == 1
        ):
            return
        rows, widest = exact_rows(common.query_start_loc_cpu.tolist(), self.window)
        config = self.compilation_config
        sizes = sorted(captured_sizes(config)) if config.cudagraph_mode.has_piecewise_cudagraphs() else []
        size = padded_count(len(rows), sizes, len(self.rows))
        padded = torch.tensor(rows + rows[-1:] * (size - len(rows)), dtype=self.rows.dtype)
        self.rows[:size].copy_(padded, non_blocking=True)
        common.logits_indices_padded = self.rows[:size]
        common.num_logits_indices, common.max_logits_per_req = len(rows), widest


_active: weakref.ref[PromptWindow] | None = None


def use_prompt_window(window: PromptWindow | None) -> None:
    """Make ``window`` the rows rule of vLLM's fast prefill in this process (None: the logits rows, vLLM's own).

    vLLM's fast-prefill builder calls ``make_kv_sharing_fast_prefill_common_attn_metadata`` through its module, so
    the first call wraps that function once; the wrapper applies the window of the SwiftKV model built last in the
    process while that model lives (one engine per process, as vLLM serves; the tests start several in turn)."""
    global _active
    original = fast_prefill_utils.make_kv_sharing_fast_prefill_common_attn_metadata
    if window is not None and not getattr(original, "swiftkv_window", False):

        @functools.wraps(original)
        def with_window(common_attn_metadata):
            active = _active() if _active is not None else None
            if active is not None:
                active.widen(common_attn_metadata)
            return original(common_attn_metadata)

        with_window.swiftkv_window = True
        fast_prefill_utils.make_kv_sharing_fast_prefill_common_attn_metadata = with_window
    _active = None if window is None else weakref.ref(window)
