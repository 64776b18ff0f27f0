"""Greedy speculative decoding on any transformers causal LM, verifying suffix-cache drafts in one forward pass.

Only the public model/Cache API is used: ``model(input_ids, position_ids, attention_mask, cache=...)`` and
``cache.crop``.  Path drafts run with the model's own causal mask; tree drafts pass a 4D additive mask in
which each draft token sees the cache, the pending tokens and its own ancestors, with position ids = depth.

Rollback keeps no bookkeeping on the cache side: after verification the cache is cropped to the longest
accepted run that is laid out contiguously (tree drafts are laid out depth-first, most probable child first,
so that is usually all of it); accepted tokens past that point, plus the bonus token, are simply fed again
at the front of the next step's input.  Output is the model's greedy output token for token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .cache import SuffixCache
from .draft import Draft


@dataclass
class GenerationStats:
    """What one generation did: output, forward passes and the cost of the speculation itself."""

    tokens: list[int] = field(default_factory=list)
    steps: int = 0  # decoding forward passes (prefill excluded)
    drafted: int = 0
    refed: int = 0  # accepted tree-draft tokens laid out after a rejected branch, fed again next step
    speculate_s: float = 0.0
    speculate_calls: int = 0
    append_s: float = 0.0
    appended: int = 0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per decoding forward pass (1.0 without speculation); the first token comes from prefill."""
        return (len(self.tokens) - 1) / self.steps if self.steps else 0.0


def _select(draft: Draft, order: list[int]) -> Draft:
    """The draft tokens ``order`` (parents before children) in that order, parent indices remapped."""
    new_index = {old: new for new, old in enumerate(order)}
    return Draft(
        tokens=[draft.tokens[i] for i in order],
        parents=[new_index.get(draft.parents[i], -1) for i in order],
        probs=[draft.probs[i] for i in order],
        match_len=draft.match_len,
    )


