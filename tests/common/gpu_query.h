// What the process can use, for the tests and the programs in bench/ alike (no GoogleTest here): GPUs of
// compute capability 9.0 (the library is built for sm_90a only), and whether the big cases should shrink.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>

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

// MOK_TEST_REDUCED set to anything but "" or "0": the full-size cases skip (tools/gpu_suite.sh sets it for
// its compute-sanitizer runs, which are 10-100x slower than the kernels alone).
inline bool reduced_sizes() {
  const char* value = std::getenv("MOK_TEST_REDUCED");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

}  // namespace mok::testing
