"""The exact K/V option (``exact_kv_window``) against the independent reference with the mask applied by hand:
teacher-forced passes with an explicit mask, cached generation (every cache and backend the SwiftKV path
supports), chunked prefill, speculative verification, and the training path."""

from __future__ import annotations

import pytest
import torch
from helpers.models import left_padded_batch, tiny_base, to_swiftkv
from helpers.reference import greedy, student_logits
from helpers.students import ATOL, FAMILIES, FLASH_2D, make_cache, reference_batches, student

from swiftkv import LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM
from swiftkv.modeling_swiftkv import exact_kv_positions


def windowed(family: str, impl: str, window: int, l: int = 2):
    model = student(family, 1, impl, l=l)
    model.config.exact_kv_window = window
    return model


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


# -- the option in the config ----------------------------------------------------------------------------------
def test_config_default_is_off_and_round_trips(tmp_path):
    model = to_swiftkv(tiny_base("llama"), l=2)
    assert model.config.exact_kv_window == 0
    model.config.exact_kv_window = 5
    model.save_pretrained(tmp_path)
    assert LlamaSwiftKVForCausalLM.from_pretrained(tmp_path).config.exact_kv_window == 5


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"exact_kv_window": -1}, "exact_kv_window=-1 must be an integer >= 0"),
        (
            {"exact_kv_window": 4, "key_value_group_size": 2},
            "exact_kv_window=4 needs key_value_group_size=1, got 2",
        ),
    ],
)
def test_config_refuses_bad_windows(fields, message):
    """transformers' strict config dataclass wraps the ValueError of validate_architecture; the message stays."""
    base = dict(num_hidden_layers=4, num_key_value_layers=2, hidden_size=32, num_attention_heads=4)
    with pytest.raises(Exception, match=message):
        LlamaSwiftKVConfig(**base, **fields)


def test_explicit_mask_with_acrosskv_or_a_cache_is_refused():
    ids = torch.randint(3, 128, (1, 6))
    grouped = to_swiftkv(tiny_base("llama"), l=2, g=2)
    with pytest.raises(ValueError, match="key_value_group_size=1"):
        grouped(ids, use_cache=False, swiftkv_exact_mask=torch.ones_like(ids, dtype=torch.bool))
    model = to_swiftkv(tiny_base("llama"), l=2)
    with pytest.raises(ValueError, match="without a cache"):
        model(ids, use_cache=True, swiftkv_exact_mask=torch.ones_like(ids, dtype=torch.bool))


# -- teacher-forced passes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_teacher_forced_mask_matches_reference(family, impl):
    model = student(family, 1, impl)
    _, ids, mask = left_padded_batch()
    exact = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.5
    with torch.no_grad():
        out = model(
            ids,
            attention_mask=mask,
            position_ids=positions_of(mask),
            use_cache=False,
            swiftkv_exact_mask=exact,
        ).logits
        ref = student_logits(model, ids, mask, exact)
        plain = student_logits(model, ids, mask)
    rows = mask.bool()
    torch.testing.assert_close(out[rows], ref[rows], atol=ATOL, rtol=0)
    assert (plain - ref)[rows].abs().max() > 1e-2  # the mask really changes the student


@pytest.mark.parametrize("family", FAMILIES)
def test_every_position_exact_with_original_queries_is_the_teacher(family):
    """The implementation check of the measurement: exact K/V everywhere plus the original query projection
    (and Qwen3's query norm) make every layer the original one."""
    base = tiny_base(family)
    model = to_swiftkv(base, l=2)
    with torch.no_grad():
        for layer in model.model.layers[2:]:
            attn = layer.self_attn
            attn.q_proj_swiftkv.load_state_dict(attn.q_proj.state_dict())
            if hasattr(attn, "q_norm_swiftkv"):
                attn.q_norm_swiftkv.load_state_dict(attn.q_norm.state_dict())
        ids = torch.randint(3, 128, (2, 10))
        every = torch.ones_like(ids, dtype=torch.bool)
        out = model(ids, use_cache=False, swiftkv_exact_mask=every).logits
        torch.testing.assert_close(out, base(ids).logits, atol=ATOL, rtol=0)


