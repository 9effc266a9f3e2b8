#!/usr/bin/env bash
# Builds the library and runs the main program on the local GPU(s) (README's first command).
#   tools/run_main.sh [mok_bench arguments, e.g. --shape Kimi-K2.7]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
tools/setup.sh
build=${MOK_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$(nproc)" --target mok_bench
"$build/bench/mok_bench" "$@"
