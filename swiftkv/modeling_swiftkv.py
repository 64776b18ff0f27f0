"""SwiftKV models composed from transformers' own Llama/Qwen2/Qwen3 classes.

What differs from the base family is only this:

* layers ``j >= l`` (``l = config.num_key_value_layers``) get ``q_proj_swiftkv``; each AcrossKV group leader
  also gets ``k_proj_swiftkv``/``v_proj_swiftkv``; the model gets ``norm_swiftkv``; families with per-head
  query/key norms (Qwen3) get ``q_norm_swiftkv`` per layer and ``k_norm_swiftkv`` per leader, as the
  reference training code's Qwen3 model does;
* in SwiftKV mode (``config.swiftkv``) the K/V of every later layer come from ``h = norm_swiftkv(x_l)``, where
  ``x_l`` is the input of layer ``l``; queries use ``q_proj_swiftkv`` on the layer's own normed input.

One forward serves training and inference.  Tokens run layers ``< l``; then the K/V of all later groups are
computed from ``h`` (at inference in one fused matmul per device) and written into the cache once per group (the leader's slot, so
AcrossKV really stores one K/V per group); then only the tokens whose logits are wanted (``logits_to_keep``,
which ``generate()`` sets to 1) continue through layers ``>= l``.  Without ``logits_to_keep`` every token
continues (the training path), which gives the same numbers at the kept positions.  The kept rows get their
own mask in every backend's format (``_mask_for_last_rows``).

Multi-device and offloaded weights: the group K/V are computed per device (one fused matmul per device when
the weights are materialized, else by calling each projection module, so that accelerate's offload hooks
and DeepSpeed ZeRO-3 can materialize the weights inside the module's forward), and each group's K/V stay on
its leader's device.

Exact K/V (``config.exact_kv_window = W >= 1``): the tokens that run layers ``>= l`` store exact K/V there,
the layer's original ``k_proj``/``v_proj`` on its own normed input.  In cached generation a forward with logits for its
last k rows (``logits_to_keep``; the k - 1 before the last are speculative tokens) writes SwiftKV K/V for all
but its last ``E = k - 1 + W`` tokens, and those E tokens run layers ``>= l`` and append their exact K/V in
each: decode and speculative tokens, and the last W prompt tokens of a prefill.  A prompt fed over several
forwards (chunked prefill) passes ``swiftkv_prompt_len = P``, so that exactly the slots >= P - W are exact in
whichever forward they arrive (``generate()`` passes it with ``prefill_chunk_size`` and ``use_cache=False``).
A full teacher-forced forward runs every position through every layer, so it takes the positions that count as run
there from an explicit mask (``swiftkv_exact_mask``; ``exact_kv_positions`` builds it from a loss mask);
without one it treats the input as one prompt (its last W positions exact).

In teacher mode (``swiftkv=False``) the model is exactly the original.  ``teacher_student_hidden`` runs the
shared lower layers once and both upper paths, which is what distillation needs.

This file travels with every checkpoint for ``trust_remote_code`` loading: it imports only torch,
transformers and the sibling configuration file.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from itertools import groupby

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    eager_attention_forward,
    rotate_half,
)
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2ForCausalLM,
    Qwen2Model,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3ForCausalLM,
    Qwen3Model,
)
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_swiftkv import LlamaSwiftKVConfig, Qwen2SwiftKVConfig, Qwen3SwiftKVConfig


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on one tensor of shape [batch, heads, seq, head_dim] (cos/sin: [batch, seq, head_dim])."""
    cos, sin = cos.to(x.device).unsqueeze(1), sin.to(x.device).unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _materialized(linear: nn.Linear) -> bool:
    """Whether the weight is really there outside the module's forward (not on ``meta`` as under accelerate's
    offload hooks, not an empty ZeRO-3 partition)."""
    weight = linear.weight
    return weight.device.type != "meta" and weight.shape == (linear.out_features, linear.in_features)


