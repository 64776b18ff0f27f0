"""Steps, tokens and hours of a distillation run, from the recipe, the model's config.json and the launch.

``swiftkv check`` prints this next to the memory plan, so a 64- or 128-GPU run is sized before it is
booked.  The numbers are a plan, not a measurement:

* **Rows.** A sample is one rendered conversation of ``sample_tokens`` tokens on average (measured on the rows
  ``check`` reads, or stated with ``--sample-tokens``), at most ``seq_len``.  Packed, the samples fill
  ``samples x sample_tokens / seq_len`` rows (a lower bound: a row is closed when the next sample does not
  fit); unpacked, every sample is one row.  Every row is ``seq_len`` positions long either way (padding is
  computed too), so unpacked short samples cost as much as full rows.
* **Steps.** ``epochs x rows / global_batch`` (``train.max_steps`` when set), with ``global_batch =
  micro_batch_size x grad_accum x processes``: the global batch, and with it the number of optimizer steps,
  changes with the number of GPUs unless ``grad_accum`` is rescaled.
* **FLOPs per row** (multiply-add = 2), ``swiftkv.flops``'s counting over ``n = seq_len`` positions, attention
  as one causal sequence of ``n`` (an upper bound for packed rows, whose samples attend only within
  themselves): the shared lower layers once; the teacher's upper layers and head; the student's upper layers
  (queries from ``q_proj_swiftkv``, one K/V per group) and head; backward through the student only (the
  activation gradients of its matmuls, once more their FLOPs, and of its attention, twice; the weight
  gradients of the trainable parameters, ``2 x trainable`` per position); and with gradient checkpointing the
  student's upper layers once more, up to their MLP's down projection (where torch's non-reentrant
  checkpointing stops recomputing).  Layers < l build no graph, checkpointed or not.  The KD heads are counted on every position (the loss projects only
  counted ones: an upper bound).
* **Hours** = steps x global_batch x FLOPs per row / (processes x ``tflops``), where ``tflops`` is the
  achieved per-GPU throughput the user states (``--tflops``; the default is an assumption, printed as such).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swiftkv.flops import Shape, attention_flops, kv_flops, projection_flops

DEFAULT_TFLOPS = 350.0  # achieved bf16 TFLOP/s per GPU assumed when none is stated (~35% of an H100's peak)


def training_flops_per_row(
    s: Shape, seq_len: int, trainable: int, checkpointing: bool, shared_lower_layers: bool = True
) -> int:
    """FLOPs of one ``seq_len`` row through forward, loss and backward (see the module docstring)."""
    n, l, upper = seq_len, s.num_key_value_layers, s.layers - s.num_key_value_layers
    lower = n * l * (projection_flops(s) + kv_flops(s)) + l * attention_flops(s, n)
    teacher_upper = n * upper * (projection_flops(s) + kv_flops(s)) + upper * attention_flops(s, n)
    student_matmuls = n * upper * projection_flops(s) + n * kv_flops(s) * s.groups
    student_attn = upper * attention_flops(s, n)
    head = 2 * n * s.hidden * s.vocab
    forward = (
        lower * (1 if shared_lower_layers else 2) + teacher_upper + student_matmuls + student_attn + 2 * head
    )
    backward = student_matmuls + 2 * student_attn + head + 2 * n * trainable
    # checkpointing re-runs each student layer up to its last matmul (MLP down): torch's non-reentrant
    # checkpoint stops recomputing once the tensors backward needs are back
    recompute = n * upper * (projection_flops(s) - 2 * s.hidden * s.intermediate) + student_attn
    recompute *= checkpointing
    return forward + backward + recompute


@dataclass(frozen=True)
class Budget:
    """A run's size: samples, rows, optimizer steps, tokens and hours."""

    samples: int
    sample_tokens: float
    rows: int
    global_batch: int
    steps: int
    flops_per_row: int
    processes: int
    tflops: float
    seq_len: int

    @property
    def tokens(self) -> int:
        """Positions processed (rows x seq_len, padding included) over all steps."""
        return self.steps * self.global_batch * self.seq_len

    @property
    def hours(self) -> float:
        return (
            self.steps * self.global_batch * self.flops_per_row / (self.processes * self.tflops * 1e12) / 3600
        )


def plan_budget(
    shape: Shape,
    trainable: int,
    *,
    samples: int,
    sample_tokens: float,
    seq_len: int,
    packing: bool,
    micro_batch: int,
    grad_accum: int,
    processes: int,
    epochs: float,
    max_steps: int | None,
    checkpointing: bool,
    shared_lower_layers: bool = True,
    tflops: float = DEFAULT_TFLOPS,
) -> Budget:
    """The run's rows, steps, tokens and hours (see the module docstring for each rule)."""
    sample_tokens = min(sample_tokens, seq_len)
    rows = math.ceil(samples * sample_tokens / seq_len) if packing else samples
    global_batch = micro_batch * grad_accum * processes
    steps = max_steps or max(1, math.ceil(epochs * (rows // global_batch)))
    return Budget(
        samples=samples,
        sample_tokens=sample_tokens,
        rows=rows,
        global_batch=global_batch,
        steps=steps,
        flops_per_row=training_flops_per_row(shape, seq_len, trainable, checkpointing, shared_lower_layers),
        processes=processes,
        tflops=tflops,
        seq_len=seq_len,
    )
