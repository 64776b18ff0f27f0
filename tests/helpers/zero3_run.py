"""``accelerate launch ... tests/helpers/zero3_run.py RECIPE [key=value ...]``: a distillation run that first
records, after setup (model loaded, K/V init fitted, engine built), which parameters of the engine's module are
not ZeRO-3 partitions, in ``OUTPUT/partitioning.json``; then trains as ``python -m distill`` does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from distill.recipe import load_recipe
from distill.train import loop, setup


def main(argv: list[str]) -> None:
    run = setup(load_recipe(argv[0], argv[1:]))
    params = list(run.accelerator.unwrap_model(run.objective).named_parameters())
    whole = [
        name
        for name, p in params
        if getattr(p, "ds_status", None) != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0
    ]
    if run.accelerator.is_main_process:
        Path(run.recipe.output_dir, "partitioning.json").write_text(
            json.dumps({"parameters": len(params), "not_partitioned": whole})
        )
    loop(run)


if __name__ == "__main__":
    main(sys.argv[1:])
