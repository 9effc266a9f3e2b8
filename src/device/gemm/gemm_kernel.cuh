// The standalone persistent GEMM kernel: one body for the expert GEMM (expert_gemm.cuh, tasks kRowTiles) and the
// weight-gradient GEMM (weight_grad_gemm.cuh, tasks kKGrouped; also with AnyWeightGradParams, the megakernel's
// configuration, output mode chosen at run time), behind two names that profiles and tools tell apart. Used by
// the unfused forward, the stage-kernel backward, the tests and the bench.
// Roles (one CTA per SM, in clusters of T::kClusterN; 1 producer warpgroup + T::kConsumerWarpgroups):
//   producer   thread 0 takes slots from the atomic ticket (rank 1 of a cluster gets rank 0's by mail: TaskRing),
//              decodes them (T::Walker), publishes them and issues the tiles' TMA loads (load_tile); in a
//              row-gathering configuration (RowGatherTraits) the whole warpgroup gathers A (row_gather.cuh).
//   consumers  compute the published tasks (compute_tile, mainloop.cuh).
// Shared memory: T::SharedStorage. Sync: docs/sync_protocol.md, "Inside one kernel"; every wait is bounded.
// Determinism: results do not depend on which CTA takes which slot (each tile is one CTA's fixed-order K loop).
#pragma once

#include <cstdint>

#include <cutlass/arch/reg_reconfig.h>

#include "src/device/common/sync.cuh"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/gemm/mainloop.cuh"
#include "src/device/gemm/row_gather.cuh"
#include "src/device/gemm/weight_grad_gemm.cuh"

