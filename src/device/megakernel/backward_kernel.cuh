// The backward megakernel: one persistent launch per rank for the whole backward between its two EP barriers
// (FusedOptions::backward_megakernel; the twin of the stage kernels in src/host/moe_backward.cu; docs/design.md,
// "The backward megakernel"):
//
//   pull        d_out_rows[r] = d_out_src[token], dy_rows[r] = bf16(rw * d_out_src[token]), row_weight[r] = rw,
//               x_rows[r] (when the context keeps fewer rows than the capacity)      (comm, from the token's rank)
//   recompute   g | u and h of the rows the context does not keep                    (SwiGLU GEMM, B K-major)
//   down dgrad  d_hu = d_out · W_down_e; d_g | d_u from the kept g, u; d_rw partials  (B MN-major)
//   gate/up     d_x_route = [d_g, d_u] · [W_gate_e; W_up_e]                           (B MN-major)
//   push        d_x_route rows -> combined_src[token * k + slot], d_rw -> d_rw_src     (comm, to the token's rank)
//   wgrad       dW_down_e = Σ dyᵀ h, dW_gate/up_e = Σ [d_g, d_u]ᵀ x over the expert's rows (k-grouped GEMMs)
// and the same for the shared expert over the rank's own tokens (row weight 1, no communication). All buffers
// are capacity-sized scratch (BackwardScratch); the epilogue after the closing barrier sums d_x.
// This file is the sequencing: roles, and which task runs next. The task order is data (backward_tasks.h,
// walked by task_order.h); the tiles are expert_gemm.cuh's and weight_grad_gemm.cuh's, run on one pipeline and
// one shared-memory type (mainloop.cuh's GemmSharedStorage: every tile kind's TileStorage is the same);
// the row copies are grad_rows.cuh's; the loop that hands them out is communication.cuh's.
//
// Roles, as the forward megakernel's (forward_kernel.cuh): one CTA per SM in clusters of kClusterN;
//   producer warpgroup   thread 0 takes compute slots (TaskRing), waits for the phase's counter over the task's
//                        rows (a weight-gradient tile: its expert's whole segment), issues the tile's TMA loads.
//                        Warps 1-3 copy rows (comm_ctas == 0).
//   consumer warpgroups  wgmma + epilogue of the phase's GEMM; row GEMMs count their 64 rows in the phase's
//                        counter per stored n-block. Weight-gradient tiles signal nothing (read after the launch).
// With comm_ctas > 0 the first comm_ctas CTAs only copy rows (all their warps, warp copies).
// Shared memory: the GEMM tiles' TileStorage (one type for every tile kind: static_asserts here and in
// src/host/weight_grad_params.h), a ring of decoded tasks, the communication group's words.
// Sync: docs/sync_protocol.md, "Inside the backward megakernel". Tasks are handed out in topological order.
// Determinism: every output element is one thread's fixed-order K reduction, the same tiles and k-block order
// as the unfused stage kernels, whatever CTA, minibatch or placement runs it; copies are copies; d_rw is the
// n-block partials summed in ascending order. The results are bitwise those of the unfused backward.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cutlass/arch/reg_reconfig.h>

#include "mok/peer_group.h"
#include "mok/status.h"
#include "src/device/backward/grad_rows.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/gemm/weight_grad_gemm.cuh"
#include "src/device/megakernel/backward_tasks.h"
#include "src/device/megakernel/communication.cuh"
#include "src/device/megakernel/task_inputs.cuh"
#include "src/device/megakernel/task_order.h"
#include "src/device/megakernel/timeline.cuh"

