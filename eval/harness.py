"""A thin lm-eval wrapper: our model types registered in-process, our offline tasks included.

Stock lm-eval works too, through the remote code saved beside the weights:
``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path TASKS --tasks ...``.
GPU users evaluate the reference's hub tasks the same way (see README: ARC-C 25-shot, Winogrande 5-shot,
HellaSwag 10-shot, TruthfulQA 0-shot mc2, MMLU 5-shot, MMLU-CoT (mmlu_flan_cot_zeroshot), GSM8K 5-shot CoT).

``device`` is ``cpu``, ``cuda`` (one GPU) or ``auto`` (lm-eval's ``parallelize``: ``device_map="auto"`` over
every visible GPU); ``dtype`` float32, bfloat16 or float16, as ``eval.quality``.

A checkpoint with exact K/V (``exact_kv_window`` W) is scored as served: lm-eval's HF model scores a request by
one forward over context + continuation, and ``ServedHFLM`` marks the continuation (and the W prompt tokens
before it) as generated, so they take exact K/V as they would when a server generates them.  Rolling
log-likelihood (document perplexity) scores text nobody generated: it runs the plain forward, which treats the
whole input as one prompt (its last W positions exact), as stock lm-eval does for every request: the
conservative number.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lm_eval.models.huggingface import HFLM

from swiftkv.modeling_swiftkv import exact_kv_positions


class ServedHFLM(HFLM):
    """lm-eval's HF causal LM whose log-likelihood forwards mark each request's continuation as generated
    (module docstring); for other models it is lm-eval's own."""

    _continuations: dict[int, dict[tuple[int, ...], int]] | None = None
    _rolling = False

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        # a document's windows reach _loglikelihood_tokens as continuations, but are prompt text: score them so
        self._rolling = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm)
        finally:
            self._rolling = False

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        # lm-eval batches and pads the requests itself: keep each one's input (as lm-eval cuts it) -> continuation
        # length, keyed by input length, so that _model_call can find every row's continuation
        config = self.model.config
        if getattr(config, "exact_kv_window", 0) and getattr(config, "swiftkv", False) and not self._rolling:
            self._continuations = {}
            for _, context, continuation in requests:
                inp = (context + continuation)[-(self.max_length + 1) :][:-1]
                self._continuations.setdefault(len(inp), {})[tuple(inp)] = len(continuation)
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        finally:
            self._continuations = None

    def generated_positions(self, inps: torch.Tensor) -> torch.Tensor:
        """[batch, seq] bool: the positions whose logits score a continuation token (lm-eval pads rows on the
        right with 0)."""
        scored = torch.zeros(inps.shape, dtype=torch.bool)
        for b, row in enumerate(inps.tolist()):
            last = max((i for i, t in enumerate(row) if t), default=-1)
            for length, inputs in self._continuations.items():
                contlen = inputs.get(tuple(row[:length])) if length > last else None
                if contlen is not None:
                    scored[b, max(length - contlen, 0) : length] = True
                    break
            else:
                raise RuntimeError(
                    f"lm-eval row {b} matches no request (an lm-eval change in how rows are built)"
                )
        return scored

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if self._continuations is None:
            return super()._model_call(inps, attn_mask, labels)
        positions = torch.arange(inps.shape[1]).expand(inps.shape[0], -1)
        exact = exact_kv_positions(
            self.generated_positions(inps), positions, self.model.config.exact_kv_window
        )
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=self.device.type,
                dtype=self.mixed_precision_dtype,
                enabled=self.mixed_precision_dtype is not None,
            ),
        ):
            return self.model(inps, use_cache=False, swiftkv_exact_mask=exact.to(inps.device)).logits


def task_manager(tasks: list[str], tasks_dir: str | Path):
    """lm-eval's task index over ``tasks_dir``, with lm-eval's own tasks only when ``tasks`` names one of them:
    indexing its thousands of task files takes some 10 s a call, longer than scoring the job's quick tasks."""
    from lm_eval.tasks import TaskManager

    ours = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return ours if set(tasks) <= set(ours.all_tasks) else TaskManager(include_path=str(tasks_dir))


def run_harness(
    model_dir: str | Path,
    tasks: list[str],
    tasks_dir: str | Path,
    limit: int | None = None,
    max_length: int = 1024,
    batch_size: int = 4,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, dict[str, float]]:
    """Evaluate ``model_dir`` on ``tasks`` and return {task: {metric: value}}."""
    import lm_eval

    import swiftkv  # noqa: F401  (registers llama_swiftkv / qwen2_swiftkv with the Auto classes)

    from .quality import check_placement

    check_placement(device, dtype)
    model = ServedHFLM(
        pretrained=str(model_dir),
        dtype=dtype,
        backend="causal",
        max_length=max_length,
        batch_size=batch_size,
        **({"parallelize": True} if device == "auto" else {"device": device}),
    )
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=tasks,
        task_manager=task_manager(tasks, tasks_dir),
        limit=limit,
        log_samples=False,
        bootstrap_iters=0,
    )
    out = {}
    for task, metrics in results["results"].items():
        out[task] = {
            k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k
        }
    return out
