"""``python -m distill.cluster``: see ``distill.cluster.cli``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
