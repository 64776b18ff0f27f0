"""``swiftkv kvcompress calibrate``: low-rank KV bases from calibration activations.

The K/V that matter are exactly what the model hands to ``cache.update`` — post-RoPE keys and values, for
the layers that own KV — so calibration runs the model with a recording cache (``MomentLayer``) and
accumulates each layer's per-head second moments ``Σ k kᵀ`` and ``Σ v vᵀ`` in float64.  The queries that
read those keys are what attention is handed, so a recording attention function (registered with
transformers' ``AttentionInterface``, sdpa inside) adds ``Σ q qᵀ`` per KV head (the query heads of its group
summed) under the layer that owns the keys, for a second key basis fitted in the queries' metric
(``kvcompress.factors``).  No model code is patched or imported, so the same function calibrates a base model
or a SwiftKV model (only the AcrossKV group leaders call ``update``, so only they get factors, and the queries
of every layer that reads a leader's cache count for it).

Why activations rather than an SVD of ``W_k``/``W_v``: keys are needed post-RoPE (see
``kvcompress.factors``), which a weight SVD cannot describe, and for values the activation PCA is the
optimum for the data distribution while a weight SVD assumes isotropic inputs.  ``scripts/bench_kvcompress.py
--compare-bases`` measures both on held-out text.

Calibration sequences are ShareGPT conversations of the train split (chat template applied) joined into
sequences of ``max_length`` tokens, so the moments see every position up to the length the cache will serve:
post-RoPE keys rotate with position, and a basis fitted on short sequences misses the angles of later ones
(the benchmark evaluates on the held-out split).  The first ``sinks`` positions of each sequence are left
out of the moments: the cache keeps attention sinks exact, and their outsized keys would otherwise tilt the
bases.  Progress is checkpointed every ``checkpoint_every`` sequences next to the output (safetensors + JSON
metadata, never a pickle), so an interrupted run resumes where it stopped.

Last, each layer's cost of key truncation is measured on the first calibration sequences and stored with the
factors, and the default policy's key ranks are moved between layers by it (``kvcompress.allocate``); that
measurement resumes after the last finished sequence (a JSON file beside the moments).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .defaults import (
    BITS,
    BLOCK,
    DATA,
    MAX_LENGTH,
    RANK_BUDGET,
    SAMPLES,
    SCALES,
    SENSITIVITY_SAMPLES,
    SENSITIVITY_TOKENS,
    SINKS,
    VALUE_BITS,
    WINDOW,
)
from .factors import (
    POLICY_FILE,
    Factors,
    LayerFactors,
    bases_from_moments,
    key_fingerprint,
    model_signature,
    save_factors,
    scored_bases,
)
from .policy import Policy, scales_pair


class MomentLayer(DynamicLayer):
    """A ``DynamicLayer`` that also accumulates per-head second moments of what it is given."""

    skip = 0
    """Leading positions of the first update (a prefill from position 0) left out of the moments."""

    def __init__(self):
        super().__init__()
        self.key_moment = self.value_moment = None
        self.count = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = 0 if self.get_seq_length() else self.skip
        k, v = key_states[:, :, start:].detach().double(), value_states[:, :, start:].detach().double()
        km, vm = torch.einsum("bhnd,bhne->hde", k, k), torch.einsum("bhnd,bhne->hde", v, v)
        self.key_moment = km if self.key_moment is None else self.key_moment + km
        self.value_moment = vm if self.value_moment is None else self.value_moment + vm
        self.count += k.shape[0] * k.shape[2]
        return super().update(key_states, value_states, *args, **kwargs)


MOMENT_ATTENTION = "kvcompress-moments"
MIN_QUERIES_PER_DIM = 16  # fewer query vectors than this times head_dim: no scored key basis
_recording: ContextVar[dict[int, list] | None] = ContextVar("kvcompress_query_moments", default=None)


def _moment_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa attention that adds ``Σ q qᵀ`` per KV head to the recording ``accumulate`` opened, under the layer
    whose cache holds the keys (a SwiftKV config maps each layer to its KV group's leader)."""
    record = _recording.get()
    if record is not None:
        b, hq, n, d = query.shape
        kv_heads = key.shape[1]
        q = query.detach().double().reshape(b, kv_heads, hq // kv_heads, n, d)
        owner = getattr(module.config, "kv_cache_layer", lambda i: i)(module.layer_idx)
        entry = record.setdefault(owner, [0.0, 0])
        entry[0] = entry[0] + torch.einsum("bhgnd,bhgne->hde", q, q)
        entry[1] += b * (hq // kv_heads) * n
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class Moments:
    """Running second moments per layer, summed over calibration sequences (serializable for resume):
    ``layers[i] = [Σ k kᵀ, Σ v vᵀ, tokens]``, ``queries[i] = [Σ q qᵀ, query vectors]``."""

    def __init__(self):
        self.layers: dict[int, list] = {}
        self.queries: dict[int, list] = {}

    def save(self, path: Path, header: dict) -> None:
        """Write the moments as safetensors with ``header`` and the token counts as JSON metadata (atomic)."""
        tensors = {
            f"{idx}.{kind}": m
            for idx, (km, vm, _) in self.layers.items()
            for kind, m in (("k", km), ("v", vm))
        }
        tensors |= {f"{idx}.q": qm for idx, (qm, _) in self.queries.items()}
        counts = {str(idx): n for idx, (_, _, n) in self.layers.items()}
        query_counts = {str(idx): n for idx, (_, n) in self.queries.items()}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        metadata = {
            "header": json.dumps(header),
            "counts": json.dumps(counts),
            "queries": json.dumps(query_counts),
        }
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> tuple[Moments, dict] | None:
        """Moments and header written by ``save``; None when the file is absent or not a valid one."""
        if not path.is_file():
            return None
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
                header, counts = json.loads(meta["header"]), json.loads(meta["counts"])
                moments = cls()
                moments.layers = {
                    int(i): [f.get_tensor(f"{i}.k"), f.get_tensor(f"{i}.v"), n] for i, n in counts.items()
                }
                moments.queries = {
                    int(i): [f.get_tensor(f"{i}.q"), n] for i, n in json.loads(meta["queries"]).items()
                }
        except (SafetensorError, KeyError, ValueError, OSError):
            return None
        return moments, header

    def add(self, cache: Cache) -> None:
        for idx, layer in enumerate(cache.layers):
            if layer.key_moment is None:
                continue
            acc = self.layers.setdefault(idx, [0.0, 0.0, 0])
            acc[0], acc[1], acc[2] = (
                acc[0] + layer.key_moment,
                acc[1] + layer.value_moment,
                acc[2] + layer.count,
            )

    def factors(self, meta: dict) -> Factors:
        layers = {}
        for idx, (km, vm, n) in sorted(self.layers.items()):
            kb, ks = bases_from_moments(km / n)
            vb, vs = bases_from_moments(vm / n)
            qm, queries = self.queries.get(idx, (None, 0))
            scored = (None, None)
            if queries >= MIN_QUERIES_PER_DIM * km.shape[-1]:
                scored = scored_bases(km / n, qm / queries)
            layers[idx] = LayerFactors(kb, ks, vb, vs, *scored)
        return Factors(layers, meta)


@torch.no_grad()
def accumulate(
    model: torch.nn.Module,
    sequences: Iterable[torch.Tensor],
    moments: Moments | None = None,
    skip: int = 0,
) -> Moments:
    """Run ``model`` over token sequences ``(1, n)`` and add their KV second moments to ``moments``,
    leaving out the first ``skip`` positions of each (the attention sinks), and the second moments of every
    query that reads them (``_moment_attention``; the model's attention is restored after)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    moments = moments or Moments()
    device = next(model.parameters()).device
    layer = type("SkippingMomentLayer", (MomentLayer,), {"skip": skip}) if skip else MomentLayer
    AttentionInterface.register(MOMENT_ATTENTION, _moment_attention)
    AttentionMaskInterface.register(MOMENT_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(MOMENT_ATTENTION)
    token = _recording.set(moments.queries)
    try:
        for ids in sequences:
            cache = Cache(layer_class_to_replicate=layer)
            model(input_ids=ids.to(device), cache=cache, use_cache=True)
            moments.add(cache)
    finally:
        _recording.reset(token)
        model.set_attn_implementation(previous)
    return moments


def factors_from_model(
    model: torch.nn.Module, sequences: Iterable[torch.Tensor], skip: int = 0, **meta
) -> Factors:
    """In-memory calibration: bases for every KV-writing layer of ``model`` from ``sequences``."""
    moments = accumulate(model, sequences, skip=skip)
    return moments.factors(
        {**model_signature(model.config), "key_fingerprint": key_fingerprint(model), **meta}
    )


def chat_sequences(
    tokenizer,
    length: int,
    count: int,
    split: str = "train",
    data: str = "sharegpt",
    offset: int = 0,
    tail: bool = False,
) -> Iterator[torch.Tensor]:
    """Up to ``count`` ``(1, length)`` token tensors: chat-formatted conversations of ``split`` from the
    ``offset``-th on, joined; with ``tail``, a last shorter one when the data runs out."""
    from toolkit.assets import iter_conversations

    buffer: list[int] = []
    made = 0
    for i, messages in enumerate(iter_conversations(data, split=split)):
        if made >= count:
            return
        if i < offset:
            continue
        text = (
            tokenizer.apply_chat_template(messages, tokenize=False)
            if tokenizer.chat_template
            else "\n".join(m["content"] for m in messages)
        )
        buffer += tokenizer(text, add_special_tokens=False).input_ids
        while len(buffer) >= length and made < count:
            yield torch.tensor([buffer[:length]])
            buffer, made = buffer[length:], made + 1
    if tail and len(buffer) >= 2 and made < count:
        yield torch.tensor([buffer])


def calibrate(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    data: str = DATA,
    samples: int = SAMPLES,
    max_length: int = MAX_LENGTH,
    rank_budget: float = RANK_BUDGET,
    bits: Sequence[int | None] = BITS,
    value_bits: Sequence[int | None] | None = VALUE_BITS,
    scales: str = SCALES,
    sinks: int = SINKS,
    window: int = WINDOW,
    block: int = BLOCK,
    sensitivity_samples: int = SENSITIVITY_SAMPLES,
    force: bool = False,
    checkpoint_every: int = 32,
    progress: bool = True,
) -> Path:
    """Calibrate low-rank KV factors for ``model_dir`` and write them (with a default policy) to ``out_dir``.

    ``samples`` sequences of ``max_length`` tokens: set ``max_length`` to the context length you serve.  On
    the first ``sensitivity_samples`` of them (at most ``samples``) each layer's cost of key truncation is
    measured, and the default policy's key ranks are moved between layers by it (``kvcompress.allocate``;
    0: the same ranks in every layer)."""
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from toolkit.artifacts import atomic_output_dir, check_destination, write_json_atomic, write_provenance
    from toolkit.assets import resolve_data_path

    if samples < 1 or max_length < 2 or sensitivity_samples < 0:
        raise ValueError(
            f"samples={samples}, max_length={max_length}, sensitivity_samples={sensitivity_samples}; to resolve, "
            "pass samples >= 1, max_length >= 2 and sensitivity_samples >= 0"
        )
    sensitivity_samples = min(sensitivity_samples, samples)
    value_bits = None if value_bits is None else list(value_bits)
    config = AutoConfig.from_pretrained(model_dir)
    policy = Policy.from_budget(
        rank_budget,
        list(bits),
        model_signature(config)["head_dim"],
        value_bits=value_bits,
        scales=scales_pair(scales),
        sinks=sinks,
        window=window,
        block=block,
    )
    check_destination(out_dir, force)
    resolve_data_path(data)
    options = {
        "data": str(data),
        "samples": samples,
        "max_length": max_length,
        "sinks": sinks,
        "sensitivity_samples": sensitivity_samples,
    }
    partial = Path(out_dir).parent / f".{Path(out_dir).name}.calibrate-partial.safetensors"
    saved = Moments.load(partial)
    moments, done = Moments(), 0
    if saved is not None and saved[1]["options"] == options:
        moments, done = saved[0], saved[1]["done"]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sequences = chat_sequences(tokenizer, max_length, samples, split="train", data=data, tail=True)
    first: list[torch.Tensor] = []  # the sequences the sensitivity is measured on (kept, not re-tokenized)
    for i, ids in enumerate(tqdm(sequences, total=samples, desc="calibrate", disable=not progress)):
        if i < sensitivity_samples:
            first.append(ids)
        if i < done:
            continue
        accumulate(model, [ids], moments, skip=sinks)
        done = i + 1
        if done % checkpoint_every == 0:
            moments.save(partial, {"options": options, "done": done})
    if not moments.layers:
        raise ValueError(f"no calibration sequences were read from {data}; to resolve, check --data")

    tokens = next(iter(moments.layers.values()))[2]
    meta = {
        **model_signature(config),
        "key_fingerprint": key_fingerprint(model),
        "source": str(model_dir),
        "tokens": tokens,
    }
    factors = moments.factors(meta)
    if sensitivity_samples:
        from .allocate import SENSITIVITY_KEY, allocate_key_ranks

        moments.save(partial, {"options": options, "done": done})  # a resumed run measures, not accumulates
        factors.meta[SENSITIVITY_KEY] = measure_sensitivity(
            model, factors, policy, first, partial.with_suffix(".json"), options, progress
        )
        policy = allocate_key_ranks(policy, factors, factors.meta[SENSITIVITY_KEY])
    with atomic_output_dir(out_dir, force) as tmp:
        save_factors(factors, tmp)
        write_json_atomic(tmp / POLICY_FILE, policy.model_dump())
        write_provenance(
            tmp,
            "kvcompress.calibrate",
            source=str(model_dir),
            rank_budget=rank_budget,
            bits=list(bits),
            value_bits=value_bits,
            scales=scales,
            **options,
        )
    partial.unlink(missing_ok=True)
    partial.with_suffix(".json").unlink(missing_ok=True)
    return Path(out_dir)


def measure_sensitivity(
    model,
    factors: Factors,
    policy: Policy,
    sequences: list[torch.Tensor],
    partial: Path,
    options: dict,
    progress: bool,
) -> dict:
    """``kvcompress.allocate.key_sensitivity`` on ``sequences``, resumable: the sums so far are written to
    ``partial`` (JSON) after each sequence, and a run with the same ``options`` and ``policy`` skips the
    sequences done."""
    from tqdm.auto import tqdm

    from toolkit.artifacts import write_json_atomic

    from .allocate import key_sensitivity

    options = {**options, "policy": json.loads(policy.model_dump_json())}  # sums hold for the policy measured
    state = {"options": options, "done": 0, "summed": {}, "tokens": 0}
    if partial.is_file():
        try:
            saved = json.loads(partial.read_text())
            if isinstance(saved, dict) and saved.get("options") == options and saved.keys() >= state.keys():
                state = saved
        except (ValueError, OSError):
            pass
    bar = tqdm(total=len(sequences), initial=state["done"], desc="key sensitivity", disable=not progress)

    def done(summed: dict[int, float], tokens: int) -> None:
        state.update(done=state["done"] + 1, summed={str(k): v for k, v in summed.items()}, tokens=tokens)
        write_json_atomic(partial, state)
        bar.update()

    continuation = min([SENSITIVITY_TOKENS, *(ids.shape[1] // 4 for ids in sequences)])
    result = key_sensitivity(
        model,
        factors,
        policy,
        sequences[state["done"] :],
        continuation,
        summed={int(k): v for k, v in state["summed"].items()},
        tokens=state["tokens"],
        done=done,
    )
    bar.close()
    return result
