"""SCAR running checkpoint: crash safety, exact partial recovery, max-change selection, coverage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from distill.scar.blocks import MAX_BLOCKS, make_blocks
from distill.scar.config import ScarConfig
from distill.scar.faults import damage_blocks, pick_blocks, truncate_file
from distill.scar.running import (
    RunningCheckpoint,
    advance_step_counters,
    broadcast_from_owners,
    owned_by_rank,
)
from distill.scar.store import CorruptBlockError


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))


def train_steps(model, opt, n: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, 12, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt) -> tuple[dict, dict]:
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = {
        k: {s: t.clone() for s, t in opt.state[p].items()}
        for k, p in model.named_parameters()
        if opt.state[p]
    }
    return params, state


CRASH_SCRIPT = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from test_scar import tiny_model, train_steps
from distill.scar import running
from distill.scar.config import ScarConfig
from distill.scar.running import RunningCheckpoint
model = tiny_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
train_steps(model, opt, 2)
ckpt = RunningCheckpoint({root!r}, dict(model.named_parameters()), ScarConfig(fraction=1, every_steps=1), opt)
ckpt.save(0)
torch.save({{k: v.detach().clone() for k, v in model.named_parameters()}}, {root!r} + "/v0.pt")
train_steps(model, opt, 3, seed=2)
torch.save({{k: v.detach().clone() for k, v in model.named_parameters()}}, {root!r} + "/v1.pt")
# the test's fault injection: SIGKILL this process right after the n-th write of the given kind
point, n = {kill!r}.split(":")
name = {{"block_written": "write_block", "manifest_written": "write_manifest"}}[point]
real, hits = getattr(running, name), []
def write_then_die(*args, **kwargs):
    out = real(*args, **kwargs)
    hits.append(1)
    if len(hits) == int(n):
        os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(running, name, write_then_die)
ckpt.save(1)
"""


@pytest.mark.parametrize("kill,expect", [("block_written:2", "v0.pt"), ("manifest_written:1", "v1.pt")])
def test_writer_killed_mid_save_leaves_a_loadable_state(tmp_path, kill, expect):
    script = CRASH_SCRIPT.format(tests=os.path.dirname(__file__), root=str(tmp_path), kill=kill)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    model = tiny_model(seed=5)
    ckpt = RunningCheckpoint(tmp_path, dict(model.named_parameters()), ScarConfig(fraction=1, every_steps=1))
    assert ckpt.detect_corrupt() == set()
    ckpt.recover()
    expected = torch.load(tmp_path / expect)
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name
    files = {p.name for p in (tmp_path / "rank_00000").iterdir()}
    assert files == {"manifest.json"} | {e["file"] for e in ckpt.entries.values()}  # orphans removed


@pytest.mark.parametrize("block_bytes", [16 << 20, 384])  # whole tensors up to the budget; row slices
def test_partial_recovery_restores_exactly_the_lost_blocks(tmp_path, block_bytes):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = ScarConfig(fraction=0.5, every_steps=2, block_bytes=block_bytes)
    ckpt = RunningCheckpoint(tmp_path, dict(model.named_parameters()), cfg, opt)
    at_save: dict[str, tuple[dict, dict]] = {}
    for step in range(9):
        train_steps(model, opt, 1, seed=step)
        for bid in ckpt.maybe_save(step):
            at_save[bid] = snapshot(model, opt)
    train_steps(model, opt, 1, seed=99)  # live state moves past the last save
    lost = pick_blocks(ckpt.blocks, 0.4, torch.Generator().manual_seed(3))
    before_params, before_state = snapshot(model, opt)
    damage_blocks(dict(model.named_parameters()), lost, mode="perturb")
    assert ckpt.recover({b.id for b in lost}) == [b.id for b in lost]
    params, state = snapshot(model, opt)
    lost_ids = {b.id for b in lost}
    for b in ckpt.blocks:
        ref_params, ref_state = at_save[b.id] if b.id in lost_ids else (before_params, before_state)
        assert torch.equal(b.rows(params[b.name]), b.rows(ref_params[b.name])), b.id
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(b.rows(state[b.name][key]), b.rows(ref_state[b.name][key])), (b.id, key)


