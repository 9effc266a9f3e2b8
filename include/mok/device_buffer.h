// An owning buffer of device memory on one GPU: what every allocation of the library's workspaces and
// forward contexts is made of (docs/design.md, "Lifetimes"), so a constructor that throws half way frees
// what it made, and a moved-from owner frees nothing.
//
//   DeviceBuffer b(device, bytes);   // cudaMalloc on `device` (the current device is restored)
//   b.get(), b.bytes(), b.device()
//   b.reset();                       // cudaFree on its device; the destructor does the same
#pragma once

#include <cstddef>

namespace mok {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `bytes` of device memory on `device`; 0 bytes: an empty buffer (get() is null). Throws std::runtime_error
  // naming the CUDA call (out of memory, a bad device) and leaves nothing allocated.
  DeviceBuffer(int device, size_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }
  bool empty() const { return ptr_ == nullptr; }

  // Frees the memory now (cudaFree on its device, which waits for the device's work first) and empties the
  // buffer. Never throws: a failure is reported on stderr (the first teardown error of the process; a CUDA
  // runtime already unloaded at process exit is not an error).
  void reset() noexcept;

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  int device_ = 0;
};

}  // namespace mok
