#!/usr/bin/env bash
# Builds everything and runs the test suite (README's second command; CI runs it too).
#   tools/run_tests.sh [extra ctest arguments, e.g. -L cpu]
# GPU tests report "Skipped" (with the reason) on a machine without a Hopper GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
ctest --test-dir "${MOK_BUILD_DIR:-build}" --output-on-failure "$@"
