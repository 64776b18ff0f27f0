"""vLLM serving benchmark: a SwiftKV checkpoint against its original model, same run, interleaved repeats.

Run with the vLLM venv's python (``scripts/setup_vllm_cpu.sh``).  Both engines run compiled (vLLM's
compilation; ``--eager`` turns it off) and stay up side by side; each repeat measures both in a shuffled order
(``eval.speed.interleaved``), and the table reports medians:

* TTFT: one request of n random prompt tokens, ``max_tokens=1`` (prefix caching off, so every repeat
  prefills in full), for each n in ``--lengths``; beside it the FLOP-ideal prefill speedup
  (``swiftkv.flops.ideal_prefill_speedup``) and the fraction of it reached;
* TPOT: one request, ``--tpot-prompt`` tokens then ``--tpot-tokens`` decode steps, minus its TTFT;
* throughput: ``--mix-requests`` requests of ``--mix-prompt`` prompt and ``--mix-output`` output tokens
  (10:1 by default) submitted together, in tokens (prompt + output) per second.

    .venv-vllm/bin/python scripts/bench_vllm.py out/smollm2-swiftkv50 \\
        ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct --out out/bench/vllm.json
    .venv-vllm/bin/python scripts/bench_vllm.py M B --lengths 512 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

from eval.serving.vllm.cpu import cpu_environment, make_llm
from eval.speed import interleaved
from swiftkv.convert import read_config
from swiftkv.flops import Shape, ideal_prefill_speedup
from toolkit.cliargs import ArgumentParser, add_dtype, add_model, add_out, int_list, run


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]} for _ in range(count)]


def timed_generate(llm, prompts: list[dict], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def bench(args: argparse.Namespace) -> dict:
    vocab = read_config(args.model)["vocab_size"]
    engine = dict(
        enforce_eager=args.eager,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_model_len=max(
            args.lengths + [args.mix_prompt + args.mix_output, args.tpot_prompt + args.tpot_tokens]
        )
        + 8,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
    )
    llms = {"original": make_llm(args.baseline, **engine), "swiftkv": make_llm(args.model, **engine)}
    seeds = iter(range(10**6))  # a fresh prompt for every measurement

    def once(llm, count: int, length: int, max_tokens: int) -> float:
        return timed_generate(llm, random_prompts(vocab, count, length, next(seeds)), max_tokens)

    for llm in llms.values():  # warm-up
        once(llm, 1, 64, 2)
    shape = Shape.from_config(read_config(args.model))
    rows = []

    def record(row: dict) -> None:  # progress as it goes: a long run on a busy machine shows what it has
        rows.append(row)
        print(json.dumps(row), flush=True)

    for n in args.lengths:
        t = interleaved(llms, lambda llm, n=n: once(llm, 1, n, 1), args.repeats, seed=n)
        ideal = ideal_prefill_speedup(shape, n)
        speedup = t["original"] / t["swiftkv"]
        record(dict(metric="ttft_s", length=n, **t, speedup=speedup, ideal=ideal, of_ideal=speedup / ideal))

    def tpot(llm) -> float:
        prompt = random_prompts(vocab, 1, args.tpot_prompt, next(seeds))
        full = timed_generate(llm, prompt, args.tpot_tokens + 1)
        return (full - timed_generate(llm, prompt, 1)) / args.tpot_tokens

    t = interleaved(llms, tpot, args.repeats)
    record(dict(metric="tpot_s", length=args.tpot_prompt, **t, speedup=t["original"] / t["swiftkv"]))

    def throughput(llm) -> float:
        tokens = args.mix_requests * (args.mix_prompt + args.mix_output)
        return tokens / once(llm, args.mix_requests, args.mix_prompt, args.mix_output)

    t = interleaved(llms, throughput, args.repeats)
    record(dict(metric="tokens_per_s", length=args.mix_prompt, **t, speedup=t["swiftkv"] / t["original"]))
    return dict(meta=dict(vars(args), model=str(args.model), baseline=str(args.baseline)), rows=rows)


def print_table(result: dict) -> None:
    print("| metric | prompt | original | SwiftKV | speedup | FLOP-ideal | of ideal |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        scale, unit = (1, "tok/s") if r["metric"] == "tokens_per_s" else (1000, "ms")
        ideal = f"{r['ideal']:.2f}x | {r['of_ideal']:.2f}" if "ideal" in r else "- | -"
        print(
            f"| {r['metric']} | {r['length']} | {r['original'] * scale:.1f} {unit} | {r['swiftkv'] * scale:.1f} {unit} "
            f"| {r['speedup']:.2f}x | {ideal} |"
        )


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__)
    add_model(parser, help="SwiftKV checkpoint")
    add_model(parser, "baseline", help="the original checkpoint it came from")
    parser.add_argument(
        "--lengths", type=int_list, default=[512, 1024, 2048, 4096], help="TTFT prompt lengths"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tpot-prompt", type=int, default=512)
    parser.add_argument("--tpot-tokens", type=int, default=32)
    parser.add_argument("--mix-requests", type=int, default=8)
    parser.add_argument("--mix-prompt", type=int, default=1000)
    parser.add_argument("--mix-output", type=int, default=100)
    add_dtype(parser, "float32")
    parser.add_argument("--eager", action="store_true", help="no torch.compile (default: vLLM's compilation)")
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    add_out(parser, "out/bench/vllm.json")
    return parser


def run_bench(args) -> None:
    tmp = tempfile.mkdtemp(prefix="bench-vllm-")
    for key, value in cpu_environment(tmp).items():
        os.environ.setdefault(key, value)
    result = bench(args)
    result["meta"]["command"] = " ".join(sys.argv)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp_out.replace(args.out)
    print(f"\nwrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run(run_bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
