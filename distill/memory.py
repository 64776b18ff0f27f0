"""Per-GPU memory plan of a distillation run, from the model's config.json alone (no weights).

The numbers follow what this toolkit's training step keeps alive, not a generic transformer rule of thumb:

* **Model states** (DeepSpeed's own accounting, so ``estimate_zero{2,3}_model_states_mem_needs`` agree when
  every parameter trains): every weight in the 16-bit training dtype, on every GPU below ZeRO-3 and sharded at
  ZeRO-3 (plus the gathered working set: the largest module's weights and gradient); for the *trainable*
  parameters only (SwiftKV: ``norm_swiftkv`` and the ``*_proj_swiftkv``, ~5% of the model) 16-bit gradients
  (sharded from ZeRO-2), an fp32 gradient copy for the optimizer step (ZeRO-3: one ``sub_group_size`` at a
  time), the fp32 master copy and the optimizer's fp32 state (Adam: 2 values), sharded from ZeRO-1 or moved to
  the host with ``offload_optimizer``.
* **Activations** of ``micro_batch_size x seq_len`` tokens on the shared-lower-layers path: layers < l, the
  teacher's upper layers and the vocabulary head of the teacher run without building a graph (their weights are
  frozen and their inputs need no gradient), so only the student's upper layers, the SwiftKV K/V of each group
  and the loss keep tensors for backward.  Per student layer and token (``a`` = bytes of the activation dtype):
  both RMSNorm inputs in fp32 (``2 x 4h``), ``q_proj_swiftkv``'s input (``a h``), the attention's query, output
  and log-sum-exp (``2 a H d + 4 H``; sdpa/flash keep no ``seq x seq`` scores), and the MLP's gate, SiLU output
  and up projection (``3 a I``); per group, K after RoPE and V (``2 a K d``); ``norm_swiftkv``'s normalized
  input and output (``2 a h``); the MSE difference (``4h``) and the KD rows of both paths (``2 a h``); packed
  rows' block-diagonal mask and sdpa's additive copy (``(1 + a) seq^2`` per row).  With gradient checkpointing
  a student layer keeps only its input (``a h``).  On top comes the largest of the transients that never
  coexist: the KD loss's ``chunk_tokens x vocab`` fp32 logits in ``KD_LOGIT_COPIES`` copies, or one layer's
  backward (``a (2 I + 4 h)`` per token, plus that layer's recomputed activations under checkpointing).  The
  naive two-pass baseline (``shared_lower_layers: false``) also holds both passes' logits and hidden states.
* **Communication buffers** from the DeepSpeed config: the gradient reduce bucket (two with ``overlap_comm``),
  the ZeRO-1/2 parameter all-gather bucket and the ZeRO-3 prefetch bucket, each capped by what there is to move.
* **Least-squares init** (``model.swiftkv.init: lstsq``, ``swiftkv.lstsq_init``), a separate phase before the
  optimizer exists: one layer's weights (plus the ZeRO-3 shards), H^T H, the ridge system and its LU factor
  (``3 x 8 (h+1)^2``), one group's K/V moments and copy weights (``4 x 8 (h+1) K d``), and one micro-batch of
  activations (a layer's forward plus the float64 features, ``8 (h+1)`` per token).

The activation terms are checked against the peak memory of real CPU runs of the objective
(tests/distill/test_check.py); the model states against DeepSpeed's estimators.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftkv.flops import Shape

GB = 1e9
KD_LOGIT_COPIES = 6  # fp32 [chunk, vocab] tensors alive at the loss's peak (recomputed chunk in backward)
_DS_DEFAULTS = {  # DeepSpeed's defaults for the keys the plan reads (deepspeed/runtime/zero/config.py)
    "reduce_bucket_size": 5e8,
    "allgather_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "sub_group_size": 1e9,
    "overlap_comm": None,  # DeepSpeed turns it on for ZeRO-3 and off below
}
_DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb


@dataclass(frozen=True)
class Parallel:
    """How the run is spread: processes, ZeRO stage (0 = no DeepSpeed: DDP or one process) and its buffers."""

    processes: int = 1
    stage: int = 0
    nodes: int = 1  # machines the processes run on (the plan is per GPU; ZeRO shards over all processes)
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_bucket: int = int(_DS_DEFAULTS["reduce_bucket_size"])
    allgather_bucket: int = int(_DS_DEFAULTS["allgather_bucket_size"])
    prefetch_bucket: int = int(_DS_DEFAULTS["stage3_prefetch_bucket_size"])
    sub_group: int = int(_DS_DEFAULTS["sub_group_size"])
    overlap_comm: bool = False

    def __post_init__(self):
        if self.processes < 1 or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"processes={self.processes} must be >= 1 and stage={self.stage} in 0..3")
        if self.nodes < 1 or self.processes % self.nodes:
            raise ValueError(f"processes={self.processes} must be a multiple of nodes={self.nodes}")
        if self.offload_params and self.stage != 3:
            raise ValueError(f"offload_param needs ZeRO-3, got stage={self.stage}")

    @classmethod
    def from_deepspeed(cls, processes: int, ds: dict, nodes: int = 1) -> Parallel:
        """From a DeepSpeed config dict (``zero_optimization`` section); missing keys take DeepSpeed's defaults."""
        zero = ds.get("zero_optimization", {}) or {}
        stage = int(zero.get("stage", 0))

        def get(key):
            value = zero.get(key, _DS_DEFAULTS[key])
            return int(float(value)) if value not in (None, "auto") else int(_DS_DEFAULTS[key] or 0)

        def device(key):
            return (zero.get(key) or {}).get("device", "none") in ("cpu", "nvme")

        overlap = zero.get("overlap_comm", _DS_DEFAULTS["overlap_comm"])
        return cls(
            processes=processes,
            stage=stage,
            nodes=nodes,
            offload_optimizer=device("offload_optimizer"),
            offload_params=device("offload_param"),
            reduce_bucket=get("reduce_bucket_size"),
            allgather_bucket=get("allgather_bucket_size"),
            prefetch_bucket=get("stage3_prefetch_bucket_size"),
            sub_group=get("sub_group_size"),
            overlap_comm=bool(stage == 3 if overlap is None else overlap),
        )


