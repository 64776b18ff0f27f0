"""Sia configurations: the allocation shapes a job may get, and which of them a job fits in.

Per GPU type with R GPUs per node and N nodes the configurations are 1, 2, 4, ..., R GPUs on one node and
then whole nodes (2R, 3R, ..., N·R).  A job fits a configuration when its GPU count is within the job's
limit, the GPU computes in the job's precision (no bf16 job on a T4), and some ZeRO stage brings the
per-GPU memory under the GPU's memory; the smallest such stage is also
what the launch config uses, so planner and launcher agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .spec import Cluster, GpuType, Job

# Bytes per trainable parameter under bf16 mixed precision with Adam: bf16 weights (2), bf16 grads (2),
# fp32 master weights + two moments (12).  The frozen teacher holds bf16 weights only (2).
WEIGHT_B, GRAD_B, OPTIM_B, TEACHER_B = 2, 2, 12, 2
USABLE_FRACTION = 0.9
"""Share of a GPU's memory the planner may fill (the rest is CUDA context and fragmentation)."""


@dataclass(frozen=True, order=True)
class Config:
    """``gpus`` GPUs of one type spread over ``nodes`` nodes (1 node, or whole nodes)."""

    gpu_type: str
    nodes: int
    gpus: int

    def __str__(self) -> str:
        return f"{self.gpus}x{self.gpu_type}" + (f"@{self.nodes}n" if self.nodes > 1 else "")


def type_configs(gpu: GpuType) -> list[Config]:
    """Configurations of one GPU type: powers of two up to a node, then whole nodes."""
    out, g = [], 1
    while g <= gpu.gpus_per_node:
        out.append(Config(gpu.name, 1, g))
        g *= 2
    out += [Config(gpu.name, n, n * gpu.gpus_per_node) for n in range(2, gpu.nodes + 1)]
    return out


def cluster_configs(cluster: Cluster) -> list[Config]:
    """All configurations of the cluster, grouped by GPU type."""
    return [c for t in cluster.gpu_types for c in type_configs(t)]


def config_for(cluster: Cluster, gpu_type: str, gpus: int) -> Config:
    """The configuration with ``gpus`` GPUs of ``gpu_type``; refuses counts that are not configurations."""
    t = cluster.type(gpu_type)
    nodes = max(1, -(-gpus // t.gpus_per_node))
    cfg = Config(gpu_type, nodes, gpus)
    if cfg not in type_configs(t):
        raise ValueError(
            f"{gpus} GPUs of {gpu_type} is not a configuration; to resolve, use a power of two up to "
            f"{t.gpus_per_node} or a multiple of {t.gpus_per_node} up to {t.capacity}"
        )
    return cfg


@lru_cache(maxsize=64)
def _recipe_and_config(recipe_path: str, config_json: str | None) -> tuple:
    """The job's recipe and its model's config.json, read once (the same reads as ``distill check``)."""
    from ..check import load_recipe_or_usage, model_config_of
    from ..shipped import find

    recipe = load_recipe_or_usage(recipe_path, [])  # a file or a shipped name, as every command takes one
    return recipe, model_config_of(recipe, None if config_json is None else find(config_json, "model config"))


def memory_per_gpu_gb(job: Job, gpus: int, zero_stage: int) -> float:
    """Per-GPU memory (GB) of ``job`` on ``gpus`` data-parallel ranks under a ZeRO stage (0-3).

    By default ``distill check``'s plan for the job's recipe, process count and stage (the same number the user
    sees before launch); with ``activation_gb`` set, model states by bytes per parameter plus that.
    """
    if job.activation_gb is None:
        from ..check import peak_gb, plan
        from ..memory import Parallel

        recipe, config = _recipe_and_config(job.recipe, job.config_json)
        return peak_gb(plan(recipe, config, Parallel(processes=gpus, stage=zero_stage)))
    p, t = job.student_params_b, job.teacher_params_b  # billions of params -> GB per byte/param
    if zero_stage == 0:
        model = p * (WEIGHT_B + GRAD_B + OPTIM_B) + t * TEACHER_B
    elif zero_stage == 1:
        model = p * (WEIGHT_B + GRAD_B) + p * OPTIM_B / gpus + t * TEACHER_B
    elif zero_stage == 2:
        model = p * WEIGHT_B + p * (GRAD_B + OPTIM_B) / gpus + t * TEACHER_B
    elif zero_stage == 3:
        model = (p * (WEIGHT_B + GRAD_B + OPTIM_B) + t * TEACHER_B) / gpus
    else:
        raise ValueError(f"zero_stage={zero_stage}; valid: 0, 1, 2, 3")
    return model + job.activation_gb


def zero_stage(job: Job, gpus: int, memory_gb: float) -> int | None:
    """Smallest ZeRO stage under which ``job`` fits on ``gpus`` GPUs of ``memory_gb``; None if none does."""
    for stage in range(4):
        if memory_per_gpu_gb(job, gpus, stage) <= memory_gb * USABLE_FRACTION:
            return stage
    return None


def precision_ok(job: Job, gpu: GpuType) -> bool:
    """A bf16 job needs a GPU type that computes in bf16."""
    return gpu.bf16 or job.mixed_precision != "bf16"


def job_configs(job: Job, cluster: Cluster) -> list[Config]:
    """The configurations ``job`` fits in (GPU limit, precision and memory)."""
    return [
        c
        for c in cluster_configs(cluster)
        if c.gpus <= job.max_gpus
        and precision_ok(job, cluster.type(c.gpu_type))
        and zero_stage(job, c.gpus, cluster.type(c.gpu_type).memory_gb) is not None
    ]


def require_fit(job: Job, cluster: Cluster) -> list[Config]:
    """``job_configs`` or a one-line error when the job fits no configuration at all."""
    configs = job_configs(job, cluster)
    if not configs and not any(precision_ok(job, t) for t in cluster.gpu_types):
        raise ValueError(
            f"job {job.name!r} trains in bf16 but no GPU type of the cluster has bf16; to resolve, set the "
            "job's mixed_precision (and its recipe's train.mixed_precision) to fp16, or add bf16 GPUs"
        )
    if not configs:
        biggest = max(t.memory_gb for t in cluster.gpu_types if precision_ok(job, t))
        need = memory_per_gpu_gb(job, min(job.max_gpus, cluster.total_gpus), 3)
        raise ValueError(
            f"job {job.name!r} fits no configuration: {need:.1f} GB per GPU even with ZeRO-3 on "
            f"{min(job.max_gpus, cluster.total_gpus)} GPUs vs {biggest:g} GB GPUs; to resolve, raise max_gpus, "
            "lower activation_gb or add larger GPUs"
        )
    return configs
