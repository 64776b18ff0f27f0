"""Prompt-heavy quality: what a SwiftKV student does after a long prompt, the requests it is bought for.

Three measurements, each scored as served (the prompt as prompt, SwiftKV K/V in layers >= l except its last W
tokens; the scored tokens generated, exact K/V) against the teacher, with one teacher pass per sample shared by
every student (``distill.served.teacher_hidden``; each student runs its layers >= l on the scored rows only):

* **bands**: replies of the held-out ShareGPT split whose prompt (everything before the reply) is 1-2k, 2-4k or
  4-8k tokens long, one reply per conversation (the last in the band), its first ``reply_tokens`` scored: KL at
  T = 1 with a bootstrap 95% interval over replies, the perplexity ratio, top-1 agreement;
* **retrieval**: RULER-style synthetic tasks built in code (``eval.prompt_heavy_data``: passkey, multi-key, variable
  tracking) at several prompt lengths; a sample is correct when the greedy choice at every answer token is the
  answer token.  Scored teacher-forced, this equals greedy generation through the cache: a greedy decoder emits
  the answer iff each of its steps, fed the answer so far, picks the next answer token, and those steps run
  exactly the positions this pass marks generated (the answer) and window (the last W prompt tokens);
* **documents**: text Python ships (standard-library documentation, not chat and not in any training split),
  an instruction after it, and the teacher's own greedy reply as the scored continuation.

A band or task with too few samples is reported with its count; nothing is extrapolated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from distill.data import pack, render_conversation
from distill.objective import token_agreement
from distill.served import replies, served_hidden, teacher_hidden
from toolkit.assets import iter_conversations

from . import prompt_heavy_data

BANDS = ((1024, 2048), (2048, 4096), (4096, 8192))
BOOTSTRAP = 1000


def band_name(band: tuple[int, int]) -> str:
    return f"{band[0]}-{band[1]}"


def band_samples(tokenizer, band: tuple[int, int], n: int, reply_tokens: int, data: str | Path = "sharegpt"):
    """Up to ``n`` samples (``input_ids``, ``counted``) of held-out replies whose prompt length lies in ``band``:
    the conversation cut after the first ``reply_tokens`` of its last reply in the band, only those counted."""
    lo, hi = band
    out = []
    for messages in iter_conversations(data, split="heldout"):
        if len(out) >= n:
            break
        if not any(m["role"] == "assistant" for m in messages):
            continue
        sample = render_conversation(messages, tokenizer)
        starts = [(s, e) for s, e in replies(sample["counted"]) if lo <= s < hi]
        if starts:
            start, end = starts[-1]
            end = min(end, start + reply_tokens)
            out.append({"input_ids": sample["input_ids"][:end], "counted": [0] * start + [1] * (end - start)})
    return out


def _rows(sample: dict, pad: int) -> dict[str, torch.Tensor]:
    return pack([sample], len(sample["input_ids"]), pad)


def _windows(students: dict) -> dict[str, int | None]:
    return {name: (m.config.exact_kv_window or None) for name, m in students.items()}


@torch.no_grad()
def score_samples(
    teacher, students: dict, samples: list[dict], pad: int, desc: str, windows: dict | None = None
) -> dict[str, np.ndarray]:
    """Per sample and student, served: [samples, 5] sums of (KL, top-1, tokens, student NLL, teacher NLL).
    ``windows``: name -> exact K/V window W to score at (default: each student's own)."""
    device = teacher.get_input_embeddings().weight.device
    layers = {m.config.num_key_value_layers for m in students.values()}
    windows = windows or _windows(students)
    out = {name: np.zeros((len(samples), 5)) for name in students}
    for i, sample in enumerate(tqdm(samples, desc=desc, unit="sample", leave=False)):
        rows = {k: v.to(device) for k, v in _rows(sample, pad).items()}
        ids, pos, loss = rows["input_ids"], rows["position_ids"], rows["loss_mask"].bool()
        final, lower = teacher_hidden(teacher, ids, pos, layers)
        for name, student in students.items():
            x_l = lower[student.config.num_key_value_layers]
            hidden = served_hidden(student, x_l, pos, loss, windows[name])
            out[name][i] = (
                token_agreement(hidden, final, student.lm_head, loss, input_ids=ids).sum(0).cpu().numpy()
            )
    return out


def summarize(sums: np.ndarray, seed: int = 0) -> dict[str, float]:
    """Token-weighted means of per-sample sums, with a bootstrap 95% interval of the KL over samples."""
    if not len(sums) or sums[:, 2].sum() == 0:
        return {"samples": 0, "tokens": 0}
    total = sums.sum(0)
    n = total[2]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(sums), size=(BOOTSTRAP, len(sums)))
    boot = sums[picks, 0].sum(1) / np.maximum(sums[picks, 2].sum(1), 1)
    return {
        "samples": len(sums),
        "tokens": int(n),
        "kl": total[0] / n,
        "kl_ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "top1_agreement": total[1] / n,
        "ppl_ratio": float(np.exp((total[3] - total[4]) / n)),
    }


