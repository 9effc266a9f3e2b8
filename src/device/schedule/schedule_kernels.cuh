// GPU schedule: from the top-k ids of every rank to this rank's expert-major row map.
//
//   gather_topk_kernel   (on each source rank)  ids[T][k] -> every peer's gathered[parity][src][T*k]
//                                               (a call's T' <= T tokens: the routes past T' * k are -1)
//   count_chunks_kernel  (on each expert rank)  wait for ids; route_slot[s][q], chunk_counts[s][c][e]; own_ids
//   scan_experts_kernel  (one CTA)              per-(expert, source) prefixes, padded segment offsets,
//                                               capacity check, epoch += 1
//   place_routes_kernel                          row_route[row] = global route id, -1 for padding
//
// Roles and warps: gather and place are plain grid-stride kernels; count runs one warp per (chunk, source)
// (the warp walks its chunk in 32 steps; __match_any_sync ranks equal experts inside a step); scan is one
// CTA looping over experts. Shared memory: count keeps a per-expert histogram (local_experts int32).
//
// Sync protocol (docs/sync_protocol.md): each gather CTA writes its ids to every peer, fences at system
// scope, and adds 1 (release) to peer.topk_arrived[src]. A rank's count kernel waits (acquire, timeout) for
// topk_arrived[src] >= (epoch + 1) * gather CTAs. Ids sit in parity epoch % 2, so a peer one build ahead
// never overwrites ids still being read. The epoch lives in the rank's own memory and moves in the scan
// kernel, after the last read of the ids: the whole sequence is CUDA-graph replayable.
//
// Determinism: counts use integer atomics in shared memory only for totals; every position comes from the
// lane order inside a warp step, the step order inside a chunk and prefix sums over chunks and sources.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "mok/peer_group.h"
#include "mok/routing.h"
#include "mok/status.h"
#include "src/device/common/status.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/schedule/placement.h"

namespace mok::schedule {

struct GatherTraits {
  static constexpr int kThreads = 256;
  static constexpr int kRoutesPerThread = 8;
  static constexpr int kRoutesPerCta = kThreads * kRoutesPerThread;
};

// Number of gather CTAs: both the pushing and the waiting rank derive it from the shape.
MOK_HOST_DEVICE int gather_ctas(int64_t routes_per_rank) {
  return static_cast<int>((routes_per_rank + GatherTraits::kRoutesPerCta - 1) / GatherTraits::kRoutesPerCta);
}

// Byte layout of the symmetric gather buffer of one rank.
struct GatherLayout {
  static constexpr int64_t kArrivedBytes = int64_t(kMaxEpSize) * sizeof(uint64_t);
  MOK_HOST_DEVICE static int64_t bytes(int ep_size, int64_t routes_per_rank) {
    return kArrivedBytes + 2 * int64_t(ep_size) * routes_per_rank * int64_t(sizeof(int32_t));
  }
  MOK_HOST_DEVICE static uint64_t* topk_arrived(void* base) { return static_cast<uint64_t*>(base); }
  MOK_HOST_DEVICE static int32_t* gathered(void* base, int parity, int ep_size, int64_t routes_per_rank) {
    return reinterpret_cast<int32_t*>(static_cast<char*>(base) + kArrivedBytes) +
           int64_t(parity) * ep_size * routes_per_rank;
  }
};

// Everything the schedule kernels of one rank read or write.
struct ScheduleParams {
  int rank;
  int ep_size;
  int num_tokens;
  int top_k;
  int num_experts;
  int local_experts;
  int tile_m;
  int64_t routes_per_rank;
  uint64_t timeout_ns;
  ScheduleLayout layout;
  int32_t* schedule;       // base of the rank's ScheduleLayout buffers
  void* gather_base;       // this rank's symmetric gather buffer
  uint64_t* epoch;         // builds completed by this rank (its own memory)
  DeviceStatus* status;
};

template <typename Index>
__global__ void __launch_bounds__(GatherTraits::kThreads)
    gather_topk_kernel(const Index* __restrict__ topk, int64_t valid_routes, PeerPointers gather_peers,
                       ScheduleParams p) {
  const int parity = static_cast<int>(*p.epoch & 1);
  const int64_t begin = int64_t(blockIdx.x) * GatherTraits::kRoutesPerCta;
  for (int peer = 0; peer < p.ep_size; ++peer) {
    int32_t* dst = GatherLayout::gathered(gather_peers.base[peer], parity, p.ep_size, p.routes_per_rank) +
                   int64_t(p.rank) * p.routes_per_rank;
#pragma unroll
    for (int i = 0; i < GatherTraits::kRoutesPerThread; ++i) {
      const int64_t q = begin + int64_t(i) * GatherTraits::kThreads + threadIdx.x;
      if (q >= p.routes_per_rank) break;
      // Routes of the tokens a call did not pass (a call of fewer than num_tokens tokens) are masked.
      dst[q] = q < valid_routes ? saturate_id(static_cast<int64_t>(topk[q])) : kNoRoute;
    }
  }
  // Why: the peer's count kernel reads these ids after acquiring topk_arrived; every thread's stores must
  // be ordered before the one release below.
  device::fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int peer = 0; peer < p.ep_size; ++peer)
      device::add_release_sys(GatherLayout::topk_arrived(gather_peers.base[peer]) + p.rank, 1);
  }
}

