#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root and install Tandem with every extra.
# torch is installed first from the pinned CPU wheel so that no dependency pulls a CUDA build.
# Re-running is cheap: a stamp keyed on pyproject.toml skips the install when nothing changed.
#
# The installer is uv (installed into the venv from PyPI by pip, then `uv pip install`): it downloads and
# unpacks in parallel: a fresh .venv in about 20 s against pip's 130 s on a 2-core VM (README.md gives the run).
# uv does not read pip's configuration, so pip's package sources (indexes, find-links, constraint files, cert: where
# this machine keeps the CPU wheel of torch) are passed on by scripts/pip_settings_for_uv.py. TANDEM_INSTALLER=pip
# installs with pip alone, as before; the bootstrap falls back to pip by itself when uv cannot be installed, when
# pip's settings cannot be read, or when a uv install fails.
#
# Bytecode (.pyc): uv installs without it, and where PYTHONDONTWRITEBYTECODE is set (CI here) nothing writes it
# later, so every process would compile each module it imports from source at every start (docs/benchmarks.md §46).
#   --bytecode all (the default; `make test`): write it for the whole venv and Tandem's packages once after an
#     install (about 25 s on 2 cores; files already compiled are skipped). The suite's hundreds of processes import
#     most of what is installed.
#   --bytecode lazy (`make demo`): write none here; the caller runs with bytecode writing on
#     (`PYTHONDONTWRITEBYTECODE=` in the Makefile), so each module is compiled once, at its first import, and only
#     what the run imports is compiled (about a fifth of the files; docs/benchmarks.md §48).
# A later `--bytecode all` completes a lazy venv; a new install redoes it (its stamp names the install).
set -euo pipefail
cd "$(dirname "$0")/.."
BYTECODE=all
while [ $# -gt 0 ]; do
  case "$1" in
    --bytecode) BYTECODE=${2:-}; shift 2 || shift ;;
    --bytecode=*) BYTECODE=${1#--bytecode=}; shift ;;
    *) echo "bootstrap: unknown argument '$1' (usage: bootstrap.sh [--bytecode all|lazy])" >&2; exit 2 ;;
  esac
done
case "$BYTECODE" in
  all | lazy) ;;
  *) echo "bootstrap: --bytecode must be all or lazy, got '$BYTECODE'" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=${TANDEM_TORCH_VERSION:-2.13.0}
INSTALLER=${TANDEM_INSTALLER:-uv}
EXTRAS="train,serve,ray,dev"
case "$INSTALLER" in
  uv | pip) ;;
  *) echo "bootstrap: TANDEM_INSTALLER must be uv or pip, got '$INSTALLER'" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.tandem-installed"
bytecode_stamp="$VENV/.tandem-bytecode"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) torch=$TORCH_VERSION"
build_kernels() {
  # Tandem's CPU kernels (tandem_native/loader.py) are built on first use; building them here keeps that
  # 30-60 s out of the first server start (and out of the tests' start-up bounds). Cached: about 2 s when built.
  "$VENV/bin/python" -m tandem_native
}
compile_bytecode() {
  # quiet=2: a file that does not compile (test data in some packages) is skipped, as an import of it would fail
  "$VENV/bin/python" - <<'PY'
import compileall, sysconfig, time
t0 = time.perf_counter()
for folder in (sysconfig.get_paths()["purelib"], "shared_model", "lt_plugins", "inference_svc", "tandem_native"):
    compileall.compile_dir(folder, quiet=2, workers=0)
print(f"bootstrap: bytecode written in {time.perf_counter() - t0:.0f} s")
PY
}
finish() {
  if [ "$BYTECODE" = all ] && ! { [ -f "$bytecode_stamp" ] && [ "$(cat "$bytecode_stamp")" = "$want" ]; }; then
    compile_bytecode
    echo "$want" > "$bytecode_stamp"
  fi
  build_kernels
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  finish
  exit 0
fi
rm -f "$bytecode_stamp"

install() {
  if [ "$INSTALLER" = uv ]; then
    local settings line flags=() cert=()
    if settings=$("$VENV/bin/python" scripts/pip_settings_for_uv.py); then
      while IFS= read -r line; do
        case "$line" in
          "") ;;
          SSL_CERT_FILE=*) cert=("$line") ;;
          *) flags+=("$line") ;;
        esac
      done <<< "$settings"
      if env "${cert[@]}" "$VENV/bin/python" -m uv pip install --quiet --python "$VENV/bin/python" "${flags[@]}" "$@"; then
        return 0
      fi
      echo "bootstrap: uv pip install failed; installing with pip"
    else
      echo "bootstrap: pip's settings could not be read for uv; installing with pip"
    fi
    INSTALLER=pip
  fi
  "$VENV/bin/python" -m pip install --quiet "$@"
}
uv_works() { "$VENV/bin/python" -m uv --version >/dev/null 2>&1; }
if [ "$INSTALLER" = uv ] && ! uv_works; then
  # a uv module that is there but broken reads as installed to pip: reinstall it, then check again
  if ! "$VENV/bin/python" -m pip install --quiet --force-reinstall uv || ! uv_works; then
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
finish
