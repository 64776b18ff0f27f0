"""Two-process gloo tests of the DDP communication hooks (torch.multiprocessing.spawn, tiny MLPs).

Each scenario runs in both ranks and returns rank 0's observations; the assertions run in the parent.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from distill.comm import CommConfig, register_comm_hook

WORLD = 2


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _train(ddp: DDP, steps: int, lr: float = 0.1) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for t in range(steps):
        opt.zero_grad()
        _loss(ddp, *_batch(dist.get_rank(), t)).backward()
        opt.step()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _equivalence() -> dict:
    """budget 1.0 and hook=allreduce train exactly like DDP without a hook; PowerSGD counts fewer bytes."""
    out = {}
    for name, cfg in [
        ("none", None),
        ("allreduce", CommConfig()),
        ("managed", CommConfig(hook="managed", budget=1.0)),
        ("powersgd", CommConfig(hook="powersgd", powersgd_start_iter=2)),
    ]:
        ddp = DDP(_mlp())
        state = register_comm_hook(ddp, cfg) if cfg else None
        _train(ddp, 5)
        out[name] = _flat(ddp.parameters())
        if state:
            out[f"{name}_summary"] = state.summary()
    return out


def _nothing_lost() -> dict:
    """Small budget, fixed weights: everything sent + the unsent residuals = every gradient, averaged."""
    cfg = CommConfig(hook="managed", budget=0.2, block_size=4, priority="relative-magnitude")
    ddp = DDP(_mlp(), bucket_cap_mb=0.0001)  # several buckets
    state = register_comm_hook(ddp, cfg)
    params = list(ddp.parameters())
    sent_total, grad_total = 0, 0
    for t in range(12):
        x, y = _batch(dist.get_rank(), t)
        local = _flat(torch.autograd.grad(_loss(ddp.module, x, y), params))
        mean = local.clone()
        dist.all_reduce(mean)
        mean /= WORLD
        for p in params:
            p.grad = None
        _loss(ddp, x, y).backward()
        sent = _flat(p.grad for p in params)
        sent_total, grad_total = sent_total + sent, grad_total + mean
    residual = _flat(state.residual[p] for p in params)
    dist.all_reduce(residual)
    return {
        "sent_total": sent_total,
        "grad_total": grad_total,
        "mean_residual": residual / WORLD,
        "summary": state.summary(),
        **_priority_order(),
    }


def _priority_order() -> dict:
    """One weight matrix (one bucket, 8 blocks of 4), budget 2 blocks: which blocks went out at step 0."""
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(8, 4, bias=False))
    register_comm_hook(ddp, CommConfig(hook="managed", budget=0.25, block_size=4))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    ddp(x).square().mean().backward()
    grads = [torch.zeros(32) for _ in range(WORLD)]
    local = ddp.module.weight.detach().clone()
    local_grad = torch.autograd.grad(ddp.module(x).square().mean(), ddp.module.weight)[0]
    dist.all_gather(grads, local_grad.reshape(-1).contiguous())
    return {"w": local.reshape(-1), "rank_grads": grads, "prio_sent": ddp.module.weight.grad.reshape(-1)}


STEPS = 7


def _stale(staleness: int, store: dist.Store) -> dict:
    """Rank 1 is slow: from step 2 on it begins step t only once rank 0 has begun step t + staleness (so rank 0
    must run that far ahead, or this waits until the store's timeout; the first two steps run side by side,
    since DDP rebuilds its buckets in step 1's forward with a collective of both ranks).  When rank 0 begins a
    step it records how many steps rank 1 had begun (a counter in a store beside the process group): the hook
    lets rank 0 begin step t only after step t - staleness - 1's average, i.e. after rank 1 began that step.
    Replicas stay identical."""
    ddp = DDP(_mlp())
    register_comm_hook(ddp, CommConfig(staleness=staleness))
    params = list(ddp.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    seen, local, applied = [], [], []
    key = f"stale{staleness}"
    for t in range(STEPS):
        if dist.get_rank() == 0:
            seen.append(store.add(f"{key}/slow", 0))  # read before announcing step t
            store.set(f"{key}/fast{t}", "begun")
        else:
            if t >= 2:
                store.wait([f"{key}/fast{min(t + staleness, STEPS - 1)}"], timedelta(minutes=5))
            store.add(f"{key}/slow", 1)  # before this step's gradient goes out
        x, y = _batch(dist.get_rank(), t)
        local.append(_flat(torch.autograd.grad(_loss(ddp.module, x, y), params)))
        opt.zero_grad()
        _loss(ddp, x, y).backward()
        applied.append(_flat(p.grad for p in params))
        opt.step()
    local = torch.stack(local)
    dist.all_reduce(local)
    final = [torch.zeros(_flat(params).numel()) for _ in range(WORLD)]
    dist.all_gather(final, _flat(params))
    return {"seen": seen, "mean": local / WORLD, "applied": torch.stack(applied), "final": final}


def _resume() -> dict:
    """3 steps, checkpoint (model, optimizer, comm state), a fresh DDP resumes for 3 more.

    Staleness 2 with all-reduce resumes exactly (the two delayed averages come back).  Managed selection
    depends on DDP's bucket layout, which differs before DDP's first rebuild, so there the check is that the
    unsent residuals and delayed averages come back under the same parameter names."""

    def fresh(cfg: CommConfig, seed: int = 0):
        ddp = DDP(_mlp(seed))
        return ddp, register_comm_hook(ddp, cfg), torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def steps(ddp: DDP, opt, start: int, stop: int) -> None:
        for t in range(start, stop):
            opt.zero_grad()
            _loss(ddp, *_batch(dist.get_rank(), t)).backward()
            opt.step()

    stale = CommConfig(staleness=2)
    straight, _, opt = fresh(stale)
    steps(straight, opt, 0, 6)
    first, state, opt = fresh(stale)
    steps(first, opt, 0, 3)
    saved = {"model": first.module.state_dict(), "opt": opt.state_dict(), "comm": state.state_dict()}
    out = {"straight": _flat(straight.parameters())}
    for name, restore in [("resumed", True), ("lost", False)]:
        ddp, state, opt = fresh(stale, seed=5)
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if restore:
            state.load_state_dict(saved["comm"])
        steps(ddp, opt, 3, 6)
        out[name] = _flat(ddp.parameters())
    managed = CommConfig(hook="managed", budget=0.3, block_size=4, priority="fifo", staleness=1)
    ddp, state, opt = fresh(managed)
    steps(ddp, opt, 0, 3)
    out["managed_saved"] = state.state_dict()
    _, back, _ = fresh(managed)
    back.load_state_dict(out["managed_saved"])
    out["managed_back"] = back.state_dict()
    return out


SCENARIOS = {
    "resume": _resume,
    "equivalence": _equivalence,
    "nothing_lost": _nothing_lost,
    "stale2": lambda store: _stale(2, store),
    "stale0": lambda store: _stale(0, store),
}


def _worker(rank: int, init: str, results: str, side: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    store = dist.FileStore(side, WORLD)  # the staleness scenarios' own counters
    try:
        out = {name: run(store) if "stale" in name else run() for name, run in SCENARIOS.items()}
        if rank == 0:
            torch.save(out, results)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """All scenarios in one 2-process launch (process start-up dominates the cost)."""
    tmp = tmp_path_factory.mktemp("comm_ddp")
    mp.spawn(_worker, args=(f"file://{tmp}/store", str(tmp / "results.pt"), str(tmp / "side")), nprocs=WORLD)
    return torch.load(tmp / "results.pt")


@pytest.mark.slow
def test_budget_one_and_allreduce_equal_plain_ddp_and_powersgd_sends_less(runs):
    out = runs["equivalence"]
    torch.testing.assert_close(out["allreduce"], out["none"], rtol=0, atol=0)
    torch.testing.assert_close(out["managed"], out["none"], rtol=1e-6, atol=1e-7)
    dense = out["allreduce_summary"]["comm_bytes"]
    assert out["managed_summary"]["comm_bytes"] == dense
    assert out["allreduce_summary"]["comm_byte_ratio"] == 1.0
    assert out["powersgd_summary"]["comm_steps"] == 5
    assert out["powersgd_summary"]["comm_bytes"] < dense  # two warm-up steps dense, then rank-1 factors
    assert not torch.allclose(out["powersgd"], out["none"])


@pytest.mark.slow
def test_small_budget_loses_nothing_and_respects_priority(runs):
    out = runs["nothing_lost"]
    torch.testing.assert_close(
        out["sent_total"] + out["mean_residual"], out["grad_total"], rtol=1e-5, atol=1e-6
    )
    assert out["mean_residual"].abs().max() > 1e-3  # something really was held back
    s = out["summary"]
    assert s["comm_steps"] == 12 and 0.15 < s["comm_byte_ratio"] < 0.5  # 20% of blocks + scores
    # one bucket, step 0: the sent blocks are the 2 of 8 with the highest rank-summed sum of |g/x|
    w, sent = out["w"].view(8, 4), out["prio_sent"].view(8, 4)
    scores = sum((g.view(8, 4) / w).abs().sum(1) for g in out["rank_grads"])
    want = set(scores.topk(2).indices.tolist())
    assert {i for i in range(8) if sent[i].abs().sum() > 0} == want
    mean = sum(out["rank_grads"]).view(8, 4) / WORLD
    torch.testing.assert_close(sent[sorted(want)], mean[sorted(want)])
    assert want != set(sum(g.view(8, 4).abs().sum(1) for g in out["rank_grads"]).topk(2).indices.tolist())


@pytest.mark.slow
def test_staleness_bound_with_a_slow_worker(runs):
    s, out = 2, runs["stale2"]
    # from step 2 on, rank 0 began step t when rank 1 had begun exactly max(2, t - s) steps: no fewer (the
    # bound, and step 1's bucket rebuild), the test's own order allows no more; and rank 0 got s steps ahead
    # (at step 4 rank 1 had begun 2; else rank 1 would have waited until the timeout)
    assert out["seen"][2:] == [max(2, t - s) for t in range(2, STEPS)]
    applied, mean = out["applied"], out["mean"]
    assert torch.count_nonzero(applied[:s]) == 0
    torch.testing.assert_close(applied[s:], mean[: STEPS - s], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["final"][0], out["final"][1], rtol=0, atol=0)


@pytest.mark.slow
def test_comm_state_checkpoint_resumes_exactly(runs):
    out = runs["resume"]
    torch.testing.assert_close(out["resumed"], out["straight"], rtol=0, atol=1e-7)
    assert not torch.allclose(out["lost"], out["straight"])
    saved, back = out["managed_saved"], out["managed_back"]
    assert saved["residual"].keys() == back["residual"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert sum(r.abs().sum() for r in saved["residual"].values()) > 0
    torch.testing.assert_close(back, saved, rtol=0, atol=0)


@pytest.mark.slow
def test_staleness_zero_is_synchronous(runs):
    out = runs["stale0"]
    assert out["seen"][2:] == list(range(2, STEPS))  # rank 0 begins step t once rank 1 has begun step t-1
    torch.testing.assert_close(out["applied"], out["mean"], rtol=1e-5, atol=1e-6)
