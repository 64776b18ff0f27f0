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
* ``PromptWindow``: vLLM builds the upper layers' attention metadata for the logits rows only
  (``make_kv_sharing_fast_prefill_common_attn_metadata``, called by the fast-prefill builder in both model
  runners); the model has vLLM build it for ``layout.exact_rows`` instead: by absolute position, the rows at
  positions >= prompt_len - W of their own request (its prompt's last W tokens and everything it generated,
  recomputed outputs included), whatever the chunking, and a chunk's last row, which writes nothing, where it
  has none.  The prompt lengths come from the model runner (``step_prompt_lens``).
* ``cap_prefix_cache`` (``layout``, installed on every scheduler by ``keep_prefix_cache_outside_windows``): no
  prefix-cache hit reaches into a request's window, and no block holding an exact row is cached.

FP8 KV cache: exact K/V are quantized with the holder's scale, the one the whole group shares (the checkpoint's
scales on the teacher K/V projections of layers >= l count towards it); a scale calibrated on SwiftKV K/V only
may clip exact K/V.  Queries are quantized as vLLM's own attention layer quantizes them (``attend_after``).
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch

from eval.serving.vllm.internals import (
    Attention,
    V1ModelRunner,
    encode_layer_name,
    fast_prefill_utils,
    get_forward_context,
    unified_attention_with_output,
)
from eval.serving.vllm.layout import captured_sizes, exact_rows, padded_count
from eval.serving.vllm.staging import StagedRows

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
    """Has vLLM build the upper layers' attention metadata for ``layout.exact_rows`` (by position: each request's
    rows at positions >= prompt_len - W, else its last row), padded to a captured CUDA-graph size with the last row
    repeated, and which of them write exact K/V, in one static buffer.

    It rewrites the step's ``CommonAttentionMetadata`` in place (``logits_indices_padded``,
    ``num_logits_indices``, ``max_logits_per_req``): vLLM's fast-prefill builder keeps that object and hands the
    rows to the model with the metadata, which ``LlamaSwiftKVModel._decode_rows`` reads, together with
    ``writes_for`` (the rows that store exact K/V; the others, a chunk's last row before its window, run the upper
    layers for the runner's logits row and write nothing).  The runner samples from its own logits indices, a
    subset of these rows.  Positions come from ``query_start_loc_cpu`` and ``seq_lens_cpu_upper_bound`` (exact for
    a request still in its prompt, which is all the rule needs: a request past its prompt has every row exact),
    prompt lengths from the runner (``step_prompt_lens``).  A step vLLM does not arm (every row needs logits:
    decode steps, and every step captured as a FULL CUDA graph), and a step of one exact row per request (decodes),
    is left as it is: all its rows write."""

    def __init__(self, window: int, rows: int, compilation_config, device: torch.device):
        self.window, self.compilation_config = (
            window,
            compilation_config,
        )  # its sizes read when used (llama.py)
        # row indices, then 1 where the row writes exact K/V (0: a chunk's logits row before its window, padding),
        # filled through pinned host buffers (staging.py: no host sync per armed step)
        self.staging = StagedRows(rows, device, lanes=2)
        self.buffer = self.staging.rows
        self.rows, self.writes = self.buffer[0], self.buffer[1]
        self.staged: torch.Tensor | None = None  # the rows view of the step widened last

    def widen(self, common) -> None:
        if common.logits_indices_padded is None or common.num_logits_indices is None:
            return
        starts = common.query_start_loc_cpu.tolist()
        if common.seq_lens_cpu_upper_bound is None:
            raise RuntimeError(
                "exact K/V: this vLLM gives fast prefill no seq_lens_cpu_upper_bound, so the SwiftKV plugin cannot "
                "tell the rows' positions (to resolve, use a vLLM version in the tested range, docs/serving.md)"
            )
        num_reqs = len(starts) - 1
        seq_lens = common.seq_lens_cpu_upper_bound[:num_reqs].tolist()
        prompt_lens = step_prompt_lens(common, num_reqs)
        if common.max_query_len == 1 and all(
            seq - 1 >= prompt - self.window
            for seq, prompt, start, end in zip(seq_lens, prompt_lens, starts[:-1], starts[1:], strict=True)
            if end > start
        ):
            return  # one row per request, all exact (decodes): vLLM's own rows, left as they are, nothing staged
        rows, writes, widest = exact_rows(starts, seq_lens, prompt_lens, self.window)
        config = self.compilation_config
        sizes = sorted(captured_sizes(config)) if config.cudagraph_mode.has_piecewise_cudagraphs() else []
        size = padded_count(len(rows), sizes, self.rows.shape[0])
        pad = size - len(rows)
        self.staging.upload(rows + rows[-1:] * pad, [int(w) for w in writes] + [0] * pad)
        self.staged = common.logits_indices_padded = self.rows[:size]
        common.num_logits_indices, common.max_logits_per_req = len(rows), widest

    def writes_for(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Which of the decode stack's rows write exact K/V (1) when ``rows`` (the upper layers' metadata's
        logits rows) are the ones this window staged for the step; None (every row writes) otherwise."""
        if rows is None or rows is not self.staged:
            return None
        return self.writes[: rows.shape[0]]


# Prompt lengths of the step's requests, from the model runner (see step_prompt_lens).  V1: the input batch's
# num_prompt_tokens, set while the runner builds the step's attention metadata; V2: RequestState.prompt_len (all
# request states), indexed by the metadata's req_idx
_v1_prompt_lens = None
_v2_prompt_lens = None


def step_prompt_lens(common, num_reqs: int) -> list[int]:
    """Each request's prompt length, for the ``num_reqs`` requests of the step whose metadata is ``common``.

    * V1 (``vllm/v1/worker/gpu_model_runner.py``): the persistent ``InputBatch`` holds one row per request of
      the step, in the order of ``query_start_loc`` (``_build_attention_metadata`` reads
      ``self.input_batch.num_prompt_tokens_cpu_tensor[:num_reqs_padded]`` for ``is_prefilling`` the same way);
      ``num_prompt_tokens`` is the request's own prompt (``InputBatch.add_request``), also when a preempted
      request is re-added with its outputs to recompute (they are kept apart in ``output_token_ids``).
    * V2 (``vllm/v1/worker/gpu/``): ``RequestState.prompt_len`` per request state (``states.py``: "prompt_len:
      Number of tokens in the user-provided prompt ... in cases such as resumption after preemption, prefill_len
      may be greater"), and the metadata's ``req_idx`` maps the step's requests to those states
      (``model_states/default.py`` passes ``req_idx=input_batch.idx_mapping_np``)."""
    if _v1_prompt_lens is not None:
        return _v1_prompt_lens[:num_reqs].tolist()
    req_idx = getattr(common, "req_idx", None)
    if _v2_prompt_lens is not None and req_idx is not None:
        return _v2_prompt_lens[req_idx[:num_reqs]].tolist()
    raise RuntimeError(
        "exact K/V: vLLM built fast-prefill metadata outside a model-runner step the SwiftKV plugin reads prompt "
        "lengths from (to resolve, use a vLLM version in the tested range, docs/serving.md)"
    )


def _read_prompt_lens_from_runners() -> None:
    """Wrap, once, the model-runner methods that precede the upper layers' metadata, to record the prompt lengths
    ``step_prompt_lens`` reads: V1's ``_build_attention_metadata`` (the input batch's ``num_prompt_tokens`` while
    it runs) and, when vLLM loaded it, V2's ``prepare_inputs`` (``req_states.prompt_len``)."""
    build = V1ModelRunner._build_attention_metadata
    if not getattr(build, "swiftkv_prompts", False):

        @functools.wraps(build)
        def build_with_prompts(self, *args, **kwargs):
            global _v1_prompt_lens
            _v1_prompt_lens = self.input_batch.num_prompt_tokens
            try:
                return build(self, *args, **kwargs)
            finally:
                _v1_prompt_lens = None

        build_with_prompts.swiftkv_prompts = True
        V1ModelRunner._build_attention_metadata = build_with_prompts
    v2 = sys.modules.get("vllm.v1.worker.gpu.model_runner")  # imported by vLLM before it builds a V2 model
    runner = getattr(v2, "GPUModelRunner", None)
    if runner is not None and not getattr(runner.prepare_inputs, "swiftkv_prompts", False):
        prepare = runner.prepare_inputs

        @functools.wraps(prepare)
        def prepare_with_prompts(self, *args, **kwargs):
            global _v2_prompt_lens
            _v2_prompt_lens = self.req_states.prompt_len.np
            return prepare(self, *args, **kwargs)

        prepare_with_prompts.swiftkv_prompts = True
        runner.prepare_inputs = prepare_with_prompts


_active: weakref.ref[PromptWindow] | None = None


def use_prompt_window(window: PromptWindow | None) -> None:
    """Make ``window`` the rows rule of vLLM's fast prefill in this process (None: the logits rows, vLLM's own).

    vLLM's fast-prefill builder calls ``make_kv_sharing_fast_prefill_common_attn_metadata`` through its module, so
    the first call wraps that function once; the wrapper applies the window of the SwiftKV model built last in the
    process while that model lives (one engine per process, as vLLM serves; the tests start several in turn)."""
    global _active
    if window is not None:
        _read_prompt_lens_from_runners()
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
