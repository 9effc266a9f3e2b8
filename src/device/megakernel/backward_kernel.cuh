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
// are capacity-sized scratch (BackwardScratch); the epilogue after the closing barrier sums d_x. In FP8 (block-scaled
// row tiles) the pull also quantizes d_out's rows, the row GEMMs run in e4m3, and the weight gradients run after the
// launch (BackwardTasks below).
// This file is the backward's task set on the megakernel skeleton (megakernel.cuh): its parameters and per-kind
// load, compute and copy; its tables are backward_tasks.h's, its tiles expert_gemm.cuh's and weight_grad_gemm.cuh's
// (one pipeline, one TileStorage), its row copies grad_rows.cuh's.
//
// Roles (megakernel.cuh): a weight-gradient tile waits for its expert's whole segment; warps 1-3, or with
// comm_ctas > 0 all warps of the first comm_ctas CTAs, pull and push rows (warp copies). Row GEMMs count their
// 64 rows per stored n-block; weight-gradient tiles signal nothing (read after the launch).
// Sync: docs/sync_protocol.md, "Inside the backward megakernel". Tasks are handed out in topological order.
// Determinism: every output element is one thread's fixed-order K reduction, the same tiles and k-block order
// as the unfused stage kernels, whatever CTA, minibatch or placement runs it; copies are copies; d_rw is the
// n-block partials summed in ascending order. The results are bitwise those of the unfused backward.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mok/peer_group.h"
#include "mok/status.h"
#include "src/device/backward/grad_rows.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/gemm/weight_grad_gemm.cuh"
#include "src/device/megakernel/backward_tasks.h"
#include "src/device/megakernel/megakernel.cuh"

namespace mok::megakernel {

// Descriptors by MLP (0: the shared expert, 1: the routed experts).
template <class RecomputeGemm, class DgradGemm, class WeightGradGemm>
struct BackwardParams {
  RecomputeGemm recompute[2];          // A = x rows -> h, g | u (rows the context does not keep)
  DgradGemm down_dgrad[2];             // A = d_out rows -> d_g | d_u, d_rw partials
  DgradGemm gate_up_dgrad[2];          // A = d_g | d_u -> d_x rows
  WeightGradGemm down_wgrad[2];        // a = dy rows, b = h
  WeightGradGemm gate_up_wgrad[2];     // a = d_g | d_u, b = x rows
  MegakernelParams common;             // with the backward's phase tables
  ::mok::backward::GradPullSources pull;
  ::mok::backward::GradPullFp8 pull_fp8;  // FP8: d_out rows quantized as they are pulled (d_out_rows not written)
  uint4* x_rows;                       // bf16 [capacity, H], or null (the context keeps every row)
  uint4* d_out_rows;                   // bf16 [capacity, H]
  uint4* dy_rows;                      // bf16 [capacity, H], or null (FP8 weight gradients read dy by route)
  float* row_weight;                   // fp32 [capacity]
  ::mok::backward::GradPushDestinations push;
  const uint4* d_x_rows;               // bf16 [capacity, H] (d_out_rows' bytes: the gate/up dgrad's output)
  const float* row_partials;           // fp32 [capacity, n_blocks]
  int n_blocks;                        // of the down dgrad: d_rw partials per row
  static constexpr KernelId kKernel = KernelId::kBackwardMegakernel;  // named in a timeout's report
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

// The backward's task set: row tiles of the recompute (traits TRecompute: SwiGLU with the g | u side output),
// the down dgrad (TDown: SwiGLU backward) and the gate/up dgrad (T: plain store), the weight-gradient tiles
// (WeightGradTraitsInGemmLayout, output mode chosen at run time), the gradient pull and push.
// FP8 (block-scaled row tiles, kFp8): the same phases, the row GEMMs in e4m3 and the pull quantizing d_out's rows
// (GradPullFp8); its weight-gradient phases have no tiles (the host gives them no m-blocks: their operands are
// quantized along the rows after the launch, and the FP8 weight gradients run as the stage kernels do).
template <class TRecompute, class TDown, class TGateUp>
struct BackwardTasks {
  using T = TGateUp;
  static constexpr bool kFp8 = T::kBlockScaled;
  static_assert(std::is_same_v<typename TRecompute::TileStorage, typename T::TileStorage> &&
                    std::is_same_v<typename TDown::TileStorage, typename T::TileStorage> &&
                    (kFp8 ||
                     std::is_same_v<typename gemm::WeightGradTraitsInGemmLayout<GradOutput::kFloat32>::TileStorage,
                                    typename T::TileStorage>) &&
                    TRecompute::kStages == T::kStages && TDown::kStages == T::kStages &&
                    TRecompute::kClusterN == T::kClusterN && TDown::kClusterN == T::kClusterN &&
                    TRecompute::kBlockM == T::kBlockM && TDown::kBlockM == T::kBlockM,
                "the backward's row GEMMs share one shared-memory layout, pipeline and cluster");

