// The forward megakernel's communication stage (forward_kernel.cuh): 64-row dispatch and combine tasks taken
// from the communication ticket (task_order.h, comm phases of forward_tasks.h), each one waiting on a
// counter, copying the unit's rows and adding to a counter:
//
//   dispatch   expert_rows[r % ring] = x_src[token]              (pull from the token's rank; 0 for padding)
//   combine    combined_src[token * k + slot] = y[r % ring]      (push to the token's rank; padding: nothing)
// r a schedule row with row_route[r] = (src, token, slot); x [padded T, H] and combined [T * k, H] are every
// rank's symmetric buffers (peer pointers), expert_rows and y the macrobatch rings [ring_rows, H].
//
// Roles (two placements, one task loop: communication_loop):
//   copy warps           warps 1-3 of every compute CTA's producer warpgroup (FusedOptions::comm_ctas == 0):
//                        warp copies (copy_row_warp), warp w taking rows w, w + 3, ... of a unit; they meet
//                        at hardware named barrier 8
//   communication CTAs   the first comm_ctas CTAs: lane 0 of each of 12 warps bulk-copies rows through its
//                        16 KB shared-memory slot (BulkRowCopier), 12 slots in flight per CTA
// Shared memory: a communication CTA's row slots overlay the GEMM's stage buffers (CommSlots); every CTA has
// the slots' mbarriers and the group's task word (CommSharedStorage).
// Sync (docs/sync_protocol.md, "forward megakernel"): the group's leader acquires the comm phase's counter,
// the group's barrier extends it to every copying thread, which fences before its bulk loads; after the copy,
// the barrier, then the leader's fence and one release-add. Pushes to peers are released at system scope
// before the kernel's end (the EP barrier's arrive follows it).
// Determinism: every destination row has one writer and is a copy.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "mok/peer_group.h"
#include "mok/status.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/common/row_copy.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/dispatch/pull_rows.cuh"
#include "src/device/gemm/task_ring.cuh"
#include "src/device/megakernel/task_order.h"
#include "src/device/megakernel/timeline_record.h"

