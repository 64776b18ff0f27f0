#!/usr/bin/env bash
# Set up everything on a fresh machine, idempotently: a venv in .venv, CPU torch, this package with its
# tested dependencies, and the embedded assets (SmolLM2-135M-Instruct, ShareGPT) in the user cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch.compile on CPU (inductor; the tests compile flex_attention and a static-cache decode) builds its kernels
# with the C++ compiler in $CXX (default g++): without one the suite would fail only after half an hour
CXX_BIN=${CXX:-g++}
if ! printf '#include <cmath>\nint main() { return std::isnan(0.0); }\n' | "$CXX_BIN" -x c++ -c -o /dev/null - 2>/dev/null; then
  echo "error: no working C++ compiler '$CXX_BIN' for torch's inductor (to resolve, install one, e.g. sudo apt-get install g++, or set CXX)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# CPU torch first: installed alone it takes the local CPU wheel; otherwise deepspeed pulls a CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
if ! .venv/bin/python -c "import toolkit, swiftkv, lm_eval, deepspeed, numba, tensorboard" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q -c <(echo torch==2.13.0) -e ".[dev,tensorboard]"
  touch .venv/.installed
fi
.venv/bin/swiftkv fetch all >/dev/null
