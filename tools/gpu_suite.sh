#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root, in one call (after tools/gpu_carry.sh here):
#   tools/gpu_suite.sh [ctest label regex, default "gpu|multigpu"]
# Environment: MOK_SUITE_TESTS=regex (only these tests), MOK_SUITE_MAIN=0 (skip mok_bench),
#              MOK_SUITE_GEMM_BENCH=0 (skip bench/gemm_bench.py), MOK_SUITE_TIMEOUT=s (per test, 300),
#              MOK_SUITE_LAYER_BENCH=0 (skip tools/run_main.sh, the layer benchmark; MOK_SUITE_LAYER_ARGS
#              are its arguments, MOK_SUITE_LAYER_TIMEOUT its limit in seconds; its layer_bench_ep<EP>.json
#              and .png chart go to the logs' folder), MOK_SUITE_DISPATCH_BENCH=0
#              (skip build-gpu/bench/dispatch_bench, run with two or more GPUs; MOK_SUITE_DISPATCH_ARGS),
#              MOK_SUITE_SOAK=0 (skip build-gpu/bench/mok_soak; MOK_SUITE_SOAK_ARGS are its arguments),
#              MOK_SUITE_PYTEST=0 (skip pip install + pytest: tools/run_python_tests.sh), MOK_SUITE_EXAMPLE=0
#              (skip examples/train_moe.py; MOK_SUITE_EXAMPLE_ARGS are its arguments).
#   compute-sanitizer: MOK_SUITE_SANITIZERS=0 skips all of it. memcheck runs every GPU test binary of the
#              labels (MOK_SANITIZER_TESTS=regex picks binaries, MOK_MEMCHECK_FILTER is their gtest filter)
#              with MOK_TEST_REDUCED=1 (full-size cases skip, big sweeps shrink); racecheck and synccheck
#              run test_moe_fused with MOK_RACECHECK_FILTER (gtest filter, default '*Timeline*').
#              MOK_SANITIZER_TIMEOUT=s per run (240); MOK_SANITIZER_BUDGET=s for all runs together (900):
#              runs that would start later are reported as skipped.
# Configures and builds with the carried .deps/, runs the GPU tests (and CPU ones if asked), the
# compute-sanitizer runs, the soak and the main program, then prints a summary table (one line per test
# binary and per sanitizer run). Logs go to $OUT (the device tool's return folder) when set.
set -u -o pipefail
cd "$(dirname "$0")/.."
labels=${1:-"gpu|multigpu"}
out=${OUT:-/tmp/mok_gpu_suite}
mkdir -p "$out"
# NVLink multicast must stay off on the shared machines (never use NVLS/multimem).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
commit=${MOK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# The device machine's copy can hold a tree other than its HEAD's (round 18: a branch's files under main's HEAD):
# say so rather than print a commit that was not what ran.
if [ -z "${MOK_COMMIT:-}" ] && changed=$(git diff --name-only HEAD -- 2>/dev/null | wc -l) && [ "$changed" -gt 0 ]; then
  commit="$commit with $changed tracked files changed"
fi
status=0
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$out/gpus.txt"

if ! { cmake -S . -B build-gpu -G Ninja -DMOK_DEPS_DIR="$PWD/.deps" >"$out/configure.log" 2>&1 &&
       cmake --build build-gpu -j "$(nproc)" >"$out/build.log" 2>&1; }; then
  tail -n 40 "$out/configure.log" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi

ctest --test-dir build-gpu -V --timeout "${MOK_SUITE_TIMEOUT:-300}" -L "$labels" ${MOK_SUITE_TESTS:+-R "$MOK_SUITE_TESTS"} >"$out/ctest.log" 2>&1 || status=1

# compute-sanitizer. One line per run in the summary: clean / ERRORS / test FAILED / TIMEOUT / skipped.
sanitizer_lines=()
sanitizer_timeout=${MOK_SANITIZER_TIMEOUT:-240}
sanitizer_deadline=$((SECONDS + ${MOK_SANITIZER_BUDGET:-900}))
# sanitize LABEL LOG TOOL-ARGS... BINARY ARGS...: one run at reduced sizes, its verdict into the table.
sanitize() {
  local label=$1 log=$2 rc=0 verdict ok skipped
  shift 2
  if [ "$SECONDS" -ge "$sanitizer_deadline" ]; then
    sanitizer_lines+=("$(printf "%-34s %s" "$label" "skipped (MOK_SANITIZER_BUDGET spent)")")
    return
  fi
  MOK_TEST_REDUCED=1 MOK_TEST_WAIT_TIMEOUT_S=${MOK_TEST_WAIT_TIMEOUT_S:-5} timeout -k 15 "$sanitizer_timeout" compute-sanitizer --error-exitcode 9 "$@" >"$log" 2>&1 || rc=$?
  ok=$(grep -cE '^\[ +OK \] .*\([0-9]+ ms\)' "$log")
  skipped=$(grep -cE '^\[ +SKIPPED \] .*\([0-9]+ ms\)' "$log")
  case $rc in
    0) if [ "$ok" -gt 0 ]; then verdict="clean ($ok passed, $skipped skipped)"; else verdict="skipped ($skipped skipped)"; fi ;;
    9) verdict="ERRORS: $(grep -m1 -E '^========= ERROR SUMMARY|^========= RACECHECK SUMMARY' "$log" | sed 's/^========= //') ($(basename "$log"))"
       status=1 ;;
    124|137) verdict="TIMEOUT after ${sanitizer_timeout} s ($(basename "$log"))"; status=1 ;;
    *) verdict="test FAILED, rc $rc ($(basename "$log"))"; status=1 ;;
  esac
  sanitizer_lines+=("$(printf "%-34s %s" "$label" "$verdict")")
}
if [ "${MOK_SUITE_SANITIZERS:-1}" != 1 ]; then
  sanitizer_lines+=("$(printf "%-34s %s" "compute-sanitizer" "skipped (MOK_SUITE_SANITIZERS=0)")")
