"""The tensors a rank checkpoints under DeepSpeed ZeRO: its fp32 master partitions (ZeRO-1/2
``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_partitioned_groups_flat``), whose optimizer state lives in
the wrapped torch optimizer.  Each rank writes only its own partition; after recovering it, ``push_to_model``
refreshes the model's working weights from the restored masters.  CPU/NVMe offload swapping is not covered.
"""

from __future__ import annotations

import torch


def zero_partitions(ds_optimizer) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """This rank's fp32 master partitions (named ``zero_partition_<group>``) and the base torch optimizer."""
    flat = getattr(ds_optimizer, "single_partition_of_fp32_groups", None)
    if flat is None:
        flat = getattr(ds_optimizer, "fp32_partitioned_groups_flat", None)
    if flat is None:
        raise TypeError(
            f"{type(ds_optimizer).__name__} is not a DeepSpeed ZeRO optimizer; to resolve, pass the "
            "optimizer of the DeepSpeed engine (accelerate: prepared_optimizer.optimizer)"
        )
    return {f"zero_partition_{i}": t for i, t in enumerate(flat)}, ds_optimizer.optimizer


@torch.no_grad()
def push_to_model(ds_optimizer) -> None:
    """Copy restored fp32 masters into the model's weights (ZeRO-1/2: all-gather, so every rank calls it)."""
    if hasattr(ds_optimizer, "single_partition_of_fp32_groups"):
        ds_optimizer.update_lp_params()
        return
    for low, master in zip(
        ds_optimizer.fp16_partitioned_groups_flat, ds_optimizer.fp32_partitioned_groups_flat, strict=True
    ):
        low.copy_(master)
