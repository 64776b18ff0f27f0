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
are ignored (<1% here).

With exact K/V (``exact_kv_window`` W), the last w = min(W, n) prompt tokens run every later layer, with their
own k/v projections there, and attend over up to n keys; the G group K/V are computed for the other n − w
tokens only: SwiftKV prefill = n·l·proj + l·attn(n) + (n − w)·(2·2·h·K·d)·G + (L−l)·[w·(proj + k/v) +
2·2·H·d·(sum of the w rows' key counts)] + head.  A decode token computes exact k/v in every layer, as the
original does.

A served request of p prompt and o output tokens costs its prefill (which yields the first output token) and
o − 1 decode steps; the step after c cached tokens runs every layer on one token, attends over c + 1 keys in
each, and computes its logits: L·proj + L·2·2·H·d·(c+1) + head for the original, the same with the k/v
projections of layers ≥ l replaced by the G group projections from x_l for SwiftKV.  A workload's FLOP-ideal
throughput ratio is the sum over its requests of the original's FLOPs over SwiftKV's.

KV bytes per token: 2·K·d·bytes per cache slot; the original has L slots, SwiftKV l + G.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace


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
    exact_kv_window: int = 0

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
            exact_kv_window=get("exact_kv_window") or 0,
        )

    @property
    def groups(self) -> int:
        return (self.layers - self.num_key_value_layers) // self.group_size

    @property
    def original(self) -> Shape:
        """The same model without SwiftKV layers (l = L): every function here then counts the original."""
        return replace(self, num_key_value_layers=self.layers, group_size=1, exact_kv_window=0)


def projection_flops(s: Shape) -> int:
    """Per token and layer: the q and o projections and the MLP (not k/v)."""
    return 2 * s.hidden * s.heads * s.head_dim * 2 + 3 * 2 * s.hidden * s.intermediate


def kv_flops(s: Shape) -> int:
    """Per token and layer (or SwiftKV group): the k and v projections."""
    return 2 * 2 * s.hidden * s.kv_heads * s.head_dim


def attention_flops(s: Shape, n: int) -> int:
    """One layer's causal attention (scores and weighted sum) over a sequence of ``n`` tokens."""
    return 2 * 2 * s.heads * s.head_dim * n * (n + 1) // 2


def prefill_flops_original(s: Shape, n: int) -> int:
    return (
        n * s.layers * (projection_flops(s) + kv_flops(s))
        + s.layers * attention_flops(s, n)
        + 2 * s.hidden * s.vocab
    )


def prefill_flops_swiftkv(s: Shape, n: int) -> int:
    l = s.num_key_value_layers
    lower = n * l * (projection_flops(s) + kv_flops(s)) + l * attention_flops(s, n)
    if s.exact_kv_window and l < s.layers:
        rows = min(s.exact_kv_window, n)
        keys = rows * n - rows * (rows - 1) // 2  # the last rows attend over n, n - 1, ... keys
        swift_kv = (n - rows) * kv_flops(s) * s.groups
        upper = (s.layers - l) * (
            rows * (projection_flops(s) + kv_flops(s)) + 2 * 2 * s.heads * s.head_dim * keys
        )
    else:
        swift_kv = n * kv_flops(s) * s.groups
        upper = (s.layers - l) * (projection_flops(s) + 2 * 2 * s.heads * s.head_dim * n)
    return lower + swift_kv + upper + 2 * s.hidden * s.vocab


def _decode_token(s: Shape) -> int:
    """A decode step without its attention: projections (SwiftKV: the group K/V from x_l; with exact K/V each
    layer's own k/v) and the logits."""
    exact = s.exact_kv_window and s.num_key_value_layers < s.layers
    kv = (s.layers if exact else s.num_key_value_layers + s.groups) * kv_flops(s)
    return s.layers * projection_flops(s) + kv + 2 * s.hidden * s.vocab


def decode_flops(s: Shape, context: int) -> int:
    """One decode step after ``context`` cached tokens (SwiftKV when ``s`` has SwiftKV layers)."""
    return _decode_token(s) + s.layers * 2 * 2 * s.heads * s.head_dim * (context + 1)


def request_flops(s: Shape, prompt: int, output: int) -> int:
    """Prefill of ``prompt`` tokens (its logits give the first output token), then ``output - 1`` decode steps."""
    steps = max(output - 1, 0)
    keys = steps * prompt + steps * (steps + 1) // 2  # sum of c + 1 over c = prompt .. prompt + steps - 1
    return (
        prefill_flops_swiftkv(s, prompt)
        + steps * _decode_token(s)
        + s.layers * 2 * 2 * s.heads * s.head_dim * keys
    )


def ideal_workload_speedup(s: Shape, requests: Iterable[tuple[int, int]]) -> float:
    """The original's FLOPs over SwiftKV's for (prompt, output) token counts: the compute-bound throughput ratio."""
    requests = list(requests)
    return sum(request_flops(s.original, p, o) for p, o in requests) / sum(
        request_flops(s, p, o) for p, o in requests
    )


def ideal_prefill_speedup(s: Shape, n: int) -> float:
    return prefill_flops_original(s, n) / prefill_flops_swiftkv(s, n)


def kv_bytes_per_token(s: Shape, bytes_per_value: int = 2, swiftkv: bool = True) -> int:
    slots = s.num_key_value_layers + s.groups if swiftkv else s.layers
    return slots * 2 * s.kv_heads * s.head_dim * bytes_per_value
