// Peer groups: virtual ranks on one GPU, one rank per GPU with CUDA peer access, or NCCL symmetric windows.
#include "mok/peer_group.h"

#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "src/host/nccl_windows.h"

namespace mok {
using detail::check_nccl;
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
    tables_ = std::move(other.tables_);
    devices_ = std::move(other.devices_);
    comms_ = std::move(other.comms_);
    windows_ = std::move(other.windows_);
    bytes_ = other.bytes_;
    other.ptrs_.clear();
  }
  return *this;
}

SymmetricAllocation::~SymmetricAllocation() { release(); }

void SymmetricAllocation::release() {
  int previous = 0;
  cudaGetDevice(&previous);
  for (size_t r = 0; r < ptrs_.size(); ++r) {
    if (ptrs_[r] == nullptr) continue;
    cudaSetDevice(devices_[r]);
    if (comms_.empty()) {
      cudaFree(ptrs_[r]);
    } else {
      // Deregistration is collective like registration; every process frees its windows in the same order.
      ncclCommWindowDeregister(comms_[r], windows_[r]);
      ncclMemFree(ptrs_[r]);
    }
  }
  cudaSetDevice(previous);
  ptrs_.clear();
}

void* SymmetricAllocation::on(int rank) const {
  void* ptr = ptrs_.at(rank);
  if (ptr == nullptr) throw std::invalid_argument("SymmetricAllocation: rank " + std::to_string(rank) + " is not local");
  return ptr;
}

PeerPointers SymmetricAllocation::peers(int rank) const {
  on(rank);  // checks that the rank is local
  return tables_[rank];
}

