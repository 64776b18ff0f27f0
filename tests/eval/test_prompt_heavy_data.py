"""The prompt-heavy evaluation's prompts (``eval.prompt_heavy_data``) with SmolLM2's tokenizer: RULER-style
retrieval samples that are deterministic, just under their target length, with one findable answer whose tokens
follow the prompt's; standard-library documents within their bounds, the same in any process."""

from __future__ import annotations

import json
import re
import sys

import pytest
from transformers import AutoTokenizer

from eval.prompt_heavy_data import (
    INSTRUCTIONS,
    STDLIB_MODULES,
    TASKS,
    answer_ids,
    document_prompts,
    documents,
    prompt_ids,
    retrieval_samples,
    stdlib_texts,
)

pytestmark = pytest.mark.smollm2
ASSIGNMENT = re.compile(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.")


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


def content(sample: dict) -> str:
    return sample["messages"][0]["content"]


def resolve(text: str, variable: str) -> str:
    """The value of ``variable`` by following the text's assignments, each made once and after what it reads."""
    values: dict[str, str] = {}
    for name, source, number in ASSIGNMENT.findall(text):
        assert name not in values, f"VAR {name} assigned twice"
        values[name] = number or values[source]  # a KeyError: read before it was assigned
    return values[variable]


@pytest.mark.parametrize("task", TASKS)
def test_samples_follow_their_seed(tokenizer, task):
    samples = retrieval_samples(tokenizer, task, 1024, 2, seed=3)
    assert samples == retrieval_samples(tokenizer, task, 1024, 2, seed=3)
    assert samples[:1] == retrieval_samples(tokenizer, task, 1024, 1, seed=3)  # a larger n extends the list
    others = retrieval_samples(tokenizer, task, 1024, 2, seed=4)
    assert all(
        a["messages"] != b["messages"] and a["answer"] != b["answer"]
        for a, b in zip(samples, others, strict=True)
    )
    assert samples[0]["messages"] != samples[1]["messages"]


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("task", TASKS)
def test_prompt_is_just_under_its_length(tokenizer, task, length):
    for sample in retrieval_samples(tokenizer, task, length, 3):
        assert (sample["task"], sample["length"]) == (task, length)
        assert 0.95 * length <= len(prompt_ids(tokenizer, sample)) <= length


@pytest.mark.parametrize("task", TASKS)
def test_answer_tokens_follow_the_prompt(tokenizer, task):
    """The chat prompt (template, generation prompt, answer prefix) followed by the answer tokenizes as
    prompt_ids + answer_ids, and the template's special tokens are not added a second time."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for sample in retrieval_samples(tokenizer, task, 512, 4, seed=1):
        text = tokenizer.apply_chat_template(sample["messages"], add_generation_prompt=True, tokenize=False)
        text += sample["answer_prefix"] + sample["answer"]
        prompt = prompt_ids(tokenizer, sample)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == prompt + answer_ids(
            tokenizer, sample
        )
        assert prompt[0] == start and prompt.count(start) == 3  # system, user, assistant
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n" + sample["answer_prefix"])
        assert sample["answer"].startswith(" ") and sample["answer"][1:].isdigit()


def test_passkey_needle_is_there_once(tokenizer):
    for sample in retrieval_samples(tokenizer, "passkey", 1024, 4):
        key = sample["answer"].strip()
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        assert content(sample).count(needle) == 1
        assert content(sample).count(key) == 2  # both in the needle
        assert content(sample).endswith("What is the pass key?")
        assert sample["answer_prefix"] == "The pass key is"


def test_multikey_answer_is_the_asked_keys_number(tokenizer):
    for sample in retrieval_samples(tokenizer, "multikey", 1024, 4):
        needles = dict(
            re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", content(sample))
        )
        asked = re.search(r"number for ([a-z]+-[a-z]+) mentioned", content(sample)).group(1)
        assert len(needles) == 4 and len(set(needles.values())) == 4
        assert needles[asked] == sample["answer"].strip()
        assert content(sample).count(sample["answer"].strip()) == 1
        assert asked in sample["answer_prefix"]


def test_vartrack_chain_resolves_to_the_answer(tokenizer):
    for sample in retrieval_samples(tokenizer, "vartrack", 1024, 4):
        asked = re.search(r"What is the value of VAR ([A-Z]{5})\?", content(sample)).group(1)
        assignments = ASSIGNMENT.findall(content(sample))
        numbers = [number for _, _, number in assignments if number]
        assert resolve(content(sample), asked) == sample["answer"].strip()
        assert len(numbers) == 3 and len(set(numbers)) == 3  # the asked chain and two distractors
        assert any(name == asked and source for name, source, _ in assignments)  # at least one hop
        assert sample["answer_prefix"] == f"Answer: The value of VAR {asked} is"


def test_bad_task_or_length_says_what_to_do(tokenizer):
    with pytest.raises(
        ValueError, match=r"^unknown retrieval task 'needle': use one of passkey, multikey, vartrack$"
    ):
        retrieval_samples(tokenizer, "needle", 1024, 1)
    for task in TASKS:
        with pytest.raises(
            ValueError, match=rf"^length 200 is too small for task '{task}': .* use length >= \d+$"
        ):
            retrieval_samples(tokenizer, task, 200, 1)


def test_documents_are_stdlib_docs_within_bounds(tokenizer):
    docs = documents(tokenizer, 12, 256, 1024)
    assert [d["source"] for d in docs] == [s for s in STDLIB_MODULES if s in {d["source"] for d in docs}]
    for doc in docs:
        full = stdlib_texts()[doc["source"]]
        assert doc["source"].split(".")[0] in sys.stdlib_module_names
        assert doc["tokens"] == len(tokenizer(doc["text"], add_special_tokens=False)["input_ids"])
        assert 256 <= doc["tokens"] <= 1024
        assert doc["text"] == full or full.startswith(doc["text"] + "\n")  # cut on a line end
        assert doc["text"].startswith(f"Module {doc['source']}\n\n")
        assert not re.search(r"<\|im_(start|end)\|>|^(human|gpt|user|assistant):", doc["text"], re.I | re.M)
    assert any(doc["text"] != stdlib_texts()[doc["source"]] for doc in docs)  # some were cut


def test_documents_ignore_what_this_process_patched(monkeypatch):
    """The texts come from a fresh interpreter (its own random hash seed): nothing that torch, transformers or
    pytest patched into the standard library here, nor any address, reaches them."""

    def dumps(obj) -> str:
        """Patched by the test."""

    monkeypatch.setattr(json, "dumps", dumps)
    stdlib_texts.cache_clear()
    texts = stdlib_texts()
    stdlib_texts.cache_clear()
    assert texts == stdlib_texts() and list(texts) == list(STDLIB_MODULES)
    assert "Patched by the test" not in texts["json"] and "function json.dumps(obj, *," in texts["json"]
    assert not any(re.search(r" at 0x[0-9a-f]+", text) for text in texts.values())


def test_document_prompts_end_with_an_instruction(tokenizer):
    prompts = document_prompts(tokenizer, 10, 256, 1024, seed=0)
    assert prompts == document_prompts(tokenizer, 10, 256, 1024, seed=0)
    assert prompts != document_prompts(tokenizer, 10, 256, 1024, seed=1)
    for prompt, doc in zip(prompts, documents(tokenizer, 10, 256, 1024), strict=True):
        text, instruction = prompt["messages"][0]["content"].rsplit("\n\n", 1)
        assert prompt["source"] == doc["source"] and text == doc["text"]
        assert instruction in {i.format(source=doc["source"]) for i in INSTRUCTIONS}


def test_too_few_documents_says_what_to_do(tokenizer):
    with pytest.raises(
        ValueError, match=r"^only \d+ standard-library documents have 8000 to 9000 tokens, 5 asked"
    ):
        documents(tokenizer, 5, 8000, 9000)
