"""A thin lm-eval wrapper: our model types registered in-process, our offline tasks included.

Stock lm-eval works too, through the remote code saved beside the weights:
``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path TASKS --tasks ...``.
GPU users evaluate the reference's hub tasks the same way (see README: ARC-C 25-shot, Winogrande 5-shot,
HellaSwag 10-shot, TruthfulQA 0-shot mc2, MMLU 5-shot, MMLU-CoT (mmlu_flan_cot_zeroshot), GSM8K 5-shot CoT).

``device`` is ``cpu``, ``cuda`` (one GPU) or ``auto`` (lm-eval's ``parallelize``: ``device_map="auto"`` over
every visible GPU); ``dtype`` float32, bfloat16 or float16, as ``eval.quality``.
"""

from __future__ import annotations

from pathlib import Path


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
    from lm_eval.tasks import TaskManager

    import swiftkv  # noqa: F401  (registers llama_swiftkv / qwen2_swiftkv with the Auto classes)

    from .quality import check_placement

    check_placement(device, dtype)
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={
            "pretrained": str(model_dir),
            "dtype": dtype,
            "backend": "causal",
            "max_length": max_length,
            **({"parallelize": True} if device == "auto" else {}),
        },
        tasks=tasks,
        task_manager=TaskManager(include_path=str(tasks_dir)),
        limit=limit,
        batch_size=batch_size,
        device=None if device == "auto" else device,
        log_samples=False,
        bootstrap_iters=0,
    )
    out = {}
    for task, metrics in results["results"].items():
        out[task] = {
            k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k
        }
    return out
