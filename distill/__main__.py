"""``python -m distill RECIPE.yaml [key=value ...]`` (also under ``accelerate launch -m distill``),
``python -m distill check RECIPE.yaml ...`` (recipe + data + memory plan, see ``distill.check``) and
``python -m distill sweep MODEL --fractions ... --budget-tokens N --out DIR`` (``distill.sweep``) and
``python -m distill diagnose CHECKPOINT`` (where the student's error comes from, ``distill.diagnose``)."""

from __future__ import annotations

import sys

from swiftkv.cliargs import ArgumentParser, add_model, run

EPILOG = """examples:
  python -m distill recipes/swiftkv_smollm2_cpu.yaml train.max_steps=50 output_dir=out/x
  python -m distill check recipes/swiftkv_llama3.1_8b.yaml --config recipes/accelerate/8gpu_zero2.yaml
  python -m distill sweep MODEL --fractions 0.2,0.3,0.4,0.5,0.6 --budget-tokens 20480 --max-kl 0.2 --out out/sweep
  accelerate launch --config_file recipes/accelerate/cpu_2proc_zero2.yaml -m distill recipes/swiftkv_smollm2_cpu.yaml
  accelerate launch --config_file recipes/accelerate/8gpu_zero2.yaml -m distill recipes/swiftkv_llama3.1_8b.yaml
"""


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m distill",
        description="SwiftKV knowledge-preserving distillation (`python -m distill check --help` for the plan, "
        "`python -m distill sweep --help` to choose the fraction).",
        epilog=EPILOG,
    )
    add_model(parser, "recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=50")
    return parser


def _distill(args) -> str:
    from swiftkv.checkpoint import open_checkpoint

    from .check import load_recipe_or_usage
    from .train import train

    recipe = load_recipe_or_usage(args.recipe, args.overrides)
    open_checkpoint(recipe.model.source)  # a bad model is refused before any work (a Hub id is fetched here)
    return f"distilled model: {train(recipe)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check"]:
        from .check import main as check

        return check(argv[1:])
    if argv[:1] == ["sweep"]:
        from .sweep import main as sweep

        return sweep(argv[1:])
    if argv[:1] == ["diagnose"]:
        from .diagnose import main as diagnose

        return diagnose(argv[1:])
    return run(_distill, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
