"""Group-wise asymmetric integer quantization of low-rank coefficients, bit-packed into uint8.

Why a quantizer of our own instead of transformers' ``QuantizedCache`` backends: those quantize full K/V
tensors (quanto/HQQ are optional extras, fp8 is per-tensor), whereas TALE quantizes the *coefficients* of
each token in a low-rank basis, with a bit width chosen per token (8/4/2 bits by significance).

Design choices:

- **Two ways to share a scale and zero point** (``Scales``):

  * ``token``: groups along the rank dimension of one token (``group_size`` coefficients share one scale
    and zero point; by default the whole vector is one group).  What KIVI does for values.
  * ``channel``: one scale and zero point per rank position (channel), shared by a group of up to
    ``token_group`` consecutive stored tokens.  What KIVI does for keys, and what fits coefficients in an
    energy-sorted basis: their ranges fall by orders of magnitude along the rank, so one range per token
    spends a 2-bit step of a third of the first coefficient's range on coefficients far smaller than it.
    The fp16 scale/zero cost ``4 * rank / token_group`` bytes a token instead of 4 per group and token.
    Groups are formed per ``quantize`` call (the tokens a block sends to a tier), the last one of a call
    possibly shorter; their first token offsets (``starts``, int32, one entry per group) say where each
    begins.
- **Asymmetric min/max** with the scale and zero point stored in fp16.  Quantization uses the fp16-rounded
  scale and zero, so ``dequantize`` reproduces exactly the grid ``quantize`` rounded to: the error of every
  element is at most half a step (``scale / 2``), up to fp16 rounding of the zero point.
- **Bit packing**: 8 bits → one code a byte, 4 → two, 2 → four, so ``nbytes`` is the memory really held.
  ``bits=16`` stores fp16 and ``bits=None`` stores the input dtype unchanged (no quantization at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT_BITS = (2, 4, 8)
GROWTH = 1 / 16  # spare capacity an ``append`` that outgrows its buffers adds, relative to the new length
ALLOWED_BITS = (*INT_BITS, 16, None)


@dataclass
class QTensor:
    """Quantized ``(..., n, r)`` tensor: packed codes plus per-group fp16 scale/zero (or plain floats)."""

    data: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    bits: int | None
    rank: int
    starts: torch.Tensor | None = None  # channel scales: first token of each group, int32 (None: per token)
    token_group: int | None = None  # channel scales: tokens a group holds at most
    buffers: tuple[torch.Tensor | None, ...] | None = (
        None  # spare-capacity storage the fields view (``append``)
    )

    @property
    def nbytes(self) -> int:
        """Bytes held by the underlying storages (what this tensor really costs in memory)."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.zero, self.starts) if t is not None]

    @property
    def per_channel(self) -> bool:
        return self.starts is not None

    def token_groups(self) -> torch.Tensor:
        """Channel scales: the group index of every stored token, ``(n,)`` int64."""
        lengths = torch.diff(self.starts.long(), append=self.starts.new_tensor([len(self)]).long())
        return torch.repeat_interleave(torch.arange(len(lengths), device=self.data.device), lengths)

    def __len__(self) -> int:
        return self.data.shape[-2]

    def index_select(self, dim: int, index: torch.Tensor) -> QTensor:
        """Select along a leading dim (batch reordering); returns fresh storages."""
        pick = [
            t.index_select(dim, index) if t is not None else None for t in (self.data, self.scale, self.zero)
        ]
        return QTensor(pick[0], pick[1], pick[2], self.bits, self.rank, self.starts, self.token_group)


SCALES = ("token", "channel")


def rank_group(rank: int, group_size: int | None) -> int:
    """Coefficients per token-scale group: ``group_size`` capped at the rank (None: the whole vector)."""
    return min(group_size or rank, rank)


def check_bits(bits: int | None, rank: int, group_size: int | None) -> None:
    """Raise a one-line ValueError unless ``bits``/``rank``/``group_size`` can be packed and grouped
    (``group_size`` above the rank means one group)."""
    if bits not in ALLOWED_BITS:
        raise ValueError(
            f"bits={bits} is not supported; to resolve, use one of 2, 4, 8, 16 or None (no quantization)"
        )
    if bits in INT_BITS:
        if (rank * bits) % 8:
            raise ValueError(
                f"rank {rank} at {bits} bits does not fill whole bytes; to resolve, use a rank divisible by {8 // bits}"
            )
        if group_size is not None and (group_size <= 0 or rank % rank_group(rank, group_size)):
            raise ValueError(
                f"group_size {group_size} does not divide rank {rank}; to resolve, pick a divisor of the rank"
            )


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes < 2**bits along the last dim, ``8 // bits`` codes per byte."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    codes = codes.view(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
    return (codes << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)


