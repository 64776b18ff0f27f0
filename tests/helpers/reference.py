"""An independent SwiftKV student, written from the formulas (ARCHITECTURE.md), for the equivalence tests.

It reads only the state dict and the config of the model under test; none of that model's modules run.
Attention is the explicit ``softmax(Q K^T / sqrt(d) + mask) V`` with the KV heads repeated for GQA, over
full (uncached) sequences with left padding; RoPE uses transformers' rotary embedding only for its cos/sin
tables.  Layers ``j >= l`` take K/V from ``k/v_proj_swiftkv(norm_swiftkv(x_l))`` of their AcrossKV group
leader and queries from their own ``q_proj_swiftkv``; Qwen3's per-head norms use the ``*_norm_swiftkv``
weights there.  With ``l = L`` this is the base model itself.  ``exact`` [B, T] (the exact K/V option): in layers
``j >= l`` the marked positions take layer j's own ``k/v_proj`` (and Qwen3's ``k_norm``) of their normed input
instead, as the original model would compute them from the student's hidden state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D] (the halves layout: rotate (x1, x2) -> (-x2, x1))."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """q: [B, H, T, D]; k, v: [B, KVH, S, D]; allowed: [B, T, S] bool.  Rows with no allowed key give 0."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v


def student_logits(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    exact: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [B, T, V] of the SwiftKV student for left-padded ``input_ids`` (padding positions are arbitrary),
    with exact K/V in layers >= l at the ``exact`` positions."""
    cfg = model.config
    W = {k: v.detach() for k, v in model.state_dict().items()}
    eps, L = cfg.rms_norm_eps, cfg.num_hidden_layers
    l, g = (cfg.num_key_value_layers, cfg.key_value_group_size) if cfg.swiftkv else (L, 1)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    B, T = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    causal = torch.arange(T)[:, None] >= torch.arange(T)[None, :]
    allowed = causal[None] & mask[:, None, :].bool()

    def lin(x, name):
        return F.linear(x, W[name + ".weight"], W.get(name + ".bias"))

    def heads(x):
        return x.view(B, T, -1, head_dim).transpose(1, 2)

    x = W["model.embed_tokens.weight"][input_ids]
    cos, sin = LlamaRotaryEmbedding(cfg)(x, positions)
    for j in range(L):
        attn = f"model.layers.{j}.self_attn."
        if j == l:
            h = rms_norm(x, W["model.norm_swiftkv.weight"], eps)
        normed = rms_norm(x, W[f"model.layers.{j}.input_layernorm.weight"], eps)
        if j < l:
            q, k, v = (heads(lin(normed, attn + p)) for p in ("q_proj", "k_proj", "v_proj"))
            q_norm, k_norm = attn + "q_norm.weight", attn + "k_norm.weight"
        else:
            leader = f"model.layers.{l + (j - l) // g * g}.self_attn."
            q = heads(lin(normed, attn + "q_proj_swiftkv"))
            k, v = heads(lin(h, leader + "k_proj_swiftkv")), heads(lin(h, leader + "v_proj_swiftkv"))
            q_norm, k_norm = attn + "q_norm_swiftkv.weight", leader + "k_norm_swiftkv.weight"
        if q_norm in W:  # Qwen3: RMSNorm over each head before RoPE
            q, k = rms_norm(q, W[q_norm], eps), rms_norm(k, W[k_norm], eps)
        if j >= l and exact is not None:
            k_own, v_own = heads(lin(normed, attn + "k_proj")), heads(lin(normed, attn + "v_proj"))
            if attn + "k_norm.weight" in W:
                k_own = rms_norm(k_own, W[attn + "k_norm.weight"], eps)
            swap = exact[:, None, :, None]
            k, v = torch.where(swap, k_own, k), torch.where(swap, v_own, v)
        out = attention(rope(q, cos, sin), rope(k, cos, sin), v, allowed)
        x = x + lin(out.transpose(1, 2).reshape(B, T, -1), attn + "o_proj")
        normed = rms_norm(x, W[f"model.layers.{j}.post_attention_layernorm.weight"], eps)
        mlp = f"model.layers.{j}.mlp."
        x = x + lin(F.silu(lin(normed, mlp + "gate_proj")) * lin(normed, mlp + "up_proj"), mlp + "down_proj")
    x = rms_norm(x, W["model.norm.weight"], eps)
    return x @ W.get("lm_head.weight", W["model.embed_tokens.weight"]).T


def greedy(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, steps: int, window: int = 0
) -> torch.Tensor:
    """Greedy continuation [B, steps] of a left-padded batch, recomputing the full reference every step; with
    ``window`` W > 0 the last W prompt columns and every generated one take exact K/V."""
    ids, mask = input_ids, attention_mask
    for _ in range(steps):
        exact = None
        if window:
            exact = (torch.arange(ids.shape[1]) >= input_ids.shape[1] - window).expand(ids.shape)
        nxt = student_logits(model, ids, mask, exact)[:, -1].argmax(-1, keepdim=True)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    return ids[:, input_ids.shape[1] :]


def sequence_logprob(model, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
    """Sum of the reference log-probabilities of the tokens after ``prompt_len`` (per row)."""
    logp = torch.log_softmax(student_logits(model, input_ids, attention_mask).float(), -1)
    picked = logp[:, prompt_len - 1 : -1].gather(-1, input_ids[:, prompt_len:, None])[..., 0]
    return picked.sum(-1)
