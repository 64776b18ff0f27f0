"""The rooms' import rules and "no test hooks in the library", read from the source with ``ast``.

``toolkit`` is the shared base that every room may import, and it imports no room (its front door names the
rooms' commands as text, imported only when one runs); ``swiftkv`` is the ground floor (the model) and imports
only the base; ``kvcompress`` and ``distill`` import only ``swiftkv`` and the base; ``eval`` may import all of
them; nothing imports ``scripts`` (and the library never imports ``tests``).  Library code holds no test hooks:
no ``os._exit``, no ``pytest``, and no environment-variable names about killing, faults or tests
(``SWIFTKV_..._KILL_AT``): tests kill processes from outside.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import ROOT

LIBRARY = ("toolkit", "swiftkv", "kvcompress", "distill", "eval")
ALLOWED = {
    "toolkit": {"toolkit"},
    "swiftkv": {"swiftkv", "toolkit"},
    "kvcompress": {"kvcompress", "swiftkv", "toolkit"},
    "distill": {"distill", "swiftkv", "toolkit"},
    "eval": {"eval", "swiftkv", "kvcompress", "distill", "toolkit"},
}
OURS = {*LIBRARY, "scripts", "tests"}
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
HOOK_WORDS = {"KILL", "FAULT", "FAULTS", "TEST", "TESTS", "TESTING"}


def python_files(*rooms: str) -> list[Path]:
    return sorted(p for room in rooms for p in (ROOT / room).rglob("*.py") if ".venv" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module the file imports: import statements (relative ones resolved) and
    ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            if not node.module:  # from . import x: x may be a module
                names.update(f"{module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
        ):
            names.add(node.args[0].value)
    return names


def rooms_imported(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)} & OURS


def test_the_rules_see_imports():
    """The parser resolves relative imports and finds every room that the eval job uses."""
    assert rooms_imported(ROOT / "eval" / "job.py") >= {"eval", "distill", "swiftkv", "toolkit"}
    assert "toolkit" in rooms_imported(ROOT / "toolkit" / "checkpoint.py")  # from .cliargs import ...


@pytest.mark.parametrize("room", LIBRARY)
def test_room_imports_only_what_it_may(room):
    wrong = {str(p.relative_to(ROOT)): sorted(rooms_imported(p) - ALLOWED[room]) for p in python_files(room)}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_nothing_imports_scripts():
    files = python_files(*LIBRARY, "scripts", "tests")
    assert [str(p.relative_to(ROOT)) for p in files if "scripts" in rooms_imported(p)] == []
    library = python_files(*LIBRARY)
    assert [str(p.relative_to(ROOT)) for p in library if "tests" in rooms_imported(p)] == []


def module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The library modules that ``path`` imports when it is imported (statements in the module body; imports
    inside functions run later and may close a circle on purpose)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
    return (names & modules) - {module_name(path)}


def test_no_import_circles():
    """No library module imports, at import time, a module that imports it back (directly or round a circle)."""
    files = {module_name(p): p for p in python_files(*LIBRARY)}
    graph = {name: module_level_imports(path, set(files)) for name, path in files.items()}
    circles, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            circles.append(" -> ".join(path[path.index(name) :] + [name]))
        elif name not in done:
            for imported in sorted(graph[name]):
                visit(imported, [*path, name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert circles == []


def is_hook_name(text: str) -> bool:
    """An environment-variable-like name with a word about killing, faults or tests."""
    return bool(ENV_NAME.match(text)) and not HOOK_WORDS.isdisjoint(text.split("_"))


def hooks_in(path: Path) -> list[str]:
    """What in ``path`` looks like a test hook."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "_exit":
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and is_hook_name(node.value):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if (module or "").split(".")[0] == "pytest":
                found.append(f"line {node.lineno}: imports pytest")
    return found


def test_hook_rule_catches_the_old_kill_hook(tmp_path):
    old = tmp_path / "train.py"
    old.write_text(
        'import os\nKILL_ENV = "SWIFTKV_DISTILL_KILL_AT_STEP"\n'
        "if step == int(os.environ.get(KILL_ENV, 0)):\n    os._exit(17)\n"
    )
    assert len(hooks_in(old)) == 2
    clean = tmp_path / "clean.py"
    clean.write_text('import os\nCACHE = os.environ.get("SWIFTKV_CACHE")\nLATEST = "LATEST_TESTED"\n')
    assert hooks_in(clean) == []


LIBRARY_FILES = [str(p.relative_to(ROOT)) for p in python_files(*LIBRARY)]


@pytest.mark.parametrize("rel", LIBRARY_FILES)
def test_library_holds_no_test_hooks(rel):
    assert hooks_in(ROOT / rel) == []
