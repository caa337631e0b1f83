#!/usr/bin/env bash
# One H200 device call per stage; everything it measures lands in $OUT (at most 8 files come back).
#   bash benchmarks/h200.sh tests   every `gpu` test in one pytest run (-n $WORKERS), -v log;
#                                   TEST_MARK="gpu and not slow" / "gpu and slow" splits it in two
#                                   calls (since stop 34 the whole suite overruns 530 s; "gpu and
#                                   slow" is one test, every recipe trained, 326-391 s: leave
#                                   TEST_BUDGET at 540, stop 59's 300 cut it), and
#                                   TEST_PART=1/2, 2/2 splits a selection further (tests/conftest.py's
#                                   --part: stop 49's "gpu and not slow" overran 540 s at 87%)
#   bash benchmarks/h200.sh bench   the kernel and layer benchmarks named in $BENCHES (default
#                                   bench_dense bench_quantize bench_grouped_quantize; bench_moe
#                                   does not finish in one call: run it alone with --blocks)
#   bash benchmarks/h200.sh train   the h200 preset's recipe comparison ($RECIPES, default all;
#                                   TRAIN_ARGS=--scan-layers for the scanned blocks)
#   bash benchmarks/h200.sh sharding   (kind nvidia-h200-x2) the multi-GPU sharding tests and
#                                      the two gather strategies timed over NCCL ($SHARDING_TESTS
#                                      picks tests, e.g. "...test_sharding_gpu.py -k moe")
#   bash benchmarks/h200.sh ab      grouped GEMM variants timed in alternation
#                                   (AB_VARIANTS=schedule|epilogue|grouping|defaults|wgrad)
#   bash benchmarks/h200.sh quantize   the quantize kernels' `gpu` tests, their ptxas resources and
#                                      their variants timed in alternation ($AB_KERNELS, default
#                                      nvfp4 nvfp4_sr mxfp8 fp8_block_128x128)
#   bash benchmarks/h200.sh pending    the `gpu` tests of kernel paths awaiting their verification
#                                      ($PENDING_TESTS, a pytest -k expression, in $PENDING_FILES)
#                                      and their timing. Defaults (stops 67-69, none run on a
#                                      GPU yet): the kernels rounding their own bf16 output
#                                      (test_gemm_kernels.py's and test_dense_gpu.py's gpu
#                                      tests) and the wgrad kernel's group_scale, then
#                                      $PENDING_SCRIPTS (benchmarks/<name>.py OUT, each under
#                                      what is left of $PENDING_DEADLINE_S; default
#                                      grouped_output_ab then dense_output_ab); then
#                                      whatever PENDING_PEERS / PENDING_RESOURCES / PENDING_AB /
#                                      PENDING_GROUPED_AB (stop 64 ran the last sets: none by
#                                      default) / PENDING_BENCH name
#   bash benchmarks/h200.sh peers      our grouped / dense / MXFP8 / block-FP8 GEMMs against
#                                      torch, jax's Mosaic GPU kernels and XLA in alternation
#                                      (benchmarks/peers_ab.py; PEERS_CASES picks its --cases),
#                                      then Nsight Compute on our G8 bf16 forward and
#                                      torch._grouped_mm's (stop 46's plan; PEERS_NCU=0 skips it)
#   bash benchmarks/h200.sh ncu        Nsight Compute on benchmarks/ncu_cases.py's kernels
#                                      ($NCU_CASES), then kernel_resources' SASS dump
#                                      (the in-register kernels of stops 46-47:
#                                      NCU_CASES="mxfp8_weights nvfp4_weights nvfp4_weights_permute"
#                                      NCU_REGEX=matmul NCU_SKIP=0 SASS_CASES="weights in registers")
#                                      NCU_SOURCE=1 adds the per-instruction SASS counters of each
#                                      case (benchmarks/ncu_source.py; stop 56's wgrad stages:
#                                      NCU_CASES="fp8_block_wgrad_3_stages fp8_block_wgrad_4_stages
#                                      fp8_block_wgrad_4_stages_scales_first" NCU_REGEX=matmul
#                                      NCU_SKIP=0 SASS_CASES=none NCU_SOURCE=1)
#   bash benchmarks/h200.sh split      (kind nvidia-h200-x2) the tests stage on GPU 0 while the
#                                      train stage runs on GPU 1, after ab when SPLIT_AB=1
# TEST_BUDGET / BENCH_BUDGET (seconds) cap each stage so it fits one device call (600 s).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false JQ_EAGER_FAILURES=1
OUT=${OUT:-h200_out}
STAGE=${1:-tests}
mkdir -p "$OUT"
# (ab runs beside train in the split stage: its device line would be the 9th file of $OUT.)
[[ $STAGE == ab ]] || { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} > "$OUT/gpu_$STAGE.txt" 2>&1

