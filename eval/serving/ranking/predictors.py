"""The two ranking predictors and the exported directory a serving scheduler loads.

* ``small-lm`` (the paper's design): a separate small LM with a scalar head —
  ``AutoModelForSequenceClassification`` with ``num_labels=1`` (the last prompt token's state), optionally
  cut to its first N layers to make it cheaper.
* ``swiftkv-head`` (beyond the paper): a two-layer MLP on the served model's own hidden state x_l entering
  layer ``l`` (the SwiftKV layer input, which SwiftKV prefill computes anyway), pooled as
  [mean over prompt tokens except the first (an attention sink with outsized norm), last token] and
  standardized with training statistics.  Features come from ``hidden_states[l]`` of the model loaded with
  only ``l + 1`` layers (equal to the full model's ``hidden_states[l]``), so no SwiftKV class is needed.

* ``ngram`` (for a proxy in front of a server): ridge regression of log length on hashed token n-grams of the
  served model's tokenizer (:mod:`.ngram`); no model runs, a 1k-token prompt scores in about a millisecond.

Either LM kind can instead be a bucket classifier (objective ``buckets``), the baseline the paper compares with.
An exported ranker is ``ranker.json`` (score semantics, labels, options) + tokenizer + weights
(the small LM via ``save_pretrained``; the head as ``head.safetensors``; the n-gram model as ``ngram.safetensors``).  The directory holds no path: a head
records the ``model_fingerprint`` of the model whose x_l it reads, and whoever loads it names that model
(``Ranker(dir, target_model=...)``), which is checked against the fingerprint.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

from .listmle import bucket_score

RANKER_FILE = "ranker.json"
HEAD_FILE = "head.safetensors"
SCORE_SEMANTICS = (
    "higher score = shorter expected output; serve in descending score. "
    "Trained on labels cap//bin - min(cap, output_len)//bin."
)


class RankerSpec(BaseModel):
    """Everything needed to rebuild a ranker; written as ``ranker.json``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["small-lm", "swiftkv-head", "ngram"]
    objective: Literal["listmle", "buckets", "regression", "pairwise"]
    label_cap: int
    label_bin: int
    max_prompt_tokens: int
    bucket_edges: list[float] | None = None
    layer: int | None = None
    model_fingerprint: str | None = None
    head_hidden: int | None = None
    feature_dim: int | None = None
    ngram_bits: int | None = None
    ngram_edge: int | None = None
    score: str = SCORE_SEMANTICS

    @property
    def outputs(self) -> int:
        return len(self.bucket_edges or []) + 1 if self.objective == "buckets" else 1


FINGERPRINT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 of the model family, the architecture fields of config.json and the tokenizer (vocabulary and
    special ids, as for suffix caches).  A SwiftKV conversion keeps all of them (its first layers, which
    compute x_l, are the base model's), so a head trained on the base model serves its SwiftKV checkpoint."""
    import hashlib

    from transformers import AutoTokenizer

    from swiftkv.convert import read_config

    from ..suffix.artifact import tokenizer_fingerprint

    config = read_config(Path(model_dir))
    payload = {
        "family": str(config.get("model_type", "")).removesuffix("_swiftkv"),
        **{key: config.get(key) for key in FINGERPRINT_FIELDS},
        "tokenizer": tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_dir)),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def check_target(spec: RankerSpec, ranker_dir: str | os.PathLike, model_dir: str | os.PathLike) -> None:
    """Refuse, in one line, a swiftkv-head ranker for a model it was not trained on."""
    found = model_fingerprint(model_dir)
    if spec.model_fingerprint != found:
        raise ValueError(
            f"ranker {ranker_dir} reads x_l of a model with another architecture or tokenizer than {model_dir} "
            f"(fingerprint {str(spec.model_fingerprint)[:12]} vs {found[:12]}); "
            "to resolve, train the ranker on this model"
        )


def default_layer(model_dir: str | os.PathLike) -> int:
    """L // 2, the usual SwiftKV layer (SwiftKV skips the second half of the layers for prompt tokens)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).num_hidden_layers // 2


def _first_layers(model_dir: str | os.PathLike, n_layers: int, dtype: torch.dtype) -> torch.nn.Module:
    """The model cut to its first ``n_layers``, quietly: transformers prints a load report on every load that
    lists the checkpoint's later layers as unexpected weights, which is what a cut model means (also in a vLLM
    server's log, where the ranker loads).  Weights the cut model lacks are still warned about."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModel.from_pretrained(
            model_dir, num_hidden_layers=n_layers, dtype=dtype, output_loading_info=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"] or info["mismatched_keys"]:
        logging.getLogger(__name__).warning(
            "%s cut to %d layers lacks weights %s (left at their initialization)",
            model_dir, n_layers, sorted(info["missing_keys"]) + sorted(map(str, info["mismatched_keys"])),
        )  # fmt: skip
    return model.eval()