@dataclass(frozen=True)
class Params:
    """Parameter counts of the SwiftKV model (teacher weights + the new projections)."""

    total: int
    trainable: int
    largest_module: int  # ZeRO-3 gathers one module's weights at a time
    largest_trainable_module: int

    @classmethod
    def of(cls, shape: Shape, config: dict, trainable: str = "swiftkv", lora_r: int = 16) -> Params:
        s = shape
        h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
        bias = bool(config.get("attention_bias")) or str(config.get("model_type", "")).startswith("qwen2")
        mlp_bias = bool(config.get("mlp_bias"))
        head = 0 if config.get("tie_word_embeddings") else s.vocab * h
        layer = (h * q + 2 * h * kv + q * h + 3 * h * s.intermediate + 2 * h) + bias * (q + 2 * kv)
        layer += mlp_bias * (2 * s.intermediate + h)
        upper = s.layers - s.num_key_value_layers
        q_swift, kv_swift = h * q + bias * q, 2 * (h * kv + bias * kv)
        swiftkv = h + upper * q_swift + s.groups * kv_swift
        total = s.vocab * h + head + s.layers * layer + h + swiftkv
        largest = max(s.vocab * h, h * s.intermediate, h * q)
        if trainable == "swiftkv":
            return cls(total, swiftkv, largest, q_swift if upper else h)
        if trainable == "lora":
            lora = h + upper * lora_r * (h + q) + s.groups * 2 * lora_r * (h + kv)
            return cls(total, lora, largest, lora_r * (h + q) if upper else h)
        if trainable == "all":
            return cls(total, total, largest, largest)
        raise ValueError(f"trainable={trainable!r}: expected swiftkv, lora or all")


def model_states(
    params: Params, par: Parallel, weight_bytes: int = 2, optimizer_values: int = 2
) -> dict[str, int]:
    """Per-GPU bytes of weights, gradients and optimizer state.

    ``weight_bytes``: the training dtype of the weights.  Under DeepSpeed 16-bit weights come with fp32 master
    weights and fp32 gradients for the step; without DeepSpeed (stage 0) the optimizer works on the weights'
    own dtype.  ``optimizer_values``: optimizer state values per trainable parameter (Adam 2)."""
    n, t, w = par.processes, params.trainable, weight_bytes
    if par.stage == 0:
        return {"weights": params.total * w, "gradients": t * w, "optimizer state": optimizer_values * w * t}
    master = w < 4
    state_shard = n
    grad_shard = n if par.stage >= 2 else 1
    on_gpu = not par.offload_optimizer
    out = {
        "weights": 0 if par.offload_params else params.total * w // (n if par.stage == 3 else 1),
        "gradients": t * w // grad_shard if on_gpu or par.stage == 1 else 0,
    }
    if par.stage == 3:  # gathered for forward/backward: the largest module's weights and its gradient
        out["zero3 gathered"] = w * (params.largest_module + params.largest_trainable_module)
    fp32_grads = t // state_shard if par.stage < 3 else min(par.sub_group, t // n)  # ZeRO-3: per sub-group
    out["fp32 gradients"] = 4 * fp32_grads * master * on_gpu
    out["fp32 master weights"] = 4 * t // state_shard * master * on_gpu
    out["optimizer state"] = 4 * optimizer_values * t // state_shard * on_gpu
    return out


