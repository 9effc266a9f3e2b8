// The forward megakernel: one persistent launch per rank that pulls token rows, runs the shared and the
// routed experts' SwiGLU MLPs and pushes the expert outputs to their tokens' ranks (ForwardPath::kFused in
// include/mok/moe.h). It replaces the unfused path's stages between its two EP barriers:
//
//   shared_hidden[t] = SwiGLU(x[t] · Wg^T, x[t] · Wu^T),     shared_out[t] = shared_hidden[t] · Wd^T
//   expert_rows[r]   = x_src[token]                          (dispatch: pull from the source rank)
//   hidden[r]        = SwiGLU(expert_rows[r] · Wg_e^T, ...),  y[r] = hidden[r] · Wd_e^T
//   combined_src[token * k + slot] = y[r]                    (combine: push to the source rank)
// x [padded T, H] (symmetric), expert_rows [ring, H], hidden [ring, I], y [ring, H] (rings of macrobatch rows,
// row r at r % ring), shared_hidden [padded T, I], shared_out [padded T, H], combined [T * k, H] (symmetric).
// This file is the sequencing: roles, and which task runs next. What the tasks are, what each waits on and
// signals, is data (forward_tasks.h: phase and counter tables, walked by task_order.h); the GEMM tiles are
// src/device/gemm/expert_gemm.cuh's, the copies communication.cuh's, the task records timeline.cuh's.
//
// Roles. One CTA per SM in clusters of kClusterN, every one computing (the default, comm_ctas == 0):
//   producer warpgroup   thread 0: takes compute slots (TaskRing: the cluster shares each slot), waits for the
//                        phase's counter over the tile's rows, issues the TMA loads (load_tile). Warps 1-3:
//                        the communication (communication.cuh, run_communication_warps).
//   consumer warpgroups  wgmma + epilogue (compute_tile of the phase's GEMM), then count their 64 rows in the
//                        phase's counter for this n-block.
// With comm_ctas > 0 the first comm_ctas CTAs only communicate instead (run_communication_cta).
// Shared memory (ForwardSharedStorage): the expert GEMM's TileStorage (one type for the gate/up and down
// tiles, mainloop.cuh), or for communication CTAs 12 row slots of 16 KB in the same bytes; a ring of decoded tasks.
// Sync: counters per 64-row unit in global memory, release-add / acquire-spin with timeouts reported through
// the status word (docs/sync_protocol.md, "forward megakernel"). Tasks are handed out in topological order,
// so spinning cannot deadlock.
// Determinism: every output element is one thread's fixed-order K reduction, whatever tile, CTA, minibatch
// or macrobatch it falls in; copies are copies. The results are bitwise those of the unfused path.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cutlass/arch/reg_reconfig.h>

#include "mok/peer_group.h"
#include "mok/status.h"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/megakernel/communication.cuh"
#include "src/device/megakernel/forward_tasks.h"
#include "src/device/megakernel/task_inputs.cuh"
#include "src/device/megakernel/task_order.h"
#include "src/device/megakernel/timeline.cuh"

