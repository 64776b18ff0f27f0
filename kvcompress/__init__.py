"""kvcompress: token-adaptive low-rank + multi-level quantized KV cache (TALE), for any Llama-family model.

``from kvcompress import load_compressed; m, cache = load_compressed(model_dir, factors_dir)``.
Importing the package is cheap: torch/transformers load on first use of an attribute.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_compressed": "api",
    "make_cache": "api",
    "read_policy": "api",
    "enable_tale": "attention",
    "TaleCache": "cache",
    "TaleLayer": "cache",
    "Policy": "policy",
    "Tier": "policy",
    "uniform_policy": "policy",
    "calibrate": "calibrate",
    "load_factors": "factors",
    "identity_factors": "factors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvcompress' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
