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

# GPU tests file by file, most fundamental first, each under its own time limit and logged with
# -v straight into $OUT: a stage that is cut still names every test it finished.
FILES=(
  tests/pallas_kernels/test_float32_division.py   # (CPU-only today; cheap sanity on the GPU host)
  tests/jax_qtrain/test_quantize_gpu.py
  tests/jax_qtrain/test_formats_vs_oracle.py
  tests/pallas_kernels/test_quantize.py
  tests/pallas_kernels/test_quantize_dispatch.py
  tests/jax_qtrain/test_dense_gpu.py
  tests/jax_qtrain/test_gemm_kernels.py
  tests/pallas_kernels/test_grouped_matmul_gpu.py
  tests/jax_qtrain/test_grouped_gpu.py
  tests/jax_qtrain/test_quantized_weights_gpu.py
)
per_file=$(( ${TEST_BUDGET:-300} / ${#FILES[@]} + 20 ))
for file in "${FILES[@]}"; do
  name=$(basename "$file" .py)
  marker="-m gpu"; [[ $name == test_float32_division ]] && marker=""
  timeout "$per_file" python3 -m pytest $marker -v -n 4 -p no:cacheprovider -rfE "$file" \
    > "$OUT/gpu_$name.log" 2>&1
  echo "$name: exit $? $(tail -1 "$OUT/gpu_$name.log")" | tee -a "$OUT/gpu_tests_summary.txt"
done

timeout "${BENCH_BUDGET:-250}" python3 - "$OUT/bench" <<'PY' 2>&1 | tee "$OUT/bench.log" | tail -45
import sys
from benchmarks import bench_dense, bench_moe
out = sys.argv[1]
bench_dense.main(out)
bench_moe.main(out, budget_s=120)
PY