def test_full_forward_without_a_mask_scores_the_input_as_one_prompt():
    """Without a mask, a forward treats its input as a prompt: its last W positions exact (with or without a
    cache, every row's logits)."""
    model = windowed("llama", "sdpa", window=3)
    _, ids, mask = left_padded_batch()
    exact = torch.zeros_like(ids, dtype=torch.bool)
    exact[:, -3:] = True
    ref = student_logits(model, ids, mask, exact)
    with torch.no_grad():
        for cache in (None, make_cache("dynamic", model)):
            out = model(
                ids,
                attention_mask=mask,
                position_ids=positions_of(mask),
                cache=cache,
                use_cache=cache is not None,
            ).logits
            torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)


def test_training_path_takes_the_mask():
    model = windowed("qwen3", "sdpa", window=2)
    ids = torch.randint(3, 128, (2, 12))
    exact = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) > 0.6
    with torch.no_grad():
        teacher, hidden, _, _ = model.model.teacher_student_hidden(ids, exact_mask=exact)
        logits = model.lm_head(hidden)
        torch.testing.assert_close(logits, student_logits(model, ids, None, exact), atol=ATOL, rtol=0)
        default = model.lm_head(model.model.teacher_student_hidden(ids)[1])  # the last W positions
        torch.testing.assert_close(default, model(ids, use_cache=False).logits, atol=ATOL, rtol=0)
        model.set_mode("teacher")
        torch.testing.assert_close(model.lm_head(teacher), model(ids).logits, atol=ATOL, rtol=0)


# -- cached generation -------------------------------------------------------------------------------------------
def run_conversation(model, cache, ids, mask, window: int, steps: int = 2):
    """Prefill (logits_to_keep=1), decode steps, a second multi-token prompt onto the cache, decode again; every
    step checked against the reference with the last ``window`` columns of each forward (all of a decode step)
    exact."""
    torch.manual_seed(11)
    turn2 = torch.randint(3, 128, (ids.shape[0], 4))
    plan = [ids] + [None] * steps + [turn2] + [None] * min(steps, 1)
    seq, seq_mask, exact, logits = ids[:, :0], mask[:, :0], ids[:, :0].bool(), None
    with torch.no_grad():
        for chunk in plan:
            if chunk is None:
                chunk = logits[:, -1].argmax(-1, keepdim=True)
            seq_mask = torch.cat([seq_mask, mask if seq.shape[1] == 0 else torch.ones_like(chunk)], 1)
            seq = torch.cat([seq, chunk], 1)
            new = torch.zeros_like(chunk, dtype=torch.bool)
            new[:, -window:] = True
            exact = torch.cat([exact, new], 1)
            logits = model(
                chunk,
                attention_mask=seq_mask,
                position_ids=positions_of(seq_mask)[:, -chunk.shape[1] :],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            ref = student_logits(model, seq, seq_mask, exact)[:, -1]
            torch.testing.assert_close(logits[:, -1], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("impl", "window"), [("eager", 1), ("sdpa", 3), (FLASH_2D, 3)])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_conversation_matches_reference(family, impl, cache, window):
    model = windowed(family, impl, window)
    for ids, mask in reference_batches():
        run_conversation(model, make_cache(cache, model), ids, mask, window)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("impl", "cache"), [("sdpa", "dynamic"), (FLASH_2D, "static")])
def test_greedy_generate_matches_reference(family, impl, cache):
    model = windowed(family, impl, window=3)
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
        assert out[:, ids.shape[1] :].tolist() == greedy(model, ids, mask, 6, window=3).tolist()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("chunk", [2, 4])
