"""Prompts for a prompt-heavy evaluation of a chat model, built in code without any download.

SwiftKV saves most where the prompt is long and the reply short (retrieval, RAG, summarization), and its
student computes the K/V of the later layers from earlier ones: does it still find one fact in a long
prompt?  ShareGPT is mostly short chat, so this module builds two other sets:

* **synthetic retrieval** in the style of RULER (Hsieh et al. 2024, https://arxiv.org/abs/2404.06654), with a
  known answer: ``passkey`` (one needle in a haystack), ``multikey`` (several keyed needles, one asked for) and
  ``vartrack`` (chains of variable assignments).  The haystack is varied filler made from small word lists
  (RULER repeats one line), sized with the tokenizer so that the prompt is just under the target length.
  Every answer is a number, so every task is scored the same way (SmolLM2 writes each digit as one token).
  RULER's variable tracking asks for *all* the variables that hold a value (four hops); here the question is
  the value of the last variable of a one-hop chain (``VAR A = 12345`` ... ``VAR B = VAR A``) among two
  distractor chains, which SmolLM2-135M-Instruct has a chance at: at 1024 tokens (6 samples, each answer digit
  the argmax given the ones before) it got 5/6 passkey and multikey answers, 2/6 one-hop answers and 0/6 with
  two or four hops.  The likelihood of the answer stays a graded signal where accuracy is low;
* **documents** that are neither chat nor ShareGPT: the documentation Python ships for a fixed list of
  standard-library modules (``inspect.getdoc`` of each module and its public classes, methods and functions,
  read by a fresh interpreter), the same on every run of one Python version, each followed by an instruction
  (summarize, list, give an example...).

A retrieval sample is ``{"task", "length", "messages", "answer_prefix", "answer"}``: the reply is meant to be
``answer_prefix + answer`` (``"The pass key is" + " 12345"``); ``prompt_ids`` is the chat prompt with the
generation prompt and the answer prefix, ``answer_ids`` the tokens that follow it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import json
import random
import string
import subprocess
import sys
from dataclasses import dataclass
from types import MappingProxyType

TASKS = ("passkey", "multikey", "vartrack")
# A prompt has 95% to 100% of its target length: 5% of 512 tokens (25) is more than one filler sentence, so
# the haystack can always end within it.
MIN_LENGTH = 512
MULTIKEY_NEEDLES = 4
VARTRACK_HOPS = 1
VARTRACK_CHAINS = 3  # the asked chain and two distractors

_NOUNS = (
    "river", "garden", "teacher", "window", "village", "engine", "lantern", "orchard", "painter", "bridge",
    "kitten", "mountain", "sailor", "library", "meadow", "farmer", "candle", "harbor", "forest", "baker",
)  # fmt: skip
_ADJECTIVES = (
    "quiet", "old", "bright", "small", "heavy", "gentle", "narrow", "busy", "cold", "golden",
    "patient", "wooden", "distant", "curious", "tired", "silver", "crowded", "plain", "warm", "rusty",
)  # fmt: skip
_VERBS = (
    "waited", "rested", "wandered", "listened", "shivered", "glowed", "settled", "lingered", "drifted", "sang",
)  # fmt: skip
_PLACES = (
    "near the hill", "by the road", "under the old roof", "behind the market", "across the field",
    "beside the well", "at the edge of town", "in the valley",
)  # fmt: skip
_TIMES = ("In the morning", "Later that day", "Every autumn", "Before the rain", "At dusk", "Once a week")
_ADVERBS = ("slowly", "softly", "happily", "calmly", "quietly", "strangely")
_FILLER = (
    "The {adj} {noun} {verb} {place}.",
    "{time}, a {adj} {noun} {verb} {place}.",
    "Nobody knew why the {noun} {verb} so {adverb}.",
    "A {noun} and a {noun2} {verb} {place}.",
    "The {noun} was {adj}, and the {noun2} was {adj2}.",
    "{time}, the {noun2} {verb} {adverb} while the {noun} {verb2}.",
)
# the multikey keys, disjoint from the filler's words so that a key is named only by its needle and question
_KEY_ADJECTIVES = (
    "hurried", "fragile", "crimson", "hollow", "brave", "clumsy", "frozen", "loyal", "noisy", "polite",
)  # fmt: skip
_KEY_NOUNS = (
    "dragon", "compass", "violin", "walrus", "pepper", "rocket", "saddle", "tulip", "anchor", "falcon",
)  # fmt: skip


@dataclass
class _Retrieval:
    """What a retrieval prompt holds besides its filler: needles are (depth in [0, 1], sentence)."""

    intro: str
    needles: list[tuple[float, str]]
    question: str
    answer_prefix: str
    answer: str


def _passkey(rng: random.Random) -> _Retrieval:
    key = str(rng.randint(10000, 99999))
    return _Retrieval(
        intro="There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about it.",
        needles=[(rng.random(), f"The pass key is {key}. Remember it. {key} is the pass key.")],
        question="What is the pass key?",
        answer_prefix="The pass key is",
        answer=f" {key}",
    )


def _multikey(rng: random.Random) -> _Retrieval:
    pairs = rng.sample([(a, n) for a in _KEY_ADJECTIVES for n in _KEY_NOUNS], MULTIKEY_NEEDLES)
    keys = [f"{adjective}-{noun}" for adjective, noun in pairs]
    numbers = rng.sample(range(1_000_000, 10_000_000), MULTIKEY_NEEDLES)
    needles = [
        (rng.random(), f"One of the special magic numbers for {k} is: {v}.")
        for k, v in zip(keys, numbers, strict=True)
    ]
    asked = rng.randrange(MULTIKEY_NEEDLES)
    return _Retrieval(
        intro="Some special magic numbers are hidden within the following text. Make sure to memorize them. I "
        "will quiz you about the numbers afterwards.",
        needles=needles,
        question=f"What is the special magic number for {keys[asked]} mentioned in the provided text?",
        answer_prefix=f"The special magic number for {keys[asked]} mentioned in the provided text is",
        answer=f" {numbers[asked]}",
    )


def _variable_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    return sorted(names)


def _vartrack(rng: random.Random) -> _Retrieval:
    names = _variable_names(rng, VARTRACK_CHAINS * (VARTRACK_HOPS + 1))
    rng.shuffle(names)
    values = rng.sample(range(10000, 100000), VARTRACK_CHAINS)
    needles = []
    for c, value in enumerate(values):
        chain = names[c * (VARTRACK_HOPS + 1) : (c + 1) * (VARTRACK_HOPS + 1)]
        statements = [f"VAR {chain[0]} = {value}."]
        statements += [f"VAR {name} = VAR {previous}." for previous, name in itertools.pairwise(chain)]
        needles += zip(sorted(rng.random() for _ in statements), statements, strict=True)
    last = names[VARTRACK_HOPS]  # the asked chain is the first one
    return _Retrieval(
        intro="Memorize and track the chains of variable assignments hidden in the following text.",
        needles=needles,
        question=f"Question: What is the value of VAR {last}?",
        answer_prefix=f"Answer: The value of VAR {last} is",
        answer=f" {values[0]}",
    )


_BUILDERS = {"passkey": _passkey, "multikey": _multikey, "vartrack": _vartrack}


def _filler_sentence(rng: random.Random) -> str:
    noun, noun2 = rng.sample(_NOUNS, 2)
    adj, adj2 = rng.sample(_ADJECTIVES, 2)
    verb, verb2 = rng.sample(_VERBS, 2)
    words = {"noun": noun, "noun2": noun2, "adj": adj, "adj2": adj2, "verb": verb, "verb2": verb2}
    words |= {"place": rng.choice(_PLACES), "time": rng.choice(_TIMES), "adverb": rng.choice(_ADVERBS)}
    return rng.choice(_FILLER).format(**words)


def _haystack(retrieval: _Retrieval, filler: list[str]) -> str:
    """The filler with each needle at its depth (stable: needles of equal place keep their order)."""
    slots: list[list[str]] = [[] for _ in range(len(filler) + 1)]
    for depth, needle in sorted(retrieval.needles, key=lambda item: item[0]):
        slots[min(int(depth * (len(filler) + 1)), len(filler))].append(needle)
    sentences = slots[0] + [
        s for sentence, slot in zip(filler, slots[1:], strict=True) for s in [sentence, *slot]
    ]
    return " ".join(sentences)


def _messages(retrieval: _Retrieval, filler: list[str]) -> list[dict[str, str]]:
    content = f"{retrieval.intro}\n\n{_haystack(retrieval, filler)}\n\n{retrieval.question}"
    return [{"role": "user", "content": content}]


def _prompt_text(tokenizer, messages: list[dict[str, str]], answer_prefix: str) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + answer_prefix


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fill(tokenizer, rng: random.Random, budget: int) -> list[str]:
    """Filler sentences whose tokens (each counted with the space that joins it) add up to at most ``budget``."""
    filler: list[str] = []
    while True:
        batch = [_filler_sentence(rng) for _ in range(64)]
        counts = [
            len(ids) for ids in tokenizer([" " + s for s in batch], add_special_tokens=False)["input_ids"]
        ]
        for sentence, count in zip(batch, counts, strict=True):
            if count > budget:
                return filler
            filler.append(sentence)
            budget -= count


def _prompt_length(tokenizer, retrieval: _Retrieval, filler: list[str]) -> int:
    return _count(tokenizer, _prompt_text(tokenizer, _messages(retrieval, filler), retrieval.answer_prefix))


def _retrieval_sample(tokenizer, task: str, length: int, rng: random.Random) -> dict:
    retrieval = _BUILDERS[task](rng)
    overhead = _prompt_length(tokenizer, retrieval, [])
    if length < max(MIN_LENGTH, 2 * overhead):
        raise ValueError(
            f"length {length} is too small for task {task!r}: its chat template, question and needles take "
            f"{overhead} tokens and the filler at least as many; use length >= {max(MIN_LENGTH, 2 * overhead)}"
        )
    filler = _fill(tokenizer, rng, length - overhead)
    # the sentences' counts add up to the prompt's within a few tokens (joins); drop the last ones if over
    while _prompt_length(tokenizer, retrieval, filler) > length:
        filler.pop()
    return {
        "task": task,
        "length": length,
        "messages": _messages(retrieval, filler),
        "answer_prefix": retrieval.answer_prefix,
        "answer": retrieval.answer,
    }


def retrieval_samples(tokenizer, task: str, length: int, n: int, seed: int = 0) -> list[dict]:
    """``n`` RULER-style retrieval samples of ``task`` whose prompt (``prompt_ids``) has between 95% and 100% of
    ``length`` tokens.  Sample ``i`` depends only on (task, length, seed, i), so a larger ``n`` extends a list."""
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}: use one of {', '.join(TASKS)}")
    return [
        _retrieval_sample(tokenizer, task, length, random.Random(f"{task}:{length}:{seed}:{i}"))
        for i in range(n)
    ]


def prompt_ids(tokenizer, sample: dict) -> list[int]:
    """The chat template of the sample's messages with the generation prompt, then its answer prefix.  The
    template writes the special tokens itself, so the tokenizer adds none."""
    text = _prompt_text(tokenizer, sample["messages"], sample["answer_prefix"])
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_ids(tokenizer, sample: dict) -> list[int]:
    """The answer's tokens as they follow the prompt: its leading space and digits tokenize alone as after the
    prefix, so ``prompt_ids + answer_ids`` is the tokenization of the prompt text followed by the answer."""
    return tokenizer(sample["answer"], add_special_tokens=False)["input_ids"]


# Standard-library modules with documentation of their own, portable (no platform-specific modules), in a fixed
# order: documents() takes the first ones that fit its bounds.
STDLIB_MODULES = (
    "json", "csv", "argparse", "pathlib", "itertools", "functools", "collections", "re", "datetime", "textwrap",
    "string", "heapq", "bisect", "statistics", "fractions", "decimal", "random", "shlex", "difflib", "enum",
    "dataclasses", "contextlib", "logging", "sqlite3", "zipfile", "tarfile", "gzip", "base64", "hashlib",
    "hmac", "secrets", "uuid", "urllib.parse", "html", "unittest", "doctest", "timeit", "calendar", "fnmatch",
    "glob", "shutil", "tempfile", "io", "struct", "queue", "threading", "subprocess", "operator", "copy",
    "pprint", "reprlib", "weakref", "types", "typing", "abc", "numbers", "math", "colorsys", "configparser",
    "plistlib", "ipaddress", "mimetypes", "getopt", "optparse", "graphlib", "zoneinfo", "tomllib", "codecs",
    "pickle", "sched", "selectors", "socketserver", "http.cookies", "email.message", "xml.dom.minidom",
    "concurrent.futures", "asyncio.queues", "ast", "tokenize", "traceback", "warnings", "atexit",
)  # fmt: skip
# defaults shown as they are in a signature; others (objects, lists of live handlers...) have reprs that change
# from run to run ("<object object at 0x7f...>") and are shown as "..."
_LITERALS = (type(None), bool, int, float, str, bytes)
INSTRUCTIONS = (
    "Summarize the documentation above in three sentences.",
    "List the main functions and classes documented above, and say in one line what each does.",
    "Explain how to use the {source} module in a short example.",
    "What are the pitfalls or common mistakes to avoid when using the {source} module?",
    "Which problem does the {source} module solve, and when would you rather not use it?",
)


def _public_members(module) -> list[tuple[str, object]]:
    """The module's ``__all__`` if it has one, else its public names defined in it, as classes and functions."""
    names = getattr(module, "__all__", None) or sorted(
        name
        for name, member in vars(module).items()
        if getattr(member, "__module__", None) == module.__name__
    )
    members = [(name, getattr(module, name, None)) for name in names if not name.startswith("_")]
    return [(n, m) for n, m in members if inspect.isclass(m) or inspect.isroutine(m)]


