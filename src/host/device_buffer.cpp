// DeviceBuffer (include/mok/device_buffer.h).
#include "mok/device_buffer.h"

#include <utility>

#include <cuda_runtime_api.h>

#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "src/host/failure_injection.h"
#include "src/host/teardown.h"

namespace mok {

DeviceBuffer::DeviceBuffer(int device, size_t bytes) : device_(device) {
  if (bytes == 0) return;
  detail::construction_step("cudaMalloc");
  detail::DeviceGuard guard(device);
  void* ptr = nullptr;
  MOK_CHECK_CUDA(cudaMalloc(&ptr, bytes));
  detail::note_allocation();
  ptr_ = ptr;
  bytes_ = bytes;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)), device_(other.device_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

void DeviceBuffer::reset() noexcept {
  if (ptr_ == nullptr) return;
  {
    detail::TeardownDeviceGuard guard(device_);
    if (guard.ok()) detail::check_teardown(cudaFree(ptr_), "cudaFree");
  }
  detail::note_free();  // freed or lost with the context: either way not ours any more
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace mok
