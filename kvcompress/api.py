"""User entry points: ``load_compressed`` (model + cache in one call) and ``make_cache`` (a fresh cache).

A ``TaleCache`` holds one conversation's state: pass a new one (``make_cache``) to each ``generate`` call,
exactly as with ``DynamicCache``.  ``load_compressed`` returns the model already switched to TALE attention
and a first cache built from the factors directory and its ``policy.json`` (or the ``policy`` given).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .cache import TaleCache
from .factors import POLICY_FILE, Factors, load_factors
from .policy import Policy


def read_policy(factors_dir: str | os.PathLike) -> Policy:
    """The default policy saved by ``swiftkv kvcompress calibrate``."""
    path = Path(factors_dir) / POLICY_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; to resolve, pass policy=... or re-run `swiftkv kvcompress calibrate`"
        )
    return Policy.model_validate(json.loads(path.read_text()))


def make_cache(
    model: torch.nn.Module, factors: Factors | str | os.PathLike, policy: Policy | None = None
) -> TaleCache:
    """A fresh ``TaleCache`` for ``model`` (which must use ``attn_implementation='tale'``)."""
    if not isinstance(factors, Factors):
        policy = policy or read_policy(factors)
        factors = load_factors(factors)
    if policy is None:
        raise ValueError(
            "no policy given; to resolve, pass policy=Policy(...) or a factors directory with policy.json"
        )
    return TaleCache(factors, policy, model.config, model=model)


def load_compressed(
    model_dir: str | os.PathLike,
    factors_dir: str | os.PathLike,
    policy: Policy | None = None,
    dtype: torch.dtype | str = "auto",
    **model_kwargs,
) -> tuple[torch.nn.Module, TaleCache]:
    """Load ``model_dir`` with TALE attention and a ``TaleCache`` from ``factors_dir``.

    Example::

        m, cache = load_compressed("models/smollm2", "out/kv")
        m.generate(ids, max_new_tokens=64, cache=cache)
    """
    from transformers import AutoModelForCausalLM

    from .attention import enable_tale

    factors = load_factors(factors_dir)
    policy = policy or read_policy(factors_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **model_kwargs)
    enable_tale(model)
    return model, make_cache(model, factors, policy)
