"""The SuffixDecoding cache: a global tree of previous responses plus one tree per live request.

The global tree holds complete responses (a pre-built artifact and/or outputs finished in this process) and
evicts the oldest past ``max_cached_requests`` (FIFO).  Each request gets its own tree over prompt + output
so far, which is what catches the copying in agentic and self-refinement loops.  A draft is speculated from
both and the one with the higher score (expected accepted tokens) wins, as in the paper.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .tree import Draft, SuffixTree


class SpecConfig(BaseModel):
    """Speculation settings; defaults are the paper's (and what ``export-vllm`` writes)."""

    model_config = ConfigDict(extra="forbid")

    max_depth: int = Field(64, ge=1, description="Suffix tree depth cap (tokens).")
    max_spec: int = Field(32, ge=1, description="Most draft tokens per step.")
    factor: float = Field(
        1.0, ge=0, description="alpha in the draft budget floor(alpha * match_len + offset)."
    )
    offset: float = Field(0.0, description="offset in the draft budget floor(alpha * match_len + offset).")
    min_token_prob: float = Field(
        0.1, ge=0, le=1, description="Stop expanding below this estimated probability."
    )
    max_cached_requests: int = Field(100_000, ge=0, description="FIFO limit on responses in the global tree.")
    mode: Literal["path", "tree"] = Field(
        "path", description="Path draft (one chain) or tree draft (best-first)."
    )


class SuffixCache:
    """Global + per-request suffix trees with the speculation rule of SuffixDecoding."""

    def __init__(self, config: SpecConfig | None = None, global_tree: SuffixTree | None = None) -> None:
        self.config = config or SpecConfig()
        self.global_tree = global_tree or SuffixTree(self.config.max_depth)
        if self.global_tree.max_depth != self.config.max_depth:
            raise ValueError(
                f"global tree depth {self.global_tree.max_depth} != max_depth {self.config.max_depth}; "
                "to resolve, use the depth the cache was built with"
            )
        self._fifo: deque[int] = deque(sorted(self.global_tree.seqs))
        self._ids = itertools.count(max(self.global_tree.seqs, default=-1) + 1)
        self._requests: dict[int, SuffixTree] = {}

    # ---- global tree ----------------------------------------------------------------------------------

    def add_response(self, tokens: Sequence[int]) -> int:
        """Insert a finished response into the global tree (evicting the oldest past the limit); its id."""
        seq_id = next(self._ids)
        if self.config.max_cached_requests == 0:
            return seq_id
        while len(self._fifo) >= self.config.max_cached_requests:
            self.global_tree.remove(self._fifo.popleft())
        self.global_tree.add(seq_id, tokens)
        self._fifo.append(seq_id)
        return seq_id

    @property
    def num_responses(self) -> int:
        return len(self._fifo)

    # ---- requests -------------------------------------------------------------------------------------

    def start_request(self, request_id: int, prompt: Sequence[int]) -> None:
        tree = SuffixTree(self.config.max_depth)
        tree.extend(0, prompt)
        self._requests[request_id] = tree

    def append(self, request_id: int, tokens: Sequence[int]) -> None:
        """Record newly generated tokens of a live request."""
        self._requests[request_id].extend(0, tokens)

    def finish_request(self, request_id: int, response: Sequence[int]) -> None:
        """Drop the request's tree and cache its response globally."""
        del self._requests[request_id]
        self.add_response(response)

    def speculate(self, request_id: int, context: Sequence[int]) -> Draft:
        """The higher-scoring draft of the request tree and the global tree for ``context``'s tail."""
        cfg = self.config
        kwargs = dict(
            max_spec=cfg.max_spec,
            factor=cfg.factor,
            offset=cfg.offset,
            min_token_prob=cfg.min_token_prob,
            tree=cfg.mode == "tree",
        )
        local = self._requests[request_id].speculate(context, **kwargs)
        glob = self.global_tree.speculate(context, **kwargs)
        return glob if glob.score > local.score else local
