// Error checking on the host: CUDA runtime and NCCL calls throw std::runtime_error naming the call;
// argument checks throw std::invalid_argument with the caller's message.
#pragma once

#include <cstdint>
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

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Gives a persistent kernel the dynamic shared memory it needs on the current device and returns the
// device's SM count; throws std::runtime_error naming `what` when the device allows less per CTA.
template <class Kernel>
int prepare_persistent_kernel(Kernel kernel, int shared_bytes, const char* what);

}  // namespace mok::detail

#define MOK_CHECK_CUDA(call)                                                       \
  do {                                                                             \
    const cudaError_t mok_check_error_ = (call);                                   \
    if (mok_check_error_ != cudaSuccess)                                           \
      ::mok::detail::throw_cuda_error(mok_check_error_, #call, __FILE__, __LINE__); \
  } while (0)

template <class Kernel>
int mok::detail::prepare_persistent_kernel(Kernel kernel, int shared_bytes, const char* what) {
  int device = 0, num_sms = 0, max_smem = 0;
  MOK_CHECK_CUDA(cudaGetDevice(&device));
  MOK_CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  MOK_CHECK_CUDA(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (shared_bytes > max_smem)
    throw std::runtime_error(std::string(what) + ": needs " + std::to_string(shared_bytes) +
                             " bytes of shared memory per CTA, the device allows " + std::to_string(max_smem));
  MOK_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  return num_sms;
}
