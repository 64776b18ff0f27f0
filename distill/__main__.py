"""``python -m distill RECIPE.yaml [key=value ...]`` (also under ``accelerate launch -m distill``), and
``python -m distill check RECIPE.yaml ...`` (recipe + data + memory plan, see ``distill.check``)."""

from __future__ import annotations

import sys

from swiftkv.cliargs import ArgumentParser, UsageError, add_model, run

EPILOG = """examples:
  python -m distill recipes/swiftkv_smollm2_cpu.yaml train.max_steps=50 output_dir=out/x
  python -m distill check recipes/swiftkv_llama3.1_8b.yaml --config recipes/accelerate/8gpu_zero2.yaml
  accelerate launch --config_file recipes/accelerate/cpu_2proc_zero2.yaml -m distill recipes/swiftkv_smollm2_cpu.yaml
  accelerate launch --config_file recipes/accelerate/8gpu_zero2.yaml -m distill recipes/swiftkv_llama3.1_8b.yaml
"""


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m distill",
        description="SwiftKV knowledge-preserving distillation (`python -m distill check --help` for the plan).",
        epilog=EPILOG,
    )
    add_model(parser, "recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=50")
    return parser


def _distill(args) -> str:
    from .recipe import RecipeError, load_recipe
    from .train import train

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:  # one problem per line: report them all on one line
        problems = [line.removeprefix("recipe error: ") for line in str(e).splitlines()]
        raise UsageError(
            f"recipe {args.recipe}: {'; '.join(problems)} (to resolve, fix the recipe or the key=value overrides)"
        ) from None
    return f"distilled model: {train(recipe)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check"]:
        from .check import main as check

        return check(argv[1:])
    return run(_distill, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
