#!/usr/bin/env bash
# Installs the build tools this project needs where they are missing (Debian; needs root for apt-get).
# The CUDA 13 toolkit (nvcc, NCCL 2.28) is a prerequisite it does not install.
set -euo pipefail
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
[ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || [ -f /usr/src/googletest/CMakeLists.txt ] ||
  [ -f "$(dirname "$0")/../.deps/googletest/CMakeLists.txt" ] || missing+=(libgtest-dev)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  apt-get update -q && apt-get install -y -q "${missing[@]}"
fi
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] ||
  { echo "setup: nvcc not found: install the CUDA 13 toolkit" >&2; exit 1; }