class _Elided:
    def __repr__(self) -> str:
        return "..."


def _signature(member) -> str:
    try:
        signature = inspect.signature(member)
    except (TypeError, ValueError):  # builtins without a text signature
        return ""
    parameters = [
        p if isinstance(p.default, _LITERALS) or p.default is p.empty else p.replace(default=_Elided())
        for p in signature.parameters.values()
    ]
    return str(signature.replace(parameters=parameters))


def _methods(cls: type) -> list[tuple[str, object]]:
    """The public methods a class defines itself, in definition order."""
    return [(name, m) for name, m in vars(cls).items() if not name.startswith("_") and inspect.isroutine(m)]


def _member_texts(qualname: str, member, kind: str) -> list[str]:
    """A class, function or method's heading and docstring, then, for a class, its own methods' (an
    undocumented one gives none)."""
    doc = inspect.getdoc(member)
    if not doc:
        return []
    texts = [f"{kind} {qualname}{_signature(member)}\n{doc}"]
    for name, method in _methods(member) if kind == "class" else []:
        texts += _member_texts(f"{qualname}.{name}", method, "method")
    return texts


def _module_text(name: str) -> str:
    """The documentation of a standard-library module: its docstring, then each public class (with its methods)
    and function's."""
    module = importlib.import_module(name)
    parts = [f"Module {name}", inspect.getdoc(module) or ""]
    for member_name, member in _public_members(module):
        kind = "class" if inspect.isclass(member) else "function"
        parts += _member_texts(f"{name}.{member_name}", member, kind)
    return "\n\n".join(parts)


