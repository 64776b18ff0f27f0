"""The SuffixDecoding cache: a global tree of previous responses plus one tree per live request.

The global tree holds complete responses (a pre-built artifact and/or outputs finished in this process) and
evicts the oldest past ``max_cached_requests`` (FIFO).  Each request gets its own tree over prompt + output
so far, which is what catches the copying in agentic and self-refinement loops.  A draft is speculated from
both and the one with the higher score (expected accepted tokens) wins, as in the paper.
"""

from __future__ import annotations

import itertools
from array import array
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from .draft import Draft

if TYPE_CHECKING:
    from .tree import SuffixTree

# finished requests' trees kept for reuse: at most this many, of at most this many tokens each (a tree takes
# about 250 bytes per token)
SPARE_TREES, SPARE_TREE_TOKENS = 8, 8192


class SpecConfig(BaseModel):
    """Speculation settings; defaults are the paper's (``export-vllm`` writes those vLLM reads where they differ
    from vLLM's defaults: its tree depth is 24, ours 64)."""

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
    # 10,000 responses x ~300 tokens at the bytes per cached token of bench_suffix.py's streams: ~0.9 GB for our
    # tree (~310 B, allocated tables), ~1.4 GB for the C++ reference in vLLM (~450 B).  100,000 would be ten
    # times that.
    max_cached_requests: int = Field(
        10_000, ge=0, description="FIFO limit on responses in the global tree (live ones included)."
    )
    mode: Literal["path", "tree"] = Field(
        "path", description="Path draft (one chain) or tree draft (best-first)."
    )


class SuffixCache:
    """Global + per-request suffix trees with the speculation rule of SuffixDecoding.

    As in the reference (arctic-inference's ``SuffixDecodingCache``), a live request's response enters the
    global tree token by token, so other requests (and this one) can draft from it at once; the oldest
    responses are evicted past ``max_cached_requests``, counting the live ones.  ``global_tree``: a pre-built
    one (a loaded artifact's).
    """

    def __init__(self, config: SpecConfig | None = None, global_tree: SuffixTree | None = None) -> None:
        from .tree import SuffixTree  # numba: imported with a cache, not with its settings (SpecConfig)

        self.config = config or SpecConfig()
        self.global_tree = global_tree or SuffixTree(self.config.max_depth)
        self._new_request_tree = SuffixTree.for_request
        if self.global_tree.max_depth != self.config.max_depth:
            raise ValueError(
                f"global tree depth {self.global_tree.max_depth} != max_depth {self.config.max_depth}; "
                "to resolve, use the depth the cache was built with"
            )
        self._fifo: deque[int] = deque(sorted(self.global_tree.seqs))
        self._ids = itertools.count(max(self.global_tree.seqs, default=-1) + 1)
        self._requests: dict[int, tuple[SuffixTree, int | None]] = {}
        self._live: dict[int, int] = {}  # global sequence id -> live request id
        self._spare: list[SuffixTree] = []  # finished requests' trees, to reuse

    # ---- global tree ----------------------------------------------------------------------------------

    def _new_response(self) -> int | None:
        """A fresh global sequence id (evicting the oldest responses past the limit); None when caching is off."""
        if self.config.max_cached_requests == 0:
            return None
        while len(self._fifo) >= self.config.max_cached_requests:
            old = self._fifo.popleft()
            if old in self.global_tree.seqs:
                self.global_tree.remove(old)
            if (request_id := self._live.pop(old, None)) is not None:  # a live request's response
                self._requests[request_id] = (self._requests[request_id][0], None)
        seq_id = next(self._ids)
        self._fifo.append(seq_id)
        return seq_id

    def add_response(self, tokens: Sequence[int]) -> int | None:
        """Insert a finished response into the global tree; its id (None when caching is off)."""
        seq_id = self._new_response()
        if seq_id is not None:
            self.global_tree.add(seq_id, tokens)
        return seq_id

    @property
    def num_responses(self) -> int:
        return len(self._fifo)

    # ---- requests -------------------------------------------------------------------------------------

    def start_request(self, request_id: int, prompt: Sequence[int]) -> None:
        """Open a request: its own tree over ``prompt`` (a finished request's, cleared, when one is spare) and a
        slot for its response in the global tree."""
        tree = self._spare.pop() if self._spare else self._new_request_tree(self.config.max_depth)
        tree.restart(prompt)
        seq_id = self._new_response()
        self._requests[request_id] = (tree, seq_id)
        if seq_id is not None:
            self._live[seq_id] = request_id

    def append(self, request_id: int, tokens: Sequence[int]) -> None:
        """Record newly generated tokens of a live request (in its tree and in the global tree)."""
        tree, seq_id = self._requests[request_id]
        new = array("i", tokens)  # converted once for both trees
        tree.extend(0, new)
        if seq_id is not None:
            self.global_tree.extend(seq_id, new)

    def finish_request(self, request_id: int) -> None:
        """Drop the request's tree (kept for reuse if small); its response stays in the global tree."""
        tree, seq_id = self._requests.pop(request_id)
        if len(self._spare) < SPARE_TREES and tree.root_count <= SPARE_TREE_TOKENS:
            self._spare.append(tree)
        if seq_id is not None:
            self._live.pop(seq_id)
            self.global_tree.close(seq_id)

    def speculate(self, request_id: int, context: Sequence[int]) -> Draft:
        """The higher-scoring draft of the request tree and the global tree for ``context``'s tail.

        Match lengths run up to ``max_depth - 1``.  Match positions come from active nodes in O(1) each
        when ``context`` ends with the request's own tokens (the usual case): the request tree's for every
        length, the global tree's (which holds the live response) for lengths within the response so far;
        only longer ones are walked from the root.
        """
        cfg = self.config
        tree, seq_id = self._requests[request_id]
        ctx = array("i", context[-cfg.max_depth :])
        kwargs = dict(
            max_spec=cfg.max_spec,
            factor=cfg.factor,
            offset=cfg.offset,
            min_token_prob=cfg.min_token_prob,
            tree=cfg.mode == "tree",
        )
        local = tree.speculate_open(0, ctx, False, **kwargs)
        glob = self.global_tree.speculate_open(seq_id, ctx, True, **kwargs)
        return local if local.score >= glob.score else glob
