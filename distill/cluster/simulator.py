"""Round-based cluster simulator: replay a trace under a policy and measure JCT, makespan and GPU-hours.

Every ``round_s`` seconds the policy sees the jobs that have arrived and are unfinished, returns a
configuration per job, and the placer maps it to GPUs.  A job whose GPUs changed (or that starts) loses
its restart cost before it makes progress; a job left out makes none.  Throughput comes from the trace's
true model; policies only see their bootstrapped estimates, which the simulator feeds with the profile of
each new job (smallest fitting configuration per GPU type, taken as free) and with the observed
throughput of every running job.  Every run segment is recorded so that work conservation can be checked.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .baselines import fifo_policy, gavel_policy, pollux_policy
from .configs import Config
from .placer import place
from .sia import sia_policy
from .spec import Cluster, Job, Placement
from .state import JobState
from .trace import TraceJob

Policy = Callable[[list[JobState], Cluster], dict[str, Config | None]]
POLICIES: dict[str, Policy] = {
    "sia": sia_policy,
    "pollux": pollux_policy,
    "gavel": gavel_policy,
    "gavel-tuned": gavel_policy,
    "fifo": fifo_policy,
}
TUNED = {"gavel-tuned"}
"""Policies whose fixed requests are tuned per job (``TraceJob.tuned_gpus``) instead of the user's request."""


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid: {sorted(POLICIES)}")
    return POLICIES[name]


@dataclass
class Segment:
    """A stretch of productive time of one job on one configuration."""

    job: str
    start: float
    end: float
    config: Config
    throughput: float


@dataclass
class SimResult:
    policy: str
    jct: dict[str, float]
    finish: dict[str, float]
    segments: list[Segment]
    gpu_seconds: float
    policy_runtime_s: list[float]
    usage: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    """(round start, GPUs allocated per type) for every round."""
    unfinished: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        jct = np.array(list(self.jct.values())) if self.jct else np.array([np.nan])
        return {
            "jobs_done": len(self.jct),
            "avg_jct_h": float(jct.mean() / 3600),
            "p99_jct_h": float(np.percentile(jct, 99) / 3600),
            "makespan_h": float(max(self.finish.values(), default=np.nan) / 3600),
            "gpu_hours": self.gpu_seconds / 3600,
            "policy_ms_median": float(np.median(self.policy_runtime_s) * 1e3),
            "policy_ms_max": float(np.max(self.policy_runtime_s) * 1e3),
        }


SYNTHETIC_ACTIVATION_GB = 4.0
"""Per-GPU activation memory of a synthetic trace job (it has no recipe to estimate from)."""


def _job_spec(t: TraceJob) -> Job:
    return Job(
        name=t.name,
        student_params_b=t.student_params_b,
        max_gpus=t.max_gpus,
        restart_s=t.restart_s,
        activation_gb=SYNTHETIC_ACTIVATION_GB,
    )


def _profile(state: JobState, trace: TraceJob, cluster: Cluster) -> None:
    for gpu in cluster.gpu_types:
        fits = [c for c in state.fits(cluster) if c.gpu_type == gpu.name]
        if fits:
            smallest = min(fits, key=lambda c: c.gpus)
            state.model.observe(smallest, trace.throughput(smallest))


def simulate(
    cluster: Cluster,
    trace: list[TraceJob],
    policy: str,
    round_s: float = 60.0,
    max_rounds: int | None = None,
    progress: bool = False,
) -> SimResult:
    """Replay ``trace`` under ``policy`` until every job finished (or ``max_rounds`` rounds)."""
    from tqdm.auto import tqdm

    decide = get_policy(policy)
    pending = sorted(trace, key=lambda j: j.arrival_s)
    by_name = {j.name: j for j in trace}
    states: dict[str, JobState] = {}
    done_work: dict[str, float] = {}
    delay: dict[str, float] = {}
    placements: dict[str, Placement] = {}
    started: set[str] = set()
    result = SimResult(policy, {}, {}, [], 0.0, [])
    bar = tqdm(total=len(trace), desc=f"simulate {policy}", disable=not progress)
    now, rounds = 0.0, 0
    while (pending or states) and (max_rounds is None or rounds < max_rounds):
        if not states and pending[0].arrival_s > now:
            now = math.ceil(pending[0].arrival_s / round_s) * round_s
        while pending and pending[0].arrival_s <= now:
            t = pending.pop(0)
            request = t.tuned_gpus(cluster) if policy in TUNED else t.requested_gpus
            s = JobState(_job_spec(t), arrival_s=t.arrival_s, requested_gpus=request)
            _profile(s, t, cluster)
            states[t.name], done_work[t.name], delay[t.name] = s, 0.0, 0.0
        active = list(states.values())
        for s in active:
            s.age_s = now - s.arrival_s
        tic = time.perf_counter()
        alloc = decide(active, cluster)
        result.policy_runtime_s.append(time.perf_counter() - tic)
        new_place = place(
            alloc, cluster, {s.name: placements[s.name] for s in active if s.name in placements}
        )
        usage = {g.name: 0 for g in cluster.gpu_types}
        for s in active:
            old, new = placements.pop(s.name, None), new_place.get(s.name)
            if new is not None and new != old:
                s.restarts += s.name in started
                started.add(s.name)
                delay[s.name] = s.job.restart_s
            s.current = alloc[s.name] if new is not None else None
            if new is None:
                continue
            placements[s.name] = new
            usage[s.current.gpu_type] += s.current.gpus
            _advance(result, s, by_name[s.name], now, round_s, done_work, delay)
            if s.name in result.finish:
                del states[s.name], placements[s.name]
                bar.update(1)
        result.usage.append((now, usage))
        now += round_s
        rounds += 1
    bar.close()
    result.unfinished = sorted(states) + [j.name for j in pending]
    return result


def _advance(
    result: SimResult,
    s: JobState,
    trace: TraceJob,
    now: float,
    round_s: float,
    done_work: dict[str, float],
    delay: dict[str, float],
) -> None:
    """Run one job for one round on ``s.current``: restart delay first, then progress until done."""
    cfg = s.current
    lost = min(delay[s.name], round_s)
    delay[s.name] -= lost
    start, thr = now + lost, trace.throughput(cfg)
    need = trace.work - done_work[s.name]
    finishes = need / thr <= now + round_s - start
    end = start + need / thr if finishes else now + round_s
    if end > start:
        result.segments.append(Segment(s.name, start, end, cfg, thr))
        s.model.observe(cfg, thr)
    done_work[s.name] = trace.work if finishes else done_work[s.name] + thr * (end - start)
    if finishes:
        result.finish[s.name] = end
        result.jct[s.name] = end - trace.arrival_s
    result.gpu_seconds += cfg.gpus * (end - now)
