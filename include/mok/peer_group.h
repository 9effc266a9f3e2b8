// The ranks of an expert-parallel group as seen from one process, and memory every rank can address.
//
// Two kinds exist today, both for single-process use:
//   virtual ranks  all ranks live on one GPU; their kernels run one after another (DESIGN.md section 2).
//                  Used to test EP = 4, 8, ... on one GPU.
//   device peers   one rank per GPU of this process, CUDA peer access enabled between them.
// The NCCL communicator (symmetric windows, LSA pointers) plugs in behind the same PeerPointers table.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "mok/routing.h"

namespace mok {

// What a kernel gets: the base address of one symmetric allocation on every rank, addressable from the
// calling rank's device. Passed by value as a kernel parameter.
struct PeerPointers {
  void* base[kMaxEpSize];
};

class PeerGroup;

// One allocation of the same size on every rank (zero-filled). Move-only; frees on destruction.
class SymmetricAllocation {
 public:
  SymmetricAllocation() = default;
  SymmetricAllocation(SymmetricAllocation&&) noexcept;
  SymmetricAllocation& operator=(SymmetricAllocation&&) noexcept;
  SymmetricAllocation(const SymmetricAllocation&) = delete;
  SymmetricAllocation& operator=(const SymmetricAllocation&) = delete;
  ~SymmetricAllocation();

  void* on(int rank) const { return ptrs_.at(rank); }
  size_t bytes() const { return bytes_; }
  PeerPointers peers() const;

 private:
  friend class PeerGroup;
  void release();
  std::vector<void*> ptrs_;
  std::vector<int> devices_;
  size_t bytes_ = 0;
};

class PeerGroup {
 public:
  // ep_size ranks sharing one GPU.
  static PeerGroup virtual_ranks(int ep_size, int device = 0);
  // Rank r on devices[r]; enables peer access between every pair (throws if a pair cannot).
  static PeerGroup device_peers(const std::vector<int>& devices);

  int size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_.at(rank); }
  bool is_virtual() const { return is_virtual_; }

  // `bytes` on every rank, zero-filled (synchronously: call at setup, not on the hot path).
  SymmetricAllocation allocate(size_t bytes) const;

 private:
  std::vector<int> devices_;
  bool is_virtual_ = false;
};

}  // namespace mok
