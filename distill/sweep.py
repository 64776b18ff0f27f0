"""How many layers can a model skip?  ``swiftkv sweep MODEL --fractions ... --budget-tokens N``.

For each candidate fraction the recipe's own distillation runs with only the number of SwiftKV layers
changed: the same data, seed, init (the least-squares fit in the CPU recipe) and schedule, stretched to the
same token budget.  Every candidate is an ordinary ``distill.train`` run into ``OUT/l<l>`` (so it runs under
``accelerate launch`` on every process, resumes from its checkpoints after an interruption and exports a
normal SwiftKV folder).  Each candidate is a stage of ``distill.runs`` (the main job's resume scheme): skipped
on a rerun when its recipe is unchanged, rerun from scratch when it changed.
Quality is the trainer's final held-out evaluation (the recipe's ``data.holdout`` rows): KL(teacher ||
student) at T = 1, top-1 agreement and the perplexity ratio; with exact K/V (``model.exact_kv_window`` W) the
student is trained and evaluated with the served positions exact, and the speedup counts the W prompt tokens
through the upper layers.  Speed is the FLOP-ideal prefill speedup of ``swiftkv.flops`` at ``prefill_tokens``.  The report (``OUT/sweep.{json,md,png}``, rewritten after every
candidate) names the largest fraction that meets the user's quality budget (``max_kl``, ``max_ppl_ratio``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from swiftkv.convert import ConversionError, read_config, resolve_num_key_value_layers
from swiftkv.flops import Shape, ideal_prefill_speedup, kv_bytes_per_token
from toolkit.artifacts import save_figure, write_json_atomic, write_text_atomic
from toolkit.cliargs import ArgumentParser, UsageError, add_model, add_out, float_list, run

from .recipe import Recipe, SwiftKVOptions
from .shipped import SHIPPED, find

RECIPE = SHIPPED / "swiftkv_smollm2_cpu.yaml"
EPILOG = """examples:
  swiftkv sweep ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct \\
      --fractions 0.2,0.3,0.4,0.5,0.6 --budget-tokens 20480 --max-kl 0.2 --out out/sweep
  accelerate launch --config_file "$(swiftkv recipes path accelerate/8gpu_zero2)" -m distill sweep MODEL \\
      --recipe swiftkv_llama3.1_8b --fractions 0.25,0.375,0.5 --budget-tokens 50000000 --out sweep/
