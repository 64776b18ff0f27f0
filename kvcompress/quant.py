"""Group-wise asymmetric integer quantization of low-rank coefficients, bit-packed into uint8.

Why a quantizer of our own instead of transformers' ``QuantizedCache`` backends: those quantize full K/V
tensors (quanto/HQQ are optional extras, fp8 is per-tensor), whereas TALE quantizes the *coefficients* of
each token in a low-rank basis, with a bit width chosen per token (8/4/2 bits by significance).

Design choices:

- **Groups along the rank dimension of one token** (``group_size`` coefficients share one scale and one
  zero point; by default the whole coefficient vector is one group, the cheapest in bytes).
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
    buffers: tuple[torch.Tensor | None, ...] | None = (
        None  # spare-capacity storage the fields view (``append``)
    )

    @property
    def nbytes(self) -> int:
        """Bytes held by the underlying storages (what this tensor really costs in memory)."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.zero) if t is not None]

    def __len__(self) -> int:
        return self.data.shape[-2]

    def index_select(self, dim: int, index: torch.Tensor) -> QTensor:
        """Select along a leading dim (batch reordering); returns fresh storages."""
        pick = [
            t.index_select(dim, index) if t is not None else None for t in (self.data, self.scale, self.zero)
        ]
        return QTensor(pick[0], pick[1], pick[2], self.bits, self.rank)


def check_bits(bits: int | None, rank: int, group_size: int | None) -> None:
    """Raise a one-line ValueError unless ``bits``/``rank``/``group_size`` can be packed and grouped."""
    if bits not in ALLOWED_BITS:
        raise ValueError(
            f"bits={bits} is not supported; to resolve, use one of 2, 4, 8, 16 or None (no quantization)"
        )
    if bits in INT_BITS:
        if (rank * bits) % 8:
            raise ValueError(
                f"rank {rank} at {bits} bits does not fill whole bytes; to resolve, use a rank divisible by {8 // bits}"
            )
        if group_size is not None and (group_size <= 0 or rank % group_size):
            raise ValueError(
                f"group_size {group_size} does not divide rank {rank}; to resolve, pick a divisor of the rank"
            )


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes < 2**bits along the last dim, ``8 // bits`` codes per byte."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    codes = codes.view(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
    return (codes << shifts).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)


def quantize(x: torch.Tensor, bits: int | None, group_size: int | None = None) -> QTensor:
    """Quantize ``x`` of shape ``(..., n, r)`` group-wise along ``r``; ``group_size=None`` = one group of ``r``."""
    rank = x.shape[-1]
    check_bits(bits, rank, group_size)
    if bits is None:
        return QTensor(x.contiguous().clone(), None, None, None, rank)
    if bits == 16:
        return QTensor(x.to(torch.float16).contiguous(), None, None, 16, rank)
    group = group_size or rank
    grouped = x.float().reshape(*x.shape[:-1], rank // group, group)
    lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    # fp16-safe floor (1e-8 would be 0 in fp16, and a constant group then divides 0 by 0)
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float16).tiny).to(torch.float16)
    zero = lo.to(torch.float16)
    codes = ((grouped - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    packed = _pack(codes.reshape(*x.shape[:-1], rank), bits)
    return QTensor(
        packed.contiguous(), scale.squeeze(-1).contiguous(), zero.squeeze(-1).contiguous(), bits, rank
    )


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize``: ``(..., n, r)`` tensor in ``dtype``."""
    if q.bits is None or q.bits == 16:
        return q.data.to(dtype)
    codes = _unpack(q.data, q.bits).float()
    groups = q.scale.shape[-1]
    codes = codes.view(*codes.shape[:-1], groups, q.rank // groups)
    values = codes * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def append(store: QTensor | None, new: QTensor, reserve: int) -> QTensor:
    """``store`` followed by ``new`` along the token dim (-2), written into spare capacity when there is room.

    The fields of the result are prefix views of buffers with room for at least ``reserve`` more tokens (and
    ``GROWTH`` of the length), so appending a block copies only the block, not everything stored before it;
    ``nbytes`` counts the buffers in full.
    """
    n, m = (0 if store is None else len(store)), len(new)
    buffers = None if store is None else store.buffers
    if buffers is None or buffers[0].shape[-2] < n + m:
        capacity = n + m + max(reserve, int(GROWTH * (n + m)))
        fresh = []
        for old, part in zip(
            (None,) * 3 if store is None else (store.data, store.scale, store.zero),
            (new.data, new.scale, new.zero),
            strict=True,
        ):
            if part is None:
                fresh.append(None)
                continue
            buffer = part.new_empty(*part.shape[:-2], capacity, part.shape[-1])
            if old is not None:
                buffer[..., :n, :] = old
            fresh.append(buffer)
        buffers = tuple(fresh)
    for buffer, part in zip(buffers, (new.data, new.scale, new.zero), strict=True):
        if buffer is not None:
            buffer[..., n : n + m, :] = part
    views = [None if b is None else b[..., : n + m, :] for b in buffers]
    return QTensor(views[0], views[1], views[2], new.bits, new.rank, buffers)


def bytes_per_vector(rank: int, bits: int | None, group_size: int | None, float_bytes: int) -> int:
    """Bytes one token's ``rank`` coefficients cost at ``bits`` (``float_bytes`` for unquantized storage)."""
    if bits is None:
        return rank * float_bytes
    if bits == 16:
        return rank * 2
    return rank * bits // 8 + 2 * 2 * (rank // (group_size or rank))
