"""``python -m toolkit`` = the ``swiftkv`` front door."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
