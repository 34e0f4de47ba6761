#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root and install Tandem with every extra.
# torch is installed first from the pinned CPU wheel so that no dependency pulls a CUDA build.
# Re-running is cheap: a stamp keyed on pyproject.toml skips the install when nothing changed.
#
# The installer is uv (installed into the venv from PyPI by pip, then `uv pip install`): it downloads and
# unpacks in parallel, so a fresh .venv takes about a fifth of pip's time (README.md gives the figures).
# uv does not read pip's configuration, so pip's find-links and constraint files (`pip config list`: where this
# machine keeps the CPU wheel of torch) are passed on. TANDEM_INSTALLER=pip installs with pip alone, as before;
# the bootstrap falls back to pip by itself when uv cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=${TANDEM_TORCH_VERSION:-2.13.0}
INSTALLER=${TANDEM_INSTALLER:-uv}
EXTRAS="train,serve,ray,dev"

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

# pip's own settings that say where packages come from, as uv flags (each value may list several, space-separated).
pip_settings_as_uv_flags() {
  local key flag value item
  for pair in "find-links:--find-links" "constraint:--constraint"; do
    key=${pair%%:*}
    flag=${pair#*:}
    value=$("$VENV/bin/python" -m pip config list 2>/dev/null |
      sed -n "s/^[^ ]*\.${key}='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u)
    for item in $value; do
      printf '%s\n%s\n' "$flag" "$item"
    done
  done
}
install() {
  if [ "$INSTALLER" = uv ]; then
    local flags=()
    mapfile -t flags < <(pip_settings_as_uv_flags)
    "$VENV/bin/python" -m uv pip install --quiet --python "$VENV/bin/python" "${flags[@]}" "$@"
  else
    "$VENV/bin/python" -m pip install --quiet "$@"
  fi
}
if [ "$INSTALLER" = uv ] && ! "$VENV/bin/python" -m uv --version >/dev/null 2>&1; then
  if ! "$VENV/bin/python" -m pip install --quiet uv; then
    echo "bootstrap: uv could not be installed; installing with pip"
    INSTALLER=pip
  fi
fi
if [ "$INSTALLER" = pip ]; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "bootstrap: installing torch==$TORCH_VERSION ($INSTALLER)"
  install "torch==$TORCH_VERSION"
fi
echo "bootstrap: installing tandem[$EXTRAS] ($INSTALLER)"
install -e ".[$EXTRAS]"
echo "$want" > "$stamp"
build_kernels
