"""``plan``: one Sia round for real jobs — which job runs on which GPU type, how many GPUs, which GPUs.

Input is the validated cluster and job list (with measured throughputs and current placements); output is
a JSON-ready dict that ``launch-configs`` turns into accelerate/DeepSpeed files, so it carries everything
the launcher needs (hosts, GPU indices, ZeRO stage, model sizes).  A job with no measurement yet gets
one short profile run on the smallest configuration it fits of each GPU type, while free capacity lasts;
those runs are held fixed in the ILP like non-preemptible jobs.
"""

from __future__ import annotations

import time
from typing import Any

from .configs import Config, config_for, memory_per_gpu_gb, require_fit, zero_stage
from .placer import place
from .sia import sia_policy
from .spec import Cluster, Job, JobList, Placement
from .state import JobState

PROFILE_TAG = "@profile-"


def job_state(job: Job, cluster: Cluster) -> JobState:
    """The planner's view of a job from ``jobs.yaml`` (errors if it fits no configuration)."""
    require_fit(job, cluster)
    state = JobState(job, age_s=job.age_s, restarts=job.restarts, requested_gpus=1)
    for o in job.observed:
        state.model.observe(config_for(cluster, o.gpu_type, o.gpus), o.throughput)
    if job.current is not None:
        state.current = config_for(cluster, job.current.gpu_type, job.current.num_gpus)
    return state


def _profile_runs(states: list[JobState], cluster: Cluster) -> list[JobState]:
    free = {t.name: t.capacity for t in cluster.gpu_types}
    for s in states:
        if s.current is not None and not s.job.preemptible:
            free[s.current.gpu_type] -= s.current.gpus
    runs = []
    for s in states:
        if s.model.observations:
            continue
        for gpu in cluster.gpu_types:
            fits = [c for c in s.fits(cluster) if c.gpu_type == gpu.name]
            if fits and min(c.gpus for c in fits) <= free[gpu.name]:
                cfg = min(fits, key=lambda c: c.gpus)
                free[gpu.name] -= cfg.gpus
                run = JobState(
                    s.job.model_copy(update={"name": s.name + PROFILE_TAG + gpu.name, "preemptible": False})
                )
                run.current = cfg
                run.model.observe(cfg, 1.0)
                runs.append(run)
    return runs


def plan(cluster: Cluster, jobs: JobList, explore: int = 2, time_limit_s: float = 10.0) -> dict[str, Any]:
    """Sia allocation and placement of ``jobs`` on ``cluster`` for the coming round."""
    states = [job_state(j, cluster) for j in jobs.jobs]
    profiled = [s for s in states if s.model.observations]
    runs = _profile_runs(states, cluster)
    tic = time.perf_counter()
    alloc: dict[str, Config | None] = (
        sia_policy(profiled + runs, cluster, explore, time_limit_s) if profiled or runs else {}
    )
    runtime = time.perf_counter() - tic
    previous = {j.name: j.current for j in jobs.jobs if j.current is not None}
    placed = place(alloc, cluster, previous)
    entries = []
    for s in profiled + runs:
        cfg, where = alloc.get(s.name), placed.get(s.name)
        if cfg is None or where is None:
            continue
        gpu = cluster.type(cfg.gpu_type)
        stage = zero_stage(s.job, cfg.gpus, gpu.memory_gb)
        entries.append(
            {
                "name": s.name,
                "recipe": s.job.recipe,
                "student_params_b": s.job.student_params_b,
                "teacher_params_b": s.job.teacher_params_b,
                "gpu_type": cfg.gpu_type,
                "gpus": cfg.gpus,
                "nodes": cfg.nodes,
                "placement": {str(n): idx for n, idx in sorted(where.gpus.items())},
                "hosts": [gpu.host(n) for n in sorted(where.gpus)],
                "zero_stage": stage,
                "memory_per_gpu_gb": None if stage is None else memory_per_gpu_gb(s.job, cfg.gpus, stage),
                "estimated_throughput": None if PROFILE_TAG in s.name else s.model.estimate(cfg),
                "restart": _moved(previous.get(s.name), where),
                "profile": PROFILE_TAG in s.name,
            }
        )
    return {
        "policy": "sia",
        "policy_runtime_s": runtime,
        "cluster": cluster.model_dump(),
        "jobs": entries,
        "unallocated": sorted(s.name for s in profiled if alloc.get(s.name) is None),
        "to_profile": {
            s.name: sorted({c.gpu_type for c in s.fits(cluster)} - s.model.profiled_types())
            for s in states
            if {c.gpu_type for c in s.fits(cluster)} - s.model.profiled_types()
        },
    }


def _moved(old: Placement | None, new: Placement) -> bool:
    return old is not None and old != new
