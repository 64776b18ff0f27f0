"""swiftkv kvcompress calibrate: CLI round trip into load_compressed, complete-or-absent output, resume after a crash."""

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
    opts = dict(data=data, samples=6, max_length=40, checkpoint_every=2, progress=False)
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


def test_resume_file_is_never_unpickled(tiny_dir, tmp_path):
    """A planted pickle where the partial state lives is ignored (calibration restarts), never executed."""
    import pickle

    marker = tmp_path / "pwned"

    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    for suffix in ("pt", "safetensors"):
        (tmp_path / f".kv.calibrate-partial.{suffix}").write_bytes(pickle.dumps(Bomb()))
    calibrate_mod.calibrate(
        tiny_dir,
        tmp_path / "kv",
        data=str(tiny_dir / "chats.jsonl"),
        samples=2,
        max_length=40,
        progress=False,
    )
    assert not marker.exists() and (tmp_path / "kv" / "factors.json").is_file()


def _record_keys(model, ids) -> dict[int, torch.Tensor]:
    """Post-RoPE keys as the model hands them to the cache, per layer (the reference for the moments)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return {i: layer.keys.double() for i, layer in enumerate(cache.layers)}


def test_sinks_are_left_out_of_the_moments(tiny_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    ids = torch.randint(1, len(WORDS), (1, 24), generator=torch.Generator().manual_seed(0))
    moments = calibrate_mod.accumulate(model, [ids], skip=4)
    for idx, keys in _record_keys(model, ids).items():
        km, _, n = moments.layers[idx]
        k = keys[0, :, 4:]  # heads x positions >= 4 x d
        assert n == 20
        torch.testing.assert_close(km, torch.einsum("hnd,hne->hde", k, k))


def test_calibrating_at_the_served_length_keeps_late_positions():
    """Keys rotate with position (RoPE): a basis fitted on short sequences loses more energy at positions it
    never saw than one fitted on sequences as long as the ones served.  Pre-RoPE keys of rank 2 (as trained
    models' are close to low rank) make the rotation the only thing that spreads them."""
    from kvcompress.evaluate import energy_error

    config = LlamaConfig(
        vocab_size=30, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        u, s, vh = torch.linalg.svd(model.model.layers[0].self_attn.k_proj.weight)
        model.model.layers[0].self_attn.k_proj.weight.copy_(u[:, :2] @ torch.diag(s[:2]) @ vh[:2])
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 30, (1, 512), generator=gen) for _ in range(2)]
    short = calibrate_mod.accumulate(model, [s[:, :64] for s in seqs])
    served = calibrate_mod.accumulate(model, seqs)
    late = _record_keys(model, torch.randint(1, 30, (1, 512), generator=gen))[0][0, :, 256:]
    held_out = torch.einsum("hnd,hne->hde", late, late) / late.shape[1]
    errors = {
        name: energy_error(held_out, moments.factors({}).layers[0].key_basis, rank=8)
        for name, moments in (("short", short), ("served", served))
    }
    assert errors["served"] < 0.7 * errors["short"], errors
