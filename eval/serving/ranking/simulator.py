"""Iteration-level continuous-batching simulator: FCFS vs learning-to-rank SJF vs oracle SJF.

Each iteration the scheduler orders every arrived, unfinished request (the 3-pivot argsort of
:mod:`.multipivot`) and fills the batch in that order under a token budget and a sequence cap: a request
still in prefill takes up to its remaining prompt tokens (chunked prefill), one in decode takes one
token.  The request whose prefill completes emits its first output token in that iteration.

KV memory: with ``kv_capacity=None`` it is unlimited and preemption is free (a request left out of the
batch keeps its KV).  With a capacity (tokens) every started request holds the KV of the tokens it has fed;
a request that needs room evicts resident requests of lower priority, lowest first, as vLLM's recompute
preemption does: the evicted one loses its KV and must prefill its prompt and every token generated so far
again (paid through the cost model's prefill term).  When no lower-priority KV is left to evict the batch
stops there.  FCFS only preempts when memory runs out; preemptive SJF pays for each preemption.  Under ``ltr`` a request left idle for ``starvation_threshold``
iterations is promoted to the front for ``quantum`` scheduled iterations (the paper: 200 and 10).
Iteration time comes from a :class:`CostModel` fitted to measured prefill/decode step times.

``preemption="memory"`` is vLLM's priority scheduler instead (``vllm/v1/core/sched/scheduler.py``): requests that
hold KV run first, every iteration, and only leave the batch when evicted for memory (the resident one of the
largest priority value first); the priority order only decides which waiting request is admitted next.
``aging_s`` ages ``ltr``: the key is the predicted log length minus the time waited over ``aging_s`` (a request
that has waited ``aging_s`` seconds longer outranks one predicted e times shorter).  Linear aging keeps the order
of any two requests fixed after both arrived (the waiting terms differ by a constant), so it is the static key
``-score + arrival / aging_s``: what a proxy can send as vLLM's fixed ``priority``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from .multipivot import argsort

Policy = Literal["fcfs", "ltr", "oracle"]
POLICIES: tuple[str, ...] = ("fcfs", "ltr", "oracle")


@dataclass(frozen=True)
class CostModel:
    """Seconds per iteration = base + prefill_token * prefill tokens + decode_token * decoding sequences.

    Defaults: SmolLM2-135M fp32, fitted by :func:`calibrate_cost_model` on this project's 2-core CPU
    machine while it was shared (load ~6), so slow; rerun ``swiftkv ranking calibrate`` for yours.
    """

    base: float = 0.66
    prefill_token: float = 0.0044
    decode_token: float = 0.0145

    def iteration(self, prefill_tokens: int, decode_tokens: int) -> float:
        return self.base + self.prefill_token * prefill_tokens + self.decode_token * decode_tokens

    @classmethod
    def from_dict(cls, fields: dict) -> CostModel:
        """The model's own fields of a cost-model JSON (calibrations record more beside them)."""
        return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class SimConfig:
    token_budget: int = 512
    max_batch: int = 32
    starvation_threshold: int = 200
    quantum: int = 10
    kv_capacity: int | None = None
    """KV-cache tokens; None = unlimited memory and free preemption."""
    preemption: Literal["priority", "memory"] = "priority"
    """priority: every iteration re-ranks all requests (the paper); memory: vLLM's (running ones stay)."""
    aging_s: float | None = None
    """ltr only: seconds of waiting worth one unit of predicted log length; None = no aging."""

    def __post_init__(self):
        fields = (self.token_budget, self.max_batch, self.starvation_threshold, self.quantum)
        if (
            min(fields) < 1
            or (self.kv_capacity is not None and self.kv_capacity < 1)
            or (self.aging_s is not None and not self.aging_s > 0)
        ):
            raise ValueError(
                f"{self} has a non-positive field; to resolve, pass positive "
                "--token-budget/--max-batch/--kv-capacity/--aging-s"
            )
        if self.preemption not in ("priority", "memory"):
            raise ValueError(f"preemption={self.preemption!r}; to resolve, pass priority or memory")


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of ``n`` requests at ``rate`` requests/s."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be > 0 requests/s; to resolve, pass e.g. --rate 2,8,32")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


