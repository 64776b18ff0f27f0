"""Quality, memory and latency measurements of KV caches on one model (used by the benchmark script).

Quality protocol (``quality``): a held-out text is split into a ``prefix`` (prefilled in one pass, then
compressed) and a ``continuation`` fed in chunks of ``chunk`` tokens (so the window keeps rolling and later
chunks see compressed history, as in decoding).  Perplexity, KL(full ‖ method) and top-1 agreement are
computed on the continuation tokens only, against the uncompressed model's logits of the same run.  Every
method starts from one shared prefill (``kvcompress.continuation.SharedPrefill``), which leaves each cache as
its own prefill would.

Methods are named by short specs so the benchmark's table is reproducible from its command line:

- ``full``: ``DynamicCache`` (the baseline, sdpa attention);
- ``tale:B`` (optionally ``tale:B:8-4-2``, one bit width per tier, or ``tale:B:4-2-2/4-4-2``, keys' then
  values'): TALE with ``Policy.from_budget(B, bits, value_bits=...)``;
- ``tiers:SPEC``: explicit tiers, e.g. ``tiers:32/48@4x0.3+16/32@2/4x0.7`` (K/V ranks @ bits, or K/V bits,
  x fraction);
- both take a scales suffix ``:KV[:G]``, one letter for keys and one for values, ``t`` per-token scales and
  ``c`` per-channel scales over groups of ``G`` tokens (default 64), e.g. ``tale:0.25:4-2-2:ct``, and an
  optional rank-group size for per-token scales as ``:KV:G:RG`` (default: the whole vector);
- TALE-family specs take trailing flags: ``:pca``, keys in the PCA basis even where the factors have one
  fitted to the queries (``Policy.scored_keys``), e.g. ``tale:0.5:4-2-2:cc:pca``; ``:uniform``, the same key
  ranks in every layer even where the factors carry a sensitivity measurement (by default the ranks are
  moved between layers by it, ``kvcompress.allocate``);
- ``lowrank:R:BITS``: one tier of rank ``R`` for every compressed token (uniform low rank; BITS 16 = fp16);
- ``quant:BITS``: identity basis, i.e. plain per-token quantization of K/V (uniform quantization);
- ``kivi:BITS[:R[:G]]``: KIVI (Liu et al. 2024) on the same cache: identity basis, keys per channel over
  groups of ``G`` tokens (default 32), values per token in groups of ``G`` channels, no sinks, the ``R``
  most recent tokens (default 128, plus up to ``G - 1`` waiting) exact;
- ``hf-fp8``: transformers' ``QuantizedCache(backend="fp8")`` (quanto/HQQ backends are not installed here).

Every TALE-family method uses the same sinks/window/block, so the comparison isolates the storage format.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .allocate import SENSITIVITY_KEY, allocate_key_ranks
from .attention import enable_tale
from .cache import TaleCache
from .calibrate import chat_sequences
from .continuation import SharedPrefill, compare, continuation_logits
from .defaults import BLOCK, SINKS, WINDOW
from .factors import Factors, identity_factors
from .policy import Policy, Tier, scales_pair, uniform_policy

FLAGS = ("pca", "uniform")  # trailing flags of TALE-family specs (module docstring)
TALE_FAMILY = ("tale", "tiers", "lowrank")  # the methods that use the calibrated factors, so take FLAGS
# arguments after the name, flags aside: at least, at most
ARITY = {
    "full": (0, 0),
    "hf-fp8": (0, 0),
    "tale": (1, 5),
    "tiers": (1, 4),
    "lowrank": (2, 2),
    "quant": (1, 1),
    "kivi": (1, 3),
}
RESOLVE = "to resolve, use full, tale:B, tiers:SPEC, lowrank:R:BITS, quant:BITS, kivi:BITS or hf-fp8"


def parse_method(spec: str) -> tuple[str, list[str], set[str]]:
    """``spec`` as (name, arguments, trailing flags), its syntax checked without a model, so that a benchmark
    refuses a misspelt spec before it loads or calibrates anything (the policy validates the rest)."""
    name, *args = spec.split(":")
    flags = set()
    while args and args[-1] in FLAGS:
        flags.add(args.pop())
    if name not in ARITY:
        raise ValueError(f"unknown method {spec!r}; {RESOLVE}")
    if flags and name not in TALE_FAMILY:
        raise ValueError(
            f"method {spec!r}: {', '.join(':' + f for f in sorted(flags))} change how calibrated factors are used, "
            f"which {name} has none of; to resolve, drop them or use {', '.join(TALE_FAMILY)}"
        )
    low, high = ARITY[name]
    try:
        if not low <= len(args) <= high:
            raise ValueError
        if name == "tale":
            float(args[0])
            if len(args) > 1:
                parse_bits(args[1])
            scales_options(args[2:])
        elif name == "tiers":
            parse_tiers(args[0])
            scales_options(args[1:])
        else:
            for a in args:
                int(a)
    except ValueError:  # pydantic's ValidationError is one too
        raise ValueError(f"malformed method {spec!r}; {RESOLVE} (kvcompress.evaluate)") from None
    return name, args, flags


def method_list(text: str) -> list[str]:
    """argparse type: a comma list of method specs, each checked by :func:`parse_method`."""
    import argparse

    methods = [m.strip() for m in text.split(",") if m.strip()]
    try:
        for m in methods:
            parse_method(m)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not methods:
        raise argparse.ArgumentTypeError(f"{text!r} names no method; {RESOLVE}")
    return methods


def make_method(
    spec: str, model, factors: Factors, sinks: int = SINKS, window: int = WINDOW, block: int = BLOCK
) -> Callable:
    """A zero-argument factory of fresh caches for ``spec`` (see module docstring); sets the attention."""
    from transformers import DynamicCache, QuantizedCache

    name, args, flags = parse_method(spec)
    head_dim = factors.meta["head_dim"]
    shared = {"sinks": sinks, "window": window, "block": block}
    if name == "full":
        model.set_attn_implementation("sdpa")
        return lambda: DynamicCache(config=model.config)
    if name == "hf-fp8":
        model.set_attn_implementation("sdpa")
        return lambda: QuantizedCache(backend="fp8", config=model.config)
    enable_tale(model)
    if name == "kivi":
        bits, residual, group = (int(a) for a in args + ["128", "32"][len(args) - 1 :])
        tier = Tier(k_rank=head_dim, v_rank=head_dim, bits=bits, fraction=1.0, k_scales="channel")
        policy = Policy(
            sinks=0, window=residual, block=group, token_group=group, group_size=group, tiers=[tier]
        )
        factors = identity_factors(model.config)
    elif name == "tale":
        bits, value_bits = parse_bits(args[1]) if len(args) > 1 else ([8, 4, 2], None)
        extra = scales_options(args[2:])
        policy = Policy.from_budget(float(args[0]), bits, head_dim, value_bits=value_bits, **shared, **extra)
    elif name == "tiers":
        extra = scales_options(args[1:])
        k_scales, v_scales = extra.pop("scales", ("token", "token"))
        tiers = [
            t.model_copy(update={"k_scales": k_scales, "v_scales": v_scales}) for t in parse_tiers(args[0])
        ]
        policy = Policy(tiers=tiers, **shared, **extra)
    elif name == "lowrank":
        policy = uniform_policy(int(args[0]), int(args[1]), **shared)
    else:  # quant (parse_method knows no other)
        factors, policy = identity_factors(model.config), uniform_policy(head_dim, int(args[0]), **shared)
    policy = policy.model_copy(update={"scored_keys": "pca" not in flags})
    if SENSITIVITY_KEY in factors.meta and "uniform" not in flags:
        policy = allocate_key_ranks(policy, factors, factors.meta[SENSITIVITY_KEY])
    return lambda: TaleCache(factors, policy, model.config, model=model)


def scales_options(args: list[str]) -> dict:
    """``["ct", "64", "16"]`` (key/value scale letters, token group, rank group) as ``Policy`` keywords."""
    if not args:
        return {}
    out: dict = {"scales": scales_pair(args[0])}
    if len(args) > 1:
        out["token_group"] = int(args[1])
    if len(args) > 2:
        out["group_size"] = int(args[2])
    return out


def parse_bits(spec: str) -> tuple[list[int], list[int] | None]:
    """``"4-2-2"`` -> one bit width per tier for keys and values; ``"4-2-2/4-4-2"`` -> keys', values'."""
    keys, _, values = spec.partition("/")
    widths = lambda text: [int(b) for b in text.split("-")]  # noqa: E731
    return widths(keys), widths(values) if values else None


def parse_tiers(spec: str) -> list[Tier]:
    """``"32/48@4x0.3+16/32@2/4x0.7"``: tiers of K-rank/V-rank at bits (or K/V bits) for a fraction, most
    significant first."""
    tiers = []
    for part in spec.split("+"):
        ranks, rest = part.split("@")
        bits, fraction = rest.split("x")
        k_rank, v_rank = (int(r) for r in ranks.split("/"))
        k_bits, _, v_bits = bits.partition("/")
        tiers.append(
            Tier(
                k_rank=k_rank,
                v_rank=v_rank,
                bits=int(k_bits),
                v_bits=int(v_bits or k_bits),
                fraction=float(fraction),
            )
        )
    return tiers


def kv_bytes(cache, exact_element_bytes: int | None = None) -> int:
    """Bytes of every tensor a cache's layers hold (storages, so views count in full); factors excluded.

    ``exact_element_bytes``: count the K/V a cache holds in the model dtype (TALE's exact part, all of a
    ``DynamicCache``) at that size, e.g. 2 to report the memory of a 16-bit model from a float32 run; the
    compressed tiers and fp8 codes do not depend on the model dtype."""
    if isinstance(cache, TaleCache):
        return cache.nbytes(exact_element_bytes)
    storages = {}
    for layer in cache.layers:
        for value in vars(layer).values():
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.numel():
                    size = t.untyped_storage().nbytes()
                    if (
                        exact_element_bytes
                        and t.is_floating_point()
                        and t.element_size() > exact_element_bytes
                    ):
                        size = size // t.element_size() * exact_element_bytes
                    storages[t.untyped_storage().data_ptr()] = size
    return sum(storages.values())


def fp16_kv_bytes(config, tokens: int, batch: int = 1) -> int:
    """What a plain fp16 KV cache of ``tokens`` tokens costs for ``config`` (the usual reference)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * tokens * batch


