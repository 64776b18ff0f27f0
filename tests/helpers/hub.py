"""A local Hugging Face cache holding a model, written with huggingface_hub's own cache functions, in the
layout a download leaves (``models--org--name/{blobs, snapshots/COMMIT, refs/main, trees/COMMIT.json}``), so
the toolkit's Hub path runs for real with ``HF_HUB_OFFLINE=1`` and no network."""

from __future__ import annotations

import hashlib
from pathlib import Path

from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
from huggingface_hub.file_download import (
    _cache_commit_hash_for_specific_revision,
    _create_symlink,
    repo_folder_name,
)

HUB_REPO = "acme/tiny-chat"  # the Hub id of conftest's ``hub`` fixture: a tiny chat model (helpers.chat)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_to_cache(cache: Path, repo_id: str, folder: Path, skip: tuple[str, ...] = ()) -> str:
    """Put every file of ``folder`` into ``cache`` as revision ``main`` of model ``repo_id``; return the commit.

    ``skip``: files listed in the commit's tree but left out of the snapshot (an interrupted download)."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    entries = {}
    for path in files:
        rel, data = path.relative_to(folder).as_posix(), path.read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        entries[rel] = TreeCacheEntry(
            size=len(data), blob_id=git_blob_id(data), lfs_sha256=sha256, lfs_size=len(data)
        )
        if rel in skip:
            continue
        blob = storage / "blobs" / sha256
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = storage / "snapshots" / commit / rel
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=True)
    _cache_commit_hash_for_specific_revision(str(storage), "main", commit)
    write_tree_cache(str(storage), commit, entries)
    return commit
