#!/usr/bin/env bash
# GPU check of the Triton attention kernels (issue 6), about 6 minutes on one H200 (bounded at 9):
#   1. the kernel test folder compiled on the GPU (the whole sweep plus the `gpu`-marked fp16/bf16 cases), with
#      the heuristic configs (autotune off: fast); the benchmark below then checks the autotuned configs;
#   2. benchmarks/gpu_kernels.py: correctness, prefill vs SDPA-flash, decode vs copy bandwidth, engine end to end.
# Results (JSON + logs) go to $OUT when set (the device tool's output folder), else benchmarks/results/.
# Env: PYTHON (default python3); GPU_CHECK_ARGS (extra benchmark flags, e.g. --quick); BENCH_TIMEOUT (seconds,
#      default 390; the tests get 150, so the pair fits one 10-minute call). The tests launch the kernels with their
#      default heuristic configs; the benchmark autotunes unless GPU_CHECK_ARGS has --no-autotune.
# Each benchmark section is written to the JSON as it finishes, so a timeout still leaves the earlier ones.
# Missing Python packages travel as wheels: see /work/.library/device/README.md (".whl" + carry).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$RESULTS/gpu_env.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
  2>&1 | tee -a "$RESULTS/gpu_env.txt"

status=0
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/inference_svc/kernels \
  2>&1 | tee "$RESULTS/gpu_kernel_tests.log" || status=1

# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
timeout "${BENCH_TIMEOUT:-390}" "$PY" benchmarks/gpu_kernels.py --out "$RESULTS/gpu_kernels.json" ${GPU_CHECK_ARGS:-} \
  2>&1 | tee "$RESULTS/gpu_kernels.log" || status=1
echo "gpu-check: exit $status; results in $RESULTS"
exit $status