namespace mok::megakernel {

// Descriptors by MLP (0: the shared expert, 1: the routed experts).
template <class RecomputeGemm, class DgradGemm, class WeightGradGemm>
struct BackwardParams {
  RecomputeGemm recompute[2];          // A = x rows -> h, g | u (rows the context does not keep)
  DgradGemm down_dgrad[2];             // A = d_out rows -> d_g | d_u, d_rw partials
  DgradGemm gate_up_dgrad[2];          // A = d_g | d_u -> d_x rows
  WeightGradGemm down_wgrad[2];        // a = dy rows, b = h
  WeightGradGemm gate_up_wgrad[2];     // a = d_g | d_u, b = x rows
  TaskOrderShape order;                // with the backward's phase tables
  const int32_t* scheduled_rows;       // read once by each walking thread
  const int32_t* row_route;            // [capacity]
  ::mok::backward::GradPullSources pull;
  uint4* x_rows;                       // bf16 [capacity, H], or null (the context keeps every row)
  uint4* d_out_rows;                   // bf16 [capacity, H]
  uint4* dy_rows;                      // bf16 [capacity, H]
  float* row_weight;                   // fp32 [capacity]
  ::mok::backward::GradPushDestinations push;
  const uint4* d_x_rows;               // bf16 [capacity, H] (d_out_rows' bytes: the gate/up dgrad's output)
  const float* row_partials;           // fp32 [capacity, n_blocks]
  int n_blocks;                        // of the down dgrad: d_rw partials per row
  int num_tokens;
  int top_k;
  int row_vectors;                     // H * 2 / 16
  int comm_ctas;
  CounterArrays counters;              // backward::kCounters, zeroed before the launch
  int32_t* compute_ticket;             // zeroed before the launch
  int32_t* comm_ticket;                // zeroed before the launch
  int rank;
  DeviceStatus* status;
  uint64_t timeout_ns;
  Timeline timeline;
  static constexpr KernelId kKernel = KernelId::kBackwardMegakernel;  // named in a timeout's report
};

enum class BackwardRole : int { kCommunication = 0, kProducer = 1, kConsumer = 2 };

template <class T>
struct BackwardSharedStorage {
  typename T::TileStorage gemm;
  gemm::TaskRing<T::kTaskDepth, 4 * T::kConsumerWarpgroups, T::kClusterN, ComputeTask> tasks;
  CommSharedStorage<T> comm;
};

// Which MLP a GEMM of backward::Gemm belongs to (0: the shared expert, 1: the routed experts), and the
// weight-gradient descriptor of a kWeightGrad phase's GEMM.
MOK_HOST_DEVICE constexpr int mlp_of(int gemm) { return gemm < backward::kExpertRecompute ? 0 : 1; }

template <class Params>
__device__ __forceinline__ const gemm::AnyWeightGradParams& weight_grad_of(const Params& p, int gemm) {
  const bool down = gemm == backward::kSharedDownWgrad || gemm == backward::kExpertDownWgrad;
  return down ? p.down_wgrad[mlp_of(gemm)] : p.gate_up_wgrad[mlp_of(gemm)];
}

// A weight-gradient task as this CTA's tile: n-block kClusterN * n_group + c, K = the segment's rows.
template <class TG, int kClusterN>
__device__ __forceinline__ gemm::GradTileTask grad_tile_of(const ComputeTask& t, int cta_rank) {
  return gemm::grad_tile_task<TG>(t.expert, t.m_block, t.n_group, t.row, t.rows).template for_cta<kClusterN>(cta_rank);
}

// The rows of one 64-row unit, copied by `warps` warps (warp w: rows w, w + warps, ...).
template <class Params>
__device__ __forceinline__ void copy_grad_unit(const Params& p, TaskKind kind, int32_t unit, int warp, int warps,
                                               int lane) {
  for (int r = warp; r < kUnitRows; r += warps) {
    const int64_t row = int64_t(unit) * kUnitRows + r;
    const int32_t route = p.row_route[row];
    const int64_t at = row * p.row_vectors;
    if (kind == TaskKind::kPullGrad) {
      const ::mok::backward::GradPullRow dst{p.x_rows != nullptr ? p.x_rows + at : nullptr, p.d_out_rows + at,
                                             p.dy_rows + at, p.row_weight + row};
      ::mok::backward::pull_grad_row(p.pull, dst, row, route, p.num_tokens, p.top_k, p.row_vectors, lane);
    } else {
      ::mok::backward::push_grad_row(p.push, p.d_x_rows + at, p.row_partials + row * p.n_blocks, p.n_blocks, route,
                                     p.num_tokens, p.top_k, p.row_vectors, lane);
    }
  }
}

// Row copies: a communication CTA's 12 warps (comm_ctas > 0), or a compute CTA's producer warps 1-3.
template <class T, class Params>
__device__ void run_backward_communication(const Params& p, CommSharedStorage<T>& smem, bool whole_cta) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (whole_cta) {
    const int warp = static_cast<int>(threadIdx.x) / 32;
    communication_loop(p, smem.task_word, threadIdx.x == 0, [](bool flag) { return __syncthreads_or(flag) != 0; },
                       [&](TaskKind kind, int32_t unit) { copy_grad_unit(p, kind, unit, warp, T::kThreads / 32, lane); });
  } else {
    // Hardware barrier 8, as the forward's copy warps (communication.cuh, run_communication_warps).
    constexpr int kCopyWarps = 3, kBarrierId = 8;
    const int warp = static_cast<int>(threadIdx.x) / 32 - 1;
    communication_loop(p, smem.task_word, threadIdx.x == 32,
                       [](bool flag) { return device::named_barrier_any(flag, kBarrierId, 32 * kCopyWarps); },
                       [&](TaskKind kind, int32_t unit) { copy_grad_unit(p, kind, unit, warp, kCopyWarps, lane); });
  }
}

