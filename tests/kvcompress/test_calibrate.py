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
    options = [
        "--rank-budget",
        "0.5",
        "--bits",
        "8,4",
        "--value-bits",
        "4,8",
        "--window",
        "4",
        "--block",
        "8",
    ]
    assert main([*argv, *options]) == 0
    assert main([*argv]) == 2  # refuses to overwrite without --force
    assert main([*argv, "--rank-budget", "2"]) == 2 and (out / "factors.json").is_file()
    assert main([*argv, "--force", "--bits", "8,4", "--value-bits", "4"]) == 2  # one value width per tier

    model, cache = load_compressed(tiny_dir, out, dtype=torch.float32)
    assert [(t.bits, t.v_bits) for t in cache.policy.tiers] == [(8, 4), (4, 8)]
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


def test_query_moments_are_the_post_rope_queries_of_each_kv_group(tiny_dir):
    """``accumulate`` adds ``Σ q qᵀ`` of every query attention reads, per KV head (its group's query heads
    summed), under the layer that owns the keys: the same as queries rebuilt from the layers' inputs with
    transformers' own RoPE; and the model's attention is restored afterwards."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = LlamaForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    seqs = [
        torch.randint(1, len(WORDS), (1, n), generator=torch.Generator().manual_seed(n)) for n in (24, 30)
    ]
    moments = calibrate_mod.accumulate(model, seqs, skip=4)
    assert model.config._attn_implementation == "eager"
    cfg = model.config
    group, d = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    for idx, layer in enumerate(model.model.layers):
        want = 0
        for ids in seqs:
            with torch.no_grad():
                hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[idx]
                x = layer.input_layernorm(hidden)
                q = layer.self_attn.q_proj(x).view(1, ids.shape[1], -1, d).transpose(1, 2)
                cos, sin = model.model.rotary_emb(x, torch.arange(ids.shape[1])[None])
                q = apply_rotary_pos_emb(q, q, cos, sin)[0].double()
            q = q.reshape(1, cfg.num_key_value_heads, group, ids.shape[1], d)
            want = want + torch.einsum("bhgnd,bhgne->hde", q, q)
        got, count = moments.queries[idx]
        assert count == group * (24 + 30)  # every query row, sinks included: they read compressed keys too
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_scored_bases_are_exact_at_full_rank_and_beat_pca_on_the_scores():
    """The scored key basis and its query map give ``q·k`` exactly at full rank, equal the PCA basis for
    isotropic queries, and at lower rank lose less of the scores than PCA when the queries favour directions the
    keys hold little energy in."""
    from kvcompress.factors import bases_from_moments, scored_bases

    gen = torch.Generator().manual_seed(0)
    d, n = 16, 4000
    keys = torch.randn(n, d, generator=gen, dtype=torch.float64) * torch.linspace(
        3, 0.3, d, dtype=torch.float64
    )
    queries = torch.randn(n, d, generator=gen, dtype=torch.float64) * torch.linspace(
        0.2, 4, d, dtype=torch.float64
    )
    km, qm = (keys.T @ keys / n)[None], (queries.T @ queries / n)[None]
    enc, dec = (b[0].double() for b in scored_bases(km, qm))
    scores = queries @ keys.T
    torch.testing.assert_close((queries @ dec) @ (keys @ enc).T, scores, rtol=1e-4, atol=1e-4)
    pca = bases_from_moments(km)[0][0].double()
    iso_enc, iso_dec = (b[0].double() for b in scored_bases(km, torch.eye(d, dtype=torch.float64)[None]))
    torch.testing.assert_close(iso_enc.abs(), pca.abs(), rtol=0, atol=1e-4)
    torch.testing.assert_close(iso_dec.abs(), pca.abs(), rtol=0, atol=1e-4)

    def score_error(e: torch.Tensor, q: torch.Tensor, r: int) -> float:
        approx = (queries @ q[:, :r]) @ (keys @ e[:, :r]).T
        return float((approx - scores).square().sum() / scores.square().sum())

    for r in (4, 8):
        assert score_error(enc, dec, r) < 0.7 * score_error(pca, pca, r), r


def test_the_cache_keeps_pca_keys_where_keys_are_quantized_per_token():
    """Per-channel key scales (and unquantized keys) use the scored basis; a tier with per-token integer key
    scales, or ``scored_keys=False``, makes the cache use the orthonormal PCA basis for keys."""
    from helpers.tale import HEAD_DIM, tiny_model_and_factors

    from kvcompress import Policy, TaleCache, Tier

    model, factors = tiny_model_and_factors()
    layer0 = factors.layers[0]
    assert layer0.scored_key_basis is not None
    ids = torch.randint(0, 96, (1, 30))
    cases = [("channel", 4, True, True), ("token", None, True, True), ("token", 4, True, False)]
    for k_scales, bits, asked, scored in [*cases, ("channel", 4, False, False)]:
        tier = Tier(k_rank=HEAD_DIM, v_rank=HEAD_DIM, bits=bits, fraction=1.0, k_scales=k_scales)
        policy = Policy(sinks=2, window=4, block=4, scored_keys=asked, tiers=[tier])
        cache = TaleCache(factors, policy, model.config, model=model)
        with torch.no_grad():
            model(ids, cache=cache)
        want = (layer0.scored_key_basis, layer0.scored_query_basis) if scored else (layer0.key_basis,) * 2
        assert torch.equal(cache.layers[0].key_map, want[0]) and torch.equal(
            cache.layers[0].key_query_map, want[1]
        )
    from kvcompress.evaluate import make_method

    for spec, scored in (("tale:0.5:4-2-2:cc", True), ("tale:0.5:4-2-2:cc:pca", False)):
        assert make_method(spec, model, factors)().policy.uses_scored_keys is scored


def test_factors_round_trip_with_and_without_the_scored_basis(tmp_path):
    """Saved factors load back tensor for tensor (the scored bases included); a format-1 file (no scored bases)
    still loads, without them; an unknown format version is refused in one line."""
    from helpers.tale import tiny_model_and_factors

    from kvcompress.factors import META_FILE, TENSORS, LayerFactors, load_factors, save_factors

    _, factors = tiny_model_and_factors()
    save_factors(factors, tmp_path)
    loaded = load_factors(tmp_path)
    for idx, layer in factors.layers.items():
        for name in TENSORS:
            assert torch.equal(getattr(loaded.layers[idx], name), getattr(layer, name)), name
    plain = {
        i: LayerFactors(lf.key_basis, lf.key_scale, lf.value_basis, lf.value_scale)
        for i, lf in factors.layers.items()
    }
    (tmp_path / "v1").mkdir()
    save_factors(type(factors)(plain, factors.meta), tmp_path / "v1")
    meta_path = tmp_path / "v1" / META_FILE
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "format_version": 1}))
    assert load_factors(tmp_path / "v1").layers[0].scored_key_basis is None
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "format_version": 99}))
    with pytest.raises(ValueError, match="format_version 99, this kvcompress reads 1 to 2; to resolve"):
        load_factors(tmp_path / "v1")


def test_calibrate_measures_key_sensitivity_and_resumes_it(tiny_dir, tmp_path, monkeypatch):
    """The measurement lands in the factors' metadata and the policy is allocated from it; a crash after the
    first sensitivity sequence resumes with the second, to the same numbers; a saved measurement of another
    policy (here other bit widths) is not resumed but measured again."""
    import kvcompress.allocate as allocate_mod
    from kvcompress import defaults as D
    from kvcompress.allocate import SENSITIVITY_KEY, allocate_key_ranks
    from kvcompress.api import read_policy
    from kvcompress.policy import Policy, scales_pair

    opts = dict(
        data=str(tiny_dir / "chats.jsonl"), samples=3, max_length=40, window=4, block=4, progress=False
    )
    calibrate_mod.calibrate(tiny_dir, tmp_path / "ref", **opts)
    ref = load_factors(tmp_path / "ref")
    measured = ref.meta[SENSITIVITY_KEY]
    assert set(measured["kl"]) == {"0", "1"} and all(kl >= 0 for kl in measured["kl"].values())
    default = Policy.from_budget(
        D.RANK_BUDGET,
        list(D.BITS),
        16,
        value_bits=list(D.VALUE_BITS),
        scales=scales_pair(D.SCALES),
        window=4,
        block=4,
    )
    assert read_policy(tmp_path / "ref") == allocate_key_ranks(default, ref, measured)

    real, seen = allocate_mod.key_sensitivity, []

    def crash_after_one(*args, done, **kwargs):
        seen.append(len(args[3]))

        def first_then_crash(summed, tokens):
            done(summed, tokens)
            raise RuntimeError("injected crash")

        return real(*args, done=first_then_crash if len(seen) <= 2 else done, **kwargs)

    monkeypatch.setattr(allocate_mod, "key_sensitivity", crash_after_one)
    for bits in ([8, 8, 8], list(D.BITS)):
        with pytest.raises(RuntimeError, match="injected crash"):
            calibrate_mod.calibrate(tiny_dir, tmp_path / "kv", bits=bits, **opts)
    assert not (tmp_path / "kv").exists()
    calibrate_mod.calibrate(tiny_dir, tmp_path / "kv", **opts)
    assert seen == [3, 3, 2] and not list(tmp_path.glob(".*partial*"))
    got = load_factors(tmp_path / "kv").meta[SENSITIVITY_KEY]
    assert got["kl"] == pytest.approx(measured["kl"], rel=1e-4, abs=1e-9)
