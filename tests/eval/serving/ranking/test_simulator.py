"""Scheduler simulator: hand-computed FCFS/SJF schedules, chunked prefill, the starvation guard, load behaviour."""

import numpy as np
import pytest

from eval.serving.ranking.simulator import (
    CostModel,
    SimConfig,
    poisson_arrivals,
    results_table,
    run_policies,
    simulate,
    summarize,
)

UNIT = CostModel(base=1.0, prefill_token=0.0, decode_token=0.0)  # every iteration takes 1 s


def test_one_token_budget_fcfs_vs_sjf_by_hand():
    # A (3 tokens) and B (1 token) both arrive at 0; budget 1 token: one request per iteration
    arrival, prompt, out, score = np.zeros(2), np.ones(2, int), np.array([3, 1]), np.array([0.0, 1.0])
    cfg = SimConfig(token_budget=1)
    assert simulate(arrival, prompt, out, score, "fcfs", UNIT, cfg).tolist() == [3.0, 4.0]
    assert simulate(arrival, prompt, out, score, "ltr", UNIT, cfg).tolist() == [4.0, 1.0]
    assert simulate(arrival, prompt, out, score, "oracle", UNIT, cfg).tolist() == [4.0, 1.0]
    # a wrong prediction makes LTR behave like the bad order
    assert simulate(arrival, prompt, out, -score, "ltr", UNIT, cfg).tolist() == [3.0, 4.0]


def test_preemption_and_batching_by_hand():
    # A (4 tokens) at 0, B (1 token) at 1.5; max one sequence per iteration
    arrival, prompt, out = np.array([0.0, 1.5]), np.ones(2, int), np.array([4, 1])
    cfg = SimConfig(token_budget=8, max_batch=1)
    # SJF preempts A at the iteration starting at t=2 (B arrived during the 2nd iteration)
    assert simulate(arrival, prompt, out, np.array([0.0, 1.0]), "oracle", UNIT, cfg).tolist() == [5.0, 3.0]
    assert simulate(arrival, prompt, out, np.array([0.0, 1.0]), "fcfs", UNIT, cfg).tolist() == [4.0, 5.0]
    # with room for both they share iterations and nobody waits
    both = SimConfig(token_budget=8, max_batch=2)
    assert simulate(arrival, prompt, out, np.array([0.0, 1.0]), "fcfs", UNIT, both).tolist() == [4.0, 3.0]


def test_chunked_prefill_and_cost_model_by_hand():
    # prompt of 5 tokens, budget 2: prefill takes 3 iterations (2+2+1), the 3rd emits the first of 2 tokens
    cost = CostModel(base=1.0, prefill_token=0.5, decode_token=0.25)
    finish = simulate(
        np.zeros(1), np.array([5]), np.array([2]), np.zeros(1), "fcfs", cost, SimConfig(token_budget=2)
    )
    assert finish.tolist() == [2.0 + 2.0 + 1.5 + 1.25]


def test_starvation_guard_promotes_after_threshold_for_quantum():
    # a long job with the worst score, one short job arriving every second
    n_short = 40
    arrival = np.concatenate([[0.0], np.arange(n_short, dtype=float)])
    out = np.array([10] + [1] * n_short)
    score = np.array([-5.0] + [1.0] * n_short)
    prompt = np.ones(n_short + 1, int)
    guarded = simulate(
        arrival, prompt, out, score, "ltr", UNIT, SimConfig(1, 8, starvation_threshold=3, quantum=2)
    )
    # idle 3 iterations -> runs 2 -> idle 3 -> ...: runs at iterations 4,5,9,10,...,24,25
    assert guarded[0] == 25.0
    assert guarded[1:6].tolist() == [1.0, 2.0, 3.0, 6.0, 7.0]
    unguarded = simulate(
        arrival, prompt, out, score, "ltr", UNIT, SimConfig(1, 8, starvation_threshold=10_000)
    )
    assert unguarded[0] == n_short + 10.0
    # fcfs never reads the guard
    assert simulate(arrival, prompt, out, score, "fcfs", UNIT, SimConfig(1, 8, 3, 2))[0] == 10.0