// Registers after setmaxnreg. The producer warpgroup's thread 0 walks the backward's longer task order and
// issues three kinds of loads, its copy warps pull and scale rows: at the forward's 56 ptxas spilled both.
// The consumers give up 8 of the GEMM's 224 (no spills at 216).
template <class T>
inline constexpr int kBackwardProducerRegisters = 72;
template <class T>
inline constexpr int kBackwardConsumerRegisters = T::kConsumerRegisters - 8;

template <class TRecompute, class TDown, class T, class Params>
__device__ __forceinline__ void run_backward_producer(const Params& p, BackwardSharedStorage<T>& smem, typename T::Pipeline& pipeline,
                                      int cta_rank) {
  static_assert(kBackwardProducerRegisters<T> * 128 + kBackwardConsumerRegisters<T> * 128 * T::kConsumerWarpgroups <=
                    T::kLaunchRegisters * T::kThreads,
                "setmaxnreg redistributes the CTA's launch registers, no more");
  cutlass::arch::warpgroup_reg_dealloc<kBackwardProducerRegisters<T>>();
  if (threadIdx.x >= 32) {
    if (p.comm_ctas == 0) run_backward_communication<T>(p, smem.comm, false);
    return;
  }
  if (threadIdx.x != 0) return;
  const device::HandoffBound bound{p.status, p.timeout_ns, p.rank, Params::kKernel};
  auto state = cutlass::make_producer_start_state<typename T::Pipeline>();
  BackwardWalker walker(p.order, *p.scheduled_rows);
  VerifiedUnits verified;
  // Rank 0 claims each next slot before the current task's waits and loads: a weight-gradient tile of a few
  // k-blocks takes about as long as an atomic's round trip, which would otherwise stall every task.
  int32_t claimed = cta_rank == 0 ? smem.tasks.claim(p.compute_ticket, bound) : 0;
  for (int k = 0;; ++k) {
    const int32_t slot = smem.tasks.share(k, cta_rank, claimed, bound);
    ComputeTask task;
    if (slot == gemm::kStopSlot || !walker.task_at(slot, task)) task.phase = kNoPhase;
    if (!smem.tasks.publish(k, task, bound)) break;
    if (task.phase == kNoPhase) break;
    if (cta_rank == 0) claimed = smem.tasks.claim(p.compute_ticket, bound);
    const PhaseDesc& phase = p.order.phases.phase[task.phase];
    wait_for_backward_inputs(p, phase, task, verified);  // a failed wait still issues the tile (see forward_kernel.cuh)
    const int mlp = mlp_of(phase.gemm);
    bool issued;
    switch (backward::gemm_kind(phase.gemm)) {
      case backward::GemmKind::kRecompute:
        issued = gemm::load_tile<TRecompute>(p.recompute[mlp], tile_of<T::kClusterN>(task, cta_rank), cta_rank,
                                             smem.gemm, pipeline, state, bound);
        break;
      case backward::GemmKind::kDownDgrad:
      case backward::GemmKind::kGateUpDgrad: {  // one mainloop policy: one load path for both
        const auto& g = backward::gemm_kind(phase.gemm) == backward::GemmKind::kDownDgrad ? p.down_dgrad[mlp]
                                                                                             : p.gate_up_dgrad[mlp];
        issued = gemm::load_tile<T>(g, tile_of<T::kClusterN>(task, cta_rank), cta_rank, smem.gemm, pipeline, state,
                                    bound);
        break;
      }
      default:
        issued = gemm::visit_weight_grad(weight_grad_of(p, phase.gemm), [&](auto traits, const auto& w) {
          using TG = typename decltype(traits)::type;
          return gemm::load_tile<TG>(w, grad_tile_of<TG, T::kClusterN>(task, cta_rank), cta_rank,
                                          smem.gemm, pipeline, state, bound);
        });
    }
    if (!issued) break;
  }
  gemm::producer_tail_bounded(pipeline, state, bound);
}

