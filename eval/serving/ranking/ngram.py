"""The ``ngram`` ranker: ridge regression of log reply length on hashed token n-grams, cheap enough for a proxy.

Features of a prompt, all from the served model's tokenizer (the ids vLLM counts): token unigrams and bigrams
over the whole prompt, the same again tagged for the first and for the last ``edge`` tokens (what a prompt
asks for is usually said at its start or its end), hashed into ``2**bits`` slots, log-scaled counts times
the training set's idf, L2-normalized; plus log prompt length and a one-hot of its log bin.  The weights are a
ridge regression of log(output length) (``scipy.sparse.linalg.lsqr`` with ``damp = sqrt(alpha)``).  Score
= minus the predicted log length (higher = shorter, as for every ranker).  Scoring a 1k-token prompt is a
tokenization and a sparse dot product: well under a millisecond of numpy, so it can run in front of a server
for every request.  The hash is fixed (uint64 multiply-add over ids, then a Fibonacci hash), so the exported
``ngram.safetensors`` (idf, weights) means the same on any machine.
"""

from __future__ import annotations

import numpy as np

NGRAM_FILE = "ngram.safetensors"
LEN_BINS = 12
LOG_LEN_RANGE = (np.log(4.0), np.log(1024.0))
_MIX = np.uint64(1_000_003)
_FIB = np.uint64(0x9E3779B97F4A7C15)


def hashed_ngrams(ids: np.ndarray, n: int, salt: int, bits: int) -> np.ndarray:
    """Slots of every n-gram of ``ids`` (uint64 multiply-add, then a Fibonacci hash to ``bits`` bits)."""
    if len(ids) < n:
        return np.zeros(0, np.int64)
    with np.errstate(over="ignore"):
        h = np.full(len(ids) - n + 1, salt, np.uint64)
        for k in range(n):
            h = h * _MIX + ids[k : len(ids) - n + 1 + k]
        return ((h * _FIB) >> np.uint64(64 - bits)).astype(np.int64)


def prompt_slots(ids, bits: int, edge: int) -> np.ndarray:
    """All hashed slots of one prompt (with repeats: a slot's count is its multiplicity)."""
    ids = np.asarray(ids, np.uint64)
    parts = [hashed_ngrams(ids, 1, 1, bits), hashed_ngrams(ids, 2, 2, bits)]
    if edge:
        head, tail = ids[:edge], ids[-edge:]
        parts += [hashed_ngrams(head, 1, 11, bits), hashed_ngrams(head, 2, 12, bits)]
        parts += [hashed_ngrams(tail, 1, 21, bits), hashed_ngrams(tail, 2, 22, bits)]
    return np.concatenate(parts)


def length_features(n_tokens: np.ndarray) -> np.ndarray:
    """(n, 1 + LEN_BINS): log length / 5 and a scaled one-hot of its bin (a step function of length)."""
    log_len = np.log(np.maximum(np.asarray(n_tokens, np.float64), 1.0))
    edges = np.linspace(*LOG_LEN_RANGE, LEN_BINS + 1)[1:-1]
    onehot = np.eye(LEN_BINS)[np.searchsorted(edges, log_len)] * 0.3
    return np.c_[log_len / 5.0, onehot]


def count_matrix(token_ids: list, bits: int, edge: int):
    """CSR matrix of log-scaled slot counts, one row per prompt, and the prompts' token counts."""
    import scipy.sparse as sp

    rows, cols = [], []
    for r, ids in enumerate(token_ids):
        slots = prompt_slots(ids, bits, edge)
        rows.append(np.full(len(slots), r, np.int64))
        cols.append(slots)
    rows_a = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    cols_a = np.concatenate(cols) if cols else np.zeros(0, np.int64)
    x = sp.csr_matrix((np.ones(len(rows_a), np.float64), (rows_a, cols_a)), shape=(len(token_ids), 1 << bits))
    x.sum_duplicates()
    x.data = 1.0 + np.log(x.data)
    return x, np.array([len(ids) for ids in token_ids])


def design(x, n_tokens: np.ndarray, idf: np.ndarray):
    """idf-weighted, L2-normalized counts beside the length features: the regression's inputs."""
    import scipy.sparse as sp

    x = x.multiply(idf).tocsr()
    norm = np.sqrt(np.asarray(x.multiply(x).sum(1)).ravel()) + 1e-9
    return sp.hstack([sp.diags(1.0 / norm) @ x, sp.csr_matrix(length_features(n_tokens))]).tocsr()


def fit(token_ids: list, lengths: np.ndarray, bits: int, edge: int, alpha: float, min_df: int = 2) -> dict:
    """Ridge fit of log(lengths); returns the tensors of ``ngram.safetensors`` (float32)."""
    from scipy.sparse.linalg import lsqr

    x, n_tokens = count_matrix(token_ids, bits, edge)
    df = np.bincount(x.indices, minlength=1 << bits)
    idf = np.where(df >= min_df, np.log((1 + len(token_ids)) / (1 + df)) + 1.0, 0.0)
    target = np.log(np.maximum(np.asarray(lengths, np.float64), 1.0))
    bias = target.mean()
    w = lsqr(
        design(x, n_tokens, idf), target - bias, damp=np.sqrt(alpha), atol=1e-6, btol=1e-6, iter_lim=3000
    )[0]
    return {
        "idf": idf.astype(np.float32),
        "weight": w[: 1 << bits].astype(np.float32),
        "length_weight": w[1 << bits :].astype(np.float32),
        "bias": np.array([bias], np.float32),
    }


