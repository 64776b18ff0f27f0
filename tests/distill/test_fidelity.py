"""The reference's data, batching and loss, reproduced: a local copy of a gated source, unpacked conversations,
and the reference's loss normalisation."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT
from helpers.chat import byte_tokenizer
from helpers.models import tiny_base

from distill.data import DataError, check_sources, load_source
from distill.objective import DistillationObjective
from distill.recipe import LossSection, RecipeError, load_recipe
from swiftkv.convert import to_swiftkv


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    import huggingface_hub

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert huggingface_hub.get_token() is None


def test_a_local_copy_of_a_gated_source_needs_no_token(no_token, tmp_path):
    """The GPU recipes mark LMSYS-Chat-1M gated; pointing that source at a local file (a copy made once, on a
    machine with a login) reads it without a token, while the hub name itself is still refused."""
    rows = [
        {
            "conversation_id": str(i),
            "conversation": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
        }
        for i in range(3)
    ]
    local = tmp_path / "lmsys.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe_path = ROOT / "recipes" / "swiftkv_llama3.1_8b.yaml"
    gated = [i for i, s in enumerate(load_recipe(recipe_path).data.sources) if s.gated]
    assert gated, "the recipe no longer has a gated source"
    recipe = load_recipe(recipe_path, [f"data.sources.{gated[0]}.path={local}"])
    source = recipe.data.sources[gated[0]]
    assert source.gated and source.format == "lmsys"
    check_sources(recipe.data)
    assert [r["conversation_id"] for r in load_source(source)] == ["0", "1", "2"]

    missing = load_recipe(recipe_path, [f"data.sources.{gated[0]}.path={tmp_path / 'gone.jsonl'}"])
    with pytest.raises(DataError, match=r"^data file .*gone\.jsonl not found \(to resolve"):
        check_sources(missing.data)
    with pytest.raises(DataError, match=r"lmsys/lmsys-chat-1m.*gated.*hf auth login"):
        check_sources(load_recipe(recipe_path).data)


def reference_trainer_loss(model, ids, pos, labels_mask, temperature=2.0, hidden_weight=1.0):
    """The reference trainer's loss, written out from its definition (ArcticTraining projects/swiftkv/train.py):
    two full passes; KL(softmax(t/T) || softmax(s/T)) per position, times the mask, averaged over every position of
    the tensor and scaled by T^2; plus the MSE of ``hidden_states[-2]`` averaged over all positions."""
    model.set_mode("teacher")
    with torch.no_grad():
        t = model(ids, position_ids=pos, use_cache=False, output_hidden_states=True)
    model.set_mode("student")
    s = model(ids, position_ids=pos, use_cache=False, output_hidden_states=True)
    soft_targets = torch.softmax(t.logits.float() / temperature, -1)
    soft_prob = torch.log_softmax(s.logits.float() / temperature, -1)
    kl = (soft_targets * (soft_targets.log() - soft_prob)).sum(-1) * labels_mask
    kl = (kl * temperature**2).mean()
    mse = torch.nn.functional.mse_loss(s.hidden_states[-2].float(), t.hidden_states[-2].float())
    return kl + hidden_weight * mse, kl, mse


def test_positions_normalisation_is_the_reference_trainers_loss():
    """``loss.normalize: positions`` gives the reference trainer's value and gradients (shared lower layers,
    chunked KD) on a batch with prompt and padding positions; ``counted`` differs from it exactly by the
    counted share for the KL."""
    model = to_swiftkv(tiny_base("llama"), 3, 1)
    gen = torch.Generator().manual_seed(0)
    for name in model.swiftkv_parameter_names():  # make the paths differ, as during training
        p = model.get_parameter(name)
        p.data.add_(0.05 * torch.randn(p.shape, generator=gen))
    for name, p in model.named_parameters():
        p.requires_grad_(name in model.swiftkv_parameter_names())
    ids = torch.randint(3, 128, (2, 12), generator=gen)
    pos = torch.arange(12).expand(2, -1)
    mask = (torch.rand(2, 12, generator=gen) > 0.5).long()

    model.zero_grad()
    want, want_kl, want_mse = reference_trainer_loss(model, ids, pos, mask)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    out = {}
    for normalize in ("positions", "counted"):
        model.zero_grad()
        objective = DistillationObjective(model, LossSection(chunk_tokens=7, normalize=normalize))
        out[normalize] = objective(ids, pos, mask)
        out[normalize]["loss"].backward()
        if normalize == "positions":
            for name, grad in want_grads.items():
                torch.testing.assert_close(model.get_parameter(name).grad, grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out["positions"]["loss"].detach(), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["positions"]["kl"], want_kl.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out["positions"]["mse"], want_mse.detach(), atol=1e-6, rtol=1e-5)
    share = mask.sum() / mask.numel()
    assert 0.2 < share < 0.8
    torch.testing.assert_close(out["positions"]["kl"], out["counted"]["kl"] * share, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(out["positions"]["mse"], out["counted"]["mse"])


def test_unknown_normalisation_is_refused_at_validation(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text('{"output_dir": "x", "model": {"source": "m"}, "data": {"sources": [{"path": "d"}]}}')
    with pytest.raises(RecipeError, match=r"loss\.normalize: Input should be 'counted' or 'positions'"):
        load_recipe(path, ["loss.normalize=tokens"])


def test_rows_longer_than_the_models_positions_are_refused_before_any_work(
    tiny_llama_dir, chat_data, tmp_path, capsys
):
    """The reference's long-context recipes (128k+ tokens, sequence parallel) have no counterpart here: a row
    longer than the model's positions is refused in one line before the base model is converted."""
    from distill.__main__ import main

    byte_tokenizer().save_pretrained(tiny_llama_dir)  # a complete model: only the sequence length is wrong
    out = tmp_path / "out"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        json.dumps(
            {
                "output_dir": str(out),
                "model": {"source": str(tiny_llama_dir), "swiftkv": {"num_key_value_layers": 3}},
                "data": {"sources": [{"path": str(chat_data)}], "seq_len": 512},
            }
        )
    )
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: data.seq_len=512 exceeds the model's max_position_embeddings=256 (to resolve, lower data.seq_len)\n"
    )
    assert not out.exists()
