"""Suffix cache artifacts: exact save/load round trip, tokenizer and corruption checks, the CLI stages (on a
folder or a Hub id)."""

from __future__ import annotations

import json
import random

import pytest
from helpers.chat import byte_tokenizer, word_tokenizer
from helpers.hub import HUB_REPO
from helpers.suffix import expand, filled_cache, structure

from eval.serving.suffix.artifact import META_FILE, TREE_FILE, load_cache, save_cache
from eval.serving.suffix.cache import SpecConfig, SuffixCache
from eval.serving.suffix.cli import main
from toolkit.artifacts import read_provenance


def test_round_trip_is_exact_and_keeps_fifo(tmp_path):
    tok = word_tokenizer()
    cache = filled_cache()
    save_cache(cache, tmp_path / "c", tok)
    loaded = load_cache(tmp_path / "c", tok)
    assert expand(loaded.global_tree) == expand(cache.global_tree)
    assert structure(loaded.global_tree) == structure(cache.global_tree)
    assert loaded.config == cache.config and loaded.num_responses == cache.num_responses
    rng = random.Random(1)
    for _ in range(30):
        ctx = [rng.randrange(3, 9) for _ in range(rng.randint(1, 5))]
        a, b = cache.global_tree.speculate(ctx, 8), loaded.global_tree.speculate(ctx, 8)
        assert (a.tokens, a.probs, a.match_len) == (b.tokens, b.probs, b.match_len)
    for k in range(8):  # the next insertions evict the same (oldest) responses in both
        for c in (cache, loaded):
            c.add_response([3, 4, 5, k % 3 + 3])
        assert expand(loaded.global_tree) == expand(cache.global_tree)
        for _ in range(5):
            ctx = [rng.randrange(3, 9) for _ in range(rng.randint(2, 5))]
            a, b = cache.global_tree.speculate(ctx, 8), loaded.global_tree.speculate(ctx, 8)
            assert (a.tokens, a.probs) == (b.tokens, b.probs)  # sibling order survived the round trip


def test_evicted_responses_are_not_saved(tmp_path):
    import numpy as np

    cache = filled_cache(limit=3)
    for _ in range(3):
        cache.add_response([3, 4, 5])
    save_cache(cache, tmp_path / "c", word_tokenizer())
    with np.load(tmp_path / "c" / "tree.npz") as data:
        assert len(data["tokens"]) == sum(map(len, cache.global_tree.seqs.values())) == 9
        assert (data["ref"][1:] >= 0).all()  # every node points into a cached response


def drive(cache: SuffixCache, seed: int):
    """Requests with copy-heavy prompts and outputs through one cache; yields its draft at every step."""
    rng = random.Random(seed)
    vocab = rng.randint(2, 12)
    motif = [rng.randrange(vocab) for _ in range(6)]

    def tokens(n: int, start: int) -> list[int]:
        return [rng.randrange(vocab) if rng.random() < 0.3 else motif[(start + i) % 6] for i in range(n)]

    for r in range(14):
        ctx = tokens(rng.randint(1, 30), 0)
        cache.start_request(r, ctx)
        for _ in range(rng.randint(1, 40)):
            yield cache.speculate(r, ctx)
            new = tokens(rng.randint(1, 4), len(ctx))
            cache.append(r, new)
            ctx = ctx + new
        cache.finish_request(r)
        if rng.random() < 0.3:
            cache.add_response(tokens(rng.randint(1, 50), 0))


@pytest.mark.parametrize("mode", ["path", "tree"])
def test_loaded_cache_serves_requests_as_the_saved_one(tmp_path, mode):
    """Same trie and sibling order after loading, then the same drafts, growth and evictions under requests."""
    cfg = SpecConfig(max_depth=8, max_cached_requests=5, min_token_prob=0.0, mode=mode)
    rng = random.Random(3)
    source = SuffixCache(cfg)
    for _ in range(9):  # past the limit: evicted responses are re-pointed away from and not saved
        source.add_response([rng.randrange(3, 9) for _ in range(rng.randint(1, 40))])
    tok = word_tokenizer()
    save_cache(source, tmp_path / "c", tok)
    loaded = load_cache(tmp_path / "c", tok)
    assert structure(loaded.global_tree) == structure(source.global_tree)
    for a, b in zip(drive(source, 5), drive(loaded, 5), strict=True):
        assert (a.tokens, a.parents, a.probs, a.score, a.match_len) == (
            b.tokens, b.parents, b.probs, b.score, b.match_len
        )  # fmt: skip
    assert structure(loaded.global_tree) == structure(source.global_tree)


def test_other_tokenizer_is_refused(tmp_path):
    save_cache(filled_cache(), tmp_path / "c", word_tokenizer())
    with pytest.raises(ValueError, match="built with tokenizer .* rebuild the cache for this model"):
        load_cache(tmp_path / "c", word_tokenizer(offset=1))


