"""The vLLM plugin tests' case runner: vLLM's offline ``LLM`` on token ids, several engines in one process, with
what the tests inspect (every call of the SwiftKV decode stack, cache-owning layers, compiled units, EAGLE-3
auxiliary hidden states, KV-cache scales, prefix-cache hits, preemptions, prompt log-probabilities).

Runs inside the vLLM venv (``scripts/setup_vllm_cpu.sh``), with the CPU engine defaults of
``eval.serving.vllm.cpu``.

    python -m tests.helpers.vllm_cases --model out/tiny-swiftkv --prompts '[[5, 6, 7], [8, 9]]' --max-tokens 8
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from eval.serving.vllm.cpu import cpu_environment, make_llm


@contextlib.contextmanager
def fixed_folder(name: str) -> Iterator[Path]:
    """An empty folder at the same path in every run (under the toolkit's cache), this run's alone while in use.

    vLLM keys its compiled-graph cache on the checkpoint's path among the config's fields, so a compiled engine
    over a tiny checkpoint rebuilt at a new temp path compiles again in every run (~20 s more to start); built at
    a fixed path it loads what the last run compiled."""
    from toolkit.artifacts import cache_dir

    folder = cache_dir() / "tests" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pytest run waits here rather than rebuilding it under us
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        yield folder


def run_cases(cases: list[dict], tmp: Path) -> list[dict]:
    """All ``cases`` (``run_case``) in one vLLM-venv process started from the tests' venv; their results in order."""
    import subprocess

    from .ci import VLLM_PYTHON

    root = Path(__file__).resolve().parents[2]
    (tmp / "cases.json").write_text(json.dumps(cases))
    # the sockets and caches under ``tmp`` (``--tmp``), the system temp folder left as it is: torch's inductor keeps
    # its precompiled C++ header there (``tempfile.gettempdir()``, whatever TORCHINDUCTOR_CACHE_DIR says), and under
    # a TMPDIR of the test's own every process rebuilt it before loading a cached CPU kernel (~7 s, 150 MB)
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-m", "tests.helpers.vllm_cases", "--cases", str(tmp / "cases.json"), "--out",
         str(tmp / "out.json"), "--tmp", str(tmp)],
        cwd=root, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


def run_step(llm, step: dict) -> dict:
    """One ``generate`` call: ``{"prompts", "max_tokens"=8, "prompt_logprobs"=None, "logprobs"=None,
    "alone"=False}`` -> the greedy tokens, each request's prefix-cache hits, (if asked) prompt log-probabilities
    of the prompt tokens and, per generated token, ``{"chosen": its log-probability, "top": the ``logprobs``
    largest}``; or the error.  ``alone``: one ``generate`` call per prompt, so each request is served by itself."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=step.get("max_tokens", 8),
        ignore_eos=True,
        detokenize=False,
        prompt_logprobs=step.get("prompt_logprobs"),
        logprobs=step.get("logprobs"),
    )
    batches = [[p] for p in step["prompts"]] if step.get("alone") else [step["prompts"]]
    try:
        outputs = [
            o
            for batch in batches
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        ]
    except Exception as exc:  # a refused request: the test checks the message and that the engine serves on
        return {"error": f"{type(exc).__name__}: {exc}"}
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "cached": [o.num_cached_tokens for o in outputs],
    }
    if step.get("logprobs") is not None:
        result["logprobs"] = [
            [
                {"chosen": lp[token].logprob, "top": sorted((x.logprob for x in lp.values()), reverse=True)}
                for lp, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ]
            for o in outputs
        ]
    if step.get("prompt_logprobs") is not None:  # the prompt token's own log-probability at each position
        result["prompt_logprobs"] = [
            [
                None if lp is None else lp[token].logprob
                for lp, token in zip(o.prompt_logprobs, o.prompt_token_ids, strict=True)
            ]
            for o in outputs
        ]
    return result


class StackRecorder(torch.nn.Module):
    """Stands in front of one of the SwiftKV model's compiled stacks and records what each call receives: the
    inputs' data pointers and rows, and the batch descriptor and CUDA-graph mode vLLM dispatches it with."""

    def __init__(self, stack: torch.nn.Module, log: list):
        super().__init__()
        self.stack, self.log = stack, log

    def forward(self, *args):
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        descriptor = context.batch_descriptor
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.log.append(
            {
                "ptrs": [t.data_ptr() for t in tensors],
                "rows": [len(t) for t in tensors],
                "descriptor": None if descriptor is None else descriptor.num_tokens,
                "mode": context.cudagraph_runtime_mode.name,
            }
        )
        return self.stack(*args)


def _record_stacks(model) -> None:  # module level: apply_model pickles it to tensor-parallel workers
    inner = model.model
    inner.stack_log = {"prefill": [], "decode": []}
    inner.prefill_stack = StackRecorder(inner.prefill_stack, inner.stack_log["prefill"])
    inner.decode_stack = StackRecorder(inner.decode_stack, inner.stack_log["decode"])


