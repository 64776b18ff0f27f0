"""Output-length ranking data without an asset: prompts whose words decide the reply length, the word-level
tokenizer they are written in, a ShareGPT file of them with every edge case of the length recorder, and a
ranker trained by the real training function."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = [
    "short",
    "long",
    "tell",
    "me",
    "about",
    "cats",
    "dogs",
    "code",
    "please",
    "now",
    "why",
    "how",
    "essay",
]


def synthetic_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Prompts whose words decide the reply length: `essay` asks for ~300 words, `short` for ~8."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        kind = rng.choice(["short", "essay", "how"])
        filler = " ".join(rng.choice(WORDS[2:12], rng.integers(4, 30)))
        words = {"short": 8, "essay": 300, "how": 60}[kind] * rng.uniform(0.7, 1.3)
        prompt = f"{kind} {filler} {i}" if kind != "how" else f"{filler} how {i}"
        pairs.append((prompt, " ".join(["me"] * int(words))))
    return pairs


def save_word_tokenizer(path: Path) -> Path:
    """A word-level tokenizer over ``WORDS`` saved in ``path`` (no model: the ngram ranker needs only the served
    model's tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<eos>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    ).save_pretrained(path)
    return path


def write_sharegpt(path: Path, seed: int = 0) -> Path:
    """A ShareGPT file of 400 ``synthetic_pairs`` and a row at each edge of the length recorder's filters: a
    duplicate prompt, a tiny prompt or reply, a prompt or a total past the length limit, a single turn."""
    rows = [
        {"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
        for i, (p, r) in enumerate(synthetic_pairs(400, seed))
    ]
    rows += [
        {
            "id": "dup",
            "conversations": [
                {"from": "human", "value": rows[0]["conversations"][0]["value"]},
                {"from": "gpt", "value": "me me me me me"},
            ],
        },
        {
            "id": "tiny-prompt",
            "conversations": [{"from": "human", "value": "why"}, {"from": "gpt", "value": "me me me me"}],
        },
        {
            "id": "tiny-reply",
            "conversations": [
                {"from": "human", "value": "tell me about cats"},
                {"from": "gpt", "value": "me"},
            ],
        },
        {
            "id": "long-prompt",
            "conversations": [
                {"from": "human", "value": "cats " * 1025},
                {"from": "gpt", "value": "me me me me"},
            ],
        },
        {
            "id": "long-total",
            "conversations": [
                {"from": "human", "value": "dogs " * 1000},
                {"from": "gpt", "value": "me " * 1049},
            ],
        },
        {"id": "one-turn", "conversations": [{"from": "human", "value": "tell me about dogs"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained_ranker(model_dir: Path, out: Path) -> Path:
    """A swiftkv-head ranker trained by the real training function on ``model_dir``'s x_l (prompts of "w3".."w92",
    the words of ``helpers.chat.word_tokenizer``)."""
    from eval.serving.ranking.train import TrainConfig, train_ranker

    traces = out.with_name(out.name + "-traces")
    traces.mkdir()
    rows = [{"prompt": " ".join(f"w{3 + (i * 7 + j) % 90}" for j in range(3 + i % 5)), "output_len": 5 + 9 * (i % 5)}
            for i in range(24)]  # fmt: skip
    (traces / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (traces / "meta.json").write_text(json.dumps({"model": str(model_dir), "max_new_tokens": 64}))
    config = TrainConfig(epochs=2, list_size=4, head_hidden=8, max_prompt_tokens=16, label_bin=4)
    return train_ranker(traces, out, config)
