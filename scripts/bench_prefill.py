"""Prefill (TTFT) and one decode step: original vs SwiftKV variants, same process, interleaved repeats.

For every dtype, batch size and prompt length, each repeat times every model once in a shuffled order, so a
slow spell on a shared machine hits all of them alike; the table reports medians.  Prefill is what
``generate()`` does first: a forward over the prompt with a fresh cache and ``logits_to_keep=1``.  The decode
column times one new token against a cache of ``--decode-context`` tokens (the cache is cropped back after
each step).  The FLOP-ideal speedup is ``swiftkv.flops.ideal_prefill_speedup`` (projections + causal attention
+ last-token logits; formula in that module's docstring).

    python scripts/bench_prefill.py ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct
    python scripts/bench_prefill.py out/smollm2-swiftkv50 --lengths 512,1024 --repeats 3
    python scripts/bench_prefill.py MODEL --dtypes float32 --batches 1 --variants 0.5:1,0.5:1:32   # exact K/V window
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eval.speed import decode_times, prefill_times
from swiftkv.convert import read_config, resolve_num_key_value_layers, to_swiftkv
from swiftkv.flops import Shape, ideal_prefill_speedup, kv_bytes_per_token
from toolkit.cliargs import ArgumentParser, add_model, add_out, int_list, run

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_original(path: Path, dtype: torch.dtype):
    """The base model; for a SwiftKV checkpoint, its teacher weights as the original model class."""
    config = read_config(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if "num_key_value_layers" in config:
        model.set_mode("teacher")
    return model


def variants(original, specs: list[tuple[float, int, int]]) -> dict[str, torch.nn.Module]:
    """The original and one SwiftKV model per (fraction, group size, exact K/V window) on its weights."""
    L = original.config.num_hidden_layers
    models = {"original": original}
    for fraction, g, window in specs:
        l = resolve_num_key_value_layers(L, None, fraction, g)
        model = to_swiftkv(original, l, g)
        model.config.exact_kv_window = window
        model.set_mode("student")
        models[f"swiftkv{round(fraction * 100)}-g{g}" + (f"-w{window}" if window else "")] = model
    return models


def parse_variants(text: str) -> list[tuple[float, int, int]]:
    """``fraction:group_size[:exact_kv_window],...``"""
    specs = []
    for item in text.split(","):
        fraction, g, *window = item.split(":")
        specs.append((float(fraction), int(g), int(window[0]) if window else 0))
    return specs


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__)
    add_model(parser, help="base HF checkpoint (or a SwiftKV one: its teacher)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma list of " + ", ".join(DTYPES))
    parser.add_argument("--lengths", type=int_list, default=[512, 1024, 2048, 4096])
    parser.add_argument("--batches", type=int_list, default=[1, 8])
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="skip batch x length above this")
    parser.add_argument(
        "--variants",
        type=parse_variants,
        default="0.25:1,0.25:2,0.5:1,0.5:2",
        help="fraction:group_size[:exact_kv_window],... (e.g. 0.5:1:32)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_out(parser, "out/bench/prefill.json")
    return parser


def bench(args) -> None:
    torch.set_num_threads(args.threads)
    specs = args.variants
    lengths, batches = args.lengths, args.batches
    rows = []
    for dtype_name in args.dtypes.split(","):
        models = variants(load_original(args.model, DTYPES[dtype_name]), specs)
        cases = [(b, n) for b in batches for n in lengths if b * n <= args.max_batch_tokens]
        for b, n in cases:
            times = prefill_times(models, b, n, args.repeats)
            base = times["original"]
            for name, model in models.items():
                t = times[name]
                shape = Shape.from_config(model.config)
                rows.append(
                    dict(
                        dtype=dtype_name,
                        batch=b,
                        length=n,
                        model=name,
                        prefill_s=t,
                        tokens_per_s=b * n / t,
                        speedup=base / t,
                        ideal=ideal_prefill_speedup(shape, n),
                        fraction_of_ideal=(base / t) / ideal_prefill_speedup(shape, n),
                        kv_bytes_per_token=kv_bytes_per_token(
                            shape, model.dtype.itemsize, name != "original"
                        ),
                    )
                )
                print(
                    f"{dtype_name:>8} b={b} n={n:>5} {name:>14}: {t * 1000:8.1f} ms  x{base / t:.2f} "
                    f"(ideal x{rows[-1]['ideal']:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
        decode = decode_times(models, args.decode_context, args.decode_steps, args.repeats)
        base = decode["original"]
        for name in models:
            t = decode[name]
            rows.append(
                dict(
                    dtype=dtype_name,
                    batch=1,
                    length=args.decode_context,
                    model=name,
                    decode_s=t,
                    decode_ratio=t / base,
                )
            )
        del models

    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        model=str(args.model),
        threads=args.threads,
        repeats=args.repeats,
        torch=torch.__version__,
        command=" ".join(sys.argv),
    )
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


def print_table(rows: list[dict]) -> None:
    print("| dtype | batch | prompt | model | prefill ms | speedup | FLOP-ideal | of ideal | KV B/token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "prefill_s" in r:
            print(
                f"| {r['dtype']} | {r['batch']} | {r['length']} | {r['model']} | {r['prefill_s'] * 1000:.0f} | "
                f"{r['speedup']:.2f}x | {r['ideal']:.2f}x | {r['fraction_of_ideal']:.2f} | {r['kv_bytes_per_token']} |"
            )
    print("\n| dtype | context | model | decode ms/token | vs original |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "decode_s" in r:
            print(
                f"| {r['dtype']} | {r['length']} | {r['model']} | {r['decode_s'] * 1000:.1f} | {r['decode_ratio']:.3f} |"
            )


def main(argv: list[str] | None = None) -> int:
    return run(bench, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
