"""Quality of a SwiftKV checkpoint against its own teacher (the same weights in original mode).

On the held-out split of the embedded ShareGPT (``swiftkv.assets``; training never reads it): KL(teacher ||
student) at T=1 and top-1 agreement over assistant tokens, teacher and student perplexity on those tokens, and
greedy-generation agreement on held-out prompts (the share of generated tokens before the first divergence).
A non-SwiftKV checkpoint is its own teacher: KL 0, agreement 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from distill.data import pack, render_conversation
from distill.objective import agreement_metrics, metrics_from_sums
from swiftkv.assets import iter_conversations

from .tasks import held_out_pairs


def held_out_rows(tokenizer, n_conversations: int = 32, seq_len: int = 512):
    """Packed rows (input_ids, position_ids, loss_mask) of held-out conversations, assistant tokens counted."""
    samples = []
    for messages in iter_conversations("sharegpt", split="heldout"):
        if any(m["role"] == "assistant" for m in messages):
            samples.append(render_conversation(messages, tokenizer))
        if len(samples) >= n_conversations:
            break
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pack(samples, seq_len, pad)


def _modes(model) -> tuple[str, str] | None:
    return ("teacher", "student") if hasattr(model, "set_mode") else None


@torch.no_grad()
def token_metrics(model, rows: dict[str, torch.Tensor], batch_size: int = 4) -> dict[str, float]:
    sums = torch.zeros(5, dtype=torch.float64)
    for i in range(0, rows["input_ids"].shape[0], batch_size):
        ids, pos, mask = (rows[k][i : i + batch_size] for k in ("input_ids", "position_ids", "loss_mask"))
        logits = {}
        for mode in _modes(model) or ("teacher",):
            if _modes(model):
                model.set_mode(mode)
            logits[mode] = model(ids, position_ids=pos, use_cache=False).logits.float()
        logits.setdefault("student", logits["teacher"])
        sums += agreement_metrics(logits["student"], logits["teacher"], nn.Identity(), mask, input_ids=ids)
    if _modes(model):
        model.set_mode("student")
    return metrics_from_sums(sums)


@torch.no_grad()
def generation_agreement(model, tokenizer, prompts: list[str], max_new_tokens: int = 32) -> dict[str, float]:
    if not _modes(model):
        return {"greedy_prefix_agreement": 1.0, "greedy_exact_match": 1.0}
    prefix, exact = [], []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        outs = {}
        for mode in ("teacher", "student"):
            model.set_mode(mode)
            gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
            outs[mode] = gen[0, ids["input_ids"].shape[1] :].tolist()
        t, s = outs["teacher"], outs["student"]
        same = next((i for i, (a, b) in enumerate(zip(t, s, strict=False)) if a != b), min(len(t), len(s)))
        prefix.append(same / max(len(t), 1))
        exact.append(float(t == s))
    model.set_mode("student")
    return {
        "greedy_prefix_agreement": sum(prefix) / len(prefix),
        "greedy_exact_match": sum(exact) / len(exact),
    }


def evaluate_quality(
    model_dir: str | Path,
    n_conversations: int = 32,
    seq_len: int = 512,
    n_prompts: int = 8,
    max_new_tokens: int = 32,
) -> dict[str, float]:
    """All quality metrics of one checkpoint against its teacher."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import swiftkv  # noqa: F401

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = held_out_rows(tokenizer, n_conversations, seq_len)
    prompts = [p for p, _ in held_out_pairs(n_prompts, max_chars=400)]
    return {**token_metrics(model, rows), **generation_agreement(model, tokenizer, prompts, max_new_tokens)}
