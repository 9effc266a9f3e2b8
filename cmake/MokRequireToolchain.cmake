# Included by the top-level CMakeLists.txt before project() enables CXX and CUDA, so a machine without a
# CUDA toolkit or a supported host compiler stops with what to install instead of CMake's "No
# CMAKE_CUDA_COMPILER could be found" or an nvcc #error deep in the first CUDA file. The same check serves
# `cmake -S .` and `pip install .` (scikit-build-core runs the same configure).
#   nvcc  found in $CUDACXX, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin; handed to CMake.
#   g++   $CXX or g++ on PATH; nvcc 13's host compiler: GCC 11 to 15 (C++20 needs 11, nvcc 13 refuses > 15).

# ---- nvcc ------------------------------------------------------------------------------------------
set(_mok_toolkit_help
    "install the CUDA 13.0 toolkit (nvcc, with NCCL >= 2.28; Debian/Ubuntu: the cuda-toolkit-13-0 and "
    "libnccl-dev packages from NVIDIA's repository), then put its bin/ on PATH or set CUDACXX=/path/to/nvcc")
string(CONCAT _mok_toolkit_help ${_mok_toolkit_help})
if(DEFINED CMAKE_CUDA_COMPILER AND EXISTS "${CMAKE_CUDA_COMPILER}")
  # given (or cached by an earlier configure)
elseif(DEFINED ENV{CUDACXX} AND NOT "$ENV{CUDACXX}" STREQUAL "")
  if(NOT EXISTS "$ENV{CUDACXX}")
    message(FATAL_ERROR "CUDACXX=$ENV{CUDACXX} does not exist: point it at the CUDA 13 toolkit's nvcc "
                        "(e.g. /usr/local/cuda/bin/nvcc) or unset it")
  endif()
  # CMake takes the compiler from CUDACXX itself
else()
  find_program(MOK_NVCC nvcc HINTS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin" PATHS /usr/local/cuda/bin NO_CACHE)
  if(NOT MOK_NVCC)
    message(FATAL_ERROR
      "No CUDA toolkit found (no nvcc in $CUDACXX, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH or /usr/local/cuda/bin).\n"
      "mok compiles its CUDA library from source: ${_mok_toolkit_help}, and run the build (or pip) again.")
  endif()
  set(CMAKE_CUDA_COMPILER "${MOK_NVCC}" CACHE FILEPATH "CUDA compiler (found by cmake/MokRequireToolchain.cmake)")
  message(STATUS "nvcc: ${MOK_NVCC}")
endif()

# ---- g++ (the C++ compiler and nvcc's host compiler) -------------------------------------------------
set(_mok_cxx "")
if(DEFINED CMAKE_CXX_COMPILER AND NOT "${CMAKE_CXX_COMPILER}" STREQUAL "")
  set(_mok_cxx "${CMAKE_CXX_COMPILER}")
elseif(DEFINED ENV{CXX} AND NOT "$ENV{CXX}" STREQUAL "")
  set(_mok_cxx "$ENV{CXX}")
else()
  find_program(_mok_cxx_found g++ NO_CACHE)
  if(_mok_cxx_found)
    set(_mok_cxx "${_mok_cxx_found}")
  endif()
endif()
if(_mok_cxx STREQUAL "")
  message(FATAL_ERROR "No C++ compiler found (no $CXX, no g++ on PATH). mok needs g++ 11 to 15 (C++20, and "
                      "nvcc 13's host compiler): Debian/Ubuntu: apt-get install g++; then run the build (or pip) again.")
endif()
execute_process(COMMAND "${_mok_cxx}" -dumpfullversion OUTPUT_VARIABLE _mok_cxx_version
                OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
execute_process(COMMAND "${_mok_cxx}" --version OUTPUT_VARIABLE _mok_cxx_banner ERROR_QUIET)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "The C++ compiler ${_mok_cxx} does not run (${_rc}): install g++ 11 to 15 "
                      "(Debian/Ubuntu: apt-get install g++) or point CXX at one")
endif()
if(NOT _mok_cxx_banner MATCHES "clang" AND _mok_cxx_banner MATCHES "GCC|g\\+\\+|Free Software Foundation")
  if(_mok_cxx_version VERSION_LESS 11 OR _mok_cxx_version VERSION_GREATER_EQUAL 16)
    message(FATAL_ERROR "${_mok_cxx} is GCC ${_mok_cxx_version}; mok needs g++ 11 to 15 (C++20 needs 11, nvcc 13 "
                        "accepts at most 15): install one (Debian/Ubuntu: apt-get install g++-12) and set "
                        "CXX=/usr/bin/g++-12 (a build folder configured before keeps its compiler: remove it)")
  endif()
endif()
