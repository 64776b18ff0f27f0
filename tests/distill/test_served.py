"""Scoring as served: per-reply samples, the scored subsets, and the teacher-forced "as served" logits equal to
what cached generation computes for the same reply."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import tiny_base, to_swiftkv

from distill.data import pack
from distill.diagnose import main as diagnose_main
from distill.served import per_reply_samples, regime_sums, replies, served_sums, subsets
from swiftkv.modeling_swiftkv import exact_kv_positions


def test_replies_and_per_reply_samples():
    sample = {"input_ids": list(range(12)), "counted": [0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0]}
    assert replies(sample["counted"]) == [(2, 4), (7, 10)]
    first, second = per_reply_samples([sample], seq_len=12)
    assert first == {"input_ids": [0, 1, 2, 3], "counted": [0, 0, 1, 1]}
    assert second == {"input_ids": list(range(10)), "counted": [0] * 7 + [1, 1, 1]}
    assert per_reply_samples([sample], 12, slice(1, None)) == [second]
    # a reply that ends past seq_len is cut there, one that starts there is left out
    assert per_reply_samples([sample], 9) == [
        first,
        {"input_ids": list(range(9)), "counted": [0] * 7 + [1, 1]},
    ]
    assert per_reply_samples([sample], 7) == [first]
    assert per_reply_samples([sample], 12, min_context=5, max_reply=2) == [
        {"input_ids": list(range(9)), "counted": [0] * 7 + [1, 1]}
    ]


def test_subsets_follow_replies_and_samples():
    loss = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])  # two packed samples: the second starts at index 7
    masks = subsets(loss, pos, first_tokens=2)
    assert masks["reply"].int().tolist() == loss.tolist()
    assert masks["first2"].int().tolist() == [[0, 1, 1, 0, 0, 1, 1, 0, 1, 1]]
    assert masks["first_reply"].int().tolist() == [[0, 1, 1, 1, 0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("window", [1, 3])
def test_as_served_scoring_is_what_cached_generation_computes(window):
    """The teacher-forced logits of a reply scored as served (its sample cut after it, exact K/V on it and the
    window before it) equal the logits a cached generation computes while it feeds that reply token by token."""
    model = to_swiftkv(tiny_base("llama"), l=2)
    model.config.exact_kv_window = window
    torch.manual_seed(3)
    ids = torch.randint(3, 128, (1, 14))
    prompt = 9  # the reply is ids[9:14]; positions 8..12 predict it
    loss = torch.zeros_like(ids)
    loss[0, prompt - 1 : -1] = 1
    pos = torch.arange(14)[None]
    with torch.no_grad():
        forced = model(
            ids, position_ids=pos, use_cache=False, swiftkv_exact_mask=exact_kv_positions(loss, pos, window)
        )
        served = [model(ids[:, :prompt], use_cache=True, logits_to_keep=1)]
        for t in range(prompt, 13):
            served.append(model(ids[:, t : t + 1], cache=served[-1].cache, use_cache=True))
    steps = torch.cat([s.logits[:, -1] for s in served])
    torch.testing.assert_close(forced.logits[0, prompt - 1 : -1], steps, atol=2e-5, rtol=0)


def test_no_exact_position_is_the_plain_student():
    model = to_swiftkv(tiny_base("llama"), l=2)
    samples = [{"input_ids": torch.randint(3, 128, (20,)).tolist(), "counted": [0] * 8 + [1] * 12}]
    rows = pack(samples, 24, 0)
    sums = {
        r: {k: v.sum(0) for k, v in parts.items()}
        for r, parts in regime_sums(model, {"m": (model, {"none": None, "reply": 1})}, rows)["m"].items()
    }
    with torch.no_grad():
        model.set_mode("teacher")
        teacher = torch.log_softmax(model(rows["input_ids"], position_ids=rows["position_ids"]).logits, -1)
        model.set_mode("student")
        student = torch.log_softmax(model(rows["input_ids"], position_ids=rows["position_ids"]).logits, -1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)[rows["loss_mask"].bool()].sum()
    torch.testing.assert_close(sums["none"]["reply"][0].float(), kl.double().float(), atol=1e-4, rtol=1e-4)
    assert sums["none"]["reply"][2] == rows["loss_mask"].sum()
    assert sums["reply"]["reply"][0] < sums["none"]["reply"][0]  # exact K/V move the student to the teacher


@pytest.mark.smollm2
def test_diagnose_exact_kv_writes_the_table(tiny_chat_model, tmp_path, capsys):
    from swiftkv.convert import convert

    converted = tmp_path / "converted"
    convert(tiny_chat_model, converted, swiftkv_fraction=0.5)
    assert (
        diagnose_main([str(converted), "--exact-kv", "4", "--limit", "3", "--out", str(tmp_path / "d")]) == 0
    )
    table = json.loads((tmp_path / "d" / "exact_kv.json").read_text())["table"]
    assert set(table) == {"none", "every_reply", "each_reply", "every_reply_window", "served_window"}
    assert table["every_reply"]["reply"]["kl"] < table["none"]["reply"]["kl"]
    assert "as served, W = 4" in capsys.readouterr().out
    assert diagnose_main([str(converted), "--exact-kv", "0"]) == 2


def test_long_prompt_samples_need_a_reply_that_starts_after_the_context(tmp_path):
    """A reply that only spans the min_context mark does not make a conversation prompt-heavy: selection and the
    per-reply cut agree (the report's prompt-heavy row once found conversations the cut then left empty)."""
    from helpers.chat import byte_tokenizer

    from distill.served import conversation_samples

    chats = [
        {
            "conversations": [{"from": "human", "value": "q" * 20}, {"from": "gpt", "value": "a" * 200}]
        },  # spans 100
        {
            "conversations": [{"from": "human", "value": "q" * 150}, {"from": "gpt", "value": "b" * 30}]
        },  # starts past
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats) * 60)  # enough rows for the held-out split
    tokenizer = byte_tokenizer()
    samples = conversation_samples(tokenizer, 4, 300, data, min_context=100, required=False)
    assert samples and all(per_reply_samples([s], 300, min_context=100) for s in samples)
    assert all(len(per_reply_samples([s], 300, min_context=100)) == 1 for s in samples)
    assert conversation_samples(tokenizer, 4, 300, data, min_context=1000, required=False) == []


