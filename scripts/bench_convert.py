"""Peak memory of ``swiftkv convert`` on a sharded random Llama checkpoint, against its largest shard.

The source is written shard by shard with safetensors (random weights, the model is never instantiated),
then converted by ``swiftkv convert`` in a fresh child interpreter, which reports its own peak RSS (Linux
VmHWM) after importing the converter (interpreter + torch + transformers) and after converting.  Target (issue 18): peak RSS <= largest shard + 1 GiB.  "attention + norms" is what a converter that
kept every layer's attention and norm tensors until the end would hold on top of a shard.

    python scripts/bench_convert.py --out out/bench/convert.json      # Llama-3.2-1B shape: 1.24 B params, bf16
    python scripts/bench_convert.py --layers 24 --hidden 768 --heads 12 --kv-heads 12 --intermediate 256 \\
        --vocab 512 --shard-mb 12 --dtype float32 --out /tmp/convert.json    # seconds; what the test runs
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from toolkit.artifacts import write_json_atomic  # noqa: E402
from toolkit.cliargs import ArgumentParser, UsageError, add_out, add_seed, run  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
GIB = 1 << 30


def llama_shapes(args) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint in the order transformers saves them (tied embeddings)."""
    d = args.hidden // args.heads
    q, kv = args.heads * d, args.kv_heads * d
    out = [("model.embed_tokens.weight", (args.vocab, args.hidden))]
    for i in range(args.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (args.hidden,)),
            (p + "self_attn.q_proj.weight", (q, args.hidden)),
            (p + "self_attn.k_proj.weight", (kv, args.hidden)),
            (p + "self_attn.v_proj.weight", (kv, args.hidden)),
            (p + "self_attn.o_proj.weight", (args.hidden, q)),
            (p + "post_attention_layernorm.weight", (args.hidden,)),
            (p + "mlp.gate_proj.weight", (args.intermediate, args.hidden)),
            (p + "mlp.up_proj.weight", (args.intermediate, args.hidden)),
            (p + "mlp.down_proj.weight", (args.hidden, args.intermediate)),
        ]
    return out + [("model.norm.weight", (args.hidden,))]


def write_checkpoint(path: Path, args) -> list[int]:
    """A sharded random checkpoint (at most ``--shard-mb`` per shard unless one tensor is larger); shard sizes."""
    from transformers import LlamaConfig

    path.mkdir(parents=True)
    LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        tie_word_embeddings=True,
        dtype=args.dtype,
    ).save_pretrained(path)
    dtype, limit = DTYPES[args.dtype], args.shard_mb << 20
    gen = torch.Generator().manual_seed(args.seed)
    groups, current, size = [], [], 0
    for name, shape in llama_shapes(args):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    groups.append(current)
    weight_map, sizes = {}, []
    for i, group in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name, shape in group:
            shard[name] = torch.randn(shape, generator=gen, dtype=dtype).mul_(0.02)
        save_file(shard, path / file, metadata={"format": "pt"})
        sizes.append((path / file).stat().st_size)
        weight_map.update(dict.fromkeys(shard, file))
        del shard
    total = sum(torch.Size(shape).numel() for _, shape in llama_shapes(args)) * dtype.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sizes


# runs in the child: the peak RSS (VmHWM) after the imports and after ``swiftkv convert``.  VmHWM belongs to the
# child's own address space; getrusage/wait4 would also count the RSS the child inherited from this process.
CHILD = """
import json, sys
def peak():
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM"))
from swiftkv.cli import main
imported = peak()
code = main(["convert", *sys.argv[1:]])
print(json.dumps({"code": code, "import_rss_bytes": imported, "peak_rss_bytes": peak()}))
"""


def convert_in_child(argv: list[str]) -> dict:
    """``swiftkv convert ARGV`` in a fresh interpreter; its peak RSS after imports and in all."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], cwd=REPO, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(f"swiftkv convert failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args) -> dict:
    params = sum(torch.Size(s).numel() for _, s in llama_shapes(args))
    itemsize = DTYPES[args.dtype].itemsize
    need = 2.3 * params * itemsize + GIB  # source + converted copy (+ the new tensors) + slack
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.work))
    try:
        if shutil.disk_usage(work).free < need:
            raise UsageError(f"{work} has less than {need / GIB:.1f} GiB free (to resolve, pass --work DIR)")
        sizes = write_checkpoint(work / "src", args)
        rss = convert_in_child(
            [str(work / "src"), str(work / "dst"), "--swiftkv-fraction", str(args.fraction)]
            + ["--group-size", str(args.group_size)]
        )
        baseline, peak = rss["import_rss_bytes"], rss["peak_rss_bytes"]
        out_bytes = sum(f.stat().st_size for f in (work / "dst").glob("*.safetensors"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    held = sum(torch.Size(s).numel() for n, s in llama_shapes(args) if ".self_attn." in n or "norm" in n)
    largest = max(sizes)
    return dict(
        params=params,
        dtype=args.dtype,
        shards=len(sizes),
        source_bytes=sum(sizes),
        output_bytes=out_bytes,
        largest_shard_bytes=largest,
        import_rss_bytes=baseline,
        peak_rss_bytes=peak,
        conversion_rss_bytes=peak - baseline,
        attention_norm_bytes=held * itemsize,
        target_bytes=largest + GIB,
        meets_target=peak <= largest + GIB,
    )


def print_table(r: dict) -> None:
    mb = 1 << 20
    print(
        "| params | dtype | shards | largest shard | import RSS | peak RSS | peak - import | attention + norms "
        "| target (shard + 1 GiB) | met |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['params'] / 1e9:.2f} B | {r['dtype']} | {r['shards']} | {r['largest_shard_bytes'] / mb:.0f} MiB | "
        f"{r['import_rss_bytes'] / mb:.0f} MiB | {r['peak_rss_bytes'] / mb:.0f} MiB | "
        f"{r['conversion_rss_bytes'] / mb:.0f} MiB | {r['attention_norm_bytes'] / mb:.0f} MiB | "
        f"{r['target_bytes'] / mb:.0f} MiB | {'yes' if r['meets_target'] else 'NO'} |"
    )


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="bench_convert.py", description=__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--shard-mb", type=int, default=400, help="source shard size limit (MiB)")
    parser.add_argument("--fraction", type=float, default=0.5, help="--swiftkv-fraction of the conversion")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None, help="folder for the temporary checkpoints")
    add_seed(parser)
    add_out(parser, "out/bench/convert.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    def command(args):
        if args.hidden % args.heads or args.heads % args.kv_heads:
            raise UsageError(
                f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {args.kv_heads} do not "
                "divide (to resolve, pick heads dividing hidden and kv-heads dividing heads)"
            )
        result = measure(args)
        print_table(result)
        meta = dict(command=" ".join(sys.argv), torch=torch.__version__, cpus=os.cpu_count())
        write_json_atomic(args.out, {"meta": meta, "result": result})
        return f"\nwrote {args.out}"

    return run(command, build_parser(), argv, errors=(RuntimeError,))


if __name__ == "__main__":
    raise SystemExit(main())
