"""Scoring a SwiftKV student the way it is served, with exact K/V (``exact_kv_window``).

A teacher-forced pass runs every position through every layer, but a served request runs only its generated
tokens (and the last W prompt tokens) through layers >= l, and only those store exact K/V there.  So a
student's quality depends on which positions are marked as generated, and three regimes bound what users see:

* **as served** (``per_reply`` rows): each reply is scored in a sample of its own, cut after it, with everything
  before it as prompt: exact K/V on that reply and the W prompt positions before it, SwiftKV K/V elsewhere.
  This is a request re-sent without a prefix-cache hit (every turn of a chat API without prefix caching);
* **continued** (conversation rows, every reply marked): all replies generated in turn in one cache, as a chat
  whose earlier turns hit the prefix cache;
* **all prompt** (no position marked): the student's plain teacher-forced quality, the conservative number
  (and the only one for a student without exact K/V).

Each regime is scored on every reply token, on the first ``first_tokens`` tokens of each reply (the tokens
closest to the SwiftKV prompt, where exact K/V help least), and on the first reply of each sample.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from swiftkv.modeling_swiftkv import exact_kv_positions
from toolkit.assets import iter_conversations
from toolkit.cliargs import UsageError

from .data import pack, render_conversation
from .objective import metrics_from_sums, token_agreement

FIRST_TOKENS = 16


def conversation_samples(
    tokenizer,
    n: int,
    seq_len: int,
    data: str | Path = "sharegpt",
    min_context: int = 0,
    required: bool = True,
) -> list[dict]:
    """Rendered samples (``input_ids``, ``counted``) of the first ``n`` held-out conversations of ``data`` with a
    reply that starts at ``min_context`` tokens or later and before ``seq_len`` (none found: a one-line error,
    or ``[]`` when not ``required``)."""
    samples = []
    for messages in iter_conversations(data, split="heldout"):
        if not any(m["role"] == "assistant" for m in messages):
            continue
        sample = render_conversation(messages, tokenizer)
        if any(max(min_context, 1) <= start < seq_len for start, _ in replies(sample["counted"])):
            samples.append(sample)
        if len(samples) >= n:
            return samples
    if not samples and required:
        raise UsageError(
            f"no held-out conversation of {data} has a reply after {min_context} tokens and within {seq_len} "
            "(to resolve, evaluate on longer sequences or on conversations with shorter prompts)"
        )
    return samples


def replies(counted: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of counted tokens (each reply)."""
    runs, start = [], None
    for i, c in enumerate([*counted, 0]):
        if c and start is None:
            start = i
        elif not c and start is not None:
            runs.append((start, i))
            start = None
    return runs


def per_reply_samples(
    samples: list[dict],
    seq_len: int,
    replies_of: slice = slice(None),
    min_context: int = 0,
    max_reply: int | None = None,
) -> list[dict]:
    """One sample per reply (those of ``replies_of`` in each conversation, e.g. ``slice(1)`` for the first): the
    conversation cut after that reply (at most ``max_reply`` of its tokens, and none past ``seq_len``), only that
    reply counted.  Replies that start before ``min_context`` tokens or at ``seq_len`` or later are left out."""
    out = []
    for sample in samples:
        for start, end in replies(sample["counted"])[replies_of]:
            end = min(end, seq_len, start + max_reply) if max_reply else min(end, seq_len)
            if start < max(min_context, 1) or start >= seq_len:
                continue
            counted = [0] * start + [1] * (end - start)
            out.append({"input_ids": sample["input_ids"][:end], "counted": counted})
    return out


def subsets(loss_mask: torch.Tensor, position_ids: torch.Tensor, first_tokens: int = FIRST_TOKENS):
    """Masks of the scored positions: every reply token, the first ``first_tokens`` of each reply, the first
    reply of each packed sample (each [batch, seq] bool)."""
    scored = loss_mask.bool()
    first_n, first_reply = torch.zeros_like(scored), torch.zeros_like(scored)
    for b in range(scored.shape[0]):
        run_at, runs_in_sample = -1, 0
        for t in range(scored.shape[1]):
            if position_ids[b, t] == 0:
                runs_in_sample = 0
            if not scored[b, t]:
                continue
            if t == 0 or not scored[b, t - 1] or position_ids[b, t] == 0:
                run_at, runs_in_sample = t, runs_in_sample + 1
            first_n[b, t] = t - run_at < first_tokens
            first_reply[b, t] = runs_in_sample == 1
    return {"reply": scored, f"first{first_tokens}": first_n, "first_reply": first_reply}


