#!/usr/bin/env bash
# One H200 session: every `gpu` test, then the dense and MoE layer benchmarks. Output in $OUT.
#   TEST_BUDGET / BENCH_BUDGET (seconds) cap the two stages so the whole run fits one device call.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-h200_out}
mkdir -p "$OUT/bench"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/gpu.txt"

timeout_flag=""
python3 -c "import pytest_timeout" 2>/dev/null && timeout_flag="--timeout 150"
timeout "${TEST_BUDGET:-300}" python3 -m pytest -m gpu -q -n 8 $timeout_flag -p no:cacheprovider \
  -rfE tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -60

timeout "${BENCH_BUDGET:-250}" python3 - "$OUT/bench" <<'PY' 2>&1 | tee "$OUT/bench.log" | tail -45
import sys
from benchmarks import bench_dense, bench_moe
out = sys.argv[1]
bench_dense.main(out)
bench_moe.main(out, budget_s=120)
PY
