# Shared libraries that other programs load (the ctypes library today, the Python extension later) export
# their own API and nothing else. A Python process has usually loaded the system libstdc++ (PyTorch) before
# it loads ours; every C++ runtime symbol we export then competes with that copy, and with the GPU
# machine's g++ 13 (which links libstdc++ into each binary) formatting a number in an std::ostringstream
# crashed inside our copy (issue 13). So a shared library built here:
#   - exports only the symbols its version script lists as global (`local: *;` hides the rest);
#   - hides every symbol it takes from a static archive (`--exclude-libs,ALL`: libmok.a, libcudart_static.a,
#     libstdc++.a), so no archive leaks through a wildcard of the script;
#   - links the C++ runtime statically and hidden (g++), so it runs on the runtime it was compiled against
#     whatever libstdc++ the loading process brought.
# Every shared library of the project must call mok_export_only; mok_add_export_checks (deferred from
# tests/CMakeLists.txt) refuses to configure one that does not, and adds a CPU test per library that runs
# tools/check_exports.py on the built file.
#
# mok_export_only(<target> <C-symbol glob> | <version-script> ALLOWED <regex>)
#   A glob (`mok_*`) becomes a version script in the build tree exporting the C symbols it matches.
#   A version script (a file, absolute or relative to the calling CMakeLists.txt, GNU ld syntax) needs
#   ALLOWED: a regular expression of the names it exports, for the check.
function(mok_export_only target exports)
  cmake_parse_arguments(PARSE_ARGV 2 ARG "" "ALLOWED" "")
  get_target_property(_type ${target} TYPE)
  if(NOT _type STREQUAL "SHARED_LIBRARY" AND NOT _type STREQUAL "MODULE_LIBRARY")
    message(FATAL_ERROR "mok_export_only(${target}): not a shared library (${_type})")
  endif()
  if(exports MATCHES "^[A-Za-z0-9_*?]+$")
    set(_script "${CMAKE_CURRENT_BINARY_DIR}/${target}.exports.map")
    file(CONFIGURE OUTPUT "${_script}" CONTENT "{\n  global: ${exports};\n  local: *;\n};\n")
    string(REPLACE "*" ".*" _allowed "${exports}")
    string(REPLACE "?" "." _allowed "${_allowed}")
  else()
    cmake_path(ABSOLUTE_PATH exports BASE_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}" OUTPUT_VARIABLE _script)
    if(NOT EXISTS "${_script}" OR NOT ARG_ALLOWED)
      message(FATAL_ERROR "mok_export_only(${target}): '${exports}' is neither a C-symbol glob nor a "
                          "version script given with ALLOWED <regex>")
    endif()
    set(_allowed "${ARG_ALLOWED}")
  endif()
  target_link_options(${target} PRIVATE "LINKER:--version-script=${_script}" "LINKER:--exclude-libs,ALL")
  set_property(TARGET ${target} APPEND PROPERTY LINK_DEPENDS "${_script}")
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_link_options(${target} PRIVATE -static-libstdc++ -static-libgcc)
    set_target_properties(${target} PROPERTIES MOK_FORBID_NEEDED "libstdc\\+\\+|libgcc_s")
  endif()
  set_target_properties(${target} PROPERTIES VISIBILITY_INLINES_HIDDEN ON MOK_EXPORTS "${_allowed}")
endfunction()

# The shared and module libraries defined in `dir` and the folders below it, skipping third-party trees.
function(_mok_shared_libraries dir out)
  set(_found "")
  get_property(_targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(_t IN LISTS _targets)
    get_target_property(_type ${_t} TYPE)
    if(_type STREQUAL "SHARED_LIBRARY" OR _type STREQUAL "MODULE_LIBRARY")
      list(APPEND _found ${_t})
    endif()
  endforeach()
  get_property(_subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(_sub IN LISTS _subdirs)
    cmake_path(IS_PREFIX PROJECT_SOURCE_DIR "${_sub}" NORMALIZE _ours)
    cmake_path(IS_PREFIX MOK_DEPS_DIR "${_sub}" NORMALIZE _third_party)
    if(_ours AND NOT _third_party)
      _mok_shared_libraries("${_sub}" _below)
      list(APPEND _found ${_below})
    endif()
  endforeach()
  set(${out} ${_found} PARENT_SCOPE)
endfunction()

# One CPU test per shared library: check_exports_<target>. Runs after every folder is read (the libraries
# live in folders read after tests/).
function(mok_add_export_checks)
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  _mok_shared_libraries("${PROJECT_SOURCE_DIR}" _libraries)
  foreach(_t IN LISTS _libraries)
    get_target_property(_allowed ${_t} MOK_EXPORTS)
    if(NOT _allowed)
      message(FATAL_ERROR "Shared library ${_t} exports everything: call mok_export_only(${_t} ...) "
                          "(cmake/MokSharedLibrary.cmake)")
    endif()
    set(_runtime "")
    get_target_property(_forbid ${_t} MOK_FORBID_NEEDED)
    if(_forbid)
      set(_runtime --forbid-needed "${_forbid}")  # the C++ runtime is linked in, not loaded
    endif()
    add_test(NAME check_exports_${_t}
             COMMAND ${Python3_EXECUTABLE} "${PROJECT_SOURCE_DIR}/tools/check_exports.py" $<TARGET_FILE:${_t}>
                     --allowed "${_allowed}" ${_runtime})
    set_tests_properties(check_exports_${_t} PROPERTIES LABELS cpu SKIP_RETURN_CODE 77)  # 77: no readelf
  endforeach()
endfunction()