class HiddenStateFeatures:
    """Pooled x_l of a served model for chat-templated prompts (what its prefill computes anyway)."""

    def __init__(self, model_dir: str | os.PathLike, layer: int, max_prompt_tokens: int, dtype=torch.float32):
        from transformers import AutoConfig, AutoTokenizer

        n_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
        if not 0 < layer < n_layers:
            raise ValueError(
                f"layer={layer} must be in 1..{n_layers - 1} for {model_dir}; to resolve, pass --layer"
            )
        self.layer, self.max_prompt_tokens = layer, max_prompt_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left", truncation_side="left")
        if self.tokenizer.pad_token is None:  # Llama-3's has none; padded positions are masked out anyway
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = _first_layers(model_dir, layer + 1, dtype)
        self._cache: dict[str, torch.Tensor] = {}

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in prompts
        ]
        return self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_prompt_tokens,
            add_special_tokens=False,
        )

    @staticmethod
    def pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[mean over tokens after the first real one, last token] of left-padded (b, t, H) states."""
        body = mask.clone()
        body[torch.arange(len(mask)), mask.argmax(-1)] = 0  # drop each row's first real token
        body = body.to(hidden.dtype)
        mean = (hidden * body[..., None]).sum(1) / body.sum(1, keepdim=True).clamp(min=1)
        return torch.cat([mean, hidden[:, -1]], dim=-1).float()

    @torch.no_grad()
    def __call__(self, prompts: list[str], batch_size: int = 8, progress: bool = False) -> torch.Tensor:
        """Pooled features (n, 2H); each distinct prompt is run once per instance (later calls hit a cache)."""
        from tqdm import tqdm

        todo = sorted(dict.fromkeys(p for p in prompts if p not in self._cache), key=len)  # less padding
        for i in tqdm(range(0, len(todo), batch_size), desc=f"x_{self.layer}", disable=not progress):
            enc = self.encode(todo[i : i + batch_size])
            hidden = self.model(**enc, output_hidden_states=True).hidden_states[self.layer]
            self._cache.update(
                zip(todo[i : i + batch_size], self.pool(hidden, enc["attention_mask"]), strict=True)
            )
        if not prompts:
            return torch.empty(0, 2 * self.model.config.hidden_size)
        return torch.stack([self._cache[p] for p in prompts])


@functools.cache
def shared_features(model_dir: str, layer: int, max_prompt_tokens: int) -> HiddenStateFeatures:
    """One feature extractor (model + cache) per process for each (model, layer, truncation)."""
    return HiddenStateFeatures(model_dir, layer, max_prompt_tokens)


class SwiftKVHead(nn.Module):
    """Standardize pooled x_l, then Linear-GELU-Linear to ``outputs`` (1 score or bucket logits)."""

    def __init__(self, feature_dim: int, hidden: int, outputs: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(feature_dim))
        self.register_buffer("std", torch.ones(feature_dim))
        self.mlp = nn.Sequential(nn.Linear(feature_dim, hidden), nn.GELU(), nn.Linear(hidden, outputs))

    def fit_normalizer(self, features: torch.Tensor) -> None:
        self.mean.copy_(features.mean(0))
        self.std.copy_(features.std(0).clamp(min=1e-6))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp((features - self.mean) / self.std)


def load_small_lm(backbone: str | os.PathLike, outputs: int, layers: int | None = None):
    """(tokenizer, sequence-classification model) from any causal LM dir, optionally cut to ``layers``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(backbone, padding_side="right", truncation_side="right")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    overrides = {"num_hidden_layers": layers} if layers else {}
    model = AutoModelForSequenceClassification.from_pretrained(
        backbone, num_labels=outputs, pad_token_id=tokenizer.pad_token_id, **overrides
    )
    return tokenizer, model


def small_lm_logits(tokenizer, model, prompts: list[str], max_prompt_tokens: int) -> torch.Tensor:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt_tokens)
    return model(**enc).logits


