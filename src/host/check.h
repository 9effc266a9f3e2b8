// Error checking on the host: CUDA runtime and NCCL calls throw std::runtime_error naming the call;
// argument checks throw std::invalid_argument with the caller's message.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace mok::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                           ") in " + call + " at " + file + ":" + std::to_string(line));
}

inline void check_nccl(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) throw std::runtime_error(std::string("NCCL error in ") + call + ": " + ncclGetErrorString(result));
}

inline void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

}  // namespace mok::detail

#define MOK_CHECK_CUDA(call)                                                       \
  do {                                                                             \
    const cudaError_t mok_check_error_ = (call);                                   \
    if (mok_check_error_ != cudaSuccess)                                           \
      ::mok::detail::throw_cuda_error(mok_check_error_, #call, __FILE__, __LINE__); \
  } while (0)