elif ! command -v compute-sanitizer >/dev/null; then
  sanitizer_lines+=("$(printf "%-34s %s" "compute-sanitizer" "skipped (not on PATH)")")
else
  for name in $(ctest --test-dir build-gpu -N -L "$labels" -LE cpu ${MOK_SANITIZER_TESTS:+-R "$MOK_SANITIZER_TESTS"} |
                awk '/Test +#[0-9]+:/ {print $3}'); do
    [ -x "build-gpu/tests/$name" ] || continue
    # API errors off: NCCL's communicator setup probes kernels of other architectures
    # (cudaErrorNoKernelImageForDevice inside libnccl); our own CUDA calls are checked by the code.
    sanitize "memcheck $name" "$out/memcheck_$name.log" --tool memcheck --report-api-errors no \
      "build-gpu/tests/$name" --gtest_filter="${MOK_MEMCHECK_FILTER:-*}"
  done
  if [ -x build-gpu/tests/test_moe_fused ] && [[ test_moe_fused =~ ${MOK_SANITIZER_TESTS:-.} ]]; then
    race_filter=${MOK_RACECHECK_FILTER:-*Timeline*}
    sanitize "racecheck test_moe_fused" "$out/racecheck_test_moe_fused.log" --tool racecheck --racecheck-report all \
      build-gpu/tests/test_moe_fused --gtest_filter="$race_filter"
    sanitize "synccheck test_moe_fused" "$out/synccheck_test_moe_fused.log" --tool synccheck \
      build-gpu/tests/test_moe_fused --gtest_filter="$race_filter"
  fi
fi

# The soak: many forward calls with fresh routings (bench/soak.cpp); its last line is the verdict.
soak=skipped
if [ "${MOK_SUITE_SOAK:-1}" = 1 ] && [ -x build-gpu/bench/mok_soak ]; then
  soak_rc=0
  timeout -k 15 300 build-gpu/bench/mok_soak ${MOK_SUITE_SOAK_ARGS:-} >"$out/soak.log" 2>&1 || soak_rc=$?
  soak=$(grep -E '^mok_soak: (PASS|FAIL|SKIPPED)' "$out/soak.log" | tail -n 1 | sed 's/^mok_soak: //')
  [ "$soak_rc" = 124 ] && soak="TIMEOUT after 300 s"
  [ -n "$soak" ] || soak="FAILED, rc $soak_rc (soak.log)"
  [ "$soak_rc" = 0 ] || [ "$soak_rc" = 77 ] || status=1
