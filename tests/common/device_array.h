// A typed device buffer for tests: allocate, upload, download (synchronous copies), free on destruction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "src/host/check.h"

namespace mok::testing {

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceArray(size_t n) : count(n) {
    MOK_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& host) {
    MOK_CHECK_CUDA(cudaMemcpy(ptr, host.data(), std::min(host.size(), count) * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count);
    MOK_CHECK_CUDA(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

// `count` elements of T from device memory at `src` (synchronous; none for count 0, any pointer then).
template <typename T>
std::vector<T> download(const void* src, int64_t count) {
  std::vector<T> host(count);
  if (count > 0) MOK_CHECK_CUDA(cudaMemcpy(host.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace mok::testing
