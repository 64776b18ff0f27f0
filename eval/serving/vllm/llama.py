"""SwiftKV Llama (and Qwen2, Qwen3) for vLLM, composed from vLLM's Llama/Qwen3 modules.

Layout of the KV caches: every AcrossKV group (leader layer ``j``) owns one vLLM ``Attention`` at
``model.swiftkv_kv.{j}`` that holds the group's cache, and the attention of every layer >= l is a KV-sharing
layer reading that cache (``kv_sharing_target_layer_name``).  So a group of g layers stores one K/V (the
AcrossKV memory saving), and the holders are built before the decoder layers, which makes layers l..L-1
the KV-sharing tail that vLLM's ``kv_sharing_fast_prefill`` (YOCO) machinery recognises: it builds their
attention metadata for the logits rows only (``logits_indices`` of the runner, speculative tokens
included) and hands those indices to the model.

Forward, in two compiled units (``@support_torch_compile``, as vLLM's YOCO model gemma3n splits its self- and
cross-decoder): the prefill stack runs layers < l on all tokens, then ``h = norm_swiftkv(x_l)``, the K/V of every
group from one fused matmul on ``h``, RoPE, written into the holders' caches; outside the compiled code the
logits rows are gathered (their number is data-dependent); the decode stack runs layers >= l on those rows with
queries from ``q_proj_swiftkv``.  Rows that skip the upper layers return unused placeholders (the runner reads
only the logits rows).  With fast prefill off (EAGLE) every row runs the upper layers (same logits, no saving).

CUDA graphs (vLLM's default on GPUs) replay each compiled unit's pieces on the memory they were captured with,
chosen by the step's ``batch_descriptor`` alone; vLLM's graph wrapper copies no inputs.  So, as vLLM's YOCO models
do (gemma3n, gemma4 ``fast_prefill_forward``), the decode stack always reads static buffers allocated once
(``max_num_batched_tokens`` rows) with its rows at offset 0, and runs under a batch descriptor of the row count
it is given (the runner pads the logits rows to a captured size); the prefill stack's outputs, which vLLM hands
back as weak references into graph memory the decode stack may reuse, are copied before the decode stack runs.

Exact K/V (``exact_kv_window = W >= 1``, g = 1): the rows the decode stack runs store their own K/V in each
layer's holder before its attention reads it (``exact.py``); those rows are, by absolute position, each request's
positions >= prompt_len - W (its prompt's last W tokens and every token it generated), whatever the chunking,
batching, preemption or prefix-cache state (a chunk before its window runs only its logits row and writes
nothing).

In teacher mode (``swiftkv: false``) the model is vLLM's own (compiled) Llama; the SwiftKV weights are skipped
at load.  In SwiftKV mode the teacher q/k/v projections of layers >= l are skipped (never used), except the
teacher k/v (and Qwen3's k_norm) with exact K/V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from vllm.config import VllmConfig

from eval.serving.vllm import fast_prefill_refusal
from eval.serving.vllm.exact import SLOTS, PromptWindow, attend_after, use_prompt_window, write_exact_kv
from eval.serving.vllm.internals import (
    Attention,
    ColumnParallelLinear,
    CUDAGraphMode,
    KVSharingFastPrefillMetadata,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    MergedColumnParallelLinear,
    Qwen3DecoderLayer,
    RMSNorm,
    RowParallelLinear,
    default_weight_loader,
    encode_layer_name,
    get_forward_context,
    get_pp_group,
    get_tensor_model_parallel_world_size,
    ignore_torch_compile,
    is_breakable_cudagraph_enabled,
    set_model_tag,
    support_torch_compile,
    unified_kv_cache_update,
)
from eval.serving.vllm.layout import SwiftKVLayout, captured_sizes, kv_head_slice, kv_head_split

ROWS = {0: "rows"}  # the one dynamic dimension of a compiled unit's tensors: tokens, or logits rows


class KVFanoutLinear(MergedColumnParallelLinear):
    """K and V of every AcrossKV group from one input (the fused SwiftKV projection), shards ``[k_0, v_0, k_1, ...]``.

    KV heads are split over tensor-parallel ranks by vLLM's QKVParallelLinear rule (``layout.kv_head_slice``):
    with more ranks than KV heads each rank holds one whole head, shared by ``tp // kv_heads`` ranks, so rank r
    loads the checkpoint slice of its head, not of its rank (MergedColumnParallelLinear alone would cut a head
    in pieces)."""

    def __init__(self, hidden_size: int, head_dim: int, total_kv_heads: int, groups: int, **kwargs):
        tp = get_tensor_model_parallel_world_size()
        self.total_kv_heads = total_kv_heads
        self.num_kv_heads, _ = kv_head_split(total_kv_heads, tp)
        super().__init__(hidden_size, [self.num_kv_heads * head_dim * tp] * (2 * groups), **kwargs)

    def _head_rank(self, rank: int) -> int:
        """The rank whose slice of the checkpoint the base loaders should narrow to: the one of rank's heads."""
        return kv_head_slice(rank, self.total_kv_heads, self.tp_size).start // self.num_kv_heads

    @contextmanager
    def _as_head_rank(self, param):
        """Let the base loaders narrow the checkpoint at this rank's heads, not at its rank."""
        rank, param_rank = self.tp_rank, getattr(param, "tp_rank", None)
        self.tp_rank = self._head_rank(rank)
        if param_rank is not None:
            param.tp_rank = self._head_rank(param_rank)
        try:
            yield
        finally:
            self.tp_rank = rank
            if param_rank is not None:
                param.tp_rank = param_rank

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        with self._as_head_rank(param):
            super().weight_loader(param, loaded_weight, loaded_shard_id)

    def weight_loader_v2(self, param, loaded_weight, loaded_shard_id=None):
        with self._as_head_rank(param):
            super().weight_loader_v2(param, loaded_weight, loaded_shard_id)