def simulate(
    arrival: np.ndarray,
    prompt_len: np.ndarray,
    output_len: np.ndarray,
    score: np.ndarray,
    policy: Policy,
    cost: CostModel = CostModel(),
    config: SimConfig = SimConfig(),
) -> np.ndarray:
    """Finish time of every request (arrays in arrival order; score: higher = shorter expected output)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is unknown; to resolve, choose from {', '.join(POLICIES)}")
    n = len(arrival)
    if np.any(np.diff(arrival) < 0) or np.any(np.asarray(output_len) < 1):
        raise ValueError(
            "arrivals must be sorted and output lengths >= 1; to resolve, sort requests by arrival"
        )
    prompt = np.maximum(np.asarray(prompt_len, dtype=np.int64), 1)
    prefill_left = prompt.copy()
    output = np.asarray(output_len, dtype=np.int64)
    todo = output.copy()
    capacity = config.kv_capacity
    if capacity is not None and n and int((prompt + todo).max()) > capacity:
        raise ValueError(
            f"kv_capacity={capacity} tokens cannot hold one request: the longest request needs "
            f"{int((prompt + todo).max())} (prompt + output); to resolve, raise --kv-capacity"
        )
    base_key = {
        "fcfs": np.asarray(arrival, float),
        "ltr": aged_key(score, arrival, config.aging_s),
        "oracle": todo.astype(float),
    }[policy]
    kv = np.zeros(n, np.int64)  # KV tokens resident per request
    idle = np.zeros(n, np.int64)
    promoted = np.zeros(n, np.int64)
    finish = np.full(n, np.nan)
    t, admitted, active = 0.0, 0, np.empty(0, np.int64)
    while admitted < n or len(active):
        if not len(active) and arrival[admitted] > t:
            t = float(arrival[admitted])
        new = admitted + int(np.searchsorted(arrival[admitted:], t, side="right"))
        active = np.concatenate([active, np.arange(admitted, new)])
        admitted = new
        key = base_key[active]
        if policy == "ltr":
            key = np.where(promoted[active] > 0, -np.inf, key)
        order = active[argsort(key)]
        if config.preemption == "memory":  # vLLM: the requests holding KV first, then admissions by priority
            order = np.concatenate([order[kv[order] > 0], order[kv[order] == 0]])
        run, take = _fill_batch(order, prefill_left, kv, prompt, output, todo, capacity, config)
        in_prefill = prefill_left[run] > 0
        t += cost.iteration(int(take[in_prefill].sum()), int((~in_prefill).sum()))
        prefill_left[run[in_prefill]] -= take[in_prefill]
        kv[run] += take
        emits = run[prefill_left[run] == 0]
        todo[emits] -= 1
        # starvation guard bookkeeping (only ltr reads `promoted`)
        waiting = np.setdiff1d(active, run, assume_unique=True)
        idle[waiting] += 1
        idle[run] = 0
        promoted[run] = np.maximum(promoted[run] - 1, 0)
        starving = waiting[idle[waiting] >= config.starvation_threshold]
        promoted[starving] = config.quantum
        idle[starving] = 0
        done = active[todo[active] == 0]
        finish[done] = t
        kv[done] = 0
        active = active[todo[active] > 0]
    return finish


def aged_key(score, arrival, aging_s: float | None) -> np.ndarray:
    """The ``ltr`` order key (lower first): minus the score (the predicted log length), plus the arrival time
    over ``aging_s`` when aging (equal, for any two requests, to subtracting each one's waiting time)."""
    key = -np.asarray(score, float)
    return key if aging_s is None else key + np.asarray(arrival, float) / aging_s


def _fill_batch(
    order: np.ndarray,
    prefill_left: np.ndarray,
    kv: np.ndarray,
    prompt: np.ndarray,
    output_len: np.ndarray,
    todo: np.ndarray,
    capacity: int | None,
    config: SimConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """The requests of one iteration and the tokens each feeds, in priority ``order``; with a KV capacity,
    evicts lower-priority residents (recompute: ``prefill_left`` = prompt + generated, KV freed) for room."""
    run: list[int] = []
    take: list[int] = []
    budget = config.token_budget
    free = None if capacity is None else capacity - int(kv.sum())
    victims = [int(r) for r in order[::-1] if kv[r] > 0]  # resident, lowest priority first
    for r in order[: config.max_batch]:
        r = int(r)
        need = int(prefill_left[r]) if prefill_left[r] > 0 else 1
        chunked = need > budget
        if chunked and (prefill_left[r] == 0 or budget == 0):
            break
        need = min(need, budget)
        if free is not None:
            while free < need and victims and victims[0] != r and victims[0] not in run:
                victim = victims.pop(0)
                free += int(kv[victim])
                kv[victim] = 0
                prefill_left[victim] = prompt[victim] + output_len[victim] - todo[victim]
            if free < need:
                break
            free -= need
        run.append(r)
        take.append(need)
        budget -= need
        if chunked or budget == 0:
            break
    return np.asarray(run, np.int64), np.asarray(take, np.int64)


@dataclass
class SimResult:
    policy: str
    rate: float
    mean_latency_s: float
    mean_latency_per_token_s: float
    p90_latency_per_token_s: float
    throughput_tok_s: float
    throughput_req_s: float
    wall_s: float
    kv_capacity: int | None = None
    """The run's KV capacity in tokens (None: unlimited memory, free preemption)."""
    p99_latency_s: float = float("nan")
    max_latency_s: float = float("nan")
    """The worst request: what starvation shows in."""


def summarize(
    policy: str, rate: float, arrival, output_len, finish, wall_s: float, kv_capacity: int | None = None
) -> SimResult:
    latency = finish - arrival
    per_token = latency / np.asarray(output_len)
    span = float(np.max(finish) - np.min(arrival))
    return SimResult(
        policy,
        rate,
        float(latency.mean()),
        float(per_token.mean()),
        float(np.percentile(per_token, 90)),
        float(np.sum(output_len) / span),
        float(len(arrival) / span),
        wall_s,
        kv_capacity,
        float(np.percentile(latency, 99)),
        float(latency.max()),
    )


def run_policies(
    prompt_len: np.ndarray,
    output_len: np.ndarray,
    score: np.ndarray,
    rates: list[float],
    policies: list[str],
    n_requests: int = 500,
    cost: CostModel = CostModel(),
    config: SimConfig = SimConfig(),
    seed: int = 0,
) -> list[SimResult]:
    """Sample ``n_requests`` of the given requests with replacement, Poisson arrivals per rate, every policy."""
    rng = np.random.default_rng(seed)
    results = []
    for rate in rates:
        pick = rng.integers(0, len(output_len), n_requests)
        arrival = poisson_arrivals(n_requests, rate, seed)
        for policy in policies:
            start = time.perf_counter()
            finish = simulate(arrival, prompt_len[pick], output_len[pick], score[pick], policy, cost, config)
            wall = time.perf_counter() - start
            results.append(
                summarize(policy, rate, arrival, output_len[pick], finish, wall, config.kv_capacity)
            )
    return results


def latency_stats(latency: np.ndarray) -> dict[str, float]:
    """Mean, p50, p90, p99 and max of end-to-end latencies (s)."""
    return {"mean_s": float(latency.mean()), "p50_s": float(np.median(latency)),
            **{f"p{q}_s": float(np.percentile(latency, q)) for q in (90, 99)}, "max_s": float(latency.max())}  # fmt: skip


def aging_sweep(
    prompt_len: np.ndarray,
    output_len: np.ndarray,
    score: np.ndarray,
    agings: list[float],
    rate_x: float,
    n_requests: int,
    cost: CostModel,
    config: SimConfig,
    seeds: list[int],
) -> list[dict]:
    """FCFS, ``ltr`` without aging and ``ltr`` with each ``aging_s`` on the same requests and arrivals, per seed:
    ``n_requests`` sampled with replacement, Poisson arrivals at ``rate_x`` times FCFS's request rate when all of
    them arrive at once (its saturated rate, as the benchmark's ``1.3x``).  One row per (seed, arm) with
    :func:`latency_stats`."""
    from dataclasses import replace

    rows = []
    for seed in seeds:
        pick = np.random.default_rng(seed).integers(0, len(output_len), n_requests)
        p, o, s = prompt_len[pick], output_len[pick], score[pick]
        burst = simulate(np.zeros(n_requests), p, o, s, "fcfs", cost, config)
        rate = rate_x * n_requests / float(burst.max())
        arrival = poisson_arrivals(n_requests, rate, seed)
        arms = [("fcfs", None), ("ltr", None), *(("ltr", a) for a in agings)]
        for policy, aging in arms:
            finish = simulate(arrival, p, o, s, policy, cost, replace(config, aging_s=aging))
            rows.append({"seed": seed, "policy": policy, "aging_s": aging, "rate_rps": rate,
                         **latency_stats(finish - arrival)})  # fmt: skip
    return rows


def choose_aging(rows: list[dict], bound: float = 2.0) -> float | None:
    """The ``aging_s`` of :func:`aging_sweep` with the lowest mean latency (averaged over seeds) among those whose
    worst latency is within ``bound`` times FCFS's in every seed; None if no constant holds the bound."""
    fcfs = {r["seed"]: r["max_s"] for r in rows if r["policy"] == "fcfs"}
    agings = {r["aging_s"] for r in rows if r["aging_s"] is not None}
    held = [
        a for a in agings if all(r["max_s"] <= bound * fcfs[r["seed"]] for r in rows if r["aging_s"] == a)
    ]
    if not held:
        return None
    return min(held, key=lambda a: float(np.mean([r["mean_s"] for r in rows if r["aging_s"] == a])))


def calibrate_cost_model(model_dir: str | os.PathLike, repeats: int = 3, dtype: str = "float32") -> CostModel:
    """Fit :class:`CostModel` by least squares to timed prefill and batched decode steps of a real model."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size
    rows, times = [], []
    with torch.no_grad():
        for _ in range(repeats):
            for tokens in (32, 128, 256):
                ids = torch.randint(0, vocab, (1, tokens))
                start = time.perf_counter()
                model(ids)
                rows.append((1, tokens, 0))
                times.append(time.perf_counter() - start)
            for batch in (1, 8, 32):
                ids = torch.randint(0, vocab, (batch, 128))
                cache = DynamicCache(config=model.config)
                model(ids, cache=cache)
                start = time.perf_counter()
                for _ in range(4):
                    model(torch.randint(0, vocab, (batch, 1)), cache=cache)
                rows.append((1, 0, batch))
                times.append((time.perf_counter() - start) / 4)
    coef, *_ = np.linalg.lstsq(np.asarray(rows, float), np.asarray(times), rcond=None)
    return CostModel(*(max(float(c), 0.0) for c in coef))


def kv_setting(kv_capacity: int | None) -> str:
    """Table label of a KV setting: ``free`` (unlimited, free preemption) or ``kv N`` (N tokens, recompute)."""
    return "free" if kv_capacity is None else f"kv {kv_capacity}"


def results_table(results: list[SimResult]) -> str:
    by_rate: dict[tuple[str, float], dict[str, SimResult]] = {}
    for r in results:
        by_rate.setdefault((kv_setting(r.kv_capacity), r.rate), {})[r.policy] = r
    lines = [
        "KV | rate req/s | policy | mean lat s | mean s/token | p90 s/token | tok/s | "
        "FCFS/policy mean s/token | FCFS/policy mean lat"
    ]
    for (kv, rate), rows in by_rate.items():
        fcfs = rows.get("fcfs")
        for r in rows.values():
            ratios = (
                f"{fcfs.mean_latency_per_token_s / r.mean_latency_per_token_s:.2f}x | "
                f"{fcfs.mean_latency_s / r.mean_latency_s:.2f}x"
                if fcfs
                else "- | -"
            )
            lines.append(
                f"{kv} | {rate:g} | {r.policy} | {r.mean_latency_s:.2f} | {r.mean_latency_per_token_s:.4f} | "
                f"{r.p90_latency_per_token_s:.4f} | {r.throughput_tok_s:.1f} | {ratios}"
            )
    return "\n".join(lines)


def results_json(results: list[SimResult]) -> list[dict]:
    return [asdict(r) for r in results]
