"""``distill.budget`` and the run plans of ``swiftkv check``: FLOPs per row against torch's own FLOP
counter on a real training step, and the multi-node GPU recipes planned from their launch configs."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from helpers import ROOT
from helpers.models import tiny_base
from torch.utils.flop_counter import FlopCounterMode

from distill.budget import plan_budget, training_flops_per_row
from distill.check import main
from distill.objective import DistillationObjective
from distill.recipe import Recipe
from distill.train import select_trainable
from swiftkv.convert import to_swiftkv
from swiftkv.flops import Shape, attention_flops

CONFIGS = ROOT / "recipes" / "model_configs"
# each GPU recipe at the scale its header names: (recipe, accelerate config, model config, nodes, processes)
AT_SCALE = {
    "llama3.1_8b": ("swiftkv_llama3.1_8b.yaml", "8gpu_zero2.yaml", 1, 8),
    "qwen2.5_7b": ("swiftkv_qwen2.5_7b.yaml", "8gpu_zero2.yaml", 1, 8),
    "qwen2.5_14b": ("swiftkv_qwen2.5_14b.yaml", "8gpu_zero2.yaml", 1, 8),
    "qwen2.5_32b": ("swiftkv_qwen2.5_32b.yaml", "8gpu_zero3.yaml", 1, 8),
    "llama3.3_70b": ("swiftkv_llama3.3_70b.yaml", "64gpu_8nodes_zero3.yaml", 8, 64),
    "llama3.1_405b": ("swiftkv_llama3.1_405b.yaml", "128gpu_16nodes_zero3.yaml", 16, 128),
}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_flops_per_row_match_torchs_count_of_a_training_step(checkpointing):
    """Forward, KD loss and backward of a real step on a tiny SwiftKV Llama, counted by torch's FlopCounterMode
    (every matmul as executed), against the formula with every position counted by the loss, as it assumes.
    The counter has no formula for CPU sdpa's fused kernel, so the formula's attention terms (causal, analytic)
    are left out of the comparison; what remains differs only by the first upper layer's q projection, whose
    input needs no gradient (its input comes from the frozen lower layers)."""
    seq = 24
    model = to_swiftkv(tiny_base("llama"), 3, 1)
    model.set_mode("student")
    recipe = Recipe.model_validate(
        {
            "output_dir": "unused",
            "model": {"source": "unused"},
            "data": {"sources": [{"path": "unused"}]},
            "loss": {"chunk_tokens": 1000},
            "train": {"gradient_checkpointing": checkpointing},
        }
    )
    model = select_trainable(model, recipe)
    objective = DistillationObjective(model, recipe.loss).train()
    ids = torch.randint(3, 128, (1, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq)[None]
    counter = FlopCounterMode(display=False)
    with counter:
        objective(ids, pos, torch.ones(1, seq, dtype=torch.long))["loss"].backward()
    shape = Shape.from_config(model.config)
    trainable = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "norm" not in n)
    expected = training_flops_per_row(shape, seq, trainable, checkpointing)
    upper = shape.layers - shape.num_key_value_layers
    passes = shape.layers + upper * (3 + checkpointing)  # teacher; student forward, backward x2, recompute
    expected -= passes * attention_flops(shape, seq)
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.02)


def test_rows_steps_and_hours_follow_the_batch():
    shape = Shape.from_config(
        {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
            "num_key_value_layers": 16,
        }
    )
    common = dict(
        samples=100_000, sample_tokens=900.0, seq_len=8192, micro_batch=1, epochs=1.0, max_steps=None
    )
    packed = plan_budget(shape, 10**8, packing=True, grad_accum=1, processes=8, checkpointing=True, **common)
    assert packed.rows == -(-100_000 * 900 // 8192) and packed.steps == packed.rows // 8
    more_gpus = plan_budget(
        shape, 10**8, packing=True, grad_accum=1, processes=64, checkpointing=True, **common
    )
    assert more_gpus.steps == packed.rows // 64
    assert more_gpus.hours == pytest.approx(
        packed.hours * (packed.rows // 64 * 64) / (packed.rows // 8 * 8) / 8
    )
    unpacked = plan_budget(
        shape, 10**8, packing=False, grad_accum=4, processes=8, checkpointing=True, **common
    )
    assert unpacked.rows == 100_000 and unpacked.steps == 100_000 // 32
    assert unpacked.tokens == unpacked.steps * 32 * 8192  # padding is computed too


def check(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", list(AT_SCALE))
def test_gpu_recipes_are_planned_at_the_references_scale(name, tmp_path, capsys):
    """Each GPU recipe with the launch config its header names fits 80 GB cards, and the plan states the
    nodes, the global batch and the steps that follow from the recipe's data caps."""
    recipe, config, nodes, processes = AT_SCALE[name]
    model = tmp_path / name
    model.mkdir()
    shutil.copy(CONFIGS / name / "config.json", model / "config.json")
    args = [
        ROOT / "recipes" / recipe,
        f"model.source={model}",
        "--config",
        ROOT / "recipes" / "accelerate" / config,
    ]
    code, out, err = check(capsys, *args, "--no-data", "--sample-tokens", "1000")
    assert (code, err) == (0, ""), err
    assert (
        ": fits" in out
        and f"launch: {processes} process(es) on {nodes} node(s) x {processes // nodes}" in out
    )
    assert f"recipe {ROOT / 'recipes' / recipe}: valid" in out
    size = re.search(
        r"size: ([\d,]+) training samples .* -> ([\d,]+) packed rows .* -> ([\d,]+) optimizer steps", out
    )
    samples, rows, steps = (int(g.replace(",", "")) for g in size.groups())
    assert samples == int(3 * 500_000 * (1 - 0.001))
    batch = int(re.search(r"global batch (\d+) rows", out).group(1))
    assert rows == -(-samples * 1000 // int(re.search(r"of (\d+) positions", out).group(1)))
    assert steps == rows // batch and re.search(r"time: .* h on \d+ GPUs .* at 350 TFLOP/s", out)
    code, out, _ = check(capsys, *args, "--no-data")  # without a sample length, no size
    assert code == 0 and "size: not estimated (no tokens per sample (--sample-tokens))" in out


def test_a_launch_config_whose_processes_do_not_split_over_its_nodes_is_one_line(tmp_path, capsys):
    config = tmp_path / "odd.yaml"
    text = (ROOT / "recipes" / "accelerate" / "64gpu_8nodes_zero3.yaml").read_text()
    config.write_text(text.replace("num_processes: 64", "num_processes: 60"))
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(CONFIGS / "llama3.3_70b" / "config.json", model / "config.json")
    code, out, err = check(
        capsys,
        ROOT / "recipes" / "swiftkv_llama3.3_70b.yaml",
        f"model.source={model}",
        "--no-data",
        "--config",
        config,
    )
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "num_processes 60 is not a multiple of num_machines 8" in err and "to resolve" in err


def test_a_sequence_length_no_gpu_holds_is_refused_with_the_longest_that_fits(tmp_path, capsys):
    """128k-token rows of the 70B recipe on 64 GPUs: the activations of one row exceed a GPU whatever the GPU
    count, so the one-line error names the longest data.seq_len that fits, and that one does (1024 more does
    not)."""
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(CONFIGS / "llama3.3_70b" / "config.json", model / "config.json")
    args = [ROOT / "recipes" / "swiftkv_llama3.3_70b.yaml", f"model.source={model}", "--no-data"]
    args += ["--config", ROOT / "recipes" / "accelerate" / "64gpu_8nodes_zero3.yaml"]
    code, _, err = check(capsys, *args, "data.seq_len=131072")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no sequence parallelism" in err
    longest = int(re.search(r"lower data.seq_len to (\d+) or less", err).group(1))
    assert 8192 < longest < 131072 and "more GPUs" not in err
    assert check(capsys, *args, f"data.seq_len={longest}")[0] == 0
    assert check(capsys, *args, f"data.seq_len={longest + 1024}")[0] == 2
