"""Parameter blocks: the unit that the running checkpoint selects, writes and restores.

A block is a slice of whole rows along dim 0 of one named tensor (a 1-D tensor such as a ZeRO flat partition
is sliced by elements), about ``block_bytes`` of parameter values, or the whole tensor when it is smaller.
The size is raised until a rank has at most ``MAX_BLOCKS`` blocks (so a save never writes more files than
that, however large the partition) and capped at one save's budget (``fraction`` of all the bytes), so that
every block fits a save.  A block's payload is its parameter values plus the matching slice of the optimizer
state for that parameter: state tensors of the parameter's shape are sliced like it, scalar state (Adam's
``step``) is stored whole with every block.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from .config import ScarConfig

PARAM = "param"
STATE = "state."


@dataclass(frozen=True)
class Block:
    id: str
    name: str
    start: int
    stop: int  # rows [start, stop) of dim 0; a 0-dim tensor is one block with (0, 1)

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.dim() == 0 else tensor[self.start : self.stop]


MAX_BLOCKS = 1000  # per rank: bounds the files (and fsyncs) of one save


def _row_bytes(tensor: torch.Tensor) -> int:
    rows = tensor.shape[0] if tensor.dim() else 1
    return max(1, tensor.numel() * tensor.element_size() // max(1, rows))


def _rows_per_block(tensor: torch.Tensor, size: int) -> int:
    return max(1, size // _row_bytes(tensor))


def _count(params: Mapping[str, torch.Tensor], size: int) -> int:
    return sum(-(-(t.shape[0] if t.dim() else 1) // _rows_per_block(t, size)) for t in params.values())


def block_size(params: Mapping[str, torch.Tensor], config: ScarConfig) -> int:
    """The parameter bytes per block: ``block_bytes``, doubled while the rank would have more than
    ``MAX_BLOCKS`` blocks, and at most ``fraction`` of all the bytes (one save's budget).  More tensors than
    ``MAX_BLOCKS`` (whole tensors are never merged) leave more blocks than that."""
    total = sum(t.numel() * t.element_size() for t in params.values())
    budget = max(1, int(config.fraction * total))
    size = min(config.block_bytes, budget)
    while size < budget and _count(params, size) > MAX_BLOCKS:
        size = min(2 * size, budget)
    return size


def make_blocks(params: Mapping[str, torch.Tensor], config: ScarConfig) -> list[Block]:
    """Split named tensors into blocks of ``block_size`` bytes of whole rows, in the order given."""
    size = block_size(params, config)
    blocks = []
    for name, tensor in params.items():
        rows, step = (tensor.shape[0] if tensor.dim() else 1), _rows_per_block(tensor, size)
        if rows <= step:
            blocks.append(Block(name, name, 0, rows))
            continue
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            blocks.append(Block(f"{name}[{start}:{stop}]", name, start, stop))
    return blocks


def _payload_views(
    block: Block, param: torch.Tensor, state: Mapping[str, object] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a block's payload holds (views into the live tensors): its parameter rows, the same rows
    of state tensors shaped like the parameter, and scalar state whole."""
    yield PARAM, block.rows(param.detach())
    for key, value in (state or {}).items():
        if not isinstance(value, torch.Tensor):
            continue  # e.g. a momentum buffer that is still None
        yield STATE + key, (block.rows(value) if value.shape == param.shape else value).detach()


def block_payload(
    block: Block, param: torch.Tensor, state: Mapping[str, object] | None
) -> dict[str, torch.Tensor]:
    """CPU copies of the block's parameter rows and optimizer state, ready for serialization."""
    return {key: view.to("cpu", copy=True).contiguous() for key, view in _payload_views(block, param, state)}


def block_nbytes(block: Block, param: torch.Tensor, state: Mapping[str, object] | None) -> int:
    """Bytes of the block's payload tensors (what a save of it writes, less the file header); the unit of
    the running checkpoint's I/O budget, so that blocks of different sizes are compared fairly."""
    return sum(view.numel() * view.element_size() for _, view in _payload_views(block, param, state))


@torch.no_grad()
def restore_payload(
    block: Block,
    payload: Mapping[str, torch.Tensor],
    param: torch.Tensor,
    state: dict | None,
    whole_param: bool,
) -> None:
    """Write a block's saved values back into the live parameter and optimizer state (in place).

    Scalar state is shared by all blocks of a parameter, so it is only restored when the whole parameter
    is being restored (``whole_param``); survivors keep theirs.  Missing state (a fresh optimizer after a
    full loss) is created with the parameter's shape."""
    block.rows(param).copy_(payload[PARAM])
    if state is None:
        return
    for key, value in payload.items():
        if not key.startswith(STATE):
            continue
        key = key[len(STATE) :]
        current = state.get(key)
        if value.dim() and value.shape[1:] == param.shape[1:] and (current is None or current.dim()):
            if current is None:
                current = state[key] = torch.zeros(param.shape, dtype=value.dtype, device=param.device)
            block.rows(current).copy_(value)
        elif whole_param or current is None:
            state[key] = value.to(current.device if current is not None else "cpu").clone()
