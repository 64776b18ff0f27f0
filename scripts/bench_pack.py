"""Peak memory of the distillation data pipeline (tokenize + pack, ``distill.data.build_datasets``) as the
dataset grows, against the list packing it replaced.

Synthetic ShareGPT-layout conversations (random words, 1-3 exchanges) are written to a local JSONL; each
run is a child process that builds the packed rows from it with a fresh datasets cache, then reads every
train row back through the training loop's DataLoader.  The child reports its own peak RSS (``ru_maxrss``:
what a training rank holds) and the largest tokenizing worker's.  The baseline ("lists") tokenizes the same
way, then packs the whole stream as Python lists into tensors in one go, as ``pack()`` did for training
before (every token of the dataset in memory on every rank).  Target (issue 17): peak < 2 GB and flat as the
dataset grows 4x.  The default tokenizer is a word-level one over the synthetic vocabulary with a ChatML
template (the same code path, ~50x faster than a BPE one on a busy CPU); ``--tokenizer DIR`` uses a real one.

    python scripts/bench_pack.py --out out/bench/pack.json                          # 50k and 200k; lists at 50k
    python scripts/bench_pack.py --sizes 2000 8000 --baseline-sizes 2000 --out /tmp/pack.json   # seconds
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.artifacts import write_json_atomic  # noqa: E402
from toolkit.cliargs import ArgumentParser, UsageError, add_out, add_seed, run  # noqa: E402

WORDS = [f"w{i}" for i in range(2000)]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MB = 1 << 20


def synthetic_tokenizer(folder: Path):
    """A word-level fast tokenizer over ``WORDS`` with ChatML special tokens, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, "user", "assistant", "system", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        chat_template=CHATML,
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.save_pretrained(folder)
    return folder


def write_conversations(path: Path, n: int, seed: int) -> int:
    """``n`` ShareGPT-layout records; returns the file size in bytes."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns.append({"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))})
                turns.append({"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(20, 300)))})
            f.write(json.dumps({"id": str(i), "conversations": turns}) + "\n")
    return path.stat().st_size


class AnonPeak(threading.Thread):
    """Peak anonymous RSS of this process (``/proc/self/status`` RssAnon, sampled): ``ru_maxrss`` also counts
    the memory-mapped Arrow pages the kernel can drop, which grow with the files read, not with what is held."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0

    def sample(self) -> int:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        self.peak = max(self.peak, int(fields["RssAnon"].split()[0]) * 1024)
        return self.peak

    def run(self):
        while True:
            self.sample()
            time.sleep(0.05)


def child(mode: str, data: str, tokenizer: str, seq_len: int, num_proc: int, cache: str) -> dict:
    """One measured build in this (child) process."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from distill.data import build_datasets, collate_rows, load_source, pack, tokenize_source
    from distill.recipe import DataSection

    section = DataSection.model_validate(
        {
            "sources": [{"path": data}],
            "seq_len": seq_len,
            "holdout": 0.001,
            "num_proc": num_proc,
            "cache_dir": cache,
        }
    )
    tok = AutoTokenizer.from_pretrained(tokenizer)
    anon = AnonPeak()
    anon.start()
    t0 = time.perf_counter()
    if mode == "datasets":
        train, _ = build_datasets(section, tok)
        built = time.perf_counter() - t0
        peak_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        tokens = rows = 0
        for ids, _, mask in DataLoader(train, batch_size=16, collate_fn=collate_rows):
            rows += ids.shape[0]
            tokens += int(mask.sum())
    else:  # the list packing this replaced: every tokenized sample as Python lists, then tensors
        source = section.sources[0]
        samples = tokenize_source(source, load_source(source, cache_dir=cache), tok, section)
        packed = pack(list(samples), seq_len, tok.pad_token_id)
        built = time.perf_counter() - t0
        peak_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rows, tokens = packed["input_ids"].shape[0], int(packed["loss_mask"].sum())
        del packed
    torch.set_num_threads(1)
    return {
        "mode": mode,
        "rows": rows,
        "loss_tokens": tokens,
        "build_s": built,
        "peak_rss_built_bytes": peak_built,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_anon_rss_bytes": anon.sample(),
        "worker_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }


def measure(args, mode: str, size: int, work: Path, tokenizer: Path) -> dict:
    data = work / f"conv-{size}.jsonl"
    if not data.exists():
        file_bytes = write_conversations(data, size, args.seed)
    else:
        file_bytes = data.stat().st_size
    cache = work / f"cache-{mode}-{size}"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        str(data),
        str(tokenizer),
        str(args.seq_len),
        str(args.num_proc),
        str(cache),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} at {size}: {out.stderr.strip().splitlines()[-1]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"conversations": size, "jsonl_bytes": file_bytes, **result}


def bench(args) -> str:
    if any(n < 1 for n in args.sizes + args.baseline_sizes) or args.seq_len < 16:
        raise UsageError(
            "--sizes, --baseline-sizes must be >= 1 and --seq-len >= 16 (to resolve, fix the numbers)"
        )
    with tempfile.TemporaryDirectory(prefix="bench-pack-") as tmp:
        work = Path(tmp)
        tokenizer = (
            Path(args.tokenizer) if args.tokenizer != "synthetic" else synthetic_tokenizer(work / "tok")
        )
        results = [measure(args, "datasets", n, work, tokenizer) for n in args.sizes]
        results += [measure(args, "lists", n, work, tokenizer) for n in args.baseline_sizes]
    smallest = min(results, key=lambda r: (r["mode"] != "datasets", r["conversations"]))
    lines = [
        f"packing {args.seq_len}-token rows, num_proc={args.num_proc}, tokenizer={args.tokenizer}",
        "| pipeline | conversations | rows | peak RSS built (MB) | peak RSS after reading all rows (MB) "
        "| of which anonymous (MB) | worker peak (MB) | vs smallest datasets run | build s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["peak_rss_bytes"] / smallest["peak_rss_bytes"]
        lines.append(
            f"| {r['mode']} | {r['conversations']} | {r['rows']} | {r['peak_rss_built_bytes'] / MB:.0f} "
            f"| {r['peak_rss_bytes'] / MB:.0f} | {r['peak_anon_rss_bytes'] / MB:.0f} "
            f"| {r['worker_peak_rss_bytes'] / MB:.0f} | {ratio:.2f}x "
            f"| {r['build_s']:.0f} |"
        )
    if args.out:
        write_json_atomic(args.out, {"seq_len": args.seq_len, "num_proc": args.num_proc, "results": results})
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        mode, data, tokenizer, seq_len, num_proc, cache = argv[1:7]
        print(json.dumps(child(mode, data, tokenizer, int(seq_len), int(num_proc), cache)))
        return 0
    parser = ArgumentParser(prog="python scripts/bench_pack.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[50_000, 200_000], help="conversations per run"
    )
    parser.add_argument(
        "--baseline-sizes", type=int, nargs="*", default=[50_000], help="sizes of the lists runs"
    )
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row (default: 2048)")
    parser.add_argument("--num-proc", type=int, default=2, help="tokenizing processes (default: 2)")
    parser.add_argument("--tokenizer", default="synthetic", help="'synthetic' or a tokenizer folder")
    add_seed(parser)
    add_out(parser, required=False)
    return run(bench, parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