def measure_sequence(
    model,
    ids: torch.Tensor,
    factors: Factors,
    methods: list[str],
    prefix: int,
    chunk: int,
    sinks: int = SINKS,
    window: int = WINDOW,
    done: Callable[[str, dict], None] | None = None,
) -> dict[str, dict]:
    """One sequence, every method (``methods[0]`` the reference): summed NLL, KL(reference ‖ method) and top-1
    agreements over the continuation ``ids[:, prefix:]``, their count, the KV bytes held at the end (exact
    K/V counted at 16 bits) and what fp16 K/V of the same tokens would cost; ``done(method, result)`` is
    called as each method finishes (so a caller can keep results of a sequence cut short)."""
    targets, shared, ref, out = ids[:, prefix:], SharedPrefill(model, ids[:, :prefix]), None, {}
    for m in methods:
        cache = make_method(m, model, factors, sinks, window)()
        start = time.perf_counter()
        logits = continuation_logits(model, ids, cache, prefix, chunk, shared)
        seconds = time.perf_counter() - start
        ref = logits if ref is None else ref
        out[m] = {
            **compare(logits, ref, targets),
            "bytes": kv_bytes(cache, exact_element_bytes=2),
            "fp16": fp16_kv_bytes(model.config, ids.shape[1] - 1),
            "seconds": seconds,
        }
        if done:
            done(m, out[m])
    return out


