"""The main job on the embedded default (convert -> distill -> evaluate -> report): ``python -m eval run``.

python scripts/demo.py             # the same as: python -m eval run
python scripts/demo.py --quick
"""

import sys

from eval.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main(["run", *sys.argv[1:]]))
