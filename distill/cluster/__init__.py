"""Sia-style cluster planner for distillation jobs: plan, launch configs, and a round-based simulator.

``swiftkv cluster plan|launch-configs|simulate|trace``; see ``distill.cluster.cli``.
Modules import only numpy/pydantic at import time; scipy, matplotlib and accelerate load where used.
"""