def test_sjf_beats_fcfs_under_load_and_matches_at_low_load():
    rng = np.random.default_rng(0)
    out = rng.integers(1, 400, 300)
    prompt = rng.integers(10, 200, 300)
    cost = CostModel()
    perfect = -out.astype(float)
    high = {
        r.policy: r for r in run_policies(prompt, out, perfect, [50.0], ["fcfs", "ltr", "oracle"], 300, cost)
    }
    assert high["oracle"].mean_latency_s < 0.85 * high["fcfs"].mean_latency_s
    assert high["oracle"].mean_latency_per_token_s < 0.5 * high["fcfs"].mean_latency_per_token_s
    # the guard costs some mean latency under overload; without it a perfect predictor is the oracle
    assert high["oracle"].mean_latency_s < high["ltr"].mean_latency_s < high["fcfs"].mean_latency_s
    no_guard = SimConfig(starvation_threshold=10**9)
    ltr = run_policies(prompt, out, perfect, [50.0], ["ltr", "oracle"], 300, cost, no_guard)
    assert ltr[0].mean_latency_s == ltr[1].mean_latency_s
    # a random predictor is no better than FCFS by much
    noise = {
        r.policy: r for r in run_policies(prompt, out, rng.random(300), [50.0], ["fcfs", "ltr"], 300, cost)
    }
    assert noise["ltr"].mean_latency_s > 0.8 * noise["fcfs"].mean_latency_s
    low = {
        r.policy: r
        for r in run_policies(prompt, out, -out.astype(float), [0.01], ["fcfs", "oracle"], 50, cost)
    }
    assert low["oracle"].mean_latency_s == pytest.approx(low["fcfs"].mean_latency_s, rel=1e-9)
    oracle_row = next(
        line for line in results_table(list(high.values())).splitlines() if "| oracle |" in line
    )
    per_token_ratio = high["fcfs"].mean_latency_per_token_s / high["oracle"].mean_latency_per_token_s
    assert oracle_row.split(" | ")[-2] == f"{per_token_ratio:.2f}x"


def test_summary_and_input_checks():
    r = summarize("fcfs", 1.0, np.array([0.0, 1.0]), np.array([2, 4]), np.array([2.0, 5.0]), 0.0)
    assert r.mean_latency_s == 3.0 and r.mean_latency_per_token_s == 1.0 and r.throughput_tok_s == 6 / 5
    with pytest.raises(ValueError, match="rate=0"):
        poisson_arrivals(3, 0)
    with pytest.raises(ValueError, match="policy 'sjf'"):
        simulate(np.zeros(1), np.ones(1), np.ones(1), np.zeros(1), "sjf")
    with pytest.raises(ValueError, match="sorted"):
        simulate(np.array([1.0, 0.0]), np.ones(2), np.ones(2), np.zeros(2), "fcfs")
    with pytest.raises(ValueError, match="token-budget"):
        SimConfig(token_budget=0)
    assert np.all(np.diff(poisson_arrivals(100, 5.0)) > 0)


PREFILL_COST = CostModel(base=1.0, prefill_token=1.0, decode_token=0.0)


def test_kv_capacity_preemption_recomputes_by_hand():
    # A (prompt 4, 3 tokens) at 0, B (prompt 4, 1 token) at 0.5; one sequence per iteration
    arrival, prompt, out = np.array([0.0, 0.5]), np.array([4, 4]), np.array([3, 1])
    free = SimConfig(token_budget=8, max_batch=1)
    tight = SimConfig(token_budget=8, max_batch=1, kv_capacity=7)
    # free preemption: A prefills (1 + 4 s), B preempts it (5 s), A decodes its last 2 tokens (1 s each)
    assert simulate(arrival, prompt, out, np.zeros(2), "oracle", PREFILL_COST, free).tolist() == [12.0, 10.0]
    # 7 KV tokens: B's 4 do not fit beside A's 4, so A is evicted and re-prefills prompt + 1 token (6 s)
    assert simulate(arrival, prompt, out, np.zeros(2), "oracle", PREFILL_COST, tight).tolist() == [17.0, 10.0]
    # FCFS never preempts: the same schedule with or without the limit
    for cfg in (free, tight):
        assert simulate(arrival, prompt, out, np.zeros(2), "fcfs", PREFILL_COST, cfg).tolist() == [7.0, 12.0]


def test_ample_kv_capacity_changes_nothing_and_a_tight_one_costs_time():
    rng = np.random.default_rng(1)
    out = rng.integers(1, 300, 200)
    prompt = rng.integers(10, 200, 200)
    args = (prompt, out, -out.astype(float), [40.0], ["fcfs", "ltr", "oracle"], 200, CostModel())
    free = run_policies(*args, SimConfig())
    ample = run_policies(*args, SimConfig(kv_capacity=10**9))
    assert [r.mean_latency_s for r in ample] == [r.mean_latency_s for r in free]
    tight = {r.policy: r for r in run_policies(*args, SimConfig(kv_capacity=2000))}
    free = {r.policy: r for r in free}
    assert tight["oracle"].mean_latency_s > 1.05 * free["oracle"].mean_latency_s  # recompute is paid
    assert tight["ltr"].mean_latency_s > 1.05 * free["ltr"].mean_latency_s
    with pytest.raises(ValueError, match="kv_capacity=300 .* longest request needs 500"):
        simulate(
            np.zeros(1),
            np.array([200]),
            np.array([300]),
            np.zeros(1),
            "fcfs",
            config=SimConfig(kv_capacity=300),
        )


