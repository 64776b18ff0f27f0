"""SCAR checkpoint hooks: prioritized running checkpoints and partial recovery (see ``running``)."""

from .config import ScarConfig

__all__ = ["ScarConfig"]
