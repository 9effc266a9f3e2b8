// The persistent megakernel skeleton, written once for the forward (forward_kernel.cuh) and the backward
// (backward_kernel.cuh): the parameters both read, the shared memory, the role switch, the pipeline start, the
// producer's and the consumers' task loops and the teardown. A pass supplies a task set (below); its kernel is
// one line, run_megakernel<Tasks>(p).
//
// Roles: one CTA per SM in clusters of T::kClusterN, every one computing (the default, comm_ctas == 0):
//   producer warpgroup   thread 0 takes compute slots (TaskRing: the cluster shares each slot), decodes them
//                        (Tasks::Walker over the pass's phase tables, task_order.h), waits for the phase's
//                        counter over the task's rows and issues the tile's TMA loads; warps 1-3 copy rows
//                        (run_copy_warps, communication.cuh).
//   consumer warpgroups  wgmma + epilogue of the phase's GEMM, which counts the stored rows in the phase's
//                        counter; the first consumer thread records the tile in the timeline.
// With comm_ctas > 0 the first comm_ctas CTAs only copy rows (Tasks::run_communication_cta).
// Sync: counters per 64-row unit in global memory, release-add / acquire-spin with timeouts reported through
// the status word (docs/sync_protocol.md). Tasks are handed out in topological order: spinning cannot deadlock.
//
// A task set (ForwardTasks, BackwardTasks) provides:
//   T                          the traits of the pipeline, shared memory and cluster every tile kind runs on
//   kProducerRegisters, kConsumerRegisters   the setmaxnreg budgets
//   kClaimAhead                rank 0 claims the next slot before the current task's waits and loads
//   Walker                     the task order's walker (ComputeWalker, BackwardWalker)
//   kKeptRowWaits              the producer waits by wait_for_backward_inputs (kept rows, verified units), else
//                              by wait_for_inputs
//   load(p, phase, task, cta_rank, smem, pipeline, state, bound)    producer thread: false if it gave up
//   compute(p, phase, task, cta_rank, smem, pipeline, state, consumer_idx, rows_done, signal, bound)
//                              consumers: one tile; returns what the timeline records of it
//   copy_rows(p, kind, unit, warp, warps, lane)                     a copy warp's rows of a unit
//   run_communication_cta(p, smem)   optional: a communication CTA (default: all its warps run copy_rows)
#pragma once

#include <cstdint>

#include <cutlass/arch/reg_reconfig.h>

#include "mok/status.h"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/mainloop.cuh"
#include "src/device/gemm/task_ring.cuh"
#include "src/device/gemm/tile_task.cuh"
#include "src/device/megakernel/communication.cuh"
#include "src/device/megakernel/task_order.h"
#include "src/device/megakernel/timeline.cuh"

