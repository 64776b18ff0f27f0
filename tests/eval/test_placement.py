"""Evaluation off the default CPU fp32: bf16 against fp32, ``device_map="auto"``, accelerate's disk offload,
lm-eval in bf16, and the refusals; on a tiny SwiftKV model and conversations of the test's own (no asset)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.chat import CONVERSATIONS, byte_tokenizer, save_chat_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.cli import main as eval_main
from eval.harness import run_harness
from eval.quality import evaluate_quality, held_out_rows, quality_of
from eval.tasks import write_tasks
from swiftkv.convert import convert
from toolkit.cliargs import UsageError

SETTINGS = dict(n_conversations=8, seq_len=128, n_prompts=3, max_new_tokens=6)


@pytest.fixture(scope="module")
def swift(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    model = convert(save_chat_model(root / "base"), root / "swift", swiftkv_fraction=0.5)
    return model, data


@pytest.fixture(scope="module")
def fp32(swift):
    model, data = swift
    return evaluate_quality(model, **SETTINGS, data=data)


def test_bf16_agrees_with_fp32_and_records_both(swift, fp32):
    """Teacher and student run in the same dtype; bf16 stays within the tolerance docs/eval.md states."""
    model, data = swift
    bf16 = evaluate_quality(model, **SETTINGS, data=data, dtype="bfloat16")
    assert (fp32["dtype"], bf16["dtype"], bf16["device"]) == ("float32", "bfloat16", "cpu")
    assert fp32["tokens"] == bf16["tokens"] > 100
    assert (
        fp32["kl"] > 0.01
    )  # a SwiftKV student that differs from its teacher: the comparison means something
    assert abs(bf16["kl"] - fp32["kl"]) <= 0.01
    assert abs(bf16["top1_agreement"] - fp32["top1_agreement"]) <= 0.05
    for ppl in ("ppl_teacher", "ppl_student"):
        assert bf16[ppl] == pytest.approx(fp32[ppl], rel=0.03)
    assert abs(bf16["served"]["reply"]["kl"] - fp32["served"]["reply"]["kl"]) <= 0.01


def test_device_map_auto_and_disk_offload_give_the_fp32_numbers(swift, fp32, tmp_path):
    """``--device auto`` without a GPU keeps every layer on the CPU; with a memory cap accelerate offloads
    layers to disk behind its hooks, and the numbers stay those of the plain model."""
    model, data = swift
    auto = evaluate_quality(model, **SETTINGS, data=data, device="auto")
    assert {k: v for k, v in auto.items() if k != "device"} == {
        k: v for k, v in fp32.items() if k != "device"
    }
    weights = (model / "model.safetensors").stat().st_size
    offloaded = AutoModelForCausalLM.from_pretrained(
        model, device_map="auto", max_memory={"cpu": weights // 2}, offload_folder=str(tmp_path)
    ).eval()
    assert "disk" in offloaded.hf_device_map.values()
    assert any(p.device.type == "meta" for p in offloaded.parameters())  # materialized only by the hooks
    metrics = quality_of(offloaded, AutoTokenizer.from_pretrained(model), **SETTINGS, data=data)
    assert leaves(metrics) == pytest.approx(leaves(fp32), rel=1e-5, abs=1e-6)


def leaves(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The numeric values of nested metrics by path (device and dtype left out)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        elif isinstance(value, int | float):
            out[prefix + key] = value
    return out


def test_harness_runs_in_bf16(swift, tmp_path):
    model, data = swift
    tasks = write_tasks(tmp_path / "tasks", n_docs=4, data=data)
    results = run_harness(
        model, ["sharegpt_mc", "sharegpt_ppl"], tasks, limit=3, max_length=128, dtype="bfloat16"
    )
    assert 0.0 <= results["sharegpt_mc"]["acc"] <= 1.0
    assert results["sharegpt_ppl"]["word_perplexity"] > 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("command", ["quality", "harness"])
def test_cuda_without_a_gpu_is_refused_in_one_line(swift, command, tmp_path, capsys):
    model, _ = swift
    extra = (
        ["--tasks", "sharegpt_ppl", "--tasks-dir", str(tmp_path / "tasks")] if command == "harness" else []
    )
    assert eval_main([command, str(model), "--device", "cuda", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        "error: --device cuda, but no CUDA device is visible (to resolve, pass --device cpu)"
    )
    assert not (tmp_path / "tasks").exists()


def test_conversations_cut_before_their_reply_are_skipped_or_refused(swift):
    """Only conversations with an assistant token within ``seq_len`` are taken (each prompt here is ~50 bytes
    of ChatML: byte-level tokens); when none has one, the evaluation is refused instead of reporting KL 0."""
    _, data = swift
    tokenizer = byte_tokenizer()
    rows = held_out_rows(tokenizer, n_conversations=3, seq_len=64, data=data)
    assert rows["loss_mask"].sum(1).min() > 0  # every packed row counts tokens
    with pytest.raises(
        UsageError, match="no held-out conversation of .* has an assistant token within its first 16"
    ):
        held_out_rows(tokenizer, n_conversations=3, seq_len=16, data=data)
