"""Train a ranking predictor with ListMLE (or the bucket-classification baseline) and evaluate it.

One short loop for both kinds: every mini-batch of ``list_size`` training prompts is one list.  For the
``swiftkv-head`` the served model's pooled x_l is computed once (the model is frozen), so training the
head takes seconds; the ``small-lm`` fine-tunes the whole small LM; the ``ngram`` kind is one ridge solve
(:mod:`.ngram`, no loop).  Beside each ranker ``train.json`` keeps the one-feature baseline: the mean log
length per prompt-length quantile bin of the training split, which ``evaluate`` scores next to it.  The held-out split is a seeded
shuffle recorded in ``train.json``, so ``evaluate`` and ``simulate`` later score the same prompts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from toolkit.artifacts import atomic_output_dir, sha256_file, write_json_atomic, write_provenance

from .listmle import (
    bucket_edges,
    kendall_tau,
    kendall_tau_interval,
    length_labels,
    listmle_loss,
    tau_ceiling,
)
from .predictors import (
    HEAD_FILE,
    Ranker,
    RankerSpec,
    SwiftKVHead,
    default_layer,
    load_small_lm,
    model_fingerprint,
    save_spec,
    shared_features,
    small_lm_logits,
    to_scores,
)
from .traces import Trace, load_traces, prompt_digest, read_meta, split_traces, traces_file

log = logging.getLogger(__name__)
TRAIN_FILE = "train.json"


class TrainConfig(BaseModel):
    """Options of ``swiftkv ranking train``; defaults follow the paper where it has one."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["small-lm", "swiftkv-head", "ngram"] = "swiftkv-head"
    objective: Literal["listmle", "buckets", "pairwise"] = Field(
        "listmle",
        description="buckets = classification baseline; the ngram kind fits a ridge regression unless pairwise",
    )
    pair_alpha: float = Field(0.05, gt=0, description="pairwise: L2 penalty of the pair loss (ngram kind)")
    pair_weight: Literal["gap", "log-gap", "none"] = Field(
        "gap",
        description="pairwise: what a misordered pair costs: |len_i - len_j| (the latency a swap adds), "
        "|log len_i - log len_j| or 1",
    )
    target_model: str | None = Field(
        None, description="served model (swiftkv-head); default: the traces' model"
    )
    layer: int | None = Field(None, description="x_l read by the swiftkv-head; default L // 2")
    backbone: str | None = Field(None, description="small-lm backbone dir; default: the traces' model")
    backbone_layers: int | None = Field(None, ge=1, description="keep only the first N backbone layers")
    epochs: int = Field(5, ge=1)
    lr: float | None = Field(None, gt=0, description="default 2e-5 (small-lm, paper) or 1e-3 (head)")
    weight_decay: float = Field(0.01, ge=0)
    list_size: int = Field(32, ge=2, description="prompts per ListMLE list (= mini-batch)")
    max_prompt_tokens: int = Field(2048, ge=8)
    label_cap: int | None = Field(None, ge=1, description="default: the traces' max_new_tokens")
    label_bin: int = Field(10, ge=1)
    buckets: int = Field(8, ge=2, description="classes of the bucket baseline (equal-mass length buckets)")
    head_hidden: int = Field(256, ge=1)
    alpha: float = Field(0.5, gt=0, description="ridge penalty of the ngram kind")
    ngram_bits: int = Field(20, ge=8, le=24, description="ngram kind: 2**bits hashed slots")
    ngram_edge: int = Field(16, ge=0, description="ngram kind: also tag n-grams of the first/last N tokens")
    held_out: float = Field(0.2, ge=0, lt=1, description="0 = train on all; evaluate others with --split all")
    batch_size: int = Field(8, ge=1, description="forward micro-batch inside a list")
    seed: int = 0