@torch.no_grad()
def answer_correct(teacher, students: dict, prompt: list[int], answer: list[int]) -> dict[str, bool]:
    """Whether greedy decoding after ``prompt`` emits ``answer`` first, for the teacher and each student, as served:
    one teacher-forced pass with the answer marked generated (module docstring)."""
    device = teacher.get_input_embeddings().weight.device
    layers = {m.config.num_key_value_layers for m in students.values()}
    ids = torch.tensor([prompt + answer[:-1]], device=device)
    pos = torch.arange(ids.shape[1], device=device)[None]
    loss = torch.zeros_like(ids, dtype=torch.bool)
    loss[:, len(prompt) - 1 :] = True
    target = torch.tensor(answer, device=device)
    final, lower = teacher_hidden(teacher, ids, pos, layers)
    out = {"teacher": bool((teacher.get_output_embeddings()(final[loss]).argmax(-1) == target).all())}
    for name, student in students.items():
        x_l = lower[student.config.num_key_value_layers]
        hidden = served_hidden(student, x_l, pos, loss, student.config.exact_kv_window or None)
        out[name] = bool((student.lm_head(hidden[loss]).argmax(-1) == target).all())
    return out


def retrieval_accuracy(teacher, students: dict, tokenizer, tasks, lengths, n: int) -> dict:
    """Accuracy of the teacher and each student per task and prompt length (``answer_correct``):
    ``{task: {length: {"samples": n, "teacher": acc, name: acc, ...}}}``."""
    out: dict = {}
    for task in tasks:
        for length in lengths:
            correct = {"teacher": 0, **{name: 0 for name in students}}
            samples = prompt_heavy_data.retrieval_samples(tokenizer, task, length, n, seed=0)
            for sample in tqdm(samples, desc=f"retrieval {task} @{length}", unit="sample", leave=False):
                prompt = prompt_heavy_data.prompt_ids(tokenizer, sample)
                answer = prompt_heavy_data.answer_ids(tokenizer, sample)
                for name, ok in answer_correct(teacher, students, prompt, answer).items():
                    correct[name] += ok
            out.setdefault(task, {})[str(length)] = {
                "samples": len(samples),
                **{name: c / max(len(samples), 1) for name, c in correct.items()},
            }
    return out


@torch.no_grad()
def document_samples(
    teacher, tokenizer, n: int, min_tokens: int, max_tokens: int, reply_tokens: int
) -> list[dict]:
    """Document + instruction prompts with the teacher's own greedy reply (``generate()``, the original model) as
    the counted continuation."""
    device = teacher.get_input_embeddings().weight.device
    samples = []
    for doc in tqdm(
        prompt_heavy_data.document_prompts(tokenizer, n, min_tokens, max_tokens),
        desc="documents: teacher replies",
        unit="doc",
        leave=False,
    ):
        text = tokenizer.apply_chat_template(doc["messages"], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        if hasattr(teacher, "set_mode"):
            teacher.set_mode("teacher")
        ids = torch.tensor([prompt], device=device)
        reply = teacher.generate(ids, max_new_tokens=reply_tokens, do_sample=False)[0, len(prompt) :].tolist()
        if hasattr(teacher, "set_mode"):
            teacher.set_mode("student")
        samples.append({"input_ids": prompt + reply, "counted": [0] * len(prompt) + [1] * len(reply)})
    return samples


def prompt_heavy_settings(n: int, retrieval_lengths: list[int]) -> dict | None:
    """``prompt_heavy_metrics``' settings for ``swiftkv quality --prompt-heavy N`` (0: None, off)."""
    if n <= 0:
        return None
    return {
        "band_replies": n,
        "retrieval_lengths": retrieval_lengths,
        "retrieval_samples": max(1, n // 2),
        "documents": n,
    }


def prompt_heavy_metrics(
    teacher,
    students: dict,
    tokenizer,
    *,
    band_replies: int,
    reply_tokens: int = 64,
    bands=BANDS,
    retrieval_lengths=(1024, 2048, 4096),
    retrieval_samples: int = 8,
    tasks=prompt_heavy_data.TASKS,
    documents: int = 8,
    document_tokens: tuple[int, int] = (384, 1024),
    data: str | Path = "sharegpt",
) -> dict:
    """Every measurement of the module docstring for ``students`` (name -> SwiftKV model sharing ``teacher``'s
    weights): ``{"bands": {band: {name: summary}}, "retrieval": {task: {length: {...}}}, "documents": {name:
    summary}, "settings": {...}}``; bands, lengths and documents beyond the model's positions are left out."""
    max_positions = getattr(teacher.config, "max_position_embeddings", None) or 1 << 30
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: dict = {"bands": {}, "retrieval": {}, "documents": {}}
    for band in bands:
        fits = (band[0], min(band[1], max_positions - reply_tokens))
        samples = band_samples(tokenizer, fits, band_replies, reply_tokens, data) if fits[1] > fits[0] else []
        sums = score_samples(teacher, students, samples, pad, f"band {band_name(band)}")
        out["bands"][band_name(band)] = {name: summarize(s) for name, s in sums.items()}
    lengths = [n for n in retrieval_lengths if n + 16 <= max_positions]
    if retrieval_samples and lengths:
        out["retrieval"] = retrieval_accuracy(teacher, students, tokenizer, tasks, lengths, retrieval_samples)
    if documents:
        docs = document_samples(teacher, tokenizer, documents, *document_tokens, reply_tokens)
        sums = score_samples(teacher, students, docs, pad, "documents")
        out["documents"] = {name: summarize(s) for name, s in sums.items()}
    out["settings"] = {
        "band_replies": band_replies,
        "reply_tokens": reply_tokens,
        "retrieval_lengths": lengths,
        "retrieval_samples": retrieval_samples,
        "documents": documents,
        "document_tokens": list(document_tokens),
    }
    return out
