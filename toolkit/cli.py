"""The front door: ``swiftkv COMMAND [ARGS]`` (also ``python -m toolkit``) reaches every command of every room.

Each room keeps its commands as ``main(argv) -> int`` functions (the convention of ``toolkit.cliargs``); this
table names them as entry points (``module:function``, like a package's console scripts), so the front door
imports only the one command it runs and ``swiftkv --help`` lists all of them without loading torch.  A
command with sub-commands of its own (``kvcompress``, ``suffix``, ``ranking``, ``certaindex``) takes them after
its name, e.g. ``swiftkv ranking train``.

Distillation on several processes keeps accelerate's own launcher: ``accelerate launch --config_file "$(swiftkv
recipes path accelerate/8gpu_zero2)" -m distill RECIPE`` (a shipped config by name, ``distill.shipped``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    entry: str  # "module:function", called with the arguments after the command's name
    help: str
    prefix: tuple[str, ...] = ()  # arguments put before the user's (the room CLI's own sub-command)

    def run(self, argv: Sequence[str]) -> int:
        module, _, function = self.entry.partition(":")
        return getattr(importlib.import_module(module), function)([*self.prefix, *argv])


# (section, commands) in the order a user meets them on the main job's path
SECTIONS: tuple[tuple[str, tuple[Command, ...]], ...] = (
    (
        "the embedded default (toolkit)",
        (Command("fetch", "toolkit.assets:main", "fetch SmolLM2-135M-Instruct and ShareGPT into the cache"),),
    ),
    (
        "the model (swiftkv)",
        (
            Command("convert", "swiftkv.cli:main", "rewrite a HF checkpoint into SwiftKV form", ("convert",)),
            Command("info", "swiftkv.cli:main", "layout, KV bytes and FLOP-ideal prefill speedup", ("info",)),
        ),
    ),
    (
        "distillation (distill)",
        (
            Command(
                "recipes", "distill.shipped:main", "the shipped recipes and launcher configs: ls | path | cp"
            ),
            Command("distill", "distill.__main__:main", "distill a SwiftKV student with a YAML recipe"),
            Command("check", "distill.check:main", "a recipe's model, data and memory plan, before any work"),
            Command(
                "sweep", "distill.sweep:main", "distill at several SwiftKV fractions, report quality vs speed"
            ),
            Command(
                "diagnose", "distill.diagnose:main", "where a student's error comes from, layer by layer"
            ),
            Command(
                "cluster", "distill.cluster.cli:main", "Sia planner: plan | launch-configs | trace | simulate"
            ),
        ),
    ),
    (
        "measurement (eval)",
        (
            Command(
                "run", "eval.cli:main", "the main job: convert -> distill -> evaluate -> report", ("run",)
            ),
            Command(
                "quality", "eval.cli:main", "KL, agreement and perplexity against the teacher", ("quality",)
            ),
            Command("harness", "eval.cli:main", "lm-eval tasks on a checkpoint", ("harness",)),
            Command("tasks", "eval.cli:main", "write the offline ShareGPT tasks for lm-eval", ("tasks",)),
            Command("report", "eval.cli:main", "report.md and plots from a run folder", ("report",)),
        ),
    ),
    (
        "KV-cache compression (kvcompress)",
        (
            Command(
                "kvcompress",
                "kvcompress.cli:main",
                "TALE low-rank + quantized KV cache: calibrate its factors",
            ),
        ),
    ),
    (
        "serving (eval.serving)",
        (
            Command(
                "vllm-args",
                "eval.cli:main",
                "the checked vLLM serve command for a checkpoint",
                ("vllm-args",),
            ),
            Command(
                "suffix",
                "eval.serving.suffix.cli:main",
                "suffix-decoding cache: build | generate | export-vllm",
            ),
            Command(
                "ranking",
                "eval.serving.ranking.cli:main",
                "output-length ranker and its proxy in front of vLLM",
            ),
            Command("certaindex", "eval.serving.certaindex.cli:main", "early exit of reasoning by certainty"),
            Command(
                "check-vllm-api",
                "eval.serving.vllm.api_check:main",
                "check a vLLM source tree for every name the plugin uses",
            ),
        ),
    ),
    (
        "on a GPU (eval, eval.serving)",
        (
            Command(
                "gpu-check",
                "eval.gpu_check:main",
                "the transformers path and the vLLM plugin on one GPU: one verdict",
            ),
            Command(
                "gpu-check-vllm",
                "eval.serving.vllm.gpu_check:main",
                "the vLLM plugin's rows alone, run in the serving environment",
            ),
        ),
    ),
)
COMMANDS = {command.name: command for _, commands in SECTIONS for command in commands}


def usage() -> str:
    lines = [
        "usage: swiftkv COMMAND [ARGS]   (swiftkv COMMAND --help for a command's own arguments)",
        "",
        "Make LLM inference cheaper by transforming and distilling the model.",
    ]
    for section, commands in SECTIONS:
        lines += ["", f"{section}:"]
        lines += [f"  {c.name:<16}{c.help}" for c in commands]
    lines += [
        "",
        "examples:",
        "  swiftkv run --quick                      # the main job on the embedded default, in minutes",
        "  swiftkv convert MODEL out/x --swiftkv-fraction 0.5 && swiftkv info out/x",
        '  accelerate launch --config_file "$(swiftkv recipes path accelerate/8gpu_zero2)" -m distill RECIPE',
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from . import __version__

        print(f"swiftkv-toolkit {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(
            f"error: unknown command {argv[0]!r} (to resolve, use one of {', '.join(COMMANDS)}; see `swiftkv --help`)",
            file=sys.stderr,
        )
        return 2
    return command.run(argv[1:])
