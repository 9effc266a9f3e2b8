// Makes a device current for a scope and restores the previous one on exit.
#pragma once

#include <cuda_runtime_api.h>

#include "src/host/check.h"

namespace mok::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MOK_CHECK_CUDA(cudaGetDevice(&previous_));
    MOK_CHECK_CUDA(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace mok::detail
