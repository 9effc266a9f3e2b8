#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root (after tools/gpu_carry.sh here): builds several versions of the
# library side by side and times them interleaved in one call, so that a change is measured against its baseline
# on the same machine (docs/perf_notes.md's rule: a ratio measured side by side in one run).
#   tools/gpu_ab.sh NAME=SOURCE[@CUDA_FLAGS] ...
# SOURCE: a source tree (".", ".baseline" made by `git archive d0b3fa0 | tar -x -C .baseline`, ...) or a tar file of
# one (`git archive BRANCH > scratch/b.tar`, carried as an untracked file); CUDA_FLAGS (optional) are added to
# CMAKE_CUDA_FLAGS, e.g. base=.@-DSOME_EXPERIMENT; or a prebuilt version (a folder with libmok_bench_capi.so, its
# bench/ and tests/: tools/build_versions.sh, run on the development machine; no device time spent building it).
# Each version's own bench/*.py drive its library (their C APIs may differ). Environment:
#   MOK_AB_REPS=2                          rounds of the layer benchmark, each over every version in turn
#   MOK_AB_LAYER_ARGS="--shapes Qwen3-30B-A3B --iters 30"   bench/layer_bench.py's arguments ("" skips it)
#   MOK_AB_GEMM_ARGS=""                    bench/gemm_bench.py's arguments, e.g. "--gemm all" ("" skips it)
#   MOK_AB_FP8_ARGS=""                     bench/fp8_layer_bench.py's arguments, each round over every version, e.g.
#                                          "--backward --breakdown --backward-paths fp8f --shapes Kimi-K2.7 --iters 10"
#                                          ("" skips it; run by this tree's script: its C API rows must exist in each)
#   MOK_BENCH_CLOCKS=1                     the benches print each timed function's SM clock ("SM clock" lines;
#                                          only versions whose bench/*.py have it: from round 16 on)
#   MOK_AB_BITS_SHAPES=""                  bench/bits.py (this tree's): --save with the first version, --check with
#                                          every other one, on these shapes, e.g. "Qwen3-30B-A3B,Kimi-K2.7"
#   MOK_AB_JOBS                            build jobs per version (default: the cores / the number of versions)
#   MOK_AB_TESTS=""                        prebuilt versions' GPU test binaries, run before the benches, each
#                                          BINARY or BINARY:GTEST_FILTER, e.g. "test_moe_fp8:*Megakernel*" (a
#                                          version without the binary in its tests/ skips it)
# Prints the table rows of each run; full logs go to $OUT (the device tool's return folder) when set.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
out=${OUT:-/tmp/mok_ab}
work=/tmp/mok_ab_work
mkdir -p "$out" "$work"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ $# -lt 1 ]; then
  echo "usage: tools/gpu_ab.sh NAME=SOURCE[@CUDA_FLAGS] ... (see the header)" >&2
  exit 2
fi