Students = dict[str, tuple[torch.nn.Module, dict[str, int | None]]]


def _device(model) -> torch.device:
    return model.get_input_embeddings().weight.device  # accelerate's hooks move inputs on from there


@torch.no_grad()
def teacher_hidden(
    teacher, ids, position_ids, layers: set[int]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The teacher's final normed hidden states and the input of each layer of ``layers`` (a SwiftKV model runs in
    teacher mode and is left in student mode; any other causal LM is its own teacher)."""
    if hasattr(teacher, "set_mode"):
        teacher.set_mode("teacher")
    out = teacher.model(ids, position_ids=position_ids, use_cache=False, output_hidden_states=True)
    if hasattr(teacher, "set_mode"):
        teacher.set_mode("student")
    return out.last_hidden_state, {l: out.hidden_states[l] for l in layers}


def shares_teacher(student, teacher) -> bool:
    """Whether ``student`` computes the teacher's lower layers and head: every weight of the teacher's is in the
    student, equal (a SwiftKV checkpoint distilled with only its SwiftKV weights trained, against its base)."""
    if student is teacher:
        return True
    mine = dict(student.named_parameters())
    return all(n in mine and torch.equal(p, mine[n].to(p.device)) for n, p in teacher.named_parameters())


def served_hidden(student, x_l, position_ids, scored: torch.Tensor, window: int | None) -> torch.Tensor:
    """The student's final normed hidden states at the ``scored`` rows, from the input of its layer l: those rows
    generated (exact K/V with the W - 1 prompt positions before them, ``exact_kv_positions``; None: no exact
    position), everything else SwiftKV prompt."""
    exact = None if window is None else exact_kv_positions(scored, position_ids, window)
    query = scored if exact is None else scored | exact
    return student.model.student_rows_hidden(x_l, position_ids, query, exact)[0]


@torch.no_grad()
def regime_sums(
    teacher,
    students: Students,
    rows: dict[str, torch.Tensor],
    batch_size: int = 4,
    first_tokens: int = FIRST_TOKENS,
) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """``agreement_metrics`` sums per packed row of each student against the teacher, per regime and subset:
    ``{student: {regime: {"reply" | "first16" | "first_reply": [rows, 5]}}}`` (``metrics`` turns them into means).

    ``students``: name -> (SwiftKV model sharing the teacher's weights, {regime: W}), W the exact K/V window of
    the regime (exact K/V on each scored reply and the W - 1 positions before it, ``exact_kv_positions``) or None
    for no exact position.  The teacher runs once per batch and hands each student the input of its layer l;
    each student runs its layers >= l on the scored rows only (``student_rows_hidden``), which equals its own
    teacher-forced pass there.
    """
    device = _device(teacher)
    layers = {m.config.num_key_value_layers for m, _ in students.values()}
    n = rows["input_ids"].shape[0]
    sums = {name: {r: {} for r in regimes} for name, (_, regimes) in students.items()}
    for i in tqdm(range(0, n, batch_size), desc="scoring", unit="batch", leave=False):
        ids, pos, loss = (
            rows[k][i : i + batch_size].to(device) for k in ("input_ids", "position_ids", "loss_mask")
        )
        masks = subsets(loss, pos, first_tokens)
        reply = masks["reply"]
        row_of = reply.nonzero()[:, 0].cpu()
        final, lower = teacher_hidden(teacher, ids, pos, layers)
        for name, (student, regimes) in students.items():
            x_l = lower[student.config.num_key_value_layers]
            for regime, window in regimes.items():
                hidden = served_hidden(student, x_l, pos, reply, window)
                per_token = token_agreement(hidden, final, student.lm_head, reply, input_ids=ids).cpu()
                for subset, mask in masks.items():
                    keep = mask[reply].cpu()
                    part = torch.zeros(len(ids), 5, dtype=torch.float64)
                    part.index_add_(0, row_of[keep], per_token[keep])
                    got = sums[name][regime].get(subset)
                    sums[name][regime][subset] = part if got is None else torch.cat([got, part])
    return sums


def metrics(sums: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, dict[str, float]]]:
    """Means over every row of one student's ``regime_sums``."""
    return {
        regime: {name: metrics_from_sums(s.sum(0)) for name, s in parts.items()}
        for regime, parts in sums.items()
    }


def served_sums(
    teacher,
    students: Students,
    samples: list[dict],
    seq_len: int,
    pad: int,
    batch_size: int = 4,
    **cut,
) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """``regime_sums`` of every reply scored as served (``per_reply_samples``); the ``first_reply`` subset is the
    first reply of each conversation (empty where no reply is left, e.g. prompt-heavy cuts of first replies)."""
    first, later = (per_reply_samples(samples, seq_len, part, **cut) for part in (slice(1), slice(1, None)))
    subset_names = ("reply", f"first{FIRST_TOKENS}", "first_reply")
    empty = torch.zeros(0, 5, dtype=torch.float64)
    sums = {
        name: {r: {s: empty for s in subset_names} for r in regimes}
        for name, (_, regimes) in students.items()
    }
    for part, is_first in ((first, True), (later, False)):
        if not part:
            continue
        for name, by_regime in regime_sums(teacher, students, pack(part, seq_len, pad), batch_size).items():
            for regime, parts in by_regime.items():
                for subset, rows in parts.items():
                    if is_first or subset != "first_reply":
                        sums[name][regime][subset] = torch.cat([sums[name][regime][subset], rows])
    return sums


def exact_kv_table(
    model,
    tokenizer,
    window: int,
    n_conversations: int = 32,
    seq_len: int = 512,
    batch_size: int = 4,
    data: str | Path = "sharegpt",
) -> dict[str, dict[str, dict[str, float]]]:
    """The forward-only measurement of what exact K/V buy a checkpoint, in five regimes: ``none`` (the student
    as it is), ``every_reply`` (every reply token exact, the continued regime at W = 1), ``each_reply``
    (each reply's own tokens only, earlier turns SwiftKV: as served at W = 1), ``every_reply_window`` (every
    reply token and the ``window`` prompt positions before each reply) and ``served_window`` (as served at W)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    samples = conversation_samples(tokenizer, n_conversations, seq_len, data)
    packed = {"m": (model, {"none": None, "every_reply": 1, "every_reply_window": window})}
    table = regime_sums(model, packed, pack(samples, seq_len, pad), batch_size)["m"]
    alone = {"m": (model, {"each_reply": 1, "served_window": window})}
    table.update(served_sums(model, alone, samples, seq_len, pad, batch_size)["m"])
    return metrics(table)


REGIMES = {
    "none": "none (the student as it is)",
    "every_reply": "every reply token",
    "each_reply": "each reply's own tokens only; earlier turns SwiftKV (as served, W = 1)",
    "every_reply_window": "every reply token + the {w} prompt tokens before each reply",
    "served_window": "each reply's own tokens + the {w} prompt tokens before it (as served, W = {w})",
}


def exact_kv_lines(table: dict, window: int, first_tokens: int = FIRST_TOKENS) -> list[str]:
    """The ``exact_kv_table`` in markdown: KL at T = 1 per regime on each subset."""
    lines = [
        f"| positions with exact K/V in layers >= l | KL, reply tokens | KL, first {first_tokens} tokens of each reply "
        "| KL, first reply | top-1, reply tokens |",
        "|---|---|---|---|---|",
    ]
    for regime, label in REGIMES.items():
        parts = table[regime]
        cells = [parts[name]["kl"] for name in ("reply", f"first{first_tokens}", "first_reply")]
        lines.append(
            f"| {label.format(w=window)} | "
            + " | ".join(f"{c:.3f}" for c in cells)
            + f" | {parts['reply']['top1_agreement']:.3f} |"
        )
    return lines