def _lists(n: int, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(n)
    return [chunk for chunk in np.array_split(order, max(1, n // size)) if len(chunk) >= 2]


def _loss(spec: RankerSpec, logits: torch.Tensor, lengths: np.ndarray, gen: torch.Generator) -> torch.Tensor:
    if spec.objective == "listmle":
        labels = torch.from_numpy(length_labels(lengths, spec.label_cap, spec.label_bin))
        return listmle_loss(logits[:, 0], labels, gen)
    classes = torch.from_numpy(np.searchsorted(np.asarray(spec.bucket_edges), lengths, side="right"))
    return torch.nn.functional.cross_entropy(logits, classes, reduction="sum")


ONE_FEATURE_BINS = 20


def one_feature_fit(prompt_lens: np.ndarray, lengths: np.ndarray) -> dict:
    """The one-feature regression baseline: mean log length per prompt-length quantile bin (any shape)."""
    prompt_lens, log_len = np.asarray(prompt_lens, np.float64), np.log(np.maximum(lengths, 1))
    edges = np.unique(np.quantile(prompt_lens, np.linspace(0, 1, ONE_FEATURE_BINS + 1)[1:-1]))
    bins = np.searchsorted(edges, prompt_lens, side="right")
    means = [
        float(log_len[bins == k].mean()) if (bins == k).any() else float(log_len.mean())
        for k in range(len(edges) + 1)
    ]
    return {"edges": edges.tolist(), "mean_log_len": means}


def one_feature_scores(fit: dict, prompt_lens) -> np.ndarray:
    """Scores of the one-feature baseline (higher = shorter)."""
    bins = np.searchsorted(np.asarray(fit["edges"]), np.asarray(prompt_lens, np.float64), side="right")
    return -np.asarray(fit["mean_log_len"])[bins]


def _train_ngram(train: list[Trace], spec: RankerSpec, config: TrainConfig, tokenizer) -> dict:
    from .ngram import fit, fit_pairwise

    pairwise = config.objective == "pairwise"
    spec.objective = "pairwise" if pairwise else "regression"
    spec.ngram_bits, spec.ngram_edge = config.ngram_bits, config.ngram_edge
    ids = tokenizer([t.prompt for t in train]).input_ids
    lengths = np.array([t.output_len for t in train])
    if pairwise:
        return fit_pairwise(
            ids,
            lengths,
            config.ngram_bits,
            config.ngram_edge,
            config.alpha,
            config.pair_alpha,
            config.pair_weight,
            seed=config.seed,
        )
    return fit(ids, lengths, config.ngram_bits, config.ngram_edge, config.alpha)


def train_ranker(
    traces_path: str | os.PathLike, out_dir: str | os.PathLike, config: TrainConfig, force: bool = False
) -> Path:
    """Train on the training split of ``traces_path``, export to ``out_dir``; return it."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    traces = load_traces(traces_path)
    meta = read_meta(traces_path)
    train, test = split_traces(traces, config.held_out, config.seed)
    if len(train) < 2:
        raise ValueError(f"{traces_path} has {len(traces)} traces; to resolve, generate more (at least ~10)")
    if config.objective == "pairwise" and config.kind != "ngram":
        raise ValueError(
            f"objective pairwise is for the ngram kind, not {config.kind}; to resolve, pass --kind ngram"
        )
    lengths = np.array([t.output_len for t in train])
    target = config.target_model or meta.get("model")
    cap = config.label_cap or meta.get("max_new_tokens") or int(max(t.output_len for t in traces))
    spec = RankerSpec(
        kind=config.kind,
        objective=config.objective,
        label_cap=cap,
        label_bin=config.label_bin,
        max_prompt_tokens=config.max_prompt_tokens,
        bucket_edges=bucket_edges(lengths, config.buckets).tolist()
        if config.objective == "buckets"
        else None,
    )
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    prompts = [t.prompt for t in train]
    info = {
        "traces_sha256": sha256_file(traces_file(traces_path)),
        "n_train": len(train),
        "n_held_out": len(test),
        "config": config.model_dump(exclude={"target_model", "backbone"}),  # paths: not portable
        "one_feature": one_feature_fit(np.array([_prompt_len(t) for t in train]), lengths),
        "prompt_digests": sorted(
            {prompt_digest(t.prompt) for t in train}
        ),  # what `evaluate` must never score
    }
    if config.kind == "ngram":
        if target is None:
            raise ValueError("the traces name no model; to resolve, pass --target-model DIR (its tokenizer)")
        from safetensors.numpy import save_file as save_numpy
        from transformers import AutoTokenizer

        from .ngram import NGRAM_FILE

        tokenizer = AutoTokenizer.from_pretrained(target)
        tensors = _train_ngram(train, spec, config, tokenizer)
        with atomic_output_dir(out_dir, force) as tmp:
            save_spec(tmp, spec)
            save_numpy(tensors, str(tmp / NGRAM_FILE))
            tokenizer.save_pretrained(tmp)
            write_json_atomic(tmp / TRAIN_FILE, {**info, "lr": None, "history": []})
            write_provenance(
                tmp,
                "eval.serving.ranking.train",
                traces_sha256=info["traces_sha256"],
                kind="ngram",
                objective=spec.objective,
            )
        return Path(out_dir)
    if config.kind == "swiftkv-head":
        if target is None:
            raise ValueError("the traces name no model; to resolve, pass --target-model DIR")
        spec.layer = config.layer if config.layer is not None else default_layer(target)
        spec.model_fingerprint, spec.head_hidden = model_fingerprint(target), config.head_hidden
        features = shared_features(str(target), spec.layer, spec.max_prompt_tokens)(
            prompts, config.batch_size, True
        )
        spec.feature_dim = features.shape[1]
        model = SwiftKVHead(spec.feature_dim, config.head_hidden, spec.outputs)
        model.fit_normalizer(features)
        lr = config.lr or 1e-3
    else:
        backbone = config.backbone or target
        if backbone is None:
            raise ValueError("no backbone for the small LM; to resolve, pass --backbone DIR")
        tokenizer, model = load_small_lm(backbone, spec.outputs, config.backbone_layers)
        lr = config.lr or 2e-5

    def forward(batch: np.ndarray) -> torch.Tensor:
        if config.kind == "swiftkv-head":
            return model(features[torch.from_numpy(batch)])
        # micro-batches of similar length pad less (a list of 32 random prompts varies ~3x in length)
        by_length = batch[np.argsort([len(prompts[i]) for i in batch], kind="stable")]
        parts = [
            small_lm_logits(
                tokenizer,
                model,
                [prompts[i] for i in by_length[j : j + config.batch_size]],
                spec.max_prompt_tokens,
            )
            for j in range(0, len(batch), config.batch_size)
        ]
        position = {int(i): k for k, i in enumerate(by_length)}
        return torch.cat(parts)[[position[int(i)] for i in batch]]

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay)
    history = []
    model.train()
    for epoch in range(config.epochs):
        batches = _lists(len(train), config.list_size, rng)
        total = 0.0
        for batch in tqdm(
            batches, desc=f"epoch {epoch + 1}/{config.epochs}", disable=config.kind != "small-lm"
        ):
            loss = _loss(spec, forward(batch), lengths[batch], gen)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() / len(batch)
        history.append({"epoch": epoch + 1, "loss_per_item": total / len(batches)})
        log.info("epoch %d: loss/item %.4f", epoch + 1, history[-1]["loss_per_item"])
    model.eval()
    with torch.no_grad():
        train_scores = torch.cat(
            [to_scores(spec, forward(b)) for b in np.array_split(np.arange(len(train)), 1 + len(train) // 64)]
        )
    train_tau = kendall_tau(train_scores.numpy(), length_labels(lengths, cap, spec.label_bin))

    with atomic_output_dir(out_dir, force) as tmp:
        save_spec(tmp, spec)
        if config.kind == "swiftkv-head":
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / HEAD_FILE)
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(target).save_pretrained(tmp)
        else:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / TRAIN_FILE, {**info, "lr": lr, "history": history, "train_tau": train_tau})
        write_provenance(
            tmp,
            "eval.serving.ranking.train",
            traces_sha256=sha256_file(traces_file(traces_path)),
            kind=config.kind,
            objective=config.objective,
        )
    return Path(out_dir)


def held_out_traces(
    ranker_dir: str | os.PathLike, traces_path: str | os.PathLike, split: str = "held-out"
) -> list[Trace]:
    """The prompts a ranker never saw: the recorded held-out split, or all traces for ``split="all"``, less
    any trace whose prompt (whitespace-normalized) the ranker was trained on, whatever file it came from."""
    traces = load_traces(traces_path)
    info = json.loads((Path(ranker_dir) / TRAIN_FILE).read_text())
    if split != "all":
        if not info["config"]["held_out"]:
            raise ValueError(
                f"ranker {ranker_dir} was trained on every trace (--held-out 0), so it has no held-out split; "
                "to resolve, pass traces it was not trained on with --split all"
            )
        if info.get("traces_sha256") != sha256_file(traces_file(traces_path)):
            log.info(
                "traces differ from the training traces; the split is still the recorded seed's held-out part"
            )
        traces = split_traces(traces, info["config"]["held_out"], info["config"]["seed"])[1]
    seen = set(info.get("prompt_digests", ()))  # rankers trained before 2026-12-06 record none
    unseen = [t for t in traces if prompt_digest(t.prompt) not in seen]
    if len(unseen) < len(traces):
        log.warning("%d of %d prompts were training prompts of %s; left out", len(traces) - len(unseen),
                    len(traces), ranker_dir)  # fmt: skip
    if not unseen:
        raise ValueError(
            f"every prompt of {traces_path} was a training prompt of {ranker_dir}; to resolve, evaluate on "
            "prompts it was not trained on"
        )
    return unseen


def load_ranker(
    ranker_dir: str | os.PathLike,
    traces_path: str | os.PathLike,
    target_model: str | os.PathLike | None = None,
) -> Ranker:
    """The ranker, reading x_l of ``target_model`` (default: the model that generated the traces)."""
    return Ranker(ranker_dir, target_model or read_meta(traces_path).get("model"))


def combined_scores(scores: list[np.ndarray]) -> np.ndarray:
    """The mean of each ranker's scores standardized over the same prompts: a combination that needs no labels
    (so it cannot fit the held-out ones) and no common unit (a head's ListMLE scores and an ngram's log lengths
    differ in scale)."""
    return np.mean([(s - s.mean()) / max(float(s.std()), 1e-12) for s in map(np.asarray, scores)], axis=0)


def evaluate_ranker(
    ranker_dir: str | os.PathLike,
    traces_path: str | os.PathLike,
    split: str = "held-out",
    target_model: str | os.PathLike | None = None,
    combine_with: tuple[str | os.PathLike, ...] = (),
) -> dict:
    """Kendall's tau of the ranker on held-out prompts (with a 95% bootstrap interval against the raw lengths),
    beside the prompt-length heuristic and the oracle.

    The oracle is tie-free (as any real predictor is), so its tau is below 1 when many replies hit the cap.
    With ``combine_with`` (other rankers, e.g. a swiftkv-head beside an ngram): only prompts none of them was
    trained on, each one's tau, and that of :func:`combined_scores` with the paired interval of its gain over
    this ranker.
    """
    traces = held_out_traces(ranker_dir, traces_path, split)
    for other in combine_with:
        unseen = {t.prompt for t in held_out_traces(other, traces_path, "all")}
        traces = [t for t in traces if t.prompt in unseen]
    ranker = load_ranker(ranker_dir, traces_path, target_model)
    labels = length_labels([t.output_len for t in traces], ranker.spec.label_cap, ranker.spec.label_bin)
    scores = ranker.score([t.prompt for t in traces], progress=True)
    raw = [-t.output_len for t in traces]  # unbinned, uncapped: higher = shorter
    prompt_lens = [_prompt_len(t) for t in traces]
    info = json.loads((Path(ranker_dir) / TRAIN_FILE).read_text())
    baseline = {}
    if "one_feature" in info:
        one = one_feature_scores(info["one_feature"], prompt_lens)
        baseline = {"one_feature_tau": kendall_tau(one, labels), "one_feature_tau_raw": kendall_tau(one, raw)}
    combined = {}
    if combine_with:
        others = [load_ranker(o, traces_path, target_model) for o in combine_with]
        other_scores = [o.score([t.prompt for t in traces], progress=True) for o in others]
        mix = combined_scores([scores, *other_scores])
        combined = {
            "others": [
                {
                    "ranker": str(d),
                    "kind": o.spec.kind,
                    "objective": o.spec.objective,
                    "kendall_tau": kendall_tau(s, labels),
                    "kendall_tau_raw": kendall_tau(s, raw),
                }
                for d, o, s in zip(combine_with, others, other_scores, strict=True)
            ],
            "combined_tau": kendall_tau(mix, labels),
            "combined_tau_raw": kendall_tau(mix, raw),
            "combined_tau_raw_95": kendall_tau_interval(mix, raw),
            "combined_gain_raw_95": kendall_tau_interval(mix, raw, minus=scores),
        }
    return {
        "ranker": str(ranker_dir),
        "kind": ranker.spec.kind,
        "objective": ranker.spec.objective,
        "traces": str(traces_path),
        "split": split,
        "n_train": info.get("n_train"),
        "n": len(traces),
        "label_cap": ranker.spec.label_cap,
        "label_bin": ranker.spec.label_bin,
        "kendall_tau": kendall_tau(scores, labels),
        "kendall_tau_raw": kendall_tau(scores, raw),
        "kendall_tau_raw_95": kendall_tau_interval(scores, raw),
        "prompt_len_tau": kendall_tau([-t.prompt_len for t in traces], labels),
        "prompt_len_tau_raw": kendall_tau([-t.prompt_len for t in traces], raw),
        **baseline,
        "tie_free_oracle_tau": tau_ceiling(labels),
        "tie_free_oracle_tau_raw": tau_ceiling(raw),
        "capped_fraction": float(np.mean([t.output_len >= ranker.spec.label_cap for t in traces])),
        **combined,
    }


def evaluation_table(result: dict) -> str:
    """The taus of :func:`evaluate_ranker` as a markdown table: the ranker beside the two baselines it must
    beat (shortest prompt first; the one-feature regression on prompt length) and the tie-free ceiling,
    against the raw reply lengths and against the capped, binned training labels."""
    others = result.get("others", [])
    rows = [  # (name, where its taus are, their key)
        (f"ranker ({result['kind']}, {result['objective']})", result, "kendall_tau"),
        *((f"ranker {o['ranker']} ({o['kind']}, {o['objective']})", o, "kendall_tau") for o in others),
    ]
    if others:
        rows.append(("combined: mean of the rankers' standardized scores", result, "combined_tau"))
    rows += [
        ("shortest prompt first", result, "prompt_len_tau"),
        ("one-feature regression on prompt length", result, "one_feature_tau"),
        ("tie-free oracle (ceiling)", result, "tie_free_oracle_tau"),
    ]
    lines = [
        f"{result['traces']} ({result['split']}): {result['n']} prompts; ranker trained on "
        f"{result['n_train']}; {result['capped_fraction']:.1%} of replies at the label cap",
        "",
        f"| predictor | Kendall's τ, raw lengths | τ, labels (cap {result['label_cap']}, bin {result['label_bin']}) |",
        "|---|---|---|",
    ]
    for name, source, key in rows:
        if key in source:  # rankers trained before the one-feature baseline existed lack it
            low_high = source.get(key + "_raw_95")
            interval = f" [{low_high[0]:.3f}, {low_high[1]:.3f}]" if low_high else ""
            lines.append(f"| {name} | {source[key + '_raw']:.3f}{interval} | {source[key]:.3f} |")
    if others:
        gain, (low, high) = (
            result["combined_tau_raw"] - result["kendall_tau_raw"],
            result["combined_gain_raw_95"],
        )
        lines += [
            "",
            f"combined minus the first ranker, paired over the same prompts: {gain:+.3f} [{low:+.3f}, {high:+.3f}]",
        ]
    return "\n".join(lines)


def _prompt_len(trace: Trace) -> int:
    """The recorded prompt length (character count / 4 for traces from elsewhere that lack it)."""
    return trace.prompt_len or max(1, len(trace.prompt) // 4)
