"""The vLLM plugin tests' case runner: greedy generation with vLLM's offline ``LLM`` on token ids, several
engines in one process, with what the tests inspect (rows through the upper layers, cache-owning layers,
compiled units, EAGLE-3 auxiliary hidden states).

Runs inside the vLLM venv (``scripts/setup_vllm_cpu.sh``), with the CPU engine defaults of
``eval.serving.vllm.cpu``.

    python -m tests.vllm_cases --model out/tiny-swiftkv --prompts '[[5, 6, 7], [8, 9]]' --max-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

from eval.serving.vllm.cpu import cpu_environment, make_llm


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations (token ids) of ``prompts``, batched in one call."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def upper_layer_rows(llm) -> list[int]:
    """Start recording how many rows enter the last decoder layer per forward (in-process engines only);
    returns the live list.  With SwiftKV fast prefill this is the number of logits rows, not of tokens."""
    rows: list[int] = []

    def install(model) -> None:
        layer = model.model.layers[-1]
        layer.register_forward_pre_hook(lambda _mod, args: rows.append(int(args[1].shape[0])))

    llm.apply_model(install)
    return rows


def _count_kv_layers(model) -> int:  # module level: apply_model pickles it to tensor-parallel workers
    from vllm.model_executor.layers.attention import Attention

    return sum(isinstance(m, Attention) and m.kv_sharing_target_layer_name is None for m in model.modules())


def kv_cache_layers(llm) -> int:
    """How many attention layers own a KV cache (KV-sharing layers read another layer's)."""
    return llm.apply_model(_count_kv_layers)[0]


def _compiled(model) -> list[str]:
    return sorted(type(m).__name__ for m in model.modules() if getattr(m, "compiled", False))


def compiled_units(llm) -> list[str]:
    """Class names of the modules vLLM compiled (``@support_torch_compile`` units that ran compiled)."""
    return llm.apply_model(_compiled)[0]


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


def run_case(case: dict) -> dict:
    """One engine start: ``{"model", "prompts", "max_tokens"=8, "engine"={}, "repeat"=1, "rows"=False,
    "aux_layers"=[]}`` -> ``{"tokens": [per repeat: [per prompt: ids]], "rows": [...], "kv_layers": n,
    "compiled": [...], "aux": [...]}``, or ``{"error": "..."}`` if the engine does not start."""
    try:
        llm = make_llm(case["model"], **case.get("engine", {}))
    except Exception as exc:  # reported to the caller, which decides whether the failure was expected
        return {"error": f"{type(exc).__name__}: {exc}"}
    rows = upper_layer_rows(llm) if case.get("rows") else []
    aux = eagle3_aux_states(llm, case["aux_layers"]) if case.get("aux_layers") else []
    kv_layers = kv_cache_layers(llm)
    tokens = [greedy(llm, case["prompts"], case.get("max_tokens", 8)) for _ in range(case.get("repeat", 1))]
    compiled = compiled_units(llm)
    del llm
    gc.collect()
    return {"tokens": tokens, "rows": rows, "kv_layers": kv_layers, "compiled": compiled, "aux": aux}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m tests.vllm_cases --model DIR --prompts '[[5, 6, 7]]' --max-tokens 8\n"
        "  python -m tests.vllm_cases --cases cases.json --out results.json   # several engines, one process",
    )
    parser.add_argument("--model", help="checkpoint directory")
    parser.add_argument("--prompts", help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--engine", default="{}", help="JSON dict of extra vllm.LLM keyword arguments")
    parser.add_argument("--cases", help="JSON file with a list of cases (see run_case); replaces --model")
    parser.add_argument("--out", help="write the JSON result here (default: stdout)")
    args = parser.parse_args(argv)
    if not args.cases and not (args.model and args.prompts):
        parser.error("give --model and --prompts, or --cases FILE")
    for key, value in cpu_environment(os.environ.get("TMPDIR", "/tmp")).items():
        os.environ.setdefault(key, value)
    if args.cases:
        result = [run_case(case) for case in json.loads(Path(args.cases).read_text())]
    else:
        case = dict(model=args.model, prompts=json.loads(args.prompts), max_tokens=args.max_tokens)
        result = run_case({**case, "engine": json.loads(args.engine)})
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
