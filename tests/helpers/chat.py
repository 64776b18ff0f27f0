"""Chats without an asset: a tiny random chat checkpoint laid out as a Hub download is (weights, config, a
byte-level tokenizer with a ChatML template, ``toolkit.tokenizer``: any text tokenizes; a card with licence metadata and licence
files), a word-level tokenizer, and short ShareGPT-format conversations."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers.models import tiny_base
from toolkit.tokenizer import VOCAB, byte_tokenizer

CARD = """---
license: llama3.1
base_model: meta-llama/Llama-3.1-8B
---
# Tiny-Instruct

The base model's own card, which a derivative must not copy.
"""
LICENCES = {"LICENSE": "TINY COMMUNITY LICENSE\n", "USE_POLICY.md": "# Acceptable use\n"}


def save_chat_model(path: Path, family: str = "llama", card: bool = True, **overrides) -> Path:
    """Write a tiny random ``family`` chat model with tokenizer (and, with ``card``, a card and licences)."""
    model = tiny_base(
        family, vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.2, **overrides
    )
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    if card:
        (path / "README.md").write_text(CARD)
        for name, text in LICENCES.items():
            (path / name).write_text(text)
    return path


def word_tokenizer(words: int = 128, offset: int = 0) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over "w3".."w{words-1}" (ids shifted by ``offset``), with a plain chat template."""
    vocab = {
        "[UNK]": 0,
        "<eos>": 1,
        "<bos>": 2,
        **{f"w{i}": (i + offset - 3) % (words - 3) + 3 for i in range(3, words)},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]", bos_token="<bos>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def conversations(n: int) -> list[dict]:
    """``n`` short ShareGPT-format chats (two turns each) that differ by their numbers."""
    return [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                {"from": "gpt", "value": f"The answer is {2 * i}. " * (1 + i % 3)},
                {"from": "human", "value": "Thanks! And times two?"},
                {"from": "gpt", "value": f"That would be {4 * i}."},
            ]
        }
        for i in range(n)
    ]


CONVERSATIONS = conversations(40)