# xdist hands tests out in collection order: the kernels' bit-exactness first, so a stage cut at
# its limit still has them (the notebooks need nbformat, which the GPU image lacks; CI runs them).
KERNELS_FIRST="tests/pallas_kernels tests/jax_qtrain/test_quantize_gpu.py
  tests/jax_qtrain/test_formats_vs_oracle.py tests/jax_qtrain/test_gemm_kernels.py tests/jax_qtrain
  tests/train"
if [[ $STAGE == tests ]]; then
  # One pytest process fans the files out over xdist workers (compiles are CPU-bound and the
  # host has 16 cores); -v names every finished test even when the stage is cut at its limit.
  timeout "${TEST_BUDGET:-540}" python3 -m pytest -m "${TEST_MARK:-gpu}" -v -n "${WORKERS:-8}" \
    ${TEST_PART:+--part "$TEST_PART"} -p no:cacheprovider -rfE --durations=25 ${TEST_PATHS:-$KERNELS_FIRST} > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu_tests.log"
  tail -5 "$OUT/gpu_tests.log"
elif [[ $STAGE == bench ]]; then
  # Writes into a scratch folder, then packs it into one archive (the run may be cut by timeout).
  # bench_moe is not in the default: every block compiles its own kernels before any is timed,
  # and the 8-expert configuration alone printed nothing in 500 s on an H100 (2026-12-07); run
  # `python3 -m benchmarks.bench_moe --configs "8 experts" --routings balanced --blocks ...`
  # a few blocks per call instead.
  scratch=$(mktemp -d)
  timeout "${BENCH_BUDGET:-540}" python3 -m benchmarks.run --out "$scratch" \
    --only ${BENCHES:-bench_dense bench_quantize bench_grouped_quantize} 2>&1 | tee "$OUT/bench.log" | tail -40
  cp "$scratch"/*.md "$OUT"/ 2>/dev/null
  # Training checkpoints (hundreds of MB at the h200 preset) stay behind: the archive must come back.
  tar -czf "$OUT/bench_raw.tar.gz" --exclude=checkpoints -C "$scratch" .
elif [[ $STAGE == train ]]; then
  scratch=$(mktemp -d)
  timeout "${BENCH_BUDGET:-540}" python3 -m benchmarks.bench_train --out "$scratch" \
    ${RECIPES:+--recipes $RECIPES} ${TRAIN_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v 'step/s' > "$OUT/bench_train.log"
  tail -20 "$OUT/bench_train.log"
  cp "$scratch"/bench_train.md "$OUT"/ 2>/dev/null
  tar -czf "$OUT/bench_train_runs.tar.gz" --exclude=checkpoints -C "$scratch" .
elif [[ $STAGE == sharding ]]; then
  # Every test uses both GPUs; a few xdist workers share them (the tests are compile-bound).
  timeout "${TEST_BUDGET:-470}" python3 -m pytest -m gpu -v -n "${SHARDING_WORKERS:-0}" \
    -p no:cacheprovider -rfE \
    ${SHARDING_TESTS:-tests/jax_qtrain/test_sharding_gpu.py} > "$OUT/gpu_sharding_tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu_sharding_tests.log"
  tail -5 "$OUT/gpu_sharding_tests.log"
  timeout "${BENCH_BUDGET:-110}" python3 -m benchmarks.sharding_strategies \
    --out "$OUT/sharding_strategies.md" 2>&1 | tee "$OUT/sharding_strategies.log" | tail -12
elif [[ $STAGE == ab ]]; then
  timeout "${AB_BUDGET:-150}" python3 -m benchmarks.grouped_ab --out "$OUT" --variants "${AB_VARIANTS:-schedule}" 2>&1 | tail -30
elif [[ $STAGE == quantize ]]; then
  timeout "${TEST_BUDGET:-200}" python3 -m pytest -m gpu -q -n "${WORKERS:-8}" -p no:cacheprovider \
    -rfE tests/pallas_kernels/test_quantize.py > "$OUT/gpu_quantize_tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu_quantize_tests.log"
  tail -3 "$OUT/gpu_quantize_tests.log"
  scratch=$(mktemp -d)
  timeout 90 python3 benchmarks/kernel_resources.py "$scratch" "row+col" > /dev/null 2>&1
  cp "$scratch/kernel_resources.md" "$OUT/" 2>/dev/null && cat "$OUT/kernel_resources.md"
  for kernel in ${AB_KERNELS:-nvfp4 nvfp4_sr mxfp8 fp8_block_128x128}; do
    timeout "${AB_BUDGET:-100}" python3 benchmarks/quantize_ab.py "$scratch" --kernel "$kernel" 2>&1 | tail -12
  done
  cat "$scratch"/quantize_ab*.md > "$OUT/quantize_ab.md" 2>/dev/null
elif [[ $STAGE == pending ]]; then
  # The gpu tests of kernel paths awaiting their verification, then their timing (the defaults
  # are in the header), then
  # peers_ab's case groups ($PENDING_PEERS), ptxas resources ($PENDING_RESOURCES, e.g.
  # "weights in registers"), quantize_ab's variants if any ($PENDING_AB, e.g. nvfp4_weight), grouped_ab sets
  # ($PENDING_GROUPED_AB: "set" or "set:arg", each under its own timeout, a set skipped when
  # fewer than $GROUPED_AB_MIN_S seconds of $PENDING_DEADLINE_S are left; its rows print as
  # they are timed, so a cut set still reports) and bench_quantize's case groups
  # ($PENDING_BENCH, e.g. extra). Point PENDING_* at the next path.
  timeout "${TEST_BUDGET:-300}" python3 -m pytest -m gpu -v -n "${WORKERS:-12}" -p no:cacheprovider \
    -rfE -k "${PENDING_TESTS:-test_gemm_kernels or test_dense_gpu or group_scale}" \
    ${PENDING_FILES:-tests/jax_qtrain/test_gemm_kernels.py tests/jax_qtrain/test_dense_gpu.py \
    tests/pallas_kernels/test_grouped_matmul_gpu.py} \
    > "$OUT/gpu_pending_tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu_pending_tests.log"
  tail -3 "$OUT/gpu_pending_tests.log"
  # Each script's table prints as it is timed, so a script cut at its limit still reports.
  for script in ${PENDING_SCRIPTS-grouped_output_ab dense_output_ab}; do
    left=$(( ${PENDING_DEADLINE_S:-580} - SECONDS ))
    if (( left < 60 )); then
      echo "$script: skipped, ${left} s left"
      continue
    fi
    mkdir -p "$OUT/ab"
    timeout "$left" python3 "benchmarks/$script.py" "$OUT/ab" 2>&1 \
      | tee "$OUT/ab/$script.log" | tail -20
  done
  # ptxas's resources of the kernels named by $PENDING_RESOURCES (the in-register kernels:
  # do the second step's A registers spill? A refusal writes ptxas_error.txt into the
  # archive).
  if [[ -n ${PENDING_PEERS-} ]]; then
    timeout "${PEERS_BUDGET:-200}" python3 -m benchmarks.peers_ab --out "$OUT" --rounds 15 \
      --cases $PENDING_PEERS 2>&1 | tail -40
  fi
  if [[ -n ${PENDING_RESOURCES-} ]]; then
    res=$(mktemp -d)
    timeout 90 python3 benchmarks/kernel_resources.py "$res" "${PENDING_RESOURCES}" | tail -10
    tar -czf "$OUT/pending_resources.tar.gz" -C "$res" .
  fi
  for kernel in ${PENDING_AB:-}; do
    timeout "${AB_BUDGET:-120}" python3 benchmarks/quantize_ab.py "$OUT/ab" --kernel "$kernel" 2>&1 | tail -12
  done
  for entry in ${PENDING_GROUPED_AB-}; do
    left=$(( ${PENDING_DEADLINE_S:-580} - SECONDS ))
    if (( left < ${GROUPED_AB_MIN_S:-120} )); then
      echo "grouped_ab ${entry%%:*}: skipped, ${left} s left"
      continue
    fi
    budget=$(( left < ${GROUPED_AB_BUDGET:-220} ? left : ${GROUPED_AB_BUDGET:-220} ))
    args=""
    [[ $entry == *:* ]] && args=${entry#*:}
    mkdir -p "$OUT/ab"
    timeout "$budget" python3 -m benchmarks.grouped_ab --out "$OUT/ab" \
      --variants "${entry%%:*}" $args 2>&1 | tee "$OUT/ab/grouped_ab_${entry%%:*}.log" | tail -18
  done
  # bench_quantize's case groups ($PENDING_BENCH; "extra" times the NVFP4 dequantize kernel
  # with and without the float16 decode, CUPTI), when set.
  if [[ -n ${PENDING_BENCH-} ]]; then
    BENCH_BUDGET_S=${BENCH_BUDGET_S:-90} timeout 120 python3 benchmarks/bench_quantize.py \
      "$OUT/bq" --cases="${PENDING_BENCH}" 2>&1 | grep -i "dequantize\|nvfp4" | head -30
  fi
  # One archive for the A/B folders: at most 8 files of $OUT come back from the device.
  for folder in ab bq; do
    [[ -d $OUT/$folder ]] && tar -czf "$OUT/$folder.tar.gz" -C "$OUT" "$folder" && rm -rf "${OUT:?}/$folder"
  done
elif [[ $STAGE == peers ]]; then
  timeout "${PEERS_BUDGET:-300}" python3 -m benchmarks.peers_ab --out "$OUT" \
    --rounds "${PEERS_ROUNDS:-15}" ${PEERS_CASES:+--cases $PEERS_CASES} 2>&1 \
    | tee "$OUT/peers_ab.log" | tail -40
  [[ ${PEERS_NCU:-1} == 0 ]] || NCU_CASES="bf16_grouped torch_bf16_grouped" NCU_REGEX="matmul|device_kernel" NCU_SKIP=0 \
    NCU_COUNT=${NCU_COUNT:-2} SASS_CASES=none NCU_BUDGET=${NCU_BUDGET:-110} bash "$0" ncu
elif [[ $STAGE == ncu ]]; then
  # Nsight Compute on each case of benchmarks/ncu_cases.py ($NCU_CASES), the sections first
  # (always available), then the pipes' instruction shares, then the NVFP4 kernels' PTX,
  # ptxas report and SASS (kernel_resources' dump and log) in one archive ($SASS_CASES=none
  # skips it). $NCU_REGEX picks the kernels (torch's CUTLASS GEMMs are "device_kernel"),
  # $NCU_SKIP / $NCU_COUNT which launches of them.
  NCU=${NCU:-/usr/local/cuda/bin/ncu}
  PIPES=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
  launches="--launch-skip ${NCU_SKIP:-1} --launch-count ${NCU_COUNT:-1}"
  for case in ${NCU_CASES:-nvfp4 nvfp4_sr mxfp8 fp8_block_gemm}; do
    timeout "${NCU_BUDGET:-80}" "$NCU" --kernel-name regex:"${NCU_REGEX:-quantize|matmul}" $launches \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section InstructionStats --section SchedulerStats --section WarpStateStats \
      --section Occupancy python3 -m benchmarks.ncu_cases "$case" > "$OUT/ncu_$case.txt" 2>&1
    timeout "${NCU_BUDGET:-80}" "$NCU" --kernel-name regex:"${NCU_REGEX:-quantize|matmul}" $launches \
      --metrics "${NCU_METRICS:-$PIPES}" python3 -m benchmarks.ncu_cases "$case" \
      >> "$OUT/ncu_$case.txt" 2>&1
    grep -E "Duration|Issue Slots Busy|Executed Ipc A|pipe_|issue_active|inst_executed.sum|Warp Cycles Per Issued|Stall|Registers|Achieved Occ|Compute \(SM\)|Memory Through" "$OUT/ncu_$case.txt" | head -40
    if [[ ${NCU_SOURCE:-0} == 1 ]]; then
      # Per-instruction SASS counters (shared wavefronts, stall samples): benchmarks/ncu_source.py
      # reads them; stop 56 found the wgrad kernel's 4-stage slow spot with it.
      timeout "${NCU_BUDGET:-80}" "$NCU" --kernel-name regex:"${NCU_REGEX:-quantize|matmul}" $launches \
        --section SourceCounters --page source --print-source sass --csv \
        python3 -m benchmarks.ncu_cases "$case" > "$OUT/ncu_source_$case.csv" 2>&1
      python3 -m benchmarks.ncu_source "$OUT/ncu_source_$case.csv" >> "$OUT/ncu_$case.txt" 2>&1
      gzip -f "$OUT/ncu_source_$case.csv"
    fi
  done
  if [[ ${SASS_CASES:-lean} != none ]]; then
    scratch=$(mktemp -d)
    # Mosaic GPU prints the SASS (MOSAIC_GPU_DUMP_SASS) to stdout: kept in the archive's log.
    timeout "${SASS_BUDGET:-120}" python3 benchmarks/kernel_resources.py "$scratch" "${SASS_CASES:-lean}" \
      > "$scratch/kernel_resources.log" 2>&1
    tar -czf "$OUT/sass_dump.tar.gz" -C "$scratch" .
  fi
elif [[ $STAGE == split ]]; then
  CUDA_VISIBLE_DEVICES=0 bash "$0" tests &
  { [[ -z ${SPLIT_AB:-} ]] || CUDA_VISIBLE_DEVICES=1 bash "$0" ab; CUDA_VISIBLE_DEVICES=1 bash "$0" train; }
  wait
else
  echo "unknown stage '$STAGE' (expected tests, bench, train, ab, quantize, pending, peers, ncu, sharding or split)" >&2
  exit 2
fi