  // Registers after setmaxnreg. The producer warpgroup's thread 0 walks the backward's longer task order and
  // issues three kinds of loads, its copy warps pull and scale rows: at the forward's 56 ptxas spilled both.
  // The consumers give up 8 of the GEMM's 224 (no spills at 216).
  static constexpr int kProducerRegisters = 72;
  static constexpr int kCopyUnroll = kFp8 ? 2 : device::kRowCopyUnroll;  // the pull's vectors a lane in flight
  static constexpr int kConsumerRegisters = T::kConsumerRegisters - 8;
  // Rank 0 claims each next slot before the current task's waits and loads (a weight-gradient tile of a few
  // k-blocks takes about as long as the atomic's round trip).
  static constexpr bool kClaimAhead = true;
  static constexpr bool kKeptRowWaits = true;  // below recompute_from the down dgrad waits for the pull
  using Walker = BackwardWalker;

  template <class Params>
  __device__ __forceinline__ static bool load(const Params& p, const PhaseDesc& phase, const ComputeTask& task,
                                              int cta_rank, auto& smem, auto& pipeline, auto& state,
                                              const auto& bound) {
    const int mlp = mlp_of(phase.gemm);
    switch (backward::gemm_kind(phase.gemm)) {
      case backward::GemmKind::kRecompute:
        return gemm::load_tile<TRecompute>(p.recompute[mlp], tile_of<T::kClusterN>(task, cta_rank), cta_rank, smem,
                                           pipeline, state, bound);
      case backward::GemmKind::kDownDgrad:
      case backward::GemmKind::kGateUpDgrad: {  // one mainloop policy: one load path for both
        const auto& g = backward::gemm_kind(phase.gemm) == backward::GemmKind::kDownDgrad ? p.down_dgrad[mlp]
                                                                                             : p.gate_up_dgrad[mlp];
        return gemm::load_tile<T>(g, tile_of<T::kClusterN>(task, cta_rank), cta_rank, smem, pipeline, state, bound);
      }
      default:
        if constexpr (kFp8) {
          return false;  // not reached: FP8's weight-gradient phases have no tiles
        } else {
          return gemm::visit_weight_grad(weight_grad_of(p, phase.gemm), [&](auto traits, const auto& w) {
            using TG = typename decltype(traits)::type;
            return gemm::load_tile<TG>(w, grad_tile_of<TG, T::kClusterN>(task, cta_rank), cta_rank, smem, pipeline,
                                       state, bound);
          });
        }
    }
  }

  // Consumer side of one weight-gradient tile in output mode kOutput.
  template <GradOutput kOutput>
  __device__ __forceinline__ static void compute_grad_tile(const gemm::AnyWeightGradParams& w, const ComputeTask& task,
                                                           auto& smem, auto& pipeline, auto& state, int consumer_idx,
                                                           int cta_rank, const auto& bound, auto& signal) {
    using TG = gemm::WeightGradTraitsInGemmLayout<kOutput>;
    gemm::compute_tile<TG>(w.params<kOutput>(), grad_tile_of<TG, T::kClusterN>(task, cta_rank), smem, pipeline,
                           state, consumer_idx, nullptr, &signal, bound);
  }

