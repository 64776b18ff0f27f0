"""Gradient communication for data-parallel distillation: Bösen managed communication and AdaRevision.

``CommConfig`` (the ``comm:`` recipe section) is pydantic only; ``register_comm_hook``, ``attach_comm_hook``,
``CommState`` and ``AdaRevision`` import torch when first used.
"""

from __future__ import annotations

from importlib import import_module

from .config import CommConfig

_LAZY = {
    "register_comm_hook": "hooks",
    "CommState": "hooks",
    "attach_comm_hook": "hooks",
    "AdaRevision": "adarevision",
}

__all__ = ["CommConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