namespace mok::megakernel {

// What every megakernel reads besides its GEMM descriptors and its copies' buffers: its task order (with its
// tables), the schedule, its counters and tickets, where waits report, the timeline. Embedded as `common` in
// the passes' parameters (ForwardParams, BackwardParams), filled by one host function (src/host/megakernel_launch.h).
struct MegakernelParams {
  TaskOrderShape order;           // with the pass's phase tables
  const int32_t* scheduled_rows;  // read once by each walking thread
  const int32_t* row_route;       // [capacity]
  int num_tokens;
  int top_k;
  int row_vectors;                // H * 2 / 16
  int comm_ctas;
  CounterArrays counters;         // the pass's kCounters, zeroed before the launch
  int32_t* compute_ticket;        // zeroed before the launch
  int32_t* comm_ticket;           // zeroed before the launch
  int rank;
  DeviceStatus* status;
  uint64_t timeout_ns;
  Timeline timeline;
};

enum class MegakernelRole : int { kCommunication = 0, kProducer = 1, kConsumer = 2 };

// Compute CTAs use the GEMM's shared memory, communication CTAs may use the same bytes as row slots (the
// forward's bulk copies); plus a task ring that carries decoded tasks: the producer walks the task order once
// per slot and its consumers read the task (the GEMM's own slot ring stays unused).
template <class T>
struct MegakernelSharedStorage {
  union {
    typename T::TileStorage gemm;
    CommSlots<T> comm_slots;
  };
  gemm::TaskRing<T::kTaskDepth, 4 * T::kConsumerWarpgroups, T::kClusterN, ComputeTask> tasks;
  CommSharedStorage<T> comm;
};

// What the timeline records of a GEMM task besides its kind and expert (Tasks::compute returns it).
struct TileRecord {
  int32_t row;
  int32_t rows;
  int32_t n_block;
};

// A row GEMM's task as this CTA's tile: CTA c of the cluster takes n-block kClusterN * n_group + c.
template <int kClusterN>
__device__ __forceinline__ gemm::TileTask tile_of(const ComputeTask& t, int cta_rank) {
  return gemm::TileTask{t.row, t.buffer_row, t.rows, t.n_group, t.expert}.template for_cta<kClusterN>(cta_rank);
}

// Producer thread: waits until every 64-row unit of the task's rows [row, row + rows) is complete in the
// phase's counter (a row tile's A rows; a weight-gradient tile's whole expert segment).
// Reads p.common (counters, rank, status, timeout_ns) and Params::kKernel.
template <class Params>
__device__ __forceinline__ void wait_for_inputs(const Params& p, const PhaseDesc& phase, const ComputeTask& t) {
  if (phase.waits == kNoCounter) return;  // inputs complete before the launch
  const MegakernelParams& c = p.common;
  const uint64_t* counter = c.counters.base[phase.waits];
  for (int32_t unit = t.row / kUnitRows; unit * kUnitRows < t.row + t.rows; ++unit)
    device::wait_at_least(counter + unit, c.counters.target[phase.waits],
                          {c.rank, Role::kGemmProducer, c.counters.id[phase.waits], unit, Params::kKernel}, c.status,
                          c.timeout_ns);
  // Why: the TMA loads that follow read, through the async proxy, rows the acquire above made visible.
  device::fence_proxy_async_global();
}

// The units a producer thread has already seen complete on one counter (counts only grow): the next task
// over the same rows, e.g. an expert's next weight-gradient tile, waits for nothing.
struct VerifiedUnits {
  int8_t counter = kNoCounter;
  int32_t first = 0, end = 0;
  __device__ __forceinline__ bool covers(int8_t c, int32_t unit) const {
    return c == counter && unit >= first && unit < end;
  }
};

// Producer thread of the backward megakernel: as wait_for_inputs, but a tile's units below the order's
// recompute_from wait on the phase's waits_kept counter (counter_awaited), and units this thread already
// saw complete (`verified`: a weight-gradient tile waits for its expert's whole segment, and an expert has
// hundreds of such tiles) are not read again. The acquire and the proxy fence of the earlier wait precede
// this task's loads in this thread's program order.
template <class Params>
__device__ __forceinline__ void wait_for_backward_inputs(const Params& p, const PhaseDesc& phase, const ComputeTask& t,
                                                         VerifiedUnits& verified) {
  const MegakernelParams& m = p.common;
  const int32_t first = t.row / kUnitRows, end = (t.row + t.rows + kUnitRows - 1) / kUnitRows;
  bool waited = false, complete = true;
  for (int32_t unit = first; unit < end; ++unit) {
    const int8_t c = counter_awaited(phase, m.order, unit);
    if (c == kNoCounter || verified.covers(c, unit)) continue;
    complete &= device::wait_at_least(m.counters.base[c] + unit, m.counters.target[c],
                                      {m.rank, Role::kGemmProducer, m.counters.id[c], unit, Params::kKernel}, m.status,
                                      m.timeout_ns);
    waited = true;
  }
  if (!waited) return;
  if (complete && phase.waits == phase.waits_kept) verified = {phase.waits, first, end};
  // Why: the TMA loads that follow read, through the async proxy, rows the acquires above made visible.
  device::fence_proxy_async_global();
}

template <class Tasks, class Params, class T = typename Tasks::T>
__device__ __forceinline__ void run_megakernel_producer(const Params& p, MegakernelSharedStorage<T>& smem,
                                                        typename T::Pipeline& pipeline, int cta_rank) {
  const MegakernelParams& c = p.common;
  static_assert(Tasks::kProducerRegisters * 128 + Tasks::kConsumerRegisters * 128 * T::kConsumerWarpgroups <=
                    T::kLaunchRegisters * T::kThreads,
                "setmaxnreg redistributes the CTA's launch registers, no more");
  cutlass::arch::warpgroup_reg_dealloc<Tasks::kProducerRegisters>();
  if (threadIdx.x >= 32) {  // warps 1-3 copy rows when no CTA is given to communication
    if (c.comm_ctas == 0) run_copy_warps<Tasks>(p, smem.comm.task_word);
    return;
  }
  if (threadIdx.x != 0) return;
  const device::HandoffBound bound{c.status, c.timeout_ns, c.rank, Params::kKernel};
  auto state = cutlass::make_producer_start_state<typename T::Pipeline>();
  typename Tasks::Walker walker(c.order, *c.scheduled_rows);
  VerifiedUnits verified;  // the units the producer saw complete (kKeptRowWaits: not awaited again)
  // With kClaimAhead rank 0 claims each next slot before the current task's waits and loads: a short tile (a
  // weight gradient's of a few k-blocks) takes about as long as an atomic's round trip, which would otherwise
  // stall every task.
  int32_t claimed = 0;
  if constexpr (Tasks::kClaimAhead) claimed = cta_rank == 0 ? smem.tasks.claim(c.compute_ticket, bound) : 0;
  for (int k = 0;; ++k) {
    // After a timeout (abort set) rank 0 takes kStopSlot: both CTAs of the cluster stop at this slot.
    int32_t slot;
    if constexpr (Tasks::kClaimAhead)
      slot = smem.tasks.share(k, cta_rank, claimed, bound);
    else
      slot = smem.tasks.take(k, cta_rank, c.compute_ticket, bound);
    ComputeTask task;
    if (slot == gemm::kStopSlot || !walker.task_at(slot, task)) task.phase = kNoPhase;
    if (!smem.tasks.publish(k, task, bound)) break;  // hand-off gave up: stop issuing
    if (task.phase == kNoPhase) break;
    if constexpr (Tasks::kClaimAhead)
      if (cta_rank == 0) claimed = smem.tasks.claim(c.compute_ticket, bound);
    const PhaseDesc& phase = c.order.phases.phase[task.phase];
    // A failed input wait still issues the tile (in bounds, garbage): the partner CTA and both CTAs'
    // consumers already hold it, and every load issued is waited for before the CTAs exit.
    if constexpr (Tasks::kKeptRowWaits)
      wait_for_backward_inputs(p, phase, task, verified);
    else
      wait_for_inputs(p, phase, task);
    if (!Tasks::load(p, phase, task, cta_rank, smem.gemm, pipeline, state, bound)) break;
  }
  gemm::producer_tail_bounded(pipeline, state, bound);
}

template <class Tasks, class Params, class T = typename Tasks::T>
__device__ __forceinline__ void run_megakernel_consumer(const Params& p, MegakernelSharedStorage<T>& smem,
                                                        typename T::Pipeline& pipeline, int cta_rank) {
  const MegakernelParams& c = p.common;
  cutlass::arch::warpgroup_reg_alloc<Tasks::kConsumerRegisters>();
  const bool recorder = threadIdx.x == 128 && c.timeline.enabled();
  int32_t recorded = 0;  // the recorder's records
  gemm::RowsDoneSignal signal;  // this warpgroup's late completion count (used by its store leader)
  typename T::PipelineState state;
  const device::HandoffBound bound{c.status, c.timeout_ns, c.rank, Params::kKernel};
  // The consumer warpgroup's hardware barrier: the one compute_tile's epilogue syncs (NamedBarrier id
  // 1 + warpgroup), the same 128 threads.
  const int consumer_barrier = int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount) + 1 +
                               __shfl_sync(0xffffffff, (static_cast<int>(threadIdx.x) - 128) / 128, 0);
  for (int k = 0;; ++k) {
    ComputeTask task;
    const bool arrived = smem.tasks.consume(k, task, bound);  // warp-uniform (broadcast from lane 0)
    // Why: a hand-off that gave up leaves the warpgroup's four warps free to disagree; they must leave
    // together (the tile's wgmma and named barriers need all four). The barrier also orders the previous
    // tile's plain stores (the backward's d_rw partials) before the late count its store leader adds next.
    if (!device::named_barrier_all(arrived, consumer_barrier, 128)) break;
    if (task.phase == kNoPhase) break;
    const PhaseDesc& phase = c.order.phases.phase[task.phase];
    const uint64_t start = recorder ? device::global_timer_ns() : 0;
    // Why opaque: the fragment coordinates derived from the index are loop invariants; hoisted for every
    // GEMM they outgrow the consumers' registers (ptxas spilled). Recomputing them per tile costs nothing.
    int consumer_idx;
    asm volatile("mov.u32 %0, %1;" : "=r"(consumer_idx) : "r"(static_cast<int>(threadIdx.x) - 128));
    uint64_t* rows_done = phase.signals == kNoCounter ? nullptr : c.counters.base[phase.signals];
    const TileRecord tile = Tasks::compute(p, phase, task, cta_rank, smem.gemm, pipeline, state, consumer_idx,
                                           rows_done, signal, bound);
    if (recorder)
      c.timeline.record(kGemmTrack, recorded, phase.kind, start, device::global_timer_ns(), tile.row, tile.rows,
                        tile.n_block, task.expert);
  }
  if (threadIdx.x % 128 == 0) {
    signal.flush();
    // Why: the shared memory must outlive the last TMA stores' reads of it.
    cute::tma_store_wait<0>();
  }
}

