#!/usr/bin/env bash
# Builds everything and runs the test suite (README's second command; CI runs it too).
#   tools/run_tests.sh [extra ctest arguments, e.g. -L cpu]
# GPU tests report "Skipped" (with the reason) on a machine without a Hopper GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
tools/setup.sh
build=${MOK_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure "$@"
