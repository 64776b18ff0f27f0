"""``python -m distill RECIPE.yaml [key=value ...]`` (also under ``accelerate launch -m distill``)."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  python -m distill recipes/swiftkv_smollm2_cpu.yaml train.max_steps=50 output_dir=out/x
  accelerate launch --config_file recipes/accelerate/cpu_2proc_zero2.yaml -m distill recipes/swiftkv_smollm2_cpu.yaml
  accelerate launch --config_file recipes/accelerate/8gpu_zero2.yaml -m distill recipes/swiftkv_llama3.1_8b.yaml
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m distill",
        description="SwiftKV knowledge-preserving distillation.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=50")
    args = parser.parse_args(argv)

    from .recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        sys.exit(str(e))

    from swiftkv.convert import ConversionError

    from .data import DataError
    from .train import ResumeError, train

    try:
        path = train(recipe)
    except (DataError, ResumeError, ConversionError, ValueError) as e:
        sys.exit(f"distill: error: {e}")
    print(f"distilled model: {path}")


if __name__ == "__main__":
    main()