def test_results_table_reports_the_kv_setting():
    rng = np.random.default_rng(2)
    out, prompt = rng.integers(1, 50, 40), rng.integers(5, 50, 40)
    rows = run_policies(
        prompt, out, -out.astype(float), [5.0], ["fcfs"], 40, CostModel(), SimConfig(kv_capacity=500)
    )
    assert rows[0].kv_capacity == 500 and "kv 500" in results_table(rows)
    assert run_policies(prompt, out, -out.astype(float), [5.0], ["fcfs"], 40)[0].kv_capacity is None


def test_memory_preemption_keeps_running_requests_like_vllm():
    # A (4 tokens) at 0, B (1 token, better score) at 1.5, one sequence per iteration: the paper's scheduler
    # preempts A for B; vLLM's keeps A running and admits B after it
    arrival, prompt, out, score = (
        np.array([0.0, 1.5]),
        np.ones(2, int),
        np.array([4, 1]),
        np.array([0.0, 1.0]),
    )
    paper = SimConfig(token_budget=8, max_batch=1)
    vllm = SimConfig(token_budget=8, max_batch=1, preemption="memory")
    assert simulate(arrival, prompt, out, score, "ltr", UNIT, paper).tolist() == [5.0, 3.0]
    assert simulate(arrival, prompt, out, score, "ltr", UNIT, vllm).tolist() == [4.0, 5.0]
    with pytest.raises(ValueError, match="preemption"):
        SimConfig(preemption="never")


def test_aging_is_the_static_key_and_bounds_the_wait():
    # one sequence per iteration of 1 s; a short job (predicted log length 1) arrives every second from 0, a long
    # one (predicted 5, 10 tokens) at 0.5 while the first short one runs
    n_short = 40
    arrival = np.sort(np.concatenate([[0.5], np.arange(n_short, dtype=float)]))
    out = np.array([1, 10] + [1] * (n_short - 1))
    score = np.array([-1.0, -5.0] + [-1.0] * (n_short - 1))
    prompt = np.ones(n_short + 1, int)
    plain = SimConfig(1, 1, starvation_threshold=10**9, preemption="memory")
    assert (
        simulate(arrival, prompt, out, score, "ltr", UNIT, plain)[1] == n_short + 10.0
    )  # after every short one
    aged = SimConfig(1, 1, 10**9, preemption="memory", aging_s=2.0)
    # keys: 5 + 0.5 / 2 for the long one, 1 + k / 2 for the short one of second k: from k = 9 on the long one
    # ranks first, is admitted at t = 9 and, running, stays for its 10 iterations
    assert simulate(arrival, prompt, out, score, "ltr", UNIT, aged)[1] == 9.0 + 10.0
    from eval.serving.ranking.simulator import aged_key

    assert aged_key(score, arrival, None).tolist() == (-score).tolist()
    np.testing.assert_allclose(aged_key(score, arrival, 2.0), -score + arrival / 2.0)
    with pytest.raises(ValueError, match="aging-s"):
        SimConfig(aging_s=0.0)


def test_aging_sweep_and_choice():
    from eval.serving.ranking.simulator import aging_sweep, choose_aging

    rng = np.random.default_rng(0)
    out = rng.integers(1, 300, 200)
    prompt = rng.integers(10, 100, 200)
    score = -np.log(out) + rng.normal(0, 0.5, 200)  # a fair predictor
    cost = CostModel(base=0.03, prefill_token=0.001, decode_token=0.001)
    config = SimConfig(512, 8, 10**9, preemption="memory")
    rows = aging_sweep(prompt, out, score, [5.0, 1e9], 1.3, 200, cost, config, [0, 1])
    assert len(rows) == 2 * 4 and {r["policy"] for r in rows} == {"fcfs", "ltr"}
    by = {(r["seed"], r["aging_s"], r["policy"]): r for r in rows}
    for seed in (0, 1):
        # an aging constant far beyond the run's length changes nothing; strong aging moves toward FCFS
        assert by[seed, 1e9, "ltr"]["max_s"] == pytest.approx(by[seed, None, "ltr"]["max_s"])
        assert by[seed, 5.0, "ltr"]["max_s"] <= by[seed, None, "ltr"]["max_s"]
        assert by[seed, None, "ltr"]["mean_s"] < by[seed, None, "fcfs"]["mean_s"]

    def mean(aging):
        return np.mean([by[s, aging, "ltr"]["mean_s"] for s in (0, 1)])

    worst = max(by[s, None, "ltr"]["max_s"] / by[s, None, "fcfs"]["max_s"] for s in (0, 1))
    assert choose_aging(rows, bound=worst + 1) == min((5.0, 1e9), key=mean)  # both hold it: the lower mean
    strong = max(by[s, 5.0, "ltr"]["max_s"] / by[s, None, "fcfs"]["max_s"] for s in (0, 1))
    if strong < worst:  # a bound only the strong aging holds
        assert choose_aging(rows, bound=(strong + worst) / 2) == 5.0
    assert choose_aging(rows, bound=0.5) is None
