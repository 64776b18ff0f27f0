"""Baseline policies: a Gavel-like max-sum-throughput ILP, strict FIFO, and a Pollux-like elastic policy.

Gavel and FIFO keep each job at the GPU count it requested and only choose the GPU type (and, for the
Gavel-like policy, who runs this round); the simulator's ``gavel-tuned`` gives Gavel requests tuned per job
with knowledge of the true scaling curve (``TraceJob.tuned_gpus``), the strongest fixed-size baseline.  The
Pollux-like policy is elastic: it chooses every job's GPU count each round by the same goodput ILP as Sia,
with Pollux's fairness exponent p = −1 and the same restart factor, but it is blind to GPU types (a job's
goodput on N GPUs is its mean estimate over the types, so the type is whatever has room).  Jobs here keep
their global batch (distillation rescales gradient accumulation), so goodput is throughput and Pollux's
batch-size adaptation has nothing to adapt.  Gavel's max-sum-throughput objective is Σ normalized throughput,
each job's throughput on a type divided by its best type, so every job counts the same; a tiny bonus for
the current type avoids needless migrations and an even tinier one for age breaks ties toward older
jobs.  FIFO starts jobs in arrival order on the fastest type with room, never preempts, and stops at the
first job that fits nowhere (head-of-line blocking, as in a plain queue).
"""

from __future__ import annotations

import numpy as np

from .configs import Config
from .sia import Problem, assignment_constraints, goodput_matrix, solve
from .spec import Cluster
from .state import JobState

STAY_BONUS, AGE_BONUS = 1e-3, 1e-6


def _requested_options(s: JobState, cluster: Cluster) -> dict[Config, float]:
    """Configurations with the job's requested GPU count, with estimated throughput."""
    out = {}
    for c in s.fits(cluster):
        thr = s.model.estimate(c) if c.gpus == s.requested_gpus else None
        if thr:
            out[c] = thr
    return out


def gavel_policy(jobs: list[JobState], cluster: Cluster) -> dict[str, Config | None]:
    """Max-sum-normalized-throughput over GPU types, requests fixed, solved with ``scipy.optimize.milp``."""
    from scipy.optimize import milp

    var_job, var_cfg, value = [], [], []
    oldest = sorted(jobs, key=lambda s: s.arrival_s)
    rank = {s.name: len(jobs) - k for k, s in enumerate(oldest)}
    for i, s in enumerate(jobs):
        opts = _requested_options(s, cluster)
        if not opts:
            continue
        best = max(opts.values())
        for c, thr in opts.items():
            var_job.append(i), var_cfg.append(c)
            value.append(thr / best + STAY_BONUS * (c == s.current) + AGE_BONUS * rank[s.name])
    out: dict[str, Config | None] = {s.name: None for s in jobs}
    if not var_job:
        return out
    vj = np.asarray(var_job)
    res = milp(
        -np.asarray(value),
        integrality=np.ones(len(vj)),
        bounds=(0, 1),
        constraints=assignment_constraints(vj, var_cfg, len(jobs), cluster),
    )
    for k in np.flatnonzero(res.x > 0.5):
        out[jobs[vj[k]].name] = var_cfg[k]
    return out


def fifo_policy(jobs: list[JobState], cluster: Cluster) -> dict[str, Config | None]:
    """Strict FIFO, non-preemptive: running jobs keep their configuration; the queue starts in order."""
    free = {t.name: t.capacity for t in cluster.gpu_types}
    out: dict[str, Config | None] = {}
    for s in jobs:
        if s.current is not None:
            out[s.name] = s.current
            free[s.current.gpu_type] -= s.current.gpus
    blocked = False
    for s in sorted(jobs, key=lambda s: (s.arrival_s, s.name)):
        if s.current is not None:
            continue
        opts = {c: thr for c, thr in _requested_options(s, cluster).items() if c.gpus <= free[c.gpu_type]}
        if blocked or not opts:
            blocked = True
            out[s.name] = None
            continue
        c = max(opts, key=opts.get)
        out[s.name] = c
        free[c.gpu_type] -= c.gpus
    return out


POLLUX_P = -1.0


def pollux_policy(jobs: list[JobState], cluster: Cluster) -> dict[str, Config | None]:
    """Elastic, heterogeneity-blind: Sia's ILP on type-averaged goodput with p = −1."""
    problem = goodput_matrix(jobs, cluster)
    blind = problem.goodput.copy()
    counts = np.array([c.gpus for c in problem.configs])
    for i in range(len(jobs)):
        for n in np.unique(counts):
            cols = (counts == n) & (blind[i] > 0)
            if cols.any():
                blind[i, cols] = blind[i, cols].mean()
    choice = solve(Problem(jobs, problem.configs, blind), cluster, p=POLLUX_P)
    return {s.name: None if j is None else problem.configs[j] for s, j in zip(jobs, choice, strict=True)}
