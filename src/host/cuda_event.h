// An owning CUDA event (timing disabled) on one device: created in the constructor, destroyed in the
// destructor (errors reported, never thrown: src/host/teardown.h). Move-only.
#pragma once

#include <utility>

#include <cuda_runtime_api.h>

#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "src/host/failure_injection.h"
#include "src/host/teardown.h"

namespace mok::detail {

class CudaEvent {
 public:
  CudaEvent() = default;
  explicit CudaEvent(int device) : device_(device) {
    construction_step("cudaEventCreateWithFlags");
    DeviceGuard guard(device);
    MOK_CHECK_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)), device_(other.device_) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
      device_ = other.device_;
    }
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() { reset(); }

  cudaEvent_t get() const { return event_; }

  void reset() noexcept {
    if (event_ == nullptr) return;
    TeardownDeviceGuard guard(device_);
    check_teardown(cudaEventDestroy(std::exchange(event_, nullptr)), "cudaEventDestroy");
  }

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = 0;
};

}  // namespace mok::detail