namespace mok::megakernel {

// Communication CTAs: each warp's lane 0 copies rows with the bulk-copy engine through its own slot.
template <class T>
struct CommTraits {
  static constexpr int kWarps = T::kThreads / 32;
  static constexpr int kSlotBytes = 16384;  // a chunk in flight per warp; rows of H > 8192 go in chunks
};

// A communication CTA's row slots, in the bytes of the (unused) GEMM stage buffers.
template <class T>
struct CommSlots {
  alignas(128) char slot[CommTraits<T>::kWarps][CommTraits<T>::kSlotBytes];
};

template <class T>
struct CommSharedStorage {
  uint64_t slot_loaded[CommTraits<T>::kWarps];  // mbarrier per slot (BulkRowCopier)
  int32_t task_word;                            // the communication group's task broadcast
};

// The communication loop of both placements: a group of threads takes 64-row tasks from the comm ticket;
// its leader waits for the task's comm phase counter; copy_unit(kind, unit) copies the rows (each thread
// ends with its copies written); the leader publishes them with one release.
//   sync(flag)  the group's barrier, returning whether any thread passed true: __syncthreads_or for a
//               communication CTA, bar.red.or on a named barrier for the producer warpgroup's copy warps
// Reads from Params: order, scheduled_rows, counters, comm_ticket, rank, status, timeout_ns, timeline, kKernel.
template <class Params, class Sync, class CopyUnit>
__device__ __forceinline__ void communication_loop(const Params& p, int32_t& task_word, bool leader, Sync sync,
                                                   CopyUnit copy_unit) {
  const int32_t scheduled_rows = *p.scheduled_rows;
  int32_t recorded = 0;  // the leader's timeline records
  while (true) {
    // After a timeout (abort set) the group takes no more tasks.
    if (leader) task_word = device::abort_bits(p.status) != 0 ? gemm::kStopSlot : atomicAdd(p.comm_ticket, 1);
    sync(false);
    if (task_word == gemm::kStopSlot) break;
    const CommTask task = comm_task_at(p.order, scheduled_rows, task_word);
    if (task.phase == kNoPhase) break;
    const CommPhaseDesc& phase = p.order.comm_phases.phase[task.phase];
    const uint64_t start = leader ? device::global_timer_ns() : 0;
    bool gave_up = false;
    if (leader && phase.waits != kNoCounter) {
      // kRingPrevious (dispatch): the ring rows this unit overwrites held the unit one macrobatch later
      // (walked earlier); its tiles read them, and its combine, which needed everything downstream, is done.
      const int32_t unit =
          phase.wait_unit == CommWait::kRingPrevious ? task.unit + p.order.ring_rows / kUnitRows : task.unit;
      if (unit * kUnitRows < scheduled_rows)
        gave_up = !device::wait_at_least(p.counters.base[phase.waits] + unit, p.counters.target[phase.waits],
                                         {p.rank, phase.role, p.counters.id[phase.waits], unit, Params::kKernel}, p.status,
                                         p.timeout_ns);
    }
    // Why: the leader's acquire covers the group once it passes the barrier; the fence then orders it before
    // this thread's bulk loads (async proxy) of rows other CTAs wrote.
    // A wait that gave up: the group skips this unit's copy (its rows would be overwritten while read, or
    // are not written yet) and stops; the unit's counter never moves, so its dependents give up too.
    if (sync(gave_up)) break;
    device::fence_proxy_async_global();
    copy_unit(phase.kind, task.unit);
    // Why: every thread's rows are written before the leader publishes them with one release.
    sync(false);
    if (leader) {
      device::fence_acq_rel_gpu();
      if (phase.signals != kNoCounter) device::add_release_gpu(p.counters.base[phase.signals] + task.unit, 1);
      p.timeline.record(kCopyTrack, recorded, phase.kind, start, device::global_timer_ns(), task.unit * kUnitRows,
                        kUnitRows, 0, 0);
    }
  }
  // Why: the barrier arrive after this kernel publishes the pushes to peers; order them at system scope.
  device::fence_acq_rel_sys();
}

// The task bodies: where row r of a dispatch or combine unit comes from and goes to (source, destination);
// a null source means nothing to copy (a padding row: dispatch zeroes it, combine leaves it).
// Reads from Params: row_route, order.ring_rows, row_vectors, expert_rows, x, expert_out, combined,
// num_tokens, top_k. (A kernel that copies other rows overloads this for its own Params.)
template <class Params>
__device__ __forceinline__ void unit_row_endpoints(const Params& p, TaskKind kind, int32_t unit, int r,
                                                   const uint4*& src, uint4*& dst) {
  const int32_t row = unit * kUnitRows + r;
  const int32_t route = p.row_route[row];
  const int64_t ring_offset = int64_t(row % p.order.ring_rows) * p.row_vectors;
  if (kind == TaskKind::kDispatch) {
    dst = p.expert_rows + ring_offset;
    src = route < 0 ? nullptr : dispatch::source_row(p.x, route, p.num_tokens, p.top_k, p.row_vectors);
  } else {
    src = route < 0 ? nullptr : p.expert_out + ring_offset;
    dst = route < 0 ? nullptr : combine::destination_row(p.combined, route, p.num_tokens, p.top_k, p.row_vectors);
  }
}

// A communication CTA (FusedOptions::comm_ctas > 0): each warp's lane 0 bulk-copies its rows (warp w: rows w,
// w + 12, ...) through its 16 KB slot, as many whole rows at a time as fit (H <= 4096: two or more), so a CTA
// keeps 12 slots of rows in flight; padding rows are zeroed by the warp's stores.
template <class T, class Params>
__device__ void run_communication_cta(const Params& p, CommSlots<T>& slots, CommSharedStorage<T>& smem) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kWarps = CommTraits<T>::kWarps;
  const int row_bytes = p.row_vectors * 16;
  // Whole rows per slot when they fit more than one (H <= 4096), else one row (in chunks when H > 8192).
  const int rows_per_batch = row_bytes * 2 <= CommTraits<T>::kSlotBytes ? CommTraits<T>::kSlotBytes / row_bytes : 1;
  if (lane == 0) device::mbarrier_init(&smem.slot_loaded[warp], 1);
  // Why: the barrier init must be visible to the async proxy (the bulk copies complete on it).
  cutlass::arch::fence_barrier_init();
  device::BulkRowCopier copier{slots.slot[warp], &smem.slot_loaded[warp], CommTraits<T>::kSlotBytes,
                               {p.status, p.timeout_ns, p.rank, Params::kKernel}, warp};
  auto copy_unit = [&](TaskKind kind, int32_t unit) {
    if (kind == TaskKind::kDispatch) {
      for (int r = warp; r < kUnitRows; r += kWarps) {
        const uint4* src;
        uint4* dst;
        unit_row_endpoints(p, kind, unit, r, src, dst);
        if (src == nullptr) device::zero_row_warp(dst, p.row_vectors, lane);
      }
    }
    if (lane != 0) return;
    const Role role = kind == TaskKind::kDispatch ? Role::kDispatch : Role::kCombine;
    if (rows_per_batch == 1) {  // rows of 8 KB and more: one at a time, in slot-sized chunks
      for (int r = warp; r < kUnitRows; r += kWarps) {
        const uint4* src;
        uint4* dst;
        unit_row_endpoints(p, kind, unit, r, src, dst);
        if (src != nullptr) copier.copy(src, dst, row_bytes, role);
      }
    } else {  // smaller rows: a batch of whole rows fills the slot (loads, one wait, stores)
      for (int first = warp; first < kUnitRows; first += kWarps * rows_per_batch) {
        copier.begin();
        for (int b = 0, r = first; b < rows_per_batch && r < kUnitRows; ++b, r += kWarps) {
          const uint4* src;
          uint4* dst;
          unit_row_endpoints(p, kind, unit, r, src, dst);
          if (src != nullptr) copier.load(src, row_bytes, b * row_bytes);
        }
        copier.loaded(role);  // a give-up (recorded) stores what the slot holds; the group stops at its next task
        for (int b = 0, r = first; b < rows_per_batch && r < kUnitRows; ++b, r += kWarps) {
          const uint4* src;
          uint4* dst;
          unit_row_endpoints(p, kind, unit, r, src, dst);
          if (src != nullptr) copier.store(dst, row_bytes, b * row_bytes);
        }
      }
    }
    copier.finish();  // this warp's stores are written
  };
  communication_loop(p, smem.task_word, threadIdx.x == 0, [](bool flag) { return __syncthreads_or(flag) != 0; },
                     copy_unit);
}

