# Third-party dependencies, none of them committed:
#   mok::cutlass  CUTLASS/CuTe 4.2 headers, from the PyPI wheel nvidia-cutlass==4.2.0.0 (pip install .'s build
#                 requirement, or fetched at configure time), copied into the build tree; or from
#                 MOK_CUTLASS_INCLUDE_DIR / MOK_DEPS_DIR/cutlass/include where no registry is reachable (the
#                 GPU machine: tools/gpu_carry.sh prepares .deps/). The order is below.
#   mok::nccl     NCCL >= 2.28 (header + shared library), from the CUDA toolkit or the system.
#   GTest         the system package (find_package), else a source tree in MOK_DEPS_DIR/googletest or
#                 /usr/src/googletest built in-tree.
set(MOK_DEPS_DIR "${PROJECT_SOURCE_DIR}/.deps" CACHE PATH "Folder of carried dependencies (GPU machine)")
set(MOK_CUTLASS_VERSION "4.2.0.0")

# ---- CUTLASS / CuTe -------------------------------------------------------------------------------
# The headers of the PyPI wheel nvidia-cutlass (its cutlass_library/source/include), first found of:
#   1. MOK_CUTLASS_INCLUDE_DIR, or MOK_DEPS_DIR/cutlass/include (carried to a machine without a registry);
#   2. a copy in this build tree from an earlier configure (_deps/cutlass-<version>/include);
#   3. the nvidia-cutlass package of the Python that configures (pip install . declares it as a build
#      requirement, so pip's isolated build environment has it): copied into the build tree, so the
#      compiled files do not depend on a temporary environment's path;
#   4. python -m pip download nvidia-cutlass==<version> (a plain cmake configure with pip and a registry).
set(MOK_CUTLASS_INCLUDE_DIR "" CACHE PATH "CUTLASS include folder (holds cute/ and cutlass/)")
if(NOT MOK_CUTLASS_INCLUDE_DIR)
  if(EXISTS "${MOK_DEPS_DIR}/cutlass/include/cute")
    set(MOK_CUTLASS_INCLUDE_DIR "${MOK_DEPS_DIR}/cutlass/include")
  else()
    set(_cutlass_root "${CMAKE_BINARY_DIR}/_deps/cutlass-${MOK_CUTLASS_VERSION}")
    if(NOT EXISTS "${_cutlass_root}/include/cute")
      find_package(Python3 REQUIRED COMPONENTS Interpreter)
      # Located without importing it (its __init__ imports cuda-python and friends).
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -c
          "import importlib.metadata as m, importlib.util as u; s = u.find_spec('cutlass_library'); \
print(m.version('nvidia-cutlass') + ';' + s.submodule_search_locations[0])"
        OUTPUT_VARIABLE _cutlass_package OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
      list(LENGTH _cutlass_package _n)
      if(_rc EQUAL 0 AND _n EQUAL 2)
        list(GET _cutlass_package 0 _version)
        list(GET _cutlass_package 1 _package_dir)
        if(_version STREQUAL MOK_CUTLASS_VERSION AND EXISTS "${_package_dir}/source/include/cute/tensor.hpp")
          message(STATUS "CUTLASS ${_version} headers from the Python package at ${_package_dir}")
          file(COPY "${_package_dir}/source/include/" DESTINATION "${_cutlass_root}/include")
        else()
          message(STATUS "Python package nvidia-cutlass ${_version} at ${_package_dir} is not "
                         "${MOK_CUTLASS_VERSION} with headers: not used")
        endif()
      endif()
    endif()
    if(NOT EXISTS "${_cutlass_root}/include/cute")
      message(STATUS "Fetching CUTLASS ${MOK_CUTLASS_VERSION} headers from PyPI (pip download nvidia-cutlass)")
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -m pip download --no-deps --quiet --disable-pip-version-check
                nvidia-cutlass==${MOK_CUTLASS_VERSION} -d "${_cutlass_root}/wheel"
        RESULT_VARIABLE _rc ERROR_VARIABLE _pip_error)
      if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "The CUTLASS ${MOK_CUTLASS_VERSION} headers were not found: ${Python3_EXECUTABLE} has no "
                            "nvidia-cutlass==${MOK_CUTLASS_VERSION} package, and `${Python3_EXECUTABLE} -m pip download "
                            "nvidia-cutlass==${MOK_CUTLASS_VERSION}` failed:\n${_pip_error}\n"
                            "Either install the package into that Python (python3 -m pip install "
                            "nvidia-cutlass==${MOK_CUTLASS_VERSION}), or point MOK_CUTLASS_INCLUDE_DIR at a CUTLASS "
                            "${MOK_CUTLASS_VERSION} include folder (the one holding cute/ and cutlass/), or put one in "
                            "MOK_DEPS_DIR/cutlass/include (tools/gpu_carry.sh does, for a machine without a registry).")
      endif()
      file(GLOB _wheel "${_cutlass_root}/wheel/nvidia_cutlass-*.whl")
      file(ARCHIVE_EXTRACT INPUT "${_wheel}" DESTINATION "${_cutlass_root}/unpacked"
           PATTERNS "cutlass_library/source/include/*")
      file(RENAME "${_cutlass_root}/unpacked/cutlass_library/source/include" "${_cutlass_root}/include")
      file(REMOVE_RECURSE "${_cutlass_root}/unpacked" "${_cutlass_root}/wheel")
    endif()
    set(MOK_CUTLASS_INCLUDE_DIR "${_cutlass_root}/include")
  endif()