names=() sources=() flags=() prebuilt=()
for spec in "$@"; do
  name=${spec%%=*} rest=${spec#*=}
  if [ "$name" = "$spec" ] || ! [[ $name =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "gpu_ab: expected NAME=SOURCE[@CUDA_FLAGS] with NAME of letters, digits, _ and -, got '$spec'" >&2
    exit 2
  fi
  source=${rest%%@*} flag=""
  [ "$source" != "$rest" ] && flag=${rest#*@}
  if [ -f "$source/libmok_bench_capi.so" ]; then  # prebuilt (tools/build_versions.sh): its bench/ drives it
    names+=("$name") sources+=("$(cd "$source" && pwd)") flags+=("") prebuilt+=(1)
    continue
  fi
  if [ -f "$source" ]; then  # a tar of a tree
    mkdir -p "$work/src_$name" && tar -xf "$source" -C "$work/src_$name" || exit 1
    source="$work/src_$name"
  fi
  if [ ! -f "$source/CMakeLists.txt" ]; then
    echo "gpu_ab: $name: $source is not a source tree (no CMakeLists.txt)" >&2
    exit 2
  fi
  names+=("$name") sources+=("$(cd "$source" && pwd)") flags+=("$flag") prebuilt+=(0)
done
# Prebuilt libraries and tests were linked on the development machine: the CUDA runtime and NCCL from their folders
# here (only then: a version built here finds them as it was linked).
if [[ " ${prebuilt[*]} " == *" 1 "* ]]; then
  nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null ||
             true)
  LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH
fi

jobs=${MOK_AB_JOBS:-$(( $(nproc) / ${#names[@]} > 0 ? $(nproc) / ${#names[@]} : 1 ))}
SECONDS=0
for i in "${!names[@]}"; do
  [ "${prebuilt[$i]}" = 1 ] && continue
  (cmake -S "${sources[$i]}" -B "$work/build_${names[$i]}" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     -DMOK_DEPS_DIR="$root/.deps" -DMOK_BUILD_TESTS=OFF -DCMAKE_CUDA_FLAGS="${flags[$i]}" \
     >"$out/configure_${names[$i]}.log" 2>&1 &&
   cmake --build "$work/build_${names[$i]}" --target mok_bench_capi -j "$jobs" >"$out/build_${names[$i]}.log" 2>&1) ||
    echo "BUILD FAILED: ${names[$i]} ($out/build_${names[$i]}.log)" &
done
wait
echo "builds: $SECONDS s"
# Version NAME's library: its build's, or the prebuilt folder's.
lib() {
  local i
  for i in "${!names[@]}"; do
    [ "${names[$i]}" = "$1" ] || continue
    if [ "${prebuilt[$i]}" = 1 ]; then echo "${sources[$i]}/libmok_bench_capi.so"; else
      echo "$work/build_$1/bench/libmok_bench_capi.so"; fi
  done
}
status=0
for i in "${!names[@]}"; do
  [ -f "$(lib "${names[$i]}")" ] || { tail -n 30 "$out/build_${names[$i]}.log"; status=1; }
done
[ $status = 0 ] || exit 1

read -r -a test_specs <<<"${MOK_AB_TESTS:-}"  # words, not globbed (filters hold '*')
for k in "${!test_specs[@]}"; do
  spec=${test_specs[$k]} binary=${test_specs[$k]%%:*} filter=()
  [ "$binary" != "$spec" ] && filter=(--gtest_filter="${spec#*:}")
  for i in "${!names[@]}"; do
    exe="${sources[$i]}/tests/$binary"
    [ "${prebuilt[$i]}" = 1 ] && [ -x "$exe" ] || continue
    log="$out/test_${names[$i]}_${binary}_$k.txt"  # a binary may be named twice (two filters)
    rc=0
    timeout -k 10 "${MOK_SUITE_TIMEOUT:-300}" "$exe" "${filter[@]}" >"$log" 2>&1 || rc=$?
    echo "== ${names[$i]} $binary ${filter[*]}: rc $rc, $(grep -cE '^\[ +OK \] .*\(' "$log") passed," \
         "$(grep -cE '^\[ +SKIPPED \] .*\(' "$log") skipped, $(grep -cE '^\[ +FAILED \] .*\(' "$log") failed"
    grep -E '^\[ +FAILED \] .*\(' "$log" | head -n 5
    [ "$rc" = 0 ] || status=1
  done
done

layer_args=${MOK_AB_LAYER_ARGS-"--shapes Qwen3-30B-A3B --iters 30"}
if [ -n "$layer_args" ]; then
  for rep in $(seq "${MOK_AB_REPS:-2}"); do
    for i in "${!names[@]}"; do
      log="$out/layer_${names[$i]}_$rep.txt"
      # shellcheck disable=SC2086  # the arguments are words
      timeout 300 python3 "${sources[$i]}/bench/layer_bench.py" --lib "$(lib "${names[$i]}")" $layer_args >"$log" 2>&1 ||
        echo "layer_bench FAILED: ${names[$i]} round $rep ($log)"
      echo "== ${names[$i]}, round $rep"
      grep -E "^(fwd|f\+b) " "$log" | grep -v " shape " | sort -u
      grep -E "^ +(fused|unfused) (forward|backward) +[a-z_]+_kernel|SM clock" "$log"
    done
  done
fi
if [ -n "${MOK_AB_FP8_ARGS:-}" ]; then
  for rep in $(seq "${MOK_AB_REPS:-2}"); do
    for i in "${!names[@]}"; do
      log="$out/fp8_${names[$i]}_$rep.txt"
      # shellcheck disable=SC2086  # the arguments are words
      timeout 300 python3 bench/fp8_layer_bench.py --lib "$(lib "${names[$i]}")" $MOK_AB_FP8_ARGS >"$log" 2>&1 ||
        echo "fp8_layer_bench FAILED: ${names[$i]} round $rep ($log)"
      echo "== ${names[$i]}, fp8_layer_bench round $rep"
      grep -E "^[A-Z][A-Za-z0-9.-]+ +[0-9]+ |^  [A-Z].* ms per call" "$log" | cut -c1-160
    done
  done
fi
if [ -n "${MOK_AB_GEMM_ARGS:-}" ]; then
  for i in "${!names[@]}"; do
    log="$out/gemm_${names[$i]}.txt"
    # shellcheck disable=SC2086
    timeout 300 python3 "${sources[$i]}/bench/gemm_bench.py" --lib "$(lib "${names[$i]}")" $MOK_AB_GEMM_ARGS >"$log" 2>&1 ||
      echo "gemm_bench FAILED: ${names[$i]} ($log)"
    echo "== ${names[$i]}, gemm_bench"
    grep -vE "^\s*#" "$log" | tail -n 30
  done
fi
if [ -n "${MOK_AB_BITS_SHAPES:-}" ]; then
  saved="$out/bits_${names[0]}.json"
  timeout 300 python3 bench/bits.py --lib "$(lib "${names[0]}")" --save "$saved" --shapes "$MOK_AB_BITS_SHAPES" \
    >"$out/bits_${names[0]}.txt" 2>&1 || { echo "bits --save FAILED: ${names[0]}"; status=1; }
  tail -n 5 "$out/bits_${names[0]}.txt"
  for i in "${!names[@]}"; do
    [ "$i" = 0 ] && continue
    timeout 300 python3 bench/bits.py --lib "$(lib "${names[$i]}")" --check "$saved" >"$out/bits_${names[$i]}.txt" 2>&1 ||
      status=1
    echo "== ${names[$i]} against ${names[0]}'s bits"
    tail -n 12 "$out/bits_${names[$i]}.txt"
  done
fi
echo "gpu_ab: done in $SECONDS s, status $status"
exit $status
