"""The shipped recipes and launcher configs, by name.

``recipes/`` of the repository ships inside the package (``distill/recipes`` is a link to it, package data of
``distill``), so a non-editable install has every recipe, accelerate config, DeepSpeed config, model config and
cluster file.  A shipped file's name is its path under ``recipes/`` without the suffix (``swiftkv_llama3.1_8b``,
``accelerate/8gpu_zero2``, ``deepspeed/zero2``, ``model_configs/llama3.1_405b`` for its ``config.json``,
``cluster/jobs``); the checkout's own spelling (``recipes/accelerate/8gpu_zero2.yaml``) names the same file.

Every command that takes one of these files takes a name too, through ``find``: an existing path is used as it
is, else the name is looked up among the shipped files of that kind, else the command refuses in one line that
lists the close matches; ``load_recipe_or_usage`` loads a recipe so (a file or a name), every problem on one line
before torch is imported.  The accelerate configs name their DeepSpeed config as ``recipes/deepspeed/NAME.json``,
which ``find`` resolves the same way, so a shipped accelerate config works from any folder
(``deepspeed_config_file`` in ``distill.train`` and ``distill.check``).

``swiftkv recipes`` lists them with a line each, ``swiftkv recipes path NAME`` prints where the installed file
is (for ``accelerate launch --config_file``, which reads the file itself), and ``swiftkv recipes cp NAME
[DEST]`` copies one for editing, as torchtune's ``tune ls`` and ``tune cp`` do.
"""

from __future__ import annotations

import difflib
import importlib.resources
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from toolkit.cliargs import UsageError, add_force, command_parser, run

from .recipe import Recipe, RecipeError, load_recipe

SHIPPED = Path(str(importlib.resources.files("distill") / "recipes"))
# kind -> (the folder under recipes/, what a user does with it): the order `swiftkv recipes` lists them in
KINDS = {
    "recipe": ("", "swiftkv distill|check NAME, swiftkv sweep|run --recipe NAME"),
    "accelerate config": (
        "accelerate",
        'accelerate launch --config_file "$(swiftkv recipes path NAME)", swiftkv check --config NAME, '
        "swiftkv run --launch NAME",
    ),
    "DeepSpeed config": ("deepspeed", "named by the accelerate configs as recipes/deepspeed/NAME.json"),
    "model config": ("model_configs", "swiftkv check --model-config NAME, for a model not on this machine"),
    "cluster file": ("cluster", "swiftkv cluster plan cluster/cluster cluster/jobs"),
}
SUFFIXES = (".yaml", ".json")
EPILOG = """examples:
  swiftkv recipes                                    # every shipped recipe and config, with a line each
  swiftkv recipes cp swiftkv_llama3.1_8b my_recipe.yaml
  swiftkv check swiftkv_llama3.1_8b --config accelerate/8gpu_zero2
  accelerate launch --config_file "$(swiftkv recipes path accelerate/8gpu_zero2)" -m distill swiftkv_llama3.1_8b
"""


@dataclass(frozen=True)
class Shipped:
    name: str  # the path under recipes/ without its suffix (a model config: its folder)
    kind: str
    path: Path


def _name(relative: Path) -> str:
    if relative.name == "config.json":
        return relative.parent.as_posix()
    return relative.with_suffix("").as_posix()


def _kind(relative: Path) -> str | None:
    folder = relative.parts[0] if len(relative.parts) > 1 else ""
    return next((kind for kind, (where, _) in KINDS.items() if where == folder), None)


def shipped(kind: str | None = None) -> dict[str, Shipped]:
    """The shipped files (of ``kind``), by name, in the order of ``KINDS`` then by name."""
    found = []
    for path in SHIPPED.rglob("*"):
        relative = path.relative_to(SHIPPED)
        if path.is_file() and path.suffix in SUFFIXES and _kind(relative) is not None:
            found.append(Shipped(_name(relative), _kind(relative), path))
    order = list(KINDS)
    found.sort(key=lambda s: (order.index(s.kind), s.name))
    return {s.name: s for s in found if kind is None or s.kind == kind}


def normalize(name: str) -> str:
    """A name as a user may write it (``recipes/accelerate/8gpu_zero2.yaml``) -> ``accelerate/8gpu_zero2``."""
    text = name.strip().removeprefix("./").removeprefix("recipes/")
    for suffix in (*SUFFIXES, "/config"):
        text = text.removesuffix(suffix)
    return text


def entry(name: str, kind: str | None = None) -> Shipped:
    """The shipped file called ``name`` (of ``kind``), or ``UsageError`` naming the close matches (every name of
    that kind when none is close)."""
    files = shipped(kind)
    key = normalize(name)
    if key in files:
        return files[key]
    close = difflib.get_close_matches(key, list(files), n=4, cutoff=0.5) or (list(files) if kind else [])
    names = f"a shipped name: {', '.join(close)}; " if close else "a shipped name; "
    raise UsageError(
        f"{kind or 'shipped recipe or config'} {name} not found (to resolve, pass a file or {names}"
        "`swiftkv recipes` lists them)"
    )


