"""On-disk suffix caches: a versioned directory holding a pre-built global tree, and the vLLM config export.

Layout (format version 2)::

    suffix_cache.json   format, version, SpecConfig, tokenizer fingerprint, sha256 of tree.npz, sizes
    tree.npz            the compressed tree as flat arrays (nodes in parent-before-child order, siblings
                        in count order, suffix endpoints) and the cached responses' tokens (evicted ones
                        are gone); loading rebuilds the nodes without re-inserting suffixes, so it costs
                        O(nodes), not O(tokens * depth)
    provenance.json     what built it (toolkit.artifacts)

A cache is only valid for the tokenizer it was built with, so the tokenizer's vocabulary is fingerprinted and
checked on load; a tree file whose hash or structure does not check out is refused as corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.artifacts import atomic_output_dir, sha256_file, write_json_atomic, write_provenance

from .cache import SpecConfig, SuffixCache

if TYPE_CHECKING:
    from .tree import SuffixTree

FORMAT = "swiftkv-suffix-cache"
VERSION = 2
META_FILE = "suffix_cache.json"
TREE_FILE = "tree.npz"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id) and the special-token ids."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted((k, v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)),
    }
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def tree_to_arrays(tree: SuffixTree, order: list[int]) -> dict[str, Any]:
    """Flatten a tree; ``order`` lists the sequence ids in FIFO order (every node points into one of them).

    Children are stored in their sibling order (decreasing count, the reference's tie order), and every
    node's suffix endpoints as (node, sequence, end) rows, so a loaded tree drafts and evicts exactly as
    the saved one.
    """
    import numpy as np

    arrays = [np.asarray(tree.seqs[i], dtype=np.int32) for i in order]
    offsets = np.cumsum([0] + [len(a) for a in arrays], dtype=np.int64)
    columns, ep_rows = tree.to_arrays(order)
    return {
        "max_depth": np.int64(tree.max_depth),
        "seq_ids": np.array(order, dtype=np.int64),
        "offsets": offsets,
        "tokens": np.concatenate(arrays) if arrays else np.zeros(0, np.int32),
        **{k: columns[:, i].copy() for i, k in enumerate(("parent", "count", "length", "ref", "end"))},
        **{k: ep_rows[:, i].copy() for i, k in enumerate(("endpoint_node", "endpoint_seq", "endpoint_end"))},
    }


def tree_from_arrays(data: dict[str, Any]) -> SuffixTree:
    """Inverse of :func:`tree_to_arrays`; raises ValueError on any inconsistency (checked vectorized first)."""
    import numpy as np

    from .tree import SuffixTree

    offsets, tokens = data["offsets"], data["tokens"]
    parent, count, length, ref, end = (data[k][1:] for k in ("parent", "count", "length", "ref", "end"))
    ep_node, ep_seq, ep_end = (data[k] for k in ("endpoint_node", "endpoint_seq", "endpoint_end"))
    n_seqs, n_nodes = len(offsets) - 1, len(parent)
    if n_seqs != len(data["seq_ids"]) or len(tokens) != (offsets[-1] if len(offsets) else 0):
        raise ValueError("sequence table does not match the token array")
    ok = (parent >= 0) & (parent <= np.arange(n_nodes)) & (ref >= 0) & (ref < n_seqs) & (count >= 1)
    seq_len = np.diff(offsets)[np.clip(ref, 0, max(n_seqs - 1, 0))] if n_seqs else np.zeros(n_nodes, np.int64)
    ok &= (length >= 1) & (length <= end) & (end <= seq_len)
    if not ok.all():
        raise ValueError(f"node {int(np.argmin(ok)) + 1} is inconsistent")
    if len(ep_node) and not (
        (ep_node >= 0).all() & (ep_node <= n_nodes).all() & (ep_seq >= 0).all() & (ep_seq < n_seqs).all()
    ):
        raise ValueError("endpoint table is inconsistent")
    first = tokens[offsets[ref] + end - length] if n_nodes else np.zeros(0, np.int32)
    columns = np.stack([data[k] for k in ("parent", "count", "length", "ref", "end")], axis=1)
    return SuffixTree.from_arrays(
        int(data["max_depth"]),
        data["seq_ids"].tolist(),
        offsets,
        tokens,
        np.ascontiguousarray(columns, np.int64),
        np.concatenate([[0], first]).astype(np.int64),
        np.stack([ep_node, ep_seq, ep_end], axis=1).astype(np.int64).reshape(-1, 3),
    )


def save_cache(
    cache: SuffixCache, out: str | os.PathLike, tokenizer, force: bool = False, **provenance
) -> Path:
    """Write ``cache``'s global tree and config as a complete-or-absent directory."""
    import numpy as np

    with atomic_output_dir(out, force) as tmp:
        np.savez(tmp / TREE_FILE, **tree_to_arrays(cache.global_tree, list(cache._fifo)))
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "config": cache.config.model_dump(),
            "tokenizer": {
                "fingerprint": tokenizer_fingerprint(tokenizer),
                "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
                "vocab_size": len(tokenizer),
            },
            "num_responses": cache.num_responses,
            "num_tokens": sum(len(s) for s in cache.global_tree.seqs.values()),
            "tree_sha256": sha256_file(tmp / TREE_FILE),
        }
        write_json_atomic(tmp / META_FILE, meta)
        write_provenance(tmp, "eval.serving.suffix build", **provenance)
    return Path(out)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The cache's metadata, checked for format and version."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found; to resolve, build one with `swiftkv suffix build`")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path} is corrupt ({e}); to resolve, rebuild the cache") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{meta_path} has format {meta.get('format')!r} version {meta.get('version')!r}, expected {FORMAT!r} "
            f"version {VERSION}; to resolve, rebuild the cache with this version"
        )
    return meta


