"""A byte-level chat tokenizer built offline, for tiny random checkpoints that need one (the GPU check's
``swiftkv quality`` step, the tests): one token per byte, so any text tokenizes, with the ChatML specials and
template.  Nothing to download, so it works without network and without a checkout.

tokenizers and transformers are imported when a tokenizer is built, not when this module is (``toolkit``
imports no heavy library at import time).
"""

from __future__ import annotations

SPECIALS = ["<pad>", "<|im_end|>", "<|im_start|>"]  # ids 0, 1, 2: pad, eos and bos
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = len(SPECIALS) + 256


def byte_tokenizer():
    """A byte-level BPE without merges (a ``PreTrainedTokenizerFast``): one token per byte, the ChatML specials
    and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML
    return fast