def test_max_change_writes_the_blocks_that_moved_most_and_all_blocks_stay_held(tmp_path):
    params = {f"w{i}": torch.zeros(4, 3) for i in range(8)}
    ckpt = RunningCheckpoint(tmp_path, params, ScarConfig(fraction=0.25, every_steps=1))
    assert ckpt.maybe_save(0) == list(params)  # first save holds every block
    moves = [0.3, 2.0, 0.1, 0.0, 5.0, 1.0, 0.2, 0.4]
    for i, m in enumerate(moves):
        params[f"w{i}"] += m
    assert ckpt.maybe_save(1) == ["w1", "w4"]
    norms = ckpt.change_norms()
    assert norms["w1"] == norms["w4"] == 0 and norms["w5"] == pytest.approx(1.0 * 12**0.5)
    assert ckpt.maybe_save(2) == ["w5", "w7"]
    reopened = RunningCheckpoint(tmp_path, params, ScarConfig(fraction=0.25, every_steps=1))
    assert set(reopened.entries) == set(params) and reopened.detect_corrupt() == set()


def test_max_change_ranks_by_squared_change_per_byte_within_the_byte_budget(tmp_path):
    params = {"big": torch.zeros(8, 4), **{f"s{i}": torch.zeros(1, 4) for i in range(4)}}
    params["pad"] = torch.zeros(16, 4)  # 256 bytes: more than one save's budget, so two blocks of 8 rows
    cfg = ScarConfig(fraction=0.3, every_steps=1)  # 134 of 448 bytes per save
    ckpt = RunningCheckpoint(tmp_path, params, cfg)
    assert [b.id for b in ckpt.blocks][-2:] == ["pad[0:8]", "pad[8:16]"]
    ckpt.maybe_save(0)
    for name, move in {"big": 1.0, "s0": 2.0, "s1": 0.1, "s2": 3.0, "s3": 1.5}.items():
        params[name] += move
    # squared change per byte: s2 2.25, s0 1.0, s3 0.56, big 0.25, s1 0.0025; big has the 2nd largest norm
    assert ckpt.maybe_save(1) == ["s0", "s2", "s3"]
    assert ckpt.credit == 134 - 48  # big (128 bytes) comes next: the rest is saved up for it
    # 220 bytes: big, then s1 and the unchanged small blocks fit in what is left; a pad block does not
    assert ckpt.maybe_save(2) == ["big", "s0", "s1", "s2", "s3"]
    assert ckpt.credit == 220 - 128 - 64 and ckpt.change_norms() == dict.fromkeys(ckpt._index, 0.0)
    reopened = RunningCheckpoint(tmp_path, params, cfg)
    assert set(reopened.entries) == set(ckpt._index) and reopened.credit == ckpt.credit


def test_max_change_measures_change_in_adams_preconditioned_norm(tmp_path):
    params = {n: torch.nn.Parameter(torch.zeros(2, 2)) for n in ("a", "b")}
    opt = torch.optim.Adam(params.values())
    for p, v in ((params["a"], 16.0), (params["b"], 1.0)):  # a has 4x the gradient RMS of b
        opt.state[p].update(
            step=torch.tensor(1.0), exp_avg=torch.zeros(2, 2), exp_avg_sq=torch.full((2, 2), v)
        )
    ckpt = RunningCheckpoint(tmp_path, params, ScarConfig(fraction=0.5, every_steps=1), opt)
    ckpt.maybe_save(0)
    with torch.no_grad():
        params["a"] += 1.0
        params["b"] += 1.5  # moved more in plain norm, less in Adam's: 1.5 < 1.0 * 16 ** 0.25
    assert ckpt.change_norms() == {"a": pytest.approx(4.0), "b": pytest.approx(3.0)}
    assert ckpt.maybe_save(1) == ["a"]


@pytest.mark.parametrize("select", ["max-change", "round-robin", "random"])
def test_byte_budget_bounds_each_save_and_is_spent_exactly_over_time(tmp_path, select):
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = ScarConfig(fraction=0.25, every_steps=1, block_bytes=720, select=select)  # 15 rows
    ckpt = RunningCheckpoint(tmp_path, dict(model.named_parameters()), cfg, opt)
    train_steps(model, opt, 1)  # Adam's state exists from here on
    assert ckpt.maybe_save(0) == [b.id for b in ckpt.blocks]
    sizes = ckpt.block_bytes()
    # values + exp_avg + exp_avg_sq rows, and the scalar step: optimizer state is part of the budget
    assert sizes["0.weight[0:15]"] == 3 * 15 * 12 * 4 + 4 and sizes["0.weight[30:40]"] == 3 * 10 * 12 * 4 + 4
    share = round(0.25 * sum(sizes.values()))
    spent = 0
    for step in range(1, 41):
        train_steps(model, opt, 1, seed=step)
        credit = ckpt.credit
        written = sum(sizes[b] for b in ckpt.maybe_save(step))
        assert written <= credit + share and ckpt.credit < max(sizes.values())
        spent += written
    assert spent == 40 * share - ckpt.credit  # long-run bytes per save equal the share, to the byte
    on_disk = sum(e["bytes"] for e in ckpt.entries.values())
    assert sum(sizes.values()) < on_disk < sum(sizes.values()) + 1024 * len(sizes)  # payload + headers