def load_cache(path: str | os.PathLike, tokenizer=None, config: SpecConfig | None = None) -> SuffixCache:
    """Load a cache; with ``tokenizer``, refuse one built with another tokenizer.

    ``config`` overrides the stored speculation settings (its ``max_depth`` must equal the stored one).
    """
    import numpy as np

    path = Path(path)
    meta = read_meta(path)
    if tokenizer is not None:
        want, have = meta["tokenizer"]["fingerprint"], tokenizer_fingerprint(tokenizer)
        if want != have:
            raise ValueError(
                f"suffix cache {path} was built with tokenizer {meta['tokenizer']['name_or_path']!r} "
                f"(fingerprint {want[:12]}), but this tokenizer ({getattr(tokenizer, 'name_or_path', '?')!r}) is "
                f"{have[:12]}; to resolve, rebuild the cache for this model (`swiftkv suffix build MODEL`)"
            )
    tree_path = path / TREE_FILE
    if not tree_path.is_file() or sha256_file(tree_path) != meta["tree_sha256"]:
        raise ValueError(
            f"{tree_path} is missing or corrupt (sha256 mismatch); to resolve, rebuild the cache"
        )
    try:
        with np.load(tree_path) as data:
            tree = tree_from_arrays({k: data[k] for k in data.files})
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ValueError(f"{tree_path} is corrupt ({e}); to resolve, rebuild the cache") from e
    return SuffixCache(config or SpecConfig(**meta["config"]), tree)


# What vLLM's ``suffix`` method reads, with vLLM's defaults: vLLM key -> (our SpecConfig field, vLLM default).
# From vllm/config/speculative.py and vllm/v1/spec_decode/suffix_decoding.py (identical in vLLM 0.32 and 0.33);
# num_speculative_tokens, the cap on draft tokens per step, defaults to the tree depth.  vLLM still runs
# arctic-inference's C++ suffix tree (and refuses the method without it).
VLLM_KEYS = {
    "suffix_decoding_max_tree_depth": ("max_depth", 24),
    "suffix_decoding_max_spec_factor": ("factor", 1.0),
    "suffix_decoding_min_token_prob": ("min_token_prob", 0.1),
    "suffix_decoding_max_cached_requests": ("max_cached_requests", 10_000),
}


def vllm_speculative_config(config: SpecConfig) -> dict[str, Any]:
    """vLLM ``speculative_config`` for method "suffix" with the same settings: the keys vLLM reads, each only
    where the setting differs from vLLM's default.

    vLLM has no offset or tree-mode setting and cannot preload a global tree: it starts empty and fills it
    with the responses it serves (:func:`vllm_dropped_settings` names what a cache loses).
    """
    spec: dict[str, Any] = {"method": "suffix"}
    if config.max_spec != config.max_depth:
        spec["num_speculative_tokens"] = config.max_spec
    for key, (attr, default) in VLLM_KEYS.items():
        if getattr(config, attr) != default:
            spec[key] = getattr(config, attr)
    return spec


def vllm_dropped_settings(meta: dict[str, Any]) -> list[str]:
    """What a cache (its ``read_meta``) holds that vLLM's suffix method cannot take: offset, tree mode, the tree."""
    config = SpecConfig(**meta["config"])
    dropped = [f"offset={config.offset}"] if config.offset != SpecConfig().offset else []
    dropped += [f"mode={config.mode}"] if config.mode != "path" else []
    if meta.get("num_responses"):
        dropped.append(
            f"the {meta['num_responses']} pre-built responses (vLLM starts with an empty global tree)"
        )
    return dropped
