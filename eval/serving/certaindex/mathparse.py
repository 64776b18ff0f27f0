"""A whitelist parser from answer text to a sympy expression tree, so answers are compared without running them.

Model output (and any server's reply) is untrusted: sympy's ``parse_expr``/``sympify`` evaluate Python, so
``\\boxed{__import__("os").system(...)}`` would run on the host.  Here a tokenizer accepts only numbers,
single-letter variables, ``pi``/``\\pi``, ``sqrt``/``\\sqrt{}``/``\\sqrt[n]{}``, ``\\frac{}{}``, ``+ - * /``,
``^``/``**``, ``\\cdot``/``\\times``/``\\div``, ``%`` and brackets, and a recursive-descent parser builds the
tree from sympy constructors (Integer, Rational, Symbol, Add, Mul, Pow, pi) directly.  Anything else raises
:class:`ParseError` and the caller falls back to string equality.  Numeric exponents are bounded so that
``9^9^9^9`` is refused instead of computed.  Input is expected normalized (lower case, no spaces, TeX
wrappers such as ``\\left``/``\\dfrac``/``\\text{}`` already rewritten; see ``answers.normalize``).
"""

from __future__ import annotations

import functools
import re

import sympy

MAX_EXPONENT = 64  # |numeric exponent| allowed; larger powers are refused, not computed
MAX_POWER_BITS = 100_000  # a rational power whose result would need more bits is refused too

_TOKEN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)|(\\[a-z]+)|([a-z]+)|(\*\*|[-+*/^(){}\[\]%])")
_OPEN = {"(": ")", "{": "}", "[": "]"}
_COMMANDS = {"\\cdot": "*", "\\times": "*", "\\div": "/"}


class ParseError(ValueError):
    """The text is not in the whitelisted grammar; compare it as a string."""


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ParseError(f"unexpected {text[pos]!r} at {pos}")
        token = match.group()
        tokens.append(_COMMANDS.get(token, token))
        pos = match.end()
    return tokens


def _number(text: str) -> sympy.Expr:
    whole, _, decimals = text.partition(".")
    return sympy.Rational(int(whole or "0") * 10 ** len(decimals) + int(decimals or "0"), 10 ** len(decimals))


def _power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    if exponent.is_Number:
        if not exponent.is_finite or abs(exponent) > MAX_EXPONENT:
            raise ParseError(f"exponent {exponent} is above {MAX_EXPONENT}")
        if (
            base.is_Rational
            and max(base.p.bit_length(), base.q.bit_length()) * abs(exponent) > MAX_POWER_BITS
        ):
            raise ParseError(f"power with exponent {exponent} is too large to compute")
    return sympy.Pow(base, exponent)


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/'|implicit) unary)* ;
    unary := ('+'|'-') unary | power ; power := postfix ('^' unary)? ; postfix := primary '%'?"""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise ParseError(f"expected {expected or 'more'} at token {self.pos}, got {token!r}")
        self.pos += 1
        return token

    def parse(self) -> sympy.Expr:
        value = self.expr()
        if self.peek() is not None:
            raise ParseError(f"unexpected {self.peek()!r} at token {self.pos}")
        return value

    def expr(self) -> sympy.Expr:
        terms = [self.term()]
        while self.peek() in ("+", "-"):
            sign = self.take()
            terms.append(self.term() if sign == "+" else -self.term())
        return sympy.Add(*terms)

    def term(self) -> sympy.Expr:
        factors = [self.unary()]
        while True:
            token = self.peek()
            if token in ("*", "/"):
                self.take()
                factor = self.unary()
                factors.append(factor if token == "*" else _power(factor, sympy.Integer(-1)))
            elif token is not None and self.starts_primary(token):  # implicit: 2x, 2\sqrt{2}, (a)(b)
                factors.append(self.power())
            else:
                return sympy.Mul(*factors)

    def unary(self) -> sympy.Expr:
        if self.peek() in ("+", "-"):
            return self.unary() if self.take() == "+" else -self.unary()
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.postfix()
        if self.peek() in ("^", "**"):
            self.take()
            return _power(base, self.unary())
        return base

    def postfix(self) -> sympy.Expr:
        value = self.primary()
        if self.peek() == "%":
            self.take()
            value = value / 100
        return value

    @staticmethod
    def starts_primary(token: str) -> bool:
        return token in _OPEN or token[0].isdigit() or token[0] in ".\\" or token.isalpha()

    def group(self) -> sympy.Expr:
        """A ``\\frac`` argument: ``{expr}``, or one digit or letter as in ``\\frac12``."""
        token = self.peek()
        if token is not None and token.isdigit() and len(token) > 1:
            self.tokens[self.pos] = token[1:]
            return sympy.Integer(int(token[0]))
        return self.primary()

    def primary(self) -> sympy.Expr:
        token = self.take()
        if token in _OPEN:
            value = self.expr()
            self.take(_OPEN[token])
            return value
        if token[0].isdigit() or token[0] == ".":
            return _number(token)
        if token in ("\\pi", "pi"):
            return sympy.pi
        if token == "\\frac":
            numerator = self.group()
            return numerator * _power(self.group(), sympy.Integer(-1))
        if token in ("\\sqrt", "sqrt"):
            index = sympy.Integer(2)
            if token == "\\sqrt" and self.peek() == "[":
                self.take()
                index = self.expr()
                self.take("]")
            return _power(self.primary(), 1 / index)
        if len(token) == 1 and token.isalpha():
            return sympy.Symbol(token)
        raise ParseError(f"{token!r} is not a number, a one-letter variable or a known function")


@functools.lru_cache(maxsize=4096)
def parse_math(text: str) -> sympy.Expr:
    """The sympy tree of a normalized answer; :class:`ParseError` when it is outside the grammar."""
    if not text:
        raise ParseError("empty answer")
    return _Parser(_tokens(text)).parse()
