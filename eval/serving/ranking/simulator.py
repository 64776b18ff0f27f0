"""Iteration-level continuous-batching simulator: FCFS vs learning-to-rank SJF vs oracle SJF.

Each iteration the scheduler orders every arrived, unfinished request (the 3-pivot argsort of
:mod:`.multipivot`) and fills the batch in that order under a token budget and a sequence cap: a request
still in prefill takes up to its remaining prompt tokens (chunked prefill), one in decode takes one
token.  Preemption is free (KV stays resident).  The request whose prefill completes emits its first
output token in that iteration.  Under ``ltr`` a request left idle for ``starvation_threshold``
iterations is promoted to the front for ``quantum`` scheduled iterations (the paper: 200 and 10).
Iteration time comes from a :class:`CostModel` fitted to measured prefill/decode step times.
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
    machine while it was shared (load ~6), so slow; rerun ``python -m eval.serving.ranking calibrate`` for yours.
    """

    base: float = 0.66
    prefill_token: float = 0.0044
    decode_token: float = 0.0145

    def iteration(self, prefill_tokens: int, decode_tokens: int) -> float:
        return self.base + self.prefill_token * prefill_tokens + self.decode_token * decode_tokens

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        return cls(
            **{k: v for k, v in json.loads(Path(path).read_text()).items() if k in cls.__dataclass_fields__}
        )


@dataclass(frozen=True)
class SimConfig:
    token_budget: int = 512
    max_batch: int = 32
    starvation_threshold: int = 200
    quantum: int = 10

    def __post_init__(self):
        if min(self.token_budget, self.max_batch, self.starvation_threshold, self.quantum) < 1:
            raise ValueError(
                f"{self} has a non-positive field; to resolve, pass positive --token-budget/--max-batch"
            )


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
    prefill_left = np.maximum(np.asarray(prompt_len, dtype=np.int64), 1)
    todo = np.asarray(output_len, dtype=np.int64).copy()
    base_key = {
        "fcfs": np.asarray(arrival, float),
        "ltr": -np.asarray(score, float),
        "oracle": todo.astype(float),
    }[policy]
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
        order = active[argsort(key)][: config.max_batch]
        need = np.where(prefill_left[order] > 0, prefill_left[order], 1)
        spent = np.cumsum(need)
        fits = int(np.searchsorted(spent, config.token_budget, side="right"))
        take = need[:fits].copy()
        if (
            fits < len(order) and prefill_left[order[fits]] > 0
        ):  # chunk the next prefill into the leftover budget
            leftover = config.token_budget - (int(spent[fits - 1]) if fits else 0)
            if leftover > 0:
                take = np.append(take, leftover)
        run = order[: len(take)]
        in_prefill = prefill_left[run] > 0
        t += cost.iteration(int(take[in_prefill].sum()), int((~in_prefill).sum()))
        prefill_left[run[in_prefill]] -= take[in_prefill]
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
        active = active[todo[active] > 0]
    return finish


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


def summarize(policy: str, rate: float, arrival, output_len, finish, wall_s: float) -> SimResult:
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
            results.append(
                summarize(policy, rate, arrival, output_len[pick], finish, time.perf_counter() - start)
            )
    return results


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


def results_table(results: list[SimResult]) -> str:
    by_rate: dict[float, dict[str, SimResult]] = {}
    for r in results:
        by_rate.setdefault(r.rate, {})[r.policy] = r
    lines = [
        "rate req/s | policy | mean lat s | mean s/token | p90 s/token | tok/s | "
        "FCFS/policy mean s/token | FCFS/policy mean lat"
    ]
    for rate, rows in by_rate.items():
        fcfs = rows.get("fcfs")
        for r in rows.values():
            ratios = (
                f"{fcfs.mean_latency_per_token_s / r.mean_latency_per_token_s:.2f}x | "
                f"{fcfs.mean_latency_s / r.mean_latency_s:.2f}x"
                if fcfs
                else "- | -"
            )
            lines.append(
                f"{rate:g} | {r.policy} | {r.mean_latency_s:.2f} | {r.mean_latency_per_token_s:.4f} | "
                f"{r.p90_latency_per_token_s:.4f} | {r.throughput_tok_s:.1f} | {ratios}"
            )
    return "\n".join(lines)


def results_json(results: list[SimResult]) -> list[dict]:
    return [asdict(r) for r in results]
