// Error checking for CUDA runtime calls on the host: throws std::runtime_error naming the call and place.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

namespace mok::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                           ") in " + call + " at " + file + ":" + std::to_string(line));
}

}  // namespace mok::detail

#define MOK_CHECK_CUDA(call)                                                       \
  do {                                                                             \
    const cudaError_t mok_check_error_ = (call);                                   \
    if (mok_check_error_ != cudaSuccess)                                           \
      ::mok::detail::throw_cuda_error(mok_check_error_, #call, __FILE__, __LINE__); \
  } while (0)
