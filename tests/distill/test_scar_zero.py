"""SCAR under DeepSpeed ZeRO-1/2/3 (fp32 and bf16) on 2 real processes: each rank's partition is read,
saved, lost and recovered into the model's working weights."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

RANK_SCRIPT = """
import os, sys, tempfile, torch
os.environ.update(RANK=sys.argv[2], WORLD_SIZE="2", LOCAL_RANK=sys.argv[2])
torch.distributed.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
import deepspeed
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
deepspeed.init_distributed(dist_backend="gloo")  # takes the process group above
from distill.scar.config import ScarConfig
from distill.scar.running import RunningCheckpoint
from distill.scar.zero import push_to_model, zero_partitions
rank = int(sys.argv[2])
root = sys.argv[3]
for stage, bf16 in ((1, True), (2, True), (3, True), (1, False)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": bf16}, "data_types": {"grad_accum_dtype": "fp32"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert isinstance(opt, BF16_Optimizer) == (stage == 1 and bf16), type(opt)
    gen = torch.Generator().manual_seed(rank)
    def step():
        x = torch.randn(4, 12, generator=gen).to(next(engine.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    for _ in range(3):
        step()
    parts, base = zero_partitions(opt)
    cfg = ScarConfig(block_bytes=400, fraction=0.5, every_steps=1)
    folder = f"{root}/stage{stage}-{bf16}"
    ckpt = RunningCheckpoint(folder, parts, cfg, base, rank=rank)
    ckpt.save(3)
    local = (lambda p: p.ds_tensor) if stage == 3 else (lambda p: p)
    weights = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    masters = {n: t.clone() for n, t in parts.items()}
    states = {n: {k: v.clone() for k, v in base.state[t].items()} for n, t in parts.items()}
    step()  # the live state moves on, then this rank loses all of it
    with torch.no_grad():
        for t in parts.values():
            t.zero_()
        for p in model.parameters():
            local(p).zero_()
    RunningCheckpoint(folder, parts, cfg, base, rank=rank).recover()
    push_to_model(opt)
    for n, p in model.named_parameters():
        assert torch.equal(local(p), weights[n]), (stage, bf16, n)
    for n, t in parts.items():
        assert torch.equal(t, masters[n]), (stage, bf16, n)
        for k, v in base.state[t].items():
            assert torch.equal(v, states[n][k]), (stage, bf16, n, k)
    step()
    print(f"rank {rank} stage {stage} bf16 {bf16}: {len(ckpt.blocks)} blocks ok", flush=True)
"""


@pytest.mark.slow
def test_zero_stages_and_bf16_partitions_recover_on_two_processes(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    init = f"file://{tmp_path}/rendezvous"  # no port to find or to lose
    procs = []
    try:
        for rank in range(2):  # each rank's output in files of its own: no pipe fills while another is read
            with (
                open(tmp_path / f"rank{rank}.out", "w") as out,
                open(tmp_path / f"rank{rank}.err", "w") as err,
            ):
                cmd = [sys.executable, "-c", RANK_SCRIPT, init, str(rank), str(tmp_path)]
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=tmp_path))
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank, code in enumerate(codes):
        assert code == 0, (tmp_path / f"rank{rank}.err").read_text()[-3000:]
        out = (tmp_path / f"rank{rank}.out").read_text()
        assert out.count("blocks ok") == 4, out
    assert {p.name for p in (tmp_path / "stage1-True").iterdir()} == {"rank_00000", "rank_00001"}
