"""Prefill (TTFT) and decode (TPOT) timing on the transformers inference path, interleaved A/B.

Prefill is what ``generate()`` does first: one forward over the prompt with a fresh cache and
``logits_to_keep=1``.  Decode is one new token against a cache of ``context`` tokens, cropped back after each
step.  Each repeat times every model once in a shuffled order, so a slow spell hits all alike; callers report
medians and ratios to the original measured in the same run.  On a GPU the prompt goes to each model's
embedding device and every timed call ends with a device synchronisation.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from transformers.cache_utils import DynamicCache


def input_device(model) -> torch.device:
    """Where inputs go: the embedding's device (accelerate's hooks move them on from there when dispatched)."""
    device = model.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


def _on_model(model, ids: torch.Tensor) -> torch.Tensor:
    return ids.to(input_device(model))


def _sync(ids: torch.Tensor) -> None:
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)


@torch.inference_mode()
def time_prefill(model, ids: torch.Tensor) -> float:
    ids = _on_model(model, ids)
    _sync(ids)
    start = time.perf_counter()
    model(ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    _sync(ids)
    return time.perf_counter() - start


@torch.inference_mode()
def time_decode(model, ids: torch.Tensor, steps: int) -> float:
    """Median seconds of one decode step after prefilling ``ids[:, :-1]``."""
    ids = _on_model(model, ids)
    cache = DynamicCache(config=model.config)
    model(ids[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
    times = []
    for _ in range(steps):
        _sync(ids)
        start = time.perf_counter()
        model(ids[:, -1:], cache=cache, use_cache=True)
        _sync(ids)
        times.append(time.perf_counter() - start)
        cache.crop(-1)
    return statistics.median(times)


def interleaved(models: dict, measure, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median of ``measure(model)`` per model over ``repeats`` shuffled rounds."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        order = list(models)
        rng.shuffle(order)
        for name in order:
            times[name].append(measure(models[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def prompt_ids(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def prefill_times(models: dict, batch: int, length: int, repeats: int) -> dict[str, float]:
    """Median prefill seconds per model for a ``batch x length`` random prompt, after a short warm-up each.

    The one prefill loop of the toolkit: the main job and ``scripts/bench_prefill.py`` both call it.
    """
    vocab = next(iter(models.values())).config.vocab_size
    ids = prompt_ids(vocab, batch, length, seed=length)
    for model in models.values():
        time_prefill(model, ids[:, :64])
    return interleaved(models, lambda m: time_prefill(m, ids), repeats, seed=length)


def decode_times(models: dict, context: int, steps: int, repeats: int) -> dict[str, float]:
    """Median seconds of one decode step per model after a ``context``-token random prompt."""
    vocab = next(iter(models.values())).config.vocab_size
    ids = prompt_ids(vocab, 1, context + 1, seed=1)
    return interleaved(models, lambda m: time_decode(m, ids, steps), repeats)
