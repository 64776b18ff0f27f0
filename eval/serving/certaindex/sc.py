"""Certaindex-adaptive self-consistency and threshold calibration.

Samples are drawn in rounds of ``step`` (round r uses seed ``seed + r * step``); after each round the
certaindex of all answers so far decides whether to stop (certaindex >= threshold, at least ``min_samples``
answers) or to draw another round, up to ``max_samples``.  The final answer is the majority cluster.
Because the rounds and seeds do not depend on the threshold, an adaptive run is a prefix of the full-budget
run: ``replay`` turns one full-budget record into the result for any threshold, which is how ``calibrate``
scores a whole grid of thresholds on a dev split from a single generation pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

from .answers import answers_equal, extract_final_answer
from .backends import DEFAULT_SAMPLING, Backend, Sampling
from .certainty import certaindex, majority


@dataclass
class ScResult:
    """One request: per-sample answers and token counts in draw order, certaindex after each round."""

    answer: str
    answers: list[str]
    sample_tokens: list[int]
    certaindex: list[float]
    stopped_early: bool

    @property
    def tokens(self) -> int:
        return sum(self.sample_tokens)

    def to_dict(self) -> dict:
        return {**asdict(self), "samples": len(self.answers), "tokens": self.tokens}

    @classmethod
    def from_dict(cls, record: dict) -> ScResult:
        """Inverse of ``to_dict`` (extra keys of a stored record are ignored)."""
        return cls(**{f.name: record[f.name] for f in fields(cls)})


def _stops(answers: Sequence[str], threshold: float | None, min_samples: int) -> tuple[bool, float]:
    index = certaindex(answers)
    return threshold is not None and len(answers) >= min_samples and index >= threshold, index


def run_sc(
    backend: Backend,
    prompt: str,
    *,
    max_samples: int = 16,
    step: int = 4,
    threshold: float | None = 0.8,
    min_samples: int = 2,
    max_tokens: int = 512,
    sampling: Sampling = DEFAULT_SAMPLING,
    choices: int = 0,
) -> ScResult:
    """Self-consistency with certaindex early stop; ``threshold=None`` always draws ``max_samples``."""
    if max_samples < 1 or step < 1:
        raise ValueError(
            f"max_samples ({max_samples}) and step ({step}) must be >= 1; to resolve, pass positive values"
        )
    answers: list[str] = []
    tokens: list[int] = []
    trace: list[float] = []
    stop = False
    while len(answers) < max_samples and not stop:
        k = min(step, max_samples - len(answers))
        for c in backend.sample(prompt, k, max_tokens, replace(sampling, seed=sampling.seed + len(answers))):
            answers.append(extract_final_answer(c.text, choices))
            tokens.append(c.tokens)
        stop, index = _stops(answers, threshold, min_samples)
        trace.append(index)
    return ScResult(majority(answers), answers, tokens, trace, stop and len(answers) < max_samples)


def replay(full: ScResult, step: int, threshold: float | None, min_samples: int = 2) -> ScResult:
    """The result ``run_sc`` would return with ``threshold`` given the full-budget run ``full`` (same seeds)."""
    trace: list[float] = []
    n = 0
    while n < len(full.answers):
        n = min(n + step, len(full.answers))
        stop, index = _stops(full.answers[:n], threshold, min_samples)
        trace.append(index)
        if stop:
            break
    answers = full.answers[:n]
    return ScResult(majority(answers), answers, full.sample_tokens[:n], trace, n < len(full.answers))


THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(21))
"""Grid that ``calibrate`` scores by default: 0, 0.05, ..., 1."""


@dataclass(frozen=True)
class Operating:
    """Accuracy and mean tokens of one threshold over a dev split (``threshold`` None = full budget)."""

    threshold: float | None
    accuracy: float
    mean_tokens: float


def calibrate(
    runs: Sequence[ScResult],
    references: Sequence[str],
    step: int,
    thresholds: Sequence[float] = THRESHOLDS,
    target_accuracy: float | None = None,
    tolerance: float = 0.01,
    min_samples: int = 2,
) -> tuple[Operating, list[Operating]]:
    """Pick the threshold with the fewest mean tokens whose dev accuracy is >= ``target_accuracy`` (default:
    full-budget accuracy - ``tolerance``); returns it and every operating point (full budget first)."""
    if len(runs) != len(references) or not runs:
        raise ValueError(
            f"calibrate needs one reference per run, got {len(runs)} runs and {len(references)} references"
        )

    def score(threshold: float | None) -> Operating:
        results = [replay(r, step, threshold, min_samples) for r in runs]
        correct = sum(answers_equal(r.answer, ref) for r, ref in zip(results, references, strict=True))
        return Operating(threshold, correct / len(runs), sum(r.tokens for r in results) / len(runs))

    points = [score(None)] + [score(t) for t in sorted(thresholds)]
    target = points[0].accuracy - tolerance if target_accuracy is None else target_accuracy
    feasible = [p for p in points if p.accuracy >= target - 1e-12]
    best = min(feasible, key=lambda p: (p.mean_tokens, -(p.threshold or 2.0))) if feasible else points[0]
    return best, points
