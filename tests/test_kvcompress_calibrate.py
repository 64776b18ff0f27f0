"""kvcompress calibrate: CLI round trip into load_compressed, complete-or-absent output, resume after a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import kvcompress.calibrate as calibrate_mod
from kvcompress import load_compressed
from kvcompress.cli import main
from kvcompress.factors import load_factors

WORDS = "the cache keeps recent tokens exact and compresses older ones into low rank codes by significance".split()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a word-level tokenizer and chat template, plus a small conversation file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny")
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    with open(path / "chats.jsonl", "w") as f:
        for i in range(8):
            words = [WORDS[j] for j in torch.randint(0, len(WORDS), (40,), generator=gen)]
            turns = [
                {"from": "human", "value": " ".join(words[:20])},
                {"from": "gpt", "value": " ".join(words[20:])},
            ]
            f.write(json.dumps({"id": str(i), "conversations": turns}) + "\n")
    return path


def test_cli_calibrate_then_load_compressed_generates(tiny_dir, tmp_path):
    out = tmp_path / "kv"
    argv = [
        "calibrate",
        str(tiny_dir),
        "--out",
        str(out),
        "--data",
        str(tiny_dir / "chats.jsonl"),
        "--limit",
        "4",
    ]
    assert main([*argv, "--rank-budget", "0.5", "--bits", "8,4", "--window", "4", "--block", "8"]) == 0
    assert main([*argv]) == 2  # refuses to overwrite without --force
    assert main([*argv, "--rank-budget", "2"]) == 2 and (out / "factors.json").is_file()

    model, cache = load_compressed(tiny_dir, out, dtype=torch.float32)
    assert [t.bits for t in cache.policy.tiers] == [8, 4]
    ids = torch.randint(1, len(WORDS), (1, 30))
    generated = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, cache=cache)
    assert generated.shape == (1, 40) and cache.layers[0].n_compressed > 0


def test_calibrate_resumes_after_a_crash(tiny_dir, tmp_path, monkeypatch):
    data, ref_dir, out = str(tiny_dir / "chats.jsonl"), tmp_path / "ref", tmp_path / "kv"
    opts = dict(data=data, samples=6, checkpoint_every=2, progress=False)
    calibrate_mod.calibrate(tiny_dir, ref_dir, **opts)

    real, calls, crash_at = calibrate_mod.accumulate, [], [4]

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == crash_at[0]:
            raise RuntimeError("injected crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_mod, "accumulate", crashing)
    with pytest.raises(RuntimeError, match="injected crash"):
        calibrate_mod.calibrate(tiny_dir, out, **opts)
    assert not out.exists()  # complete or absent

    calls.clear()
    crash_at[0] = 0
    calibrate_mod.calibrate(tiny_dir, out, **opts)
    assert len(calls) == 4  # resumed from the checkpoint after 2 samples
    assert not list(tmp_path.glob(".*partial*"))
    got, ref = load_factors(out), load_factors(ref_dir)
    assert got.meta["tokens"] == ref.meta["tokens"]
    for idx, layer in ref.layers.items():
        torch.testing.assert_close(got.layers[idx].value_scale, layer.value_scale)
        torch.testing.assert_close(got.layers[idx].key_basis.abs(), layer.key_basis.abs(), atol=1e-4, rtol=0)
