// Device-side barrier over the EP group: unicast peer stores and per-source counters (no multicast).
//
// Symmetric buffer of each rank (BarrierLayout): arrived[kMaxEpSize] u64, then the rank-local `passed`
// counter (barriers this rank has completed; only the owner touches it).
//   barrier_arrive_kernel  (1 warp)  fence.acq_rel.sys, then arrived[rank] += 1 (release, system scope) on
//                                    every peer, the rank itself included
//   barrier_wait_kernel    (1 warp)  lane src waits (acquire, timeout) for own arrived[src] >= passed + 1;
//                                    then passed += 1
// Arrive and wait are separate launches so virtual ranks can issue every rank's arrive before any rank's
// wait on one stream. Counters only grow; `passed` moves in the wait kernel, so graph replays work.
// Protocol table: docs/sync_protocol.md.
#pragma once

#include <cstdint>

#include "mok/peer_group.h"
#include "mok/status.h"
#include "src/device/common/host_device.h"
#include "src/device/common/sync.cuh"

namespace mok::device {

struct BarrierLayout {
  MOK_HOST_DEVICE static constexpr int64_t bytes() { return (int64_t(kMaxEpSize) + 1) * sizeof(uint64_t); }
  MOK_HOST_DEVICE static uint64_t* arrived(void* base) { return static_cast<uint64_t*>(base); }
  MOK_HOST_DEVICE static uint64_t* passed(void* base) { return static_cast<uint64_t*>(base) + kMaxEpSize; }
};

struct BarrierParams {
  PeerPointers flags;  // every rank's barrier buffer
  int rank;
  int ep_size;
  DeviceStatus* status;
  uint64_t timeout_ns;
};

__global__ void __launch_bounds__(32) barrier_arrive_kernel(BarrierParams p) {
  // Why: the stage kernels before this one in the stream wrote to peers (combine) or to this rank's
  // symmetric buffers (publish); a system-scope fence orders those writes before the releases below.
  fence_acq_rel_sys();
  for (int peer = threadIdx.x; peer < p.ep_size; peer += 32)
    add_release_sys(BarrierLayout::arrived(p.flags.base[peer]) + p.rank, 1);
}

__global__ void __launch_bounds__(32) barrier_wait_kernel(BarrierParams p) {
  void* own = p.flags.base[p.rank];
  const uint64_t target = *BarrierLayout::passed(own) + 1;
  for (int src = threadIdx.x; src < p.ep_size; src += 32) {
    const WaitSite site{p.rank, Role::kBarrier, CounterId::kBarrierArrived, src, KernelId::kBarrier};
    wait_at_least(BarrierLayout::arrived(own) + src, target, site, p.status, p.timeout_ns);
  }
  // Why: each lane acquired its sources' writes; the warp barrier extends that to lane 0, and the kernel
  // boundary to the kernels after this one.
  __syncwarp();
  if (threadIdx.x == 0) *BarrierLayout::passed(own) = target;
}

}  // namespace mok::device
