"""Sia planner: ILP = brute force, capacity, restart factor, bootstrapping rule, placer, input errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from distill.cluster.configs import Config, cluster_configs, config_for, zero_stage
from distill.cluster.placer import place
from distill.cluster.sia import LAMBDA, P, costs, goodput_matrix, objective, restart_factor, solve
from distill.cluster.spec import Cluster, Job, load_cluster, load_jobs
from distill.cluster.state import JobState
from distill.cluster.throughput import ThroughputModel

TINY = Cluster.model_validate(
    {
        "gpu_types": [
            {"name": "fast", "nodes": 1, "gpus_per_node": 4, "memory_gb": 80},
            {"name": "slow", "nodes": 2, "gpus_per_node": 2, "memory_gb": 24},
        ]
    }
)


def random_jobs(rng: np.random.Generator, n: int) -> list[JobState]:
    """Jobs with random 1-GPU profiles, a few multi-GPU observations, some running, one pinned."""
    configs = cluster_configs(TINY)
    jobs = []
    for k in range(n):
        s = JobState(
            Job(
                activation_gb=4.0,
                name=f"j{k}",
                max_gpus=int(rng.choice([2, 4])),
                restart_s=float(rng.uniform(10, 60)),
            )
        )
        for t in ("fast", "slow"):
            s.model.observe(Config(t, 1, 1), float(rng.uniform(1, 10)))
        for c in rng.choice(len(configs), 2, replace=False):
            if configs[c].gpus > 1 and configs[c].gpus <= s.job.max_gpus:
                s.model.observe(configs[c], float(rng.uniform(1, 30)))
        if rng.random() < 0.5:
            s.current = Config("slow", 1, 1) if rng.random() < 0.5 else Config("fast", 1, 2)
            s.age_s, s.restarts = float(rng.uniform(0, 600)), int(rng.integers(0, 3))
        jobs.append(s)
    jobs[0].job = jobs[0].job.model_copy(update={"preemptible": False})
    jobs[0].current = Config("slow", 1, 1)
    return jobs


def brute_force(problem, cost: np.ndarray) -> float:
    caps = {t.name: t.capacity for t in TINY.gpu_types}
    options = []
    for i, s in enumerate(problem.jobs):
        cur = problem.current_index(i)
        allowed = [int(j) for j in np.flatnonzero(np.isfinite(cost[i]))]
        options.append([cur] if not s.job.preemptible else [None, *allowed])
    best = np.inf
    for assign in itertools.product(*options):
        used = {t: 0 for t in caps}
        for j in assign:
            if j is not None:
                used[problem.configs[j].gpu_type] += problem.configs[j].gpus
        if all(used[t] <= caps[t] for t in caps):
            best = min(best, objective(cost, list(assign)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_brute_force_and_respects_capacity(seed):
    rng = np.random.default_rng(seed)
    jobs = random_jobs(rng, 4)
    problem = goodput_matrix(jobs, TINY)
    cost = costs(problem)
    choice = solve(problem, TINY, mip_rel_gap=0.0)
    best = brute_force(problem, cost)
    assert objective(cost, choice) == pytest.approx(best, rel=1e-9, abs=1e-9) and problem.mip_gap == 0
    assert objective(cost, solve(problem, TINY)) <= best + 1e-3 * abs(best - LAMBDA * len(jobs)) + 1e-9
    for t in TINY.gpu_types:
        assert (
            sum(
                problem.configs[j].gpus
                for j in choice
                if j is not None and problem.configs[j].gpu_type == t.name
            )
            <= t.capacity
        )
    assert choice[0] == problem.current_index(0)  # non-preemptible job stays
    alloc = {s.name: None if j is None else problem.configs[j] for s, j in zip(jobs, choice, strict=True)}
    placed = place(alloc, TINY)
    seen = set()
    for name, p in placed.items():
        assert (
            p.gpu_type == alloc[name].gpu_type
            and p.num_gpus == alloc[name].gpus
            and len(p.gpus) == alloc[name].nodes
        )
        for node, idx in p.gpus.items():
            gpu = TINY.type(p.gpu_type)
            assert 0 <= node < gpu.nodes and all(0 <= g < gpu.gpus_per_node for g in idx)
            cells = {(p.gpu_type, node, g) for g in idx}
            assert not cells & seen
            seen |= cells


@pytest.mark.parametrize("seed", range(4))
def test_certified_lp_and_fix_gap_bounds_the_true_gap(seed):
    cluster = Cluster.model_validate(
        {
            "gpu_types": [
                {"name": "a", "nodes": 2, "gpus_per_node": 4, "memory_gb": 80},
                {"name": "b", "nodes": 3, "gpus_per_node": 4, "memory_gb": 24},
            ]
        }
    )
    rng, jobs = np.random.default_rng(seed), []
    for k in range(30):  # concave measured scaling on every configuration: fractional LP vertices
        s = JobState(Job(activation_gb=4.0, name=f"j{k}", max_gpus=8))
        for c in cluster_configs(cluster):
            if c.gpus <= 8:
                s.model.observe(c, float(rng.uniform(1, 3) * c.gpus ** rng.uniform(0.5, 0.95)))
        jobs.append(s)
    problem = goodput_matrix(jobs, cluster)
    cost, shift = costs(problem), LAMBDA * len(jobs)
    exact = objective(cost, solve(problem, cluster, mip_rel_gap=0.0)) - shift
    for gap in (0.05, 1e-3):
        fast = objective(cost, solve(problem, cluster, mip_rel_gap=gap)) - shift
        assert problem.mip_gap <= gap
        assert exact - 1e-9 <= fast <= exact + problem.mip_gap * abs(fast) + 1e-9  # the certificate holds


def test_restart_factor_only_off_the_current_configuration():
    s = JobState(
        Job(activation_gb=4.0, name="run", restart_s=30.0),
        age_s=300.0,
        restarts=2,
        current=Config("fast", 1, 2),
    )
    q = JobState(Job(activation_gb=4.0, name="queued", restart_s=30.0), age_s=300.0, restarts=2)
    for st in (s, q):
        st.model.observe(Config("fast", 1, 1), 4.0)
        st.model.observe(Config("fast", 1, 2), 7.0)
        st.model.observe(Config("slow", 1, 1), 2.0)
    problem = goodput_matrix([s, q], TINY)
    cost = costs(problem)
    r = restart_factor(300.0, 2, 30.0)
    assert r == pytest.approx((300 - 2 * 30) / (300 + 30))
    g = problem.goodput
    for j, c in enumerate(problem.configs):
        if g[0, j] > 0:
            factor = 1.0 if c == s.current else r
            assert cost[0, j] == pytest.approx((factor * g[0, j] / g[0][g[0] > 0].min()) ** P)
            assert cost[1, j] == pytest.approx((g[1, j] / g[1][g[1] > 0].min()) ** P)
    assert restart_factor(10.0, 3, 30.0) == pytest.approx(1e-3)  # clipped: young job that restarted a lot


def test_everyone_allocated_when_there_is_room():
    jobs = [JobState(Job(activation_gb=4.0, name=f"j{k}", max_gpus=1)) for k in range(3)]
    for s in jobs:
        s.model.observe(Config("fast", 1, 1), 1.0)
    problem = goodput_matrix(jobs, TINY)
    assert all(j is not None for j in solve(problem, TINY))  # λ = 1.1 > any normalized cost
    assert LAMBDA > 1


def test_bootstrapping_follows_the_ratio_rule_and_refines():
    m = ThroughputModel()
    m.observe(Config("a", 1, 1), 10.0)
    m.observe(Config("b", 1, 1), 4.0)
    assert m.estimate(Config("c", 1, 1)) is None  # never profiled
    m.observe(Config("b", 1, 4), 12.0)
    assert m.estimate(Config("a", 1, 4)) == pytest.approx(10.0 / 4.0 * 12.0)
    assert m.estimate(Config("b", 1, 4)) == 12.0  # observation wins
    assert m.explore_limit(2) == 8
    truth = ThroughputModel()  # refinement: an Amdahl-shaped job is recovered from three observations
    for n in (1, 2, 4):
        truth.observe(Config("b", 1, n), 5.0 * n / (1 + 0.1 * (n - 1)))
    truth.observe(Config("a", 1, 1), 9.0)
    assert truth.estimate(Config("a", 1, 8)) == pytest.approx(9.0 * 8 / (1 + 0.1 * 7), rel=1e-6)


def test_placer_keeps_unchanged_jobs_and_repacks_when_fragmented():
    cluster = Cluster.model_validate(
        {"gpu_types": [{"name": "g", "nodes": 2, "gpus_per_node": 4, "memory_gb": 40}]}
    )
    first = place({"a": Config("g", 1, 1), "b": Config("g", 1, 1)}, cluster)
    again = place({"a": Config("g", 1, 1), "b": Config("g", 1, 1), "c": Config("g", 1, 2)}, cluster, first)
    assert again["a"] == first["a"] and again["b"] == first["b"]
    spread = {"a": first["a"], "b": first["b"].model_copy(update={"gpus": {1: [3]}})}
    assert set(first["a"].gpus) == {0}  # a on node 0, b now on node 1: neither node can take 4 GPUs
    full = place({"a": Config("g", 1, 1), "b": Config("g", 1, 1), "c": Config("g", 1, 4)}, cluster, spread)
    assert len(full["c"].gpus) == 1 and full["c"].num_gpus == 4
    cells = [(n, g) for p in full.values() for n, idx in p.gpus.items() for g in idx]
    assert len(cells) == len(set(cells)) == 6


def test_zero_stage_grows_with_model_size():
    small, big = (
        Job(activation_gb=4.0, name="s", student_params_b=0.1),
        Job(activation_gb=4.0, name="b", student_params_b=4.0),
    )
    assert zero_stage(small, 1, 24) == 0
    assert zero_stage(big, 1, 24) is None
    assert zero_stage(big, 8, 24) == 2  # 2 + 14·4/8 + 4 = 19 GB <= 0.9·24
    assert zero_stage(big, 8, 16) == 3  # 16·4/8 + 4 = 12 GB <= 0.9·16
    assert zero_stage(big, 1, 80) == 0


def test_input_errors_are_one_line(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty or not a mapping"):
        load_cluster(empty)
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu_types:\n  - {name: x, nodes: 1, gpus_per_node: 6, memory_gb: 40, speed: 2}\n")
    with pytest.raises(ValueError) as e:
        load_cluster(bad)
    msg = str(e.value)
    assert "\n" not in msg and "power of two" in msg and "speed" in msg
    (tmp_path / "c.yaml").write_text("gpu_types:\n  - {name: x, nodes: 1, gpus_per_node: 4, memory_gb: 16}\n")
    cluster = load_cluster(tmp_path / "c.yaml")
    (tmp_path / "j.yaml").write_text(
        "jobs:\n  - {name: j, activation_gb: 4, observed: [{gpu_type: y, gpus: 1, throughput: 1}]}\n"
    )
    with pytest.raises(ValueError, match="not in the cluster"):
        load_jobs(tmp_path / "j.yaml", cluster)
    (tmp_path / "j.yaml").write_text(
        "jobs:\n  - {name: a, activation_gb: 4, current: {gpu_type: x, gpus: {0: [0, 1]}}}\n"
        "  - {name: b, activation_gb: 4, current: {gpu_type: x, gpus: {0: [1]}}}\n"
    )
    with pytest.raises(ValueError, match="also used by 'a'"):
        load_jobs(tmp_path / "j.yaml", cluster)
    from distill.cluster.plan import job_state

    with pytest.raises(ValueError, match="fits no configuration"):
        job_state(Job(activation_gb=4.0, name="huge", student_params_b=70.0), cluster)
    with pytest.raises(ValueError, match="not a configuration"):
        config_for(cluster, "x", 3)
