"""What the tests of several rooms share, imported by name (``from helpers.models import tiny_base``; pytest puts
``tests/`` on ``sys.path``, ``pythonpath`` in pyproject.toml).  ``tests/conftest.py`` holds only fixtures and
hooks.  Nothing here imports pytest at module level, so scripts may use these modules too.

- ``ci``: the CI=true rules (which skips CI allows, where the vLLM venv lives) that conftest enforces
- ``models``: tiny random base models, in-memory SwiftKV students, batches and the teacher-student KL
- ``chat``: a tiny chat checkpoint laid out as a Hub download, byte- (``toolkit.tokenizer``) and word-level
  tokenizers, conversations
- ``hub``: a local Hugging Face cache written with huggingface_hub's own functions (offline Hub ids)
- ``reference``: the independent SwiftKV student written from the formulas
- ``students``: the students the equivalence tests compare with it (every family, group size and attention
  backend, with a CPU stand-in for FlashAttention-2's mask format), their batches and caches
- ``tale``: a tiny model with TALE (kvcompress) attention, its factors and a lossy policy
- ``suffix``: suffix trees as tries, brute-force counts, a filled suffix cache
- ``ranking``: synthetic ShareGPT prompts whose words decide the reply length, a trained ranker
- ``ranking_proxy``: a fake vLLM behind the ranking proxy (records, holds, aborts, FCFS refusals), raw-socket clients
- ``faults``: launches that the test kills at a named point (also the wrapper the ranks run under)
- ``distill_runs``: recipes, runs and resumes of real distillations of the tiny chat model
- ``zero3_run``: a distillation run that records ZeRO-3 partitioning (an ``accelerate launch`` target)
- ``vllm_cases``: the vLLM plugin tests' case runner (``python -m tests.helpers.vllm_cases`` in the vLLM venv)
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
