"""SwiftKV Llama (and Qwen2, which is Llama with q/k/v biases) for vLLM, composed from vLLM's Llama modules.

Layout of the KV caches: every AcrossKV group (leader layer ``j``) owns one vLLM ``Attention`` at
``model.swiftkv_kv.{j}`` that holds the group's cache, and the attention of every layer >= l is a KV-sharing
layer reading that cache (``kv_sharing_target_layer_name``).  So a group of g layers stores one K/V (the
AcrossKV memory saving), and the holders are built before the decoder layers, which makes layers l..L-1
the KV-sharing tail that vLLM's ``kv_sharing_fast_prefill`` (YOCO) machinery recognises: it builds their
attention metadata for the logits rows only (``logits_indices`` of the runner, speculative tokens
included) and hands those indices to the model.

Forward: layers < l on all tokens; ``h = norm_swiftkv(x_l)``; K/V of every group from one fused matmul
on ``h``, RoPE, written into the holders' caches; then only the logits rows run layers >= l, with queries
from ``q_proj_swiftkv``.  Rows that skip the upper layers return unused placeholders (the runner reads
only the logits rows).  With fast prefill off every row runs the upper layers (same logits, no saving).

In teacher mode (``swiftkv: false``) this is vLLM's Llama; the SwiftKV weights are skipped at load.
In SwiftKV mode the teacher q/k/v projections of layers >= l are skipped (never used).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn
from vllm.compilation.decorators import ignore_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata

_SWIFTKV_WEIGHT = re.compile(r"layers\.(\d+)\.self_attn\.([qkv])_proj_swiftkv\.(weight|bias)$")
_TEACHER_QKV = re.compile(r"layers\.(\d+)\.self_attn\.[qkv]_proj\.(weight|bias)$")


class SwiftKVLayout:
    """Which layers are SwiftKV layers, their group leaders, and the checkpoint names that must exist."""

    def __init__(self, config):
        self.num_layers = config.num_hidden_layers
        self.first = config.num_key_value_layers if config.swiftkv else self.num_layers
        self.group_size = config.key_value_group_size
        self.leaders = list(range(self.first, self.num_layers, self.group_size))
        self.bias = bool(getattr(config, "qkv_bias", getattr(config, "attention_bias", False)))

    def leader_of(self, layer: int) -> int:
        return self.first + (layer - self.first) // self.group_size * self.group_size

    def required_weights(self) -> set[str]:
        """Checkpoint names (relative to ``model.``) of the SwiftKV weights the student path needs."""
        if not self.leaders:
            return set()
        kinds = ("weight", "bias") if self.bias else ("weight",)
        names = {"norm_swiftkv.weight"}
        for j in range(self.first, self.num_layers):
            projs = ("q", "k", "v") if j in self.leaders else ("q",)
            names |= {f"layers.{j}.self_attn.{p}_proj_swiftkv.{k}" for p in projs for k in kinds}
        return names


class SwiftKVLlamaAttention(nn.Module):
    """Attention of a layer >= l: queries from ``q_proj_swiftkv``; K/V already in the group's cache, so the
    vLLM ``Attention`` shares the holder's cache and never writes it."""

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
    ) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads
        self.max_position_embeddings = max_position_embeddings
        self.q_proj_swiftkv = ColumnParallelLinear(
            hidden_size, num_heads * self.head_dim, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.q_proj_swiftkv",
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, hidden_size, bias=bias_o_proj, quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )  # fmt: skip
        LlamaAttention._init_rotary_emb(self, config, quant_config)
        self.attn = Attention(
            num_heads // tp,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=max(1, num_kv_heads // tp),
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
            attn_type=attn_type,
            kv_sharing_target_layer_name=kv_source,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, _ = self.q_proj_swiftkv(hidden_states)
        q, _ = self.rotary_emb(positions, q, None)
        output, _ = self.o_proj(self.attn(q, None, None))
        return output


@ignore_torch_compile  # the logits rows are data-dependent; SwiftKV runs eager
class LlamaSwiftKVModel(LlamaModel):
    """vLLM's LlamaModel plus the K/V holders, ``norm_swiftkv``, the fused K/V projection, and the skip-ahead
    forward."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", layer_type=LlamaDecoderLayer):
        config = vllm_config.model_config.hf_config
        if get_pp_group().world_size > 1:
            raise ValueError(
                "SwiftKV checkpoints do not support pipeline parallelism; use tensor parallelism."
            )
        layout = SwiftKVLayout(config)
        tp = get_tensor_model_parallel_world_size()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = max(1, config.num_key_value_heads // tp)
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
            attn = partial(SwiftKVLlamaAttention, kv_source=source)
            return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix, attn_layer_type=attn)

        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=make_layer)
        self.layout = layout
        self.kv_size = kv_heads * head_dim
        if layout.leaders:
            self.swiftkv_kv = nn.ModuleDict(holders)
            self.norm_swiftkv = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.kv_proj_swiftkv = MergedColumnParallelLinear(
                config.hidden_size,
                [config.num_key_value_heads * head_dim] * (2 * len(layout.leaders)),
                bias=layout.bias,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.kv_proj_swiftkv",
            )

    # -- forward -------------------------------------------------------------------------------------
    def _write_swiftkv_cache(self, positions: torch.Tensor, x_l: torch.Tensor) -> None:
        """K/V of every group from ``norm_swiftkv(x_l)`` (one matmul), RoPE, into the holders' caches."""
        num_tokens, groups = x_l.shape[0], len(self.layout.leaders)
        kv, _ = self.kv_proj_swiftkv(self.norm_swiftkv(x_l))
        kv = kv.view(num_tokens, groups, 2, self.kv_size)
        keys = kv[:, :, 0].reshape(num_tokens, groups * self.kv_size)
        keys, _ = self.layers[self.layout.first].self_attn.rotary_emb(positions, keys, None)
        keys = keys.view(num_tokens, groups, self.kv_size)
        for g, j in enumerate(self.layout.leaders):
            holder = self.swiftkv_kv[str(j)]
            shape = (num_tokens, holder.num_kv_heads, holder.head_size)
            unified_kv_cache_update(keys[:, g].reshape(shape), kv[:, g, 1].reshape(shape), holder.layer_name)

    def _logits_rows(self) -> torch.Tensor | None:
        """The rows vLLM will compute logits for, when it built the upper layers' metadata for just them."""
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return None
        meta = attn_metadata.get(self.layers[-1].self_attn.attn.layer_name)
        if not isinstance(meta, KVSharingFastPrefillMetadata) or meta.num_logits_indices is None:
            return None
        return meta.logits_indices_padded[: meta.num_logits_indices].long()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if not self.layout.leaders:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers[: self.layout.first]:
            hidden, residual = layer(positions, hidden, residual)
        x_l = hidden + residual
        self._write_swiftkv_cache(positions, x_l)
        rows = self._logits_rows()
        if rows is not None:
            hidden, residual, positions = hidden[rows], residual[rows], positions[rows]
        for layer in self.layers[self.layout.first :]:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        if rows is None:
            return hidden
        return x_l.index_copy_(0, rows, hidden)  # non-logits rows: placeholders, never read

    # -- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route the SwiftKV weights (k/v fused into ``kv_proj_swiftkv``), skip the unused ones, hand the rest to
        vLLM's Llama loader, then refuse a checkpoint that lacks a SwiftKV weight, by name."""
        layout, seen, loaded = self.layout, set(), set()
        params = dict(self.named_parameters())

        def load(name: str, tensor: torch.Tensor, target: str, *shard) -> None:
            param = params[target]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, *shard)
            seen.add(name)
            loaded.add(target)

        def others():
            for name, tensor in weights:
                swift = _SWIFTKV_WEIGHT.search(name)
                if not layout.leaders:  # teacher mode: the SwiftKV weights are not used
                    if swift is None and "norm_swiftkv" not in name:
                        yield name, tensor
                elif name == "norm_swiftkv.weight":
                    load(name, tensor, name)
                elif swift is not None:
                    j, proj, kind = int(swift[1]), swift[2], swift[3]
                    if proj == "q":
                        load(name, tensor, f"layers.{j}.self_attn.q_proj_swiftkv.{kind}")
                    elif j in layout.leaders:
                        shard = 2 * layout.leaders.index(j) + (proj == "v")
                        load(name, tensor, f"kv_proj_swiftkv.{kind}", shard)
                elif (teacher := _TEACHER_QKV.search(name)) is None or int(teacher[1]) < layout.first:
                    yield name, tensor

        loaded |= super().load_weights(others())
        missing = sorted(layout.required_weights() - seen)
        if missing:
            raise ValueError(
                f"SwiftKV checkpoint lacks {len(missing)} SwiftKV weight(s): model.{missing[0]}"
                + (f" (and {', '.join(missing[1:4])}...)" if len(missing) > 1 else "")
                + '. To resolve, re-create it with `swiftkv convert` or set "swiftkv": false in config.json.'
            )
        return loaded


class LlamaSwiftKVForCausalLM(LlamaForCausalLM):
    """vLLM's LlamaForCausalLM on the SwiftKV model (architecture name of our checkpoints)."""

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type=LlamaDecoderLayer):
        return LlamaSwiftKVModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


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