namespace mok::gemm {

enum class GemmRole : int { kProducer = 0, kConsumer = 1 };

// The standalone GEMM kernels' second parameter: where their hand-offs report and how long they may take
// (every wait of the kernel is bounded: docs/sync_protocol.md), and a test knob.
struct StandaloneWaits {
  device::HandoffBound bound;
  // Test entry (honoured only in builds with MOK_TEST_ENTRIES, src/host/gemm_test_knobs.h): each CTA's
  // producer arms the first stage of its first tile and issues none of its loads, so its consumers' wait for
  // the stage's bytes must time out (a stalled producer).
  bool stall_producer;
};

// The stalled producer of a test (StandaloneWaits::stall_producer): arms `state`'s stage, so its consumers
// wait for its transaction bytes, and loads nothing. The producer then returns without its tail: the consumers'
// wait must be the one that times out (a tail would wait for their release of this stage as long), and the
// CTA stays alive for their releases anyway (its threads, and the final cluster_sync for the partner's).
template <class Pipeline, class State>
__device__ __forceinline__ void stall_stage(Pipeline& pipeline, State& state, const device::HandoffBound& bound) {
  if (producer_acquire_bounded(pipeline, state, bound)) ++state;
}

// Producer thread: slots from the ticket until one lies past the last task, published like the others so that
// the consumers stop on it. Once the rank's abort word is set the slot is kStopSlot (a failed step does no more
// work), and a hand-off that gave up ends the loop (its consumers' waits give up too: kAbortHandoff).
template <class T, class Params>
__device__ __forceinline__ void run_gemm_producer(const Params& p, const StandaloneWaits& waits,
                                                  typename T::SharedStorage& smem, typename T::Pipeline& pipeline,
                                                  int cta_rank) {
  using Walker = typename T::Walker;
  auto state = cutlass::make_producer_start_state<typename T::Pipeline>();
  Walker walker;
  int32_t claimed = 0;
  if constexpr (Walker::kClaimAhead) claimed = cta_rank == 0 ? smem.tasks.claim(p.ticket, waits.bound) : 0;
  for (int k = 0;; ++k) {
    int32_t slot;
    if constexpr (Walker::kClaimAhead)
      slot = smem.tasks.share(k, cta_rank, claimed, waits.bound);
    else
      slot = smem.tasks.take(k, cta_rank, p.ticket, waits.bound);
    typename Walker::Task task;
    const bool more = walker.task_at(p, slot, task);
    if (!smem.tasks.publish(k, Walker::payload(more, slot, task), waits.bound) || !more) break;
    // The next slot's atomic goes out before this tile's loads: its latency hides behind them (the thread
    // waits for the value only at the next task_at).
    if constexpr (Walker::kClaimAhead)
      if (cta_rank == 0) claimed = smem.tasks.claim(p.ticket, waits.bound);
#if defined(MOK_TEST_ENTRIES)
    if (waits.stall_producer) {  // no tail: see stall_stage
      stall_stage(pipeline, state, waits.bound);
      return;
    }
#endif
    if constexpr (kTilePasses<T> > 1) {  // a task of several tiles along n, loaded in turn (SwiGLUQuantEpilogue)
      const TileTask cta_task = task.template for_cta<T::kClusterN>(cta_rank);
      const int passes = T::Epilogue::passes(p, cta_task);
      bool loaded = true;
      for (int pass = 0; pass < passes && loaded; ++pass)
        loaded = load_tile<T>(p, T::Epilogue::pass_task(cta_task, pass), cta_rank, smem, pipeline, state, waits.bound);
      if (!loaded) break;
    } else if (!load_tile<T>(p, task.template for_cta<T::kClusterN>(cta_rank), cta_rank, smem, pipeline, state,
                             waits.bound)) {
      break;
    }
  }
  // Why: neither CTA may exit while its consumers, or the partner CTA's, still release stages into it.
  producer_tail_bounded(pipeline, state, waits.bound);
}

// Producer warpgroup of a gathering configuration (row_gather.cuh): thread 0 takes and decodes the slots as
// run_gemm_producer does (its walker and the decoded tasks in shared memory: RowGatherTasks); all four warps
// read each published entry back from the task ring (as consumer warps do, counted in its empty barriers) and
// gather the tile together. A give-up anywhere ends the loop in every thread at once (the named barriers
// reduce it). No stall_producer test knob here.
template <class T, class Params>
__device__ __forceinline__ void run_gather_producer(const Params& p, const StandaloneWaits& waits,
                                                    typename T::SharedStorage& smem, typename T::Pipeline& pipeline,
                                                    int thread_idx) {
  using Walker = typename T::Walker;
  static_assert(!Walker::kClaimAhead && T::kClusterN == 1, "row tiles, one CTA per tile");
  auto state = cutlass::make_producer_start_state<typename T::Pipeline>();
  for (int k = 0;; ++k) {
    const int q = k % T::Collective::kTaskDepth;
    if (thread_idx == 0) {
      TileTask decoded;
      const int32_t slot = smem.tasks.take(k, 0, p.ticket, waits.bound);
      const bool more = smem.tasks.walker.task_at(p, slot, decoded);
      smem.tasks.decoded[q] = decoded;
      // A publish that gave up leaves entry k empty: the reads below give up too.
      smem.tasks.publish(k, Walker::payload(more, slot, decoded), waits.bound);
    }
    __syncwarp();
    typename Walker::Payload payload;
    const bool arrived = smem.tasks.consume(k, payload, waits.bound);
    if (!device::named_barrier_all(arrived, T::kGatherBarrier, T::kGatherThreads)) break;
    if (payload == kStopSlot) break;  // what payload() publishes past the last task
    const TileTask task = smem.tasks.decoded[q];
    const bool gathered = gather_tile<T>(p, task, smem, pipeline, state, thread_idx, waits.bound);
    if (!device::named_barrier_all(gathered, T::kGatherBarrier, T::kGatherThreads)) break;
  }
  // Why: no thread leaves with copies in flight into stages its consumers still read.
  cute::cp_async_wait<0>();
  // Why: as run_gemm_producer's tail.
  if (thread_idx == 0) producer_tail_bounded(pipeline, state, waits.bound);
}

// Consumer threads: the published tasks until "no more", or until a task-ring wait gave up (the warpgroup's
// four warps agree first, as the megakernels' consumers do). With p.trace (the expert GEMM's, optional): per
// tile the consumer's start and end (globaltimer), SM id, SM cycles and the task.
template <class T, class Params>
__device__ __forceinline__ void run_gemm_consumers(const Params& p, const device::HandoffBound& bound,
                                                   typename T::SharedStorage& smem, typename T::Pipeline& pipeline,
                                                   int cta_rank, int consumer_idx) {
  using Walker = typename T::Walker;
  typename T::PipelineState state;
  Walker walker;
  typename Walker::Task task;
  // The warpgroup's hardware barrier: the one the epilogue syncs (NamedBarrier kStagingBarrier + warpgroup),
  // the same 128 threads.
  const int consumer_barrier = int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount) + T::kStagingBarrier +
                               __shfl_sync(0xffffffff, consumer_idx / 128, 0);
  for (int k = 0;; ++k) {
    typename Walker::Payload payload;
    const bool arrived = smem.tasks.consume(k, payload, bound);  // warp-uniform
    // Why: a hand-off that gave up leaves the warpgroup's warps free to disagree; they must leave together
    // (the tile's wgmma and named barriers need all four).
    if (!device::named_barrier_all(arrived, consumer_barrier, 128)) break;
    if (!walker.consumer_task(p, payload, task)) break;
    bool record = false;
    if constexpr (requires { p.trace; }) record = p.trace != nullptr && consumer_idx == 0;
    const uint64_t start = record ? device::global_timer_ns() : 0;
    const int64_t start_cycles = record ? clock64() : 0;
    compute_tile<T>(p, task.template for_cta<T::kClusterN>(cta_rank), smem, pipeline, state, consumer_idx, nullptr,
                    nullptr, bound);
    if constexpr (requires { p.trace; }) {
      if (record) {
        uint64_t* r = p.trace + (int64_t(payload) * T::kClusterN + cta_rank) * 4;
        r[0] = start;
        r[1] = device::global_timer_ns();
        r[2] = static_cast<uint64_t>(device::sm_index()) | (uint64_t(clock64() - start_cycles) << 16);
        r[3] = (uint64_t(task.expert) << 48) | (uint64_t(task.n_block) << 32) | uint32_t(task.row);
      }
    }
  }
  // Why: the shared memory must outlive the last TMA stores' reads of it.
  if (consumer_idx % 128 == 0) cute::tma_store_wait<0>();
  // Why: a scattering GEMM's rows went to peers' combine buffers by every thread's TMA stores; the barrier
  // arrive after the kernel releases them at system scope once they are written (row_scatter.cuh).
  if constexpr (ScattersRows<Params>) {
    device::bulk_stores_written();
    device::fence_acq_rel_sys();
  }
}

