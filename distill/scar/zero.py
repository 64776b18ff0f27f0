"""The tensors a rank checkpoints under DeepSpeed ZeRO: its fp32 master partitions, whose optimizer state
lives in the wrapped torch optimizer.  The partition lists differ by optimizer class: ZeRO-1/2
(``DeepSpeedZeroOptimizer``) ``single_partition_of_fp32_groups``, ZeRO-1 with bf16 (``BF16_Optimizer``)
``fp32_groups_flat_partition``, ZeRO-3 ``fp32_partitioned_groups_flat``.  Each rank writes only its own
partition; after recovering it, ``push_to_model`` refreshes the model's working weights from the restored
masters.  CPU/NVMe offload swapping is not covered.
"""

from __future__ import annotations

import torch

PARTITION_LISTS = (
    "single_partition_of_fp32_groups",
    "fp32_groups_flat_partition",
    "fp32_partitioned_groups_flat",
)


def zero_partitions(ds_optimizer) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """This rank's fp32 master partitions (named ``zero_partition_<group>``) and the base torch optimizer."""
    for attribute in PARTITION_LISTS:
        flat = getattr(ds_optimizer, attribute, None)
        if flat is not None:
            return {f"zero_partition_{i}": t for i, t in enumerate(flat)}, ds_optimizer.optimizer
    raise TypeError(
        f"{type(ds_optimizer).__name__} is not a DeepSpeed ZeRO optimizer; to resolve, pass the "
        "optimizer of the DeepSpeed engine (accelerate: prepared_optimizer.optimizer)"
    )


@torch.no_grad()
def push_to_model(ds_optimizer) -> None:
    """Copy restored fp32 masters into the model's weights (ZeRO-1/2 and bf16: all-gather, so every rank
    calls it)."""
    if not hasattr(ds_optimizer, "fp32_partitioned_groups_flat"):
        ds_optimizer.update_lp_params()
        return
    for low, master in zip(
        ds_optimizer.fp16_partitioned_groups_flat, ds_optimizer.fp32_partitioned_groups_flat, strict=True
    ):
        low.copy_(master)
