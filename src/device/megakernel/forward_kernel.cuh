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
// This file is the forward's task set on the megakernel skeleton (megakernel.cuh): its parameters and per-kind
// load, compute and copy; its tables are forward_tasks.h's, its GEMM tiles src/device/gemm/expert_gemm.cuh's.
//
// Roles (megakernel.cuh): warps 1-3 of the producer warpgroup dispatch and combine rows (warp copies); with
// comm_ctas > 0 the first comm_ctas CTAs only copy, lane 0 of each of 12 warps through a 16 KB slot of the GEMM's
// stage bytes (BulkRowCopier), 12 slots in flight per CTA.
// Sync: docs/sync_protocol.md, "forward megakernel".
// Determinism: every output element is one thread's fixed-order K reduction, whatever tile, CTA, minibatch
// or macrobatch it falls in; copies are copies. The results are bitwise those of the unfused path.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cutlass/arch/barrier.h>

#include "mok/peer_group.h"
#include "mok/status.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/common/row_copy.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/dispatch/pull_rows.cuh"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/megakernel/forward_tasks.h"
#include "src/device/megakernel/megakernel.cuh"

namespace mok::megakernel {

template <class GemmParams>
struct ForwardParams {
  GemmParams gemms[forward::kNumGemms];  // by forward::Gemm: shared gate/up (A = x, out = shared_hidden),
                                         // shared down (shared_hidden -> shared_out), expert gate/up
                                         // (expert_rows ring -> hidden ring), expert down (hidden -> y ring)
  MegakernelParams common;    // with the forward's phase tables
  PeerPointers x;             // every rank's symmetric x, bf16 [padded T, H]
  PeerPointers combined;      // every rank's symmetric combine buffer, bf16 [T * k, H]
  uint4* expert_rows;         // bf16 ring [ring_rows, H]
  const uint4* expert_out;    // bf16 ring [ring_rows, H] (y)
  bool combine_in_place;      // EP = 1 with the whole capacity in the ring: the combine tasks copy nothing (the
                              // combine epilogue reads y in place: MoeWorkspace::local_combine)
  static constexpr KernelId kKernel = KernelId::kForwardMegakernel;  // named in a timeout's report
};

// GEMM `gemm`'s (forward::Gemm) parameters: one array of one type in bf16; Fp8ForwardParams (below) holds the gate/up
// and the down GEMMs' in two arrays of their own types.
template <class Params>
__device__ __forceinline__ const auto& gate_up_params(const Params& p, int gemm) {
  if constexpr (requires { p.gate_up; })
    return p.gate_up[gemm / 2];
  else
    return p.gemms[gemm];
}
template <class Params>
__device__ __forceinline__ const auto& down_params(const Params& p, int gemm) {
  if constexpr (requires { p.down; })
    return p.down[gemm / 2];
  else
    return p.gemms[gemm];
}

// The forward's task set: tiles of the gate/up GEMMs (traits T, SwiGLU epilogue) and the down GEMMs (TDown),
// dispatch and combine copies.
template <class TGateUp, class TDown>
struct ForwardTasks {
  using T = TGateUp;
  static_assert(std::is_same_v<typename T::TileStorage, typename TDown::TileStorage> &&
                    T::kStages == TDown::kStages && T::kBlockM == TDown::kBlockM && T::kBlockN == TDown::kBlockN &&
                    T::kClusterN == TDown::kClusterN,
                "the gate/up and down GEMMs share one shared-memory layout, pipeline and cluster");

  // Registers of the producer warpgroup after setmaxnreg: the GEMM's 48 leave too few for the task walker and
  // four GEMMs' descriptors (ptxas spilled); the consumers keep theirs.
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = T::kConsumerRegisters;
  static constexpr bool kClaimAhead = false;
  static constexpr bool kKeptRowWaits = false;
  using Walker = ComputeWalker;

  template <class Params>
  __device__ __forceinline__ static bool load(const Params& p, const PhaseDesc& phase, const ComputeTask& task,
                                              int cta_rank, auto& smem, auto& pipeline, auto& state,
                                              const auto& bound) {
    return gemm::load_tile<T>(p.gemms[phase.gemm], tile_of<T::kClusterN>(task, cta_rank), cta_rank, smem, pipeline,
                              state, bound);
  }

