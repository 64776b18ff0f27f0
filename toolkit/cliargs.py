"""One command-line convention for every entry point of the toolkit.

Every CLI is ``main(argv) -> int`` built from these pieces, so a user meets the same behaviour everywhere:

* bad input is ONE line on stderr, ``error: <what> (to resolve, <how>)``, exit status 2, and nothing is written
  (``UsageError`` raised by a stage before any expensive work, or argparse's own complaints, reworded);
* the model or checkpoint directory is positional; the same flag name means the same thing everywhere
  (``--limit`` for counts, ``--out`` for output paths, ``--dtype``, ``--seed``, ``--force``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
# where and in what an evaluation runs (eval.quality): here so that a command's --help needs no torch
EVAL_DEVICES = ("cpu", "cuda", "auto")  # this process's CPU, one GPU, device_map="auto" over the visible GPUs
EVAL_DTYPES = ("float32", "bfloat16", "float16")


class UsageError(ValueError):
    """Bad input a user can fix: the message says what is wrong and, after 'to resolve', how."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's one-line error format and exit status 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "_parser_prog"):  # the innermost sub-command's parser parses first
            namespace._parser_prog = self.prog
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an unrecognized argument is reported by the sub-command that was given it, so that
        the line points at ``swiftkv quality --help`` rather than the command list."""
        namespace, extras = self.parse_known_args(args, namespace)
        prog = vars(namespace).pop("_parser_prog", self.prog)
        if extras:
            ArgumentParser(prog=prog).error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def error(self, message: str) -> None:  # argparse's hook; never returns
        print(f"error: {self.prog}: {message} (to resolve, see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def subcommands(parser: argparse.ArgumentParser, epilog: str | None = None) -> argparse._SubParsersAction:
    """Required sub-commands whose parsers share the project's parser class, formatting and (by default)
    the examples ``epilog``."""
    parser_class = functools.partial(ArgumentParser, epilog=epilog) if epilog else ArgumentParser
    return parser.add_subparsers(dest="command", required=True, parser_class=parser_class)


def command_parser(
    prog: str, description: str, epilog: str
) -> tuple[ArgumentParser, argparse._SubParsersAction]:
    """A CLI with sub-commands: the top parser and its sub-command set, all showing the same examples."""
    parser = ArgumentParser(prog=prog, description=description, epilog=epilog)
    return parser, subcommands(parser, epilog)


def existing_path(text: str) -> Path:
    """argparse type: a path that must exist (checked before any work)."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{path} does not exist")
    return path


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (checked before any work)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def int_list(text: str) -> list[int]:
    """argparse type: a comma list of integers such as ``512,1024``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers, e.g. 512,1024") from None


def float_list(text: str) -> list[float]:
    """argparse type: a comma list of numbers such as ``0.25,0.5``."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers, e.g. 0.25,0.5") from None


def add_model(parser: argparse.ArgumentParser, name: str = "model", help: str = "model or checkpoint folder"):
    return parser.add_argument(name, type=existing_path, help=help)


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` or ``org/name@revision`` that is not an existing path (the Hub's own id rules)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id = name.partition("@")[0]
    if Path(name).expanduser().exists() or repo_id.count("/") != 1 or name.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def model_name(text: str) -> str:
    """argparse type: an existing path or a Hugging Face Hub id (``org/name[@revision]``); the command
    fetches and checks it with ``toolkit.checkpoint.open_checkpoint`` before any work."""
    if Path(text).expanduser().exists() or looks_like_hub_id(text):
        return text
    raise argparse.ArgumentTypeError(f"{text} does not exist (and is not a Hub model id such as org/name)")


def add_checkpoint(
    parser: argparse.ArgumentParser,
    name: str = "model",
    help: str = "model or checkpoint: a folder, or a Hugging Face Hub id (org/name[@revision])",
    **kwargs,
):
    """The positional model of a command that reads one: a folder or a Hub id (see ``model_name``)."""
    return parser.add_argument(name, type=model_name, help=help, **kwargs)


def add_out(
    parser: argparse.ArgumentParser,
    default: str | None = None,
    help: str = "output path",
    required: bool | None = None,
):
    """``--out PATH``; required unless it has a default or ``required=False`` (then None means "do not write")."""
    required = default is None if required is None else required
    return parser.add_argument("--out", type=Path, default=default, required=required, help=help)


def add_limit(parser: argparse.ArgumentParser, default: int | None, help: str):
    return parser.add_argument("--limit", type=int, default=default, help=f"{help} (default: {default})")


def add_dtype(parser: argparse.ArgumentParser, default: str = "auto", choices: Sequence[str] = DTYPES):
    return parser.add_argument("--dtype", default=default, choices=choices, help=f"default: {default}")


def add_seed(parser: argparse.ArgumentParser, default: int = 0):
    return parser.add_argument("--seed", type=int, default=default, help=f"default: {default}")


def add_force(parser: argparse.ArgumentParser):
    return parser.add_argument("--force", action="store_true", help="replace a non-empty output")


def run(
    command: Callable[[argparse.Namespace], object],
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Parse ``argv``, run ``command(args)``, print what it returns; user errors become the one-line form.

    ``errors``: further exception types that carry a user-facing message (beyond ``UsageError``,
    ``FileNotFoundError``, ``FileExistsError`` and ``ValueError``).
    """
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error already printed (2)
        return int(e.code or 0)
    try:
        result = command(args)
    except (UsageError, FileNotFoundError, FileExistsError, ValueError, *errors) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    if result is not None:
        print(result)
    return 0


def one_line(error: BaseException) -> str:
    """The first line of an exception's message (a FileNotFoundError from open() names its path)."""
    if isinstance(error, FileNotFoundError) and error.filename:
        return f"{error.filename} not found (to resolve, check the path)"
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
