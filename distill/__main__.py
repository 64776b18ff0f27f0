"""``swiftkv distill RECIPE.yaml [key=value ...]`` (also under ``accelerate launch -m distill``),
``swiftkv check RECIPE.yaml ...`` (recipe + data + memory plan, see ``distill.check``) and
``swiftkv sweep MODEL --fractions ... --budget-tokens N --out DIR`` (``distill.sweep``) and
``swiftkv diagnose CHECKPOINT`` (where the student's error comes from, ``distill.diagnose``)."""

from __future__ import annotations

import sys

from toolkit.cliargs import ArgumentParser, run

# what `python -m distill X` runs as `swiftkv X` (``accelerate launch -m distill sweep ...`` runs a sweep on
# every process)
SUBCOMMANDS = ("check", "sweep", "diagnose")
EPILOG = """examples (recipes and configs by file or by shipped name: `swiftkv recipes`):
  swiftkv distill swiftkv_smollm2_cpu train.max_steps=50 output_dir=out/x
  swiftkv check swiftkv_llama3.1_8b --config accelerate/8gpu_zero2
  swiftkv sweep MODEL --fractions 0.2,0.3,0.4,0.5,0.6 --budget-tokens 20480 --max-kl 0.2 --out out/sweep
  accelerate launch --config_file "$(swiftkv recipes path accelerate/cpu_2proc_zero2)" -m distill swiftkv_smollm2_cpu
  accelerate launch --config_file "$(swiftkv recipes path accelerate/8gpu_zero2)" -m distill swiftkv_llama3.1_8b
"""


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="swiftkv distill",
        description="SwiftKV knowledge-preserving distillation (`swiftkv check --help` for the plan, "
        "`swiftkv sweep --help` to choose the fraction).",
        epilog=EPILOG,
    )
    parser.add_argument("recipe", help="YAML recipe: a file or a shipped name (`swiftkv recipes`)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=50")
    return parser


def _distill(args) -> str:
    from toolkit.checkpoint import open_checkpoint

    from .shipped import load_recipe_or_usage

    recipe = load_recipe_or_usage(args.recipe, args.overrides)  # a file or a shipped name
    from .train import train

    open_checkpoint(recipe.model.source)  # a bad model is refused before any work (a Hub id is fetched here)
    return f"distilled model: {train(recipe)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:  # the same commands as `swiftkv check|sweep|diagnose`
        from toolkit.cli import COMMANDS

        return COMMANDS[argv[0]].run(argv[1:])
    return run(_distill, build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
