"""Single-process tests of distill.comm: the config, block priorities and AdaRevision's exact update."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from distill.comm import AdaRevision, CommConfig, priority


def test_config_rejects_unknown_keys_and_bad_combinations():
    with pytest.raises(ValidationError, match="extra"):
        CommConfig(hook="managed", bugdet=0.1)
    with pytest.raises(ValidationError, match="use priority=random or fifo"):
        CommConfig(hook="managed", budget=0.1, staleness=1)
    with pytest.raises(ValidationError, match="hook=powersgd"):
        CommConfig(hook="powersgd", staleness=1)
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        CommConfig(budget=1.5)
    assert CommConfig(hook="managed", priority="fifo", staleness=2).staleness == 2


def test_relative_magnitude_prefers_large_relative_change():
    # block 0: small change of a tiny weight; block 1: large change of a large weight; block 2: x = 0
    update = torch.tensor([0.01, 0.01, 1.0, 1.0, 0.5, 0.5])
    x = torch.tensor([0.001, 0.001, 100.0, 100.0, 0.0, 0.0])
    rel = priority.magnitude_scores(update, x, 2)
    mag = priority.magnitude_scores(update, None, 2)
    torch.testing.assert_close(rel, torch.tensor([20.0, 0.02, 1.0]))
    assert priority.choose(rel, 1).tolist() == [0]
    assert priority.choose(mag, 1).tolist() == [1]
    assert priority.choose(rel, 2).tolist() == [0, 2]


def test_blocks_pad_the_tail():
    b = priority.blocks(torch.arange(5.0), 2)
    assert b.shape == (3, 2) and b[2].tolist() == [4.0, 0.0]


def test_fifo_is_round_robin_and_random_is_shared():
    ages = torch.zeros(7)
    seen = []
    for _ in range(4):
        chosen = priority.choose(priority.fifo_scores(ages), 2)
        ages += 1
        ages[chosen] = 0
        seen += chosen.tolist()
    assert seen == [0, 1, 2, 3, 4, 5, 0, 6]  # block 6 (oldest) and then the lowest index
    a, b = priority.random_scores(9, 0, 3, 1), priority.random_scores(9, 0, 3, 1)
    assert torch.equal(a, b) and not torch.equal(a, priority.random_scores(9, 0, 4, 1))


def test_adarevision_hand_computed_sequence():
    """alpha=1, x0=0; g=3/4 fresh, g=-1/2 computed on x0 (one step stale), g=2 read after step 1."""
    x = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = AdaRevision([x], lr=1.0)
    read0 = opt.snapshot()
    x.grad = torch.tensor([0.75], dtype=torch.float64)
    opt.step(read=read0)  # z = 1 + 9/16 = 25/16, eta = 4/5
    assert x.item() == pytest.approx(-3 / 5, abs=1e-12)
    read1 = opt.snapshot()
    x.grad = torch.tensor([-0.5], dtype=torch.float64)
    opt.step(read=read0)  # g_bck = 3/4: z = 25/16 + 1/4 - 3/4 = 17/16 < z_max, the step size stays 4/5
    assert x.item() == pytest.approx(-1 / 5, abs=1e-12)
    assert opt.state[x]["z"].item() == pytest.approx(17 / 16)
    assert opt.state[x]["z_max"].item() == pytest.approx(25 / 16)
    x.grad = torch.tensor([2.0], dtype=torch.float64)
    opt.step(read=read1)  # g_bck = 1/4 - 3/4: z = 17/16 + 4 - 2 = 49/16, eta = 4/7, revision (4/5-4/7)(-1/2)
    assert x.item() == pytest.approx(-51 / 35, abs=1e-12)
    assert opt.state[x]["gsum"].item() == pytest.approx(9 / 4)
    assert opt.state[x]["z_max"].item() == pytest.approx(49 / 16)


def test_adarevision_without_delay_is_adagrad():
    torch.manual_seed(0)
    a = torch.randn(5, 3, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ours = AdaRevision([a], lr=0.3)
    ref = torch.optim.Adagrad([b], lr=0.3, initial_accumulator_value=1.0, eps=0.0)
    for _ in range(20):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b)


def test_adarevision_delay_uses_the_snapshot_from_delay_steps_ago():
    torch.manual_seed(1)
    x0 = torch.randn(4)
    a, b, c = (x0.clone().requires_grad_(True) for _ in range(3))
    piped, explicit, fresh = (
        AdaRevision([a], lr=0.5, delay=2),
        AdaRevision([b], lr=0.5),
        AdaRevision([c], lr=0.5),
    )
    reads = []
    for _ in range(10):
        reads.append(explicit.snapshot())
        g = torch.randn(4)
        a.grad, b.grad, c.grad = g.clone(), g.clone(), g.clone()
        piped.step()
        explicit.step(read=reads[max(0, len(reads) - 3)])
        fresh.step()
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)  # the correction did something


def test_attach_leaves_non_ddp_models_alone_unless_asked_for_more():
    from distill.comm import attach_comm_hook, register_comm_hook

    model = torch.nn.Linear(2, 2)
    assert attach_comm_hook(model, CommConfig()) is None
    with pytest.raises(ValueError, match="needs the multi-process DDP path.*to resolve"):
        attach_comm_hook(model, CommConfig(hook="managed", budget=0.1))
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_comm_hook(model, CommConfig())


def test_comm_sections_only_ddp_can_run_are_refused_before_any_work(tiny_llama_dir, tmp_path):
    """Under DeepSpeed a DDP comm hook would silently not apply; on one process there is nothing to
    communicate: both are one-line errors before conversion, data or model loading (no output folder)."""
    from distill.comm.config import require_ddp_path
    from distill.recipe import load_recipe
    from distill.train import train

    managed = CommConfig(hook="managed", budget=0.1)
    require_ddp_path(CommConfig(), deepspeed=True, processes=8)  # plain all-reduce: DeepSpeed's own
    require_ddp_path(managed, deepspeed=False, processes=2)
    with pytest.raises(ValueError, match="under DeepSpeed, which keeps its own gradient communication"):
        require_ddp_path(managed, deepspeed=True, processes=8)
    with pytest.raises(ValueError, match=r"staleness 2\) cannot run under DeepSpeed"):
        require_ddp_path(CommConfig(staleness=2), deepspeed=True, processes=8)
    data = tmp_path / "chats.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    recipe = tmp_path / "r.yaml"
    out = tmp_path / "out"
    recipe.write_text(
        f"output_dir: {out}\nmodel: {{source: {tiny_llama_dir}, swiftkv: {{num_key_value_layers: 3}}}}\n"
        f"data: {{sources: [{{path: {data}}}]}}\ncomm: {{hook: managed, budget: 0.1}}\n"
    )
    with pytest.raises(ValueError, match=r"cannot run on one process \(to resolve") as e:
        train(load_recipe(recipe, []))
    assert "\n" not in str(e.value) and not out.exists()
