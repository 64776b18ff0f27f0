"""Recorded reply lengths: ShareGPT's own assistant replies as ranking labels, counted as vLLM's benchmark does.

vLLM's ``bench serve --dataset-name sharegpt`` takes ``conversations[0]`` as the prompt and
``conversations[1]`` as the completion of every conversation with at least two turns, counts both in the
served model's tokenizer (``tokenizer(text).input_ids``, special tokens as the tokenizer adds them) and keeps
a pair when both have at least 4 tokens, the prompt at most 1,024 and the two together at most 2,048
(``is_valid_sequence``).  The output length it requests is the completion's length.  These labels are the
same numbers, written as traces (``prompt``, ``prompt_len``, ``output_len``) that :mod:`.train` reads.

Each prompt is kept once across the whole file, whatever the split asked for (:func:`unique_pairs`): two prompts
that differ only in whitespace are the same prompt, and it belongs to the split of its first record.  The
embedded file repeats many prompts (200 of the 2,209 held-out pairs once also stood, verbatim, among the train
records), so a per-split deduplication would score a ranker on prompts it was trained on.

``records`` picks the embedded file's split (:mod:`toolkit.assets`): ``train`` for rankers, ``heldout`` for
the benchmark prompts; :func:`write_sharegpt_json` writes the chosen pairs in the ShareGPT JSON layout that
vLLM's client reads (``--dataset-path``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from toolkit.artifacts import write_json_atomic

from .traces import META_FILE, TRACES_FILE, prompt_key

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048  # vllm.benchmarks.datasets.is_valid_sequence


def _indexed_pairs(data: str | os.PathLike) -> Iterator[tuple[int, str, str]]:
    """(record index, first turn, second turn) of each record with two turns, as vLLM reads them (roles not
    checked)."""
    from toolkit.assets import resolve_data_path

    with open(resolve_data_path(data)) as f:
        for i, line in enumerate(f):
            turns = json.loads(line).get("conversations") or []
            if len(turns) >= 2 and isinstance(turns[0], dict) and isinstance(turns[1], dict):
                prompt, reply = turns[0].get("value"), turns[1].get("value")
                if isinstance(prompt, str) and isinstance(reply, str):
                    yield i, prompt, reply


def unique_pairs(data: str | os.PathLike = "sharegpt", records: str = "all") -> list[tuple[str, str]]:
    """The pairs of ``records`` whose prompt (:func:`prompt_key`) no earlier record of the file has, in any
    split: deduplicated across the splits before they are taken apart, so no held-out prompt is a train one."""
    from toolkit.assets import split_range

    span = split_range(data, records)  # type: ignore[arg-type]
    seen: set[str] = set()
    pairs = []
    for i, prompt, reply in _indexed_pairs(data):
        key = prompt_key(prompt)
        if key not in seen:
            seen.add(key)
            if i in span:
                pairs.append((prompt, reply))
    return pairs


def sharegpt_lengths(
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    data: str | os.PathLike = "sharegpt",
    records: str = "train",
    limit: int | None = None,
) -> Path:
    """Write the traces of recorded reply lengths under ``tokenizer_dir``'s tokenizer; return the JSONL."""
    from transformers import AutoTokenizer

    if records not in ("all", "train", "heldout"):
        raise ValueError(f"records={records!r}; to resolve, pass all, train or heldout")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pairs = unique_pairs(data, records)
    kept = []
    for start in range(0, len(pairs), 512):
        chunk = pairs[start : start + 512]
        prompt_ids = tokenizer([p for p, _ in chunk]).input_ids
        reply_ids = tokenizer([r for _, r in chunk]).input_ids
        for (prompt, _), p, r in zip(chunk, prompt_ids, reply_ids, strict=True):
            if (
                len(p) >= MIN_LEN
                and len(r) >= MIN_LEN
                and len(p) <= MAX_PROMPT_LEN
                and len(p) + len(r) <= MAX_TOTAL_LEN
            ):
                kept.append({"prompt": prompt, "prompt_len": len(p), "output_len": len(r), "finished": True})
        if limit is not None and len(kept) >= limit:
            kept = kept[:limit]
            break
    if not kept:
        raise ValueError(
            f"no ShareGPT pair of {data} ({records}) passes vLLM's length filter; check the data"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    file = out_dir / TRACES_FILE
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(k) + "\n" for k in kept))
    os.replace(tmp, file)
    write_json_atomic(
        out_dir / META_FILE,
        {
            "model": str(Path(tokenizer_dir).resolve()),
            "data": str(data),
            "source": "sharegpt-recorded",
            "records": records,
            "max_new_tokens": MAX_TOTAL_LEN - MIN_LEN,
            "filter": {"min_len": MIN_LEN, "max_prompt_len": MAX_PROMPT_LEN, "max_total_len": MAX_TOTAL_LEN},
            "deduplicated": "prompts unique across every split of the file (whitespace-normalized)",
        },
    )
    return file


def write_sharegpt_json(pairs: list[tuple[str, str]], path: str | os.PathLike) -> Path:
    """(prompt, reply) pairs as the ShareGPT JSON that vLLM's client reads with ``--dataset-path``."""
    path = Path(path)
    rows = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
        for i, (p, r) in enumerate(pairs)
    ]
    path.write_text(json.dumps(rows))
    return path