class SwiftKVAttentionMixin:
    """Adds the SwiftKV projections to a base attention and a forward that takes precomputed K/V."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        l, g = config.num_key_value_layers, config.key_value_group_size
        if layer_idx < l:
            return
        head_norm = getattr(self, "q_norm", None)  # Qwen3: RMSNorm over each head before RoPE

        def like(module: nn.Module) -> nn.Module:
            if isinstance(module, nn.Linear):
                return nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            return type(module)(self.head_dim, eps=config.rms_norm_eps)

        self.q_proj_swiftkv = like(self.q_proj)
        if head_norm is not None:
            self.q_norm_swiftkv = like(head_norm)
        if (layer_idx - l) % g == 0:
            self.k_proj_swiftkv, self.v_proj_swiftkv = like(self.k_proj), like(self.v_proj)
            if head_norm is not None:
                self.k_norm_swiftkv = like(self.k_norm)

    def swiftkv_key_value(self, key, value, position_embeddings):
        """A leader's group K/V [batch, kv_heads, seq, head_dim] from its projections' outputs [batch, seq, -1]."""
        shape = (*key.shape[:-1], -1, self.head_dim)
        key, value = key.view(shape), value.view(shape)
        if hasattr(self, "k_norm_swiftkv"):
            key = self.k_norm_swiftkv(key)
        return _apply_rope(key.transpose(1, 2), *position_embeddings), value.transpose(1, 2)

    def exact_key_value(self, hidden_states, position_embeddings):
        """The layer's original K/V [batch, kv_heads, seq, head_dim] of its normed input (with RoPE; Qwen3: k_norm)."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        key, value = self.k_proj(hidden_states).view(shape), self.v_proj(hidden_states).view(shape)
        if hasattr(self, "k_norm"):
            key = self.k_norm(key)
        return _apply_rope(key.transpose(1, 2), *position_embeddings), value.transpose(1, 2)

    def forward(
        self,
        hidden_states,
        position_embeddings,
        attention_mask,
        cache=None,
        swiftkv_kv=None,
        exact_kv_mask=None,
        exact_kv_rows=None,
        exact_kv_index=None,
        **kwargs,
    ):
        """``swiftkv_kv``: the group's SwiftKV K/V of every key position; ``exact_kv_mask`` [batch, kv] then swaps
        in this layer's exact K/V where True (teacher-forced: every position runs this layer).  With
        ``exact_kv_index`` [rows] the hidden states are only some rows of the sequence (``student_rows_hidden``):
        row i swaps its exact K/V in at key position ``exact_kv_index[i]`` (-1: it keeps the SwiftKV K/V).  With
        ``exact_kv_rows = E`` (generation), ``swiftkv_kv`` holds the SwiftKV K/V of this forward's positions
        before its last E (or is None) and the last E rows add their exact K/V: the layer then stores this
        forward's K/V in the cache itself, once, as an ordinary layer does."""
        if swiftkv_kv is None and exact_kv_rows is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj_swiftkv(hidden_states).view(*input_shape, -1, self.head_dim)
        if hasattr(self, "q_norm_swiftkv"):
            query = self.q_norm_swiftkv(query)
        query = _apply_rope(query.transpose(1, 2), *position_embeddings)
        if exact_kv_rows is not None:
            cos, sin = position_embeddings
            rows = slice(-exact_kv_rows, None)
            key, value = self.exact_key_value(hidden_states[:, rows], (cos[:, rows], sin[:, rows]))
            if swiftkv_kv is not None:
                key, value = torch.cat([swiftkv_kv[0], key], -2), torch.cat([swiftkv_kv[1], value], -2)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
        else:
            key, value = swiftkv_kv
            if exact_kv_mask is not None:
                exact_key, exact_value = self.exact_key_value(hidden_states, position_embeddings)
                swap = exact_kv_mask[:, None, :, None].to(key.device)
                key, value = torch.where(swap, exact_key, key), torch.where(swap, exact_value, value)
            elif exact_kv_index is not None and bool((exact_kv_index >= 0).any()):
                take = exact_kv_index >= 0
                cos, sin = position_embeddings
                exact_key, exact_value = self.exact_key_value(
                    hidden_states[:, take], (cos[:, take], sin[:, take])
                )
                at = exact_kv_index[take].to(key.device)
                key, value = key.index_copy(2, at, exact_key), value.index_copy(2, at, exact_value)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class SwiftKVDecoderLayerMixin:
    """A base decoder layer whose attention is the family's SwiftKV attention (the forward is unchanged: it
    passes ``swiftkv_kv`` through its keyword arguments to the attention)."""

    attention_class: type[nn.Module]

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = self.attention_class(config, layer_idx)


