// Makes a device current for a scope and restores the previous one on exit.
#pragma once

#include <cuda_runtime_api.h>

#include "src/host/check.h"
#include "src/host/teardown.h"

namespace mok::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MOK_CHECK_CUDA(cudaGetDevice(&previous_));
    MOK_CHECK_CUDA(cudaSetDevice(device));
  }
  ~DeviceGuard() { check_teardown(cudaSetDevice(previous_), "cudaSetDevice (restoring the caller's device)"); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// DeviceGuard for teardown: never throws; `ok()` says whether `device` is current (a failure is reported,
// src/host/teardown.h).
class TeardownDeviceGuard {
 public:
  explicit TeardownDeviceGuard(int device) noexcept {
    restore_ = check_teardown(cudaGetDevice(&previous_), "cudaGetDevice");
    ok_ = check_teardown(cudaSetDevice(device), "cudaSetDevice");
  }
  ~TeardownDeviceGuard() {
    if (restore_ && ok_) check_teardown(cudaSetDevice(previous_), "cudaSetDevice (restoring the caller's device)");
  }
  TeardownDeviceGuard(const TeardownDeviceGuard&) = delete;
  TeardownDeviceGuard& operator=(const TeardownDeviceGuard&) = delete;
  bool ok() const { return ok_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  bool ok_ = false;
};

}  // namespace mok::detail