def find(name: str | Path, kind: str) -> Path:
    """A file of ``kind``: an existing path as it is, else the shipped one of that name (``entry``)."""
    path = Path(name).expanduser()
    return path if path.exists() else entry(str(name), kind).path


def load_recipe_or_usage(path: str | Path, overrides: list[str]) -> Recipe:
    """``load_recipe`` of a recipe file or a shipped recipe's name (``distill.shipped.find``) with every problem
    on one line, as the CLIs report bad input."""
    path = find(path, "recipe")
    try:
        return load_recipe(path, overrides)
    except RecipeError as e:
        problems = [line.removeprefix("recipe error: ") for line in str(e).splitlines()]
        raise UsageError(
            f"recipe {path}: {'; '.join(problems)} (to resolve, fix the recipe or the key=value overrides)"
        ) from None


def deepspeed_config(value: str) -> str:
    """accelerate's ``deepspeed_config_file`` as the training processes read it: a shipped accelerate config names
    its DeepSpeed config as ``recipes/deepspeed/NAME.json``, which is the installed one where no such file is in
    this folder; anything else (a path, accelerate's inline JSON) stays as it is."""
    files = shipped("DeepSpeed config")
    if normalize(value) not in files or Path(value).expanduser().exists():  # inline JSON is never a name
        return value
    return str(files[normalize(value)].path)


def describe(file: Shipped) -> str:
    """One line about a shipped file: the first sentence of a YAML file's opening comment; an accelerate or
    DeepSpeed config's processes and ZeRO stage; a model config's family and size."""
    if file.kind == "accelerate config":
        import yaml

        config = yaml.safe_load(file.path.read_text())
        ds = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
        nodes = int(config.get("num_machines") or 1)
        where = f"{config.get('num_processes')} processes on {nodes} node{'s' if nodes > 1 else ''}"
        return f"{where}, {describe(entry(ds, 'DeepSpeed config'))} ({normalize(ds)})" if ds else where
    if file.kind == "DeepSpeed config":
        zero = json.loads(file.path.read_text())["zero_optimization"]
        offload = [p for p in ("optimizer", "param") if zero.get(f"offload_{p}", {}).get("device") == "cpu"]
        return f"DeepSpeed ZeRO-{zero['stage']}" + (
            f", {' and '.join(offload)} offloaded to CPU" if offload else ""
        )
    if file.kind == "model config":
        config = json.loads(file.path.read_text())
        return (
            f"config.json of a {config['model_type']} model: {config['num_hidden_layers']} layers, "
            f"hidden size {config['hidden_size']}"
        )
    lines = file.path.read_text().splitlines()
    block = []  # the opening comment's prose, up to its first example command
    for line in lines[1:] if lines[:1] and lines[0].startswith("#!") else lines:
        if not line.startswith("#") or line.startswith("#   "):
            break
        block.append(line[1:].strip())
    return re.split(r"(?<=\S)(?:\.|:)(?:\s|$)", " ".join(block), maxsplit=1)[0]


def listing() -> str:
    lines = []
    for kind, (_, usage) in KINDS.items():
        entries = shipped(kind).values()
        lines += [f"{kind}s ({usage}):"]
        lines += [f"  {e.name:<34} {describe(e)}" for e in entries]
        lines += [""]
    return "\n".join(lines).rstrip()


def copy(name: str, dest: str | None, force: bool) -> Path:
    """The shipped file ``name`` (of any kind) copied to ``dest`` (a folder, existing or ending in ``/``: into it
    under its own file name; default: this folder), refusing to replace a file without ``force``."""
    source = entry(name).path
    target = Path(dest or ".").expanduser()
    if target.is_dir() or (dest or "").endswith("/"):
        target = target / source.name
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists (to resolve, pass another DEST or --force)")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser, sub = command_parser(
        "swiftkv recipes", "The shipped recipes and launcher configs: list, locate, copy for editing.", EPILOG
    )
    sub.add_parser("ls", help="every shipped recipe and config, with a line each (the default)")
    path = sub.add_parser("path", help="the installed file of NAME (for accelerate launch --config_file)")
    path.add_argument("name")
    cp = sub.add_parser("cp", help="copy NAME for editing")
    cp.add_argument("name")
    cp.add_argument("dest", nargs="?", help="a file, or a folder to copy into (default: this folder)")
    add_force(cp)

    def command(args) -> str:
        if args.command == "ls":
            return listing()
        if args.command == "path":
            return str(entry(args.name).path.resolve())
        return f"copied {normalize(args.name)} to {copy(args.name, args.dest, args.force)}"

    argv = sys.argv[1:] if argv is None else list(argv)
    return run(command, parser, argv or ["ls"])


if __name__ == "__main__":
    raise SystemExit(main())