def _stack_calls(model) -> dict:
    """Per forward: the prefill stack's rows and the decode stack's call, with the static buffers' pointers."""
    inner = model.model
    buffers = [
        getattr(inner, name, None) for name in ("decode_positions", "decode_hidden", "decode_residual")
    ]
    return {
        "buffers": [None if b is None else b.data_ptr() for b in buffers],
        "tokens": [call["rows"][0] for call in inner.stack_log["prefill"]],
        "decode": inner.stack_log["decode"],
    }


def _opaque_attention(model) -> None:
    """Take the attention branch vLLM takes on CUDA (``torch.ops.vllm`` custom ops, not direct calls), for the
    SwiftKV cache writes too; on CPU vLLM calls the same functions directly."""
    from vllm.model_executor.layers.attention import Attention

    for module in model.modules():
        if isinstance(module, Attention):
            module.use_direct_call = False


def _count_kv_layers(model) -> int:
    from vllm.model_executor.layers.attention import Attention

    return sum(isinstance(m, Attention) and m.kv_sharing_target_layer_name is None for m in model.modules())


def _kv_scales(model) -> dict:
    """Every attention layer's KV-cache scales (as used in attention) and the layer whose cache it reads."""
    from vllm.model_executor.layers.attention import Attention

    return {
        m.layer_name: {
            "k": float(m._k_scale),
            "v": float(m._v_scale),
            "reads": m.kv_sharing_target_layer_name or m.layer_name,
        }
        for m in model.modules()
        if isinstance(m, Attention)
    }


def _compiled(model) -> list[str]:
    return sorted(type(m).__name__ for m in model.modules() if getattr(m, "compiled", False))


def eagle3_aux_states(llm, layers: list[int]) -> list[list]:
    """Ask the model for EAGLE-3 auxiliary hidden states after ``layers`` (``set_aux_hidden_state_layers``, as
    vLLM's runner does for an EAGLE-3 drafter) and record them per forward; the runner still gets the final
    hidden states alone.  Returns the live list: per forward, per layer, rows x hidden."""
    records: list[list] = []

    def install(model) -> None:
        model.set_aux_hidden_state_layers(tuple(layers))

        def keep_aux(_module, _args, output):
            hidden, aux = output
            records.append([a.tolist() for a in aux])
            return hidden

        model.register_forward_hook(keep_aux)

    llm.apply_model(install)
    return records


def preemptions(llm) -> int:
    """vLLM's own count of preempted requests (``vllm:num_preemptions``; needs ``disable_log_stats=False``)."""
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def run_case(case: dict) -> dict:
    """One engine start: ``{"model", "engine"={}, "steps": [step, ...], "record"=False, "opaque"=False,
    "aux_layers"=[], "scales"=False}`` -> ``{"steps": [run_step results],
    "calls": stack calls, "kv_layers", "compiled", "aux", "preemptions", "scales"}``, or ``{"error": "..."}`` if
    the engine does not start; ``start_s`` and ``wall_s``: seconds to start the engine and in all."""
    started = time.perf_counter()
    try:
        llm = make_llm(case["model"], **case.get("engine", {}))
    except Exception as exc:  # reported to the caller, which decides whether the failure was expected
        return {"error": f"{type(exc).__name__}: {exc}"}
    start_s = time.perf_counter() - started
    if case.get("opaque"):
        llm.apply_model(_opaque_attention)
    if case.get("record"):
        llm.apply_model(_record_stacks)
    aux = eagle3_aux_states(llm, case["aux_layers"]) if case.get("aux_layers") else []
    result = {"steps": [run_step(llm, step) for step in case["steps"]], "aux": aux}
    result["kv_layers"] = llm.apply_model(_count_kv_layers)[0]
    result["compiled"] = llm.apply_model(_compiled)[0]
    if case.get("record"):
        result["calls"] = llm.apply_model(_stack_calls)
    if case.get("scales"):
        result["scales"] = llm.apply_model(_kv_scales)[0]
    if not case.get("engine", {}).get("disable_log_stats", True):
        result["preemptions"] = preemptions(llm)
    del llm
    gc.collect()
    return {**result, "start_s": start_s, "wall_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m tests.helpers.vllm_cases --model DIR --prompts '[[5, 6, 7]]' --max-tokens 8\n"
        "  python -m tests.helpers.vllm_cases --cases cases.json --out results.json   # several engines, one process",
    )
    parser.add_argument("--model", help="checkpoint directory")
    parser.add_argument("--prompts", help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--engine", default="{}", help="JSON dict of extra vllm.LLM keyword arguments")
    parser.add_argument("--cases", help="JSON file with a list of cases (see run_case); replaces --model")
    parser.add_argument("--out", help="write the JSON result here (default: stdout)")
    parser.add_argument(
        "--tmp", default=os.environ.get("TMPDIR", "/tmp"), help="folder for vLLM's sockets and caches"
    )
    args = parser.parse_args(argv)
    if not args.cases and not (args.model and args.prompts):
        parser.error("give --model and --prompts, or --cases FILE")
    for key, value in cpu_environment(args.tmp).items():
        os.environ.setdefault(key, value)
    if args.cases:
        result = [run_case(case) for case in json.loads(Path(args.cases).read_text())]
    else:
        step = {"prompts": json.loads(args.prompts), "max_tokens": args.max_tokens}
        result = run_case({"model": args.model, "engine": json.loads(args.engine), "steps": [step]})
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