def layout_depth_first(draft: Draft) -> Draft:
    """Reorder a tree draft depth-first, most probable child first; parents keep preceding children."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        children.setdefault(p, []).append(i)
    order: list[int] = []
    stack = sorted(children.get(-1, []), key=lambda i: draft.probs[i])
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(sorted(children.get(i, []), key=lambda j: draft.probs[j]))
    return _select(draft, order)


def truncate_depth(draft: Draft, max_depth: int) -> Draft:
    """Keep draft tokens at depth <= max_depth (depth 1 = children of the root)."""
    depth: list[int] = []
    keep: list[int] = []
    for i, p in enumerate(draft.parents):
        depth.append(1 if p < 0 else depth[p] + 1)
        if depth[i] <= max_depth:
            keep.append(i)
    return _select(draft, keep)


def _is_path(draft: Draft) -> bool:
    return all(p == i - 1 for i, p in enumerate(draft.parents))


def _tree_inputs(
    draft: Draft, n_cached: int, n_pending: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (1, q) and additive 4D mask (1, 1, q, n_cached + q) for pending tokens + a tree draft."""
    k = len(draft.tokens)
    q = n_pending + k
    depth = [0] * k
    allowed = torch.zeros(q, n_cached + q, dtype=torch.bool)
    allowed[:, :n_cached] = True
    allowed[:n_pending, n_cached : n_cached + n_pending] = torch.tril(
        torch.ones(n_pending, n_pending, dtype=torch.bool)
    )
    allowed[n_pending:, n_cached : n_cached + n_pending] = True
    for i, p in enumerate(draft.parents):
        row = n_pending + i
        if p >= 0:
            depth[i] = depth[p] + 1
            allowed[row, n_cached + n_pending : n_cached + q] = allowed[
                n_pending + p, n_cached + n_pending : n_cached + q
            ]
        else:
            depth[i] = 1
        allowed[row, n_cached + row] = True
    positions = list(range(n_cached, n_cached + n_pending)) + [n_cached + n_pending - 1 + d for d in depth]
    mask = torch.zeros(q, n_cached + q, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return torch.tensor([positions]), mask[None, None]


def _accept(draft: Draft, predicted: list[int], n_pending: int) -> list[int]:
    """Indices of the draft tokens that greedy decoding would have produced, root to leaf."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        children.setdefault(p, []).append(i)
    accepted: list[int] = []
    node, want = -1, predicted[n_pending - 1]
    while True:
        nxt = next((c for c in children.get(node, []) if draft.tokens[c] == want), None)
        if nxt is None:
            return accepted
        accepted.append(nxt)
        node, want = nxt, predicted[n_pending + nxt]


def check_no_sliding_window(config) -> None:
    """Refuse configs with sliding-window attention layers, naming the setting (ValueError)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types if layer_types else window is not None
    if window is not None and sliding:
        raise ValueError(
            f"{type(cfg).__name__} has sliding_window={window}: suffix decoding cannot roll back a "
            "sliding-window cache (DynamicCache cannot crop past the window) and its tree masks would see "
            "the whole cache; to resolve, set sliding_window=None if the model's contexts fit the window, "
            "or decode this model without suffix drafts"
        )


def eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


@torch.no_grad()
def speculative_generate(
    model,
    prompt: Sequence[int],
    max_new_tokens: int,
    suffix_cache: SuffixCache | None = None,
    request_id: int = 0,
    eos_token_ids: set[int] | None = None,
) -> GenerationStats:
    """Greedy generation (batch 1) with drafts from ``suffix_cache``; None = plain greedy in the same loop.

    The response enters the cache's global tree as it is generated.  Models with sliding-window attention
    are refused (ValueError): DynamicCache's sliding layers cannot ``crop`` back past the window, and the
    tree mask would let draft tokens see the whole cache instead of the window.
    """
    from transformers import DynamicCache

    check_no_sliding_window(model.config)

    eos = eos_ids(model) if eos_token_ids is None else eos_token_ids
    device = model.device
    stats = GenerationStats()
    prompt = list(prompt)
    kv = DynamicCache(config=model.config)
    prompt_ids = torch.tensor([prompt], device=device)
    logits = model(input_ids=prompt_ids, cache=kv, use_cache=True, logits_to_keep=1).logits
    first = int(logits[0, -1].argmax())
    stats.tokens.append(first)
    if suffix_cache is not None:
        t0 = time.perf_counter()
        suffix_cache.start_request(request_id, prompt)
        suffix_cache.append(request_id, [first])
        stats.append_s += time.perf_counter() - t0
        stats.appended += len(prompt) + 1
    n_cached, pending = len(prompt), [first]
    while len(stats.tokens) < max_new_tokens and stats.tokens[-1] not in eos:
        draft = Draft()
        if suffix_cache is not None:
            t0 = time.perf_counter()
            draft = suffix_cache.speculate(request_id, prompt + stats.tokens)
            stats.speculate_s += time.perf_counter() - t0
            stats.speculate_calls += 1
            draft = layout_depth_first(truncate_depth(draft, max_new_tokens - len(stats.tokens) - 1))
        ids = torch.tensor([pending + draft.tokens], device=device)
        # every row's logits, said explicitly: a SwiftKV model with exact K/V (exact_kv_window) then runs every
        # pending and draft token, all generated, through its upper layers and caches their exact K/V
        every = ids.shape[1]
        if _is_path(draft):
            logits = model(input_ids=ids, cache=kv, use_cache=True, logits_to_keep=every).logits
        else:
            positions, mask = _tree_inputs(draft, n_cached, len(pending), model.dtype)
            logits = model(
                input_ids=ids,
                position_ids=positions.to(device),
                attention_mask=mask.to(device),
                cache=kv,
                use_cache=True,
                logits_to_keep=every,
            ).logits
        predicted = logits[0].argmax(-1).tolist()
        accepted = _accept(draft, predicted, len(pending))
        bonus = predicted[len(pending) + accepted[-1]] if accepted else predicted[len(pending) - 1]
        contiguous = next((k for k, a in enumerate(accepted) if a != k), len(accepted))
        kv.crop(-(len(draft.tokens) - contiguous))
        n_cached += len(pending) + contiguous
        pending = [draft.tokens[a] for a in accepted[contiguous:]] + [bonus]
        new = [draft.tokens[a] for a in accepted] + [bonus]
        new = new[: max_new_tokens - len(stats.tokens)]
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        new = new if stop is None else new[: stop + 1]
        stats.tokens.extend(new)
        stats.steps += 1
        stats.drafted += len(draft.tokens)
        stats.refed += len(accepted) - contiguous
        if suffix_cache is not None:
            t0 = time.perf_counter()
            suffix_cache.append(request_id, new)
            stats.append_s += time.perf_counter() - t0
            stats.appended += len(new)
    if suffix_cache is not None:
        suffix_cache.finish_request(request_id)
    return stats
