"""``swiftkv check-vllm-api``: check a vLLM source tree for every internal name the SwiftKV plugin uses, without
importing it.

Reads ``USED`` from ``eval/serving/vllm/internals.py`` (as data, beside this module) and, for each ``module:qualname``, looks the
definition up in the tree's Python files: a function must take the listed parameters; a class must have each
listed member as an ``__init__`` parameter, a class-level name or field, a method, or a ``self.<name>``
assignment, in the class or a base class it imports from the tree.  Importing is not needed, so the CUDA wheel
users install (``pip download --no-deps vllm==X``, then unzip its ``vllm/*.py``) is checked on any machine.

    swiftkv check-vllm-api .venv-vllm/lib/python3.11/site-packages/vllm
    swiftkv check-vllm-api /tmp/vllm-0.33/vllm --out report.json

Prints one line per missing name and a summary; exit status 1 if anything is missing.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from toolkit.cliargs import ArgumentParser

INTERNALS = Path(__file__).with_name("internals.py")


def used_names() -> dict[str, tuple[str, ...]]:
    """``USED`` from internals.py, read as a literal (importing that module would import vLLM)."""
    for node in ast.parse(INTERNALS.read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "USED":
            return ast.literal_eval(node.value)
    raise SystemExit(f"error: no USED table in {INTERNALS}")


class Tree:
    """The module files of one vLLM source tree, parsed on demand."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self.modules:
            relative = Path(*name.split(".")[1:])
            candidates = [self.root / relative.with_suffix(".py"), self.root / relative / "__init__.py"]
            path = next((p for p in candidates if p.is_file()), None)
            self.modules[name] = ast.parse(path.read_text()) if path else None
        return self.modules[name]

    def find(self, module: str, qualname: str, depth: int = 0):
        """The definition of ``qualname`` in ``module`` (following ``from vllm... import`` re-exports), with the
        module it lives in."""
        tree = self.module(module)
        if tree is None or depth > 5:
            return None, module
        head, _, rest = qualname.partition(".")
        for node in reversed(tree.body):  # the last definition: the implementation after any @overload stubs
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == head:
                return (self.member(node, rest) if rest else node), module
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if not rest and any(getattr(t, "id", None) == head for t in targets):
                return node, module
        for node in tree.body:
            source = self.imported_module(node, module)
            for alias in getattr(node, "names", []) if source else []:
                if (alias.asname or alias.name) == head:
                    return self.find(source, ".".join(filter(None, [alias.name, rest])), depth + 1)
        return None, module

    def imported_module(self, node: ast.stmt, module: str) -> str | None:
        """The vllm module a ``from ... import`` statement in ``module`` reads (relative imports resolved)."""
        if not isinstance(node, ast.ImportFrom):
            return None
        if node.level:
            package = module.split(".")
            is_package = (self.root / Path(*package[1:]) / "__init__.py").is_file()
            base = package[: len(package) - node.level + is_package]
            return ".".join(base + ([node.module] if node.module else []))
        return node.module if node.module and node.module.startswith("vllm") else None

    @staticmethod
    def member(cls: ast.ClassDef, name: str):
        methods = [
            n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
        ]
        return methods[-1] if methods else None

    def class_names(self, cls: ast.ClassDef, module: str, depth: int = 0) -> set[str]:
        """Everything a class offers by name: its members, fields, ``__init__`` parameters and ``self.x``
        attributes, and those of the base classes found in the tree."""
        names: set[str] = set()
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                if node.name == "__init__":
                    names |= parameters(node)
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        names.add(sub.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if depth < 8:
            for base in cls.bases:
                base_name = ast.unparse(base).split("[")[0]
                found, base_module = self.find(module, base_name)
                if isinstance(found, ast.ClassDef):
                    names |= self.class_names(found, base_module, depth + 1)
        return names


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}


def check(root: Path) -> dict[str, list[str]]:
    """``{"module:qualname": [missing members]}`` for every entry of USED with a problem (``["<definition>"]``
    when the name itself is not found)."""
    tree, problems = Tree(root), {}
    for path, members in used_names().items():
        module, qualname = path.split(":")
        found, where = tree.find(module, qualname)
        if found is None:
            problems[path] = ["<definition>"]
            continue
        if isinstance(found, ast.ClassDef):
            offered = tree.class_names(found, where)
        elif isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
            offered = parameters(found)
        else:  # a module-level constant: only its existence is used
            offered = set(members)
        missing = [m for m in members if m not in offered]
        if missing:
            problems[path] = missing
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="swiftkv check-vllm-api",
        description=__doc__.split("\n\n")[0],
        epilog="example:\n  swiftkv check-vllm-api .venv-vllm/lib/python3.11/site-packages/vllm",
    )
    parser.add_argument("source", type=Path, help="the vllm package folder of a vLLM source tree or wheel")
    parser.add_argument("--out", type=Path, help="write the problems as JSON here")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error already printed (2)
        return int(e.code or 0)
    if not (args.source / "__init__.py").is_file():
        print(f"error: {args.source} is not a vllm package folder (to resolve, pass the folder holding vllm's "
              "__init__.py)", file=sys.stderr)  # fmt: skip
        return 2
    problems = check(args.source)
    for path, missing in problems.items():
        print(f"missing in {args.source}: {path} -> {', '.join(missing)}")
    print(f"{len(used_names()) - len(problems)} of {len(used_names())} names as the plugin uses them")
    if args.out:
        args.out.write_text(json.dumps(problems, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
