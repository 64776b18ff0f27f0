"""The main job on the embedded default: convert -> distill -> evaluate -> report, resumable.

    python scripts/demo.py                 # SmolLM2-135M-Instruct, SwiftKV 25% and 50%, ~30 min on 2 cores
    python scripts/demo.py --quick         # tiny settings for CI (< 3 min)
    python scripts/demo.py --run-dir out/demo --fractions 0.5 --distill-steps 60

Each stage is skipped when its inputs are unchanged and reruns (with everything downstream) when they change;
an interrupted distillation resumes from its last checkpoint.  Ends by printing where the report is.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "swiftkv_smollm2_cpu.yaml"

FULL = dict(
    fractions=[0.25, 0.5],
    distill_steps=None,  # the recipe's
    distill=[],
    quality=dict(n_conversations=32, seq_len=512, n_prompts=8, max_new_tokens=32),
    lengths=[512, 1024, 2048],
    repeats=3,
    decode_context=1024,
    decode_steps=10,
    harness=dict(limit=50, max_length=1024),
    n_docs=100,
)
QUICK = dict(
    fractions=[0.5],
    distill_steps=4,
    distill=[
        "data.sources.0.max_samples=40",
        "data.seq_len=128",
        "checkpoint.every_steps=4",
        "log.eval_batches=2",
        "log.every_steps=1",
        "log.eval_every_steps=null",
    ],
    quality=dict(n_conversations=4, seq_len=128, n_prompts=2, max_new_tokens=8),
    lengths=[128, 256],
    repeats=1,
    decode_context=128,
    decode_steps=3,
    harness=dict(limit=5, max_length=256),
    n_docs=10,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="default: out/demo (out/demo-quick with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny settings for CI")
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=None)
    parser.add_argument("--distill-steps", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    cfg["fractions"] = args.fractions or cfg["fractions"]
    cfg["distill_steps"] = args.distill_steps or cfg["distill_steps"]
    run_dir = (args.run_dir or ROOT / ("out/demo-quick" if args.quick else "out/demo")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg["quick"] = args.quick
    print(f"demo: report at {run(cfg, run_dir)}")


def run(cfg: dict, run_dir: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from fetch_assets import fetch_model, fetch_sharegpt

    from distill.recipe import load_recipe
    from distill.train import train
    from eval.harness import run_harness
    from eval.pipeline import run_stage
    from eval.quality import evaluate_quality
    from eval.report import write_report
    from eval.tasks import write_tasks
    from swiftkv.artifacts import read_provenance

    torch.manual_seed(0)
    base = fetch_model()
    fetch_sharegpt()
    commands = [f"python scripts/demo.py {' '.join(sys.argv[1:])}".strip()]
    t0 = time.time()
    base_key = read_provenance(base).get("gguf_sha256", str(base))
    tasks_key, tasks_dir = run_stage(
        run_dir,
        "tasks",
        {"n_docs": cfg["n_docs"], "data": "sharegpt"},
        lambda: str(write_tasks(run_dir / "tasks", cfg["n_docs"])),
    )

    variants = [dict(name="original", dir=str(base), fraction=0.0, key=base_key)]
    for fraction in cfg["fractions"]:
        name = f"swiftkv{round(fraction * 100)}"
        out = run_dir / f"distill-{name}"
        steps = [f"train.max_steps={cfg['distill_steps']}"] if cfg["distill_steps"] else []
        overrides = [
            f"model.source={base}",
            f"model.swiftkv.fraction={fraction}",
            f"output_dir={out}",
            *steps,
            *cfg["distill"],
        ]
        recipe = load_recipe(RECIPE, overrides)
        commands.append(f"python -m distill {RECIPE.relative_to(ROOT)} {' '.join(overrides)}")
        key, result = run_stage(
            run_dir,
            f"distill-{name}",
            {"recipe": recipe.model_dump(mode="json"), "base": base_key},
            lambda recipe=recipe: _distill(train, recipe),
            output=out,
        )
        variants.append(
            dict(
                name=f"{name}-converted",
                dir=str(out / "converted"),
                fraction=fraction,
                key=key,
                before_of=name,
            )
        )
        variants.append(dict(name=name, dir=result["model"], fraction=fraction, key=key, distill=result))

    for v in variants:
        _, v["quality"] = run_stage(
            run_dir,
            f"quality-{v['name']}",
            {"model": v["key"], "cfg": cfg["quality"]},
            lambda v=v: evaluate_quality(v["dir"], **cfg["quality"]),
        )
    measured = [v for v in variants if "before_of" not in v]
    speed_inputs = {
        "models": [v["key"] for v in measured],
        **{k: cfg[k] for k in ("lengths", "repeats", "decode_context", "decode_steps")},
    }
    _, speed = run_stage(run_dir, "speed", speed_inputs, lambda: _speed(measured, cfg))
    for v in measured:
        _, v["lm_eval"] = run_stage(
            run_dir,
            f"lm_eval-{v['name']}",
            {"model": v["key"], "tasks": tasks_key, **cfg["harness"]},
            lambda v=v: run_harness(
                v["dir"], ["sharegpt_ppl", "sharegpt_mc"], tasks_dir, batch_size=4, **cfg["harness"]
            ),
        )
        commands.append(
            f"python -m eval harness --model {v['dir']} --tasks sharegpt_ppl,sharegpt_mc "
            f"--tasks-dir {tasks_dir} --limit {cfg['harness']['limit']}"
        )
    commands.append(f"python -m eval report {run_dir}")
    _write_run_json(run_dir, base, cfg, measured, variants, speed, commands, time.time() - t0)
    return write_report(run_dir)


def _distill(train, recipe) -> dict:
    model_dir = train(recipe)
    out = Path(recipe.output_dir)
    first = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    final = json.loads((out / "final_metrics.json").read_text())
    return {"model": str(model_dir), "initial_eval_kl": first.get("eval_kl"), **final}


def _speed(measured: list[dict], cfg: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from eval.speed import interleaved, prompt_ids, time_decode, time_prefill

    models = {}
    for v in measured:
        models[v["name"]] = AutoModelForCausalLM.from_pretrained(v["dir"], dtype=torch.float32).eval()
    vocab = models["original"].config.vocab_size
    out = {name: {"prefill_s": {}} for name in models}
    for n in cfg["lengths"]:
        ids = prompt_ids(vocab, 1, n, seed=n)
        for m in models.values():
            time_prefill(m, ids[:, :32])
        for name, t in interleaved(
            models, lambda m, ids=ids: time_prefill(m, ids), cfg["repeats"], seed=n
        ).items():
            out[name]["prefill_s"][str(n)] = t
    ids = prompt_ids(vocab, 1, cfg["decode_context"] + 1)
    for name, t in interleaved(
        models, lambda m: time_decode(m, ids, cfg["decode_steps"]), cfg["repeats"]
    ).items():
        out[name]["decode_s"] = t
    for name in models:
        out[name]["prefill_speedup"] = {
            n: out["original"]["prefill_s"][n] / t for n, t in out[name]["prefill_s"].items()
        }
        out[name]["decode_ratio"] = out[name]["decode_s"] / out["original"]["decode_s"]
    return out


def _write_run_json(run_dir, base, cfg, measured, variants, speed, commands, seconds) -> None:
    from swiftkv.artifacts import write_json_atomic
    from swiftkv.convert import read_config
    from swiftkv.flops import Shape, ideal_prefill_speedup, kv_bytes_per_token

    rows = []
    quality = {v["name"]: v["quality"] for v in variants}
    for v in measured:
        config = read_config(Path(v["dir"]))
        shape = Shape.from_config(config)
        rows.append(
            dict(
                name=v["name"],
                dir=v["dir"],
                num_layers=shape.layers,
                swiftkv_layers=shape.layers - shape.num_key_value_layers,
                group_size=shape.group_size,
                kv_bytes_per_token=kv_bytes_per_token(shape, 2, v["name"] != "original"),
                ideal_prefill_speedup={str(n): ideal_prefill_speedup(shape, n) for n in cfg["lengths"]},
                quality=v["quality"],
                quality_before=quality.get(f"{v['name']}-converted"),
                speed=speed[v["name"]],
                lm_eval=v.get("lm_eval"),
                distill=v.get("distill"),
            )
        )
    meta = dict(
        model=str(base),
        machine=f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        threads=torch.get_num_threads(),
        dtype="float32",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        prefill_lengths=cfg["lengths"],
        seconds=round(seconds),
        quick=cfg["quick"],
    )
    write_json_atomic(run_dir / "run.json", {"meta": meta, "commands": commands, "variants": rows})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
