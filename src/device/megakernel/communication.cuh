// The megakernels' communication (megakernel.cuh): 64-row copy tasks taken from the communication ticket
// (task_order.h, the comm phases of a pass's tables), each one waiting on a counter, copying the unit's rows
// and adding to a counter. What a unit's rows are is the pass's (its task set's copy_rows).
// Placements, one task loop (communication_loop): the producer warpgroup's warps 1-3 of every compute CTA
// (run_copy_warps, hardware named barrier 8), or the first comm_ctas CTAs (run_copy_cta: all warps; the
// forward's bulk-copies rows through CommSlots, 16 KB per warp in the GEMM's stage bytes).
// Sync (docs/sync_protocol.md): the group's leader acquires the comm phase's counter, the group's barrier
// extends it to every copying thread, which fences before its bulk loads; after the copy, the barrier, then
// the leader's fence and one release-add. Pushes to peers are released at system scope before the kernel's
// end (the EP barrier's arrive follows it).
// Determinism: every destination row has one writer and is a copy.
#pragma once

#include <cstdint>

#include "mok/status.h"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/task_ring.cuh"
#include "src/device/megakernel/task_order.h"
#include "src/device/megakernel/timeline_record.h"

namespace mok::megakernel {

// A communication CTA's row slots, in the bytes of the (unused) GEMM stage buffers: each warp's lane 0 copies
// rows with the bulk-copy engine through its own (the forward's communication CTAs).
template <class T>
struct CommSlots {
  static constexpr int kWarps = T::kThreads / 32;
  static constexpr int kSlotBytes = 16384;  // a chunk in flight per warp; rows of H > 8192 go in chunks
  alignas(128) char slot[kWarps][kSlotBytes];
};

template <class T>
struct CommSharedStorage {
  uint64_t slot_loaded[CommSlots<T>::kWarps];  // mbarrier per slot (BulkRowCopier)
  int32_t task_word;                            // the communication group's task broadcast
};

// The communication loop of both placements: a group of threads takes 64-row tasks from the comm ticket;
// its leader waits for the task's comm phase counter; copy_unit(kind, unit) copies the rows (each thread
// ends with its copies written); the leader publishes them with one release.
//   sync(flag)  the group's barrier, returning whether any thread passed true: __syncthreads_or for a
//               communication CTA, bar.red.or on a named barrier for the producer warpgroup's copy warps
// Reads p.common (MegakernelParams: order, scheduled_rows, counters, comm_ticket, rank, status, timeout_ns,
// timeline) and Params::kKernel.
template <class Params, class Sync, class CopyUnit>
__device__ __forceinline__ void communication_loop(const Params& p, int32_t& task_word, bool leader, Sync sync,
                                                   CopyUnit copy_unit) {
  const auto& c = p.common;
  const int32_t scheduled_rows = *c.scheduled_rows;
  int32_t recorded = 0;  // the leader's timeline records
  while (true) {
    // After a timeout (abort set) the group takes no more tasks.
    if (leader) task_word = device::abort_bits(c.status) != 0 ? gemm::kStopSlot : atomicAdd(c.comm_ticket, 1);
    sync(false);
    if (task_word == gemm::kStopSlot) break;
    const CommTask task = comm_task_at(c.order, scheduled_rows, task_word);
    if (task.phase == kNoPhase) break;
    const CommPhaseDesc& phase = c.order.comm_phases.phase[task.phase];
    const uint64_t start = leader ? device::global_timer_ns() : 0;
    bool gave_up = false;
    if (leader && phase.waits != kNoCounter) {
      // kRingPrevious (dispatch): the ring rows this unit overwrites held the unit one macrobatch later
      // (walked earlier); its tiles read them, and its combine, which needed everything downstream, is done.
      const int32_t unit =
          phase.wait_unit == CommWait::kRingPrevious ? task.unit + c.order.ring_rows / kUnitRows : task.unit;
      if (unit * kUnitRows < scheduled_rows)
        gave_up = !device::wait_at_least(c.counters.base[phase.waits] + unit, c.counters.target[phase.waits],
                                         {c.rank, phase.role, c.counters.id[phase.waits], unit, Params::kKernel},
                                         c.status, c.timeout_ns);
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
      if (phase.signals != kNoCounter) device::add_release_gpu(c.counters.base[phase.signals] + task.unit, 1);
      c.timeline.record(kCopyTrack, recorded, phase.kind, start, device::global_timer_ns(), task.unit * kUnitRows,
                        kUnitRows, 0, 0);
    }
  }
  // Why: the barrier arrive after this kernel publishes the pushes to peers; order them at system scope.
  device::fence_acq_rel_sys();
}

// The producer warpgroup's three warps besides the TMA issuer (FusedOptions::comm_ctas == 0: no CTA is given
// to communication): Tasks::copy_rows(p, kind, unit, warp, warps, lane) copies warp `warp` of `warps`' rows of
// a unit (rows warp, warp + warps, ...).
template <class Tasks, class Params>
__device__ __forceinline__ void run_copy_warps(const Params& p, int32_t& task_word) {
  // Hardware barrier 8: CUTLASS NamedBarrier ids 1 and 2 of the consumer warpgroups are hardware 9 and 10.
  // (Through NamedBarrier::sync, id 8 was hardware 16, which the SASS showed wrapped to barrier 0.)
  constexpr int kCopyWarps = 3, kBarrierId = 8;
  const int warp = static_cast<int>(threadIdx.x) / 32 - 1, lane = static_cast<int>(threadIdx.x) % 32;
  communication_loop(p, task_word, threadIdx.x == 32,
                     [](bool flag) { return device::named_barrier_any(flag, kBarrierId, 32 * kCopyWarps); },
                     [&](TaskKind kind, int32_t unit) { Tasks::copy_rows(p, kind, unit, warp, kCopyWarps, lane); });
}

// A communication CTA (FusedOptions::comm_ctas > 0) whose T::kThreads / 32 warps all run Tasks::copy_rows.
template <class Tasks, class Params>
__device__ __forceinline__ void run_copy_cta(const Params& p, int32_t& task_word) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  communication_loop(p, task_word, threadIdx.x == 0, [](bool flag) { return __syncthreads_or(flag) != 0; },
                     [&](TaskKind kind, int32_t unit) {
                       Tasks::copy_rows(p, kind, unit, warp, Tasks::T::kThreads / 32, lane);
                     });
}

}  // namespace mok::megakernel