  template <class Params>
  __device__ __forceinline__ static TileRecord compute(const Params& p, const PhaseDesc& phase, const ComputeTask& task,
                                                       int cta_rank, auto& smem, auto& pipeline, auto& state,
                                                       int consumer_idx, uint64_t* rows_done, auto& signal,
                                                       const auto& bound) {
    const gemm::TileTask tile = tile_of<T::kClusterN>(task, cta_rank);
    // Two call sites, not four: each inlined compute_tile hoists its own loop invariants into registers.
    if (forward::is_gate_up(phase.gemm))
      gemm::compute_tile<T>(gate_up_params(p, phase.gemm), tile, smem, pipeline, state, consumer_idx, rows_done,
                            &signal, bound);
    else
      gemm::compute_tile<TDown>(down_params(p, phase.gemm), tile, smem, pipeline, state, consumer_idx, rows_done,
                                &signal, bound);
    return {tile.row, tile.rows, tile.n_block};
  }

  // Where row r of a dispatch or combine unit comes from and goes to (source, destination); a null source
  // means nothing to copy (a padding row: dispatch zeroes it, combine leaves it).
  template <class Params>
  __device__ __forceinline__ static void row_endpoints(const Params& p, TaskKind kind, int32_t unit, int r,
                                                       const uint4*& src, uint4*& dst) {
    const MegakernelParams& c = p.common;
    const int32_t row = unit * kUnitRows + r;
    const int32_t route = c.row_route[row];
    const int64_t ring_offset = int64_t(row % c.order.ring_rows) * c.row_vectors;
    if (kind == TaskKind::kDispatch) {
      dst = p.expert_rows + ring_offset;
      src = route < 0 ? nullptr : dispatch::source_row(p.x, route, c.num_tokens, c.top_k, c.row_vectors);
    } else {
      src = route < 0 ? nullptr : p.expert_out + ring_offset;
      dst = route < 0 ? nullptr : combine::destination_row(p.combined, route, c.num_tokens, c.top_k, c.row_vectors);
    }
  }

  // A copy warp's rows of a unit: warp copies (copy_row_warp, kUnroll vectors a lane in flight).
  template <int kUnroll = device::kRowCopyUnroll, class Params>
  __device__ __forceinline__ static void copy_rows(const Params& p, TaskKind kind, int32_t unit, int warp, int warps,
                                                   int lane) {
    if (kind == TaskKind::kCombine && p.combine_in_place) return;  // the combine epilogue reads y in place
    for (int r = warp; r < kUnitRows; r += warps) {
      const uint4* src;
      uint4* dst;
      row_endpoints(p, kind, unit, r, src, dst);
      if (src != nullptr)
        device::copy_row_warp<kUnroll>(src, dst, p.common.row_vectors, lane);
      else if (kind == TaskKind::kDispatch)
        device::zero_row_warp(dst, p.common.row_vectors, lane);
    }
  }