PeerGroup PeerGroup::virtual_ranks(int ep_size, int device) {
  check_ep_size(ep_size);
  detail::require_hopper(device, "PeerGroup::virtual_ranks");
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
  for (int device : devices) detail::require_hopper(device, "PeerGroup::device_peers");
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

PeerGroup PeerGroup::nccl(const std::vector<ncclComm_t>& comms) {
  if (comms.empty()) throw std::invalid_argument("PeerGroup::nccl: comms is empty");
  int ep_size = 0;
  check_nccl(ncclCommCount(comms[0], &ep_size), "ncclCommCount");
  check_ep_size(ep_size);
  PeerGroup group;
  group.devices_.assign(ep_size, -1);
  group.comms_.assign(ep_size, nullptr);
  for (ncclComm_t comm : comms) {
    int count = 0, rank = 0, device = 0;
    check_nccl(ncclCommCount(comm, &count), "ncclCommCount");
    check_nccl(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
    check_nccl(ncclCommCuDevice(comm, &device), "ncclCommCuDevice");
    detail::require_hopper(device, "PeerGroup::nccl");
    if (count != ep_size)
      throw std::invalid_argument("PeerGroup::nccl: comms have different sizes (" + std::to_string(count) + " and " +
                                  std::to_string(ep_size) + ")");
    if (group.comms_[rank] != nullptr)
      throw std::invalid_argument("PeerGroup::nccl: two comms are rank " + std::to_string(rank));
    const int lsa_size = detail::lsa_team_size(comm);
    if (lsa_size != ep_size)
      throw std::invalid_argument("PeerGroup::nccl: the communicator's " + std::to_string(ep_size) +
                                  " ranks are not one NVLink domain (LSA team of " + std::to_string(lsa_size) +
                                  "): the EP group must be load/store accessible");
    group.devices_[rank] = device;
    group.comms_[rank] = comm;
  }
  // One rank has no peers to address: the group of its one device, with plain device memory (NCCL's
  // one-rank window has no device-side LSA state; reading it faults).
  if (ep_size == 1) group.comms_.clear();
  return group;
}

bool PeerGroup::is_local(int rank) const {
  return rank >= 0 && rank < size() && devices_[rank] >= 0;
}

std::vector<int> PeerGroup::local_ranks() const {
  std::vector<int> ranks;
  for (int r = 0; r < size(); ++r)
    if (is_local(r)) ranks.push_back(r);
  return ranks;
}

int PeerGroup::device(int rank) const {
  if (!is_local(rank)) throw std::invalid_argument("PeerGroup: rank " + std::to_string(rank) + " is not local");
  return devices_[rank];
}

SymmetricAllocation PeerGroup::allocate(size_t bytes) const {
  SymmetricAllocation allocation;
  allocation.bytes_ = bytes;
  allocation.devices_ = devices_;
  allocation.ptrs_.assign(size(), nullptr);
  allocation.tables_.assign(size(), PeerPointers{});
  const std::vector<int> local = local_ranks();
  if (is_nccl()) {
    allocation.comms_ = comms_;
    allocation.windows_.assign(size(), nullptr);
    for (int r : local) {
      DeviceGuard guard(devices_[r]);
      check_nccl(ncclMemAlloc(&allocation.ptrs_[r], bytes), "ncclMemAlloc");
      MOK_CHECK_CUDA(cudaMemset(allocation.ptrs_[r], 0, bytes));
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
    }
    // Registration is collective over the communicator; a group call lets one process drive several ranks.
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int r : local) {
      DeviceGuard guard(devices_[r]);
      check_nccl(ncclCommWindowRegister(comms_[r], allocation.ptrs_[r], bytes, &allocation.windows_[r],
                                        NCCL_WIN_COLL_SYMMETRIC),
                 "ncclCommWindowRegister");
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    for (int r : local) {
      DeviceGuard guard(devices_[r]);
      allocation.tables_[r] = detail::window_peer_pointers(allocation.windows_[r], size());
    }
    return allocation;
  }
  for (int r : local) {
    DeviceGuard guard(devices_[r]);
    MOK_CHECK_CUDA(cudaMalloc(&allocation.ptrs_[r], bytes));
    MOK_CHECK_CUDA(cudaMemset(allocation.ptrs_[r], 0, bytes));
  }
  for (int r : local) {
    DeviceGuard guard(devices_[r]);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
  }
  // Peer access (and one GPU) use one address space: every rank sees the same table.
  for (int r : local)
    for (int peer = 0; peer < size(); ++peer) allocation.tables_[r].base[peer] = allocation.ptrs_[peer];
  return allocation;
}

std::vector<int64_t> PeerGroup::all_gather(const std::vector<int64_t>& values) const {
  const size_t count = values.size();
  std::vector<int64_t> gathered;
  if (!is_nccl()) {
    for (int r = 0; r < size(); ++r) gathered.insert(gathered.end(), values.begin(), values.end());
    return gathered;
  }
  gathered.assign(size() * count, 0);
  const std::vector<int> local = local_ranks();
  std::vector<int64_t*> buffers(size(), nullptr);
  for (int r : local) {
    DeviceGuard guard(devices_[r]);
    MOK_CHECK_CUDA(cudaMalloc(&buffers[r], (size() + 1) * count * sizeof(int64_t)));
    MOK_CHECK_CUDA(cudaMemcpy(buffers[r] + size() * count, values.data(), count * sizeof(int64_t),
                              cudaMemcpyHostToDevice));
  }
  // One process may drive several ranks: a group call, as for the window registration.
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int r : local) {
    DeviceGuard guard(devices_[r]);
    check_nccl(ncclAllGather(buffers[r] + size() * count, buffers[r], count, ncclInt64, comms_[r], nullptr),
               "ncclAllGather");
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  for (int r : local) {
    DeviceGuard guard(devices_[r]);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    if (r == local.front())
      MOK_CHECK_CUDA(cudaMemcpy(gathered.data(), buffers[r], size() * count * sizeof(int64_t), cudaMemcpyDeviceToHost));
    cudaFree(buffers[r]);
  }
  return gathered;
}

}  // namespace mok
