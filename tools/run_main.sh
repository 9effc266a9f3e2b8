#!/usr/bin/env bash
# Builds the library and runs the main program on the local GPU(s) (README's first command).
#   tools/run_main.sh [mok_bench arguments, e.g. --shape Kimi-K2.7]
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh --target mok_bench
"${MOK_BUILD_DIR:-build}/bench/mok_bench" "$@"
