"""Which engine a ``--model`` string opens: the two implementations of :mod:`.backends`' protocol, imported only
when one is asked for (torch and transformers for the transformers one).  Kept apart from ``backends``, which
both implementations import, so that nothing imports back up."""

from __future__ import annotations

from .backends import Backend


def load_backend(model: str, *, tokenizer: str | None = None, dtype: str = "float32") -> Backend:
    """``http(s)://host:port/v1`` -> OpenAI-compatible client (``tokenizer`` = HF dir or hub id for the chat
    template, optional); anything else -> a transformers model directory."""
    if model.startswith(("http://", "https://")):
        from .http_backend import OpenAIBackend

        return OpenAIBackend(model, tokenizer=tokenizer)
    from .hf_backend import HFBackend

    return HFBackend.from_pretrained(model, dtype=dtype)
