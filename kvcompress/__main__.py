"""``python -m kvcompress`` = the ``kvcompress`` console script."""

import sys

from .cli import main

sys.exit(main())
