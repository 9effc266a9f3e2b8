// Peer groups: virtual ranks on one GPU, one rank per GPU with CUDA peer access, or NCCL symmetric windows.
#include "mok/peer_group.h"

#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "mok/device_buffer.h"
#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "src/host/failure_injection.h"
#include "src/host/nccl_setup.h"
#include "src/host/nccl_windows.h"
#include "src/host/teardown.h"

namespace mok {
using detail::check_nccl;
using detail::DeviceGuard;
namespace {

// Streams are destroyed at once even with work pending (CUDA releases them when it is done).
void destroy_streams(const std::vector<int>& devices, const std::vector<cudaStream_t>& streams) {
  for (size_t n = 0; n < streams.size(); ++n) {
    detail::TeardownDeviceGuard guard(devices[n]);
    if (guard.ok()) detail::check_teardown(cudaStreamDestroy(streams[n]), "cudaStreamDestroy");
  }
}

void check_ep_size(int ep_size) {
  if (ep_size < 1 || ep_size > kMaxEpSize)
    throw std::invalid_argument("PeerGroup: ep_size must be in [1, " + std::to_string(kMaxEpSize) + "], got " +
                                std::to_string(ep_size));
}

}  // namespace

SymmetricAllocation::SymmetricAllocation(SymmetricAllocation&& other) noexcept { *this = std::move(other); }

SymmetricAllocation& SymmetricAllocation::operator=(SymmetricAllocation&& other) noexcept {
  if (this != &other) {
    release_without_collective();
    ptrs_ = std::move(other.ptrs_);
    tables_ = std::move(other.tables_);
    devices_ = std::move(other.devices_);
    comms_ = std::move(other.comms_);
    windows_ = std::move(other.windows_);
    setup_timeout_s_ = other.setup_timeout_s_;
    bytes_ = other.bytes_;
    closed_ = other.closed_;
    other.ptrs_.clear();
    other.windows_.clear();
    other.closed_ = false;
  }
  return *this;
}

SymmetricAllocation::~SymmetricAllocation() { release_without_collective(); }

// Never a collective (docs/design.md, "Lifetimes"): windows still registered are leaked, with a warning.
void SymmetricAllocation::release_without_collective() noexcept {
  if (needs_close()) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true))
      std::fprintf(stderr,
                   "mok: a symmetric allocation (%zu bytes per rank) was destroyed without close(): its NCCL windows "
                   "are leaked, not deregistered (deregistration is collective; this warning is printed once)\n",
                   bytes_);
    leak_windows();
  }
  free_local();
}

bool SymmetricAllocation::needs_close() const {
  for (ncclWindow_t window : windows_)
    if (window != nullptr) return true;
  return false;
}

void SymmetricAllocation::leak_windows() noexcept {
  for (size_t r = 0; r < windows_.size(); ++r) {
    if (windows_[r] == nullptr) continue;
    windows_[r] = nullptr;
    ptrs_[r] = nullptr;  // registered memory must not be freed while its window exists
  }
}

void SymmetricAllocation::free_local() noexcept {
  for (size_t r = 0; r < ptrs_.size(); ++r) {
    if (ptrs_[r] == nullptr || (!windows_.empty() && windows_[r] != nullptr)) continue;
    detail::TeardownDeviceGuard guard(devices_[r]);
    if (guard.ok()) {
      if (comms_.empty())
        detail::check_teardown(cudaFree(ptrs_[r]), "cudaFree");
      else if (const ncclResult_t result = ncclMemFree(ptrs_[r]); result != ncclSuccess)
        detail::report_teardown_error("ncclMemFree", ncclGetErrorString(result));
    }
    detail::note_free();
    ptrs_[r] = nullptr;
  }
}