def quantize(
    x: torch.Tensor, bits: int | None, group_size: int | None = None, token_group: int | None = None
) -> QTensor:
    """Quantize ``x`` of shape ``(..., n, r)``: with ``token_group``, one scale per channel for each group of up
    to ``token_group`` consecutive tokens; otherwise group-wise along ``r`` (``group_size=None``: one group)."""
    rank = x.shape[-1]
    check_bits(bits, rank, group_size)
    if bits is None:
        return QTensor(x.contiguous().clone(), None, None, None, rank)
    if bits == 16:
        return QTensor(x.to(torch.float16).contiguous(), None, None, 16, rank)
    levels = (1 << bits) - 1
    if token_group:
        n = x.shape[-2]
        groups = -(-n // token_group)
        pad = groups * token_group - n  # repeat the last token: the group's min/max do not change
        padded = torch.cat([x.float(), x[..., -1:, :].float().expand(*x.shape[:-2], pad, rank)], dim=-2)
        grouped = padded.unflatten(-2, (groups, token_group))  # (..., groups, token_group, r)
        scale, zero = _scale_zero(grouped.amin(-2), grouped.amax(-2), levels)  # (..., groups, r)
        per_token = lambda t: t.float().repeat_interleave(token_group, dim=-2)[..., :n, :]  # noqa: E731
        codes = ((x.float() - per_token(zero)) / per_token(scale)).round_().clamp_(0, levels).to(torch.uint8)
        starts = torch.arange(0, n, token_group, dtype=torch.int32, device=x.device)
        return QTensor(pack(codes, bits).contiguous(), scale, zero, bits, rank, starts, token_group)
    group = rank_group(rank, group_size)
    grouped = x.float().reshape(*x.shape[:-1], rank // group, group)
    scale, zero = _scale_zero(grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True), levels)
    codes = ((grouped - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    packed = pack(codes.reshape(*x.shape[:-1], rank), bits)
    return QTensor(
        packed.contiguous(), scale.squeeze(-1).contiguous(), zero.squeeze(-1).contiguous(), bits, rank
    )


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero point of the grid ``zero + scale * [0, levels]`` spanning ``[lo, hi]``."""
    # fp16-safe floor (1e-8 would be 0 in fp16, and a constant group then divides 0 by 0)
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float16).tiny).to(torch.float16)
    return scale.contiguous(), lo.to(torch.float16).contiguous()


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize``: ``(..., n, r)`` tensor in ``dtype``."""
    if q.bits is None or q.bits == 16:
        return q.data.to(dtype)
    codes = unpack(q.data, q.bits).float()
    if q.per_channel:
        gid = q.token_groups()
        return (codes * q.scale.float()[..., gid, :] + q.zero.float()[..., gid, :]).to(dtype)
    groups = q.scale.shape[-1]
    codes = codes.view(*codes.shape[:-1], groups, q.rank // groups)
    values = codes * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def append(store: QTensor | None, new: QTensor, reserve: int) -> QTensor:
    """``store`` followed by ``new`` along the token dim (-2), written into spare capacity when there is room.

    The fields of the result are prefix views of buffers with room for at least ``reserve`` more tokens (and
    ``GROWTH`` of the length; channel scales: the groups those tokens make), so appending a block copies only
    the block, not everything stored before it; ``nbytes`` counts the buffers in full.  Channel groups of
    ``new`` stay groups of their own (a stored group's scales are never refitted).
    """
    old = (None,) * 3 if store is None else (store.data, store.scale, store.zero)
    parts = (new.data, new.scale, new.zero)
    group = new.token_group or 1
    reserves = (reserve, -(-reserve // group), -(-reserve // group))
    needed = [
        None if p is None else (0 if o is None else o.shape[-2]) + p.shape[-2]
        for o, p in zip(old, parts, strict=True)
    ]
    buffers = None if store is None else store.buffers
    if buffers is None or any(
        b is not None and b.shape[-2] < k for b, k in zip(buffers, needed, strict=True)
    ):
        fresh = []
        for o, part, k, extra in zip(old, parts, needed, reserves, strict=True):
            if part is None:
                fresh.append(None)
                continue
            n = 0 if o is None else o.shape[-2]
            buffer = part.new_empty(*part.shape[:-2], k + max(extra, int(GROWTH * k)), part.shape[-1])
            if o is not None:
                buffer[..., :n, :] = o
            fresh.append(buffer)
        buffers = tuple(fresh)
    views = []
    for buffer, o, part in zip(buffers, old, parts, strict=True):
        if buffer is None:
            views.append(None)
            continue
        n, m = (0 if o is None else o.shape[-2]), part.shape[-2]
        buffer[..., n : n + m, :] = part
        views.append(buffer[..., : n + m, :])
    starts = None
    if new.per_channel:
        offset = 0 if store is None else len(store)
        starts = new.starts + offset if store is None else torch.cat([store.starts, new.starts + offset])
    return QTensor(views[0], views[1], views[2], new.bits, new.rank, starts, new.token_group, buffers)


def bytes_per_vector(
    rank: int, bits: int | None, group_size: int | None, float_bytes: int, token_group: int | None = None
) -> float:
    """Bytes one token's ``rank`` coefficients cost at ``bits`` (``float_bytes`` for unquantized storage);
    channel scales (``token_group``) amortized over a full group of tokens."""
    if bits is None:
        return rank * float_bytes
    if bits == 16:
        return rank * 2
    if token_group:
        return rank * bits / 8 + 2 * 2 * rank / token_group
    return rank * bits // 8 + 2 * 2 * (rank // rank_group(rank, group_size))