def to_scores(spec: RankerSpec, logits: torch.Tensor) -> torch.Tensor:
    """Raw outputs -> scores (higher = shorter) for either objective."""
    return logits[:, 0] if spec.objective != "buckets" else bucket_score(logits)


class Ranker:
    """A loaded ranker: ``score(prompts)``; a server with x_l at hand calls ``score_hidden`` instead.

    A swiftkv-head reads x_l of ``target_model`` (the served model's directory), which must match the
    fingerprint recorded at training time; a small LM carries its own weights and needs none."""

    def __init__(self, path: str | os.PathLike, target_model: str | os.PathLike | None = None):
        from safetensors.torch import load_file

        path = Path(path)
        self.spec = load_spec(path)
        self.target_model = target_model
        if self.spec.kind == "swiftkv-head":
            if target_model is None:
                raise ValueError(
                    f"ranker {path} is a swiftkv-head that reads the served model's x_l; to resolve, pass "
                    "the served model's directory as target_model (or traces whose meta.json names it)"
                )
            check_target(self.spec, path, target_model)
        if self.spec.kind == "small-lm":
            self.tokenizer, self.model = load_small_lm(path, self.spec.outputs)
            self.model.eval()
        elif self.spec.kind == "ngram":
            from safetensors.numpy import load_file as load_numpy
            from transformers import AutoTokenizer

            from .ngram import NGRAM_FILE, NgramScorer

            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.ngram = NgramScorer(
                load_numpy(path / NGRAM_FILE), self.spec.ngram_bits or 20, self.spec.ngram_edge or 0
            )
        else:
            self.head = SwiftKVHead(self.spec.feature_dim, self.spec.head_hidden, self.spec.outputs)
            self.head.load_state_dict(load_file(path / HEAD_FILE))
            self.head.eval()
            self._features: HiddenStateFeatures | None = None

    @torch.no_grad()
    def score_hidden(self, hidden: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        """Scores from x_l of shape (b, t, H) for left-padded prompts (swiftkv-head only)."""
        return to_scores(self.spec, self.head(HiddenStateFeatures.pool(hidden, mask))).numpy()

    def score_ids(self, token_ids: list[list[int]]) -> np.ndarray:
        """Scores of prompts already tokenized by the served model's tokenizer (ngram only)."""
        if self.spec.kind != "ngram":
            raise ValueError(
                f"score_ids needs an ngram ranker, this is {self.spec.kind}; to resolve, call score"
            )
        return self.ngram.scores(token_ids)

    @torch.no_grad()
    def score(self, prompts: list[str], batch_size: int = 8, progress: bool = False) -> np.ndarray:
        if self.spec.kind == "ngram":  # the raw text, as vLLM counts it (no chat template)
            return self.ngram.scores(self.tokenizer(list(prompts)).input_ids if prompts else [])
        if self.spec.kind == "small-lm":
            parts = [
                to_scores(
                    self.spec,
                    small_lm_logits(
                        self.tokenizer, self.model, prompts[i : i + batch_size], self.spec.max_prompt_tokens
                    ),
                )
                for i in range(0, len(prompts), batch_size)
            ]
            return torch.cat(parts).numpy() if parts else np.empty(0, np.float32)
        if self._features is None:
            self._features = shared_features(
                str(self.target_model), self.spec.layer, self.spec.max_prompt_tokens
            )
        return to_scores(self.spec, self.head(self._features(prompts, batch_size, progress))).numpy()


def load_spec(ranker_dir: str | os.PathLike) -> RankerSpec:
    """The ``ranker.json`` of an exported ranker, with a one-line error when there is none."""
    spec_file = Path(ranker_dir) / RANKER_FILE
    if not spec_file.is_file():
        raise FileNotFoundError(f"{spec_file} not found; to resolve, run `swiftkv ranking train` first")
    try:
        return RankerSpec.model_validate_json(spec_file.read_text())
    except ValidationError as err:
        raise ValueError(
            f"{spec_file} is not a ranker spec of this version ({err.error_count()} problems, first: "
            f"{err.errors()[0]['loc']} {err.errors()[0]['msg']}); to resolve, retrain the ranker"
        ) from None


def save_spec(out_dir: Path, spec: RankerSpec) -> None:
    (out_dir / RANKER_FILE).write_text(json.dumps(spec.model_dump(), indent=2) + "\n")
