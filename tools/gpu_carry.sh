#!/usr/bin/env bash
# Run HERE (a machine with PyPI) before a GPU-machine call: puts the dependencies the GPU machine cannot
# fetch into .deps/ (git-ignored), to travel with the call's `carry: [".deps"]`:
#   .deps/cutlass/include   CUTLASS/CuTe 4.2 headers (from the configured build tree, or PyPI)
#   .deps/googletest        GoogleTest sources (Debian's /usr/src/googletest), used if the machine has none
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
if [ ! -f .deps/cutlass/include/cute/tensor.hpp ]; then
  src=$(ls -d build*/_deps/cutlass-*/include 2>/dev/null | head -n 1 || true)
  if [ -z "$src" ]; then
    tmp=$(mktemp -d)
    python3 -m pip download --no-deps --quiet nvidia-cutlass==4.2.0.0 -d "$tmp"
    (cd "$tmp" && python3 -m zipfile -e nvidia_cutlass-*.whl unpacked)
    src="$tmp/unpacked/cutlass_library/source/include"
  fi
  mkdir -p .deps/cutlass
  cp -r "$src" .deps/cutlass/include
fi
if [ ! -f .deps/googletest/CMakeLists.txt ]; then
  [ -f /usr/src/googletest/CMakeLists.txt ] || apt-get install -y -q googletest >/dev/null
  cp -r /usr/src/googletest .deps/googletest
fi
du -sh .deps