namespace mok::megakernel {

template <class GemmParams>
struct ForwardParams {
  GemmParams gemms[forward::kNumGemms];  // by forward::Gemm: shared gate/up (A = x, out = shared_hidden),
                                         // shared down (shared_hidden -> shared_out), expert gate/up
                                         // (expert_rows ring -> hidden ring), expert down (hidden -> y ring)
  TaskOrderShape order;       // with the forward's phase tables
  const int32_t* scheduled_rows;  // read once by each walking thread
  const int32_t* row_route;   // [capacity]
  PeerPointers x;             // every rank's symmetric x, bf16 [padded T, H]
  PeerPointers combined;      // every rank's symmetric combine buffer, bf16 [T * k, H]
  uint4* expert_rows;         // bf16 ring [ring_rows, H]
  const uint4* expert_out;    // bf16 ring [ring_rows, H] (y)
  int num_tokens;
  int top_k;
  int row_vectors;            // H * 2 / 16
  int comm_ctas;
  CounterArrays counters;     // forward::kCounters, zeroed before the launch
  int32_t* compute_ticket;    // zeroed before the launch
  int32_t* comm_ticket;       // zeroed before the launch
  int rank;
  DeviceStatus* status;
  uint64_t timeout_ns;
  Timeline timeline;
  static constexpr KernelId kKernel = KernelId::kForwardMegakernel;  // named in a timeout's report
};

enum class ForwardRole : int { kCommunication = 0, kProducer = 1, kConsumer = 2 };

// Compute CTAs use the GEMM's shared memory, communication CTAs the same bytes as row slots; plus a task
// ring that carries decoded tasks: the producer walks the task order once per slot and its consumers read
// the task (the GEMM's own slot ring stays unused).
template <class T>
struct ForwardSharedStorage {
  union {
    typename T::TileStorage gemm;
    CommSlots<T> comm_slots;
  };
  gemm::TaskRing<T::kTaskDepth, 4 * T::kConsumerWarpgroups, T::kClusterN, ComputeTask> tasks;
  CommSharedStorage<T> comm;
};

// Registers of the producer warpgroup after setmaxnreg: the GEMM's 48 leave too few for the task walker and
// four GEMMs' descriptors (ptxas spilled); the consumers keep theirs.
template <class T>
inline constexpr int kProducerRegisters = 56;

template <class T, class Params>
__device__ void run_producer(const Params& p, ForwardSharedStorage<T>& smem, typename T::Pipeline& pipeline,
                             int cta_rank) {
  static_assert(kProducerRegisters<T> * 128 + T::kConsumerRegisters * 128 * T::kConsumerWarpgroups <=
                    T::kLaunchRegisters * T::kThreads,
                "setmaxnreg redistributes the CTA's launch registers, no more");
  cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters<T>>();
  if (threadIdx.x >= 32) {  // warps 1-3 copy rows when no CTA is given to communication
    if (p.comm_ctas == 0) run_communication_warps<T>(p, smem.comm);
    return;
  }
  if (threadIdx.x != 0) return;
  const device::HandoffBound bound{p.status, p.timeout_ns, p.rank, Params::kKernel};
  auto state = cutlass::make_producer_start_state<typename T::Pipeline>();
  ComputeWalker walker(p.order, *p.scheduled_rows);
  for (int k = 0;; ++k) {
    // After a timeout (abort set) rank 0 takes kStopSlot: both CTAs of the cluster stop at this slot.
    const int32_t slot = smem.tasks.take(k, cta_rank, p.compute_ticket, bound);
    ComputeTask task;
    if (slot == gemm::kStopSlot || !walker.task_at(slot, task)) task.phase = kNoPhase;
    if (!smem.tasks.publish(k, task, bound)) break;  // hand-off gave up: stop issuing
    if (task.phase == kNoPhase) break;
    const PhaseDesc& phase = p.order.phases.phase[task.phase];
    // A failed input wait still issues the tile (in bounds, garbage): the partner CTA and both CTAs'
    // consumers already hold it, and every load issued is waited for before the CTAs exit.
    wait_for_inputs(p, phase, task);
    if (!load_tile<T>(p.gemms[phase.gemm], tile_of<T::kClusterN>(task, cta_rank), cta_rank, smem.gemm, pipeline,
                      state, bound))
      break;
  }
  gemm::producer_tail_bounded(pipeline, state, bound);
}

template <class T, class TDown, class Params>
__device__ void run_consumer(const Params& p, ForwardSharedStorage<T>& smem, typename T::Pipeline& pipeline,
                             int cta_rank) {
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
  const bool recorder = threadIdx.x == 128 && p.timeline.enabled();
  int32_t recorded = 0;  // the recorder's records
  gemm::RowsDoneSignal signal;  // this warpgroup's late completion count (used by its store leader)
  typename T::PipelineState state;
  const device::HandoffBound bound{p.status, p.timeout_ns, p.rank, Params::kKernel};
  // The consumer warpgroup's hardware barrier: the one compute_tile's epilogue syncs (NamedBarrier id
  // 1 + warpgroup), the same 128 threads.
  const int consumer_barrier = int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount) + 1 +
                               __shfl_sync(0xffffffff, (static_cast<int>(threadIdx.x) - 128) / 128, 0);
  for (int k = 0;; ++k) {
    ComputeTask task;
    const bool arrived = smem.tasks.consume(k, task, bound);  // warp-uniform (broadcast from lane 0)
    // Why: a hand-off that gave up leaves the warpgroup's four warps free to disagree; they must leave
    // together (the tile's wgmma and named barriers need all four).
    if (!device::named_barrier_all(arrived, consumer_barrier, 128)) break;
    if (task.phase == kNoPhase) break;
    const PhaseDesc& phase = p.order.phases.phase[task.phase];
    const uint64_t start = recorder ? device::global_timer_ns() : 0;
    const gemm::TileTask tile = tile_of<T::kClusterN>(task, cta_rank);
    // Why opaque: the fragment coordinates derived from the index are loop invariants; hoisted for both
    // GEMMs they outgrow the consumers' registers (ptxas spilled). Recomputing them per tile costs nothing.
    int consumer_idx;
    asm volatile("mov.u32 %0, %1;" : "=r"(consumer_idx) : "r"(static_cast<int>(threadIdx.x) - 128));
    uint64_t* rows_done = phase.signals == kNoCounter ? nullptr : p.counters.base[phase.signals];
    // Two call sites, not four: each inlined compute_tile hoists its own loop invariants into registers.
    if (forward::is_gate_up(phase.gemm))
      gemm::compute_tile<T>(p.gemms[phase.gemm], tile, smem.gemm, pipeline, state, consumer_idx, rows_done, &signal,
                            bound);
    else
      gemm::compute_tile<TDown>(p.gemms[phase.gemm], tile, smem.gemm, pipeline, state, consumer_idx, rows_done,
                                &signal, bound);
    if (recorder)
      p.timeline.record(kGemmTrack, recorded, phase.kind, start, device::global_timer_ns(), tile.row, tile.rows,
                        tile.n_block, task.expert);
  }
  if (threadIdx.x % 128 == 0) {
    signal.flush();
    // Why: the shared memory must outlive the last TMA stores' reads of it.
    cute::tma_store_wait<0>();
  }
}

