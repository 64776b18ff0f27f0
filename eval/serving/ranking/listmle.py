"""Labels, the ListMLE loss and Kendall's tau: the learning-to-rank objective of the ranking predictor.

Scores follow one convention everywhere: higher score = shorter expected output, so a scheduler serves
requests in descending score.  Labels follow the paper: ``cap//bin - min(cap, len)//bin`` (the paper uses
cap 8192, bin 10), so ties inside a 10-token bin carry no ranking signal.  ListMLE treats each
mini-batch as one list: the negative log Plackett-Luce probability of the label order, with ties put
in a random order each time (as allRank does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def length_labels(lengths: Sequence[int] | np.ndarray, cap: int, bin: int = 10) -> np.ndarray:
    """Paper labels: higher = shorter; lengths above ``cap`` are all the lowest label."""
    if cap < 1 or bin < 1:
        raise ValueError(
            f"label cap={cap} and bin={bin} must be positive; to resolve, pass e.g. --label-bin 10"
        )
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), cap)
    return (cap // bin - lengths // bin).astype(np.float32)


def listmle_loss(
    scores: torch.Tensor, labels: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """-log P(label order | scores) under Plackett-Luce, for one list of shape (n,); ties shuffled.

    P(pi) = prod_i exp(s_pi(i)) / sum_{j >= i} exp(s_pi(j)) with pi sorting labels descending.
    """
    if scores.shape != labels.shape or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} must be equal 1-d lists"
        )
    shuffle = torch.randperm(len(labels), generator=generator, device=labels.device)
    order = shuffle[torch.argsort(labels[shuffle], descending=True, stable=True)]
    s = scores[order]
    tail_logsumexp = torch.logcumsumexp(s.flip(0), dim=0).flip(0)
    return (tail_logsumexp - s).sum()


def kendall_tau(scores: Sequence[float] | np.ndarray, labels: Sequence[float] | np.ndarray) -> float:
    """Kendall's tau-b between predicted scores and labels (1 = same order, ties handled)."""
    from scipy.stats import kendalltau

    return float(kendalltau(np.asarray(scores), np.asarray(labels)).statistic)


def kendall_tau_interval(
    scores: Sequence[float] | np.ndarray,
    labels: Sequence[float] | np.ndarray,
    resamples: int = 1000,
    minus: Sequence[float] | np.ndarray | None = None,
) -> tuple[float, float]:
    """95% bootstrap interval of :func:`kendall_tau`: prompts resampled with their labels (paired), seeded, so
    that two rankers scored on the same prompts get comparable intervals; NaN for fewer than two prompts (as
    the tau itself).  With ``minus`` (another ranker's scores of the same prompts): the interval of the
    difference ``tau(scores) - tau(minus)``, both on each resample, which is far narrower than the two
    intervals side by side."""
    from scipy.stats import bootstrap

    if len(scores) < 2:
        return float("nan"), float("nan")

    def tau(s: np.ndarray, y: np.ndarray, *other: np.ndarray, axis: int = -1) -> np.ndarray:  # one per row
        rows = zip(np.atleast_2d(s), np.atleast_2d(y), *(np.atleast_2d(o) for o in other), strict=True)
        return np.array([kendall_tau(a, b) - (kendall_tau(o[0], b) if o else 0.0) for a, b, *o in rows])

    data = [np.asarray(scores, np.float64), np.asarray(labels, np.float64)]
    data += [] if minus is None else [np.asarray(minus, np.float64)]
    result = bootstrap(
        tuple(data), tau, paired=True, vectorized=True, n_resamples=resamples, method="percentile",
        rng=np.random.default_rng(0),
    )  # fmt: skip
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def tau_ceiling(labels: Sequence[float] | np.ndarray) -> float:
    """Kendall's tau-b of a perfect predictor whose scores never tie: sqrt(1 - tied label pairs / pairs).

    Below 1 when labels tie; with short length caps most replies share the lowest label, so this, not 1,
    is the scale against which a measured tau is read.
    """
    _, counts = np.unique(np.asarray(labels), return_counts=True)
    n = counts.sum()
    pairs, tied = n * (n - 1) / 2, float((counts * (counts - 1) / 2).sum())
    return float(np.sqrt(1 - tied / pairs)) if pairs else float("nan")


def bucket_edges(lengths: Sequence[int] | np.ndarray, buckets: int) -> np.ndarray:
    """Inner edges of ``buckets`` equal-mass length buckets from training lengths (classification baseline)."""
    if buckets < 2:
        raise ValueError(f"buckets={buckets} must be >= 2; to resolve, pass e.g. --buckets 8")
    return np.unique(np.quantile(np.asarray(lengths, dtype=np.float64), np.linspace(0, 1, buckets + 1)[1:-1]))


def bucket_score(logits: torch.Tensor) -> torch.Tensor:
    """Score of a bucket classifier: minus the expected bucket index (higher = shorter)."""
    index = torch.arange(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    return -(logits.softmax(-1) * index).sum(-1)
