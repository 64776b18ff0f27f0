"""``accelerate launch ... tests/distill_multinode_run.py RECIPE [key=value ...]``: ``python -m distill`` with a
fault point the test chooses, for tests/test_distill_multinode.py.

With ``FAULT_AT=<name>`` and ``FAULT_DIR=<folder>`` in the environment, every rank that has written its part of
the checkpoint temp folder ``<name>`` (e.g. ``.step_4.tmp``: inside the checkpoint write, before the folder is
renamed complete) creates ``FAULT_DIR/reached-<rank>`` and waits there until ``FAULT_DIR/release`` exists.  The
test kills what it wants once every rank has reached the point, so no kill depends on timing."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from distill.recipe import load_recipe
from distill.train import loop, setup


def fault_point(accelerator) -> None:
    """Wrap this rank's ``accelerator.save_state`` with the fault point named in the environment."""
    at, folder = os.environ.get("FAULT_AT"), os.environ.get("FAULT_DIR")
    if not at or not folder:
        return
    save_state = accelerator.save_state

    def save_and_wait(output_dir, **kwargs):
        out = save_state(output_dir, **kwargs)
        if Path(output_dir).name == at:
            Path(folder, f"reached-{accelerator.process_index}").touch()
            while not Path(folder, "release").exists():
                time.sleep(0.05)
        return out

    accelerator.save_state = save_and_wait


def main(argv: list[str]) -> None:
    run = setup(load_recipe(argv[0], argv[1:]))
    fault_point(run.accelerator)
    loop(run)


if __name__ == "__main__":
    main(sys.argv[1:])