template <class T, class TDown, class Params>
__global__ void __launch_bounds__(T::kThreads, 1) forward_kernel(const __grid_constant__ Params p) {
  static_assert(std::is_same_v<typename T::TileStorage, typename TDown::TileStorage> &&
                    T::kStages == TDown::kStages && T::kBlockM == TDown::kBlockM && T::kBlockN == TDown::kBlockN &&
                    T::kClusterN == TDown::kClusterN,
                "the gate/up and down GEMMs share one shared-memory layout, pipeline and cluster");
  static_assert(T::kBlockM == kTileRows, "the task order's tiles are the GEMM's m-tiles");
  extern __shared__ __align__(1024) char shared_raw[];
  auto& smem = *reinterpret_cast<ForwardSharedStorage<T>*>(shared_raw);
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);  // uniform: see compute_tile
  const ForwardRole role = static_cast<int>(blockIdx.x) < p.comm_ctas ? ForwardRole::kCommunication
                           : warpgroup == 0                            ? ForwardRole::kProducer
                                                                       : ForwardRole::kConsumer;

  // Communication CTAs build the pipeline too (unused): every CTA of the cluster takes part in its barrier.
  typename T::Pipeline pipeline = gemm::start_pipeline<T>(smem.gemm, smem.tasks, role == ForwardRole::kConsumer);
  const int cta_rank = static_cast<int>(cute::block_rank_in_cluster());
  switch (role) {
    case ForwardRole::kCommunication: run_communication_cta<T>(p, smem.comm_slots, smem.comm); break;
    case ForwardRole::kProducer: run_producer<T>(p, smem, pipeline, cta_rank); break;
    case ForwardRole::kConsumer: run_consumer<T, TDown>(p, smem, pipeline, cta_rank); break;
  }
  // Why: neither CTA may exit while its partner can still multicast into it or arrive on its barriers.
  if constexpr (T::kClusterN > 1) cute::cluster_sync();
}

}  // namespace mok::megakernel
