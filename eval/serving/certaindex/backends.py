"""What Certaindex needs from an inference engine (which one a ``--model`` string opens: :mod:`.engines`).

A backend opens a *session* on a prompt: ``extend`` grows the main chain of thought by one chunk,
``start_probe`` asks a side question about the text so far without changing it (an HTTP engine returns while
the probe is in flight, so it runs beside the next chunk; transformers runs it first, on the shared cache), and ``sample`` draws independent full
completions for self-consistency.  Every call reports the tokens it generated and the input tokens it had to
process, so callers can account main, probe and saved tokens per request.  Two engines implement it:
transformers (``hf_backend``, probes reuse the session's KV cache) and any OpenAI-compatible completions
endpoint such as vLLM (``http_backend``).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Sampling:
    """Decoding settings of one call; temperature 0 means greedy."""

    temperature: float = 0.6
    top_p: float = 0.95
    seed: int = 0


DEFAULT_SAMPLING = Sampling()


@dataclass(frozen=True)
class Completion:
    """Result of one generation call.

    ``tokens`` are generated tokens; ``input_tokens`` are the tokens the engine processed as input for this
    call (for transformers only the uncached ones, for HTTP what the server reports); ``finished`` is true
    when generation stopped at an end-of-sequence token rather than at the length limit.
    """

    text: str
    tokens: int
    input_tokens: int
    finished: bool


class Session(Protocol):
    """One growing chain of thought."""

    text: str

    def extend(self, max_tokens: int, sampling: Sampling) -> Completion: ...

    def start_probe(self, suffix: str, max_tokens: int, sampling: Sampling) -> Future[Completion]: ...


class Backend(Protocol):
    """An engine: opens sessions and draws independent samples.  ``chat_format`` renders a question as the
    engine's prompt text (the chat template when a tokenizer is known)."""

    def chat_format(self, question: str) -> str: ...

    def session(self, prompt: str) -> Session: ...

    def sample(self, prompt: str, n: int, max_tokens: int, sampling: Sampling) -> list[Completion]: ...


def render_chat(tokenizer, question: str) -> str:
    """The question as one user turn plus the assistant header, or the bare question without a template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return question + "\n"
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
