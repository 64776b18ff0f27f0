"""Answer extraction and equality for Certaindex probes and final outputs.

A probe ends with ``\\boxed{`` and the model completes the box, so its answer is the text up to the first
*unmatched* closing brace (nested ``\\frac{1}{2}`` braces are kept); a probe that never closes the box has
no answer (empty string).  Two answers are equal when their normalized strings match, or when both parse as
numbers (fractions, percentages, thousands separators) that are close, or as sympy expressions whose
difference simplifies to zero.  Answers are untrusted text: the expressions come from the whitelist parser of
:mod:`.mathparse` (sympy constructors, never ``parse_expr``/``sympify``), so code-shaped answers compare as
plain strings.  Hesitation words are matched as whole words ("no" does not match "know").
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction

PROBE_SUFFIX = "... Oh, I suddenly got the answer to the whole problem, **Final Answer**\n\n\\[ \\boxed{"
HESITATION_WORDS = ("wait", "hold", "but", "okay", "no", "hmm")
_HESITATION_RE = re.compile(r"\b(" + "|".join(HESITATION_WORDS) + r")\b", re.IGNORECASE)
_MAX_SYMPY_CHARS = 64  # sympy can take seconds on long inputs; longer answers compare as strings only


def extract_probe_answer(text: str) -> str:
    """Text before the first unmatched ``}``, stripped; ``""`` when the box is never closed."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                return text[:i].strip()
            depth -= 1
    return ""


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    answer = extract_probe_answer(text[start + len("\\boxed{") :])
    return answer or None


_ANSWER_IS_RE = re.compile(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*(?:\.\s|\.$|$|\n)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_final_answer(text: str, choices: int = 0) -> str:
    """Answer of a finished chain of thought: the last ``\\boxed{}``, else "the answer is X" (right of its last
    "="), else the last number; with ``choices`` > 0 (multiple choice), the last standalone option letter instead."""
    if choices:
        letters = "ABCDEFGHIJ"[:choices]
        found = re.findall(rf"\b([{letters}])\b", _last_boxed(text) or text)
        return found[-1] if found else ""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    said = [a.strip() for a in _ANSWER_IS_RE.findall(text) if "\\boxed" not in a]
    if said:  # "the answer is 5 * 5 = 25 marbles": the result is what follows the last "="
        return said[-1].rsplit("=", 1)[-1].strip()
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else ""


def is_hesitant(text: str) -> bool:
    """True when the probe output contains a hesitation word (whole word, any case)."""
    return _HESITATION_RE.search(text) is not None


def normalize(answer: str) -> str:
    """Canonical string form: no TeX wrappers, units in ``\\text{}``, ``$``, spaces, trailing dot; lower case."""
    s = answer.replace("\\$", "").strip().strip("$").strip()
    s = re.sub(r"^(-?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z]{2,}[A-Za-z ]*$", r"\1", s)  # "21 apples" -> "21"
    s = re.sub(r"\\text\{[^{}]*\}\s*$", "", s).strip() or s  # trailing unit, unless it is the whole answer
    s = re.sub(r"\\(?:text|mathrm|mathbf)\{([^{}]*)\}", r"\1", s)
    s = (
        s.replace("\\dfrac", "\\frac")
        .replace("\\tfrac", "\\frac")
        .replace("\\left", "")
        .replace("\\right", "")
    )
    s = (
        s.replace("\\!", "")
        .replace("\\,", "")
        .replace("\\%", "%")
        .replace("^\\circ", "")
        .replace("^{\\circ}", "")
    )
    s = re.sub(r"\s+", "", s).rstrip(".").lower()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


_DECIMAL_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_FRAC_RE = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}")


def _as_number(s: str) -> Fraction | None:
    """Exact value of a decimal, ``a/b``, ``\\frac{a}{b}``, optionally with ``%``; None for anything else (a
    pattern first: ``Fraction`` alone would also read ``1e999999999`` and build that integer)."""
    percent = s.endswith("%")
    s = s.removesuffix("%")
    frac = _FRAC_RE.fullmatch(s)
    try:
        if frac:
            value = Fraction(int(frac.group(2)), int(frac.group(3)))
            value = -value if frac.group(1) else value
        elif _DECIMAL_RE.fullmatch(s):
            value = Fraction(s)
        else:
            return None
    except (ValueError, ZeroDivisionError):  # a zero denominator, or more digits than int() reads
        return None
    return value / 100 if percent else value


def _close(a: Fraction, b: Fraction) -> bool:
    """``math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)`` in exact arithmetic (no float overflow)."""
    return abs(a - b) <= max(Fraction(1, 10**6) * max(abs(a), abs(b)), Fraction(1, 10**9))


def _symbolic_equal(a: str, b: str) -> bool:
    if max(len(a), len(b)) > _MAX_SYMPY_CHARS:
        return False
    import sympy

    from .mathparse import ParseError, parse_math  # sympy loads on the first symbolic comparison only

    try:
        ea, eb = parse_math(a), parse_math(b)
    except ParseError:
        return False

    try:
        return bool(sympy.simplify(ea - eb) == 0)
    except (TypeError, ValueError, ArithmeticError, RecursionError):  # e.g. nan or zoo inside the difference
        return False


def answers_equal(a: str, b: str) -> bool:
    """Normalized string equality, else numeric closeness, else sympy equality; empty never equals anything.

    Cached on the (unordered) pair of normalized strings: self-consistency rounds and calibration compare
    the same answers again and again."""
    na, nb = normalize(a), normalize(b)
    return _equal_normalized(*sorted((na, nb)))


@functools.lru_cache(maxsize=65536)
def _equal_normalized(na: str, nb: str) -> bool:
    if not na or not nb:
        return False
    if na == nb:
        return True
    va, vb = _as_number(na), _as_number(nb)
    if va is not None and vb is not None:
        return _close(va, vb)
    if re.search(r"[0-9a-z]", na) is None or re.search(r"[0-9a-z]", nb) is None:
        return False
    return _symbolic_equal(na, nb)
