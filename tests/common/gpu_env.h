// What the test process can use: GPUs of compute capability 9.0 (the library is built for sm_90a only).
#pragma once

#include <string>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace mok::testing {

// Number of visible Hopper GPUs; `reason` says why it is short of `needed`.
inline int hopper_gpus(int needed, std::string* reason) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    *reason = std::string("no usable CUDA device (") + cudaGetErrorName(error) + ")";
    return 0;
  }
  int hopper = 0;
  for (int d = 0; d < count; ++d) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d);
    if (major == 9 && minor == 0) ++hopper;
  }
  if (hopper < needed)
    *reason = "needs " + std::to_string(needed) + " Hopper (sm_90) GPU(s), found " + std::to_string(hopper) +
              " of " + std::to_string(count) + " CUDA device(s)";
  return hopper;
}

}  // namespace mok::testing

// Skips the current test unless `n` Hopper GPUs are visible.
#define MOK_REQUIRE_GPUS(n)                                                         \
  do {                                                                              \
    std::string mok_skip_reason_;                                                   \
    if (::mok::testing::hopper_gpus((n), &mok_skip_reason_) < (n)) GTEST_SKIP() << mok_skip_reason_; \
  } while (0)