// One warp per (chunk, source). Shared memory: int32 histogram[local_experts].
__global__ void __launch_bounds__(32) count_chunks_kernel(ScheduleParams p) {
  extern __shared__ int32_t histogram[];
  const int src = blockIdx.y;
  const int64_t chunk = blockIdx.x;
  const int lane = threadIdx.x;

  const uint64_t epoch = *p.epoch;
  const int32_t* ids = GatherLayout::gathered(p.gather_base, static_cast<int>(epoch & 1), p.ep_size,
                                              p.routes_per_rank) + int64_t(src) * p.routes_per_rank;
  const uint64_t expected = (epoch + 1) * uint64_t(gather_ctas(p.routes_per_rank));
  const device::WaitSite site{p.rank, Role::kScheduleCount, CounterId::kTopkArrived, src, KernelId::kSchedule};
  const bool arrived = lane == 0 ? device::wait_at_least(GatherLayout::topk_arrived(p.gather_base) + src,
                                                         expected, site, p.status, p.timeout_ns)
                                 : true;
  const bool all_arrived = __shfl_sync(0xffffffffu, arrived ? 1 : 0, 0);
  // Why: lane 0's acquire covers the ids for lane 0 only; the warp barrier extends the ordering to the
  // other lanes of the warp (CTA-scope morally strong synchronization).
  __syncwarp();
  if (src == p.rank) {
    // This rank's own ids, kept with the schedule for the combine's check of a later call's topk_idx. Copied
    // after a failed wait too (then the ids of this rank's own gather, earlier in its stream, when one ran).
    for (int64_t q = chunk * kChunkRoutes + lane; q < p.routes_per_rank && q < (chunk + 1) * kChunkRoutes; q += 32)
      p.schedule[p.layout.own_ids + q] = ids[q];
  }
  if (!all_arrived) {
    // The ids never came (or an earlier wait timed out): this chunk counts as empty, so the schedule the
    // later kernels build stays consistent and in bounds instead of mixing in a previous build's counts.
    for (int64_t q = chunk * kChunkRoutes + lane; q < p.routes_per_rank && q < (chunk + 1) * kChunkRoutes; q += 32)
      p.schedule[p.layout.route_slot + int64_t(src) * p.routes_per_rank + q] = kNoRoute;
    int32_t* counts =
        p.schedule + p.layout.chunk_counts + (int64_t(src) * p.layout.num_chunks + chunk) * p.local_experts;
    for (int e = lane; e < p.local_experts; e += 32) counts[e] = 0;
    return;
  }

  for (int e = lane; e < p.local_experts; e += 32) histogram[e] = 0;
  __syncwarp();

  int32_t* route_slot = p.schedule + p.layout.route_slot + int64_t(src) * p.routes_per_rank;
  const uint32_t lanes_below = (1u << lane) - 1u;
  for (int step = 0; step < kChunkRoutes / 32; ++step) {
    const int64_t q = chunk * kChunkRoutes + step * 32 + lane;
    int32_t local = -1;
    if (q < p.routes_per_rank) {
      const int32_t id = ids[q];
      if (!is_valid_expert_id(id, p.num_experts))
        device::record_bad_expert_id(p.status, int64_t(src) * p.routes_per_rank + q, id);
      local = local_expert_of(id, p.rank, p.local_experts, p.num_experts);
    }
    // Lanes with equal experts: rank by lane order, the lowest lane bumps the histogram.
    const uint32_t same = __match_any_sync(0xffffffffu, local);
    if (local >= 0) {
      const int32_t rank_in_chunk = histogram[local] + __popc(same & lanes_below);
      route_slot[q] = pack_route_slot(local, rank_in_chunk);
      // Why: every lane of the group reads the count before its lowest lane bumps it; a warp is not in
      // lockstep under independent thread scheduling (racecheck reported the write-after-read hazard).
      __syncwarp(same);
      if ((same & lanes_below) == 0) histogram[local] += __popc(same);
    } else if (q < p.routes_per_rank) {
      route_slot[q] = kNoRoute;
    }
    __syncwarp();
  }
  int32_t* counts = p.schedule + p.layout.chunk_counts + (int64_t(src) * p.layout.num_chunks + chunk) * p.local_experts;
  for (int e = lane; e < p.local_experts; e += 32) counts[e] = histogram[e];
}

struct ScanTraits {
  static constexpr int kThreads = 256;
};