def test_copies_saved_before_the_optimizer_state_existed_are_rewritten_with_it(tmp_path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = RunningCheckpoint(tmp_path, dict(model.named_parameters()), ScarConfig(every_steps=2), opt)
    ckpt.maybe_save(0)  # Adam creates its state at the first step
    train_steps(model, opt, 1)
    assert ckpt.maybe_save(1) == []  # off schedule
    assert ckpt.maybe_save(2) == [b.id for b in ckpt.blocks]  # outside the 25% budget: copies lack state
    _, state = snapshot(model, opt)
    train_steps(model, opt, 1, seed=3)
    ckpt.recover(["0.weight"])
    assert torch.equal(opt.state[model[0].weight]["exp_avg_sq"], state["0.weight"]["exp_avg_sq"])
    assert ckpt.maybe_save(4) != [b.id for b in ckpt.blocks]  # back to the budget


def test_round_robin_and_random_cover_every_block(tmp_path):
    params = {f"w{i}": torch.randn(10) for i in range(6)}
    rr = RunningCheckpoint(
        tmp_path / "rr", params, ScarConfig(fraction=1 / 3, every_steps=1, select="round-robin")
    )
    rr.maybe_save(0)
    assert [rr.maybe_save(s) for s in (1, 2, 3)] == [["w0", "w1"], ["w2", "w3"], ["w4", "w5"]]
    rnd = RunningCheckpoint(
        tmp_path / "rnd", params, ScarConfig(fraction=0.5, every_steps=1, select="random")
    )
    rnd.maybe_save(0)
    picks = [tuple(rnd.maybe_save(s)) for s in range(1, 6)]
    assert all(len(p) == 3 for p in picks) and len(set(picks)) > 1


def test_full_recovery_of_a_full_save_continues_bit_identically(tmp_path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 3)
    cfg = ScarConfig(fraction=1, every_steps=1, block_bytes=288)  # 6 rows of 12 floats
    RunningCheckpoint(tmp_path, dict(model.named_parameters()), cfg, opt).save(3)
    train_steps(model, opt, 4, seed=7)
    reference, _ = snapshot(model, opt)
    fresh = tiny_model(seed=11)  # a new process: other weights, no optimizer state
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    RunningCheckpoint(tmp_path, dict(fresh.named_parameters()), cfg, fresh_opt).recover()
    train_steps(fresh, fresh_opt, 4, seed=7)
    params, _ = snapshot(fresh, fresh_opt)
    for name in reference:
        assert torch.equal(params[name], reference[name]), name


def test_corrupt_file_is_detected_refused_and_healed(tmp_path):
    params = {f"w{i}": torch.randn(6, 2) for i in range(4)}
    cfg = ScarConfig(fraction=0.5, every_steps=10)
    ckpt = RunningCheckpoint(tmp_path, params, cfg)
    ckpt.maybe_save(0)
    truncate_file(ckpt.folder / ckpt.entries["w2"]["file"], keep=0.5)
    assert ckpt.detect_corrupt() == {"w2"}
    with pytest.raises(CorruptBlockError, match="checksum"):
        ckpt.recover({"w2"})
    ckpt.recover({"w1"})  # survivors of the checkpoint still restore
    reopened = RunningCheckpoint(tmp_path, params, cfg)
    with pytest.raises(CorruptBlockError, match="to resolve, restore them from the last full checkpoint"):
        reopened.recover({"w2"})
    assert reopened.maybe_save(3) == ["w2"]  # off schedule, but a block without a valid copy is rewritten
    assert reopened.detect_corrupt() == set()


def test_nan_blocks_are_detected_and_recovered(tmp_path):
    params = {"a": torch.randn(20, 8), "b": torch.randn(7)}
    cfg = ScarConfig(fraction=1, block_bytes=256, every_steps=1)  # 8 rows
    ckpt = RunningCheckpoint(tmp_path, params, cfg)
    ckpt.maybe_save(0)
    kept = params["a"].clone()
    damage_blocks(params, ckpt.resolve(["a[8:16]"]), mode="nan")
    assert ckpt.detect_nonfinite() == {"a[8:16]"}
    ckpt.recover(ckpt.detect_nonfinite())
    assert torch.equal(params["a"], kept)


def test_ranks_write_disjoint_blocks_and_recover_only_their_own(tmp_path):
    model = tiny_model()
    named = list(model.named_parameters())
    shares = [owned_by_rank(named, r, 2) for r in range(2)]
    assert set(shares[0]).isdisjoint(shares[1]) and set(shares[0]) | set(shares[1]) == {n for n, _ in named}
    cfg = ScarConfig(fraction=1, every_steps=1)
    ckpts = [RunningCheckpoint(tmp_path, shares[r], cfg, rank=r) for r in range(2)]
    for c in ckpts:
        c.maybe_save(0)
    before = {n: p.detach().clone() for n, p in named}
    with torch.no_grad():
        for p in shares[1].values():
            p.zero_()  # rank 1 died
        for p in shares[0].values():
            p.add_(1.0)  # rank 0 kept training
    ckpts[1].recover()
    for name, p in model.named_parameters():
        expected = before[name] + (1.0 if name in shares[0] else 0.0)
        assert torch.equal(p, expected), name


def _ddp_rank(rank: int, root: str, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world)
    model = tiny_model(seed=0)  # identical replicas
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 3)
    cfg = ScarConfig(fraction=1, every_steps=1, block_bytes=384)
    named = list(model.named_parameters())
    RunningCheckpoint(root, owned_by_rank(named, rank, world), cfg, opt, rank=rank).save(3)
    expected = snapshot(model, opt)
    # every replica lost: restarted processes with other weights and no optimizer state
    fresh = tiny_model(seed=10 + rank)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    train_steps(fresh, fresh_opt, 1, seed=rank)
    named = list(fresh.named_parameters())
    RunningCheckpoint(root, owned_by_rank(named, rank, world), cfg, fresh_opt, rank=rank).recover()
    broadcast_from_owners(named, fresh_opt)
    params, state = snapshot(fresh, fresh_opt)
    for name in params:
        assert torch.equal(params[name], expected[0][name]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[name][key], expected[1][name][key]), (name, key)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_full_loss_each_rank_restores_its_share_and_broadcasts(tmp_path):
    torch.multiprocessing.spawn(_ddp_rank, args=(str(tmp_path), 2), nprocs=2)
    assert {p.name for p in tmp_path.glob("rank_*")} == {"rank_00000", "rank_00001"}


