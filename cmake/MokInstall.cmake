# `cmake --install <build> --prefix <dir>`: the static library, the public headers (include/mok: host-only,
# no CUTLASS) and a CMake package, so another project consumes it with
#   find_package(mok 0.1 CONFIG REQUIRED)            # -DCMAKE_PREFIX_PATH=<dir>
#   target_link_libraries(app PRIVATE mok::mok)      # brings CUDA::cudart and NCCL
# examples/cpp_consumer is such a project; tests/CMakeLists.txt builds it against an install (CPU test
# cpp_consumer). The Python package installs nothing of this (pip installs the "python" component only).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(MOK_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/mok")
set_target_properties(mok_nccl PROPERTIES EXPORT_NAME nccl)
install(TARGETS mok mok_nccl EXPORT mokTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT Development
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/mok" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        COMPONENT Development)
install(EXPORT mokTargets NAMESPACE mok:: DESTINATION "${MOK_INSTALL_CMAKEDIR}" COMPONENT Development)
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/mokConfig.cmake.in"
                              "${CMAKE_CURRENT_BINARY_DIR}/mokConfig.cmake"
                              INSTALL_DESTINATION "${MOK_INSTALL_CMAKEDIR}")
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/mokConfigVersion.cmake"
                                 COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/mokConfig.cmake" "${CMAKE_CURRENT_BINARY_DIR}/mokConfigVersion.cmake"
        DESTINATION "${MOK_INSTALL_CMAKEDIR}" COMPONENT Development)
