"""The model's own reply lengths, sampled by vLLM (much faster than transformers' generate on this CPU).

Run with the vLLM venv's python.  Takes the prompts of a traces directory (e.g. the recorded ShareGPT lengths
of ``ranking labels``, whose prompts are unique across the file's splits), samples one reply to each as a chat
turn with the served model (temperature, top-p and a length cap as given), and writes traces (``prompt``,
``prompt_len``, ``output_len``, ``finished``) with a ``meta.json`` naming the model, the cap and the generation
time, which ``ranking train`` / ``evaluate`` read.  Prints the fraction of replies that hit the cap.

Resumable and bounded: every prompt not yet in the JSONL goes to one engine, which keeps ``--max-num-seqs``
replies in flight; each reply is appended as soon as it finishes (no batch waits for its longest reply), and after
``--time-limit`` seconds the unfinished ones are aborted.  A rerun with the same options answers the prompts still
missing.  The engine is seeded with ``--seed`` plus the number of replies already written (vLLM's CPU build
refuses per-request seeds: "CPU Generator does not use offset"), so a rerun is reproducible, though not the
samples of one uninterrupted run; replies are written in the order they finish.

    .venv-vllm/bin/python scripts/bench_rank_traces.py MODEL out/own-prompts --out out/own-traces --limit 3500 \\
        --max-new-tokens 2048 --time-limit 1380            # rerun until it prints "complete"
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPTIONS = ("limit", "max_prompt_tokens", "max_new_tokens", "temperature", "top_p", "seed")


def done_rows(file: Path) -> list[dict]:
    """The complete lines of a partly written traces JSONL, the file truncated to them (a torn last line from a
    killed run is dropped)."""
    if not file.is_file():
        return []
    rows = []
    for line in file.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def generate(
    rows: list[dict],
    out: Path,
    meta: dict,
    sample: Callable[[list[dict], int, Callable[[], bool]], Iterator[tuple[int, int, bool]]],
    time_limit: float,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """Append a trace for each ``(k, length, finished)`` that ``sample(todo, already, expired)`` yields: ``k``
    indexes ``todo``, the rows whose prompt is not in ``out/traces.jsonl`` yet, ``already`` counts those that are,
    and ``expired()`` turns true after ``time_limit`` seconds, when the sampler must stop.  ``meta`` (the options)
    must equal what ``out/meta.json`` holds, if anything; returns the updated meta and ``done``."""
    out.mkdir(parents=True, exist_ok=True)
    meta_file, file = out / "meta.json", out / "traces.jsonl"
    old = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    if old is not None and {k: old.get(k) for k in meta} != meta:
        diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        raise ValueError(f"{out} holds traces made with other options {diff}; to resolve, use a new --out")
    meta = {**meta, "generation_s": 0.0, **(old or {})}
    done = {r["prompt"] for r in done_rows(file)}
    if not done <= {r["prompt"] for r in rows}:
        raise ValueError(f"{file} holds prompts the source does not; to resolve, use a new --out")
    todo = [r for r in rows if r["prompt"] not in done]
    start = clock()
    with open(file, "a") as f:
        for k, length, finished in (
            sample(todo, len(done), lambda: clock() - start > time_limit) if todo else ()
        ):
            r = todo[k]
            f.write(json.dumps({"prompt": r["prompt"], "prompt_len": r["prompt_len"], "output_len": length,
                                "finished": finished}) + "\n")  # fmt: skip
            f.flush()
            done.add(r["prompt"])
    meta = {
        **meta,
        "generation_s": meta["generation_s"] + clock() - start,
        "complete": len(done) == len(rows),
    }
    meta_file.write_text(json.dumps(meta, indent=1))
    return {**meta, "done": len(done)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("prompts", type=Path, help="traces directory or JSONL whose prompts to answer")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--limit", type=int, default=3000, help="the first N prompts within --max-prompt-tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=128, help="replies in flight at once")
    p.add_argument(
        "--time-limit", type=float, default=1380.0, help="seconds; then unfinished replies are aborted"
    )
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    args = p.parse_args(argv)
    source = args.prompts / "traces.jsonl" if args.prompts.is_dir() else args.prompts
    if not source.is_file() or not args.model.is_dir():
        print(
            f"{source} or {args.model} not found; to resolve, pass a traces directory and a model",
            file=sys.stderr,
        )
        return 2
    if min(args.limit, args.max_new_tokens, args.max_num_seqs) < 1 or args.time_limit <= 0:
        print("--limit, --max-new-tokens, --max-num-seqs and --time-limit must be positive", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("prompt_len", 0) <= args.max_prompt_tokens][: args.limit]
    meta = {"model": str(args.model.resolve()), "data": str(source.resolve()), "source": "own-generations-vllm",
            **{k: getattr(args, k) for k in OPTIONS}}  # fmt: skip

    def sample(
        todo: list[dict], already: int, expired: Callable[[], bool]
    ) -> Iterator[tuple[int, int, bool]]:
        import os

        from eval.serving.vllm.cpu import cpu_environment, make_llm

        os.environ.update(cpu_environment(tempfile.mkdtemp(prefix="rank-traces-")))
        from vllm import SamplingParams

        llm = make_llm(args.model, max_model_len=args.max_prompt_tokens + args.max_new_tokens + 64,
                       kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), dtype="float32",
                       max_num_seqs=args.max_num_seqs, seed=args.seed + already)  # fmt: skip
        engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens
        )
        for k, r in enumerate(todo):  # the chat template, as llm.chat applies it
            ids = tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)  # fmt: skip
            engine.add_request(str(k), {"prompt_token_ids": ids}, params)
        left = set(range(len(todo)))
        while left and not expired():
            for output in engine.step():
                if output.finished:
                    left.discard(int(output.request_id))
                    reply = output.outputs[0]
                    yield int(output.request_id), len(reply.token_ids), reply.finish_reason == "stop"
        if left:
            engine.abort_request([str(k) for k in left])

    try:
        result = generate(rows, args.out, meta, sample, args.time_limit)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    traces = done_rows(args.out / "traces.jsonl")
    capped = sum(not t["finished"] for t in traces)
    print(f"{len(traces)} of {len(rows)} replies ({'complete' if result['complete'] else 'rerun to continue'}), "
          f"{capped} ({capped / max(1, len(traces)):.1%}) hit the {args.max_new_tokens}-token cap, "
          f"{result['generation_s']:.0f} s of generation in all")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