  template <class Params>
  __device__ __forceinline__ static TileRecord compute(const Params& p, const PhaseDesc& phase, const ComputeTask& task,
                                                       int cta_rank, auto& smem, auto& pipeline, auto& state,
                                                       int consumer_idx, uint64_t* rows_done, auto& signal,
                                                       const auto& bound) {
    const int mlp = mlp_of(phase.gemm);
    const backward::GemmKind kind = backward::gemm_kind(phase.gemm);
    if (kind == backward::GemmKind::kRecompute) {
      gemm::compute_tile<TRecompute>(p.recompute[mlp], tile_of<T::kClusterN>(task, cta_rank), smem, pipeline, state,
                                     consumer_idx, rows_done, &signal, bound);
    } else if (kind == backward::GemmKind::kDownDgrad) {
      gemm::compute_tile<TDown>(p.down_dgrad[mlp], tile_of<T::kClusterN>(task, cta_rank), smem, pipeline, state,
                                consumer_idx, rows_done, &signal, bound);
      // Why: the d_rw partials are plain stores of several threads, read by another CTA (the push) after the
      // late count of these rows; each writer's fence, then the next task's barrier, then the leader's release.
      device::fence_acq_rel_gpu();
    } else if (kind == backward::GemmKind::kGateUpDgrad) {
      gemm::compute_tile<T>(p.gate_up_dgrad[mlp], tile_of<T::kClusterN>(task, cta_rank), smem, pipeline, state,
                            consumer_idx, rows_done, &signal, bound);
    } else if constexpr (!kFp8) {  // FP8's weight-gradient phases have no tiles
      // A weight-gradient tile signals nothing; the previous row tile's late count goes out inside it. One
      // call site per output mode, spelled out (a generic lambda's call was not inlined: ptxas serialized
      // every wgmma of the kernel, C7510).
      const gemm::AnyWeightGradParams& w = weight_grad_of(p, phase.gemm);
      if (w.output == GradOutput::kBFloat16)
        compute_grad_tile<GradOutput::kBFloat16>(w, task, smem, pipeline, state, consumer_idx, cta_rank, bound,
                                                 signal);
      else if (w.output == GradOutput::kFloat32)
        compute_grad_tile<GradOutput::kFloat32>(w, task, smem, pipeline, state, consumer_idx, cta_rank, bound, signal);
      else
        compute_grad_tile<GradOutput::kAccumulateFloat32>(w, task, smem, pipeline, state, consumer_idx, cta_rank,
                                                          bound, signal);
    }
    // A weight-gradient tile is recorded by its m-block (as its row) and n-block; a row tile by its rows.
    const bool grad_tile = kind == backward::GemmKind::kWeightGrad;
    return {grad_tile ? task.m_block : task.row, grad_tile ? 0 : task.rows, task.n_group * T::kClusterN + cta_rank};
  }

  // A copy warp's rows of a unit (warp w of `warps`: rows w, w + warps, ...): the gradient pull or push.
  template <class Params>
  __device__ __forceinline__ static void copy_rows(const Params& p, TaskKind kind, int32_t unit, int warp, int warps,
                                                   int lane) {
    const MegakernelParams& c = p.common;
    for (int r = warp; r < kUnitRows; r += warps) {
      const int64_t row = int64_t(unit) * kUnitRows + r;
      const int32_t route = c.row_route[row];
      const int64_t at = row * c.row_vectors;
      if (kind == TaskKind::kPullGrad) {
        const ::mok::backward::GradPullRow dst{p.x_rows != nullptr ? p.x_rows + at : nullptr, p.d_out_rows + at,
                                               p.dy_rows != nullptr ? p.dy_rows + at : nullptr, p.row_weight + row};
        if constexpr (kFp8)
          ::mok::backward::pull_grad_row<kCopyUnroll>(p.pull, dst, row, route, c.num_tokens, c.top_k, c.row_vectors,
                                                      lane, p.pull_fp8);
        else  // no quantization compiled in (a default GradPullFp8 is a constant)
          ::mok::backward::pull_grad_row(p.pull, dst, row, route, c.num_tokens, c.top_k, c.row_vectors, lane);
      } else {
        ::mok::backward::push_grad_row<kCopyUnroll>(p.push, p.d_x_rows + at, p.row_partials + row * p.n_blocks,
                                                    p.n_blocks, route, c.num_tokens, c.top_k, c.row_vectors, lane);
      }
    }
  }
};

template <class TRecompute, class TDown, class T, class Params>
__global__ void __launch_bounds__(T::kThreads, 1) backward_kernel(const __grid_constant__ Params p) {
  run_megakernel<BackwardTasks<TRecompute, TDown, T>>(p);
}

}  // namespace mok::megakernel
