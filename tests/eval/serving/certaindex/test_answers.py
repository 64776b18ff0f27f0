"""Answer comparison treats model output as data: code-shaped answers never run and compare as plain strings;
the whitelist parser covers the math that answers are written in, and repeated comparisons hit a cache."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from eval.serving.certaindex import answers
from eval.serving.certaindex.answers import answers_equal, extract_final_answer
from eval.serving.certaindex.certainty import certaindex


@pytest.fixture
def marker_dir():
    # normalize() lower-cases and drops spaces, and the old parser only read short answers: a short,
    # lower-case directory keeps every payload able to run under an evaluating comparison
    path = Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))
    yield path
    shutil.rmtree(path)


PAYLOADS = [
    '__import__("os").system(">{m}/a")',
    'open("{m}/b","w")',
    '(lambda:open("{m}/c","w"))()',
    'getattr(__import__("io"),"open")("{m}/d","w")',
    "eval(\"open('{m}/e','w')\")",
    '(f:=open("{m}/f","w"))',
    '[open("{m}/g","w")for(q)in[1]]',
    '__import__("pathlib").Path("{m}/h").touch()',
    "().__class__.__base__.__subclasses__()",
    "x.__class__.__name__",
    "{{}}.__class__",
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_code_shaped_answers_never_run_and_compare_as_strings(payload, marker_dir):
    code = payload.format(m=marker_dir)
    boxed = extract_final_answer(f"so \\boxed{{{code}}}")
    assert boxed == code
    for other in ("0", "1", "none", "x", code + "+0", "\\frac{1}{2}"):
        assert not answers_equal(code, other) and not answers_equal(other, code)
    assert answers_equal(code, code) and answers_equal(code, " " + code.upper())  # same normalized string
    assert certaindex([code, code, "2"]) > 0
    assert list(marker_dir.iterdir()) == []  # nothing ran


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("\\sqrt[3]{8}", "2"),
        ("\\sqrt{2}\\cdot\\sqrt{2}", "2"),
        ("sqrt(12)", "2\\sqrt{3}"),
        ("2^{10}", "1024"),
        ("2**10", "1024"),
        ("x^2+2x+1", "(x+1)^2"),
        ("\\left(\\frac{1}{2}\\right)^2", "\\tfrac{1}{4}"),
        ("2\\pi", "\\pi+pi"),
        ("3\\times4", "12"),
        ("\\frac{\\sqrt{3}}{2}", "\\dfrac{1}{2}\\sqrt{3}"),
        ("12.5\\%", "\\frac{1}{8}"),
        ("2x-x", "x"),
        ("-(-3)", "3"),
        ("4\\text{ cm}", "4"),
        ("\\frac{6}{4}", "1.5"),
        ("\\frac12", "0.5"),
        ("x^{-1}", "\\frac{1}{x}"),
        ("10/4", "5/2"),
        ("[2]", "2"),
    ],
)
def test_whitelisted_math_compares_by_value(a, b):
    assert answers_equal(a, b) and answers_equal(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("\\sqrt{2}", "1.41421"),
        ("x^2", "2x"),
        ("xy", "x*y"),  # multi-letter names are not parsed: compared as strings
        ("(1,2)", "(2,1)"),
        ("\\pi", "3.14159"),
        ("2^{x}", "x^2"),
    ],
)
def test_values_that_differ_stay_unequal(a, b):
    assert not answers_equal(a, b)


def test_huge_powers_are_refused_not_computed():
    start = time.process_time()  # CPU time of this process: the same on a loaded machine
    assert not answers_equal("9^9^9^9", "1")
    assert not answers_equal("10^{10^{10}}", "0")
    assert time.process_time() - start < 5  # a generous bound: evaluating either would not finish


def test_repeated_comparisons_hit_the_cache():
    answers._equal_normalized.cache_clear()
    certaindex(["\\frac{3}{7}", "3/7", "6/14", "0.4"] * 4)
    first = answers._equal_normalized.cache_info()
    certaindex(["\\frac{3}{7}", "3/7", "6/14", "0.4"] * 4)
    second = answers._equal_normalized.cache_info()
    assert second.misses == first.misses and second.hits > first.hits
    assert (
        answers_equal(" 6/14", "\\frac{3}{7}")
        and answers._equal_normalized.cache_info().misses == first.misses
    )
