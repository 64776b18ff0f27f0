"""The three user-facing stages as functions: build a cache from data, generate with it, export for vLLM.

Responses for the global tree come from a ShareGPT-style file (assistant turns, resolved through
``toolkit.assets``) or from a JSONL of teacher generations (``response``/``output``/``completion``/``text``
field, or a message list).  Each response is tokenized without special tokens and closed with the EOS token,
as the model would emit it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .artifact import load_cache, read_meta, save_cache, vllm_speculative_config
from .cache import SpecConfig, SuffixCache

log = logging.getLogger(__name__)
TEXT_FIELDS = ("response", "output", "completion", "text")


def iter_responses(
    data: str | os.PathLike = "sharegpt", limit: int | None = None, skip: int = 0
) -> Iterator[str]:
    """Assistant texts of conversations ``skip .. skip+limit`` of a ShareGPT-style file (embedded: train split)."""
    from toolkit.assets import iter_conversations

    limit = None if limit is None else skip + limit
    for i, messages in enumerate(iter_conversations(data, limit, split="train")):
        if i >= skip:
            yield from (m["content"] for m in messages if m["role"] == "assistant" and m["content"].strip())


def iter_generations(path: str | os.PathLike, limit: int | None = None) -> Iterator[str]:
    """Response texts of a teacher-generations JSONL (one record a line)."""
    from toolkit.assets import resolve_data_path, to_messages

    with open(resolve_data_path(path)) as f:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                return
            record = json.loads(line)
            text = next((record[k] for k in TEXT_FIELDS if isinstance(record.get(k), str)), None)
            if text is not None:
                yield text
                continue
            turns = record.get("messages") or record.get("conversations")
            if not turns:
                raise ValueError(
                    f"{path} line {n + 1} has none of {TEXT_FIELDS} nor messages; to resolve, add a 'response' field"
                )
            yield from (m["content"] for m in to_messages(turns) if m["role"] == "assistant")


def build(
    out: str | os.PathLike,
    model: str | os.PathLike,
    data: str = "sharegpt",
    responses_from: str | os.PathLike | None = None,
    limit: int | None = 2000,
    config: SpecConfig | None = None,
    force: bool = False,
) -> Path:
    """Build a global suffix tree from responses and save it (complete or absent) at ``out``."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    config = config or SpecConfig()
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = list(iter_generations(responses_from, limit) if responses_from else iter_responses(data, limit))
    if not texts:
        raise ValueError(
            f"no responses found in {responses_from or data}; to resolve, check the file's fields"
        )
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    cache = SuffixCache(config)
    start = time.perf_counter()
    for ids in tqdm(tokenizer(texts, add_special_tokens=False)["input_ids"], desc="suffix tree", unit="resp"):
        cache.add_response(ids + eos)
    log.info("built %d responses in %.1fs", cache.num_responses, time.perf_counter() - start)
    source = {"responses_from": str(responses_from)} if responses_from else {"data": str(data)}
    return save_cache(cache, out, tokenizer, force, model=str(model), limit=limit, **source)


def read_prompts(path: str | os.PathLike, tokenizer) -> list[list[int]]:
    """Prompt token ids from JSONL: ``{"prompt": str}`` (wrapped in the chat template) or ``{"messages": [...]}``."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f):
            record = json.loads(line)
            if "messages" in record:
                messages = record["messages"]
            elif isinstance(record.get("prompt"), str):
                messages = [{"role": "user", "content": record["prompt"]}]
            else:
                raise ValueError(f"{path} line {n + 1} needs 'prompt' or 'messages'; to resolve, add one")
            prompts.append(chat_ids(tokenizer, messages))
    return prompts


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the assistant's turn."""
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def generate(
    model: str | os.PathLike,
    prompts: str | os.PathLike,
    cache: str | os.PathLike | None = None,
    max_new_tokens: int = 256,
    config: SpecConfig | None = None,
) -> Iterator[dict[str, Any]]:
    """Speculative greedy generation for each prompt; yields one result record per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .decode import speculative_generate

    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    suffix_cache = load_cache(cache, tokenizer, config) if cache else SuffixCache(config)
    for i, ids in enumerate(read_prompts(prompts, tokenizer)):
        start = time.perf_counter()
        stats = speculative_generate(lm, ids, max_new_tokens, suffix_cache, request_id=i)
        seconds = time.perf_counter() - start
        yield {
            "index": i,
            "text": tokenizer.decode(stats.tokens, skip_special_tokens=True),
            "new_tokens": len(stats.tokens),
            "tokens_per_step": round(stats.tokens_per_step, 3),
            "tokens_per_s": round(len(stats.tokens) / seconds, 2),
        }


def export_vllm(cache: str | os.PathLike) -> dict[str, Any]:
    """The vLLM ``speculative_config`` matching a built cache's settings."""
    return vllm_speculative_config(SpecConfig(**read_meta(cache)["config"]))