def test_corrupt_files_are_refused(tmp_path):
    tok = word_tokenizer()
    save_cache(filled_cache(), tmp_path / "c", tok)
    tree = tmp_path / "c" / TREE_FILE
    data = bytearray(tree.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tree.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt"):
        load_cache(tmp_path / "c", tok)
    (tmp_path / "c" / META_FILE).write_text('{"format": "swiftkv-suffix-cache", "vers')
    with pytest.raises(ValueError, match="corrupt"):
        load_cache(tmp_path / "c", tok)
    (tmp_path / "c" / META_FILE).write_text(json.dumps({"format": "swiftkv-suffix-cache", "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        load_cache(tmp_path / "c", tok)


def test_cli_build_generate_export(tmp_path, tiny_llama_dir, capsys):
    tok = word_tokenizer()
    tok.save_pretrained(tiny_llama_dir)
    gens = tmp_path / "gens.jsonl"
    lines = [
        {"response": "w5 w6 w7 w8 w9"},
        {"messages": [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w5 w6 w7"}]},
    ]
    gens.write_text("\n".join(map(json.dumps, lines)) + "\n")
    out = tmp_path / "cache"
    assert (
        main(
            [
                "build",
                str(tiny_llama_dir),
                "--out",
                str(out),
                "--responses-from",
                str(gens),
                "--max-spec",
                "4",
            ]
        )
        == 0
    )
    cache = load_cache(out, tok)
    assert cache.num_responses == 2 and cache.config.max_spec == 4
    # after "w5 w6 w7" both responses split (w8 / <eos>, p = 1/2 each): the tie goes to the one seen first
    draft = cache.global_tree.speculate([4, 5, 6], 4)  # match lengths < len(context), as the reference
    assert draft.tokens[0] == 7 and draft.probs[1] == 0.5 and draft.match_len == 2
    assert main(["build", str(tiny_llama_dir), "--out", str(out), "--responses-from", str(gens)]) == 2
    assert "not empty" in capsys.readouterr().err

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w6 w7 w5 w6"}) + "\n")
    assert (
        main(
            [
                "generate",
                str(tiny_llama_dir),
                "--cache",
                str(out),
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "5",
                "--mode",
                "tree",
            ]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["new_tokens"] <= 5 and record["tokens_per_step"] >= 1.0

    assert main(["export-vllm", str(out)]) == 0
    captured = capsys.readouterr()
    spec = json.loads(captured.out)
    # one warning line naming what vLLM drops: the pre-built tree (offset and mode are the defaults here)
    assert captured.err.strip().splitlines() == [
        "warning: vLLM ignores the 2 pre-built responses (vLLM starts with an empty global tree)"
    ]
    # only what vLLM reads and where it differs from vLLM's defaults (depth 24; draft cap = depth)
    assert spec == {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 64}


def test_vllm_export_writes_only_what_differs_from_vllm():
    from eval.serving.suffix.artifact import VLLM_KEYS, vllm_speculative_config

    vllm_defaults = SpecConfig(
        max_depth=24, max_spec=24, factor=1.0, min_token_prob=0.1, max_cached_requests=10_000
    )
    assert vllm_speculative_config(vllm_defaults) == {"method": "suffix"}
    changed = vllm_defaults.model_copy(
        update=dict(max_depth=32, factor=0.5, min_token_prob=0.2, max_cached_requests=7)
    )
    assert vllm_speculative_config(changed) == {
        "method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 32,
        "suffix_decoding_max_spec_factor": 0.5, "suffix_decoding_min_token_prob": 0.2,
        "suffix_decoding_max_cached_requests": 7,
    }  # fmt: skip
    assert set(VLLM_KEYS) < set(vllm_speculative_config(changed))
    # settings vLLM has no key for never reach it
    assert vllm_speculative_config(vllm_defaults.model_copy(update=dict(offset=2.0, mode="tree"))) == {
        "method": "suffix"
    }


@pytest.mark.vllm
@pytest.mark.slow  # imports vLLM in its venv
def test_vllm_reads_these_keys_with_these_defaults(vllm_python):
    """The installed vLLM's own config fields and proposer: the keys it reads and their defaults are ours."""
    import subprocess

    from eval.serving.suffix.artifact import VLLM_KEYS

    script = """
import dataclasses, inspect, json, re
from vllm.config.speculative import SpeculativeConfig
from vllm.v1.spec_decode import suffix_decoding
fields = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig) if f.name.startswith("suffix_decoding_")}
read = sorted(set(re.findall(r"config\\.(suffix_decoding_\\w+)", inspect.getsource(suffix_decoding))))
print(json.dumps([fields, read, inspect.getsource(SpeculativeConfig._validate_suffix_decoding)]))
"""
    run = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    fields, read, validate = json.loads(run.stdout.strip().splitlines()[-1])
    assert fields == {key: default for key, (_, default) in VLLM_KEYS.items()}
    assert read == sorted(VLLM_KEYS)
    # an unset draft cap becomes the tree depth; the method still needs arctic-inference
    assert "self.num_speculative_tokens = self.suffix_decoding_max_tree_depth" in validate
    assert "has_arctic_inference()" in validate


def test_cli_takes_a_hub_id_and_refuses_an_unknown_one_in_one_line(hub, tmp_path, capsys):
    home, commit = hub  # HUB_REPO in an offline cache
    gens = tmp_path / "gens.jsonl"
    gens.write_text(json.dumps({"response": "hello there"}) + "\n")
    out = tmp_path / "cache"
    assert main(["build", HUB_REPO, "--out", str(out), "--responses-from", str(gens)]) == 0
    snapshot = home / "hub" / "models--acme--tiny-chat" / "snapshots" / commit
    assert read_provenance(out)["model"] == str(snapshot)
    assert load_cache(out, byte_tokenizer()).num_responses == 1  # tokenized by that model's tokenizer
    capsys.readouterr()
    assert main(["generate", "acme/missing", "--prompts", str(gens)]) == 2
    stdout, err = capsys.readouterr()
    assert stdout == "" and err.count("\n") == 1
    assert (
        err.startswith("error: model acme/missing is not in the Hugging Face cache") and "to resolve" in err
    )