@dataclass
class _Prepared:
    """Per-forward state shared by the lower and upper layers.  ``kept_rows_mask``: the mask to cut for the last
    rows when fewer rows than the block go on (sdpa's ``is_causal`` is top-left aligned, wrong for them), while
    the full block keeps ``attention_mask`` (``None``: sdpa's ``is_causal``, its fast kernel)."""

    hidden_states: torch.Tensor
    attention_mask: torch.Tensor | BlockMask | None
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    position_ids: torch.Tensor
    cache: Cache | None
    kept_rows_mask: torch.Tensor | BlockMask | None = None


def _mask_for_last_rows(mask, rows: int):
    """The mask of the last ``rows`` query rows, in the format of each backend.

    sdpa/eager: a 4-D [batch, 1, q, kv] tensor, cut along q.  FlashAttention: a 2-D [batch, kv] padding mask,
    or None, both per key (FlashAttention aligns the queries bottom-right itself), so unchanged.  flex: a
    BlockMask rebuilt for the last rows.  None from sdpa means ``is_causal`` (the caller allows it only where
    it is still right for the kept rows).
    """
    if isinstance(mask, BlockMask):
        q_len, kv_len = mask.seq_lengths
        mask_mod, offset = mask.mask_mod, q_len - rows

        def last_rows(batch, head, q_idx, kv_idx):
            return mask_mod(batch, head, q_idx + offset, kv_idx)

        return create_block_mask(
            last_rows,
            B=mask.kv_num_blocks.shape[0],
            H=None,
            Q_LEN=rows,
            KV_LEN=kv_len,
            device=mask.kv_num_blocks.device,
            BLOCK_SIZE=mask.BLOCK_SIZE,
        )
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        return mask[:, :, -rows:]
    return mask