// Consumer side of one weight-gradient tile in output mode kOutput.
template <GradOutput kOutput, class T>
__device__ __forceinline__ void run_grad_tile(const gemm::AnyWeightGradParams& w, const ComputeTask& task,
                                              BackwardSharedStorage<T>& smem, typename T::Pipeline& pipeline,
                                              typename T::PipelineState& state, int consumer_idx, int cta_rank,
                                              const device::HandoffBound& bound, gemm::RowsDoneSignal& signal) {
  using TG = gemm::WeightGradTraitsInGemmLayout<kOutput>;
  gemm::compute_tile<TG>(w.params<kOutput>(), grad_tile_of<TG, T::kClusterN>(task, cta_rank), smem.gemm, pipeline,
                         state, consumer_idx, nullptr, &signal, bound);
}

template <class TRecompute, class TDown, class T, class Params>
__device__ __forceinline__ void run_backward_consumer(const Params& p, BackwardSharedStorage<T>& smem, typename T::Pipeline& pipeline,
                                      int cta_rank) {
  cutlass::arch::warpgroup_reg_alloc<kBackwardConsumerRegisters<T>>();
  const bool recorder = threadIdx.x == 128 && p.timeline.enabled();
  int32_t recorded = 0;  // the recorder's records
  gemm::RowsDoneSignal signal;
  typename T::PipelineState state;
  const device::HandoffBound bound{p.status, p.timeout_ns, p.rank, Params::kKernel};
  const int consumer_barrier = int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount) + 1 +
                               __shfl_sync(0xffffffff, (static_cast<int>(threadIdx.x) - 128) / 128, 0);
  for (int k = 0;; ++k) {
    ComputeTask task;
    const bool arrived = smem.tasks.consume(k, task, bound);
    // Why: the warpgroup's four warps leave together (see forward_kernel.cuh). This barrier also orders the
    // previous tile's plain stores (the d_rw partials) before the late count its store leader adds below.
    if (!device::named_barrier_all(arrived, consumer_barrier, 128)) break;
    if (task.phase == kNoPhase) break;
    const PhaseDesc& phase = p.order.phases.phase[task.phase];
    const uint64_t start = recorder ? device::global_timer_ns() : 0;
    int consumer_idx;  // opaque: see forward_kernel.cuh
    asm volatile("mov.u32 %0, %1;" : "=r"(consumer_idx) : "r"(static_cast<int>(threadIdx.x) - 128));
    uint64_t* rows_done = phase.signals == kNoCounter ? nullptr : p.counters.base[phase.signals];
    const int mlp = mlp_of(phase.gemm);
    const backward::GemmKind kind = backward::gemm_kind(phase.gemm);
    if (kind == backward::GemmKind::kRecompute) {
      gemm::compute_tile<TRecompute>(p.recompute[mlp], tile_of<T::kClusterN>(task, cta_rank),
                                     smem.gemm, pipeline, state, consumer_idx, rows_done,
                                     &signal, bound);
    } else if (kind == backward::GemmKind::kDownDgrad) {
      gemm::compute_tile<TDown>(p.down_dgrad[mlp], tile_of<T::kClusterN>(task, cta_rank), smem.gemm,
                                pipeline, state, consumer_idx, rows_done, &signal, bound);
      // Why: the d_rw partials are plain stores of several threads, read by another CTA (the push) after the
      // late count of these rows; each writer's fence, then the next task's barrier, then the leader's release.
      device::fence_acq_rel_gpu();
    } else if (kind == backward::GemmKind::kGateUpDgrad) {
      gemm::compute_tile<T>(p.gate_up_dgrad[mlp], tile_of<T::kClusterN>(task, cta_rank), smem.gemm, pipeline, state,
                            consumer_idx, rows_done, &signal, bound);
    } else {
      // A weight-gradient tile signals nothing; the previous row tile's late count goes out inside it. One
      // call site per output mode, spelled out (a generic lambda's call was not inlined: ptxas serialized
      // every wgmma of the kernel, C7510).
      const gemm::AnyWeightGradParams& w = weight_grad_of(p, phase.gemm);
      if (w.output == GradOutput::kBFloat16)
        run_grad_tile<GradOutput::kBFloat16, T>(w, task, smem, pipeline, state, consumer_idx, cta_rank, bound, signal);
      else if (w.output == GradOutput::kFloat32)
        run_grad_tile<GradOutput::kFloat32, T>(w, task, smem, pipeline, state, consumer_idx, cta_rank, bound, signal);
      else
        run_grad_tile<GradOutput::kAccumulateFloat32, T>(w, task, smem, pipeline, state, consumer_idx, cta_rank, bound,
                                                         signal);
    }
    // A weight-gradient tile is recorded by its m-block (as its row) and n-block; a row tile by its rows.
    const bool grad_tile = kind == backward::GemmKind::kWeightGrad;
    if (recorder)
      p.timeline.record(kGemmTrack, recorded, phase.kind, start, device::global_timer_ns(),
                        grad_tile ? task.m_block : task.row, grad_tile ? 0 : task.rows,
                        task.n_group * T::kClusterN + cta_rank, task.expert);
  }
  if (threadIdx.x % 128 == 0) {
    signal.flush();
    // Why: the shared memory must outlive the last TMA stores' reads of it.
    cute::tma_store_wait<0>();
  }
}