@functools.cache
def stdlib_texts() -> MappingProxyType[str, str]:
    """The documentation of each of ``STDLIB_MODULES`` (read only), as a fresh interpreter without site-packages
    reads it (``python -I -S`` runs this file): in this process, packages have patched the standard library
    (torch replaces ``inspect.getfile``, transformers adds methods to ``logging.Logger``, pytest replaces
    ``threading.excepthook``), differently depending on what was imported."""
    child = subprocess.run(
        [sys.executable, "-I", "-S", __file__, *STDLIB_MODULES], capture_output=True, text=True, check=True
    )
    return MappingProxyType(json.loads(child.stdout))


def _cut(tokenizer, text: str, max_tokens: int) -> str:
    """``text`` cut on a line end to at most ``max_tokens`` tokens (the cut may leave the last kept line's
    tokens merged differently with the next, hence the check)."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(encoding["input_ids"]) <= max_tokens:
        return text
    end = text.rfind("\n", 0, encoding["offset_mapping"][max_tokens][0])
    while end > 0 and _count(tokenizer, text[:end].rstrip()) > max_tokens:
        end = text.rfind("\n", 0, end)
    return text[: max(end, 0)].rstrip()


def documents(tokenizer, n: int, min_tokens: int, max_tokens: int) -> list[dict]:
    """The first ``n`` documents of ``STDLIB_MODULES`` with ``min_tokens`` to ``max_tokens`` tokens once cut on
    whole lines to ``max_tokens``: ``{"source": module name, "text", "tokens"}``."""
    found = []
    for source in STDLIB_MODULES:
        text = _cut(tokenizer, stdlib_texts()[source], max_tokens)
        tokens = _count(tokenizer, text)
        if tokens >= min_tokens:
            found.append({"source": source, "text": text, "tokens": tokens})
        if len(found) == n:
            return found
    raise ValueError(
        f"only {len(found)} standard-library documents have {min_tokens} to {max_tokens} tokens, {n} asked: "
        "lower min_tokens or n"
    )


def document_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """``documents`` as chat prompts: each document followed by an instruction drawn from ``INSTRUCTIONS``."""
    rng = random.Random(seed)
    prompts = []
    for document in documents(tokenizer, n, min_tokens, max_tokens):
        instruction = rng.choice(INSTRUCTIONS).format(source=document["source"])
        content = f"{document['text']}\n\n{instruction}"
        prompts.append({"messages": [{"role": "user", "content": content}], "source": document["source"]})
    return prompts


def main(argv: list[str] | None = None) -> int:
    """The fresh interpreter of ``stdlib_texts()``: the documentation of the modules named, as JSON."""
    json.dump({name: _module_text(name) for name in (sys.argv[1:] if argv is None else argv)}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
