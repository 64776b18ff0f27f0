"""Every ``tests/...``, ``scripts/...`` and ``recipes/...`` path that README.md and the pages under docs/ name
exists (a glob such as ``scripts/bench_*.py`` matches a file), so a moved test or script cannot leave a stale
reference behind.  Paths are repository-relative; a segment in capitals (``recipes/deepspeed/NAME.json``) is a
placeholder and not checked."""

from __future__ import annotations

import re

from helpers import ROOT

PATH = re.compile(r"(?<![\w/.~-])((?:tests|scripts|recipes)/[\w./*-]*[\w*])")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.\w+)?$")


def named_paths(text: str) -> set[str]:
    return {p for p in PATH.findall(text) if not any(PLACEHOLDER.match(part) for part in p.split("/"))}


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_the_pattern_finds_paths_and_skips_placeholders():
    text = (
        "see `tests/distill/test_train.py::test_x`, scripts/bench_*.py, (recipes/accelerate/8gpu_zero2.yaml), "
        "recipes/deepspeed/NAME.json and out/tests/x.py"
    )
    assert named_paths(text) == {
        "tests/distill/test_train.py",
        "scripts/bench_*.py",
        "recipes/accelerate/8gpu_zero2.yaml",
    }
    assert exists("scripts/bench_*.py") and not exists("tests/test_swiftkv_reference.py")


def test_every_path_the_docs_name_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    stale = {
        f"{page.relative_to(ROOT)}: {path}"
        for page in pages
        for path in named_paths(page.read_text())
        if not exists(path)
    }
    assert not stale, "paths that do not exist:\n" + "\n".join(sorted(stale))
