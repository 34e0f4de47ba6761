#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root and install Tandem with every extra.
# torch is installed first from the pinned CPU wheel so that no dependency pulls a CUDA build.
# Re-running is cheap: a stamp keyed on pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=${TANDEM_TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.tandem-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) torch=$TORCH_VERSION"
build_kernels() {
  # Tandem's CPU kernels (tandem_native/loader.py) are built on first use; building them here keeps that
  # 30-60 s out of the first server start (and out of the tests' start-up bounds). Cached: about 2 s when built.
  "$VENV/bin/python" -m tandem_native
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  build_kernels
  exit 0
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "bootstrap: installing torch==$TORCH_VERSION"
  "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
fi
echo "bootstrap: installing tandem[train,serve,ray,dev]"
"$VENV/bin/python" -m pip install --quiet -e ".[train,serve,ray,dev]"
echo "$want" > "$stamp"
build_kernels