class SwiftKVLlamaAttention(nn.Module):
    """Attention of a layer >= l: queries from ``q_proj_swiftkv`` (Qwen3: then ``q_norm_swiftkv`` per head); K/V
    already in the group's cache, so the vLLM ``Attention`` shares the holder's cache and never writes it.  With
    an ``exact_holder`` (exact K/V), the rows it runs first overwrite their own slots in the holder with the layer's exact K/V (the
    teacher's k/v in one fused ``exact_kv_proj``; Qwen3: its ``exact_k_norm`` per head; RoPE)."""

    def __init__(
        self,
        *,
        config,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position_embeddings: int = 8192,
        quant_config=None,
        bias: bool = False,
        bias_o_proj: bool = False,
        cache_config=None,
        prefix: str = "",
        attn_type: str = "decoder",
        kv_source: str,
        qk_norm: bool = False,
        exact_holder: Attention | None = None,
    ) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads
        self.max_position_embeddings = max_position_embeddings
        self.q_proj_swiftkv = ColumnParallelLinear(
            hidden_size, num_heads * self.head_dim, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.q_proj_swiftkv",
        )  # fmt: skip
        self.q_norm_swiftkv = RMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, hidden_size, bias=bias_o_proj, quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )  # fmt: skip
        LlamaAttention._init_rotary_emb(self, config, quant_config)
        self.attn = Attention(
            num_heads // tp,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=kv_head_split(num_kv_heads, tp)[0],
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
            attn_type=attn_type,
            kv_sharing_target_layer_name=kv_source,
        )
        self.exact_kv_proj = self.exact_k_norm = None
        if exact_holder is not None:
            self.exact_kv_proj = KVFanoutLinear(
                hidden_size, self.head_dim, num_kv_heads, 1, bias=bias, quant_config=quant_config,
                prefix=f"{prefix}.exact_kv_proj",
            )  # fmt: skip
            self.exact_k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None
            # referenced, not registered: the holder's scales keep their checkpoint names
            self._holder = [exact_holder]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, _ = self.q_proj_swiftkv(hidden_states)
        if self.q_norm_swiftkv is not None:
            q = self.q_norm_swiftkv(q.view(*q.shape[:-1], -1, self.head_dim)).view(q.shape)
        if self.exact_kv_proj is None:
            q, _ = self.rotary_emb(positions, q, None)
            output, _ = self.o_proj(self.attn(q, None, None))
            return output
        kv, _ = self.exact_kv_proj(hidden_states)
        k, v = kv.chunk(2, dim=-1)
        if self.exact_k_norm is not None:
            k = self.exact_k_norm(k.reshape(*k.shape[:-1], -1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        written = write_exact_kv(k, v, self._holder[0])
        output, _ = self.o_proj(attend_after(self.attn, q, written))
        return output


class _Stack(nn.Module):
    """A compiled unit over a slice of the SwiftKV model's layers (``support_torch_compile`` takes the
    ``vllm_config``); the model is referenced, not registered, so the weights keep their checkpoint names."""

    def __init__(self, *, model: LlamaSwiftKVModel):
        super().__init__()
        self._model = [model]


@support_torch_compile(dynamic_arg_dims={"input_ids": ROWS, "positions": ROWS, "inputs_embeds": ROWS})
class SwiftKVPrefillStack(_Stack):
    """Every token: embeddings, layers < l, and the K/V of every group written to its cache."""

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None
    ):
        model = self._model[0]
        hidden = inputs_embeds if inputs_embeds is not None else model.embed_input_ids(input_ids)
        residual, aux = None, []
        model._maybe_add_hidden_state(aux, 0, hidden, residual)
        for j, layer in enumerate(model.layers[: model.layout.first]):
            hidden, residual = layer(positions, hidden, residual)
            model._maybe_add_hidden_state(aux, j + 1, hidden, residual)
        writes = model.write_swiftkv_cache(positions, hidden + residual)
        return hidden, residual, writes, aux  # the cache writes are outputs, so the compiler keeps them


@support_torch_compile(dynamic_arg_dims={"positions": ROWS, "hidden_states": ROWS, "residual": ROWS})
class SwiftKVDecodeStack(_Stack):
    """The logits rows (all rows with fast prefill off): layers >= l and the final norm."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor):
        model, aux = self._model[0], []
        for j, layer in enumerate(model.layers[model.layout.first :], start=model.layout.first):
            hidden_states, residual = layer(positions, hidden_states, residual)
            model._maybe_add_hidden_state(aux, j + 1, hidden_states, residual)
        hidden_states, _ = model.norm(hidden_states, residual)
        return hidden_states, aux


@ignore_torch_compile  # the two stacks are the compiled units; the logits-row gather between them stays eager
class LlamaSwiftKVModel(LlamaModel):
    """vLLM's LlamaModel plus the K/V holders, ``norm_swiftkv``, the fused K/V projection, and the skip-ahead
    forward over the two compiled stacks."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", layer_type=LlamaDecoderLayer):
        config = vllm_config.model_config.hf_config
        if get_pp_group().world_size > 1:
            raise ValueError(
                "SwiftKV checkpoints do not support pipeline parallelism; use tensor parallelism."
            )
        layout = SwiftKVLayout(config)
        tp = get_tensor_model_parallel_world_size()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads, _ = kv_head_split(config.num_key_value_heads, tp)
        # The holders are built before the decoder layers: vLLM's fast prefill treats only the trailing run of
        # KV-sharing attention layers as skippable, and that run must be exactly layers l..L-1.
        holders = {
            str(j): Attention(
                config.num_attention_heads // tp,
                head_dim,
                head_dim**-0.5,
                num_kv_heads=kv_heads,
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.swiftkv_kv.{j}",
            )
            for j in layout.leaders
        }

        def make_layer(*, vllm_config: VllmConfig, prefix: str) -> nn.Module:
            j = int(prefix.rsplit(".", 1)[-1])
            if j < layout.first:
                return layer_type(vllm_config=vllm_config, prefix=prefix)
            source = f"{prefix.rsplit('.layers.', 1)[0]}.swiftkv_kv.{layout.leader_of(j)}"
            exact_holder = holders[str(j)] if layout.window else None  # W >= 1 needs g = 1: j is the leader
            attn = partial(
                SwiftKVLlamaAttention, kv_source=source, qk_norm=layout.qk_norm, exact_holder=exact_holder
            )
            return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix, attn_layer_type=attn)

        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=make_layer)
        self.layout = layout
        self.head_dim = head_dim
        self.kv_size = kv_heads * head_dim
        self.swiftkv_kv = nn.ModuleDict(holders)
        self.norm_swiftkv = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.kv_proj_swiftkv = KVFanoutLinear(
            config.hidden_size,
            head_dim,
            config.num_key_value_heads,
            len(layout.leaders),
            bias=layout.bias,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.kv_proj_swiftkv",
        )
        if layout.qk_norm:
            self.k_norm_swiftkv = nn.ModuleList(
                RMSNorm(head_dim, eps=config.rms_norm_eps) for _ in layout.leaders
            )
        with set_model_tag("swiftkv_prefill"):
            self.prefill_stack = SwiftKVPrefillStack(vllm_config=vllm_config, model=self)
        with set_model_tag("swiftkv_decode"):
            self.decode_stack = SwiftKVDecodeStack(vllm_config=vllm_config, model=self)
        backend = next(iter(holders.values())).attn_backend
        if backend.forward_includes_kv_cache_update:
            raise ValueError(
                f"the {backend.get_name()} attention backend writes the KV cache inside attention, so SwiftKV cannot "
                "write layers >= l's K/V ahead of it (to resolve, pick another backend with --attention-backend, "
                "e.g. FLASH_ATTN)"
            )
        refusal = fast_prefill_refusal(vllm_config, backend.get_name(), is_breakable_cudagraph_enabled())
        if refusal is not None:
            raise ValueError(refusal)
        # the decode stack's inputs, allocated once: CUDA graphs replay on the addresses they were captured with
        rows, device = vllm_config.scheduler_config.max_num_batched_tokens, self.embed_tokens.weight.device
        self.decode_positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.decode_hidden = torch.zeros(
            rows, config.hidden_size, dtype=vllm_config.model_config.dtype, device=device
        )
        self.decode_residual = torch.zeros_like(self.decode_hidden)
        # read when used, never copied: vLLM's V1 runner rewrites the capture sizes after the model is built
        # (multiples of 1 + num_speculative_tokens under speculation, CompilationConfig.
        # adjust_cudagraph_sizes_for_spec_decode), and a copy would miss most of the sizes it then captures
        self.compilation_config = vllm_config.compilation_config
        # exact K/V: the slots of the decode stack's rows, which every layer >= l writes its exact K/V at
        self.decode_slots = None
        if layout.window:
            self.decode_slots = torch.full((rows,), -1, dtype=torch.long, device=device)
            for holder in holders.values():
                setattr(holder, SLOTS, self.decode_slots)
        window = None
        if layout.window:
            window = PromptWindow(layout.window, rows, self.compilation_config, device)
        self.prompt_window = window  # held here: the rule applies while this model lives
        use_prompt_window(window)

    # -- forward -------------------------------------------------------------------------------------
    def write_swiftkv_cache(self, positions: torch.Tensor, x_l: torch.Tensor) -> list[torch.Tensor]:
        """K/V of every group from ``norm_swiftkv(x_l)`` (one matmul), RoPE, into the holders' caches; returns
        the cache-update ops' (empty) results."""
        num_tokens, groups = x_l.shape[0], len(self.layout.leaders)
        kv, _ = self.kv_proj_swiftkv(self.norm_swiftkv(x_l))
        kv = kv.view(num_tokens, groups, 2, self.kv_size)
        keys = kv[:, :, 0]
        if self.layout.qk_norm:
            heads = keys.reshape(num_tokens, groups, -1, self.head_dim)
            keys = torch.stack([norm(heads[:, g]) for g, norm in enumerate(self.k_norm_swiftkv)], dim=1)
        keys, _ = self.layers[self.layout.first].self_attn.rotary_emb(
            positions, keys.reshape(num_tokens, groups * self.kv_size), None
        )
        keys = keys.view(num_tokens, groups, self.kv_size)
        writes = []
        for g, j in enumerate(self.layout.leaders):
            holder = self.swiftkv_kv[str(j)]
            shape = (num_tokens, holder.num_kv_heads, holder.head_size)
            k, v = keys[:, g].reshape(shape), kv[:, g, 1].reshape(shape)
            if holder.use_direct_call:
                writes.append(unified_kv_cache_update(k, v, holder.layer_name))
            else:
                writes.append(
                    torch.ops.vllm.unified_kv_cache_update(k, v, encode_layer_name(holder.layer_name))
                )
        return writes

    def _decode_rows(self, num_tokens: int) -> tuple[torch.Tensor | None, int, torch.Tensor | None]:
        """The rows that go through layers >= l: the rows vLLM built the upper layers' attention metadata for (the
        logits rows; with exact K/V the rows of ``PromptWindow``), padded to a captured batch size (the padding
        repeating the last row), and how many are real, or ``(None, num_tokens)`` for every row (fast prefill off
        or not armed this step, or every row needs logits); and, with exact K/V, which of the decode stack's rows
        write exact K/V (``PromptWindow.writes_for``; None: every row)."""
        attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, dict):
            meta = attn_metadata.get(self.layers[-1].self_attn.attn.layer_name)
            if isinstance(meta, KVSharingFastPrefillMetadata) and meta.num_logits_indices is not None:
                rows, n = meta.logits_indices_padded, meta.num_logits_indices
                window = self.prompt_window
                writes = None if window is None else window.writes_for(rows)
                if not n == len(rows) == num_tokens:
                    return rows.long(), n, writes
                return None, num_tokens, writes
        return None, num_tokens, None

    def _gather_exact_slots(
        self, rows: torch.Tensor | None, n: int, size: int, writes: torch.Tensor | None
    ) -> None:
        """The cache slots of the decode stack's ``size`` rows (``rows[:n]``, or every row) into the static
        ``decode_slots``, which the exact K/V writes read; -1 (written nowhere) for padding rows, for the rows
        ``writes`` marks 0 (a chunk's logits row before its window: its K/V stay SwiftKV), and for every row when
        the step has no slots (vLLM's memory-profiling run).  The holders have one KV-cache spec, so vLLM puts them
        in one KV-cache group with one slot mapping."""
        mapping = get_forward_context().slot_mapping
        source = mapping.get(next(iter(self.swiftkv_kv.values())).layer_name) if mapping else None
        slots = self.decode_slots[:size]
        if source is None:
            slots.fill_(-1)
            return
        if rows is None:
            slots.copy_(source[:size])
        else:
            torch.index_select(source, 0, rows, out=slots)
            slots[n:].fill_(-1)
        if writes is not None:
            slots.masked_fill_(writes == 0, -1)

    @contextmanager
    def _graph_batch(self, size: int):
        """Run the decode stack as a batch of ``size`` rows for vLLM's piecewise CUDA graphs, which pick the graph
        to replay by the forward context's batch descriptor (the whole step's token count); without a graph
        captured for ``size``, that stack runs without graphs this step."""
        context = get_forward_context()
        descriptor, mode = context.batch_descriptor, context.cudagraph_runtime_mode
        if descriptor is not None and descriptor.num_tokens != size:
            context.batch_descriptor = dataclasses.replace(descriptor, num_tokens=size)
            if mode == CUDAGraphMode.PIECEWISE and size not in captured_sizes(self.compilation_config):
                context.cudagraph_runtime_mode = CUDAGraphMode.NONE
        try:
            yield
        finally:
            context.batch_descriptor, context.cudagraph_runtime_mode = descriptor, mode

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        hidden, residual, _, aux = self.prefill_stack(input_ids, positions, inputs_embeds)
        # The prefill stack's outputs are weak references into its last graph's memory, which the decode stack's
        # graphs may reuse: what is read after the decode stack runs is copied before it does.
        aux = [a.clone() for a in aux]
        rows, n, writes = self._decode_rows(len(positions))
        size = len(positions) if rows is None else len(rows)
        if size > len(self.decode_hidden):
            raise ValueError(
                f"a step of {size} rows exceeds the SwiftKV decode buffers ({len(self.decode_hidden)} rows, "
                "max_num_batched_tokens)"
            )
        inputs = (self.decode_positions[:size], self.decode_hidden[:size], self.decode_residual[:size])
        if rows is None:
            for buffer, value in zip(inputs, (positions, hidden, residual), strict=True):
                buffer.copy_(value)
        else:
            for buffer, value in zip(inputs, (positions, hidden, residual), strict=True):
                torch.index_select(value, 0, rows, out=buffer)
            placeholders = (
                hidden.clone()
            )  # rows that skip the upper layers return their layer-l state (unread)
        if self.decode_slots is not None:
            self._gather_exact_slots(rows, n, size, writes)
        with self._graph_batch(size):
            out, upper_aux = self.decode_stack(*inputs)
        if rows is not None:
            kept = rows[:n]
            out = placeholders.index_copy_(0, kept, out[:n])
            upper_aux = [torch.zeros_like(out).index_copy_(0, kept, a[:n]) for a in upper_aux]
        aux = aux + upper_aux
        return (out, aux) if aux else out

    # -- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route the SwiftKV tensors (k/v fused into ``kv_proj_swiftkv``, quantization tensors alike), skip the
        unused ones, hand the rest to vLLM's Llama loader, then refuse a checkpoint that lacks a SwiftKV weight,
        by name."""
        layout, seen, loaded = self.layout, set(), set()
        params = dict(self.named_parameters())

        def others():
            for name, tensor in weights:
                route = layout.route(name)
                if route is None:
                    continue
                if not route.target:
                    yield name, tensor
                    continue
                if route.target not in params:
                    raise ValueError(
                        f"checkpoint tensor model.{name} has no parameter model.{route.target} in the vLLM model "
                        "(to resolve, serve with the quantization the checkpoint was made for)"
                    )
                param = params[route.target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor, *(() if route.shard is None else (route.shard,)))
                seen.add(name)
                loaded.add(route.target)

        loaded |= super().load_weights(others())
        self._share_kv_cache_scales(loaded)
        missing = sorted(layout.required_weights() - seen)
        if missing:
            raise ValueError(
                f"SwiftKV checkpoint lacks {len(missing)} SwiftKV weight(s): model.{missing[0]}"
                + (f" (and {', '.join(missing[1:4])}...)" if len(missing) > 1 else "")
                + '. To resolve, re-create it with `swiftkv convert` or set "swiftkv": false in config.json.'
            )
        return loaded

    def _share_kv_cache_scales(self, loaded: set[str]) -> None:
        """One FP8 scale pair per group cache: its holder quantizes K/V with it when writing, and every layer of
        the group dequantizes with it when reading.  A checkpoint carries the scales on the SwiftKV projection
        (``k_proj_swiftkv.k_scale``, loaded into the holder) or on each layer's attention (``self_attn.k_scale``,
        loaded into that layer): the whole group takes the largest one the checkpoint gives (``loaded``)."""
        params = dict(self.named_parameters())
        for j in self.layout.leaders:
            members = range(j, j + self.layout.group_size)
            for name in ("k_scale", "v_scale"):
                group = [f"swiftkv_kv.{j}.{name}", *(f"layers.{i}.self_attn.attn.{name}" for i in members)]
                if any(n not in params for n in group):  # no quantized KV cache
                    continue
                given = [params[n].data.reshape(()) for n in group if n in loaded]
                if given:
                    value = torch.stack(given).max()
                    for n in group:
                        params[n].data.copy_(value)


class LlamaSwiftKVForCausalLM(LlamaForCausalLM):
    """vLLM's LlamaForCausalLM on the SwiftKV model (architecture name of our checkpoints); in teacher mode on
    vLLM's own LlamaModel."""

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type=LlamaDecoderLayer):
        self.layout = SwiftKVLayout(vllm_config.model_config.hf_config)
        if not self.layout.leaders:
            return LlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        return LlamaSwiftKVModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if not self.layout.leaders:  # teacher mode: the SwiftKV tensors are not used
            weights = ((n, w) for n, w in weights if self.layout.route(n.removeprefix("model.")) is not None)
        return super().load_weights(weights)


