// The communicator: the ranks of an expert-parallel group as one process sees them, and memory every rank
// can address (symmetric buffers).
//
// Three kinds:
//   nccl           one rank per GPU, in this or other processes, from existing NCCL 2.28 communicators. A
//                  symmetric buffer is ncclMemAlloc'd memory registered as a window with
//                  NCCL_WIN_COLL_SYMMETRIC; kernels reach the peers' copies through the device API's LSA
//                  (load/store accessible) pointers. All ranks must be in one NVLink domain (one LSA team).
//                  No multicast (NVLS) is used. A one-rank communicator gets plain device memory.
//   device peers   one rank per GPU of this process, CUDA peer access enabled between them (tests).
//   virtual ranks  all ranks on one GPU; their kernels run one after another (docs/design.md, "The
//                  communicator"). Used to test EP = 4, 8, ... on one GPU.
// A process drives its *local* ranks: all of them for device peers and virtual ranks, the ranks of its
// communicators for nccl (usually one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <nccl.h>

#include "mok/routing.h"

namespace mok {

// What a kernel gets: the base address of one symmetric allocation on every rank, addressable from the
// calling rank's device. Passed by value as a kernel parameter.
struct PeerPointers {
  void* base[kMaxEpSize];
};

class PeerGroup;

// One allocation of the same size on every rank (zero-filled). Move-only.
//
// Lifetime (docs/design.md, "Lifetimes"): for the nccl kind, freeing is collective like allocating (the windows
// are deregistered with ncclCommWindowDeregister), so it is explicit: close(), called by every process of the
// communicator for its allocations in the same order. The destructor never calls a collective: it frees local
// memory, and NCCL windows still registered are leaked with a warning on stderr (printed once per process).
// The other kinds free on destruction as well as on close().
class SymmetricAllocation {
 public:
  SymmetricAllocation() = default;
  SymmetricAllocation(SymmetricAllocation&&) noexcept;
  SymmetricAllocation& operator=(SymmetricAllocation&&) noexcept;
  SymmetricAllocation(const SymmetricAllocation&) = delete;
  SymmetricAllocation& operator=(const SymmetricAllocation&) = delete;
  ~SymmetricAllocation();

  // The local rank's own copy (device memory of its GPU); throws std::invalid_argument for a rank this process
  // does not drive, std::logic_error after close().
  void* on(int rank) const;
  size_t bytes() const { return bytes_; }
  // Every rank's copy as addressed from local rank `rank`'s device.
  PeerPointers peers(int rank) const;

  // Frees every local copy: for the nccl kind a collective (every process calls it, synchronously), which first
  // deregisters the windows in one NCCL group call. Idempotent. The copies must be idle (no kernel of any rank
  // still reading them). Throws std::runtime_error naming the call if NCCL fails; the allocation is closed
  // (its windows given up) either way.
  void close();
  bool closed() const { return closed_; }
  // Whether NCCL windows are still registered: only close() can release them.
  bool needs_close() const;
  // Gives up the registered NCCL windows without deregistering them (leaked: for an owner that has warned
  // about it); the destructor then frees only what has no window.
  void leak_windows() noexcept;

 private:
  friend class PeerGroup;
  void free_local() noexcept;  // every local copy without a registered window
  void release_without_collective() noexcept;  // the destructor's work: warn about and leak windows, free_local
  std::vector<void*> ptrs_;          // [ep_size] own copy of each local rank, nullptr elsewhere
  std::vector<PeerPointers> tables_; // [ep_size] peer table of each local rank
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;    // nccl kind: [ep_size] communicator of each local rank
  std::vector<ncclWindow_t> windows_;  // nccl kind: [ep_size] registered window, nullptr when none
  double setup_timeout_s_ = kDefaultSetupTimeoutS;  // the group's, for close()
  size_t bytes_ = 0;
  bool closed_ = false;
};

// Each factory first checks that every device of the group is a Hopper GPU (sm_90, what the library is
// compiled for): std::runtime_error "<factory>: mok needs an NVIDIA Hopper GPU (sm_90); found ..." otherwise.
class PeerGroup {
 public:
  // ep_size ranks sharing one GPU.
  static PeerGroup virtual_ranks(int ep_size, int device = 0);
  // Rank r on devices[r]; enables peer access between every pair (throws if a pair cannot).
  static PeerGroup device_peers(const std::vector<int>& devices);
  // The ranks of `comms` (communicators of one NCCL clique, one per local GPU, each created on its device);
  // the group is the communicator's whole world. Throws if the world is not one NVLink (LSA) domain or
  // exceeds kMaxEpSize. The communicators stay the caller's; they must outlive the group's allocations.
  // setup_timeout_s bounds the waits of allocate() and SymmetricAllocation::close() for the other ranks (with
  // nonblocking communicators, ncclConfig_t::blocking = 0; a blocking one may wait inside NCCL's calls first):
  // past it they throw detail::SetupTimeout, a std::runtime_error, and the communicator must be aborted.
  static PeerGroup nccl(const std::vector<ncclComm_t>& comms, double setup_timeout_s = kDefaultSetupTimeoutS);

  int size() const { return static_cast<int>(devices_.size()); }
  bool is_virtual() const { return is_virtual_; }
  bool is_nccl() const { return !comms_.empty(); }  // false for a one-rank communicator (nothing to share)
  bool is_local(int rank) const;
  std::vector<int> local_ranks() const;
  // The GPU of a local rank.
  int device(int rank) const;

  // `bytes` on every rank, zero-filled, synchronously: call at setup, not on the hot path. For the nccl kind
  // this is collective: every process of the communicator calls it, in the same order (and closes it:
  // SymmetricAllocation::close). If a step throws, what was made is freed, except NCCL windows already
  // registered (leaked with a warning: deregistering is collective).
  SymmetricAllocation allocate(size_t bytes) const;

  // Every rank's `values` (the same count on every rank), rank-major: [size() * values.size()]. For the nccl
  // kind a collective (ncclAllGather) that every process calls, synchronously, with its local ranks all
  // giving the same values; the other kinds are one process, so every rank's values are the caller's.
  // For setup-time agreement checks (MoeWorkspace: every rank must build the same shape). Waits at most
  // timeout_s for the other ranks (nonblocking communicators, as above), then throws detail::SetupTimeout.
  std::vector<int64_t> all_gather(const std::vector<int64_t>& values, double timeout_s = kDefaultSetupTimeoutS) const;

 private:
  std::vector<int> devices_;        // [ep_size] GPU of each local rank, -1 for other processes' ranks
  std::vector<ncclComm_t> comms_;   // nccl kind: [ep_size] communicator of each local rank, else empty
  double setup_timeout_s_ = kDefaultSetupTimeoutS;
  bool is_virtual_ = false;
};

}  // namespace mok