ZERO_SCRIPT = """
import os, sys, tempfile, torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.distributed.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")  # takes the process group above
from distill.scar.config import ScarConfig
from distill.scar.faults import damage_blocks
from distill.scar.running import RunningCheckpoint
from distill.scar.zero import push_to_model, zero_partitions
for stage in (2, 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    def step():
        engine.backward(engine(torch.randn(4, 12)).pow(2).mean())
        engine.step()
    for _ in range(3):
        step()
    parts, base = zero_partitions(opt)
    cfg = ScarConfig(block_bytes=400, fraction=0.5, every_steps=1)
    ckpt = RunningCheckpoint(tempfile.mkdtemp(), parts, cfg, base)
    ckpt.maybe_save(3)
    local = (lambda p: p.ds_tensor) if stage == 3 else (lambda p: p)
    weights = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in base.state[parts["zero_partition_0"]].items()}
    lost = ckpt.blocks[1:3]
    damage_blocks(parts, lost, "perturb")
    for v in base.state[parts["zero_partition_0"]].values():
        for b in lost if v.dim() else ():  # the shared scalar step survives a partial loss
            b.rows(v).zero_()
    with torch.no_grad():
        for p in model.parameters():
            local(p).zero_()
    ckpt.recover(b.id for b in lost)
    push_to_model(opt)
    for n, p in model.named_parameters():
        assert torch.equal(local(p), weights[n]), (stage, n)
    for k, v in base.state[parts["zero_partition_0"]].items():
        assert torch.equal(v, state[k]), (stage, k)
    step()
print("ok")
"""


