"""The SwiftKV models against the independent reference (helpers/reference.py): every attention backend's
mask format, dynamic and static caches, left padding, multi-turn continuation, greedy and beam generation."""

from __future__ import annotations

import pytest
import torch
from helpers.models import left_padded_batch
from helpers.reference import greedy, sequence_logprob, student_logits
from helpers.students import ATOL, FAMILIES, FLASH_2D, make_cache, reference_batches, student


def assert_last_rows_match(model, ids, mask, logits):
    ref = student_logits(model, ids, mask)[:, -1]
    torch.testing.assert_close(logits[:, -1], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_full_forward_matches_reference(family, g, impl):
    model = student(family, g, impl)
    _, ids, mask = left_padded_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    ref = student_logits(model, ids, mask)
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)


def run_conversation(model, cache, ids, mask, steps: int = 2):
    """Prefill (logits_to_keep=1), decode steps, a second multi-token prompt onto the cache, decode again;
    every step checked against the reference on the whole sequence so far."""
    torch.manual_seed(11)
    turn2 = torch.randint(3, 128, (ids.shape[0], 3))
    plan = [ids] + [None] * steps + [turn2] + [None] * min(steps, 1)
    seq, seq_mask, logits = ids[:, :0], mask[:, :0], None
    with torch.no_grad():
        for chunk in plan:
            if chunk is None:  # decode: the argmax of the last step
                chunk = logits[:, -1].argmax(-1, keepdim=True)
            seq_mask = torch.cat([seq_mask, mask if seq.shape[1] == 0 else torch.ones_like(chunk)], 1)
            seq = torch.cat([seq, chunk], 1)
            positions = (seq_mask.cumsum(-1) - 1).clamp(min=0)[:, -chunk.shape[1] :]
            logits = model(
                chunk,
                attention_mask=seq_mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            assert logits.shape[1] == 1
            assert_last_rows_match(model, seq, seq_mask, logits)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("impl", ["eager", "sdpa", FLASH_2D])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_conversation_matches_reference(family, g, impl, cache):
    model = student(family, g, impl)
    for ids, mask in reference_batches():
        run_conversation(model, make_cache(cache, model), ids, mask)


@pytest.mark.slow
@pytest.mark.parametrize(("cache", "g"), [("dynamic", 1), ("static", 2)])
def test_flex_attention_kept_rows_match_reference(g, cache):
    """The BlockMask cut to the kept rows (prefill with 1 and 3 kept rows), with as many keys as queries (a
    dynamic cache's prefill: the same mask as without a cache, plus the cache write) and with a static cache's
    longer key range.  The group size changes no flex code (the other backends' tests run both), so each case
    takes one.  Only the left-padded batch and no cached continuation: on CPU, torch 2.13's compiled
    flex_attention gives NaN or fails to compile for an unpadded prompt and for 1-row queries against a cache,
    even in stock LlamaForCausalLM.  Every case compiles its own kernels (minutes on 2 cores): hence two."""
    model = student("llama", g, "flex_attention")
    _, ids, mask = left_padded_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for keep in (1, 3):
            kv = None if cache == "none" else make_cache(cache, model)
            logits = model(
                ids,
                attention_mask=mask,
                position_ids=positions,
                cache=kv,
                use_cache=kv is not None,
                logits_to_keep=keep,
            ).logits
            torch.testing.assert_close(logits, student_logits(model, ids, mask)[:, -keep:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("impl", ["sdpa", FLASH_2D])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_matches_reference(family, g, impl, cache):
    model = student(family, g, impl)
    for ids, mask in reference_batches():
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=6,
                do_sample=False,
                cache_implementation=cache,
                pad_token_id=0,
                eos_token_id=None,
            )
        assert out[:, ids.shape[1] :].tolist() == greedy(model, ids, mask, 6).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("g", [1, 2])
def test_beam_search_scores_are_reference_logprobs(family, g):
    """Every returned beam's score is the reference log-probability of its tokens (length_penalty 0), so the
    beam reordering of the (AcrossKV) cache is exact; the best beam scores at least the greedy sequence."""
    model = student(family, g, "sdpa")
    _, ids, mask = left_padded_batch()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=5,
            num_beams=3,
            num_return_sequences=3,
            length_penalty=0.0,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        new = torch.ones_like(out.sequences[:, ids.shape[1] :])
        beams_mask = torch.cat([mask.repeat_interleave(3, 0), new], 1)
        ref = sequence_logprob(model, out.sequences, beams_mask, ids.shape[1])
        torch.testing.assert_close(out.sequences_scores, ref, atol=1e-4, rtol=0)
        greedy_ids = torch.cat([ids, greedy(model, ids, mask, 5)], 1)
        greedy_mask = torch.cat([mask, torch.ones(ids.shape[0], 5, dtype=mask.dtype)], 1)
        greedy_score = sequence_logprob(model, greedy_ids, greedy_mask, ids.shape[1])
    assert (out.sequences_scores.view(-1, 3)[:, 0] >= greedy_score - 1e-4).all()


@pytest.mark.slow
def test_compiled_static_cache_generate_matches_reference():
    """generate() compiles the decode step when the cache is static (here forced on CPU).  The left-padded
    batch only: every compile is minutes on 2 cores, and the unpadded prompt takes the same static-cache
    path (test_greedy_generate_matches_reference runs it uncompiled)."""
    from transformers import CompileConfig

    model = student("llama", 2, "sdpa")
    compile_config = CompileConfig(fullgraph=False, dynamic=False)
    compile_config._compile_all_devices = True
    _, ids, mask = left_padded_batch()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            cache_implementation="static",
            compile_config=compile_config,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert out[:, ids.shape[1] :].tolist() == greedy(model, ids, mask, 4).tolist()


def _disk_offload_map(model) -> dict[str, str]:
    """Layers < l and the head on the CPU, norm_swiftkv and the SwiftKV layers offloaded to disk."""
    l = model.config.num_key_value_layers
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    device_map["model.norm_swiftkv"] = "disk"
    for j in range(model.config.num_hidden_layers):
        device_map[f"model.layers.{j}"] = "cpu" if j < l else "disk"
    return device_map


@pytest.mark.parametrize("placement", ["cpu_offload", "disk_offload"])
@pytest.mark.parametrize("family,g", [("llama", 1), ("qwen3", 2)])
def test_offloaded_weights_match_reference(placement, family, g, tmp_path):
    """accelerate's offload hooks materialize a module's weights only inside its forward (as ZeRO-3 does):
    the SwiftKV K/V must come from calling the projection modules, never from reading their weights."""
    from accelerate import cpu_offload, dispatch_model

    model = student(family, g, "sdpa")
    _, ids, mask = left_padded_batch()
    expected_tokens = greedy(model, ids, mask, 4)
    expected_last = student_logits(model, ids, mask)[:, -1]
    if placement == "cpu_offload":
        cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        dispatch_model(model, _disk_offload_map(model), offload_dir=tmp_path)
    assert model.model.layers[2].self_attn.k_proj_swiftkv.weight.device.type == "meta"
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    torch.testing.assert_close(logits[:, -1], expected_last, atol=ATOL, rtol=0)
    assert out[:, ids.shape[1] :].tolist() == expected_tokens.tolist()
