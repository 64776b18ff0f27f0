"""Certaindex: when is a reasoning request certain enough to stop?

Two signals from the Dynasor paper.  For one chain of thought, the probe-in-the-middle exit rule: stop when
the last W probe answers are all non-empty, all mutually equal, and none of the probe outputs hesitates.
Every one of those three conditions must hold (the public reference has an exit check that always passes;
``tests/eval/serving/certaindex/test_early_exit.py`` feeds sequences that fail each condition alone).  For n sampled answers,
certaindex = (log n - H) / log n, with H the entropy of the answer clusters: 1 when all agree, 0 when all
differ.  Empty answers never agree with anything, so failed extractions count as maximal disagreement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .answers import answers_equal, is_hesitant

# (window W, chunk tokens) per preset, as in the paper and its reference client.
PRESETS: dict[str, tuple[int, int]] = {
    "mild": (8, 64),
    "low": (5, 64),
    "mid": (3, 64),
    "high": (2, 64),
    "crazy": (2, 32),
}


def preset(name: str) -> tuple[int, int]:
    """(W, chunk) of a named preset; an unknown name lists the valid ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; to resolve, use one of {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class Probe:
    """One side probe: the raw completion after the probe suffix and the answer extracted from it."""

    text: str
    answer: str

    @property
    def certain(self) -> bool:
        return bool(self.answer) and not is_hesitant(self.text)


def should_exit(probes: Sequence[Probe], window: int) -> bool:
    """True iff the last ``window`` probes exist, are each non-empty and non-hesitant, and agree."""
    if window < 1:
        raise ValueError(f"exit window must be >= 1, got {window}; to resolve, pass a positive --window")
    if len(probes) < window:
        return False
    last = probes[-window:]
    if not all(p.certain for p in last):
        return False
    return all(answers_equal(last[0].answer, p.answer) for p in last[1:])


def cluster(answers: Sequence[str]) -> list[list[int]]:
    """Group answer indices into equality classes (first member is the representative); each empty answer
    is a class of its own."""
    classes: list[list[int]] = []
    for i, answer in enumerate(answers):
        for members in classes:
            if answers_equal(answers[members[0]], answer):
                members.append(i)
                break
        else:
            classes.append([i])
    return classes


def certaindex(answers: Sequence[str]) -> float:
    """(log n - H) / log n over the answer clusters, in [0, 1]; 0 for fewer than two answers (no evidence)."""
    n = len(answers)
    if n < 2:
        return 0.0
    entropy = -sum(len(c) / n * math.log(len(c) / n) for c in cluster(answers))
    return max(0.0, min(1.0, (math.log(n) - entropy) / math.log(n)))


def majority(answers: Sequence[str]) -> str:
    """Representative of the largest non-empty cluster (earliest on ties); ``""`` if every answer is empty."""
    classes = [c for c in cluster(answers) if answers[c[0]]]
    return answers[max(classes, key=len)[0]] if classes else ""