@pytest.mark.slow
def test_zero_partitions_recover_into_the_model_under_deepspeed(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    init = f"file://{tmp_path}/rendezvous"
    proc = subprocess.run(
        [sys.executable, "-c", ZERO_SCRIPT, init],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_recover_newer_than_skips_blocks_older_than_the_full_checkpoint(tmp_path):
    params = {"a": torch.zeros(3), "b": torch.zeros(3)}
    ckpt = RunningCheckpoint(tmp_path, params, ScarConfig(fraction=0.5, every_steps=1))
    ckpt.maybe_save(0)
    params["a"] += 1
    ckpt.maybe_save(5)  # only "a" moved
    params["a"] += 1
    params["b"] += 1
    assert ckpt.recover(newer_than=3) == ["a"]
    assert params["a"].tolist() == [1.0] * 3 and params["b"].tolist() == [1.0] * 3
    fresh = RunningCheckpoint(tmp_path, params, ScarConfig(fraction=0.5, every_steps=1), resume=False)
    assert fresh.entries == {} and list((tmp_path / "rank_00000").iterdir()) == []


def test_config_errors_name_the_input_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="fraction"):
        ScarConfig(fraction=0)
    with pytest.raises(ValueError, match="extra"):
        ScarConfig(blocks="tensor")
    assert ScarConfig.equal_budget(200, 0.25).every_steps == 50
    with pytest.raises(ValueError, match="to resolve, pick a fraction"):
        ScarConfig.equal_budget(10, 0.25)
    with pytest.raises(ValueError, match="unknown block or parameter"):
        RunningCheckpoint(tmp_path, {"x": torch.zeros(2)}, ScarConfig()).recover({"y"})
    assert [
        b.id for b in make_blocks({"x": torch.zeros(5, 64)}, ScarConfig(fraction=1, block_bytes=512))
    ] == [
        "x[0:2]",
        "x[2:4]",
        "x[4:5]",
    ]
    with pytest.raises(ValueError, match="block was replaced by block_bytes .*; to resolve"):
        ScarConfig(block="row-block", rows_per_block=64)
    with pytest.raises(ValueError, match="block_bytes"):
        ScarConfig(block_bytes=16)


@pytest.mark.parametrize("stage_elements", [8_000_000_000 // 8, 70_000_000_000 // 64, 3_000_000])
def test_blocks_are_sized_in_bytes_bounded_in_count_and_inside_one_saves_budget(stage_elements):
    """A ZeRO flat partition of an 8B model on 8 ranks, of a 70B one on 64, and a small one: at most
    MAX_BLOCKS files however many elements, none larger than one save's budget, about block_bytes when
    the count allows it, and they tile the partition."""
    partition = {"zero_partition_0": torch.empty(stage_elements, device="meta")}
    total = stage_elements * 4
    for cfg in (
        ScarConfig(),
        ScarConfig(block_bytes=1 << 20),
        ScarConfig(fraction=0.01, block_bytes=1 << 30),
    ):
        blocks = make_blocks(partition, cfg)
        sizes = [4 * (b.stop - b.start) for b in blocks]
        assert len(blocks) <= MAX_BLOCKS and max(sizes) <= cfg.fraction * total
        assert blocks[0].start == 0 and blocks[-1].stop == stage_elements
        assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:], strict=False))
        if total / cfg.block_bytes <= MAX_BLOCKS / 2 and cfg.block_bytes <= cfg.fraction * total:
            assert max(sizes) == cfg.block_bytes  # the asked size when nothing bounds it
    many = {f"t{i}": torch.empty(100, 64, device="meta") for i in range(300)}  # 300 tensors of 25 kB
    assert len(make_blocks(many, ScarConfig(block_bytes=256))) <= MAX_BLOCKS


def test_resume_onto_a_full_checkpoint_takes_newer_blocks_and_reports_damaged_ones(tmp_path):
    params = {n: torch.nn.Parameter(torch.zeros(4, 64)) for n in ("a", "b", "c")}
    opt = torch.optim.Adam(params.values())
    cfg = ScarConfig(fraction=1 / 3, every_steps=1, block_bytes=1024)
    ckpt = RunningCheckpoint(tmp_path, params, cfg, opt)
    ckpt.maybe_save(1)
    for step, name in ((2, "a"), (3, "b")):  # a and b move and are saved after the full checkpoint (step 1)
        with torch.no_grad():
            params[name] += step
        assert ckpt.maybe_save(step) == [name]
    truncate_file(ckpt.folder / ckpt.entries["b"]["file"])
    with torch.no_grad():  # the restarted process: the full checkpoint of step 1 loaded
        for p in params.values():
            p.zero_()
    reopened = RunningCheckpoint(tmp_path, params, cfg, opt)
    assert reopened.step == 3 and reopened.resume_onto(full_step=1) == ["b"]
    assert params["a"].eq(2).all() and params["b"].eq(0).all() and params["c"].eq(0).all()
    counters = {0: torch.tensor(5.0), 2: 7}
    for p in params.values():
        opt.state[p]["step"] = torch.tensor(0.0)
    advance_step_counters(opt, counters, 2)
    assert [opt.state[p]["step"].item() for p in params.values()] == [7.0, 0.0, 9.0]