@dataclass(frozen=True)
class Batch:
    """What one micro-batch step computes."""

    micro_batch: int
    seq_len: int
    chunk_tokens: int = 1024
    act_bytes: int = 2
    shared_lower_layers: bool = True
    attention: str = "sdpa"
    packed: bool = True  # several samples per row: a block-diagonal mask instead of sdpa's is_causal

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


def _layer_saved(s: Shape, b: Batch) -> int:
    """Bytes per token one student upper layer keeps for backward (see the module docstring)."""
    a = b.act_bytes
    saved = 2 * (4 * s.hidden + 4) + a * s.hidden + 2 * a * s.heads * s.head_dim + 4 * s.heads
    if b.attention == "eager":  # scores and probabilities [heads, seq, seq]
        saved += 2 * a * s.heads * b.seq_len
    return saved + 3 * a * s.intermediate


def _layer_working(s: Shape, b: Batch) -> int:
    """Bytes per token of one layer's transient tensors (gradients of its MLP and residual stream)."""
    return b.act_bytes * (2 * s.intermediate + 4 * s.hidden)


def activations(s: Shape, b: Batch, checkpointing: bool) -> dict[str, int]:
    """Per-GPU bytes of the tensors autograd keeps, and the larger of the two transient peaks on top of them
    (the KD loss's logit chunk, or one layer's backward, recomputed first under checkpointing)."""
    tokens, a = b.tokens, b.act_bytes
    upper = s.layers - s.num_key_value_layers
    per_layer = tokens * _layer_saved(s, b)
    rows = s.hidden if b.shared_lower_layers else s.vocab  # what the KD chunks slice: hidden states or logits
    out = {
        "student layers": upper * tokens * a * s.hidden if checkpointing else upper * per_layer,
        # each group's K and V after RoPE, and norm_swiftkv's normalized input and output
        "swiftkv K/V": tokens * (s.groups * 2 * a * s.kv_heads * s.head_dim + 2 * a * s.hidden),
        "loss inputs": tokens * (4 * s.hidden + 2 * a * rows),  # MSE difference, KD rows of both paths
        # packed rows: a block-diagonal bool mask and sdpa's additive copy of it
        "attention mask": b.packed * b.micro_batch * b.seq_len**2 * (1 + a),
    }
    kd = KD_LOGIT_COPIES * 4 * min(b.chunk_tokens, tokens) * s.vocab
    peaks = {  # transients that never coexist: the largest is the peak on top of what autograd keeps
        "KD logit chunk (peak)": kd,
        "one layer's backward (peak)": tokens * _layer_working(s, b) + checkpointing * per_layer,
    }
    if not b.shared_lower_layers:  # two full passes: both logits and all hidden states until the loss
        full = 2 * tokens * a * (s.vocab + (s.layers + 1) * s.hidden)
        peaks["both passes' logits, hidden states, KD chunk (peak)"] = full + kd
    name = max(peaks, key=peaks.get)
    out[name] = peaks[name]
    return out


def comm_buffers(params: Params, par: Parallel, grad_bytes: int = 2) -> dict[str, int]:
    """Per-GPU bytes of communication buckets (DeepSpeed's sizes are in elements)."""
    if par.processes == 1:
        return {}
    t = params.trainable
    if par.stage == 0:
        return {"DDP buckets": min(_DDP_BUCKET_BYTES, t * grad_bytes) * 2}
    out = {"reduce bucket": min(par.reduce_bucket, t) * grad_bytes * (2 if par.overlap_comm else 1)}
    if par.stage < 3:
        out["allgather bucket"] = min(par.allgather_bucket, t) * grad_bytes
    else:
        out["prefetch bucket"] = min(par.prefetch_bucket, params.total) * grad_bytes
    return out


def lstsq_init(s: Shape, params: Params, b: Batch, par: Parallel, weight_bytes: int = 2) -> dict[str, int]:
    """Per-GPU bytes of the least-squares K/V init (``swiftkv.lstsq_init``), which runs before the optimizer
    exists, layer by layer on every rank: one layer's weights (gathered under ZeRO-3, beside this rank's
    shards), H^T H with the ridge system and its LU factor, one group's K/V moments and copy weights (float64),
    and one micro-batch of activations (the batches' hidden states wait on the host)."""
    h1, kv = s.hidden + 1, s.kv_heads * s.head_dim
    layer = max(s.vocab * s.hidden, (params.total - 2 * s.vocab * s.hidden) // s.layers)
    out = {}
    if par.stage == 3 and not par.offload_params:
        out["weights (ZeRO-3 shards)"] = params.total * weight_bytes // par.processes
    out["one layer's weights"] = weight_bytes * layer
    out["H^T H, ridge system, LU factor"] = 3 * 8 * h1 * h1
    out["one group's K/V moments + copies"] = 4 * 8 * h1 * kv
    out["one batch of activations"] = b.tokens * (_layer_working(s, b) + 8 * h1)
    return out
