"""(prompt, generated length) traces from the target model: the labels every ranking predictor learns.

The target model samples a reply (temperature 1.0, a length cap) to the first user turn of each
conversation; only the length is kept.  A reply ends at the first end-of-turn id, any of those in
``generation_config`` (Llama-3 lists several), not only ``config.eos_token_id``.  Generation is the slow part, so the JSONL grows one line per
prompt and a rerun resumes after the last complete line (a torn last line from a crash is dropped).
``meta.json`` pins the options; resuming with different options is refused.  Existing traces from
elsewhere load through :func:`load_traces` as long as each line has ``prompt`` and ``output_len``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.artifacts import write_json_atomic

log = logging.getLogger(__name__)

TRACES_FILE = "traces.jsonl"
META_FILE = "meta.json"


@dataclass(frozen=True)
class Trace:
    """One request: the prompt text, its token count under the target tokenizer, and the reply length."""

    prompt: str
    output_len: int
    prompt_len: int = 0
    finished: bool = True


def traces_file(path: str | os.PathLike) -> Path:
    """Accept a traces directory or a JSONL file directly."""
    path = Path(path)
    file = path / TRACES_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"no traces at {file}; to resolve, run `swiftkv ranking traces MODEL {path}` "
            "or pass a JSONL with `prompt` and `output_len` per line"
        )
    return file


def load_traces(path: str | os.PathLike) -> list[Trace]:
    """Read every complete trace line (ignoring a torn last line)."""
    file = traces_file(path)
    traces = []
    for lineno, line in enumerate(file.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.info("skipping incomplete line %d of %s", lineno, file)
            continue
        if "prompt" not in record or "output_len" not in record:
            raise ValueError(
                f"{file}:{lineno} lacks `prompt` or `output_len`; to resolve, regenerate the traces"
            )
        traces.append(
            Trace(
                str(record["prompt"]),
                int(record["output_len"]),
                int(record.get("prompt_len", 0)),
                bool(record.get("finished", True)),
            )
        )
    return traces


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The generation options of a traces directory ({} for a bare JSONL)."""
    meta = traces_file(path).parent / META_FILE
    return json.loads(meta.read_text()) if meta.is_file() else {}


def prompt_key(prompt: str) -> str:
    """A prompt's identity for deduplication: whitespace runs collapsed to one space, the ends stripped."""
    return " ".join(prompt.split())


def prompt_digest(prompt: str) -> str:
    """A short digest of :func:`prompt_key`: what a ranker records of the prompts it was trained on."""
    import hashlib

    return hashlib.sha256(prompt_key(prompt).encode()).hexdigest()[:16]


def split_traces(
    traces: list[Trace], held_out: float = 0.2, seed: int = 0
) -> tuple[list[Trace], list[Trace]]:
    """A deterministic shuffle split into (train, held-out); every stage uses the same one.

    The shuffle is over distinct prompts (:func:`prompt_key`): traces of one prompt (a repeat, or several
    replies sampled to it) fall on the same side, so no held-out prompt is a training one.  Traces without
    repeats split as a shuffle of the traces.  ``held_out=0`` trains on every trace (the held-out part is
    empty): for a ranker that is evaluated on other traces, e.g. trained on ShareGPT's train records and scored
    on its held-out records."""
    import numpy as np

    if not 0.0 <= held_out < 1.0:
        raise ValueError(f"held_out={held_out} must be in [0, 1); to resolve, pass e.g. 0.2")
    group: dict[str, int] = {}
    of = np.array([group.setdefault(prompt_key(t.prompt), len(group)) for t in traces], np.int64)
    order = np.random.default_rng(seed).permutation(len(group))
    n_test = max(1, round(len(group) * held_out)) if held_out else 0
    test = np.zeros(len(group), bool)
    test[order[:n_test]] = True
    rank = np.empty(len(group), np.int64)
    rank[order] = np.arange(len(group))
    by_shuffle = np.argsort(rank[of], kind="stable")  # the groups' shuffled order, a group's traces together
    return [traces[i] for i in by_shuffle if not test[of[i]]], [traces[i] for i in by_shuffle if test[of[i]]]


def _valid_lines(file: Path) -> list[str]:
    """Complete lines of a partially written JSONL; truncate the file to them."""
    if not file.is_file():
        return []
    lines = []
    for line in file.read_text().splitlines():
        try:
            json.loads(line)
        except json.JSONDecodeError:
            break
        lines.append(line)
    file.write_text("".join(f"{line}\n" for line in lines))
    return lines


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """Every id that ends a reply: ``generation_config.eos_token_id`` (a list for Llama-3, whose turns end
    with 128009), the config's and the tokenizer's ``eos_token_id``."""
    ids: set[int] = set()
    for value in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if not ids:
        raise ValueError(
            "the model names no end-of-sequence token; to resolve, set eos_token_id in its config"
        )
    return sorted(ids)


def generate_traces(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    data: str | os.PathLike = "sharegpt",
    n: int = 2000,
    max_new_tokens: int = 512,
    max_prompt_tokens: int = 512,
    batch_size: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Sample replies to the first ``n`` prompts that fit ``max_prompt_tokens``; append lengths to the JSONL.

    Returns the traces file.  Runs again with the same options continue where the last run stopped.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.assets import iter_prompts

    if n < 1 or max_new_tokens < 1 or batch_size < 1 or temperature <= 0:
        raise ValueError(
            "n, max_new_tokens, batch_size and temperature must be positive; to resolve, fix the options"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": str(Path(model_dir).resolve()),
        "data": str(data),
        "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens,
        "temperature": temperature,
        "seed": seed,
        "dtype": dtype,
    }
    meta_path = out_dir / META_FILE
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if old != meta:
            diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
            raise ValueError(
                f"{out_dir} holds traces made with other options {diff}; to resolve, use a new directory"
            )
    else:
        write_json_atomic(meta_path, meta)
    file = out_dir / TRACES_FILE
    done = len(_valid_lines(file))
    if done >= n:
        return file

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    eos = end_of_turn_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]

    def encode(prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    prompts = (
        (p, ids) for p in iter_prompts(data, split="train") if len(ids := encode(p)) <= max_prompt_tokens
    )
    for _ in range(done):  # the same prompt stream every run: skip what is already on disk
        next(prompts)
    bar = tqdm(total=n, initial=done, desc="traces", unit="prompt")
    with open(file, "a") as f:
        while done < n:
            batch = [x for _, x in zip(range(min(batch_size, n - done)), prompts, strict=False)]
            if not batch:
                log.info("data %s ran out after %d prompts", data, done)
                break
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
            torch.manual_seed(seed + done)  # batch-level seed: a resumed run samples what a fresh one would
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad,
                    eos_token_id=eos,
                )
            for (prompt, ids), row in zip(batch, out[:, width:].tolist(), strict=True):
                ends = [i for i, token in enumerate(row) if token in eos]
                finished = bool(ends)
                length = ends[0] + 1 if finished else len(row)
                record = {
                    "prompt": prompt,
                    "prompt_len": len(ids),
                    "output_len": length,
                    "finished": finished,
                }
                f.write(json.dumps(record) + "\n")
            f.flush()
            done += len(batch)
            bar.update(len(batch))
    bar.close()
    return file