void SymmetricAllocation::close() {
  if (closed_) return;
  closed_ = true;  // also when a step below throws: the windows are given up, never deregistered twice
  std::string error;
  if (needs_close()) {
    // Deregistration is collective like registration: one NCCL group call, so one process may drive
    // several ranks; every process closes its allocations in the same order.
    auto note = [&error](ncclResult_t result, const char* call) {  // ncclInProgress: the group end finishes it
      if (result != ncclSuccess && result != ncclInProgress && error.empty())
        error = std::string(call) + ": " + ncclGetErrorString(result);
    };
    int previous = -1;  // the collective is reached even when this fails (the peers wait in it)
    if (cudaGetDevice(&previous) != cudaSuccess) (void)cudaGetLastError();
    note(ncclGroupStart(), "ncclGroupStart");
    for (size_t r = 0; r < windows_.size() && error.empty(); ++r) {
      if (windows_[r] == nullptr) continue;
      if (const cudaError_t e = cudaSetDevice(devices_[r]); e != cudaSuccess)
        error = std::string("cudaSetDevice: ") + cudaGetErrorString(e);
      else
        note(ncclCommWindowDeregister(comms_[r], windows_[r]), "ncclCommWindowDeregister");
    }
    // A nonblocking communicator finishes the group in the background (ncclInProgress): wait for it, bounded.
    try {
      std::vector<ncclComm_t> local;
      for (size_t r = 0; r < windows_.size(); ++r)
        if (windows_[r] != nullptr) local.push_back(comms_[r]);
      detail::finish_nccl(local, ncclGroupEnd(), "ncclGroupEnd (ncclCommWindowDeregister)", setup_timeout_s_);
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
    if (previous >= 0) detail::check_teardown(cudaSetDevice(previous), "cudaSetDevice (restoring the caller's device)");
    if (error.empty())
      for (ncclWindow_t& window : windows_) window = nullptr;  // deregistered: the memory can go
    else
      leak_windows();  // a window whose deregistration failed may still map the memory: keep it
  }
  free_local();
  if (!error.empty())
    throw std::runtime_error("SymmetricAllocation::close: " + error + " (the windows are leaked)");
}

void* SymmetricAllocation::on(int rank) const {
  if (closed_) throw std::logic_error("SymmetricAllocation: closed (close() was called)");
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

PeerGroup PeerGroup::nccl(const std::vector<ncclComm_t>& comms, double setup_timeout_s) {
  if (comms.empty()) throw std::invalid_argument("PeerGroup::nccl: comms is empty");
  detail::require_seconds(setup_timeout_s, "PeerGroup::nccl: setup_timeout_s");
  // A nonblocking communicator may still be in its init: its queries below need it ready (bounded, as above).
  detail::finish_nccl(comms, ncclInProgress, "the communicators' init (PeerGroup::nccl)", setup_timeout_s);
  int ep_size = 0;
  check_nccl(ncclCommCount(comms[0], &ep_size), "ncclCommCount");
  check_ep_size(ep_size);
  PeerGroup group;
  group.devices_.assign(ep_size, -1);
  group.comms_.assign(ep_size, nullptr);
  group.setup_timeout_s_ = setup_timeout_s;
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

// Exception-safe: a throw at any step leaves `allocation` to its destructor, which frees every copy made so
// far (NCCL windows already registered are leaked with its warning: deregistering is collective).
SymmetricAllocation PeerGroup::allocate(size_t bytes) const {
  SymmetricAllocation allocation;
  allocation.bytes_ = bytes;
  allocation.devices_ = devices_;
  allocation.ptrs_.assign(size(), nullptr);
  allocation.tables_.assign(size(), PeerPointers{});
  const std::vector<int> local = local_ranks();
  if (is_nccl()) {
    allocation.comms_ = comms_;
    allocation.setup_timeout_s_ = setup_timeout_s_;
    allocation.windows_.assign(size(), nullptr);
    for (int r : local) {
      detail::construction_step("ncclMemAlloc");
      DeviceGuard guard(devices_[r]);
      void* ptr = nullptr;
      check_nccl(ncclMemAlloc(&ptr, bytes), "ncclMemAlloc");
      allocation.ptrs_[r] = ptr;
      detail::note_allocation();
      MOK_CHECK_CUDA(cudaMemset(allocation.ptrs_[r], 0, bytes));
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
    }
    // Registration is collective over the communicator; a group call lets one process drive several ranks. A
    // nonblocking communicator registers in the background (ncclInProgress), writing windows_[r] at the end.
    std::vector<ncclComm_t> local_comms;
    for (int r : local) local_comms.push_back(comms_[r]);
    try {
      detail::NcclGroup group;
      for (int r : local) {
        DeviceGuard guard(devices_[r]);
        const ncclResult_t result = ncclCommWindowRegister(comms_[r], allocation.ptrs_[r], bytes,
                                                           &allocation.windows_[r], NCCL_WIN_COLL_SYMMETRIC);
        if (result != ncclInProgress) check_nccl(result, "ncclCommWindowRegister");
      }
      detail::finish_nccl(local_comms, group.end(), "ncclGroupEnd (ncclCommWindowRegister)", setup_timeout_s_);
    } catch (const detail::SetupTimeout&) {
      // The background registration still holds the memory and will write &windows_[r]: both are left to it
      // (leaked; the communicator must be aborted anyway).
      (void)new std::vector<ncclWindow_t>(std::move(allocation.windows_));
      allocation.windows_.clear();
      allocation.ptrs_.assign(size(), nullptr);
      throw;
    }
    for (int r : local) {
      DeviceGuard guard(devices_[r]);
      allocation.tables_[r] = detail::window_peer_pointers(allocation.windows_[r], size());
    }
    return allocation;
  }
  for (int r : local) {
    detail::construction_step("cudaMalloc");
    DeviceGuard guard(devices_[r]);
    void* ptr = nullptr;
    MOK_CHECK_CUDA(cudaMalloc(&ptr, bytes));
    allocation.ptrs_[r] = ptr;
    detail::note_allocation();
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

std::vector<int64_t> PeerGroup::all_gather(const std::vector<int64_t>& values, double timeout_s) const {
  const size_t count = values.size();
  std::vector<int64_t> gathered;
  if (!is_nccl()) {
    for (int r = 0; r < size(); ++r) gathered.insert(gathered.end(), values.begin(), values.end());
    return gathered;
  }
  detail::require_seconds(timeout_s, "PeerGroup::all_gather: timeout_s");
  gathered.assign(size() * count, 0);
  const std::vector<int> local = local_ranks();
  std::vector<DeviceBuffer> buffers(size());  // [size() * count] gathered, then this rank's values
  for (int r : local) {
    buffers[r] = DeviceBuffer(devices_[r], (size() + 1) * count * sizeof(int64_t));
    DeviceGuard guard(devices_[r]);
    MOK_CHECK_CUDA(cudaMemcpy(static_cast<int64_t*>(buffers[r].get()) + size() * count, values.data(),
                              count * sizeof(int64_t), cudaMemcpyHostToDevice));
  }
  // One process may drive several ranks: a group call, as for the window registration, on a stream of its own per
  // rank (a wait on it sees only the collective). Bounded: a rank that never calls it leaves the others waiting (in
  // NCCL's connection setup for a nonblocking communicator, then in the collective's kernel); past timeout_s in
  // all, this throws detail::SetupTimeout. After any throw the buffers are leaked, as a pending collective may still
  // write them (and freeing them would wait for it).
  std::vector<ncclComm_t> local_comms;
  std::vector<int> local_devices;
  std::vector<cudaStream_t> streams;
  const detail::SetupClock::time_point start = detail::SetupClock::now();  // one deadline for both waits
  try {
    for (int r : local) {
      DeviceGuard guard(devices_[r]);
      cudaStream_t stream = nullptr;
      MOK_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      streams.push_back(stream);
      local_comms.push_back(comms_[r]);
      local_devices.push_back(devices_[r]);
    }
    detail::NcclGroup group;
    for (size_t n = 0; n < local.size(); ++n) {
      DeviceGuard guard(local_devices[n]);
      int64_t* buffer = static_cast<int64_t*>(buffers[local[n]].get());
      const ncclResult_t result =
          ncclAllGather(buffer + size() * count, buffer, count, ncclInt64, local_comms[n], streams[n]);
      if (result != ncclInProgress) check_nccl(result, "ncclAllGather");
    }
    detail::finish_nccl(local_comms, group.end(), "ncclGroupEnd (ncclAllGather)", timeout_s, start);
    detail::wait_streams(local_devices, streams, timeout_s, "PeerGroup::all_gather", start);
  } catch (...) {
    (void)new std::vector<DeviceBuffer>(std::move(buffers));  // leaked on purpose (above)
    destroy_streams(local_devices, streams);
    throw;
  }
  destroy_streams(local_devices, streams);
  DeviceGuard guard(devices_[local.front()]);
  MOK_CHECK_CUDA(cudaMemcpy(gathered.data(), buffers[local.front()].get(), size() * count * sizeof(int64_t),
                            cudaMemcpyDeviceToHost));
  return gathered;
}

}  // namespace mok