"""


def candidate_layers(config: dict, fractions: list[float], group_size: int) -> list[int]:
    """The distinct l (num_key_value_layers) of the fractions, most layers kept (smallest fraction) first."""
    if not fractions or not all(0.0 < f < 1.0 for f in fractions):
        raise UsageError(
            f"fractions {fractions} must lie in (0, 1) (to resolve, pass e.g. --fractions 0.25,0.5)"
        )
    num_layers = config["num_hidden_layers"]
    try:
        layers = {resolve_num_key_value_layers(num_layers, None, f, group_size) for f in fractions}
    except ConversionError as e:
        raise UsageError(f"{e} (to resolve, choose other --fractions)") from None
    skipping = sorted((l for l in layers if l < num_layers), reverse=True)
    if not skipping:
        raise UsageError(
            f"fractions {fractions} skip no layer of this {num_layers}-layer model (to resolve, pass larger ones)"
        )
    return skipping


def tokens_per_step(recipe: Recipe, processes: int) -> int:
    """Positions of one optimizer step's global batch (the x of the trainer's quality curve)."""
    return recipe.data.seq_len * recipe.train.micro_batch_size * recipe.train.grad_accum * processes


def candidate_recipe(base: Recipe, model: Path, l: int, steps: int, out: Path) -> Recipe:
    """The base recipe with only the model, the number of SwiftKV layers, the steps and the output changed."""
    opts = base.model.swiftkv or SwiftKVOptions(fraction=0.5, init="lstsq")
    swiftkv = opts.model_copy(update={"num_key_value_layers": l, "fraction": None})
    model_section = base.model.model_copy(update={"source": str(model), "swiftkv": swiftkv})
    train = base.train.model_copy(update={"max_steps": steps})
    return base.model_copy(update={"model": model_section, "train": train, "output_dir": str(out / f"l{l}")})


def _result(recipe: Recipe, config: dict, l: int, prefill_tokens: int, step_tokens: int, run: dict) -> dict:
    """A candidate's row of the report, from its distillation's result (``distill.runs``)."""
    g, window = recipe.model.swiftkv.group_size, recipe.model.exact_kv_window or 0
    shape = Shape.from_config(
        {**config, "num_key_value_layers": l, "key_value_group_size": g, "exact_kv_window": window}
    )
    base = Shape.from_config({**config, "num_key_value_layers": config["num_hidden_layers"]})
    steps = recipe.train.max_steps
    return {
        "num_key_value_layers": l,
        "swiftkv_layers": shape.layers - l,
        "num_layers": shape.layers,
        "fraction": (shape.layers - l) / shape.layers,
        "exact_kv_window": window,
        "ideal_prefill_speedup": ideal_prefill_speedup(shape, prefill_tokens),
        "kv_cache_share": kv_bytes_per_token(shape) / kv_bytes_per_token(base, swiftkv=False),
        "steps": steps,
        "train_tokens": steps * step_tokens,
        "initial_kl": run["initial_eval_kl"],
        "kl": run["eval_kl"],
        "top1_agreement": run["eval_top1_agreement"],
        "ppl_ratio": run["eval_ppl_student"] / run["eval_ppl_teacher"],
        "eval_tokens": run["eval_tokens"],
        "train_seconds": run["train_seconds"],
        "model": run["model"],
    }


def meets(result: dict, max_kl: float | None, max_ppl_ratio: float | None) -> bool:
    return (max_kl is None or result["kl"] <= max_kl) and (
        max_ppl_ratio is None or result["ppl_ratio"] <= max_ppl_ratio
    )


def choose(results: list[dict], max_kl: float | None, max_ppl_ratio: float | None) -> dict | None:
    """The candidate that skips the most layers within the budget (None without a budget or a fit)."""
    if max_kl is None and max_ppl_ratio is None:
        return None
    fits = [r for r in results if meets(r, max_kl, max_ppl_ratio)]
    return max(fits, key=lambda r: r["swiftkv_layers"], default=None)


def report_lines(summary: dict) -> list[str]:
    budget = summary["budget"]
    n = summary["prefill_tokens"]
    lines = [
        f"# SwiftKV fraction sweep: {summary['model']}",
        "",
        f"Each candidate: the recipe `{summary['recipe']}` at {summary['budget_tokens']:,} tokens "
        f"(same data, seed and schedule); quality on its held-out rows against the teacher"
        + (
            f", with exact K/V (W = {summary['results'][0]['exact_kv_window']}) at the served positions."
            if summary["results"] and summary["results"][0].get("exact_kv_window")
            else "."
        ),
        "",
        f"| SwiftKV layers | l | prefill x @{n} (FLOP-ideal) | KV cache | KL init → after | top-1 agree "
        "| ppl ratio | within budget | train s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["results"]:
        initial = "–" if r["initial_kl"] is None else f"{r['initial_kl']:.3f}"
        ok = (
            "–"
            if budget["max_kl"] is None and budget["max_ppl_ratio"] is None
            else "yes"
            if r["meets"]
            else "no"
        )
        lines.append(
            f"| {r['swiftkv_layers']}/{r['num_layers']} ({r['fraction']:.0%}) | {r['num_key_value_layers']} "
            f"| {r['ideal_prefill_speedup']:.2f}x | {r['kv_cache_share']:.0%} | {initial} → {r['kl']:.3f} "
            f"| {r['top1_agreement']:.3f} | ×{r['ppl_ratio']:.3f} | {ok} | {r['train_seconds']:.0f} |"
        )
    lines.append("")
    limits = [f"KL ≤ {budget['max_kl']}"] * (budget["max_kl"] is not None) + [
        f"ppl ratio ≤ {budget['max_ppl_ratio']}"
    ] * (budget["max_ppl_ratio"] is not None)
    chosen = summary["chosen"]
    if limits and chosen is not None:
        lines.append(
            f"Largest fraction within {' and '.join(limits)}: {chosen['fraction']:.0%} "
            f"(`model.swiftkv.num_key_value_layers: {chosen['num_key_value_layers']}`), "
            f"{chosen['ideal_prefill_speedup']:.2f}x FLOP-ideal prefill."
        )
    elif limits:
        lines.append(f"No candidate meets {' and '.join(limits)}.")
    if summary["pending"]:
        lines.append(f"Not yet run: l = {', '.join(map(str, summary['pending']))}.")
    return lines


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, budget = summary["results"], summary["budget"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    speedups = [r["ideal_prefill_speedup"] for r in results]
    for ax, key, label, limit in (
        (axes[0], "kl", "held-out KL (teacher || student)", budget["max_kl"]),
        (axes[1], "ppl_ratio", "perplexity student / teacher", budget["max_ppl_ratio"]),
    ):
        ax.plot(speedups, [r[key] for r in results], marker="o")
        for r in results:
            ax.annotate(f"{r['fraction']:.0%}", (r["ideal_prefill_speedup"], r[key]), fontsize=7)
        if limit is not None:
            ax.axhline(limit, color="gray", linestyle="--", linewidth=1)
        ax.set(xlabel=f"FLOP-ideal prefill speedup @{summary['prefill_tokens']} tokens", ylabel=label)
    fig.suptitle(
        f"Quality vs prefill savings at {summary['budget_tokens']:,} tokens of distillation", fontsize=10
    )
    fig.tight_layout()
    save_figure(fig, path)


def _write_report(summary: dict, out: Path) -> None:
    write_json_atomic(out / "sweep.json", summary)
    write_text_atomic(out / "sweep.md", "\n".join(report_lines(summary)) + "\n")
    if summary["results"]:
        plot(summary, out / "sweep.png")


def sweep(
    model: str | Path,
    fractions: list[float],
    out: str | Path,
    *,
    budget_tokens: int | None = None,
    recipe: str | Path = RECIPE,
    overrides: list[str] = (),
    max_kl: float | None = None,
    max_ppl_ratio: float | None = None,
    prefill_tokens: int = 2048,
) -> dict:
    """Distill ``model`` at each fraction for ``budget_tokens`` tokens (default: the recipe's own steps) with the
    settings of ``recipe`` (plus ``key=value`` overrides) and return the summary written to ``out/sweep.json``:
    ``results`` from most layers kept to fewest, and ``chosen``, the one that skips most within the budget."""
    from accelerate import PartialState

    from .check import load_recipe_or_usage
    from .runs import distill_stage

    if (budget_tokens is not None and budget_tokens < 1) or prefill_tokens < 1:
        raise UsageError(
            f"--budget-tokens {budget_tokens} / --prefill-tokens {prefill_tokens} (to resolve, pass positive "
            "numbers of tokens)"
        )
    if any(x is not None and x <= 0 for x in (max_kl, max_ppl_ratio)):
        raise UsageError(
            f"--max-kl {max_kl} / --max-ppl-ratio {max_ppl_ratio} (to resolve, pass positive limits)"
        )
    model, out, recipe_file = Path(model).expanduser(), Path(out), find(recipe, "recipe")
    config = read_config(model)
    if "num_key_value_layers" in config:
        raise UsageError(f"{model} is already a SwiftKV checkpoint (to resolve, pass its base model)")
    base = load_recipe_or_usage(recipe_file, list(overrides))
    group_size = base.model.swiftkv.group_size if base.model.swiftkv else 1
    layers = candidate_layers(config, fractions, group_size)
    step_tokens = tokens_per_step(base, int(os.environ.get("WORLD_SIZE", "1")))
    steps = base.train.max_steps if budget_tokens is None else max(1, math.ceil(budget_tokens / step_tokens))
    state = PartialState()
    summary = {
        "model": str(model),
        "recipe": " ".join([str(recipe_file), *overrides]),
        "budget_tokens": steps * step_tokens,
        "budget": {"max_kl": max_kl, "max_ppl_ratio": max_ppl_ratio},
        "prefill_tokens": prefill_tokens,
        "results": [],
        "pending": list(layers),
        "chosen": None,
    }
    for l in layers:
        candidate = candidate_recipe(base, model, l, steps, out)
        _, run = distill_stage(out, f"l{l}", candidate, end_training=False)
        result = _result(candidate, config, l, prefill_tokens, step_tokens, run)
        result["meets"] = meets(result, max_kl, max_ppl_ratio)
        summary["results"].append(result)
        summary["pending"].remove(l)
        summary["chosen"] = choose(summary["results"], max_kl, max_ppl_ratio)
        if state.is_main_process:
            _write_report(summary, out)
        state.wait_for_everyone()
    state.destroy_process_group()
    return summary


def build_parser() -> ArgumentParser:
    from .check import IntermixedParser

    parser = IntermixedParser(
        prog="swiftkv sweep",
        description="Distill a model at several SwiftKV fractions for the same token budget and report quality "
        "against the FLOP-ideal prefill speedup, with the largest fraction within a quality budget.",
        epilog=EPILOG,
    )
    add_model(parser, help="base (non-SwiftKV) model folder")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. optim.lr=2e-3")
    parser.add_argument(
        "--fractions", type=float_list, required=True, help="SwiftKV fractions to try, e.g. 0.2,0.3,0.4,0.5"
    )
    parser.add_argument(
        "--budget-tokens", type=int, help="tokens of distillation per candidate (default: the recipe's steps)"
    )
    parser.add_argument(
        "--recipe", default=RECIPE, help=f"base recipe: a file or a shipped name (default: {RECIPE.name})"
    )
    parser.add_argument("--max-kl", type=float, help="quality budget: held-out KL at most this")
    parser.add_argument("--max-ppl-ratio", type=float, help="quality budget: perplexity ratio at most this")
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=2048,
        help="prompt length of the FLOP-ideal speedup (default: 2048)",
    )
    add_out(parser, help="sweep folder: one distillation per candidate and sweep.{json,md,png}")
    return parser


def _sweep(args) -> str:
    summary = sweep(
        args.model,
        args.fractions,
        args.out,
        budget_tokens=args.budget_tokens,
        recipe=args.recipe,
        overrides=args.overrides,
        max_kl=args.max_kl,
        max_ppl_ratio=args.max_ppl_ratio,
        prefill_tokens=args.prefill_tokens,
    )
    return "\n".join(report_lines(summary))


def main(argv: list[str] | None = None) -> int:
    return run(_sweep, build_parser(), argv)
