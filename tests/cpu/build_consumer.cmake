# cmake -DBUILD_DIR= -DPREFIX= -DSOURCE= -DCONSUMER_BUILD= -DGENERATOR= -P build_consumer.cmake
# Installs BUILD_DIR into PREFIX (fresh), then configures and builds the consumer project SOURCE in
# CONSUMER_BUILD (fresh) with CMAKE_PREFIX_PATH=PREFIX: find_package(mok) and the link must work.
foreach(_step IN ITEMS install configure build)
  if(_step STREQUAL "install")
    file(REMOVE_RECURSE "${PREFIX}" "${CONSUMER_BUILD}")
    set(_command "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}")
  elseif(_step STREQUAL "configure")
    set(_command "${CMAKE_COMMAND}" -S "${SOURCE}" -B "${CONSUMER_BUILD}" -G "${GENERATOR}"
                 "-DCMAKE_PREFIX_PATH=${PREFIX}")
  else()
    set(_command "${CMAKE_COMMAND}" --build "${CONSUMER_BUILD}")
  endif()
  string(JOIN " " _shown ${_command})
  message(STATUS "cpp_consumer: ${_shown}")
  execute_process(COMMAND ${_command} RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "cpp_consumer: the ${_step} step failed (${_rc})")
  endif()
endforeach()
if(NOT EXISTS "${CONSUMER_BUILD}/mok_consumer")
  message(FATAL_ERROR "cpp_consumer: no ${CONSUMER_BUILD}/mok_consumer after the build")
endif()
