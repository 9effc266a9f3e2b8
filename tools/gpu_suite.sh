#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root, in one call (after tools/gpu_carry.sh here):
#   tools/gpu_suite.sh [ctest label regex, default "gpu|multigpu"]
# Environment: MOK_SUITE_TESTS=regex (only these tests), MOK_SUITE_MAIN=0 (skip mok_bench),
#              MOK_SUITE_GEMM_BENCH=0 (skip bench/gemm_bench.py), MOK_SUITE_TIMEOUT=s (per test, 300),
#              MOK_SUITE_LAYER_BENCH=0 (skip tools/run_main.sh, the layer benchmark; MOK_SUITE_LAYER_ARGS
#              are its arguments, MOK_SUITE_LAYER_TIMEOUT its limit in seconds), MOK_SUITE_DISPATCH_BENCH=0
#              (skip build-gpu/bench/dispatch_bench, run with two or more GPUs; MOK_SUITE_DISPATCH_ARGS).
# Configures and builds with the carried .deps/, runs the GPU tests (and CPU ones if asked), the
# memory checker on the error-path tests, and the main program, then prints a summary table. Logs go to
# $OUT (the device tool's return folder) when set.
set -u -o pipefail
cd "$(dirname "$0")/.."
labels=${1:-"gpu|multigpu"}
out=${OUT:-/tmp/mok_gpu_suite}
mkdir -p "$out"
# NVLink multicast must stay off on the shared machines (never use NVLS/multimem).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
commit=${MOK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$out/gpus.txt"

if ! { cmake -S . -B build-gpu -G Ninja -DMOK_DEPS_DIR="$PWD/.deps" >"$out/configure.log" 2>&1 &&
       cmake --build build-gpu -j "$(nproc)" >"$out/build.log" 2>&1; }; then
  tail -n 40 "$out/configure.log" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi

ctest --test-dir build-gpu -V --timeout "${MOK_SUITE_TIMEOUT:-300}" -L "$labels" ${MOK_SUITE_TESTS:+-R "$MOK_SUITE_TESTS"} >"$out/ctest.log" 2>&1 || status=1

# Error paths under the memory checker: no out-of-bounds access on overflow or bad ids.
sanitizer=skipped
if command -v compute-sanitizer >/dev/null; then
  if compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/test_schedule_gpu \
       --gtest_filter='*Overflow*:*BadExpert*:*Huge*:*EmptyExperts*' >"$out/memcheck.log" 2>&1 &&
     compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/test_moe_forward \
       --gtest_filter='*BadExpert*:*Provenance*' >>"$out/memcheck.log" 2>&1 &&
     compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/test_moe_fused \
       --gtest_filter='*Timeline*:*Late*' >>"$out/memcheck.log" 2>&1; then
    sanitizer=clean
  else
    sanitizer=ERRORS; status=1
  fi
fi

[ "${MOK_SUITE_MAIN:-1}" = 1 ] && { build-gpu/bench/mok_bench >"$out/bench.log" 2>&1 || status=1; }
if [ "${MOK_SUITE_LAYER_BENCH:-1}" = 1 ]; then
  MOK_BUILD_DIR=build-gpu timeout "${MOK_SUITE_LAYER_TIMEOUT:-400}" tools/run_main.sh ${MOK_SUITE_LAYER_ARGS:-} \
    >"$out/layer_bench.log" 2>&1 || status=1
fi
gpus=$(nvidia-smi -L | wc -l)
if [ "${MOK_SUITE_DISPATCH_BENCH:-1}" = 1 ] && [ "$gpus" -ge 2 ]; then
  timeout 300 build-gpu/bench/dispatch_bench ${MOK_SUITE_DISPATCH_ARGS:-} >"$out/dispatch_bench.log" 2>&1 || status=1
fi
if [ "${MOK_SUITE_GEMM_BENCH:-1}" = 1 ]; then
  PYTHONUNBUFFERED=1 python3 bench/gemm_bench.py --lib build-gpu/bench/libmok_bench_capi.so >"$out/gemm_bench.log" 2>&1 || status=1
fi

echo
echo "== test output (tables) =="
grep -hE "^[0-9]+: (shape|Kimi|GLM|Qwen|DeepSeek|overflow report|timeout report|full size|device peers|nccl|fused|comm CTAs|reported|[a-z_]+_kernel )" "$out/ctest.log" | sed 's/^[0-9]*: //'
echo
echo "== summary, commit $commit =="
printf "%-26s %8s %8s %8s\n" "test binary" "passed" "failed" "skipped"
for n in $(grep -oE "^ *Start +[0-9]+" "$out/ctest.log" | awk '{print $2}'); do
  name=$(grep -oE "Start +$n: \S+" "$out/ctest.log" | awk '{print $3}')
  count() { grep -cE "^$n: \[ *$1 *\] .*\([0-9]+ ms\)" "$out/ctest.log"; }
  if grep -qE "^$n: \[==========\]" "$out/ctest.log"; then
    printf "%-26s %8s %8s %8s\n" "$name" "$(count OK)" "$(count FAILED)" "$(count SKIPPED)"
  else  # not a GoogleTest binary: CTest's own verdict
    printf "%-26s %s\n" "$name" "$(grep -oE "Test +#$n: $name \.+ *\**[A-Za-z]+" "$out/ctest.log" | grep -oE "[A-Za-z]+$")"
  fi
done
printf "%-26s %s\n" "memcheck (error paths)" "$sanitizer"
grep -E "tests passed|tests failed" "$out/ctest.log"
echo
[ -f "$out/bench.log" ] && cat "$out/bench.log"
[ -f "$out/gemm_bench.log" ] && { echo; cat "$out/gemm_bench.log"; }
[ -f "$out/dispatch_bench.log" ] && { echo; cat "$out/dispatch_bench.log"; }
[ -f "$out/layer_bench.log" ] && { echo; grep -vE "^(\*|Setting OMP|-- |\[|ninja)" "$out/layer_bench.log"; }
exit $status
