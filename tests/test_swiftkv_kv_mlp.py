"""The optional K/V MLP (``swiftkv_kv_mlp``): off = the checkpoint format as before; on = exact zero start, the
same numbers on every inference path, its FLOPs, and a distillation that trains it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_base
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from swiftkv.convert import save_pretrained_swiftkv, to_swiftkv
from swiftkv.flops import Shape, prefill_flops_swiftkv

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5


def tensor_names(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def with_mlp(tmp_path: Path, family: str, g: int, width: int = 16):
    """A converted tiny model saved without the MLP, reloaded with one, its MLP then made non-zero."""
    plain = to_swiftkv(tiny_base(family), 3 if g == 1 else 2, g)
    path = tmp_path / "plain"
    save_pretrained_swiftkv(plain, path, force=True)
    model = AutoModelForCausalLM.from_pretrained(path, swiftkv_kv_mlp=width).eval()
    return plain, path, model


@pytest.mark.parametrize("family,g", [("llama", 1), ("qwen3", 2)])
def test_off_keeps_the_format_and_on_starts_exactly_at_the_plain_model(tmp_path, family, g):
    plain, path, model = with_mlp(tmp_path, family, g)
    assert "swiftkv_kv_mlp" not in json.loads((path / "config.json").read_text())
    assert not any("kv_up" in n or "kv_down" in n for n in tensor_names(path))
    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=0, rtol=0)
    names = {n for n in model.swiftkv_parameter_names() if "kv_up" in n or "kv_down" in n}
    leaders = range(model.config.num_key_value_layers, model.config.num_hidden_layers, g)
    assert names == {"model.kv_up_proj_swiftkv.weight"} | {
        f"model.layers.{j}.self_attn.kv_down_proj_swiftkv.weight" for j in leaders
    }


@pytest.mark.parametrize("family,g", [("llama", 1), ("qwen3", 2)])
def test_trained_mlp_changes_the_student_only_and_every_path_agrees(tmp_path, family, g):
    base = tiny_base(family)
    plain, _, model = with_mlp(tmp_path, family, g)
    torch.manual_seed(1)
    with torch.no_grad():
        for name in model.swiftkv_parameter_names():
            if "kv_down" in name:
                model.get_parameter(name).normal_(0, 0.05)
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        assert not torch.allclose(full, plain(ids).logits, atol=1e-3)
        model.set_mode("teacher")
        torch.testing.assert_close(model(ids).logits, base(ids).logits, atol=ATOL, rtol=0)
        model.set_mode("student")
        out = model(ids, use_cache=True, logits_to_keep=1)  # skip-ahead prefill, fused K/V
        torch.testing.assert_close(out.logits[:, -1], full[:, -1], atol=ATOL, rtol=0)
        cache = model(ids[:, :7], use_cache=True, logits_to_keep=1).cache
        for t in range(7, 11):  # decode steps against the cache
            step = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits
            torch.testing.assert_close(step[:, -1], full[:, t], atol=ATOL, rtol=0)
        teacher, student, _, _ = model.model.teacher_student_hidden(ids)  # the training path
        torch.testing.assert_close(model.lm_head(student), full, atol=ATOL, rtol=0)

    saved = tmp_path / "mlp"
    save_pretrained_swiftkv(model, saved, force=True)
    assert json.loads((saved / "config.json").read_text())["swiftkv_kv_mlp"] == 16
    reloaded = AutoModelForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, full, atol=0, rtol=0)


def test_flops_count_the_mlp():
    config = dict(
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        num_key_value_layers=15,
    )
    plain, mlp = Shape.from_config(config), Shape.from_config({**config, "swiftkv_kv_mlp": 256})
    n = 2048
    # up: 576 -> 256; down: 256 -> K and V (3 heads x 64) of each of the 15 groups; 2 FLOPs per multiply-add
    assert prefill_flops_swiftkv(mlp, n) - prefill_flops_swiftkv(plain, n) == n * 2 * (
        576 * 256 + 256 * 2 * 192 * 15
    )


def test_negative_width_is_refused():
    from huggingface_hub.errors import StrictDataclassClassValidationError

    from swiftkv import LlamaSwiftKVConfig

    with pytest.raises(StrictDataclassClassValidationError, match=r"swiftkv_kv_mlp=-1 must be >= 0"):
        LlamaSwiftKVConfig(num_hidden_layers=4, num_key_value_layers=2, swiftkv_kv_mlp=-1)


@pytest.mark.smollm2
def test_distillation_trains_the_mlp_and_exports_it(tiny_chat_model, chat_data, tmp_path):
    out = tmp_path / "out"
    recipe = {
        "output_dir": str(out),
        "model": {"source": str(tiny_chat_model), "swiftkv": {"num_key_value_layers": 3, "kv_mlp": 8}},
        "data": {"sources": [{"path": str(chat_data)}], "seq_len": 64, "holdout": 0.1},
        "loss": {"chunk_tokens": 32},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0},
        "train": {"micro_batch_size": 2, "max_steps": 4},
        "log": {"every_steps": 1, "eval_batches": 100},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "distill", str(path)],
        cwd=ROOT,
        env={**__import__("os").environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    exported = out / "model"
    assert json.loads((exported / "config.json").read_text())["swiftkv_kv_mlp"] == 8
    assert "swiftkv_kv_mlp" not in json.loads((out / "converted" / "config.json").read_text())
    with safe_open(exported / "model.safetensors", framework="pt") as f:
        downs = [f.get_tensor(k) for k in f.keys() if "kv_down_proj_swiftkv" in k]  # noqa: SIM118
    assert len(downs) == 3 and all(d.abs().sum() > 0 for d in downs)  # trained away from the zero start
    final = json.loads((out / "final_metrics.json").read_text())
    start = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert final["eval_kl"] < start["eval_kl"]
