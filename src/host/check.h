// Error checking on the host: CUDA runtime and NCCL calls throw std::runtime_error naming the call;
// argument checks throw std::invalid_argument with the caller's message.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "mok/routing.h"  // kMaxWaitTimeoutS

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

// Every bound on a wait (ScheduleOptions::wait_timeout_s, WaitBound::timeout_s, MoeOptions::setup_timeout_s, a
// setup call's timeout): std::invalid_argument "<name> must be a finite number of seconds in (0, 86400], got ..."
// otherwise. The comparisons also reject NaN and infinity (the kernels count waits in integer nanoseconds).
inline void require_seconds(double seconds, const std::string& name) {
  require(seconds > 0 && seconds <= kMaxWaitTimeoutS, name + " must be a finite number of seconds in (0, " +
                                                         std::to_string(static_cast<int>(kMaxWaitTimeoutS)) +
                                                         "], got " + std::to_string(seconds));
}

}  // namespace mok::detail

#define MOK_CHECK_CUDA(call)                                                       \
  do {                                                                             \
    const cudaError_t mok_check_error_ = (call);                                   \
    if (mok_check_error_ != cudaSuccess)                                           \
      ::mok::detail::throw_cuda_error(mok_check_error_, #call, __FILE__, __LINE__); \
  } while (0)

namespace mok::detail {

// Throws std::runtime_error "mok needs an NVIDIA Hopper GPU (sm_90); found ..." unless `device` is a visible
// sm_90 device: the library is compiled for sm_90a alone (its kernels would not load anywhere else). `who`
// names the entry point. Called where a group of devices is made, before any allocation or launch.
inline void require_hopper(int device, const char* who) {
  const std::string prefix = std::string(who) + ": mok needs an NVIDIA Hopper GPU (sm_90); found ";
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // a process without a driver stays usable
    throw std::runtime_error(prefix + "no CUDA device (cudaGetDeviceCount: " + cudaGetErrorString(error) + ")");
  }
  if (device < 0 || device >= count)
    throw std::runtime_error(prefix + "no device " + std::to_string(device) + " (" + std::to_string(count) +
                             " visible)");
  cudaDeviceProp prop{};
  MOK_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  if (prop.major != 9 || prop.minor != 0)
    throw std::runtime_error(prefix + prop.name + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
                             ") as device " + std::to_string(device));
}

}  // namespace mok::detail