  // A communication CTA (FusedOptions::comm_ctas > 0): each warp's lane 0 bulk-copies its rows (warp w: rows w,
  // w + 12, ...) through its 16 KB slot, as many whole rows at a time as fit (H <= 4096: two or more), so a CTA
  // keeps 12 slots of rows in flight; padding rows are zeroed by the warp's stores.
  template <class Params>
  __device__ __forceinline__ static void run_communication_cta(const Params& p, MegakernelSharedStorage<T>& storage) {
    CommSlots<T>& slots = storage.comm_slots;
    CommSharedStorage<T>& smem = storage.comm;
    const MegakernelParams& c = p.common;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    constexpr int kWarps = CommSlots<T>::kWarps;
    const int row_bytes = c.row_vectors * 16;
    // Whole rows per slot when they fit more than one (H <= 4096), else one row (in chunks when H > 8192).
    const int rows_per_batch =
        row_bytes * 2 <= CommSlots<T>::kSlotBytes ? CommSlots<T>::kSlotBytes / row_bytes : 1;
    if (lane == 0) device::mbarrier_init(&smem.slot_loaded[warp], 1);
    // Why: the barrier init must be visible to the async proxy (the bulk copies complete on it).
    cutlass::arch::fence_barrier_init();
    device::BulkRowCopier copier{slots.slot[warp], &smem.slot_loaded[warp], CommSlots<T>::kSlotBytes,
                                 {c.status, c.timeout_ns, c.rank, Params::kKernel}, warp};
    auto copy_unit = [&](TaskKind kind, int32_t unit) {
      if (kind == TaskKind::kCombine && p.combine_in_place) return;  // the combine epilogue reads y in place
      if (kind == TaskKind::kDispatch) {
        for (int r = warp; r < kUnitRows; r += kWarps) {
          const uint4* src;
          uint4* dst;
          row_endpoints(p, kind, unit, r, src, dst);
          if (src == nullptr) device::zero_row_warp(dst, c.row_vectors, lane);
        }
      }
      if (lane != 0) return;
      const Role role = kind == TaskKind::kDispatch ? Role::kDispatch : Role::kCombine;
      if (rows_per_batch == 1) {  // rows of 8 KB and more: one at a time, in slot-sized chunks
        for (int r = warp; r < kUnitRows; r += kWarps) {
          const uint4* src;
          uint4* dst;
          row_endpoints(p, kind, unit, r, src, dst);
          if (src != nullptr) copier.copy(src, dst, row_bytes, role);
        }
      } else {  // smaller rows: a batch of whole rows fills the slot (loads, one wait, stores)
        for (int first = warp; first < kUnitRows; first += kWarps * rows_per_batch) {
          copier.begin();
          for (int b = 0, r = first; b < rows_per_batch && r < kUnitRows; ++b, r += kWarps) {
            const uint4* src;
            uint4* dst;
            row_endpoints(p, kind, unit, r, src, dst);
            if (src != nullptr) copier.load(src, row_bytes, b * row_bytes);
          }
          copier.loaded(role);  // a give-up (recorded) stores what the slot holds; the group stops at its next task
          for (int b = 0, r = first; b < rows_per_batch && r < kUnitRows; ++b, r += kWarps) {
            const uint4* src;
            uint4* dst;
            row_endpoints(p, kind, unit, r, src, dst);
            if (src != nullptr) copier.store(dst, row_bytes, b * row_bytes);
          }
        }
      }
      copier.finish();  // this warp's stores are written
    };
    communication_loop(p, smem.task_word, threadIdx.x == 0, [](bool flag) { return __syncthreads_or(flag) != 0; },
                       copy_unit);
  }
};

template <class T, class TDown, class Params>
__global__ void __launch_bounds__(T::kThreads, 1) forward_kernel(const __grid_constant__ Params p) {
  run_megakernel<ForwardTasks<T, TDown>>(p);
}

// The forward in FP8 (MoeOptions::precision kFP8; docs/design.md, "FP8"): the same phases and tables, e4m3 GEMMs with
// block scales. The gate/up GEMMs write h quantized (SwiGLUQuantEpilogue, an e4m3 output) and the down GEMMs bf16,
// so their parameters have two types, held by GEMM (forward::Gemm / 2: 0 shared, 1 routed).
template <class GateUpParams, class DownParams>
struct Fp8ForwardParams {
  GateUpParams gate_up[2];    // shared (A = this rank's published FP8 x), routed (A = the expert_rows ring)
  DownParams down[2];
  MegakernelParams common;    // with the forward's phase tables
  PeerPointers x;             // every rank's published FP8 rows [padded T, 2H bytes] (src/host/quantize_fp8.h)
  PeerPointers combined;      // every rank's symmetric combine buffer, bf16 [T * k, H]
  uint4* expert_rows;         // FP8 rows ring [ring_rows, fp8_row_vectors 16-byte vectors]
  const uint4* expert_out;    // bf16 ring [ring_rows, H] (y)
  bool combine_in_place;      // as ForwardParams'
  float* expert_row_scales;   // the ring rows' A scales [ceil(H / 128), ring_rows] (the routed gate/up's a_scales)
  int fp8_row_vectors;        // 16-byte vectors of an FP8 row (H e4m3 values and ceil(H / 128) fp32 scales): the
                              // part of a published row copied, and the ring's row stride
  int hidden;
  int k_blocks;               // ceil(H / 128)
  static constexpr KernelId kKernel = KernelId::kForwardMegakernel;  // named in a timeout's report
};

// The forward's FP8 task set: ForwardTasks' sequencing, tiles (compute) and combine copies. The gate/up tasks are
// SwiGLUQuantEpilogue's one 128 x 256 tile (the 128 gate and 128 up columns of 128 h columns), with or without the
// side outputs of a training context; the down tiles have the same shape (one pipeline). A dispatched row is the FP8
// row's bytes, its scales also written into the ring's A-scale array (what unpack_fp8_row_scales does after the
// unfused pull; zeros for a padding row, as the unfused pull's zeroed row gives) before the unit's release.
// Communication CTAs copy with warps (no bulk copies of FP8 rows).
template <class TGateUp, class TDown>
struct Fp8ForwardTasks : ForwardTasks<TGateUp, TDown> {
  using Base = ForwardTasks<TGateUp, TDown>;
  using T = TGateUp;
  static_assert(T::kBlockN == 256 && T::Epilogue::kPasses == 1, "128 x 256 tiles, one pass a gate/up task");
  // Registers: the consumers need 224 (128 promoted values and a 64-value partial a thread; ptxas spilled at 216),
  // which leaves the producer warpgroup 56: enough once the copy warps keep two vectors a lane in flight, not four
  // (ptxas spilled 36-84 bytes with four).
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 224;
  static constexpr int kCopyUnroll = 2;