// One CTA: per-(expert, source) totals and chunk prefixes, padded segment offsets, capacity check.
__global__ void __launch_bounds__(ScanTraits::kThreads) scan_experts_kernel(ScheduleParams p) {
  using BlockScan = cub::BlockScan<int64_t, ScanTraits::kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int64_t carry;
  const ScheduleLayout& l = p.layout;
  int32_t* chunk_counts = p.schedule + l.chunk_counts;
  int32_t* src_counts = p.schedule + l.expert_src_counts;
  int32_t* expert_counts = p.schedule + l.expert_counts;
  int32_t* row_offsets = p.schedule + l.expert_row_offsets;

  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < p.local_experts; base += ScanTraits::kThreads) {
    const int e = base + threadIdx.x;
    int64_t padded = 0;
    if (e < p.local_experts) {
      int64_t expert_total = 0;
      for (int src = 0; src < p.ep_size; ++src) {
        int32_t running = 0;  // exclusive prefix over the chunks of (src, e), in chunk order
        for (int64_t c = 0; c < l.num_chunks; ++c) {
          int32_t* cell = chunk_counts + (int64_t(src) * l.num_chunks + c) * p.local_experts + e;
          const int32_t count = *cell;
          *cell = running;
          running += count;
        }
        src_counts[int64_t(e) * p.ep_size + src] = running;
        expert_total += running;
      }
      expert_counts[e] = static_cast<int32_t>(expert_total);
      padded = round_up(expert_total, p.tile_m);
    }
    int64_t offset, tile_total;
    BlockScan(scan_storage).ExclusiveSum(padded, offset, tile_total);
    if (e < p.local_experts) row_offsets[e] = static_cast<int32_t>(carry + offset);
    __syncthreads();  // every thread has read carry before it moves
    if (threadIdx.x == 0) carry += tile_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int64_t rows_needed = carry;
    row_offsets[p.local_experts] = static_cast<int32_t>(rows_needed);
    const bool fits = rows_needed <= l.capacity_rows;
    p.schedule[l.scheduled_rows] = fits ? static_cast<int32_t>(rows_needed) : 0;
    // The status word is sticky (include/mok/status.h): the first overflow since the reset keeps its numbers.
    if (!fits && (atomicOr(&p.status->error_bits, kStatusCapacityOverflow) & kStatusCapacityOverflow) == 0) {
      p.status->rows_needed = rows_needed;
      p.status->rows_capacity = l.capacity_rows;
    }
    // The ids of this epoch's parity are no longer read after the count kernel: the next gather may reuse it.
    *p.epoch += 1;
  }
}

struct PlaceTraits {
  static constexpr int kThreads = 256;
};

// Writes every row of row_route exactly once: real rows by their route, the rest as padding; and every entry of
// route_row once (its inverse).
__global__ void __launch_bounds__(PlaceTraits::kThreads) place_routes_kernel(ScheduleParams p) {
  const ScheduleLayout& l = p.layout;
  const int32_t* route_slots = p.schedule + l.route_slot;
  const int32_t* chunk_prefix = p.schedule + l.chunk_counts;
  const int32_t* src_counts = p.schedule + l.expert_src_counts;
  const int32_t* expert_counts = p.schedule + l.expert_counts;
  const int32_t* row_offsets = p.schedule + l.expert_row_offsets;
  int32_t* row_route = p.schedule + l.row_route;
  int32_t* route_row = p.schedule + l.route_row;
  const int32_t scheduled_rows = p.schedule[l.scheduled_rows];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;

  // Every route's entry of route_row, placed or not (nothing is placed after an overflow).
  const int64_t total_routes = int64_t(p.ep_size) * p.routes_per_rank;
  for (int64_t g = first; g < total_routes; g += stride) {
    const int32_t slot = route_slots[g];
    if (scheduled_rows == 0 || slot == kNoRoute) {
      route_row[g] = kNoRoute;
      continue;
    }
    const int src = static_cast<int>(g / p.routes_per_rank);
    const int64_t chunk = (g % p.routes_per_rank) / kChunkRoutes;
    const int32_t e = slot_expert(slot);
    const int64_t index = chunk_prefix[(int64_t(src) * l.num_chunks + chunk) * p.local_experts + e] + slot_rank(slot);
    const int64_t row = row_offsets[e] + interleaved_offset(src_counts + int64_t(e) * p.ep_size, p.ep_size, src, index);
    row_route[row] = static_cast<int32_t>(g);
    route_row[g] = static_cast<int32_t>(row);
  }
  for (int64_t row = first; row < l.capacity_rows; row += stride) {
    bool padding = row >= scheduled_rows;
    if (!padding) {
      const int32_t e = expert_of_row(row_offsets, p.local_experts, row);
      padding = row - row_offsets[e] >= expert_counts[e];
    }
    if (padding) row_route[row] = kNoRoute;
  }
}

}  // namespace mok::schedule
