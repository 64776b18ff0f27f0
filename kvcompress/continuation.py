"""Feeding a text through a cache as the quality measurements do: one shared prefill for every cache, the
continuation in chunks, and the comparison of two runs' logits.

Why a module of its own: both the evaluation (``kvcompress.evaluate``) and the per-layer sensitivity
calibration measures (``kvcompress.allocate``) run texts this way, and the evaluation builds its caches with
the allocation, so these live below both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import OBSERVED_QUERIES, TaleCache


class SharedPrefill:
    """One prompt's prefill, computed once, that starts every method's cache as its own prefill would.

    Why: a prefill is the same exact attention whatever cache follows it (TALE compresses only after the
    pass; transformers' caches, the quantized ones included, attend over the exact states of their first
    update), and at long contexts it is most of a benchmark's time.  So the prompt runs once, through sdpa's
    causal kernel into a ``DynamicCache``, and ``start`` hands it to each method's fresh cache:

    - any transformers cache receives all the K/V in one ``update`` per layer, as in its own prefill, and
      the prefill's logits;
    - a ``TaleCache`` receives the K/V of all but the last ``OBSERVED_QUERIES`` tokens unobserved
      (``TaleLayer.append_unobserved``), and those last tokens run through the model with TALE attention:
      significance then comes from the same last rows as in its own prefill, and compression follows.

    The result equals the method's own prefill up to float rounding (only the kernel that computed the
    shared K/V differs; ``tests/kvcompress/test_tale.py`` compares).  Holds the prompt's full K/V.
    """

    @torch.no_grad()
    def __init__(self, model, ids: torch.Tensor):
        from transformers import DynamicCache

        self.model, self.ids = model, ids
        previous = model.config._attn_implementation
        model.set_attn_implementation("sdpa")  # the causal kernel: no (n, n) mask at long contexts
        self.cache = DynamicCache(config=model.config)
        self.logits = model(ids, cache=self.cache, logits_to_keep=1).logits
        model.set_attn_implementation(previous)

    @torch.no_grad()
    def start(self, cache) -> torch.Tensor:
        """Fill the fresh ``cache`` as prefilling the prompt would (the model set to the cache's attention);
        returns the logits of the prompt's last position ``(b, 1, vocab)``."""
        layers = [(i, layer) for i, layer in enumerate(self.cache.layers) if layer.is_initialized]
        if not isinstance(cache, TaleCache):
            for i, layer in layers:
                cache.update(layer.keys, layer.values, i)
            return self.logits
        head = self.ids.shape[1] - OBSERVED_QUERIES
        if head <= 0:
            return self.model(self.ids, cache=cache, logits_to_keep=1).logits
        for i, layer in layers:
            cache.layers[i].append_unobserved(layer.keys[..., :head, :], layer.values[..., :head, :])
        return self.model(self.ids[:, head:], cache=cache, logits_to_keep=1).logits


@torch.no_grad()
def continuation_logits(
    model, ids: torch.Tensor, cache, prefix: int, chunk: int, shared: SharedPrefill | None = None
) -> torch.Tensor:
    """Float32 logits predicting ``ids[:, prefix:]``: prefill ``ids[:, :prefix]`` (or start from ``shared``,
    its prefill), then feed the rest in chunks."""
    first = shared.start(cache) if shared else model(ids[:, :prefix], cache=cache, logits_to_keep=1).logits
    logits = [first]
    for i in range(prefix, ids.shape[1] - 1, chunk):
        logits.append(model(ids[:, i : min(i + chunk, ids.shape[1] - 1)], cache=cache).logits)
    return torch.cat(logits, dim=1).float()


def compare(logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Summed NLL, summed KL(ref ‖ logits) and top-1 agreements over positions (and the count)."""
    logp, ref_logp = F.log_softmax(logits, -1), F.log_softmax(ref, -1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    agree = (logits.argmax(-1) == ref.argmax(-1)).float()
    return {"nll": float(nll.sum()), "kl": float(kl.sum()), "agree": float(agree.sum()), "n": targets.numel()}