fi

[ "${MOK_SUITE_MAIN:-1}" = 1 ] && { build-gpu/bench/mok_bench >"$out/bench.log" 2>&1 || status=1; }
if [ "${MOK_SUITE_LAYER_BENCH:-1}" = 1 ]; then
  MOK_BUILD_DIR=build-gpu MOK_RESULTS_DIR="$out" timeout "${MOK_SUITE_LAYER_TIMEOUT:-400}" tools/run_main.sh \
    ${MOK_SUITE_LAYER_ARGS:-} \
    >"$out/layer_bench.log" 2>&1 || status=1
fi
gpus=$(nvidia-smi -L | wc -l)
if [ "${MOK_SUITE_DISPATCH_BENCH:-1}" = 1 ] && [ "$gpus" -ge 2 ]; then
  timeout 300 build-gpu/bench/dispatch_bench ${MOK_SUITE_DISPATCH_ARGS:-} >"$out/dispatch_bench.log" 2>&1 || status=1
fi
if [ "${MOK_SUITE_GEMM_BENCH:-1}" = 1 ]; then
  PYTHONUNBUFFERED=1 python3 bench/gemm_bench.py --lib build-gpu/bench/libmok_bench_capi.so >"$out/gemm_bench.log" 2>&1 || status=1
fi
# The Python package: pip install (no registry here: --no-build-isolation with the carried .deps) and pytest;
# then the training example (README's command; MOK_SUITE_EXAMPLE_ARGS, e.g. "--steps 100").
pytest_line=skipped
if [ "${MOK_SUITE_PYTEST:-1}" = 1 ]; then
  MOK_BUILD_DIR=build-gpu timeout 900 tools/run_python_tests.sh >"$out/pytest.log" 2>&1 || status=1
  pytest_line=$(grep -E "^=+ .*(passed|failed|error).* =+$" "$out/pytest.log" | tail -n 1)
  [ -n "$pytest_line" ] || pytest_line="FAILED before pytest (pytest.log)"
fi
example_line=skipped
if [ "${MOK_SUITE_EXAMPLE:-1}" = 1 ]; then
  example_rc=0
  PYTHONUNBUFFERED=1 timeout 600 python3 examples/train_moe.py --out "$out/train_moe" ${MOK_SUITE_EXAMPLE_ARGS:-} \
    >"$out/train_moe.log" 2>&1 || example_rc=$?
  example_line="exit $example_rc (train_moe.log)"
  [ "$example_rc" = 0 ] || status=1
fi

echo
echo "== test output (tables) =="
grep -hE "^[0-9]+: (shape|Kimi|GLM|Qwen|DeepSeek|gpt-oss|case|overflow report|timeout report|full size|device peers|nccl|fused|comm CTAs|reported|[a-z_]+_kernel )" "$out/ctest.log" | sed 's/^[0-9]*: //'
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
printf "%s\n" ${sanitizer_lines[@]+"${sanitizer_lines[@]}"}
printf "%-34s %s\n" "mok_soak" "$soak"
printf "%-34s %s\n" "pytest" "$pytest_line"
printf "%-34s %s\n" "examples/train_moe.py" "$example_line"
grep -E "tests passed|tests failed" "$out/ctest.log"
echo
[ -f "$out/bench.log" ] && cat "$out/bench.log"
[ -f "$out/gemm_bench.log" ] && { echo; cat "$out/gemm_bench.log"; }
[ -f "$out/dispatch_bench.log" ] && { echo; cat "$out/dispatch_bench.log"; }
[ -f "$out/layer_bench.log" ] && { echo; grep -vE "^(\*|Setting OMP|-- |\[|ninja)" "$out/layer_bench.log"; }
[ -f "$out/train_moe.log" ] && { echo; tail -n 25 "$out/train_moe.log"; }
exit $status
