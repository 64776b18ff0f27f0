"""Quality of a SwiftKV checkpoint against its own teacher (the same weights in original mode).

On held-out conversations (the held-out split of the embedded ShareGPT, ``toolkit.assets``, which training
never reads; or a file of the user's own): KL(teacher || student) at T=1 and top-1 agreement over assistant
tokens, teacher and student perplexity on those tokens, and greedy-generation agreement on held-out prompts
(the share of generated tokens before the first divergence).  A non-SwiftKV checkpoint is its own teacher:
KL 0, agreement 1.

Two numbers for the token metrics, so that nobody is fooled by either:

* **all prompt** (the top-level keys, and ``all_prompt`` by subset): every position treated as a prompt token,
  SwiftKV K/V in layers >= l everywhere (no exact position): the conservative number;
* **as served** (``served``): each reply scored in a sample of its own, cut after it, with everything before
  it as prompt, so that exactly the positions a served request runs through every layer (that reply, and with
  ``exact_kv_window = W`` the W prompt tokens before it) take exact K/V (``distill.served``), as vLLM or
  ``generate()`` without a prefix-cache hit compute them.  Subsets: every reply token, the first 16 tokens of
  each reply, the first reply of each conversation.  Without exact K/V the two regimes are the same.
* **prompt heavy** (``prompt_heavy``, optional): replies after 1-8k prompt tokens, synthetic retrieval and
  documents that are not chat (``eval.prompt_heavy``).

Both are scored on the same samples (each reply cut after it, everything before it as prompt; causal attention
makes the all-prompt logits of a cut sample those of the whole conversation), with one teacher pass per sample
for every student (``students_quality``: the main job scores all its checkpoints so).

Greedy agreement runs ``generate()``, which serves the checkpoint as it is (exact K/V included).

Teacher and student are the same weights, so they are always evaluated on the same device and in the same
dtype; ``load_for_eval`` places them: ``cpu``, ``cuda`` (one GPU) or ``auto`` (``device_map="auto"``: the
layers spread over every visible GPU, what does not fit offloaded to CPU by accelerate's hooks), in float32,
bfloat16 or float16.  The result records both.  bf16 against fp32 on CPU (a tiny model, the tests): KL within
0.01 and top-1 agreement within 0.05 of each other.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from distill.data import pack, render_conversation
from distill.objective import agreement_metrics, metrics_from_sums
from distill.served import conversation_samples, metrics, served_sums, shares_teacher
from toolkit.assets import iter_conversations
from toolkit.cliargs import EVAL_DEVICES, EVAL_DTYPES, UsageError

from .speed import input_device
from .tasks import held_out_pairs


def held_out_rows(tokenizer, n_conversations: int = 32, seq_len: int = 512, data: str | Path = "sharegpt"):
    """Packed rows (input_ids, position_ids, loss_mask) of the first ``n_conversations`` held-out conversations
    with an assistant token within their first ``seq_len`` tokens (those are counted)."""
    samples = []
    for messages in iter_conversations(data, split="heldout"):
        if not any(m["role"] == "assistant" for m in messages):
            continue
        sample = render_conversation(messages, tokenizer)
        if any(sample["counted"][1:seq_len]):  # else packing would cut every counted token off
            samples.append(sample)
        if len(samples) >= n_conversations:
            break
    if not samples:
        raise UsageError(
            f"no held-out conversation of {data} has an assistant token within its first {seq_len} tokens "
            "(to resolve, evaluate on longer sequences or on conversations with shorter prompts)"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pack(samples, seq_len, pad)


def check_placement(device: str, dtype: str) -> None:
    """Refuse a device or dtype evaluation cannot use here, before anything is loaded."""
    if device not in EVAL_DEVICES or dtype not in EVAL_DTYPES:
        raise UsageError(
            f"device {device!r} / dtype {dtype!r} (to resolve, choose a device of {', '.join(EVAL_DEVICES)} "
            f"and a dtype of {', '.join(EVAL_DTYPES)})"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is visible (to resolve, pass --device cpu)")


def load_for_eval(model_dir: str | Path, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer) of a checkpoint for evaluation, in ``dtype`` on ``device`` (module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import swiftkv  # noqa: F401  (registers the SwiftKV model types)

    check_placement(device, dtype)
    placement = {"cpu": {}, "cuda": {"device_map": "cuda"}, "auto": {"device_map": "auto"}}[device]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **placement)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def _modes(model) -> tuple[str, str] | None:
    return ("teacher", "student") if hasattr(model, "set_mode") else None


@torch.no_grad()
def token_metrics(model, rows: dict[str, torch.Tensor], batch_size: int = 4) -> dict[str, float]:
    """The metrics of a model that is its own teacher (not SwiftKV) on packed rows: its perplexity, KL 0."""
    sums = torch.zeros(5, dtype=torch.float64)
    device = input_device(model)
    n = rows["input_ids"].shape[0]
    for i in tqdm(range(0, n, batch_size), desc="quality: held-out rows", unit="batch"):
        ids, pos, mask = (
            rows[k][i : i + batch_size].to(device) for k in ("input_ids", "position_ids", "loss_mask")
        )
        logits = model(ids, position_ids=pos, use_cache=False).logits.float()
        mask, ids = mask.to(logits.device), ids.to(logits.device)
        sums += agreement_metrics(logits, logits, nn.Identity(), mask, input_ids=ids).cpu()
    return metrics_from_sums(sums)


@torch.no_grad()
def _greedy(model, ids: dict, max_new_tokens: int, mode: str) -> list[int]:
    if _modes(model):
        model.set_mode(mode)
    gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    if _modes(model):
        model.set_mode("student")
    return gen[0, ids["input_ids"].shape[1] :].tolist()


@torch.no_grad()
def generation_agreement(
    teacher, students: dict, tokenizer, prompts: list[str], max_new_tokens: int = 32
) -> dict[str, dict[str, float]]:
    """Greedy generation of each student against the teacher's on ``prompts`` (the teacher generates once per
    prompt): the share of tokens before the first divergence, and exact matches."""
    prefix = {name: [] for name in students}
    exact = {name: [] for name in students}
    device = input_device(teacher)
    for prompt in tqdm(prompts, desc="quality: greedy prompts", unit="prompt"):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        ).to(device)
        t = _greedy(teacher, ids, max_new_tokens, "teacher")
        for name, student in students.items():
            s = _greedy(student, ids, max_new_tokens, "student")
            same = next(
                (i for i, (a, b) in enumerate(zip(t, s, strict=False)) if a != b), min(len(t), len(s))
            )
            prefix[name].append(same / max(len(t), 1))
            exact[name].append(float(t == s))
    return {
        name: {
            "greedy_prefix_agreement": sum(prefix[name]) / len(prefix[name]),
            "greedy_exact_match": sum(exact[name]) / len(exact[name]),
        }
        for name in students
    }


def _regimes(model, served: bool) -> dict[str, int | None]:
    window = model.config.exact_kv_window or None
    return {"all_prompt": None, **({"served": window} if served and window else {})}


@torch.no_grad()
def students_quality(
    teacher,
    students: dict,
    tokenizer,
    n_conversations: int = 32,
    seq_len: int = 512,
    n_prompts: int = 8,
    max_new_tokens: int = 32,
    batch_size: int = 4,
    data: str | Path = "sharegpt",
    before: frozenset[str] = frozenset(),
    prompt_heavy: dict | None = None,
) -> dict[str, dict]:
    """All quality metrics of SwiftKV ``students`` (name -> model sharing ``teacher``'s weights, checked) against
    the teacher, one teacher pass per sample for all of them: the all-prompt reply metrics at the top level,
    ``all_prompt`` and ``served`` by subset, greedy agreement, and (``prompt_heavy``: the keyword arguments of
    ``eval.prompt_heavy.prompt_heavy_metrics``) ``prompt_heavy``.  Students in ``before`` (checkpoints before
    distillation) get the all-prompt numbers only."""
    for name, student in students.items():
        if not _modes(student) or not shares_teacher(student, teacher):
            raise UsageError(
                f"{name} is not a SwiftKV checkpoint of the teacher's weights (to resolve, evaluate it alone with "
                "`swiftkv quality`)"
            )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    samples = conversation_samples(tokenizer, n_conversations, seq_len, data)
    plan = {name: (m, _regimes(m, name not in before)) for name, m in students.items()}
    sums = served_sums(teacher, plan, samples, seq_len, pad, batch_size)
    after = {name: m for name, m in students.items() if name not in before}
    prompts = [p for p, _ in held_out_pairs(n_prompts, max_chars=400, data=data)] if n_prompts else []
    greedy = (
        generation_agreement(teacher, after, tokenizer, prompts, max_new_tokens) if prompts and after else {}
    )
    heavy = None
    if prompt_heavy is not None and after:
        from .prompt_heavy import prompt_heavy_metrics

        heavy = prompt_heavy_metrics(teacher, after, tokenizer, data=data, **prompt_heavy)
    out = {}
    for name, student in students.items():
        by_regime = metrics(sums[name])
        if name not in before:  # without exact K/V the two regimes are one computation
            by_regime.setdefault("served", by_regime["all_prompt"])
        out[name] = {
            **by_regime["all_prompt"]["reply"],
            **greedy.get(name, {}),
            "exact_kv_window": student.config.exact_kv_window,
            **by_regime,
        }
        if heavy is not None and name in after:
            out[name]["prompt_heavy"] = _for_student(heavy, name)
    return out


def _for_student(heavy: dict, name: str) -> dict:
    """One student's part of ``prompt_heavy_metrics`` (with the teacher's retrieval accuracy beside its own)."""
    return {
        "bands": {band: by_name[name] for band, by_name in heavy["bands"].items()},
        "retrieval": {
            task: {
                n: {"samples": r["samples"], "teacher": r["teacher"], "student": r[name]}
                for n, r in by_len.items()
            }
            for task, by_len in heavy["retrieval"].items()
        },
        "documents": heavy["documents"].get(name, {}),
        "settings": heavy["settings"],
    }


def quality_of(
    model,
    tokenizer,
    n_conversations: int = 32,
    seq_len: int = 512,
    n_prompts: int = 8,
    max_new_tokens: int = 32,
    batch_size: int = 4,
    data: str | Path = "sharegpt",
    served: bool = True,
    prompt_heavy: dict | None = None,
) -> dict:
    """All quality metrics of a loaded model against its teacher mode (``students_quality`` with the model as its
    own teacher; ``served`` False: all prompt only, as for a checkpoint before distillation).  A model that is not
    SwiftKV is its own teacher: its perplexity, KL 0 and agreement 1."""
    if not _modes(model):
        rows = held_out_rows(tokenizer, n_conversations, seq_len, data)
        greedy = {"greedy_prefix_agreement": 1.0, "greedy_exact_match": 1.0} if n_prompts else {}
        return {**token_metrics(model, rows, batch_size), **greedy}
    return students_quality(
        model,
        {"model": model},
        tokenizer,
        n_conversations,
        seq_len,
        n_prompts if served else 0,
        max_new_tokens,
        batch_size,
        data,
        frozenset() if served else frozenset({"model"}),
        prompt_heavy if served else None,
    )["model"]


def evaluate_quality(
    model_dir: str | Path,
    n_conversations: int = 32,
    seq_len: int = 512,
    n_prompts: int = 8,
    max_new_tokens: int = 32,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 4,
    data: str | Path = "sharegpt",
    served: bool = True,
    prompt_heavy: dict | None = None,
) -> dict:
    """All quality metrics of one checkpoint against its teacher, with the device and dtype they ran in."""
    model, tokenizer = load_for_eval(model_dir, device, dtype)
    result = quality_of(
        model,
        tokenizer,
        n_conversations,
        seq_len,
        n_prompts,
        max_new_tokens,
        batch_size,
        data,
        served,
        prompt_heavy,
    )
    return {**result, "device": device, "dtype": dtype}


def evaluate_variants(
    teacher_dir: str | Path,
    variants: dict[str, str | Path],
    before: frozenset[str] = frozenset(),
    *,
    device: str = "cpu",
    dtype: str = "float32",
    **settings,
) -> dict[str, dict]:
    """``students_quality`` of SwiftKV checkpoints (name -> folder) distilled from ``teacher_dir``, loaded once
    each, with the device and dtype they ran in."""
    teacher, tokenizer = load_for_eval(teacher_dir, device, dtype)
    students = {name: load_for_eval(path, device, dtype)[0] for name, path in variants.items()}
    result = students_quality(teacher, students, tokenizer, before=before, **settings)
    return {name: {**r, "device": device, "dtype": dtype} for name, r in result.items()}