endif()
if(NOT EXISTS "${MOK_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
  message(FATAL_ERROR "No CuTe headers in MOK_CUTLASS_INCLUDE_DIR=${MOK_CUTLASS_INCLUDE_DIR}")
endif()
message(STATUS "CUTLASS headers: ${MOK_CUTLASS_INCLUDE_DIR}")
add_library(mok_cutlass INTERFACE)
add_library(mok::cutlass ALIAS mok_cutlass)
target_include_directories(mok_cutlass SYSTEM INTERFACE "${MOK_CUTLASS_INCLUDE_DIR}")

# ---- NCCL -----------------------------------------------------------------------------------------
find_path(MOK_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include /usr/include)
find_library(MOK_NCCL_LIBRARY NAMES nccl libnccl.so.2
             HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib /usr/local/cuda/lib64
                   /usr/lib/x86_64-linux-gnu)
if(NOT MOK_NCCL_INCLUDE_DIR OR NOT MOK_NCCL_LIBRARY)
  message(FATAL_ERROR "NCCL >= 2.28 not found (nccl.h: ${MOK_NCCL_INCLUDE_DIR}, lib: ${MOK_NCCL_LIBRARY})")
endif()
file(STRINGS "${MOK_NCCL_INCLUDE_DIR}/nccl.h" _nccl_version REGEX "#define NCCL_(MAJOR|MINOR) ")
string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*" "\\1" _nccl_major "${_nccl_version}")
string(REGEX REPLACE ".*NCCL_MINOR ([0-9]+).*" "\\1" _nccl_minor "${_nccl_version}")
if(_nccl_major LESS 2 OR (_nccl_major EQUAL 2 AND _nccl_minor LESS 28))
  message(FATAL_ERROR "NCCL ${_nccl_major}.${_nccl_minor} at ${MOK_NCCL_INCLUDE_DIR}: need >= 2.28")
endif()
message(STATUS "NCCL ${_nccl_major}.${_nccl_minor}: ${MOK_NCCL_LIBRARY}")
add_library(mok_nccl INTERFACE)
add_library(mok::nccl ALIAS mok_nccl)
target_include_directories(mok_nccl SYSTEM INTERFACE "${MOK_NCCL_INCLUDE_DIR}")
target_link_libraries(mok_nccl INTERFACE "${MOK_NCCL_LIBRARY}")

# ---- GoogleTest -----------------------------------------------------------------------------------
if(MOK_BUILD_TESTS)
  find_package(GTest CONFIG QUIET)
  if(NOT GTest_FOUND)
    foreach(_src "${MOK_DEPS_DIR}/googletest" "/usr/src/googletest")
      if(EXISTS "${_src}/CMakeLists.txt")
        message(STATUS "GoogleTest from source: ${_src}")
        set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
        set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
        add_subdirectory("${_src}" "${CMAKE_BINARY_DIR}/_deps/googletest" EXCLUDE_FROM_ALL SYSTEM)
        add_library(GTest::gtest ALIAS gtest)
        add_library(GTest::gtest_main ALIAS gtest_main)
        set(GTest_FOUND TRUE)
        break()
      endif()
    endforeach()
  endif()
  if(NOT GTest_FOUND)
    message(FATAL_ERROR "GoogleTest not found: apt-get install libgtest-dev, or put its source in "
                        "${MOK_DEPS_DIR}/googletest")
  endif()
endif()

# ---- cuobjdump + nvdisasm (for tools/check_sass.py) -----------------------------------------------
# Not every CUDA install ships them (this project's CI image does not): fall back to NVIDIA's PyPI wheels.
# Optional: without them the SASS check reports Skipped.
find_program(MOK_CUOBJDUMP cuobjdump HINTS ${CUDAToolkit_BIN_DIR} /usr/local/cuda/bin)
if(NOT MOK_CUOBJDUMP)
  set(_tools "${CMAKE_BINARY_DIR}/_deps/cuda-tools")
  if(NOT EXISTS "${_tools}/bin/cuobjdump")
    find_package(Python3 REQUIRED COMPONENTS Interpreter)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -m pip download --no-deps --quiet --disable-pip-version-check
              nvidia-cuda-cuobjdump==13.2.* nvidia-cuda-nvdisasm==13.2.* -d "${_tools}/wheel"
      RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET)
    if(_rc EQUAL 0)
      file(GLOB _wheels "${_tools}/wheel/*.whl")
      foreach(_wheel ${_wheels})
        file(ARCHIVE_EXTRACT INPUT "${_wheel}" DESTINATION "${_tools}/unpacked")
      endforeach()
      file(GLOB_RECURSE _bins "${_tools}/unpacked/cuobjdump" "${_tools}/unpacked/nvdisasm")
      file(COPY ${_bins} DESTINATION "${_tools}/bin"
           FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
      file(REMOVE_RECURSE "${_tools}/wheel" "${_tools}/unpacked")
    endif()
  endif()
  if(EXISTS "${_tools}/bin/cuobjdump")
    set(MOK_CUOBJDUMP "${_tools}/bin/cuobjdump" CACHE FILEPATH "cuobjdump" FORCE)
  endif()
endif()
message(STATUS "cuobjdump: ${MOK_CUOBJDUMP}")