def fit_pairwise(
    token_ids: list,
    lengths: np.ndarray,
    bits: int,
    edge: int,
    alpha: float,
    pair_alpha: float = 0.05,
    weight: str = "gap",
    partners: int = 16,
    seed: int = 0,
    iterations: int = 200,
) -> dict:
    """The ridge fit of :func:`fit`, refined by a pairwise logistic loss weighted by what misordering a pair
    costs: ``gap`` weighs pair (i, j) by |len_i - len_j| / mean length (serving the longer one first adds that much
    to the pair's total latency), ``log-gap`` by |log len_i - log len_j| (relative), ``none`` by 1 (RankNet).  Each
    prompt meets ``partners`` random others; L-BFGS from the ridge weights (penalty ``alpha``), with an L2 penalty
    of ``pair_alpha`` / (number of prompts) on the mean pair loss.  The scores are then mapped back to log-length
    units (a 1-d least-squares fit on the training prompts), so that a proxy's priority and its aging keep their
    meaning.  Same tensors as :func:`fit`."""
    from scipy.optimize import minimize

    tensors = fit(token_ids, lengths, bits, edge, alpha)
    x, n_tokens = count_matrix(token_ids, bits, edge)
    design_x = design(x, n_tokens, tensors["idf"].astype(np.float64))
    target = np.log(np.maximum(np.asarray(lengths, np.float64), 1.0))
    rng = np.random.default_rng(seed)
    i = np.repeat(np.arange(len(target)), partners)
    j = rng.integers(0, len(target), len(i))
    gap = target[i] - target[j]
    keep = gap != 0
    i, j, gap = i[keep], j[keep], gap[keep]
    if weight == "gap":
        raw = np.asarray(lengths, np.float64)
        w_pair = np.abs(raw[i] - raw[j]) / raw.mean()
    elif weight == "log-gap":
        w_pair = np.abs(gap)
    elif weight == "none":
        w_pair = np.ones_like(gap)
    else:
        raise ValueError(f"pair weight {weight!r} is unknown; to resolve, pass gap, log-gap or none")
    w_pair, sign = w_pair / w_pair.sum(), np.sign(gap)
    penalty = pair_alpha / len(target)

    def loss(w: np.ndarray) -> tuple[float, np.ndarray]:
        f = design_x @ w
        margin = sign * (f[i] - f[j])  # > 0: the longer reply predicted longer
        value = float(w_pair @ np.logaddexp(0.0, -margin)) + 0.5 * penalty * float(w @ w)
        d_margin = -w_pair * sign / (1.0 + np.exp(np.clip(margin, -50, 50)))
        d_f = np.bincount(i, d_margin, len(target)) - np.bincount(j, d_margin, len(target))
        return value, design_x.T @ d_f + penalty * w

    start = np.r_[tensors["weight"], tensors["length_weight"]].astype(np.float64)
    w = minimize(loss, start, jac=True, method="L-BFGS-B", options={"maxiter": iterations}).x
    f = design_x @ w
    slope, intercept = np.polyfit(f, target, 1)  # back to log-length units
    w = w * slope
    return {
        "idf": tensors["idf"],
        "weight": w[: 1 << bits].astype(np.float32),
        "length_weight": w[1 << bits :].astype(np.float32),
        "bias": np.array([intercept], np.float32),
    }


class NgramScorer:
    """Scores (minus predicted log length) of token-id lists with exported tensors; no torch, no model."""

    def __init__(self, tensors: dict, bits: int, edge: int):
        self.bits, self.edge = bits, edge
        self.idf = np.asarray(tensors["idf"], np.float64)
        self.weight = np.asarray(tensors["weight"], np.float64)
        self.length_weight = np.asarray(tensors["length_weight"], np.float64)
        self.bias = float(np.asarray(tensors["bias"]).ravel()[0])
        if len(self.idf) != 1 << bits or len(self.weight) != 1 << bits:
            raise ValueError(
                f"ngram tensors hold {len(self.weight)} slots, the spec says 2**{bits}; to resolve, retrain"
            )

    def predict_log_len(self, ids) -> float:
        slots, counts = np.unique(prompt_slots(ids, self.bits, self.edge), return_counts=True)
        values = (1.0 + np.log(counts)) * self.idf[slots]
        norm = np.sqrt(values @ values) + 1e-9
        text = (values @ self.weight[slots]) / norm
        return self.bias + text + float(length_features([len(ids)])[0] @ self.length_weight)

    def scores(self, token_ids: list) -> np.ndarray:
        return -np.array([self.predict_log_len(ids) for ids in token_ids], np.float32)