template <class TRecompute, class TDown, class T, class Params>
__global__ void __launch_bounds__(T::kThreads, 1) backward_kernel(const __grid_constant__ Params p) {
  static_assert(std::is_same_v<typename TRecompute::TileStorage, typename T::TileStorage> &&
                    std::is_same_v<typename TDown::TileStorage, typename T::TileStorage> &&
                    std::is_same_v<typename gemm::WeightGradTraitsInGemmLayout<GradOutput::kFloat32>::TileStorage,
                                   typename T::TileStorage> &&
                    TRecompute::kStages == T::kStages && TDown::kStages == T::kStages &&
                    TRecompute::kClusterN == T::kClusterN && TDown::kClusterN == T::kClusterN &&
                    TRecompute::kBlockM == T::kBlockM && TDown::kBlockM == T::kBlockM,
                "the backward's row GEMMs share one shared-memory layout, pipeline and cluster");
  static_assert(T::kBlockM == kTileRows, "the task order's tiles are the GEMM's m-tiles");
  extern __shared__ __align__(1024) char shared_raw[];
  auto& smem = *reinterpret_cast<BackwardSharedStorage<T>*>(shared_raw);
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);
  const BackwardRole role = static_cast<int>(blockIdx.x) < p.comm_ctas ? BackwardRole::kCommunication
                            : warpgroup == 0                            ? BackwardRole::kProducer
                                                                        : BackwardRole::kConsumer;
  typename T::Pipeline pipeline = gemm::start_pipeline<T>(smem.gemm, smem.tasks, role == BackwardRole::kConsumer);
  const int cta_rank = static_cast<int>(cute::block_rank_in_cluster());
  switch (role) {
    case BackwardRole::kCommunication: run_backward_communication<T>(p, smem.comm, true); break;
    case BackwardRole::kProducer: run_backward_producer<TRecompute, TDown, T>(p, smem, pipeline, cta_rank); break;
    case BackwardRole::kConsumer: run_backward_consumer<TRecompute, TDown, T>(p, smem, pipeline, cta_rank); break;
  }
  // Why: neither CTA may exit while its partner can still multicast into it or arrive on its barriers.
  if constexpr (T::kClusterN > 1) cute::cluster_sync();
}

}  // namespace mok::megakernel