def test_chunked_prefill_gives_the_tokens_of_one_chunk(cache, chunk):
    """A prompt token's K/V in layers >= l are exact iff it is among the last W of its prompt, however the prompt
    is split: generate() passes the prompt length (``swiftkv_prompt_len``) with ``prefill_chunk_size``, so chunks
    of 2 or 4 with W = 3 (the window spans chunks) give the reference's greedy tokens, as one chunk does."""
    model = windowed("llama", "sdpa", window=3)
    for ids, mask in reference_batches():
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=4,
                do_sample=False,
                prefill_chunk_size=chunk,
                cache_implementation=cache,
                pad_token_id=0,
                eos_token_id=None,
            )
        assert out[:, ids.shape[1] :].tolist() == greedy(model, ids, mask, 4, window=3).tolist()


@pytest.mark.parametrize("splits", [(9,), (4, 5), (2, 3, 4)])
def test_chunked_forwards_with_the_prompt_length_give_the_logits_of_one_chunk(splits):
    """A prompt fed in 1-3 forwards onto one cache, each with logits_to_keep=1 and ``swiftkv_prompt_len``, then
    two decode steps: every step's logits are the reference's with the last W prompt columns and the generated
    ones exact."""
    model = windowed("qwen3", "sdpa", window=3)
    _, ids, mask = left_padded_batch()
    prompt_len = ids.shape[1]
    cache, start, logits, seq, seq_mask = make_cache("dynamic", model), 0, None, ids, mask
    with torch.no_grad():
        for size in splits:
            end = start + size
            logits = model(
                ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=positions_of(mask)[:, start:end],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
                swiftkv_prompt_len=prompt_len,
            ).logits
            start = end
        for _ in range(3):
            exact = (torch.arange(seq.shape[1]) >= prompt_len - 3).expand(seq.shape)
            ref = student_logits(model, seq, seq_mask, exact)[:, -1]
            torch.testing.assert_close(logits[:, -1], ref, atol=ATOL, rtol=0)
            token = logits[:, -1].argmax(-1, keepdim=True)
            seq, seq_mask = torch.cat([seq, token], 1), torch.cat([seq_mask, torch.ones_like(token)], 1)
            logits = model(
                token,
                attention_mask=seq_mask,
                position_ids=positions_of(seq_mask)[:, -1:],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
                swiftkv_prompt_len=prompt_len,
            ).logits


def test_a_forward_without_a_cache_follows_the_rule_given_the_prompt_length():
    """With ``swiftkv_prompt_len`` a forward without a cache over prompt + generated tokens makes the last W
    prompt positions and the generated ones exact, as cached generation does; generate(use_cache=False) passes
    it, so it returns the cached generation's tokens."""
    model = windowed("llama", "sdpa", window=3)
    _, ids, mask = left_padded_batch()
    prompt_len = ids.shape[1]
    more = torch.randint(3, 128, (ids.shape[0], 4), generator=torch.Generator().manual_seed(9))
    seq, seq_mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    exact = (torch.arange(seq.shape[1]) >= prompt_len - 3).expand(seq.shape)
    with torch.no_grad():
        out = model(
            seq,
            attention_mask=seq_mask,
            position_ids=positions_of(seq_mask),
            use_cache=False,
            swiftkv_prompt_len=prompt_len,
        ).logits
        ref = student_logits(model, seq, seq_mask, exact)
        torch.testing.assert_close(out[seq_mask.bool()], ref[seq_mask.bool()], atol=ATOL, rtol=0)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        uncached = model.generate(**kwargs, use_cache=False, eos_token_id=None)
    assert uncached[:, prompt_len:].tolist() == greedy(model, ids, mask, 5, window=3).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prompt_lookup_speculation_gives_the_greedy_tokens(family):
    """Speculative verification tokens are generated tokens: they store exact K/V, the rejected ones are cropped,
    so n-gram speculation returns exactly the greedy continuation."""
    model = windowed(family, "sdpa", window=3)
    motif = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    ids = torch.cat([motif, motif, motif[:, :3]], 1)  # repeats, so the lookup proposes drafts
    kwargs = dict(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        speculative = model.generate(**kwargs, prompt_lookup_num_tokens=3)
        plain = model.generate(**kwargs)
    assert speculative.tolist() == plain.tolist()
    assert plain[:, ids.shape[1] :].tolist() == greedy(model, ids, torch.ones_like(ids), 8, window=3).tolist()


@pytest.mark.slow
def test_compiled_static_cache_generate_matches_reference():
    """generate() compiles the decode step when the cache is static (forced on CPU): the exact rows' cache
    writes and the prompt window under torch.compile."""
    from transformers import CompileConfig

    model = windowed("llama", "sdpa", window=3)
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
    assert out[:, ids.shape[1] :].tolist() == greedy(model, ids, mask, 4, window=3).tolist()


# -- the mask of teacher-forced rows ----------------------------------------------------------------------------
def test_exact_positions_cover_replies_and_their_windows_inside_each_sample():
    # two packed samples: [system user user | reply reply] [user | reply reply reply] + padding
    loss = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]])
    assert exact_kv_positions(loss, pos, 1).int().tolist() == loss.tolist()
    assert exact_kv_positions(loss, pos, 3).int().tolist() == [[1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0]]
    # the window never reaches into the previous sample: sample 2's reply starts at its position 1
    assert exact_kv_positions(loss, pos, 4)[0, 4].item() is False


