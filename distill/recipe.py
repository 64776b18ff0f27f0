"""Distillation recipes: YAML validated by pydantic models, with ``key=value`` overrides.

Every field has a docstring-like description; unknown keys are errors (``extra="forbid"``).  All problems of a
recipe are collected and reported at once, one line each (``recipe error: train.max_step: unknown key``),
before any model or data is touched.  Recipes hold no code and no dotted import paths: choices are names
from small registries (schedules, data formats, trainable sets).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .comm import CommConfig
from .scar.config import ScarConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class SwiftKVOptions(_Section):
    num_key_value_layers: int | None = Field(None, description="l; layers 0..l-1 stay normal")
    fraction: float | None = Field(
        None, ge=0, lt=1, description="fraction of layers that become SwiftKV layers"
    )
    group_size: int = Field(1, ge=1, description="AcrossKV group size g")
    init: Literal["copy", "lstsq"] = Field(
        "copy",
        description="K/V projections of SwiftKV layers: copies/group means (the paper), or least-squares fits to "
        "the teacher's keys/values on the first training rows (swiftkv.lstsq_init)",
    )
    init_rows: int = Field(32, ge=1, description="training rows (of data.seq_len tokens) for init: lstsq")
    init_ridge: float = Field(1e-3, ge=0, description="ridge, relative to the mean feature energy")
    local_steps: int = Field(
        0,
        ge=0,
        description="after the init, Adam steps per SwiftKV group of local distillation: its projections "
        "trained to reproduce each layer's teacher attention output (distill.local); 0: off",
    )
    local_lr: float = Field(
        1e-3, gt=0, description="peak (cosine-decayed) learning rate of local distillation"
    )
    local_rows: int = Field(
        64, ge=1, description="training rows (of data.seq_len tokens) for local distillation"
    )

    @model_validator(mode="after")
    def _one_of(self):
        if (self.num_key_value_layers is None) == (self.fraction is None):
            raise ValueError("set exactly one of swiftkv.num_key_value_layers and swiftkv.fraction")
        return self


class ModelSection(_Section):
    source: str = Field(
        description="HF checkpoint dir: a SwiftKV checkpoint, or a base one converted on the fly"
    )
    swiftkv: SwiftKVOptions | None = Field(
        None, description="conversion options when source is a base checkpoint"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="weights dtype when loading"
    )
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    exact_kv_window: int | None = Field(
        None,
        ge=0,
        description="exact K/V (swiftkv config exact_kv_window W): the tokens that run layers >= l when served "
        "(replies, and the W prompt tokens before each reply) take exact K/V there, in training as in serving; "
        "0: off; default: the checkpoint's own (0 for a fresh conversion)",
    )

    @model_validator(mode="after")
    def _exact_kv_needs_layers(self):
        if self.exact_kv_window and self.swiftkv is not None and self.swiftkv.group_size > 1:
            raise ValueError(
                f"exact_kv_window={self.exact_kv_window} needs swiftkv.group_size=1 (an AcrossKV group shares one "
                "K/V; exact K/V are per layer)"
            )
        return self

    @field_validator("source")
    @classmethod
    def _expand(cls, v: str) -> str:
        return os.path.expandvars(os.path.expanduser(v))


class DataSource(_Section):
    path: str = Field(
        description="'sharegpt', a local .json/.jsonl/.parquet/.txt file, or a hub dataset name"
    )
    format: Literal["auto", "sharegpt", "messages", "openorca", "acemath", "lmsys", "text"] = Field(
        "auto",
        description="column layout (distill.data.LAYOUTS): sharegpt (conversations: from/value), messages "
        "(messages: role/content), openorca (system_prompt, question, response), acemath (messages with the "
        "user turn + answer), lmsys (conversation: role/content), text (text); auto: detected from the columns",
    )
    gated: bool = Field(
        False,
        description="a gated hub dataset: refused before any work unless a Hugging Face token is set (a local "
        "file in path needs none)",
    )
    split: str = Field("train", description="split of a hub dataset")
    weight: float = Field(1.0, gt=0, description="relative share of this source in the mix")
    max_samples: int | None = Field(None, ge=1, description="take at most this many samples from the source")
    max_tokens: int | None = Field(
        None, ge=16, description="cut each sample of this source to this many tokens (default: data.seq_len)"
    )
    min_prompt_tokens: int = Field(
        0,
        ge=0,
        description="> 0: one sample per conversation, cut after its last reply that starts at this many tokens "
        "or later (and before the cut), only that reply counted: a reply after a long prompt, the prompt-heavy "
        "requests SwiftKV serves; conversations without one are skipped",
    )
    max_reply_tokens: int | None = Field(
        None, ge=1, description="with min_prompt_tokens: count at most this many tokens of the reply"
    )

    @model_validator(mode="after")
    def _long_prompt_fits(self):
        if self.max_reply_tokens is not None and not self.min_prompt_tokens:
            raise ValueError("max_reply_tokens needs min_prompt_tokens > 0 (one scored reply per sample)")
        if self.max_tokens is not None and self.min_prompt_tokens >= self.max_tokens:
            raise ValueError(
                f"min_prompt_tokens={self.min_prompt_tokens} leaves no room for a reply within "
                f"max_tokens={self.max_tokens}"
            )
        return self


class DataSection(_Section):
    sources: list[DataSource] = Field(min_length=1)
    seq_len: int = Field(2048, ge=16, description="tokens per training sequence")
    packing: bool = Field(
        True, description="pack several samples per sequence (attention stays within a sample)"
    )
    loss_on: Literal["assistant", "all"] = Field("assistant", description="which tokens the loss counts")
    holdout: float = Field(0.02, ge=0, lt=1, description="fraction held out for evaluation")
    seed: int = 0
    num_proc: int | None = Field(
        None, ge=1, description="tokenizing processes (default: one per 10k rows, at most min(16, CPUs))"
    )
    cache_dir: str | None = Field(None, description="datasets cache folder (default: HF_DATASETS_CACHE)")
    tokenize_timeout_minutes: int = Field(
        120,
        ge=1,
        description="process-group timeout: other ranks wait this long for the main one to tokenize",
    )

    @model_validator(mode="after")
    def _sources_fit_rows(self):
        for i, source in enumerate(self.sources):
            if (source.max_tokens or 0) > self.seq_len:
                raise ValueError(f"sources.{i}.max_tokens={source.max_tokens} exceeds seq_len={self.seq_len}")
            if source.min_prompt_tokens >= (source.max_tokens or self.seq_len):
                raise ValueError(
                    f"sources.{i}.min_prompt_tokens={source.min_prompt_tokens} leaves no room for a reply within "
                    f"{source.max_tokens or self.seq_len} tokens (raise data.seq_len)"
                )
            if source.min_prompt_tokens and self.loss_on == "all":
                raise ValueError(
                    f"sources.{i}.min_prompt_tokens needs loss_on: assistant (a reply after a prompt is scored)"
                )
        return self


class LossSection(_Section):
    temperature: float = Field(2.0, gt=0, description="KL temperature T; the KL is scaled by T^2")
    kl_weight: float = Field(1.0, ge=0)
    mse_weight: float = Field(1.0, ge=0, description="MSE between the two paths' input to the last layer")
    normalize: Literal["counted", "positions"] = Field(
        "counted",
        description="counted: the KL and the MSE are means over the tokens the loss counts; positions: as the "
        "reference trainer (ArcticTraining projects/swiftkv), the KL summed over counted tokens divided by every "
        "position of the micro-batch, the MSE a mean over every position (prompt and padding too)",
    )
    chunk_tokens: int = Field(1024, ge=1, description="tokens per vocab-projection chunk (bounds memory)")
    exact_kv_replies: Literal["all", "last"] = Field(
        "last",
        description="with model.exact_kv_window: which replies of a packed sample the loss counts, each "
        "generated with exact K/V (last: each sample's last reply, after a history of SwiftKV K/V, earlier "
        "replies included, as a request re-sent without a prefix-cache hit, the served regime of "
        "docs/swiftkv.md; all: every reply, a chat continued in its own cache)",
    )


class OptimSection(_Section):
    type: Literal["adamw", "adarevision"] = Field(
        "adamw", description="adarevision: AdaGrad with the delayed-gradient revision (Bösen; uses lr only)"
    )
    lr: float = Field(2e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    schedule: Literal["linear", "cosine", "constant", "wsd"] = Field(
        "linear",
        description="after the warmup: linear or cosine decay to 0, constant, or wsd (warmup-stable-decay: "
        "constant, then a linear decay to 0 over the last decay_ratio of the steps)",
    )
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    decay_ratio: float = Field(
        0.2,
        gt=0,
        le=1,
        description="wsd only: share of the steps in the final decay (other schedules ignore it)",
    )
    grad_clip: float | None = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _decay_fits(self):
        if self.schedule == "wsd" and self.warmup_ratio + self.decay_ratio > 1:
            raise ValueError(
                f"warmup_ratio {self.warmup_ratio} + decay_ratio {self.decay_ratio} exceed 1 (no steps left)"
            )
        return self


class LoraOptions(_Section):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)


class TrainSection(_Section):
    micro_batch_size: int = Field(1, ge=1, description="sequences per device per step")
    grad_accum: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="optimizer steps (default: one epoch)")
    epochs: float = Field(1.0, gt=0)
    trainable: Literal["swiftkv", "lora", "all"] = Field(
        "swiftkv",
        description="swiftkv: norm/q/k/v_proj_swiftkv (the paper); lora: LoRA on them; all: refused (see below)",
    )
    lora: LoraOptions = LoraOptions()
    shared_lower_layers: bool = Field(True, description="compute layers < l once for teacher and student")
    gradient_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in backward (the GPU recipes need it)"
    )
    mixed_precision: Literal["no", "bf16"] = "no"
    seed: int = 0

    @field_validator("trainable")
    @classmethod
    def _fixed_teacher(cls, v: str) -> str:
        # the teacher is the same live weights in original mode: training all of them moves the teacher too,
        # and a frozen copy would double the weights and break the shared lower layers
        if v == "all":
            raise ValueError(
                "trainable=all would train against a moving teacher (teacher and student share the live "
                "weights); use trainable=swiftkv or trainable=lora"
            )
        return v


class CheckpointSection(_Section):
    every_steps: int = Field(200, ge=1)
    keep: int = Field(2, ge=1, description="how many full checkpoints to keep")
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the latest checkpoint")
    scar: ScarConfig | None = Field(None, description="prioritized running checkpoint (SCAR); off if absent")


# accelerate's tracker names (accelerate.utils.LoggerType, less "all": a recipe names what it logs to)
TRACKERS = Literal[
    "tensorboard", "wandb", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "aim", "swanlab"
]


class LogSection(_Section):
    every_steps: int = Field(1, ge=1)
    eval_every_steps: int | None = Field(
        None, ge=1, description="held-out KL every N steps (default: at the end)"
    )
    eval_batches: int = Field(8, ge=1)
    report_to: list[TRACKERS] = Field(
        [],
        description="experiment trackers fed through accelerate's tracker API beside log.jsonl (which stays the "
        "source of the reports): tensorboard (event files in output_dir/trackers), wandb, mlflow, ...; each "
        "must be installed (checked before any work)",
    )


class Recipe(_Section):
    """A whole distillation run."""

    output_dir: str
    model: ModelSection
    data: DataSection
    loss: LossSection = LossSection()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()
    comm: CommConfig = Field(
        CommConfig(), description="gradient communication on the DDP path (not DeepSpeed)"
    )

    @model_validator(mode="after")
    def _exact_kv_needs_replies(self):
        """With a window every scored position is exact (``exact_kv_positions``): a sample scored on every token
        keeps no SwiftKV K/V in the loss, so k/v_proj_swiftkv and norm_swiftkv would never train."""
        text = [i for i, s in enumerate(self.data.sources) if s.format == "text"]
        if self.model.exact_kv_window and (self.data.loss_on == "all" or text):
            which = (
                "data.loss_on: all" if self.data.loss_on == "all" else f"data.sources.{text[0]}.format: text"
            )
            raise ValueError(
                f"model.exact_kv_window={self.model.exact_kv_window} needs replies after a prompt: with {which} "
                "every position is scored, hence exact, and k/v_proj_swiftkv and norm_swiftkv get no gradient (to "
                "resolve, train on chat sources with data.loss_on: assistant, or set model.exact_kv_window=0)"
            )
        return self


class RecipeError(ValueError):
    """A recipe problem; ``str()`` is one line per problem."""


def _set(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
            continue
        if not isinstance(node, dict):
            raise RecipeError(f"recipe error: {dotted}: cannot set a key below a non-mapping value")
        node = node.setdefault(key, {})
    if isinstance(node, list) and keys[-1].isdigit() and int(keys[-1]) < len(node):
        node[int(keys[-1])] = value
    elif isinstance(node, dict):
        node[keys[-1]] = value
    else:
        raise RecipeError(f"recipe error: {dotted}: cannot set a key below a non-mapping value")


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read, override and validate a recipe; raise RecipeError listing every problem, one per line."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe error: {path} not found")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe error: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise RecipeError(f"recipe error: {path} must be a mapping at the top level")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"recipe error: override {item!r} is not key=value")
        _set(tree, key.strip(), yaml.safe_load(raw))
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "recipe"
            msg = (
                "unknown key"
                if err["type"] == "extra_forbidden"
                else err["msg"].removeprefix("Value error, ")
            )
            lines.append(f"recipe error: {where}: {msg}")
        raise RecipeError("\n".join(lines)) from None
