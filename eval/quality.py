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
  each reply, the first reply of each conversation, and replies after at least ``long_context`` prompt tokens
  (``long_prompt``: the prompt-heavy requests RAG and summarization serve).  Without exact K/V the two regimes
  are the same.

Both are scored on the same samples (each reply cut after it, everything before it as prompt; causal attention
makes the all-prompt logits of a cut sample those of the whole conversation), with one teacher pass.

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
from distill.served import conversation_samples, metrics, served_sums
from toolkit.assets import iter_conversations
from toolkit.cliargs import UsageError

from .speed import input_device
from .tasks import held_out_pairs

DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "bfloat16", "float16")


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
    if device not in DEVICES or dtype not in DTYPES:
        raise UsageError(
            f"device {device!r} / dtype {dtype!r} (to resolve, choose a device of {', '.join(DEVICES)} "
            f"and a dtype of {', '.join(DTYPES)})"
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
def generation_agreement(model, tokenizer, prompts: list[str], max_new_tokens: int = 32) -> dict[str, float]:
    if not _modes(model):
        return {"greedy_prefix_agreement": 1.0, "greedy_exact_match": 1.0}
    prefix, exact = [], []
    device = input_device(model)
    for prompt in tqdm(prompts, desc="quality: greedy prompts", unit="prompt"):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        ).to(device)
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


@torch.no_grad()
def served_metrics(
    model,
    tokenizer,
    n_conversations: int = 32,
    seq_len: int = 512,
    batch_size: int = 4,
    data: str | Path = "sharegpt",
    served: bool = True,
    long_context: int = 1024,
    n_long: int = 8,
    long_reply: int = 64,
) -> dict[str, dict[str, dict[str, float]]]:
    """Token metrics of each reply scored in a sample of its own (module docstring), in both regimes with one
    teacher pass: ``{"all_prompt" | "served": {"reply" | "first16" | "first_reply": metrics}}`` (``served`` False:
    all prompt only); ``served`` also has ``long_prompt``, the first ``long_reply`` tokens of each reply that starts
    after at least ``long_context`` tokens in the first ``n_long`` such held-out conversations (0, or data
    without one: left out).  Without exact K/V the two regimes are one computation."""
    window = model.config.exact_kv_window or None
    regimes = {"all_prompt": None, **({"served": window} if served and window else {})}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    samples = conversation_samples(tokenizer, n_conversations, seq_len, data)
    out = metrics(served_sums(model, samples, seq_len, pad, regimes, batch_size))
    if not served:
        return out
    out.setdefault("served", out["all_prompt"])
    if n_long:
        long_len = long_context + long_reply
        long = conversation_samples(tokenizer, n_long, long_len, data, long_context, required=False)
        if long:
            cut = {"min_context": long_context, "max_reply": long_reply}
            sums = served_sums(model, long, long_len, pad, {"served": window}, 1, **cut)
            long_metrics = metrics(sums)["served"]["reply"]
            if long_metrics["tokens"]:
                out["served"] = {**out["served"], "long_prompt": long_metrics}
    return out


def quality_of(
    model,
    tokenizer,
    n_conversations: int = 32,
    seq_len: int = 512,
    n_prompts: int = 8,
    max_new_tokens: int = 32,
    batch_size: int = 4,
    data: str | Path = "sharegpt",
    n_long: int = 8,
    served: bool = True,
) -> dict:
    """All quality metrics of a loaded model against its teacher mode: for a SwiftKV model the all-prompt reply
    metrics at the top level, ``all_prompt`` and ``served`` by subset (``served`` False: all prompt only, as for a
    checkpoint before distillation); ``n_prompts`` 0 leaves greedy agreement out."""
    prompts = [p for p, _ in held_out_pairs(n_prompts, max_chars=400, data=data)] if n_prompts else []
    greedy = generation_agreement(model, tokenizer, prompts, max_new_tokens) if prompts else {}
    if not _modes(model):  # its own teacher: one pass gives the perplexity, the rest is 0 and 1
        rows = held_out_rows(tokenizer, n_conversations, seq_len, data)
        return {**token_metrics(model, rows, batch_size), **greedy}
    by_regime = served_metrics(
        model, tokenizer, n_conversations, seq_len, batch_size, data, served, n_long=n_long
    )
    return {
        **by_regime["all_prompt"]["reply"],
        **greedy,
        "exact_kv_window": model.config.exact_kv_window,
        **by_regime,
    }


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
    n_long: int = 8,
    served: bool = True,
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
        n_long,
        served,
    )
    return {**result, "device": device, "dtype": dtype}