// f(TraitsTag<T>{}, p): the parameters as they are...
template <class T, class Params, class F>
__device__ __forceinline__ void with_traits(const Params& p, F&& f) {
  f(TraitsTag<T>{}, p);
}
// ... or, for AnyWeightGradParams, as the output mode they hold (every mode: the same storage and pipeline).
template <class T, class F>
__device__ __forceinline__ void with_traits(const AnyWeightGradParams& p, F&& f) {
  visit_weight_grad(p, [&](auto traits, const auto& params) {
    using TM = typename decltype(traits)::type;
    static_assert(std::is_same_v<typename TM::SharedStorage, typename T::SharedStorage> &&
                      std::is_same_v<typename TM::Pipeline, typename T::Pipeline>,
                  "every output mode runs in the kernel's storage and pipeline");
    f(traits, params);
  });
}

// The kernel body: a switch over the roles.
template <class T, class Params>
__device__ __forceinline__ void run_standalone_gemm(const Params& p, const StandaloneWaits& waits) {
  extern __shared__ __align__(1024) char shared_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(shared_raw);
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);  // uniform: see compute_tile
  const GemmRole role = warpgroup == 0 ? GemmRole::kProducer : GemmRole::kConsumer;
  typename T::Pipeline pipeline = start_pipeline<T>(smem, smem.tasks, role == GemmRole::kConsumer);
  // Without a cluster the rank is the constant 0: the task ring's mail paths compile away.
  const int cta_rank = T::kClusterN > 1 ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
  switch (role) {
    case GemmRole::kProducer:
      cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
      if constexpr (GathersRows<T>)
        run_gather_producer<T>(p, waits, smem, pipeline, static_cast<int>(threadIdx.x));
      else if (threadIdx.x == 0)
        with_traits<T>(p, [&](auto traits, const auto& params) {
          run_gemm_producer<typename decltype(traits)::type>(params, waits, smem, pipeline, cta_rank);
        });
      break;
    case GemmRole::kConsumer:
      cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
      with_traits<T>(p, [&](auto traits, const auto& params) {
        run_gemm_consumers<typename decltype(traits)::type>(params, waits.bound, smem, pipeline, cta_rank,
                                                            static_cast<int>(threadIdx.x) - 128);
      });
      break;
  }
  // Why: neither CTA may exit while its partner can still multicast into it or arrive on its barriers.
  if constexpr (T::kClusterN > 1) cute::cluster_sync();
}

template <class T, class Params>
__global__ void __launch_bounds__(T::kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ Params p, const __grid_constant__ StandaloneWaits waits) {
  run_standalone_gemm<T>(p, waits);
}

// T: the weight gradient's traits; with AnyWeightGradParams, WeightGradTraitsInGemmLayout of any mode.
template <class T, class Params>
__global__ void __launch_bounds__(T::kThreads, 1)
    weight_grad_gemm_kernel(const __grid_constant__ Params p, const __grid_constant__ StandaloneWaits waits) {
  run_standalone_gemm<T>(p, waits);
}

}  // namespace mok::gemm
