"""Where the embedded ShareGPT data lives and how to read it.

``scripts/fetch_assets.py sharegpt`` writes the complete conversations recovered from the PyPI wheel as JSONL
(``{"id", "conversations": [{"from": "human"|"gpt"|..., "value"}]}``).  Every room that needs real text
(distillation data, calibration, traces, suffix caches) resolves ``--data sharegpt`` through this module, so
the location and the conversation format are defined once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from swiftkv.artifacts import cache_dir

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def sharegpt_path() -> Path:
    return cache_dir() / "data" / "sharegpt.jsonl"


def resolve_data_path(data: str | os.PathLike) -> Path:
    """Map the name ``sharegpt`` to the fetched JSONL; check that any other path exists."""
    path = sharegpt_path() if str(data) == "sharegpt" else Path(data)
    if not path.is_file():
        hint = (
            "run `python scripts/fetch_assets.py sharegpt`" if str(data) == "sharegpt" else "check the path"
        )
        raise FileNotFoundError(f"data file {path} not found; to resolve, {hint}")
    return path


def to_messages(conversation: list[dict]) -> list[dict[str, str]]:
    """Convert ShareGPT turns (``from``/``value``) or OpenAI messages (``role``/``content``) to OpenAI messages.

    Unknown roles are dropped; the list is cut at the first turn that breaks user/assistant alternation.
    """
    messages: list[dict[str, str]] = []
    for turn in conversation:
        role = ROLE_MAP.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            continue
        if role == "system":
            if messages:
                continue
        elif messages and messages[-1]["role"] == role:
            break
        elif not messages and role == "assistant":
            continue
        messages.append({"role": role, "content": content})
    return messages


def iter_conversations(
    data: str | os.PathLike = "sharegpt", limit: int | None = None
) -> Iterator[list[dict[str, str]]]:
    """Yield conversations as OpenAI-style message lists (at least one user turn), in file order."""
    n = 0
    with open(resolve_data_path(data)) as f:
        for line in f:
            if limit is not None and n >= limit:
                return
            record = json.loads(line)
            messages = to_messages(record.get("conversations") or record.get("messages") or [])
            if any(m["role"] == "user" and m["content"].strip() for m in messages):
                n += 1
                yield messages


def iter_prompts(data: str | os.PathLike = "sharegpt", limit: int | None = None) -> Iterator[str]:
    """Yield the first user turn of each conversation (the usual serving-benchmark prompt)."""
    for messages in iter_conversations(data, limit):
        first = next(m["content"] for m in messages if m["role"] == "user")
        if first.strip():
            yield first
