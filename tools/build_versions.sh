#!/usr/bin/env bash
# Run HERE (the development machine), from the repository root, before a GPU-machine call: builds versions of the
# library from commits, each into a folder that tools/gpu_ab.sh takes as a prebuilt version (NAME=DIR), so the call
# spends no device time building (docs/development.md, "The lent GPU machine"):
#   tools/build_versions.sh NAME=COMMIT[@CUDA_FLAGS] ...
# DIR = ${MOK_PRE_DIR:-scratch/pre}/NAME holds libmok_bench_capi.so, the commit's bench/*.py (each library is driven
# by its own scripts: their C APIs may differ), tests/ with the GPU test binaries named in MOK_PRE_TESTS (targets,
# e.g. "test_moe_fp8 test_expert_gemm"; default none) and COMMIT (the commit's full hash). CUDA_FLAGS are added to
# CMAKE_CUDA_FLAGS (a flagged experiment). Sources come from `git archive COMMIT`, the dependencies from .deps/
# (tools/gpu_carry.sh makes it); sources and build trees go to ${MOK_PRE_WORK:-/tmp/mok_pre}/NAME, kept for the next
# rebuild. Carry the folder with the call (`carry: ["scratch/pre"]`: about 8 MB a library, 1-8 MB a test binary).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
if [ $# -lt 1 ]; then
  echo "usage: tools/build_versions.sh NAME=COMMIT[@CUDA_FLAGS] ... (see the header)" >&2
  exit 2
fi
[ -f .deps/cutlass/include/cute/tensor.hpp ] || bash tools/gpu_carry.sh >/dev/null
pre=${MOK_PRE_DIR:-scratch/pre}
for spec in "$@"; do
  name=${spec%%=*} rest=${spec#*=}
  if [ "$name" = "$spec" ] || ! [[ $name =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "build_versions: expected NAME=COMMIT[@CUDA_FLAGS] with NAME of letters, digits, _ and -, got '$spec'" >&2
    exit 2
  fi
  commit=${rest%%@*} flags=""
  [ "$commit" != "$rest" ] && flags=${rest#*@}
  hash=$(git rev-parse --verify "$commit^{commit}")
  dir="$pre/$name" work="${MOK_PRE_WORK:-/tmp/mok_pre}/$name"
  rm -rf "$dir" "$work/src"
  mkdir -p "$dir/tests" "$work/src"
  git archive "$hash" | tar -x -C "$work/src"
  SECONDS=0
  cmake -S "$work/src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_DEPS_DIR="$root/.deps" \
    -DCMAKE_CUDA_FLAGS="$flags" >"$work/configure.log" 2>&1 || { tail -n 20 "$work/configure.log"; exit 1; }
  # shellcheck disable=SC2086  # the targets are words
  cmake --build "$work/build" --target mok_bench_capi ${MOK_PRE_TESTS:-} >"$work/build.log" 2>&1 ||
    { tail -n 30 "$work/build.log"; exit 1; }
  if grep -q "C751" "$work/build.log"; then
    echo "build_versions: $name: ptxas serialized wgmma (C751 in $work/build.log)" >&2
  fi
  cp "$work/build/bench/libmok_bench_capi.so" "$dir/"
  cp -r "$work/src/bench" "$dir/bench"
  for t in ${MOK_PRE_TESTS:-}; do cp "$work/build/tests/$t" "$dir/tests/"; done
  echo "$hash" >"$dir/COMMIT"
  echo "$name: $hash${flags:+ with $flags}, built in $SECONDS s: $(du -sh "$dir" | cut -f1) in $dir"
done