def summarize(records: list[dict[str, dict]], methods: list[str]) -> dict[str, dict]:
    """Per method over sequences measured with the reference ``methods[0]``: perplexity and its increase over
    the reference (token-weighted, so ``exp(ΣNLL/Σn)``), KL, top-1 agreement, median KV bytes and ratio to
    fp16, and the sequences it covers."""
    rows = {}
    for m in methods:
        seqs = [r for r in records if m in r and methods[0] in r]
        if not seqs:
            continue
        n = sum(r[m]["n"] for r in seqs)
        ppl = math.exp(sum(r[m]["nll"] for r in seqs) / n)
        base = math.exp(sum(r[methods[0]]["nll"] for r in seqs) / n)
        rows[m] = {
            "ppl": ppl,
            "ppl_increase_pct": 100 * (ppl / base - 1),
            "kl": sum(r[m]["kl"] for r in seqs) / n,
            "top1_agree": sum(r[m]["agree"] for r in seqs) / n,
            "kv_bytes": statistics.median(r[m]["bytes"] for r in seqs),
            "ratio_vs_fp16": statistics.median(r[m]["fp16"] / r[m]["bytes"] for r in seqs),
            "seconds": sum(r[m]["seconds"] for r in seqs),
            "sequences": len(seqs),
        }
    return rows