class Qwen2SwiftKVForCausalLM(LlamaSwiftKVForCausalLM):
    """Qwen2 is Llama with biases on q/k/v (not on o_proj): vLLM's Llama layers read that from ``qkv_bias``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs):
        config = vllm_config.model_config.hf_config
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                "Qwen2 SwiftKV checkpoints with use_sliding_window=true are not supported by the plugin"
            )
        config.qkv_bias = True
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)


def _qwen3_layer(*, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    return Qwen3DecoderLayer(
        vllm_config.model_config.hf_config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix
    )


class Qwen3SwiftKVForCausalLM(LlamaSwiftKVForCausalLM):
    """Qwen3 is Llama with an RMSNorm over every query and key head before RoPE: vLLM's Qwen3 layers below l;
    the SwiftKV layers normalize their queries with ``q_norm_swiftkv`` and each group its keys with
    ``k_norm_swiftkv`` (the transformers model's semantics)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs):
        config = vllm_config.model_config.hf_config
        for name in ("attention_bias", "use_sliding_window"):
            if getattr(config, name, False):
                raise ValueError(
                    f"Qwen3 SwiftKV checkpoints with {name}=true are not supported by the plugin"
                )
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type=LlamaDecoderLayer):
        return super()._init_model(vllm_config, prefix, layer_type=_qwen3_layer)