// The kernel body: a switch over the roles.
template <class Tasks, class Params>
__device__ __forceinline__ void run_megakernel(const Params& p) {
  using T = typename Tasks::T;
  static_assert(T::kBlockM == kTileRows, "the task order's tiles are the GEMM's m-tiles");
  static_assert(sizeof(CommSlots<T>) <= sizeof(typename T::TileStorage), "the row slots lie in the GEMM's bytes");
  extern __shared__ __align__(1024) char shared_raw[];
  auto& smem = *reinterpret_cast<MegakernelSharedStorage<T>*>(shared_raw);
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);  // uniform: see compute_tile
  const MegakernelRole role = static_cast<int>(blockIdx.x) < p.common.comm_ctas ? MegakernelRole::kCommunication
                              : warpgroup == 0                                   ? MegakernelRole::kProducer
                                                                                 : MegakernelRole::kConsumer;

  // Communication CTAs build the pipeline too (unused): every CTA of the cluster takes part in its barrier.
  typename T::Pipeline pipeline = gemm::start_pipeline<T>(smem.gemm, smem.tasks, role == MegakernelRole::kConsumer);
  const int cta_rank = static_cast<int>(cute::block_rank_in_cluster());
  switch (role) {
    case MegakernelRole::kCommunication:
      if constexpr (requires { Tasks::run_communication_cta(p, smem); })
        Tasks::run_communication_cta(p, smem);
      else
        run_copy_cta<Tasks>(p, smem.comm.task_word);
      break;
    case MegakernelRole::kProducer: run_megakernel_producer<Tasks>(p, smem, pipeline, cta_rank); break;
    case MegakernelRole::kConsumer: run_megakernel_consumer<Tasks>(p, smem, pipeline, cta_rank); break;
  }
  // Why: neither CTA may exit while its partner can still multicast into it or arrive on its barriers.
  if constexpr (T::kClusterN > 1) cute::cluster_sync();
}

}  // namespace mok::megakernel
