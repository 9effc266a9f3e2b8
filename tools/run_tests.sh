#!/usr/bin/env bash
# Builds everything and runs the test suite (README's second command; CI runs it too): the C++ tests
# through CTest, then the Python package's (tools/run_python_tests.sh: pip install ., pytest).
#   tools/run_tests.sh [extra ctest arguments, e.g. -L cpu]
# GPU tests report "Skipped" (with the reason, printed below the summary) on a machine without a Hopper GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
build="${MOK_BUILD_DIR:-build}"
status=0
ctest --test-dir "$build" --output-on-failure "$@" || status=$?
log="$build/Testing/Temporary/LastTest.log"
if grep -q "Skipped$" "$log" 2>/dev/null; then
  echo "Why tests were skipped:"
  grep -h -A1 "Skipped$" "$log" | grep -vE "Skipped$|^--$" | sort | uniq -c
fi
tools/run_python_tests.sh || status=$?
exit $status
