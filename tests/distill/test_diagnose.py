"""The diagnosis: probes recover planted maps, and the oracle with every block swapped is the teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.models import tiny_chat_base

from distill.diagnose import ProbeData, context_features, diagnose, main, probe_errors, report_lines


def rows_with_samples(rows: int, seq: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random features and packed position ids (samples of random lengths restarting at 0)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, seq, d, generator=g)
    pos = torch.zeros(rows, seq, dtype=torch.long)
    for r in range(rows):
        t = 0
        while t < seq:
            n = int(torch.randint(3, 20, (1,), generator=g))
            pos[r, t : t + n] = torch.arange(min(n, seq - t))
            t += n
    return h, pos


def planted(seed: int, neighbour_weight: float) -> tuple[ProbeData, ProbeData]:
    """Targets y_t = h_t A + b + w * h_{t-1} B (h_{t-1} = 0 at a sample's first token), 4 column blocks."""
    d, m = 12, 4 * 6
    g = torch.Generator().manual_seed(100)
    a, b, prev_map = (
        torch.randn(d, m, generator=g),
        torch.randn(m, generator=g),
        torch.randn(d, m, generator=g),
    )
    data = []
    for part, rows in ((0, 16), (1, 6)):
        h, pos = rows_with_samples(rows, 48, d, seed + part)
        prev = context_features(h, pos, 2)[..., d:]
        data.append(ProbeData(h, pos, h @ a + b + neighbour_weight * prev @ prev_map))
    return data[0], data[1]


def test_context_features_stop_at_sample_starts():
    h, pos = torch.arange(1.0, 7.0).reshape(1, 6, 1), torch.tensor([[0, 1, 2, 0, 1, 0]])
    feats = context_features(h, pos, 3)
    assert feats[0].tolist() == [[1, 0, 0], [2, 1, 0], [3, 2, 1], [4, 0, 0], [5, 4, 0], [6, 0, 0]]


def test_probes_recover_a_planted_linear_map():
    fit, held = planted(0, neighbour_weight=0.0)
    errors = probe_errors(fit, held, blocks=4, neighbours=3, ridge=1e-9, mlp_hidden=16, mlp_steps=50)
    assert max(errors["linear"]["held"]) < 1e-8
    assert max(errors["context"]["held"]) < 1e-8
    assert max(errors["mlp"]["held"]) < 1e-3  # starts at the linear fit; the MLP may move it a little


def test_only_the_context_probe_recovers_a_map_over_the_previous_token():
    fit, held = planted(1, neighbour_weight=1.0)
    errors = probe_errors(fit, held, blocks=4, neighbours=2, ridge=1e-9, mlp_steps=0)
    assert min(errors["linear"]["held"]) > 0.2  # half the signal comes from another token
    assert max(errors["context"]["held"]) < 1e-8
    assert "mlp" not in errors


def swiftkv_chat_model(tmp_path: Path, smollm2: Path, family: str, l: int, g: int) -> Path:
    """A tiny random SwiftKV model with the SmolLM2 tokenizer, its SwiftKV projections perturbed (a student
    that differs from its teacher), saved as a checkpoint."""
    from transformers import AutoTokenizer

    from swiftkv.convert import save_pretrained_swiftkv, to_swiftkv

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = to_swiftkv(tiny_chat_base(tokenizer, family), l, g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_proj_swiftkv" in name:
                p.add_(0.05 * torch.randn_like(p))
    path = tmp_path / f"{family}-g{g}"
    save_pretrained_swiftkv(model, path, tokenizer=tokenizer)
    return path


def write_recipe(path: Path, data: Path) -> Path:
    recipe = {
        "output_dir": "unused",
        "model": {"source": "unused"},
        "data": {"sources": [{"path": str(data)}], "seq_len": 64, "holdout": 0.2},
        "loss": {"chunk_tokens": 32},
        "train": {"micro_batch_size": 2},
        "log": {"eval_batches": 3},
    }
    path.write_text(json.dumps(recipe))
    return path


@pytest.mark.smollm2
@pytest.mark.parametrize("family,g,window", [("llama", 1, 0), ("qwen3", 2, 0), ("llama", 1, 3)])
def test_oracle_with_every_block_swapped_is_the_teacher(smollm2, chat_data, tmp_path, family, g, window):
    """Also with exact K/V: the student's layers take them at the served positions, as the trainer's do."""
    from transformers import AutoModelForCausalLM

    from distill.data import build_datasets, collate_rows
    from distill.objective import DistillationObjective
    from distill.recipe import load_recipe

    checkpoint = swiftkv_chat_model(tmp_path, smollm2, family, 2, g)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "exact_kv_window": window}))
    recipe = write_recipe(tmp_path / "recipe.yaml", chat_data)
    result = diagnose(
        checkpoint, tmp_path / "out", recipe, block_layers=2, fit_rows=8, mlp_hidden=8, mlp_steps=5
    )
    oracle = result["oracle"]
    assert oracle["student"]["kl"] > 1e-3
    assert oracle["all_kv_q"]["kl"] < 1e-9 and oracle["all_kv_q"]["top1_agreement"] == 1.0
    assert result["blocks"] == [[2, 3], [4, 5]]
    for block in result["blocks"]:
        assert oracle[f"kv_q_{block[0]}"]["kl"] < oracle["student"]["kl"]

    # the student's KL is the trainer's held-out evaluation of the same rows
    cfg = load_recipe(recipe)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    objective = DistillationObjective(model, cfg.loss).eval()
    _, held = build_datasets(cfg.data, __import__("transformers").AutoTokenizer.from_pretrained(checkpoint))
    with torch.no_grad():
        sums = sum(objective(*collate_rows([held[i], held[i + 1]]))["metrics"] for i in range(0, 6, 2))
    assert oracle["student"]["kl"] == pytest.approx(sums[0].item() / sums[2].item(), rel=1e-5)
    assert oracle["student"]["tokens"] == int(sums[2].item())

    errors = result["probes"]
    assert len(errors["linear"]["held"]) == 2 * 4  # K and V of each of the 4 SwiftKV layers
    assert all(0 <= e < 1.5 for probe in errors.values() for e in probe["held"])
    written = (tmp_path / "out" / "diagnosis.md").read_text()
    assert written.strip() == "\n".join(report_lines(result)).strip()


def test_cli_refuses_a_base_checkpoint_in_one_line(tiny_llama_dir, tmp_path, capsys):
    assert main([str(tiny_llama_dir), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {tiny_llama_dir} is not a SwiftKV checkpoint (to resolve, convert or distill it first)"
    ]
    assert not (tmp_path / "o").exists()
