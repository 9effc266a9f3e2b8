#!/usr/bin/env bash
# Installs what is missing (tools/setup.sh), configures (Release, Ninja) and builds.
#   tools/build.sh [cmake --build arguments, e.g. --target mok_bench]
# Build folder: $MOK_BUILD_DIR, default build/.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
tools/setup.sh
build=${MOK_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$(nproc)" "$@"