  template <class Params>
  __device__ __forceinline__ static bool load(const Params& p, const PhaseDesc& phase, const ComputeTask& task,
                                              int cta_rank, auto& smem, auto& pipeline, auto& state,
                                              const auto& bound) {
    const gemm::TileTask tile = tile_of<T::kClusterN>(task, cta_rank);
    if (!forward::is_gate_up(phase.gemm))
      return gemm::load_tile<TDown>(down_params(p, phase.gemm), tile, cta_rank, smem, pipeline, state, bound);
    return gemm::load_tile<T>(gate_up_params(p, phase.gemm), tile, cta_rank, smem, pipeline, state, bound);  // one pass
  }

  template <class Params>
  __device__ __forceinline__ static void copy_rows(const Params& p, TaskKind kind, int32_t unit, int warp, int warps,
                                                   int lane) {
    if (kind != TaskKind::kDispatch) {
      Base::template copy_rows<kCopyUnroll>(p, kind, unit, warp, warps, lane);  // the combine: bf16 y rows
      return;
    }
    const MegakernelParams& c = p.common;
    const int32_t ring_rows = c.order.ring_rows;
    for (int r = warp; r < kUnitRows; r += warps) {
      // The published row (bf16 rows' stride) into its packed ring slot.
      const int32_t row = unit * kUnitRows + r, route = c.row_route[row];
      const uint4* src = route < 0 ? nullptr : dispatch::source_row(p.x, route, c.num_tokens, c.top_k, c.row_vectors);
      const int64_t slot = row % ring_rows;
      uint4* dst = p.expert_rows + slot * p.fp8_row_vectors;
      if (src != nullptr)
        device::copy_row_warp<kCopyUnroll>(src, dst, p.fp8_row_vectors, lane);
      else
        device::zero_row_warp(dst, p.fp8_row_vectors, lane);
      const float* src_scales =
          src == nullptr ? nullptr : reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(src) + p.hidden);
      for (int b = lane; b < p.k_blocks; b += 32)
        p.expert_row_scales[int64_t(b) * ring_rows + slot] = src_scales == nullptr ? 0.0f : src_scales[b];
    }
  }

  template <class Params>
  __device__ __forceinline__ static void run_communication_cta(const Params& p, MegakernelSharedStorage<T>& storage) {
    run_copy_cta<Fp8ForwardTasks>(p, storage.comm.task_word);
  }
};

template <class T, class TDown, class Params>
__global__ void __launch_bounds__(T::kThreads, 1) fp8_forward_kernel(const __grid_constant__ Params p) {
  run_megakernel<Fp8ForwardTasks<T, TDown>>(p);
}

}  // namespace mok::megakernel
