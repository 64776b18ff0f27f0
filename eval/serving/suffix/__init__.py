"""Suffix cache: SuffixDecoding (model-free speculative decoding from suffix trees) for transformers models.

``tree`` is the depth-limited suffix tree, ``cache`` the global + per-request trees with the speculation rule,
``decode`` greedy verification on any causal LM, ``artifact`` the on-disk format and vLLM export, ``stages``
the user-facing functions behind ``swiftkv suffix build|generate|export-vllm``.  Importing this package
imports nothing heavy.
"""
