"""What the exact K/V window W buys after a long prompt, and what it costs in prefill FLOPs.

A distilled SwiftKV checkpoint is scored as served (``eval.prompt_heavy``) at several windows W, forward only,
one teacher pass per reply (the checkpoint's own W is what it was trained with; other windows show what moving
it would buy), on the held-out replies of each prompt-length band; beside each W, the
FLOP-ideal prefill speedup at the band's lower edge (``swiftkv.flops``).  A window that grows with the prompt
(``--grow F``: W = max(W, F x prompt tokens)) is scored the same way.

    python scripts/bench_window.py out/demo/distill-swiftkv50/model --windows 64,128,256 --replies 16 --out out/bench/window
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from eval.prompt_heavy import BANDS, band_name, band_samples, score_samples, summarize
from eval.quality import load_for_eval
from swiftkv.flops import Shape, ideal_prefill_speedup
from toolkit.artifacts import write_json_atomic, write_text_atomic
from toolkit.checkpoint import read_config
from toolkit.cliargs import ArgumentParser, add_model, add_out, int_list, run


def measure(model_dir: Path, windows: list[int], replies: int, reply_tokens: int, grow: float) -> dict:
    model, tokenizer = load_for_eval(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    shape = Shape.from_config(read_config(model_dir))
    trained = model.config.exact_kv_window
    out = {"model": str(model_dir), "trained_window": trained, "bands": {}}
    for band in BANDS:
        samples = band_samples(tokenizer, band, replies, reply_tokens)
        if not samples:
            continue
        names = {f"{w}": w for w in windows}
        sums = score_samples(
            model, {n: model for n in names}, samples, pad, f"band {band_name(band)}", windows=names
        )
        rows = {
            n: {
                **summarize(sums[n]),
                "ideal_prefill_speedup": ideal_prefill_speedup(
                    dataclasses.replace(shape, exact_kv_window=w), band[0]
                ),
            }
            for n, w in names.items()
        }
        if grow:
            grown = [max(min(windows), int(grow * len(sample["input_ids"]))) for sample in samples]
            per_sample = [
                score_samples(model, {"g": model}, [sample], pad, "grown", windows={"g": w})["g"][0]
                for sample, w in zip(samples, grown, strict=True)
            ]
            mean_w = int(np.mean(grown))
            ideal = ideal_prefill_speedup(dataclasses.replace(shape, exact_kv_window=mean_w), band[0])
            rows[f"grow {grow} (mean {mean_w})"] = {
                **summarize(np.stack(per_sample)),
                "ideal_prefill_speedup": ideal,
            }
        out["bands"][band_name(band)] = rows
    return out


def lines(result: dict) -> list[str]:
    out = [
        f"Exact K/V window after long prompts, `{result['model']}` (trained at W = {result['trained_window']}); "
        "KL as served [bootstrap 95%], FLOP-ideal prefill speedup at the band's lower edge.",
        "",
        "| band | W | replies | KL [95%] | ppl ratio | top-1 | FLOP-ideal prefill x |",
        "|---|---|---|---|---|---|---|",
    ]
    for band, rows in result["bands"].items():
        for w, m in rows.items():
            lo, hi = m["kl_ci95"]
            out.append(
                f"| {band} | {w} | {m['samples']} | {m['kl']:.3f} [{lo:.3f}, {hi:.3f}] | ×{m['ppl_ratio']:.3f} "
                f"| {m['top1_agreement']:.3f} | {m['ideal_prefill_speedup']:.2f}x |"
            )
    return out


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model(parser, help="a distilled SwiftKV checkpoint with exact K/V")
    parser.add_argument(
        "--windows", type=int_list, default=[64, 128, 256], help="windows W (default: 64,128,256)"
    )
    parser.add_argument("--replies", type=int, default=16, help="held-out replies per band (default: 16)")
    parser.add_argument(
        "--reply-tokens", type=int, default=64, help="scored tokens of each reply (default: 64)"
    )
    parser.add_argument(
        "--grow", type=float, default=0.0, help="also W = max(min W, F x prompt) (default: off)"
    )
    add_out(parser, help="folder for window.{json,md} (default: print only)", required=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    def go(args) -> str:
        result = measure(Path(args.model), args.windows, args.replies, args.reply_tokens, args.grow)
        text = "\n".join(lines(result))
        if args.out:
            write_json_atomic(Path(args.out) / "window.json", result)
            write_text_atomic(Path(args.out) / "window.md", text + "\n")
        return text

    return run(go, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
