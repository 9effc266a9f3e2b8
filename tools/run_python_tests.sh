#!/usr/bin/env bash
# The Python package's tests (called by tools/run_tests.sh, so CI runs them):
#   1. PyTorch, if missing: python3 -m pip install torch (PyPI; ~100 s and 5.4 GB where measured, docs/design.md)
#   2. python3 -m pip install .  (scikit-build-core: the CUDA library and the extension only, in build-python/)
#   3. pytest python/tests: the CPU tests; the GPU tests report their skip reason without a Hopper GPU.
# Without a registry (the GPU machine) step 2 uses --no-build-isolation when scikit-build-core and nanobind
# are installed. MOK_PYTHON_TESTS=0 skips everything (printed). $PYTHON picks the interpreter (python3).
# Exit status: pip's or pytest's; pytest collecting no test (status 5) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
py=${PYTHON:-python3}
if [[ "${MOK_PYTHON_TESTS:-1}" == 0 ]]; then
  echo "Python tests skipped: MOK_PYTHON_TESTS=0"
  exit 0
fi
step() { echo "== python: $* ($SECONDS s so far)"; }
SECONDS=0

if ! "$py" -c "import torch" 2>/dev/null; then
  step "PyTorch missing: $py -m pip install torch"
  start=$SECONDS
  "$py" -m pip install --disable-pip-version-check torch
  echo "PyTorch installed in $((SECONDS - start)) s"
fi
if ! "$py" -c "import pytest" 2>/dev/null; then
  "$py" -m pip install --disable-pip-version-check pytest
fi

args=()
build="${MOK_BUILD_DIR:-build}"
cutlass="$build/_deps/cutlass-${MOK_CUTLASS_VERSION:-4.2.0.0}/include"
if [[ -d .deps/cutlass/include ]]; then
  args+=(-C "cmake.define.MOK_DEPS_DIR=$PWD/.deps")
elif [[ -d "$cutlass/cute" ]]; then
  args+=(-C "cmake.define.MOK_CUTLASS_INCLUDE_DIR=$(realpath "$cutlass")")  # the C++ build's copy: no second download
fi
if "$py" -c "import scikit_build_core, nanobind" 2>/dev/null; then
  args+=(--no-build-isolation)
fi
step "$py -m pip install . ${args[*]}"
start=$SECONDS
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$py" -m pip install --disable-pip-version-check "${args[@]}" .
echo "mok installed in $((SECONDS - start)) s"

step "pytest python/tests"
status=0
# From a folder outside the source tree, so `import mok` is the installed package, not python/mok.
(cd python/tests && "$py" -m pytest -rs -p no:cacheprovider .) || status=$?
if [[ $status == 5 ]]; then
  echo "pytest collected no tests: python/tests is missing or broken" >&2
  status=1
fi
step "done, status $status"
exit $status
