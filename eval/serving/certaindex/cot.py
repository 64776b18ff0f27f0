"""Probe-in-the-middle early exit for one chain of thought (Dynasor-CoT).

The chain grows in chunks; after each chunk a side probe appends the paper's "I suddenly got the answer ...
\\boxed{" text to the chain so far and lets the model finish the box (at most 20 tokens, temperature 0.6,
top_p 0.95).  The probe never becomes part of the chain.  As in the reference client, the probe on the text
after chunk i runs beside chunk i + 1 (concurrently over HTTP; before it on the transformers backend, whose
probe needs the shared cache: same tokens either way), and the exit rule is checked when both are back, so an
exit keeps chunk i + 1.  Then a final answer block with the agreed answer is appended, closing the thinking
block first when the chain is still inside ``<think>`` (reasoning models' templates open one).  Chunk i of
the main chain uses seed ``seed + i`` whether or not probes run, and the transformers backend restores its
cache after each probe, so an early-exit chain is a prefix of the full-budget chain with the same seed: the
two differ only in where they stop.  Token accounting per request: main tokens, probe tokens (and probe input tokens), saved tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .answers import PROBE_SUFFIX, extract_final_answer, extract_probe_answer
from .backends import DEFAULT_SAMPLING, Backend, Sampling
from .certainty import Probe, should_exit

PROBE_SAMPLING = Sampling(temperature=0.6, top_p=0.95)
PROBE_MAX_TOKENS = 20
_PROBE_SEED_OFFSET = 1_000_003  # keeps probe seeds apart from the main chain's chunk seeds


def final_answer_block(answer: str, thinking: bool) -> str:
    """What an early exit appends (the reference client's text); ``thinking``: close the open ``<think>``."""
    head = "\n\n...</think>\n Oh," if thinking else "\n\n... Oh,"
    return f"{head} I have got the answer to the whole problem\n**Final Answer:**\n\\[\n \\boxed{{{answer}}}\n\\]"


def thinking_open(text: str) -> bool:
    """Whether ``text`` (prompt + chain) is inside a ``<think>`` block: the last tag is an opening one."""
    return text.rfind("<think>") > text.rfind("</think>")


@dataclass
class CotResult:
    """One request.  ``saved_tokens`` = budget - main - probe tokens when it exited early, else minus the
    probe tokens: an upper bound against the budget (the benchmark measures savings against a real run)."""

    answer: str
    text: str
    exited_early: bool
    finished: bool
    main_tokens: int
    probe_tokens: int
    probe_input_tokens: int
    saved_tokens: int
    probe_answers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def run_cot(
    backend: Backend,
    prompt: str,
    *,
    max_tokens: int = 1024,
    window: int = 3,
    chunk: int = 64,
    early_exit: bool = True,
    sampling: Sampling = DEFAULT_SAMPLING,
    probe_sampling: Sampling = PROBE_SAMPLING,
    probe_max_tokens: int = PROBE_MAX_TOKENS,
    choices: int = 0,
) -> CotResult:
    """Generate up to ``max_tokens`` in ``chunk``-token steps; with ``early_exit``, probe after each chunk
    and stop once the last ``window`` probes agree (see ``certainty.should_exit``)."""
    if chunk < 1 or max_tokens < 1:
        raise ValueError(
            f"chunk ({chunk}) and max_tokens ({max_tokens}) must be >= 1; to resolve, pass positive values"
        )
    session = backend.session(prompt)
    probes: list[Probe] = []
    main_tokens = probe_tokens = probe_input = 0
    finished = exited = False
    step = 0
    while main_tokens < max_tokens and not finished and not exited:
        pending = None
        if early_exit and step > 0:  # probe the text after chunk step - 1 while chunk step is generated
            seed = probe_sampling.seed + sampling.seed * 7919 + _PROBE_SEED_OFFSET + step - 1
            pending = session.start_probe(PROBE_SUFFIX, probe_max_tokens, replace(probe_sampling, seed=seed))
        part = session.extend(
            min(chunk, max_tokens - main_tokens), replace(sampling, seed=sampling.seed + step)
        )
        step += 1
        if pending is not None:
            reply = pending.result()
            probe_tokens += reply.tokens
            probe_input += reply.input_tokens
            probes.append(Probe(reply.text, extract_probe_answer(reply.text)))
            exited = should_exit(probes, window) and not part.finished  # a chain that ended keeps its own
        if part.tokens == 0:
            break
        main_tokens += part.tokens
        finished = part.finished
    text = session.text
    if exited:
        answer = probes[-1].answer
        text += final_answer_block(answer, thinking_open(prompt + text))
    else:
        answer = extract_final_answer(text, choices)
    saved = (max_tokens - main_tokens if exited else 0) - probe_tokens
    return CotResult(
        answer,
        text,
        exited,
        finished,
        main_tokens,
        probe_tokens,
        probe_input,
        saved,
        [p.answer for p in probes],
    )