// The producer warpgroup's three warps besides the TMA issuer (FusedOptions::comm_ctas == 0: no CTA is
// given to communication): warp copies (copy_row_warp), warp w of 3 taking rows w, w + 3, ... of a unit.
template <class T, class Params>
__device__ void run_communication_warps(const Params& p, CommSharedStorage<T>& smem) {
  // Hardware barrier 8: CUTLASS NamedBarrier ids 1 and 2 of the consumer warpgroups are hardware 9 and 10.
  // (Through NamedBarrier::sync, id 8 was hardware 16, which the SASS showed wrapped to barrier 0.)
  constexpr int kCopyWarps = 3, kBarrierId = 8;
  const int warp = static_cast<int>(threadIdx.x) / 32 - 1, lane = static_cast<int>(threadIdx.x) % 32;
  auto copy_unit = [&](TaskKind kind, int32_t unit) {
    for (int r = warp; r < kUnitRows; r += kCopyWarps) {
      const uint4* src;
      uint4* dst;
      unit_row_endpoints(p, kind, unit, r, src, dst);
      if (src != nullptr)
        device::copy_row_warp(src, dst, p.row_vectors, lane);
      else if (kind == TaskKind::kDispatch)
        device::zero_row_warp(dst, p.row_vectors, lane);
    }
  };
  communication_loop(p, smem.task_word, threadIdx.x == 32,
                     [](bool flag) { return device::named_barrier_any(flag, kBarrierId, 32 * kCopyWarps); }, copy_unit);
}

}  // namespace mok::megakernel
