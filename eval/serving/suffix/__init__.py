"""Suffix cache: SuffixDecoding (model-free speculative decoding from suffix trees) for transformers models.

``tree`` is the depth-limited suffix tree (a class over numpy tables; ``kernels`` the numba code that updates and
searches them, ``draft`` what it speculates), ``cache`` the global + per-request trees with the speculation rule,
``decode`` greedy verification on any causal LM, ``artifact`` the on-disk format and vLLM export, ``stages``
the user-facing functions behind ``swiftkv suffix build|generate|export-vllm``.  Importing this package
imports nothing heavy (numba comes with the first tree).
"""
