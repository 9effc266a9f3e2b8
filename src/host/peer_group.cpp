// In-process peer groups: virtual ranks on one GPU, or one rank per GPU with CUDA peer access.
#include "mok/peer_group.h"

#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "src/host/check.h"
#include "src/host/device_guard.h"

namespace mok {
using detail::DeviceGuard;
namespace {

void check_ep_size(int ep_size) {
  if (ep_size < 1 || ep_size > kMaxEpSize)
    throw std::invalid_argument("PeerGroup: ep_size must be in [1, " + std::to_string(kMaxEpSize) + "], got " +
                                std::to_string(ep_size));
}

}  // namespace

SymmetricAllocation::SymmetricAllocation(SymmetricAllocation&& other) noexcept { *this = std::move(other); }

SymmetricAllocation& SymmetricAllocation::operator=(SymmetricAllocation&& other) noexcept {
  if (this != &other) {
    release();
    ptrs_ = std::move(other.ptrs_);
    devices_ = std::move(other.devices_);
    bytes_ = other.bytes_;
    other.ptrs_.clear();
    other.devices_.clear();
  }
  return *this;
}

SymmetricAllocation::~SymmetricAllocation() { release(); }

void SymmetricAllocation::release() {
  for (size_t r = 0; r < ptrs_.size(); ++r) {
    if (ptrs_[r] == nullptr) continue;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(devices_[r]);
    cudaFree(ptrs_[r]);
    cudaSetDevice(previous);
  }
  ptrs_.clear();
}

PeerPointers SymmetricAllocation::peers() const {
  PeerPointers table{};
  for (size_t r = 0; r < ptrs_.size(); ++r) table.base[r] = ptrs_[r];
  return table;
}

PeerGroup PeerGroup::virtual_ranks(int ep_size, int device) {
  check_ep_size(ep_size);
  PeerGroup group;
  group.devices_.assign(ep_size, device);
  group.is_virtual_ = true;
  return group;
}

PeerGroup PeerGroup::device_peers(const std::vector<int>& devices) {
  check_ep_size(static_cast<int>(devices.size()));
  int device_count = 0;
  MOK_CHECK_CUDA(cudaGetDeviceCount(&device_count));
  for (int device : devices)
    if (device < 0 || device >= device_count)
      throw std::invalid_argument("PeerGroup::device_peers: device " + std::to_string(device) + " does not exist (" +
                                  std::to_string(device_count) + " visible)");
  for (size_t a = 0; a < devices.size(); ++a) {
    DeviceGuard guard(devices[a]);
    for (size_t b = 0; b < devices.size(); ++b) {
      if (devices[a] == devices[b]) continue;
      int can_access = 0;
      MOK_CHECK_CUDA(cudaDeviceCanAccessPeer(&can_access, devices[a], devices[b]));
      if (!can_access)
        throw std::runtime_error("PeerGroup::device_peers: device " + std::to_string(devices[a]) +
                                 " cannot access device " + std::to_string(devices[b]));
      const cudaError_t error = cudaDeviceEnablePeerAccess(devices[b], 0);
      if (error == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear the sticky-free error this call leaves behind
      } else {
        MOK_CHECK_CUDA(error);
      }
    }
  }
  PeerGroup group;
  group.devices_ = devices;
  group.is_virtual_ = false;
  return group;
}

SymmetricAllocation PeerGroup::allocate(size_t bytes) const {
  SymmetricAllocation allocation;
  allocation.bytes_ = bytes;
  allocation.devices_ = devices_;
  allocation.ptrs_.assign(devices_.size(), nullptr);
  for (size_t r = 0; r < devices_.size(); ++r) {
    DeviceGuard guard(devices_[r]);
    MOK_CHECK_CUDA(cudaMalloc(&allocation.ptrs_[r], bytes));
    MOK_CHECK_CUDA(cudaMemset(allocation.ptrs_[r], 0, bytes));
  }
  for (size_t r = 0; r < devices_.size(); ++r) {
    DeviceGuard guard(devices_[r]);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
  }
  return allocation;
}

}  // namespace mok