def quality(
    model,
    tokenizer,
    factors: Factors,
    methods: list[str],
    count: int,
    prefix: int,
    continuation: int,
    chunk: int,
    sinks: int = SINKS,
    window: int = WINDOW,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """``summarize`` of ``measure_sequence`` over ``count`` held-out ShareGPT sequences of ``prefix +
    continuation`` tokens."""
    records = []
    for i, ids in enumerate(chat_sequences(tokenizer, prefix + continuation, count, split="heldout")):
        records.append(measure_sequence(model, ids, factors, methods, prefix, chunk, sinks, window))
        if progress:
            progress(f"quality: sequence {i + 1}/{count} done")
    if not records:
        raise ValueError(
            f"no held-out sequence of {prefix + continuation} tokens was read; to resolve, check the data"
        )
    return summarize(records, methods)


@torch.no_grad()
def decode_step_seconds(model, token: torch.Tensor, cache, steps: int) -> tuple[list[float], torch.Tensor]:
    """Time ``steps`` whole-model greedy decode steps from ``token`` on a prefilled ``cache``.

    Returns the seconds of each step and the next token, so timed rounds can continue the same cache
    (a long prefill is paid once, and every round decodes from where the last one stopped).
    """
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token, cache=cache).logits
        times.append(time.perf_counter() - start)
        token = logits[:, -1:].argmax(-1)
    return times, token


@torch.no_grad()
def attention_step_seconds(model, cache, context: int, steps: int, seed: int = 0) -> list[float]:
    """Seconds of one layer's decode-step cache update + attention after ``context`` cached tokens.

    This is the part of a decode step that differs between caches (projections and MLPs are the same), so
    it can be timed at long contexts without a model prefill: random K/V/queries of the model's shapes in
    its dtype; a ``TaleCache`` observes the prefill's significance from its last ``OBSERVED_QUERIES`` rows,
    as a real prefill does, and compresses before the timed steps.
    """
    from .attention import attend
    from .cache import OBSERVED_QUERIES

    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(seed)

    def rand(heads: int, n: int) -> torch.Tensor:
        return torch.randn(1, heads, n, d, generator=gen).to(model.dtype)

    kv_heads, q_heads, scale = cfg.num_key_value_heads, cfg.num_attention_heads, d**-0.5
    if isinstance(cache, TaleCache):
        layer = cache.layers[0]
        layer.update(rand(kv_heads, context), rand(kv_heads, context))
        attend(layer, rand(q_heads, OBSERVED_QUERIES), None, scale)

        def step(q, k, v):
            layer.update(k, v)
            return attend(layer, q, None, scale)
    else:
        cache.update(rand(kv_heads, context), rand(kv_heads, context), 0)

        def step(q, k, v):
            keys, values = cache.update(k, v, 0)
            return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)

    times = []
    for _ in range(steps):
        q, k, v = rand(q_heads, 1), rand(kv_heads, 1), rand(kv_heads, 1)
        start = time.perf_counter()
        step(q, k, v)
        times.append(time.perf_counter() - start)
    return times


def weight_svd_bases(model, layer_idx: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head left singular vectors of ``k_proj``/``v_proj`` (the data-free alternative to calibration)."""
    params = dict(model.named_parameters())
    out = []
    for proj in ("k_proj", "v_proj"):
        weight = next(
            p for n, p in params.items() if n.endswith(f"layers.{layer_idx}.self_attn.{proj}.weight")
        )
        per_head = weight.detach().float().unflatten(0, (heads, -1))  # (heads, d, hidden)
        out.append(torch.linalg.svd(per_head, full_matrices=False).U)
    return out[0], out[1]


def energy_error(second_moment: torch.Tensor, basis: torch.Tensor, rank: int) -> float:
    """Share of the held-out energy ``E‖x‖²`` that a rank-``rank`` projection onto ``basis`` loses."""
    top = basis[..., :rank].double()
    kept = torch.einsum("hdr,hde,her->h", top, second_moment.double(), top)
    total = second_moment.double().diagonal(dim1=-2, dim2=-1).sum(-1)
    return float((1 - kept / total).mean())
