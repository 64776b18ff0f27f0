"""Offline lm-eval tasks built from the embedded ShareGPT data.

lm-eval needs task YAMLs whose ``data_files`` are concrete paths, and our data is fetched at run time into the
user cache, so the tasks are written on demand into a folder that both the in-process wrapper and stock
``lm_eval --include_path DIR`` can use:

* ``sharegpt_ppl``: ``loglikelihood_rolling`` over held-out assistant responses (word/byte perplexity, bits
  per byte);
* ``sharegpt_mc``: response selection, a 4-way multiple choice: which of four assistant replies answers this
  user turn (the true one and three replies to other conversations, fixed by a seed).

Documents come from the held-out split of the embedded ShareGPT (``toolkit.assets``: the end of the file); the
recipes, calibration and traces read only its train split, so the two never overlap.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from toolkit.assets import iter_conversations

TASKS = ("sharegpt_ppl", "sharegpt_mc")
_PPL = """task: sharegpt_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - {{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}}
metadata: {{version: 1.0}}
"""
_MC = """task: sharegpt_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "User: {{{{prompt}}}}\\nAssistant:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
"""


def held_out_pairs(n: int, max_chars: int = 600, data: str | Path = "sharegpt") -> list[tuple[str, str]]:
    """(first user turn, first assistant reply) pairs from the held-out split (of ``data``: a file of the
    user's own is used whole)."""
    pairs = []
    for messages in iter_conversations(data, split="heldout"):
        if len(messages) < 2 or messages[1]["role"] != "assistant":
            continue
        prompt, reply = messages[0]["content"].strip(), messages[1]["content"].strip()
        if 20 <= len(prompt) <= max_chars and 20 <= len(reply):
            pairs.append((prompt, reply[:max_chars]))
        if len(pairs) >= n:
            break
    return pairs


def write_tasks(dst: str | Path, n_docs: int = 100, seed: int = 0, data: str | Path = "sharegpt") -> Path:
    """Write the task YAMLs and their JSONL data (from ``data``'s held-out split) into ``dst`` (idempotent)
    and return it."""
    dst = Path(dst).resolve()
    dst.mkdir(parents=True, exist_ok=True)
    pairs = held_out_pairs(n_docs * 2, data=data)
    rng = random.Random(seed)
    ppl = [{"text": reply} for _, reply in pairs[:n_docs]]
    mc = []
    for i, (prompt, reply) in enumerate(pairs[:n_docs]):
        others = [pairs[j][1][:200] for j in rng.sample([j for j in range(len(pairs)) if j != i], 3)]
        choices = [" " + c for c in [reply[:200], *others]]
        order = list(range(4))
        rng.shuffle(order)
        mc.append({"prompt": prompt, "choices": [choices[k] for k in order], "label": order.index(0)})
    for name, docs, template in (("sharegpt_ppl", ppl, _PPL), ("sharegpt_mc", mc, _MC)):
        (dst / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (dst / f"{name}.yaml").write_text(template.format(data=dst / f"{name}.jsonl"))
    return dst