def test_served_sums_keep_later_replies_when_every_first_reply_is_cut_away():
    """The prompt-heavy cut (replies after min_context) drops first replies: the later ones are still scored."""
    model = to_swiftkv(tiny_base("llama"), l=2)
    ids = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    sample = {"input_ids": ids, "counted": [0] * 4 + [1] * 6 + [0] * 12 + [1] * 8}  # replies at 4 and 22
    plan = {"m": (model, {"served": None})}
    sums = served_sums(model, plan, [sample], 32, 0, min_context=20)["m"]["served"]
    assert sums["reply"].sum(0)[2] == 8 and sums["first_reply"].sum(0)[2] == 0
    both = served_sums(model, plan, [sample], 32, 0)["m"]["served"]
    assert both["reply"].sum(0)[2] == 14 and both["first_reply"].sum(0)[2] == 6


def test_one_teacher_pass_scores_several_students_as_each_alone():
    """Students of different l sharing the teacher's weights, scored in one pass against the original model, get
    the numbers each gets scored alone against its own teacher mode; a student of other weights is refused."""
    from distill.served import shares_teacher

    base = tiny_base("llama")
    students = {"l2": to_swiftkv(tiny_base("llama"), l=2), "l4": to_swiftkv(tiny_base("llama"), l=4)}
    for m in students.values():
        m.config.exact_kv_window = 2
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    samples = [{"input_ids": ids, "counted": [0] * 6 + [1] * 8 + [0] * 14 + [1] * 12}]
    plan = {name: (m, {"all_prompt": None, "served": 2}) for name, m in students.items()}
    together = served_sums(base, plan, samples, 48, 0)
    for name, m in students.items():
        alone = served_sums(m, {name: plan[name]}, samples, 48, 0)[name]
        for regime, parts in alone.items():
            for subset, rows in parts.items():
                torch.testing.assert_close(together[name][regime][subset], rows, atol=1e-5, rtol=1e-5)
    assert shares_teacher(students["l2"], base)
    assert not shares_teacher(to_swiftkv(tiny_base("llama", seed=1), l=2), base)


def test_acrosskv_checkpoint_without_a_window_is_scored():
    """quality's plan for an AcrossKV checkpoint (g = 2, exact_kv_window 0) asks for no exact position, so
    regime_sums scores it (every reply token) instead of refusing an exact mask."""
    from eval.quality import _regimes

    model = to_swiftkv(tiny_base("llama"), l=2, g=2)
    regimes = _regimes(model, served=True)
    assert regimes == {"all_prompt": None}
    samples = [{"input_ids": torch.randint(3, 128, (20,)).tolist(), "counted": [0] * 8 + [1] * 12}]
    rows = pack(samples, 24, 0)
    sums = regime_sums(model, {"m": (model, regimes)}, rows)["m"]["all_prompt"]["reply"]
    assert sums.sum(0)[2] == rows["loss_mask"].sum()
