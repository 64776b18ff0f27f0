"""``TaleCache``: a transformers ``Cache`` whose layers keep old tokens as quantized low-rank coefficients.

Layout of one layer (``TaleLayer``), in insertion order of the tokens::

    [ sinks (exact) | compressed tokens (tiers) | window (exact) ]

- ``exact_k/exact_v`` ``(batch, heads, n_exact, d)`` hold the sinks followed by the window, model dtype.
- tier ``t`` holds ``k``/``v`` coefficient ``QTensor``s ``(batch, heads, n_t, rank_t)``; which tier each
  compressed token went to is ``tier_ids`` ``(batch, heads, n_compressed * bits / 8)``, packed at
  ``Policy.tier_id_bits`` (2 bits for up to 4 tiers, nothing for one), needed only to mask compressed
  tokens when a padding mask reaches into them.  So that the ids pack into whole bytes, tokens leave the
  window in multiples of ``8 // tier_id_bits``.
- ``acc``/``cnt`` track the significance of the exact tokens: the attention each one received, times the
  number of keys the attending query could see (so 1.0 means "as much as a uniform share"), summed over
  the queries and averaged over the query heads of its KV group; divided by how many queries saw it.
  Sinks and window tokens are the only ones that need it: a token's tier is fixed when it leaves the
  window (lazy approximation) and it is never recomputed or promoted.

``update`` only appends the new exact K/V (it returns them tagged with the layer, ``key.tale_layer``);
attention (``kvcompress.attention``) reads the tiers without rebuilding K/V, updates significance and
then calls ``compress_overflow``.  So every forward pass sees its own new tokens exactly, and the state
between forward passes is always compressed.

Speculative decoding (assisted generation, prompt lookup, suffix decoding): ``activate_past_recording()``
(which ``generate`` calls for assisted decoding) makes each forward pass undoable.  A recorded pass attends
as usual but keeps its queries instead of adding significance, and defers its compression; ``crop(-k)``
then drops its last ``k`` tokens, observes significance from the kept rows and compresses, which leaves
exactly the state the pass would have produced without those tokens.  Only the last pass can be undone:
older tokens may already be compressed, and their significance includes the rows since.

SwiftKV: an AcrossKV group's K/V is written once, into the leader's layer (``config.kv_cache_layer``), and
every layer of the group attends to it.  The layer counts its readers, accumulates significance over all
of them and compresses only after the last one has attended, so every reader sees the same state and the
group is compressed once.  Follower layers never receive KV and stay empty (they need no factors).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import quant
from .factors import Factors, LayerFactors, model_signature
from .policy import Policy

ATTN_IMPLEMENTATION = "tale"
OBSERVED_QUERIES = 64  # a prefill's significance is observed from its last queries only
RESERVED_BLOCKS = (
    4  # spare tier capacity, in blocks, so compressing a block appends instead of copying the tier
)
MAX_UNDO_PREFILL = 64  # tokens ``crop`` can take back from a prefill longer than OBSERVED_QUERIES


class TaleLayer(CacheLayerMixin):
    """One layer's TALE state; see the module docstring for the layout."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # the last forward pass, once past recording is active (see ``crop``)

    def __init__(self, factors: LayerFactors | None, policy: Policy, layer_idx: int, readers: int = 1):
        super().__init__()
        self.factors, self.policy, self.layer_idx, self.readers = factors, policy, layer_idx, readers
        self.record_past = False
        self.reset()

    # --- CacheLayerMixin API -------------------------------------------------------------------------
    def reset(self) -> None:
        self.is_initialized = False
        self.length = 0
        self.exact_k = self.exact_v = self.acc = self.cnt = None
        self.tier_k: list[quant.QTensor | None] = [None] * len(self.policy.tiers)
        self.tier_v: list[quant.QTensor | None] = [None] * len(self.policy.tiers)
        self.tier_ids: torch.Tensor | None = None
        self.n_compressed = 0
        self.unread = 0  # attention passes still due over the tokens of the last update
        self.pass_tokens = 0  # tokens the last update added
        self.pending: list[HeldPass] | None = None  # the last pass's queries, while it can still be cropped

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.exact_k = key_states.new_zeros(b, h, 0, d)
        self.exact_v = value_states.new_zeros(b, h, 0, value_states.shape[-1])
        self.acc = torch.zeros(b, h, 0, device=self.device)
        self.cnt = torch.zeros(b, 0, device=self.device)
        self.tier_ids = torch.zeros(b, h, 0, dtype=torch.uint8, device=self.device)
        f = self.factors
        scored = f.scored_key_basis is not None and self.policy.uses_scored_keys
        key_map, query_map = (f.scored_key_basis, f.scored_query_basis) if scored else (f.key_basis,) * 2
        self.key_map = key_map.to(self.device)  # (h, d, d): coefficients c = k @ key_map[..., :r]
        self.key_query_map = query_map.to(self.device)  # maps queries; k̂ = c @ key_query_map[..., :r]ᵀ
        self.value_map = f.value_basis.to(self.device)  # orthonormal: c = v @ value_map[..., :r]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.factors is None:
            raise ValueError(
                f"layer {self.layer_idx} has no low-rank factors but received KV; to resolve, calibrate this model "
                "(`swiftkv kvcompress calibrate`) so every layer that writes KV has factors"
            )
        if self.unread:
            raise RuntimeError(
                "TaleCache was updated twice without TALE attention in between; to resolve, load the model with "
                f"kvcompress.load_compressed or call kvcompress.enable_tale(model) (attn_implementation='{ATTN_IMPLEMENTATION}')"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.settle()  # a pass nobody cropped is final once the next one starts
        n = key_states.shape[-2]
        b = key_states.shape[0]
        self.exact_k = torch.cat([self.exact_k, key_states], dim=-2)
        self.exact_v = torch.cat([self.exact_v, value_states], dim=-2)
        self.acc = torch.cat([self.acc, self.acc.new_zeros(b, self.acc.shape[1], n)], dim=-1)
        self.cnt = torch.cat([self.cnt, self.cnt.new_zeros(b, n)], dim=-1)
        self.length += n
        self.pass_tokens = n
        self.unread = self.readers
        keys = self.exact_k
        keys.tale_layer = self
        return keys, self.exact_v

    def append_unobserved(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append exact K/V that no query row has attended to, e.g. a prefill computed with another cache
        (``kvcompress.continuation.SharedPrefill``).

        No attention pass follows, so nothing is observed or compressed: like a SwiftKV prompt, these tokens
        stay exact until ``min(Policy.observe, window + 1)`` rows of later passes have seen them.
        """
        self.update(key_states, value_states)
        self.unread = 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        for name in ("exact_k", "exact_v", "acc", "cnt", "tier_ids"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        for tiers in (self.tier_k, self.tier_v):
            tiers[:] = [q.index_select(0, idx) if q is not None else None for q in tiers]

    # --- TALE specifics ------------------------------------------------------------------------------
    @property
    def n_sinks(self) -> int:
        return min(self.policy.sinks, self.length)

    def exact_columns(self, allowed: torch.Tensor) -> torch.Tensor:
        """The mask columns of the exact tokens (sinks then window) from a full ``(..., kv_len)`` mask."""
        s, c = self.n_sinks, self.n_compressed
        return torch.cat([allowed[..., :s], allowed[..., s + c : self.length]], dim=-1)

    def tier_positions(self, tier: int) -> torch.Tensor:
        """Indices (within the compressed range) of tier ``tier``'s tokens, ``(batch, heads, n_tier)``."""
        n = len(self.tier_k[tier])
        return torch.argsort((self.tier_of() != tier).to(torch.uint8), dim=-1, stable=True)[..., :n]

    def tier_of(self) -> torch.Tensor:
        """The tier of every compressed token, ``(batch, heads, n_compressed)`` uint8 (unpacks ``tier_ids``)."""
        bits = self.policy.tier_id_bits
        if bits == 0:
            return self.tier_ids.new_zeros(*self.tier_ids.shape[:2], self.n_compressed)
        return quant.unpack(self.tier_ids, bits)

    def record_significance(
        self, probs: torch.Tensor, allowed: torch.Tensor | None, visible: torch.Tensor | int, groups: int
    ) -> None:
        """Add the attention exact tokens received.

        ``probs`` ``(b, h, g*q, n_exact)``; ``allowed`` the exact columns of the mask ``(b, 1, g*q, n_exact)``;
        ``visible`` ``(b, 1, g*q, 1)`` how many keys (of all kinds) each query could see.  ``allowed=None``:
        every query saw every key, ``visible`` of them (a number).
        """
        if allowed is None:
            self.acc.add_(probs.sum(-2), alpha=visible / groups)
            self.cnt += probs.shape[-2] / groups
            return
        self.acc += (probs * visible).sum(-2) / groups
        self.cnt += allowed.sum(-2).squeeze(1).float() / groups

    def finish_read(self) -> None:
        """Called after each attention pass; once every reader of this KV has attended, compress (or, while
        past recording is active, leave that to ``crop``)."""
        self.unread = max(self.unread - 1, 0)
        if self.unread == 0 and self.pending is None:
            self.compress_overflow()

    def hold_pass(
        self, query: torch.Tensor, allowed: torch.Tensor | None, scaling: float, prefill: bool
    ) -> None:
        """Keep one reader's queries of the current pass so ``crop`` can observe significance from the kept rows.

        A prefill observes only its last ``OBSERVED_QUERIES`` rows, so only the rows that can still be among them
        after a crop of up to ``MAX_UNDO_PREFILL`` tokens are kept; any other pass observes all its rows.
        """
        q = query.shape[-2]
        first = max(0, q - OBSERVED_QUERIES - MAX_UNDO_PREFILL) if prefill else 0
        kept = None if allowed is None else allowed[..., first:, :].clone()
        held = HeldPass(query[..., first:, :].clone(), kept, scaling, first, prefill)
        self.pending = (self.pending or []) + [held]

    # --- rollback (speculative decoding) ------------------------------------------------------------------
    def activate_past_recording(self, **kwargs) -> None:
        """Make every forward pass undoable by ``crop`` (transformers calls this for assisted decoding).

        ``kwargs`` are what transformers passes on to every layer (``recurrent_states_to_keep`` for recurrent
        layers since 5.25); a TALE layer keeps no recurrent state, so it needs none of them.

        A recorded pass attends exactly as usual, but its significance and the compression it triggers wait
        for ``crop`` (or the next update), so the state after ``crop(-k)`` is exactly the state the pass would
        have left without its last ``k`` tokens.
        """
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of the last forward pass, then settle that pass."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): TaleCache is cropped by a negative count of tokens to remove; to resolve, "
                "pass -k to drop the last k tokens"
            )
        k = -tokens_to_remove
        if k == 0 or not self.is_initialized:
            self.settle()
            return
        if not self.record_past:
            raise ValueError(
                "TaleCache can only crop a forward pass recorded for undo; to resolve, call "
                "cache.activate_past_recording() before the forward pass (generate() does it for assisted decoding)"
            )
        if self.pending is None or self.unread:
            raise ValueError(
                f"crop({tokens_to_remove}): the last forward pass is already settled (cropped or followed by another "
                "pass); to resolve, crop right after the forward pass whose tokens you reject"
            )
        if k > self.pass_tokens:
            raise ValueError(
                f"crop removes {k} tokens but the last forward pass added {self.pass_tokens}; to resolve, crop only "
                "tokens of the last pass (compressed older tokens cannot be restored)"
            )
        kept = self.pass_tokens - k
        for held in self.pending:
            if observed_rows(kept, held.prefill)[0] < held.first:
                raise ValueError(
                    f"crop removes {k} tokens of a {self.pass_tokens}-token prefill; to resolve, crop at most "
                    f"{MAX_UNDO_PREFILL} tokens of a long pass"
                )
        self.exact_k, self.exact_v = self.exact_k[..., :-k, :], self.exact_v[..., :-k, :]
        self.acc, self.cnt = self.acc[..., :-k], self.cnt[..., :-k]
        self.length -= k
        self.pass_tokens = kept
        self.settle()

    def settle(self) -> None:
        """Finish a recorded pass: significance from its (kept) rows, then compression."""
        if self.pending is None:
            return
        from .scores import observe  # numba (kvcompress.kernels): imported when a recorded pass settles

        held_passes, self.pending = self.pending, None
        for held in held_passes:
            start, stop = observed_rows(self.pass_tokens, held.prefill)
            rows = slice(start - held.first, stop - held.first)
            allowed = None if held.allowed is None else held.allowed[..., rows, : self.length]
            observe(self, held.query[..., rows, :], allowed, held.scaling)
        self.compress_overflow()

    def compress_overflow(self) -> None:
        """Compress the window's oldest tokens once ``block`` of them have left it (all of them after a prefill)
        and have been observed by enough query rows (``Policy.observe``)."""
        s, n_exact = self.n_sinks, self.exact_k.shape[-2]
        overflow = n_exact - s - self.policy.window
        if overflow < self.policy.block:
            return
        # only tokens enough query rows have attended to (any batch row: padding columns are seen by none)
        need = min(self.policy.observe, self.policy.window + 1)
        seen = self.cnt[:, s : s + overflow].amax(0) / self.readers
        ready = int((seen >= need - 0.5).cumprod(0).sum())
        bits = self.policy.tier_id_bits
        ready -= ready % (8 // bits) if bits else 0  # whole bytes of packed tier ids
        if ready >= self.policy.block:
            self._compress(s, ready)

    def _compress(self, start: int, n: int) -> None:
        stop = start + n
        sig = self.acc[..., start:stop] / self.cnt[:, None, start:stop].clamp_min(1)
        order = torch.argsort(sig, dim=-1, descending=True, stable=True)
        rank = torch.argsort(order, dim=-1)  # 0 = most significant
        counts = self.policy.tier_counts(n)
        bounds = torch.tensor(list(itertools.accumulate(counts))[:-1], device=self.device)
        tier_id = torch.bucketize(rank, bounds, right=True).to(torch.uint8)
        keys, values = self.exact_k[..., start:stop, :], self.exact_v[..., start:stop, :]
        per_block = self.policy.tier_counts(self.policy.block)
        k_ranks = self.policy.key_ranks(self.layer_idx)
        for t, (tier, count) in enumerate(zip(self.policy.tiers, counts, strict=True)):
            if count == 0:
                continue
            idx = torch.argsort((tier_id != t).to(torch.uint8), dim=-1, stable=True)[..., :count]
            reserve = RESERVED_BLOCKS * per_block[t]
            self.tier_k[t] = self._append(
                self.tier_k[t], keys, idx, self.key_map, k_ranks[t], tier.bits, tier.k_scales, reserve
            )
            self.tier_v[t] = self._append(
                self.tier_v[t], values, idx, self.value_map, tier.v_rank, tier.v_bits, tier.v_scales, reserve
            )
        if self.policy.tier_id_bits:
            self.tier_ids = torch.cat([self.tier_ids, quant.pack(tier_id, self.policy.tier_id_bits)], dim=-1)
        keep = lambda x: torch.cat([x[..., :start, :], x[..., stop:, :]], dim=-2).contiguous()  # noqa: E731
        self.exact_k, self.exact_v = keep(self.exact_k), keep(self.exact_v)
        self.acc = torch.cat([self.acc[..., :start], self.acc[..., stop:]], dim=-1).contiguous()
        self.cnt = torch.cat([self.cnt[..., :start], self.cnt[..., stop:]], dim=-1).contiguous()
        self.n_compressed += n

    def _append(self, store, states, idx, basis, rank, bits, scales, reserve: int) -> quant.QTensor:
        picked = torch.gather(states, 2, idx.unsqueeze(-1).expand(*idx.shape, states.shape[-1]))
        coeffs = picked.float() @ basis[..., :rank]
        if bits is None:
            coeffs = coeffs.to(self.dtype)
        new = quant.quantize(coeffs, bits, self.policy.group_size, self.policy.token_group_of(scales))
        return quant.append(store, new, reserve)

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full K/V in insertion order from the stored form (for tests and error analysis, not for attention)."""
        s, c = self.n_sinks, self.n_compressed
        b, h, _, d = self.exact_k.shape
        keys = self.exact_k.new_zeros(b, h, c, d, dtype=torch.float32)
        values = self.exact_v.new_zeros(b, h, c, self.exact_v.shape[-1], dtype=torch.float32)
        for t in range(len(self.policy.tiers)):
            if self.tier_k[t] is None:
                continue
            pos = self.tier_positions(t).unsqueeze(-1)
            ck, cv = quant.dequantize(self.tier_k[t]), quant.dequantize(self.tier_v[t])
            keys.scatter_(
                2,
                pos.expand(*pos.shape[:-1], d),
                ck @ self.key_query_map[..., : ck.shape[-1]].transpose(-1, -2),
            )
            values.scatter_(
                2, pos.expand(*pos.shape[:-1], d), cv @ self.value_map[..., : cv.shape[-1]].transpose(-1, -2)
            )
        full_k = torch.cat([self.exact_k[..., :s, :].float(), keys, self.exact_k[..., s:, :].float()], dim=-2)
        full_v = torch.cat(
            [self.exact_v[..., :s, :].float(), values, self.exact_v[..., s:, :].float()], dim=-2
        )
        return full_k, full_v

    def held_tensors(self) -> list[torch.Tensor]:
        if not self.is_initialized:
            return []
        out = [self.exact_k, self.exact_v, self.acc, self.cnt, self.tier_ids]
        for q in (*self.tier_k, *self.tier_v):
            if q is not None:
                out += q.tensors()
        return out

    def nbytes(self, exact_element_bytes: int | None = None) -> int:
        """Bytes of KV state this layer holds (storages, so views of larger buffers count in full).

        ``exact_element_bytes`` counts the exact K/V at that many bytes an element instead of their dtype's
        (2: what a bf16/fp16 model holds, when measuring with a float32 model)."""
        total = sum(t.untyped_storage().nbytes() for t in self.held_tensors())
        if exact_element_bytes is not None and self.is_initialized:
            for t in (self.exact_k, self.exact_v):
                total += t.numel() * exact_element_bytes - t.untyped_storage().nbytes()
        return total


@dataclass
class HeldPass:
    """One reader's queries of a pass that ``crop`` may still cut: rows ``first..`` of the pass and their mask."""

    query: torch.Tensor
    allowed: torch.Tensor | None  # None: every key visible
    scaling: float
    first: int
    prefill: bool


def observed_rows(pass_tokens: int, prefill: bool) -> tuple[int, int]:
    """The rows of a pass of ``pass_tokens`` whose attention counts as significance (a prefill: its last rows)."""
    if prefill and pass_tokens > OBSERVED_QUERIES:
        return pass_tokens - OBSERVED_QUERIES, pass_tokens
    return 0, pass_tokens


class TaleCache(Cache):
    """Token-adaptive low-rank + multi-level quantized KV cache (TALE); needs ``attn_implementation='tale'``."""

    def __init__(self, factors: Factors, policy: Policy, config, model: torch.nn.Module | None = None):
        config = config.get_text_config(decoder=True)
        factors.check_model(config, model)
        policy.check_head_dim(model_signature(config)["head_dim"])
        if model is not None and model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"the model uses attn_implementation={model.config._attn_implementation!r}; to resolve, call "
                "kvcompress.enable_tale(model) or load it with kvcompress.load_compressed"
            )
        self.policy, self.factors = policy, factors
        owner = getattr(
            config, "kv_cache_layer", lambda i: i
        )  # SwiftKV configs map layers to KV-group leaders
        readers = collections.Counter(owner(i) for i in range(config.num_hidden_layers))
        layers = [
            TaleLayer(factors.layers.get(i), policy, i, readers[i]) for i in range(config.num_hidden_layers)
        ]
        super().__init__(layers=layers)

    def nbytes(self, exact_element_bytes: int | None = None) -> int:
        """KV bytes held by all layers (``exact_element_bytes``: see ``TaleLayer.nbytes``)."""
        return sum(layer.nbytes(exact_element_bytes) for layer in self.layers)

    def stats(self) -> dict:
        """Token counts of the first layer that holds KV: exact and per tier."""
        layer = next((lyr for lyr in self.layers if lyr.is_initialized), None)
        if layer is None:
            return {"tokens": 0, "exact": 0, "tiers": []}
        return {
            "tokens": layer.length,
            "exact": layer.exact_k.shape[-2],
            "tiers": [0 if q is None else len(q) for q in layer.tier_k],
        }