def exact_kv_positions(loss_mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """The positions of teacher-forced rows that run every layer when their replies are generated: [batch, seq]
    bool.

    ``loss_mask`` marks the positions whose logits are scored (the last prompt token and the reply tokens: each
    predicts the next token), ``position_ids`` restart at 0 for every packed sample.  Each run of scored positions
    is one reply; the ``window - 1`` positions before it (inside its sample) are the rest of the prefill window
    (``exact_kv_window``), which ends at the reply's first scored position, the last prompt token.
    """
    scored = loss_mask.bool()
    exact = scored.clone()
    starts = scored & (~torch.nn.functional.pad(scored[:, :-1], (1, 0)) | (position_ids == 0))
    for back in range(1, window):
        shifted = torch.zeros_like(starts)
        shifted[:, :-back] = starts[:, back:] & (position_ids[:, back:] >= back)
        exact |= shifted
    return exact


class SwiftKVModelMixin:
    """The base family's model with ``norm_swiftkv`` and the skip-ahead forward."""

    decoder_layer_class: type[nn.Module]

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm_swiftkv = type(self.norm)(config.hidden_size, eps=config.rms_norm_eps)
        self._fused_kv = None
        self.post_init()

    # -- the pieces ------------------------------------------------------------------------------------
    @property
    def kv_leaders(self) -> list[nn.Module]:
        """Attention modules that own a SwiftKV K/V projection (one per AcrossKV group)."""
        l, g = self.config.num_key_value_layers, self.config.key_value_group_size
        return [self.layers[j].self_attn for j in range(l, self.config.num_hidden_layers, g)]

    def _fused_kv_projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
        """(weight, bias, number of groups) per run of consecutive leaders on one device: every group's K and V
        weights stacked, for one matmul per device at inference.

        Cached; the cache is dropped on every train()/eval() switch and rebuilt when a weight's storage or
        version changes (load_state_dict, in-place edits).  Optimizers that write through aliases (DeepSpeed
        flat buffers) only run in training mode, where the cache is never used.
        """
        projs = [(attn.k_proj_swiftkv, attn.v_proj_swiftkv) for attn in self.kv_leaders]
        key = tuple((p.data_ptr(), p._version) for pair in projs for proj in pair for p in proj.parameters())
        if self._fused_kv is None or self._fused_kv[0] != key:
            fused = []
            for _, run in groupby(projs, key=lambda pair: pair[0].weight.device):
                run = [proj for pair in run for proj in pair]
                bias = torch.cat([p.bias for p in run]) if run[0].bias is not None else None
                fused.append((torch.cat([p.weight for p in run]), bias, len(run) // 2))
            self._fused_kv = (key, fused)
        return self._fused_kv[1]

    def train(self, mode: bool = True):
        self._fused_kv = None
        return super().train(mode)

    def _project_kv(self, h: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each group's K and V projections of ``h`` ([batch, seq, kv_heads * head_dim]), on its leader's device."""
        projs = [(attn.k_proj_swiftkv, attn.v_proj_swiftkv) for attn in self.kv_leaders]
        if (
            torch.is_grad_enabled()
            or self.training
            or not all(_materialized(p) for pair in projs for p in pair)
        ):
            # autograd, or weights that exist only inside their module's forward: call each module
            return [(k_proj(h), v_proj(h)) for k_proj, v_proj in projs]
        out = []
        for weight, bias, groups in self._fused_kv_projections():
            kv = nn.functional.linear(h.to(weight.device), weight, bias).chunk(2 * groups, -1)
            out += zip(kv[0::2], kv[1::2], strict=True)
        return out

    def swiftkv_key_values(
        self, x_l: torch.Tensor, prepared: _Prepared, tokens: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V for every AcrossKV group from the input of layer l (its first ``tokens`` positions, default all),
        written into the cache when there is one.

        Returns one (key, value) pair per group, each [batch, kv_heads, kv_len, head_dim] with RoPE applied,
        on the group leader's device.
        """
        if self.config.num_swiftkv_groups == 0:
            return []
        cos, sin = prepared.position_embeddings
        if tokens is not None:
            x_l, cos, sin = x_l[:, :tokens], cos[:, :tokens], sin[:, :tokens]
        h = self.norm_swiftkv(x_l)
        out = []
        for attn, (key, value) in zip(self.kv_leaders, self._project_kv(h), strict=True):
            key, value = attn.swiftkv_key_value(key, value, (cos, sin))
            if prepared.cache is not None:
                key, value = prepared.cache.update(key, value, attn.layer_idx)
            out.append((key, value))
        return out

    def _prepare(
        self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, rows_kept: int
    ):
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if isinstance(attention_mask, dict):  # generate() prebuilds masks per layer type for static caches
            attention_mask = attention_mask["full_attention"]
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (
                torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0) + past_seen
            )
        # sdpa's is_causal (mask None) is top-left aligned over all kv slots: right for the full block (the lower
        # layers), and for one kept row only when every kv slot is real (not the unwritten tail of a
        # StaticCache); several kept rows (an exact K/V window, speculative tokens) get an explicit mask of their
        # own, so the lower layers never pay for one
        masks = functools.partial(
            create_causal_mask,
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        mask = masks(allow_is_causal_skip=True)
        kept_rows_mask = mask
        one_row_causal = rows_kept == 1 and not getattr(cache, "is_compileable", False)
        if mask is None and rows_kept < inputs_embeds.shape[1] and not one_row_causal:
            kept_rows_mask = masks(allow_is_causal_skip=False)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)
        return _Prepared(inputs_embeds, mask, position_embeddings, position_ids, cache, kept_rows_mask)

    def _run(
        self, layers, hidden_states, prepared: _Prepared, kv=None, exact=None, exact_index=None, **kwargs
    ):
        """Run ``layers`` (a slice of self.layers).  ``kv`` holds the SwiftKV K/V per group when given, and
        ``exact`` either a [batch, seq] mask that swaps in each layer's exact K/V where True, or (generation) a
        number E of last rows that add their exact K/V to ``kv``, the SwiftKV K/V of the positions before them
        (None: none), and store both in the cache; ``exact_index`` instead: the hidden states are some rows of
        the sequence, each swapping its exact K/V in at that key position (-1: none) (``SwiftKVAttentionMixin.forward``)."""
        g, first = self.config.key_value_group_size, self.config.num_key_value_layers
        for layer in layers:
            group = None if kv is None else kv[(layer.self_attn.layer_idx - first) // g]
            if isinstance(exact, int):
                extra = {"swiftkv_kv": group, "exact_kv_rows": exact, "cache": prepared.cache}
            elif exact_index is not None:
                extra = {"swiftkv_kv": group, "exact_kv_index": exact_index, "cache": None}
            elif kv is not None:
                extra = {"swiftkv_kv": group, "exact_kv_mask": exact, "cache": None}
            else:
                extra = {"cache": prepared.cache}
            hidden_states = layer(
                hidden_states,
                attention_mask=prepared.attention_mask,
                position_embeddings=prepared.position_embeddings,
                position_ids=prepared.position_ids,
                **extra,
                **kwargs,
            )
        return hidden_states

    @staticmethod
    def _keep_last_rows(prepared: _Prepared, rows: int) -> _Prepared:
        cos, sin = prepared.position_embeddings
        return _Prepared(
            prepared.hidden_states[:, -rows:],
            _mask_for_last_rows(prepared.kept_rows_mask, rows),
            (cos[:, -rows:], sin[:, -rows:]),
            prepared.position_ids[..., -rows:],
            prepared.cache,
        )

    # -- entry points ------------------------------------------------------------------------------------
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        swiftkv_logits_to_keep: int | torch.Tensor = 0,
        swiftkv_exact_mask: torch.Tensor | None = None,
        swiftkv_prompt_len: int | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """As the base model's forward; with SwiftKV on and ``swiftkv_logits_to_keep = k > 0``, only the last k
        rows (with exact K/V: the last ``k - 1 + W``) go through layers >= l and ``last_hidden_state`` holds just
        those rows.  ``swiftkv_exact_mask`` [batch, seq]: the positions that take exact K/V in layers >= l, for a
        teacher-forced pass without a cache (module docstring).  ``swiftkv_prompt_len = P`` (cache slots, padding
        included): the request's prompt ends at slot P, so exactly the slots >= P - W are exact (the last W
        prompt tokens and every generated one) whichever forward they arrive in: a prompt over several chunks,
        or a pass without a cache over prompt + generated tokens; without it each forward ends a prompt."""
        inputs = input_ids if input_ids is not None else inputs_embeds
        seq_len = inputs.shape[1]
        config, exact_mask = self.config, swiftkv_exact_mask
        keep = swiftkv_logits_to_keep if isinstance(swiftkv_logits_to_keep, int) else 0
        if exact_mask is not None and config.swiftkv:
            if cache is not None or use_cache:
                raise ValueError(
                    "swiftkv_exact_mask is for teacher-forced passes without a cache (to resolve, pass "
                    "use_cache=False; cached generation takes exact K/V from config.exact_kv_window)"
                )
            if config.key_value_group_size > 1:
                raise ValueError("exact K/V need key_value_group_size=1: an AcrossKV group shares one K/V")
        # with logits for the last k rows, the last k - 1 are generated (speculative) tokens and the k-th from
        # the end closes the prompt window of W rows
        window = config.exact_kv_window if config.swiftkv and exact_mask is None else 0
        first_exact = None  # the first slot of this forward's exact rows, when the prompt length says it
        if window and swiftkv_prompt_len is not None:
            if cache is None and not use_cache:  # teacher-forced: the slots from the prompt's last W on
                slots = torch.arange(seq_len, device=inputs.device)
                exact_mask = (slots >= swiftkv_prompt_len - window).expand(inputs.shape[0], -1)
                window = 0
            else:
                past = int(cache.get_seq_length()) if cache is not None else 0
                first_exact = max(swiftkv_prompt_len - window - past, 0)
        if first_exact is not None:
            # the rows whose logits are wanted run layers >= l with SwiftKV K/V unless they are exact
            exact_rows = max(seq_len - first_exact, 0)
            rows = min(seq_len, max(exact_rows, keep)) if keep else seq_len
        else:
            rows = min(seq_len, keep - 1 + max(window, 1)) if keep and config.swiftkv else seq_len
            if exact_mask is not None:  # teacher-forced: every position runs every layer
                rows = seq_len
            exact_rows = (rows if keep else min(seq_len, window)) if window else 0
        prepared = self._prepare(
            input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, rows
        )
        l = config.num_key_value_layers
        hidden = self._run(self.layers[:l], prepared.hidden_states, prepared, **kwargs)
        if not config.swiftkv:
            hidden = self._run(self.layers[l:], hidden, prepared, **kwargs)
        elif exact_rows:
            # the SwiftKV K/V of the tokens before the exact rows; each layer >= l adds the exact rows' own and
            # stores both in the cache
            kv = None
            if seq_len > exact_rows:
                no_write = dataclasses.replace(prepared, cache=None)
                kv = self.swiftkv_key_values(hidden, no_write, tokens=seq_len - exact_rows)
            upper = self._keep_last_rows(prepared, rows) if rows < seq_len else prepared
            hidden = self._run(self.layers[l:], hidden[:, -rows:], upper, kv, exact_rows, **kwargs)
        else:
            kv = self.swiftkv_key_values(hidden, prepared)
            if rows < seq_len:
                prepared = self._keep_last_rows(prepared, rows)
                hidden = hidden[:, -rows:]
            hidden = self._run(self.layers[l:], hidden, prepared, kv, exact_mask, **kwargs)
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(hidden), cache=prepared.cache if use_cache else None
        )

    def teacher_student_hidden(
        self, input_ids, attention_mask=None, position_ids=None, exact_mask=None, query_mask=None
    ):
        """Final normed hidden states of the teacher (original, no grad) and the student (SwiftKV), plus both
        paths' input to the last layer, with layers < l computed once for both.  ``exact_mask`` [batch, seq]: the
        positions whose K/V in layers >= l are exact in the student (default with ``exact_kv_window = W``: the
        last W, as ``forward`` treats an input without a mask).  ``query_mask`` [batch, seq]: the positions whose
        student outputs are wanted (the scored ones; it must hold every exact position): when it leaves rows out,
        the student's layers >= l run those rows only (``student_rows_hidden``) and its outputs are zero elsewhere.  Layers < l
        build no graph when none of their weights (nor the embeddings) trains: activation checkpointing makes
        the embeddings' output require grad, which would otherwise recompute them and backpropagate through
        them for nothing."""
        l, window = self.config.num_key_value_layers, self.config.exact_kv_window
        if exact_mask is None and window:
            exact_mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
            exact_mask[:, -window:] = True
        lower = [self.embed_tokens, *self.layers[:l]]
        with torch.set_grad_enabled(
            torch.is_grad_enabled() and any(p.requires_grad for m in lower for p in m.parameters())
        ):
            prepared = self._prepare(
                input_ids, attention_mask, position_ids, None, None, False, input_ids.shape[1]
            )
            x_l = self._run(self.layers[:l], prepared.hidden_states, prepared)
        with torch.no_grad():
            t_last_in = self._run(self.layers[l:-1], x_l, prepared)
            teacher = self.norm(self._run(self.layers[-1:], t_last_in, prepared))
        rows_only = query_mask is not None and not bool(
            query_mask.all()
        )  # every row wanted: the batched pass
        if rows_only and self.config._attn_implementation in ROWS_BACKENDS:
            student, s_last_in = self.student_rows_hidden(
                x_l, prepared.position_ids, query_mask, exact_mask, attention_mask
            )
            return teacher, student, t_last_in, s_last_in
        kv = self.swiftkv_key_values(x_l, prepared)
        s_last_in = self._run(self.layers[l:-1], x_l, prepared, kv, exact_mask)
        student = self.norm(self._run(self.layers[-1:], s_last_in, prepared, kv, exact_mask))
        return teacher, student, t_last_in, s_last_in

    def student_rows_hidden(self, x_l, position_ids, query_mask, exact_mask=None, attention_mask=None):
        """The student's final normed hidden states and last-layer input [batch, seq, hidden] at the positions of
        ``query_mask`` (zero elsewhere), from ``x_l``, the input of layer l at every position (the lower layers
        are the teacher's: it may come from a teacher pass).

        Only those rows run layers >= l: every other position's K/V there are SwiftKV K/V of ``x_l``, so its
        hidden states in those layers are never read.  The rows of ``exact_mask`` (a subset of ``query_mask``)
        swap their exact K/V in, as a teacher-forced pass with ``swiftkv_exact_mask`` does; the result equals that
        pass at the queried positions, for a fraction of its cost when the scored rows are few (a short reply
        after a long prompt).  Packed samples (``position_ids`` restarting at 0) attend within themselves;
        ``attention_mask`` [batch, seq] (1 = real token) drops padded keys.  sdpa and eager attention only.
        """
        if self.config._attn_implementation not in ROWS_BACKENDS:
            raise ValueError(
                f"student_rows_hidden needs sdpa or eager attention, not {self.config._attn_implementation!r} "
                "(to resolve, load the model with attn_implementation='sdpa')"
            )
        l = self.config.num_key_value_layers
        position_ids = position_ids.expand(x_l.shape[0], -1)
        cos, sin = self.rotary_emb(x_l, position_ids=position_ids)
        full = _Prepared(x_l, None, (cos, sin), position_ids, None)
        kv = self.swiftkv_key_values(x_l, full)
        sample = (position_ids == 0).cumsum(-1)
        keys = torch.arange(x_l.shape[1], device=x_l.device)
        batch_index, row_index, normed, last_in = [], [], [], []
        for b in range(x_l.shape[0]):
            rows = query_mask[b].nonzero()[:, 0].to(x_l.device)
            if not len(rows):
                continue
            allowed = (keys[None] <= rows[:, None]) & (sample[b][None] == sample[b][rows][:, None])
            if attention_mask is not None:
                allowed &= attention_mask[b].bool().to(x_l.device)[None]
            exact = None if exact_mask is None else torch.where(exact_mask[b].to(x_l.device)[rows], rows, -1)
            mask = torch.zeros(allowed.shape, dtype=x_l.dtype, device=x_l.device)  # additive: eager adds it
            mask = mask.masked_fill(~allowed, torch.finfo(x_l.dtype).min)
            sub = _Prepared(
                x_l[b : b + 1, rows],
                mask[None, None],
                (cos[b : b + 1, rows], sin[b : b + 1, rows]),
                position_ids[b : b + 1, rows],
                None,
            )
            group_kv = [(k[b : b + 1], v[b : b + 1]) for k, v in kv]
            if exact is None:
                exact = torch.full_like(rows, -1)
            h = self._run(self.layers[l:-1], sub.hidden_states, sub, group_kv, exact_index=exact)
            last_in.append(h[0])
            normed.append(self.norm(self._run(self.layers[-1:], h, sub, group_kv, exact_index=exact))[0])
            batch_index.append(torch.full_like(rows, b))
            row_index.append(rows)
        if not row_index:
            return torch.zeros_like(x_l), torch.zeros_like(x_l)
        at = (torch.cat(batch_index), torch.cat(row_index))
        return (
            x_l.new_zeros(x_l.shape).index_put(at, torch.cat(normed)),
            x_l.new_zeros(x_l.shape).index_put(at, torch.cat(last_in)),
        )


_INPUT_KEYS = ("inputs", "input_ids", "inputs_embeds")  # generate()'s names for the prompt
ROWS_BACKENDS = ("sdpa", "eager")  # attention that takes an explicit boolean mask for some query rows


class SwiftKVForCausalLMMixin:
    """The base family's causal LM on the SwiftKV model, plus the small interface distillation uses."""

    model_class: type[nn.Module]

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        swiftkv_exact_mask: torch.Tensor | None = None,
        swiftkv_prompt_len: int | None = None,
        **kwargs,
    ):
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            swiftkv_logits_to_keep=logits_to_keep,
            swiftkv_exact_mask=swiftkv_exact_mask,
            swiftkv_prompt_len=swiftkv_prompt_len,
            **kwargs,
        )

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``, passing the prompt length (``swiftkv_prompt_len``: the input's slots)
        where a forward cannot tell the end of the prompt itself: a chunked prefill (``prefill_chunk_size``), whose
        every chunk asks for its last token's logits, and ``use_cache=False``, whose every step sees prompt and
        generated tokens in one input.  Then the last W prompt tokens and the generated ones are exact, as in an
        unchunked cached generation (which needs no length: its prefill ends the prompt)."""
        gen = kwargs.get("generation_config") or self.generation_config
        chunked = kwargs.get("prefill_chunk_size", gen.prefill_chunk_size) is not None
        uncached = kwargs.get("use_cache", gen.use_cache) is False
        if self.config.swiftkv and self.config.exact_kv_window and (chunked or uncached):
            inputs = next(
                (x for x in (args[0] if args else None, *map(kwargs.get, _INPUT_KEYS)) if x is not None), None
            )
            mask = kwargs.get("attention_mask")
            if inputs is not None:  # the mask covers the cached slots too when only new tokens are given
                lengths = [inputs.shape[1]] + ([mask.shape[1]] if mask is not None else [])
                kwargs.setdefault("swiftkv_prompt_len", max(lengths))
        return super().generate(*args, **kwargs)

    def set_mode(self, mode: str) -> None:
        """``"teacher"`` runs the original model, ``"student"`` the SwiftKV path (same weights)."""
        if mode not in ("teacher", "student"):
            raise ValueError(f"mode must be 'teacher' or 'student', got {mode!r}")
        self.config.swiftkv = mode == "student"

    def swiftkv_parameter_names(self) -> list[str]:
        """Names of the parameters SwiftKV distillation trains: norm_swiftkv and the *_proj_swiftkv."""
        return [n for n, _ in self.named_parameters() if "norm_swiftkv" in n or "_proj_swiftkv" in n]


# -- the family table: the base classes each family composes -------------------------------------------
class LlamaSwiftKVAttention(SwiftKVAttentionMixin, LlamaAttention):
    pass


class LlamaSwiftKVDecoderLayer(SwiftKVDecoderLayerMixin, LlamaDecoderLayer):
    attention_class = LlamaSwiftKVAttention


class LlamaSwiftKVModel(SwiftKVModelMixin, LlamaModel):
    config_class = LlamaSwiftKVConfig
    decoder_layer_class = LlamaSwiftKVDecoderLayer
    _no_split_modules = ["LlamaSwiftKVDecoderLayer"]


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLMMixin, LlamaForCausalLM):
    config_class = LlamaSwiftKVConfig
    model_class = LlamaSwiftKVModel
    _no_split_modules = ["LlamaSwiftKVDecoderLayer"]


class Qwen2SwiftKVAttention(SwiftKVAttentionMixin, Qwen2Attention):
    pass


class Qwen2SwiftKVDecoderLayer(SwiftKVDecoderLayerMixin, Qwen2DecoderLayer):
    attention_class = Qwen2SwiftKVAttention


class Qwen2SwiftKVModel(SwiftKVModelMixin, Qwen2Model):
    config_class = Qwen2SwiftKVConfig
    decoder_layer_class = Qwen2SwiftKVDecoderLayer
    _no_split_modules = ["Qwen2SwiftKVDecoderLayer"]


class Qwen2SwiftKVForCausalLM(SwiftKVForCausalLMMixin, Qwen2ForCausalLM):
    config_class = Qwen2SwiftKVConfig
    model_class = Qwen2SwiftKVModel
    _no_split_modules = ["Qwen2SwiftKVDecoderLayer"]


class Qwen3SwiftKVAttention(SwiftKVAttentionMixin, Qwen3Attention):
    pass


class Qwen3SwiftKVDecoderLayer(SwiftKVDecoderLayerMixin, Qwen3DecoderLayer):
    attention_class = Qwen3SwiftKVAttention


class Qwen3SwiftKVModel(SwiftKVModelMixin, Qwen3Model):
    config_class = Qwen3SwiftKVConfig
    decoder_layer_class = Qwen3SwiftKVDecoderLayer
    _no_split_modules = ["Qwen3SwiftKVDecoderLayer"]


class Qwen3SwiftKVForCausalLM(SwiftKVForCausalLMMixin, Qwen3ForCausalLM):
    config_class = Qwen3SwiftKVConfig
    model_class = Qwen3SwiftKVModel
    _no_split_modules = ["Qwen3SwiftKVDecoderLayer"]
