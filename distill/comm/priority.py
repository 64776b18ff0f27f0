"""Which gradient blocks go out first under a budget (Bösen's managed communication).

A bucket's flat update (gradient + everything not yet sent) is cut into fixed-size blocks; each block gets a
score and the ``k`` highest go out this step.  Scores must be identical on every rank so that all ranks send
the same blocks in one dense all-reduce: the magnitude scores are summed across ranks by the caller, random
uses a generator seeded by (seed, step, bucket), and fifo uses ages that every rank updates the same way.
"""

from __future__ import annotations

import torch


def blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` zero-padded to a multiple of ``block_size`` and viewed as (blocks, block_size)."""
    pad = (-flat.numel()) % block_size
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size)


def magnitude_scores(update: torch.Tensor, params: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """Per-block sum of |Δ/x| (|Δ| where x = 0), or of |Δ| when ``params`` is None; float32."""
    size = update.abs().float()
    if params is not None:
        x = params.abs().float()
        size = torch.where(x > 0, size / x.clamp_min(torch.finfo(torch.float32).tiny), size)
    return blocks(size, block_size).sum(dim=1)


def random_scores(num_blocks: int, seed: int, step: int, bucket: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((seed, step, bucket)) & 0x7FFF_FFFF_FFFF)
    return torch.rand(num_blocks, generator=gen)


def fifo_scores(ages: torch.Tensor) -> torch.Tensor:
    """Oldest first; among equal ages the lower index first (so fifo is round-robin over the bucket)."""
    n = ages.numel()
    return ages.double() * (n + 1) - torch.arange(n, dtype=torch.float64)


def choose(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` best blocks, in ascending index order (deterministic for equal inputs)."""
    return torch.topk(scores, k, sorted=False).indices.sort().values
