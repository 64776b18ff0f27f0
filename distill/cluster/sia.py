"""Sia's goodput-optimized allocation as one integer program, solved by ``scipy.optimize.milp`` (HiGHS).

Rows are jobs, columns configurations.  Each row of the goodput matrix is divided by its minimum, so a
job's worst configuration has normalized goodput 1; the cost of giving job i configuration j is
Ĝ_ij^p with p = −0.5 (minimized: more goodput is cheaper, with diminishing returns that spread GPUs
across jobs), and leaving a job out costs λ = 1.1 > 1, so any allocation beats none.  For a running job
every configuration other than its current one is scaled by the restart factor
r = (T − N·S) / (T + S) (age T, N restarts so far, restart cost S) before the power.  Constraints: at most
one configuration per job; GPUs of each type within capacity; non-preemptible running jobs keep their
configuration.  Dominated columns (same type, more GPUs, no lower cost) are dropped before solving: an
optimum never needs them, and it keeps the program small at 2048 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .configs import Config, cluster_configs
from .spec import Cluster
from .state import JobState

P, LAMBDA = -0.5, 1.1


def restart_factor(age_s: float, restarts: int, restart_s: float) -> float:
    """r = (T − N·S) / (T + S), clipped to [1e-3, 1]."""
    if age_s + restart_s <= 0:
        return 1.0
    return float(np.clip((age_s - restarts * restart_s) / (age_s + restart_s), 1e-3, 1.0))


@dataclass
class Problem:
    """The goodput matrix of one round (0 marks a configuration the job may not use)."""

    jobs: list[JobState]
    configs: list[Config]
    goodput: np.ndarray
    """jobs × configs estimated goodput (samples/s)."""
    mip_gap: float | None = None
    """Relative gap HiGHS reported for the last solve (0 = proven optimal)."""

    @cached_property
    def column(self) -> dict[Config, int]:
        return {c: j for j, c in enumerate(self.configs)}

    def current_index(self, i: int) -> int | None:
        cur = self.jobs[i].current
        return None if cur is None else self.column[cur]


def goodput_matrix(jobs: list[JobState], cluster: Cluster, explore: int = 2) -> Problem:
    """Estimated goodput of every job on every candidate configuration."""
    configs = cluster_configs(cluster)
    col = {c: j for j, c in enumerate(configs)}
    g = np.zeros((len(jobs), len(configs)))
    for i, s in enumerate(jobs):
        for c in s.candidates(cluster, explore):
            g[i, col[c]] = s.model.estimate(c) or 0.0
    return Problem(jobs, configs, g)


def costs(problem: Problem, p: float = P) -> np.ndarray:
    """Cost Ĝ^p of every (job, configuration); +inf where not allowed."""
    g = problem.goodput
    out = np.full(g.shape, np.inf)
    for i, s in enumerate(problem.jobs):
        ok = g[i] > 0
        if not ok.any():
            continue
        norm = g[i, ok] / g[i, ok].min()
        cur = problem.current_index(i)
        if cur is not None:
            r = restart_factor(s.age_s, s.restarts, s.job.restart_s)
            scale = np.full(g.shape[1], r)
            scale[cur] = 1.0
            norm = norm * scale[ok]
        out[i, ok] = norm**p
    return out


def objective(cost: np.ndarray, assignment: list[int | None], lam: float = LAMBDA) -> float:
    """Σ cost of the chosen configurations + λ per unallocated job."""
    return float(sum(lam if j is None else cost[i, j] for i, j in enumerate(assignment)))


def _undominated(cost_row: np.ndarray, configs: list[Config], keep: int | None) -> list[int]:
    best: dict[str, float] = {}
    out = []
    for j in sorted(np.flatnonzero(np.isfinite(cost_row)), key=lambda j: configs[j].gpus):
        t = configs[j].gpu_type
        if cost_row[j] < best.get(t, np.inf) or j == keep:
            out.append(int(j))
            best[t] = min(best.get(t, np.inf), cost_row[j])
    return out


def assignment_constraints(
    var_job: np.ndarray, var_cfg: list[Config], num_jobs: int, cluster: Cluster
) -> list:
    """Rows shared by every allocation ILP: ≤ 1 configuration per job, GPUs per type ≤ capacity."""
    from scipy.optimize import LinearConstraint
    from scipy.sparse import csr_array

    n, types = len(var_cfg), [t.name for t in cluster.gpu_types]
    gpus = np.array([c.gpus for c in var_cfg], float)
    tidx = np.array([types.index(c.gpu_type) for c in var_cfg])
    a_job = csr_array((np.ones(n), (var_job, np.arange(n))), shape=(num_jobs, n))
    a_cap = csr_array((gpus, (tidx, np.arange(n))), shape=(len(types), n))
    caps = np.array([t.capacity for t in cluster.gpu_types], float)
    return [LinearConstraint(a_job, 0, 1), LinearConstraint(a_cap, 0, caps)]


def solve(
    problem: Problem,
    cluster: Cluster,
    p: float = P,
    lam: float = LAMBDA,
    time_limit_s: float = 10.0,
    mip_rel_gap: float = 1e-3,
) -> list[int | None]:
    """Configuration index per job (None = not allocated) minimizing the Sia objective.

    All solving is HiGHS through ``milp``.  First the LP relaxation: it is a lower bound, and at a vertex
    at most one job per GPU type is fractional.  Jobs the LP assigns integrally are fixed and the few
    fractional ones solved exactly as a small ILP; if that answer is within ``mip_rel_gap`` of the LP
    bound it is returned (certified), otherwise the full ILP runs until the gap or ``time_limit_s``.
    ``mip_rel_gap=0`` always gives the exact optimum.  The gap reached is left in ``problem.mip_gap``.
    """
    cost = costs(problem, p)
    configs = problem.configs
    var_job, var_cfg, lower = [], [], []
    for i, s in enumerate(problem.jobs):
        cur = problem.current_index(i)
        if not s.job.preemptible and cur is not None:
            var_job.append(i), var_cfg.append(cur), lower.append(1.0)
            continue
        for j in _undominated(cost[i], configs, cur):
            var_job.append(i), var_cfg.append(j), lower.append(0.0)
    if not var_job:
        return [None] * len(problem.jobs)
    vj, vc = np.asarray(var_job), np.asarray(var_cfg)
    c, lb = cost[vj, vc] - lam, np.asarray(lower)
    rows = assignment_constraints(vj, [configs[j] for j in vc], len(problem.jobs), cluster)
    x, gap = _lp_and_fix(c, lb, vj, rows, mip_rel_gap)
    if x is None:
        x, gap = _milp(c, lb, np.ones(len(c)), rows, {"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap})
    problem.mip_gap = gap
    out: list[int | None] = [None] * len(problem.jobs)
    for k in np.flatnonzero(x > 0.5):
        out[vj[k]] = int(vc[k])
    return out


def _milp(c, lb, ub, rows, options) -> tuple[np.ndarray, float]:
    from scipy.optimize import Bounds, milp

    res = milp(c, integrality=np.ones(len(c)), bounds=Bounds(lb, ub), constraints=rows, options=options)
    if res.x is None:
        raise RuntimeError(
            f"Sia ILP found no solution ({res.message}); non-preemptible jobs exceed capacity?"
        )
    return res.x, float(res.mip_gap or 0.0)


def _lp_and_fix(c, lb, vj, rows, mip_rel_gap) -> tuple[np.ndarray | None, float]:
    from scipy.optimize import Bounds, milp

    lp = milp(c, integrality=np.zeros(len(c)), bounds=Bounds(lb, np.ones(len(c))), constraints=rows)
    if lp.x is None:
        raise RuntimeError(f"Sia LP found no solution ({lp.message}); non-preemptible jobs exceed capacity?")
    frac = (lp.x > 1e-7) & (lp.x < 1 - 1e-7)
    if not frac.any():
        return lp.x, 0.0
    free = np.isin(vj, vj[frac])
    fixed = np.where(lp.x > 0.5, 1.0, 0.0)
    x, _ = _milp(c, np.where(free, lb, fixed), np.where(free, 1.0, fixed), rows, {})
    gap = (c @ x - lp.fun) / max(abs(c @ x), 1e-12)
    return (x, float(gap)) if gap <= mip_rel_gap else (None, 0.0)


def sia_policy(
    jobs: list[JobState], cluster: Cluster, explore: int = 2, time_limit_s: float = 1.0
) -> dict[str, Config | None]:
    """One Sia round: the configuration each job should run on (solver capped at ``time_limit_s``)."""
    problem = goodput_matrix(jobs, cluster, explore)
    choice = solve(problem, cluster, time_limit_s=time_limit_s)
    return {s.name: None if j is None else problem.configs[j] for s, j in zip(jobs, choice, strict=True)}
