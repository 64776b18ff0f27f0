"""Problems for Certaindex runs: a validated JSONL format and a seeded arithmetic generator.

A problem is ``{"id", "question", "answer"}`` plus optional ``"choices"`` (multiple choice: the answer is
the option letter).  No math benchmark ships inside a PyPI package (GSM8K and friends download from the hub
at run time), so ``arithmetic(n, seed)`` writes one- and two-step word problems with known integer answers,
small enough that a 135M model solves some of them: the benchmark needs a task where the model is neither
always right nor always wrong.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

LETTERS = "ABCDEFGHIJ"


class Problem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    """Unique key; results are resumed by it."""
    question: str
    """The problem statement, without instructions (``prompt_text`` adds them)."""
    answer: str
    """Reference answer: a number or expression, or the option letter when ``choices`` is set."""
    choices: list[str] | None = None
    """Option texts for multiple choice (2 to 10), labelled A, B, ..."""

    @field_validator("choices")
    @classmethod
    def _check_choices(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not 2 <= len(v) <= len(LETTERS):
            raise ValueError(f"choices must have 2 to {len(LETTERS)} options, got {len(v)}")
        return v

    def prompt_text(self) -> str:
        """Question plus the instruction to reason and box the answer."""
        if not self.choices:
            return f"{self.question}\nThink step by step, then give the final answer in \\boxed{{}}."
        options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(self.choices))
        return f"{self.question}\n{options}\nThink step by step, then give the letter of the answer in \\boxed{{}}."


def load_problems(path: str | Path, limit: int | None = None) -> list[Problem]:
    """Read a JSONL file of problems; a bad line raises one error naming the file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no problem file at {path}; to resolve, check --data (or use --data arith:N:SEED)"
        )
    problems: list[Problem] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            problems.append(Problem.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as err:
            first = err.errors()[0] if isinstance(err, ValidationError) else {"loc": (), "msg": str(err)}
            where = ".".join(map(str, first["loc"])) or "line"
            raise ValueError(f"{path}:{lineno}: {where}: {first['msg']}; to resolve, fix that line") from None
        if limit is not None and len(problems) >= limit:
            break
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate problem ids; to resolve, give every line a unique id")
    return problems


_NAMES = ("Tom", "Ana", "Sam", "Lea", "Max", "Mia", "Ben", "Zoe")
_THINGS = ("apples", "pens", "books", "coins", "cards", "shells", "stickers", "marbles")


def arithmetic(n: int, seed: int = 0) -> list[Problem]:
    """``n`` word problems (add, subtract, multiply, or add then subtract) with small numbers; deterministic."""
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        who, what = rng.choice(_NAMES), rng.choice(_THINGS)
        kind = rng.choice(("add", "sub", "mul", "two"))
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 5)
        if kind == "add":
            q, ans = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?", a + b
        elif kind == "sub":
            a += b
            q, ans = f"{who} has {a} {what} and gives away {b}. How many {what} are left?", a - b
        elif kind == "mul":
            q, ans = (
                f"There are {a} bags with {b} {what} in each bag. How many {what} are there in total?",
                a * b,
            )
        else:
            q = f"{who} has {a} {what}, finds {b} more, then loses {c}. How many {what} does {who} have now?"
            ans = a + b - c
        problems.append(Problem(id=f"arith-{seed}-{i}", question=q, answer=str(ans)))
    return problems


def resolve_problems(data: str, limit: int | None = None) -> list[Problem]:
    """``arith:N[:SEED]`` generates problems; anything else is a JSONL path."""
    if data.startswith("arith:"):
        parts = data.split(":")
        try:
            n, seed = int(parts[1]), int(parts[2]) if len(parts) > 2 else 0
        except (ValueError, IndexError):
            raise ValueError(f"bad --data {data!r}; to resolve, write arith:N or arith:N:SEED") from None
        return arithmetic(n if limit is None else min(n, limit), seed)
    return load_problems(data, limit)
