"""``kvcompress calibrate``: low-rank KV bases from calibration activations.

The K/V that matter are exactly what the model hands to ``cache.update`` — post-RoPE keys and values, for
the layers that own KV — so calibration runs the model with a recording cache (``MomentLayer``) and
accumulates each layer's per-head second moments ``Σ k kᵀ`` and ``Σ v vᵀ`` in float64.  No model code is
patched or imported, so the same function calibrates a base model or a SwiftKV model (only the AcrossKV
group leaders call ``update``, so only they get factors).

Why activations rather than an SVD of ``W_k``/``W_v``: keys are needed post-RoPE (see
``kvcompress.factors``), which a weight SVD cannot describe, and for values the activation PCA is the
optimum for the data distribution while a weight SVD assumes isotropic inputs.  ``scripts/bench_kvcompress.py
--compare-bases`` measures both on held-out text.

Calibration data defaults to the first ``samples`` ShareGPT conversations (chat template applied,
truncated to ``max_length`` tokens) from the train split; the benchmark evaluates on the held-out split.
Progress is checkpointed every ``checkpoint_every`` samples next to the output, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .factors import (
    POLICY_FILE,
    Factors,
    LayerFactors,
    bases_from_moments,
    key_fingerprint,
    model_signature,
    save_factors,
)
from .policy import Policy


class MomentLayer(DynamicLayer):
    """A ``DynamicLayer`` that also accumulates per-head second moments of what it is given."""

    def __init__(self):
        super().__init__()
        self.key_moment = self.value_moment = None
        self.count = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k, v = key_states.detach().double(), value_states.detach().double()
        km, vm = torch.einsum("bhnd,bhne->hde", k, k), torch.einsum("bhnd,bhne->hde", v, v)
        self.key_moment = km if self.key_moment is None else self.key_moment + km
        self.value_moment = vm if self.value_moment is None else self.value_moment + vm
        self.count += k.shape[0] * k.shape[2]
        return super().update(key_states, value_states, *args, **kwargs)


class Moments:
    """Running second moments per layer, summed over calibration sequences (serializable for resume)."""

    def __init__(self):
        self.layers: dict[int, list] = {}

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
            layers[idx] = LayerFactors(kb, ks, vb, vs)
        return Factors(layers, meta)


@torch.no_grad()
def accumulate(
    model: torch.nn.Module, sequences: Iterable[torch.Tensor], moments: Moments | None = None
) -> Moments:
    """Run ``model`` over token sequences ``(1, n)`` and add their KV second moments to ``moments``."""
    moments = moments or Moments()
    device = next(model.parameters()).device
    for ids in sequences:
        cache = Cache(layer_class_to_replicate=MomentLayer)
        model(input_ids=ids.to(device), cache=cache, use_cache=True)
        moments.add(cache)
    return moments


def factors_from_model(model: torch.nn.Module, sequences: Iterable[torch.Tensor], **meta) -> Factors:
    """In-memory calibration: bases for every KV-writing layer of ``model`` from ``sequences``."""
    moments = accumulate(model, sequences)
    return moments.factors(
        {**model_signature(model.config), "key_fingerprint": key_fingerprint(model), **meta}
    )


def sharegpt_sequences(
    tokenizer, data: str, samples: int, max_length: int, offset: int = 0
) -> Iterator[torch.Tensor]:
    """Chat-formatted ShareGPT conversations as ``(1, n)`` token tensors, truncated to ``max_length``."""
    from swiftkv.assets import iter_conversations

    for i, messages in enumerate(iter_conversations(data, limit=offset + samples, split="train")):
        if i < offset:
            continue
        text = (
            tokenizer.apply_chat_template(messages, tokenize=False)
            if tokenizer.chat_template
            else "\n".join(m["content"] for m in messages)
        )
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length).input_ids
        if ids.shape[1] >= 2:
            yield ids


def calibrate(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    data: str = "sharegpt",
    samples: int = 256,
    max_length: int = 512,
    rank_budget: float = 0.25,
    bits: Sequence[int | None] = (8, 4, 2),
    sinks: int = 4,
    window: int = 64,
    block: int = 32,
    force: bool = False,
    checkpoint_every: int = 32,
    progress: bool = True,
) -> Path:
    """Calibrate low-rank KV factors for ``model_dir`` and write them (with a default policy) to ``out_dir``."""
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from swiftkv.artifacts import atomic_output_dir, check_destination, write_json_atomic, write_provenance
    from swiftkv.assets import resolve_data_path

    if samples < 1 or max_length < 2:
        raise ValueError(
            f"samples={samples}, max_length={max_length}; to resolve, pass samples >= 1 and max_length >= 2"
        )
    config = AutoConfig.from_pretrained(model_dir)
    policy = Policy.from_budget(
        rank_budget, list(bits), model_signature(config)["head_dim"], sinks=sinks, window=window, block=block
    )
    check_destination(out_dir, force)
    resolve_data_path(data)
    options = {"data": str(data), "samples": samples, "max_length": max_length}
    partial = Path(out_dir).parent / f".{Path(out_dir).name}.calibrate-partial.pt"
    state = torch.load(partial, weights_only=False) if partial.is_file() else None
    if state is None or state["options"] != options:
        state = {"options": options, "done": 0, "moments": Moments().layers}

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    moments = Moments()
    moments.layers = state["moments"]
    sequences = sharegpt_sequences(tokenizer, data, samples, max_length)
    done = state["done"]
    for i, ids in enumerate(tqdm(sequences, total=samples, desc="calibrate", disable=not progress)):
        if i < done:
            continue
        accumulate(model, [ids], moments)
        done = i + 1
        if done % checkpoint_every == 0:
            torch.save({"options": options, "done": done, "moments": moments.layers}, partial)
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
    with atomic_output_dir(out_dir, force) as tmp:
        save_factors(factors, tmp)
        write_json_atomic(tmp / POLICY_FILE, policy.model_dump())
        write_provenance(
            tmp,
            "kvcompress.calibrate",
            source=str(model_dir),
            rank_budget=rank_budget,
            bits=list(bits),
            **options,
        )
    partial.unlink(missing_ok=True)
    return Path(out_dir)