def test_a_prefill_window_keeps_sdpa_causal_kernel_in_the_lower_layers():
    """A prefill that runs its last W rows through layers >= l: the lower layers (the whole block) still get
    sdpa's ``is_causal`` (mask None, its fast kernel), and only the kept rows an explicit mask, bottom-right
    aligned (equal to the rows of the full causal mask), so the window costs its rows and no more."""
    model = windowed("llama", "sdpa", 3)
    calls = []
    real = model.model._run

    def spy(layers, hidden, prepared, *args, **kwargs):
        calls.append((len(layers), prepared.attention_mask))
        return real(layers, hidden, prepared, *args, **kwargs)

    model.model._run = spy
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    (lower, lower_mask), (upper, upper_mask) = calls
    assert (lower, upper) == (2, model.config.num_hidden_layers - 2)
    assert lower_mask is None and upper_mask is not None and upper_mask.shape[-2:] == (3, 12)
    full = torch.ones(12, 12, dtype=torch.bool).tril()[-3:]
    assert torch.equal(
        upper_mask[0, 0].bool() if upper_mask.dtype == torch.bool else upper_mask[0, 0] == 0, full
    )
    assert out.logits.shape[1] == 1


@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("qwen3", "eager"), ("qwen2", "sdpa")])
def test_rows_only_student_equals_the_full_pass(family, impl):
    """Running layers >= l on the scored and exact rows only (``query_mask``) gives the full teacher-forced pass's
    outputs at those rows, and the same gradients of the SwiftKV parameters, on packed rows with padding."""
    model = windowed(family, impl, window=3)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 128, (2, 20), generator=gen)
    pos = torch.cat([torch.arange(12), torch.arange(8)])[None].repeat(2, 1)  # two packed samples per row
    pos[1, 14:] = torch.arange(6)  # the second row: a sample, then a padding segment
    loss = torch.zeros_like(ids)
    loss[0, 7:11], loss[0, 15:19], loss[1, 4:9], loss[1, 12:14] = 1, 1, 1, 1
    exact = exact_kv_positions(loss, pos, 3)
    wanted = loss.bool() | exact
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [p for n, p in model.named_parameters() if "swiftkv" in n]
    for p in trained:
        p.requires_grad_(True)
    outs = {}
    for name, query in (("full", None), ("rows", wanted)):
        model.zero_grad()
        _, student, _, s_in = model.model.teacher_student_hidden(
            ids, position_ids=pos, exact_mask=exact, query_mask=query
        )
        (student[wanted].pow(2).sum() + s_in[wanted].sum()).backward()
        outs[name] = (student[wanted].detach(), s_in[wanted].detach(), [p.grad.clone() for p in trained])
    torch.testing.assert_close(outs["rows"][0], outs["full"][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(outs["rows"][1], outs["full"][1], atol=ATOL, rtol=0)
    for rows_grad, full_grad in zip(outs["rows"][2], outs["full"][2], strict=True):
        torch.testing.assert_close(rows_grad, full_grad, atol=1e-4, rtol=1e-4)
