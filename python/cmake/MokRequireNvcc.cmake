# Included before the top-level project() enables CUDA (pyproject.toml passes it as
# CMAKE_PROJECT_INCLUDE_BEFORE), so `pip install .` without a CUDA toolkit stops with what to install
# instead of CMake's "No CMAKE_CUDA_COMPILER could be found". Finds nvcc in $CUDACXX, $CUDA_HOME/bin,
# $CUDA_PATH/bin, PATH and /usr/local/cuda/bin, and hands it to CMake.
if(DEFINED CMAKE_CUDA_COMPILER AND EXISTS "${CMAKE_CUDA_COMPILER}")
  return()
endif()
if(DEFINED ENV{CUDACXX} AND NOT "$ENV{CUDACXX}" STREQUAL "")
  if(NOT EXISTS "$ENV{CUDACXX}")
    message(FATAL_ERROR "CUDACXX=$ENV{CUDACXX} does not exist: point it at the CUDA 13 toolkit's nvcc "
                        "(e.g. /usr/local/cuda/bin/nvcc) or unset it")
  endif()
  return()  # CMake takes the compiler from CUDACXX itself
endif()
find_program(MOK_NVCC nvcc HINTS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin" PATHS /usr/local/cuda/bin NO_CACHE)
if(NOT MOK_NVCC)
  message(FATAL_ERROR
    "No CUDA toolkit found (no nvcc in $CUDACXX, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH or /usr/local/cuda/bin).\n"
    "The mok Python package compiles its CUDA library from source: install the CUDA 13.0 toolkit (nvcc, "
    "with NCCL >= 2.28; Debian/Ubuntu: the cuda-toolkit-13-0 and libnccl-dev packages from NVIDIA's "
    "repository), then put its bin/ on PATH or set CUDACXX=/path/to/nvcc, and run pip again.")
endif()
set(CMAKE_CUDA_COMPILER "${MOK_NVCC}" CACHE FILEPATH "CUDA compiler (found by python/cmake/MokRequireNvcc.cmake)")
message(STATUS "nvcc: ${MOK_NVCC}")
