"""The checkpoints ``swiftkv gpu-check-vllm`` serves and the transformers reference it judges them against.

``build_checkpoints`` makes the tiny random checkpoints of every row (seeded: vLLM's own Llama as the control, SwiftKV
50% plain, with AcrossKV and with exact K/V, Qwen2 and Qwen3).  The reference is this package's own model in
transformers, fp32, prefilled in the engine's chunks; it runs in ``--reference-python`` (the serving environment
often pins an older transformers than the SwiftKV classes need), in one child process that serves every row
(``ReferenceProcess``; ``python -m eval.serving.vllm.gpu_check_reference`` is that child).  Nothing here imports
vLLM: the check itself is :mod:`eval.serving.vllm.gpu_check`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

# how the child starts (``python -m``)
MODULE = "eval.serving.vllm.gpu_check_reference"
TINY = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)  # fmt: skip  (head_dim 64)
LM_HEAD_STD = 0.2  # peaked next-token distributions, so bf16 ties rarely decide greedy tokens
WINDOW = 8  # the exact K/V rows' window: >= 1 + the n-gram drafts, as the plugin requires


def build_checkpoints(out: Path, dtype: str) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    import swiftkv.convert

    def base(name: str, config) -> Path:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0, LM_HEAD_STD)
            for n, p in model.named_parameters():  # non-trivial biases and head norms
                if n.endswith("bias"):
                    p.normal_(0, 0.02)
                elif n.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1.0, 0.2)
        model.to(getattr(torch, dtype)).save_pretrained(out / name)
        return out / name

    common = dict(TINY, bos_token_id=None, eos_token_id=None)
    original = base("original", LlamaConfig(**common))
    convert = swiftkv.convert.convert
    return {
        "original": original,
        "swiftkv50": convert(original, out / "swiftkv50", swiftkv_fraction=0.5),
        "swiftkv50_g2": convert(original, out / "swiftkv50_g2", swiftkv_fraction=0.5, group_size=2),
        "swiftkv50_exact": convert(original, out / "swiftkv50_exact", swiftkv_fraction=0.5, exact_kv_window=WINDOW),
        "qwen2_swiftkv50": convert(base("qwen2", Qwen2Config(**common)), out / "qwen2_swiftkv50", swiftkv_fraction=0.5),
        "qwen3_swiftkv50_g2": convert(
            base("qwen3", Qwen3Config(**common, head_dim=64)), out / "qwen3_swiftkv50_g2", swiftkv_fraction=0.5,
            group_size=2,
        ),
    }  # fmt: skip


REFERENCE_PROBE = """
from importlib.metadata import requires, version
from packaging.requirements import Requirement
need = [Requirement(r) for r in requires("swiftkv-toolkit") if Requirement(r).name == "transformers"][0]
if not need.specifier.contains(version("transformers"), prereleases=True):
    print(f"transformers {version('transformers')} (this package needs {need.specifier})")
"""


def reference_unusable(python: str) -> str | None:
    """Why ``python`` cannot run the transformers reference (this package's model classes need the transformers
    it pins; a serving environment often has vLLM's older one), or None."""
    probe = subprocess.run([python, "-c", REFERENCE_PROBE], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"it cannot import this package's requirements ({probe.stderr.strip().splitlines()[-1]})"
    return probe.stdout.strip() or None


class ReferenceProcess:
    """The transformers reference of every row in one child process of ``python`` (this module run with ``-m``), started
    by the first row that asks: a process a row paid torch's and transformers' import (and on a GPU a CUDA
    context) each time, for a tiny model that loads in a moment.  A job is one JSON line on the child's stdin, its
    answer one JSON line on the child's stdout; a job past its timeout, or a child that died, ends that child with
    the row's error, and the next row starts a fresh one (its stderr goes to ``tmp/reference.log``)."""

    def __init__(self, python: str, tmp: Path, chunk: int):
        self.python, self.log, self.chunk = python, tmp / "reference.log", chunk
        self.process: subprocess.Popen | None = None

    def run(self, model_dir: Path, requests: list[tuple[list[int], list[int]]], timeout_s: float) -> dict:
        """``reference_logprobs`` of ``requests`` on ``model_dir``: {"requests": [...]} or {"error": ...}."""
        import selectors

        if self.process is None:
            with open(self.log, "a") as log:
                self.process = subprocess.Popen(
                    [self.python, "-m", MODULE], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log, text=True,
                )  # fmt: skip
        job = json.dumps({"model": str(model_dir), "requests": requests, "chunk": self.chunk})
        answer = ""
        try:
            self.process.stdin.write(job + "\n")
            self.process.stdin.flush()
            with selectors.DefaultSelector() as ready:
                ready.register(self.process.stdout, selectors.EVENT_READ)
                if ready.select(timeout_s):
                    answer = self.process.stdout.readline()
        except BrokenPipeError:  # the child is gone: its log says why
            pass
        if answer:
            return json.loads(answer)
        timed_out = self.process.poll() is None
        self.process.kill()
        self.close()
        if timed_out:
            return {"error": f"no result within {timeout_s:.0f} s"}
        return {"error": self.log.read_text()[-1500:] or "the reference process exited"}

    def close(self) -> None:
        """End the child: its stdin closed ends its loop (a child that does not end is killed)."""
        if self.process is None:
            return
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.process = None


def serve_references(jobs) -> None:
    """The child of ``ReferenceProcess``: for each JSON job line read from ``jobs``, one JSON line on stdout.  Anything
    else that writes to stdout (a library's print) goes to stderr, so it cannot corrupt an answer; a job that
    fails answers its error and the next one still runs."""
    import traceback

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in jobs:
        job = json.loads(line)
        try:
            answer = {"requests": reference_logprobs(Path(job["model"]), job["requests"], job["chunk"])}
        except Exception:  # this row's failure, reported as a failed process's was
            answer = {"error": traceback.format_exc()[-1500:]}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def reference_logprobs(
    model_dir: Path, requests: list[tuple[list[int], list[int]]], chunk: int
) -> list[dict]:
    """For each (prompt, continuation): transformers fp32 log-probabilities of the continuation's tokens (the
    model's own inference path: the prompt prefilled in chunks of ``chunk`` tokens with its length given, so that
    exact K/V land on its last W tokens and the generated ones as a server puts them whatever its chunks, then one
    token per step) and the gap to the best token at each step."""
    import torch
    from transformers import AutoModelForCausalLM

    import swiftkv  # noqa: F401  (registers the SwiftKV classes)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for prompt, continuation in requests:
            ids = torch.tensor([prompt], device=device)
            step = None
            prompt_len = {"swiftkv_prompt_len": len(prompt)} if hasattr(model, "set_mode") else {}
            for start in range(0, len(prompt), chunk):
                cache = None if step is None else step.cache
                step = model(
                    ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1, **prompt_len
                )
            logprobs, gaps = [], []
            for token in continuation:
                dist = step.logits[0, -1].float().log_softmax(-1)
                logprobs.append(dist[token].item())
                gaps.append((dist.max() - dist[token]).item())
                step = model(torch.tensor([[token]], device=device), cache=step.cache, use_cache=True)
            out.append({"logprobs": logprobs, "gaps": gaps})
    return out


def main() -> int:
    """``ReferenceProcess``'s child: answers the jobs on stdin until it closes."""
    serve_references(sys.stdin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
