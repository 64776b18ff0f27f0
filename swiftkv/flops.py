"""Prefill FLOPs and KV-cache bytes of the original and the SwiftKV model, from the config alone.

Counting (multiply-add = 2 FLOPs), for a prompt of n tokens and a model of L layers, hidden h, H query heads
and K KV heads of size d, MLP width I, vocab V:

* per token and layer, projections: 2·h·(H·d) (q) + 2·2·h·(K·d) (k, v) + 2·(H·d)·h (o) + 3·2·h·I (MLP);
* attention of a query at position i over i+1 keys: 2·2·H·d·(i+1) (scores and the weighted sum), so a
  causal prefill of n tokens costs 2·2·H·d·n(n+1)/2 per layer: the quadratic term;
* logits only for the last prompt token (what ``generate`` computes): 2·h·V.

Original prefill = n·L·proj + L·attn(n) + head.  SwiftKV prefill = n·l·proj + l·attn(n)
+ n·(2·2·h·K·d)·G (the K/V of the G AcrossKV groups from x_l) + (L−l)·[proj without k/v + 2·2·H·d·n]
(one query row per later layer) + head.  The FLOP-ideal speedup is their ratio.  Norms, RoPE and softmax
are ignored (<1% here).  A K/V MLP of width M (``swiftkv_kv_mlp``) adds n·(2·h·M + 2·M·2·K·d·G).

KV bytes per token: 2·K·d·bytes per cache slot; the original has L slots, SwiftKV l + G.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The few numbers of a decoder config that the accounting needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    num_key_value_layers: int
    group_size: int = 1
    kv_mlp: int = 0

    @classmethod
    def from_config(cls, config) -> Shape:
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        layers = get("num_hidden_layers")
        return cls(
            layers=layers,
            hidden=get("hidden_size"),
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or get("hidden_size") // heads,
            intermediate=get("intermediate_size"),
            vocab=get("vocab_size"),
            num_key_value_layers=get("num_key_value_layers") or layers,
            group_size=get("key_value_group_size") or 1,
            kv_mlp=get("swiftkv_kv_mlp") or 0,
        )

    @property
    def groups(self) -> int:
        return (self.layers - self.num_key_value_layers) // self.group_size


def _qo_mlp(s: Shape) -> int:
    return 2 * s.hidden * s.heads * s.head_dim * 2 + 3 * 2 * s.hidden * s.intermediate


def _kv(s: Shape) -> int:
    return 2 * 2 * s.hidden * s.kv_heads * s.head_dim


def _attn(s: Shape, n: int) -> int:
    return 2 * 2 * s.heads * s.head_dim * n * (n + 1) // 2


def prefill_flops_original(s: Shape, n: int) -> int:
    return n * s.layers * (_qo_mlp(s) + _kv(s)) + s.layers * _attn(s, n) + 2 * s.hidden * s.vocab


def prefill_flops_swiftkv(s: Shape, n: int) -> int:
    l = s.num_key_value_layers
    lower = n * l * (_qo_mlp(s) + _kv(s)) + l * _attn(s, n)
    swift_kv = n * (_kv(s) * s.groups + 2 * s.kv_mlp * (s.hidden + 2 * s.kv_heads * s.head_dim * s.groups))
    upper = (s.layers - l) * (_qo_mlp(s) + 2 * 2 * s.heads * s.head_dim * n)
    return lower + swift_kv + upper + 2 * s.hidden * s.vocab


def ideal_prefill_speedup(s: Shape, n: int) -> float:
    return prefill_flops_original(s, n) / prefill_flops_swiftkv(s, n)


def kv_bytes_per_token(s: Shape, bytes_per_value: int = 2, swiftkv: bool = True) -> int:
    slots = s.num_key_value_layers + s.groups if swiftkv else s.layers
    return slots * 2 * s.kv_heads * s.head_dim * bytes_per_value
