// Grouped GEMM over expert-major rows, one output tile at a time (Hopper: TMA + wgmma, warp-specialized).
//
//   For each local expert e and each row r of its segment (from the GPU schedule), acc = A[r, :] · W_e:
//     kStore:          Y[r, :] = scale[r] * acc                                       W_e [N, K] or [K, N]
//     kSwiGLU:         H[r, :] = scale[r] * silu(min(g, L)) * clamp(u, -L, L)         g = A[r] · Wg_e^T, u = A[r] · Wu_e^T
//     kSwiGLUBackward: d_g, d_u [r, 2N] from acc = d_hu and the forward's g, u; per-row partials of d_rw
//   A [rows, K] bf16 row-major (expert e's rows are the padded segment [row_offsets[e], row_offsets[e+1])),
//   outputs bf16; fp32 accumulation. Padding rows (past expert_counts[e]) are written as zeros, so later
//   weight-gradient GEMMs can sum over whole segments. L = 0 disables the clamp; scale is optional.
//   The epilogues' formulas, side inputs and outputs: src/device/gemm/gemm_epilogue.cuh.
//
// GemmTraits = mainloop.cuh's collective (tile shape, operand policy: A K-major, B K- or MN-major) + an epilogue
// policy (gemm_epilogue.cuh) + the cluster size; compute_tile = mainloop() + Epilogue::store.
// B K-major (kK): W [E_local, N, K] (k contiguous: the forward's weights), loaded as two boxes of
// kBlockN/2 rows (gate and up rows for SwiGLU, two row ranges of W otherwise). B MN-major (kMN):
// W [E_local, K, N] (n contiguous: the backward's dgrad through the forward's weights as they are), loaded
// as kBlockN/64 boxes of 64 columns into MN-major 128-byte-swizzled stages, read by wgmma as B Major::MN;
// K may be the concatenation of two sources (b for the first b_k_blocks0 k-blocks, then b_up).
//
// Clusters of kClusterN (1 or 2) CTAs share the A tile: a task is one m-tile and kClusterN adjacent
// n-blocks; CTA c of the cluster computes n-block kClusterN * task.n_block + c. With 2, each CTA loads half
// of the A tile's rows and multicasts it to both, cutting L2 traffic per k-block from 48 to 40 KB per CTA.
// For SwiGLU the accumulator's column c (gate) and c + kBlockN/2 (up) sit in the same thread, so the
// activation is register-local.
//
// The unit of work is a TileTask (first row, rows, n-block, expert): load_tile() on the producer side and
// compute_tile() on the consumer side, each advancing a pipeline state that persists across tasks, so a
// persistent loop (expert_gemm_kernel in gemm_kernel.cuh, the megakernels) can interleave GEMM tiles with
// other work. Task order: TaskWalker<kRowTiles> (task_walker.cuh).
//
// Shared memory: A stages (kBlockM x 64 bf16, 128B swizzle) | B stages (kBlockN x 64) | epilogue staging
// (kBlockM x 128 output columns, bf16 boxes of 64 x 64, 128B swizzle) | pipeline barriers | task ring.
// Sync: mainloop.cuh's pipeline; every wait is bounded (device::HandoffBound: the standalone kernel's from its
// StandaloneWaits parameter, the megakernels' own) and a timeout is reported in the status word
// (docs/sync_protocol.md, "Timeouts and the abort word").
// Determinism: each output element is one fixed-order K reduction by one thread; no atomics.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mok/expert_gemm.h"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/gemm_epilogue.cuh"
#include "src/device/gemm/mainloop.cuh"
#include "src/device/gemm/task_ring.cuh"
#include "src/device/gemm/task_walker.cuh"
#include "src/device/gemm/tile_task.cuh"
#include "src/device/schedule/placement.h"

namespace mok::gemm {

// One TMA box of a B stage, kRows n (K-major) or 64 n-columns (MN-major) by kCols k (only the chosen major's
// layout is formed: the other's atom need not divide the box).
template <class Mainloop, int kRows, int kCols>
constexpr auto b_box_layout() {
  const auto shape = cute::make_shape(cute::Int<kRows>{}, cute::Int<kCols>{});
  if constexpr (Mainloop::kBKMajor)
    return cute::tile_to_shape(typename Mainloop::SmemAtom{}, shape);
  else
    return cute::tile_to_shape(typename Mainloop::SmemAtomMN{}, shape, cute::Step<cute::_2, cute::_1>{});
}

// GemmTraits = tile shape + operand policy (mainloop.cuh: Bf16Mainloop<A major, B major>, A K-major here and B
// either; or Fp8Mainloop, both K-major, block-scaled) + epilogue policy (gemm_epilogue.cuh) + the cluster size,
// over the collective mainloop. Outputs are bf16 whatever the operands.
template <int kBlockM_, int kBlockN_, int kStages_, class Mainloop_, class Epilogue_, int kClusterN_>
struct GemmTraits : CollectiveMainloop<Mainloop_, kBlockM_, kBlockN_, Mainloop_::kBlockK, kStages_> {
  using Collective = CollectiveMainloop<Mainloop_, kBlockM_, kBlockN_, Mainloop_::kBlockK, kStages_>;
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using typename Collective::Element;
  using Collective::kBlockM;
  using Collective::kBlockN;  // accumulator columns per tile
  using Collective::kBlockK;  // one 128-byte swizzle row of the element: 64 bf16, 128 e4m3
  using Collective::kConsumerWarpgroups;
  using OutElement = typename Epilogue::OutElement;  // bf16, or e4m3 (SwiGLUQuantEpilogue's h)
  static constexpr int kPasses = Epilogue::kPasses;   // mainloops per task (SwiGLUQuantEpilogue: one per half)
  // k-blocks of a K: whole ones (bf16: k % 64 == 0); block-scaled, the last may be partial (the TMA fills
  // its columns past k with zeros, and its scales cover the columns it has).
  static constexpr int num_k_blocks(int k) {
    return Collective::kBlockScaled ? (k + kBlockK - 1) / kBlockK : k / kBlockK;
  }
  static constexpr GemmEpilogue kEpilogue = Epilogue::kKind;
  static constexpr OperandMajor kBMajor = Mainloop::kBMajor;
  static_assert(Mainloop::kAMajor == OperandMajor::kK, "A rows are the expert-major row buffer: K-major");
  static_assert(kBlockN % 32 == 0 && kBlockN <= 256, "wgmma N, and B loads in two halves of 8-row atoms");
  static constexpr int kHalfN = kBlockN / 2;
  static constexpr int kOutCols = Epilogue::out_cols(kBlockN);
  // Output tiles (n-blocks) of n output columns; the last one is partial when n is not a multiple of kOutCols.
  static constexpr int n_blocks(int64_t n) { return static_cast<int>((n + kOutCols - 1) / kOutCols); }
  static constexpr int kClusterN = kClusterN_;  // CTAs sharing one A tile (adjacent n-blocks)
  static_assert(kClusterN == 1 || kClusterN == 2, "A is shared by at most two CTAs");
  // The launch's cluster dimension is (kClusterN, 1, 1); the pipeline maps consumer arrivals onto it, so
  // both must agree (a (1, 2, 1) shape here left one CTA's empty barriers short of arrivals: a hang).
  using ClusterShape = cute::Shape<cute::Int<kClusterN>, cute::_1, cute::_1>;
  static constexpr int kCtaRowsA = kBlockM / kClusterN;  // A rows each CTA loads (and multicasts)

  using SmemAtom = typename Mainloop::SmemAtom;
  // One TMA box of B: K-major, half of a stage (kHalfN rows); MN-major, 64 columns (128 bytes, the swizzle
  // span). A stage's boxes are contiguous, so the stage is one wgmma operand.
  static constexpr int kBoxRowsB = Mainloop::kBKMajor ? kHalfN : 64;
  static constexpr int kBoxesB = kBlockN / kBoxRowsB;
  static_assert(Mainloop::kBKMajor || kBlockN % 64 == 0, "MN-major B stages are whole 64-column boxes");
  using SmemLayoutBBox = decltype(b_box_layout<Mainloop, kBoxRowsB, kBlockK>());
  using SmemLayoutACta =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::make_shape(cute::Int<kCtaRowsA>{}, cute::Int<kBlockK>{})));

  // Epilogue staging (gemm_epilogue.cuh): per consumer warpgroup, kStagingBoxes boxes of 64 rows x 128 bytes
  // (64 bf16 columns, or 128 e4m3; the 128-byte swizzle), which TMA stores copy out. Staged in passes of
  // kStagingCols columns, which keeps 4 pipeline stages within shared memory.
  static constexpr int kBoxCols = 128 / static_cast<int>(sizeof(OutElement));
  static constexpr int kStagingBoxes = kOutCols % (2 * kBoxCols) == 0 ? 2 : 1;  // 192 columns: 3 passes of one
  static constexpr int kStagingCols = kStagingBoxes * kBoxCols;
  static_assert(kOutCols % kStagingCols == 0, "whole staging passes");
  // The boxes the shared memory holds a warpgroup: a pass's, or more for an epilogue's side outputs.
  static constexpr int kStorageBoxes = kStagingBoxes > Epilogue::kSideBoxes ? kStagingBoxes : Epilogue::kSideBoxes;
  using SmemLayoutOutBox = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<OutElement>{},
                                                         cute::make_shape(cute::Int<64>{}, cute::Int<kBoxCols>{})));

  // The tiles' bytes (the megakernels': every GEMM of one pass, weight gradients included, has this type) and
  // the standalone kernel's, with its task ring.
  using TileStorage = typename Collective::template Storage<kStorageBoxes>;
  using Walker = TaskWalker<TaskMode::kRowTiles, GemmTraits>;  // the standalone kernel's tasks
  using SharedStorage = typename Collective::template Storage<
      kStorageBoxes, TaskRing<Collective::kTaskDepth, 4 * kConsumerWarpgroups, kClusterN>>;
  static constexpr int kSharedBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSharedBytes <= 227 * 1024, "more shared memory than a Hopper CTA may have");
};

// A tile staged one 64-column box at a time a pass, whatever its width: the wide FP8 tiles (the standalone store
// GEMM's, where two boxes a pass made ptxas spill, and the FP8 megakernel's, where they did not fit its shared memory).
template <class Base>
struct OneBoxStaging : Base {
  static constexpr int kStagingBoxes = 1;
  static constexpr int kStagingCols = Base::kBoxCols;
  static_assert(Base::kOutCols % kStagingCols == 0, "whole staging passes");
};

// Kernel parameters; the TMA copies are CuTe's, built on the host (src/host/gemm_params.h).
template <class TmaA, class TmaB, class TmaOut>
struct GemmParams {
  TmaA tma_a;      // A [a_rows, k]
  TmaB tma_b0;     // kK: B half 0 source [b_rows, k]; kMN: B [b_rows, n], the first b_k_blocks0 k-blocks
  TmaB tma_b1;     // kK: B half 1 source [b_rows, k]; kMN: B [b_rows, n], the k-blocks after those
  TmaOut tma_out;  // Y / H [a_rows, out_cols], stores of one 64 x 64 box
  TmaOut tma_gate_up_out;  // SwiGLUEpilogue<true>, SwiGLUQuantEpilogue<true>: g / u [a_rows, 2n]; else empty
  TmaOut tma_side_out;     // SwiGLUQuantEpilogue<true>: bf16 h [a_rows, n] (as bytes); the FP8 SwiGLUBackwardEpilogue
                           // with out_scales: e4m3 d_g | d_u [a_rows, 2n] (as bf16 [a_rows, n]); else empty
  int64_t a_rows = {};
  int64_t b_rows = {};
  int k = {};
  int n = {};  // the GEMM's n: output columns (kStore, kSwiGLU), d_hu columns (kSwiGLUBackward)
  int local_experts = {};
  int num_n_blocks = {};
  // kK: row of B half h for expert e, n-block nb: e * b_expert_rows + b_half_offset[h] + nb * b_block_step.
  // kMN: k-row of expert e's first k-block in either source: e * b_expert_rows.
  int64_t b_expert_rows = {};
  int64_t b_half_offset0 = {};
  int64_t b_half_offset1 = {};
  int64_t b_block_step = {};
  int b_k_blocks0 = {};  // kMN: k-blocks from tma_b0 (all of them without a second source)
  const int32_t* expert_counts = {};
  const int32_t* expert_row_offsets = {};
  const int32_t* scheduled_rows = {};
  int32_t first_row = {};  // rows below it get no tasks (a multiple of 128: the tiles stay aligned)
  const float* row_scale = {};  // nullable
  float swiglu_limit = {};      // 0: plain SwiGLU
  int64_t out_cols = {};
  const __nv_bfloat16* gate_up = {};  // kSwiGLUBackward: the forward's g / u [a_rows, 2n]
  float* row_partials = {};           // kSwiGLUBackward: [a_rows, num_n_blocks]
  int32_t* ticket = {};  // zeroed before the launch; each cluster takes its next slot from it
  uint64_t* trace = {};  // nullable: per (slot, CTA) consumer start / end ns, SM id | cycles<<16, expert<<48|group<<32|row
};

// A block-scaled (FP8) GEMM's parameters: the bf16 GEMM's and the scales (include/mok/expert_gemm.h has their
// layouts). A's scales go through the pipeline with the stage (a TMA of kBlockM floats); B's, one float per
// half tile per k-block, the consumers read from global memory one k-block ahead.
template <class Base, class TmaScales>
struct BlockScaledParams : Base {
  TmaScales tma_a_scales;           // a_scales [a_rows, k_blocks] as (row, k-block) coordinates, rows contiguous
  const float* b_scales0 = {};      // of tma_b0's weights: [E_local, b_scale_blocks, k_blocks]
  const float* b_scales1 = {};      // of tma_b1's (b's again when gate and up are fused)
  int b_scale_blocks = {};          // 128-row blocks per expert: ceil(b_expert_rows / 128)
  int k_blocks = {};                // ceil(k / 128)
  float* out_scales = {};           // SwiGLUQuantEpilogue: h's scales [ceil(n / 128), a_rows]; SwiGLUBackwardEpilogue
                                    // (nullable): d_g | d_u's, [2n / 128, a_rows]
  bool out_power_of_two = {};       // those scales rounded up to powers of two
  DeviceStatus* status = {};        // where a non-finite block of them is reported (the waits')
  int rank = {};

  // The scales over k of 64-column group `group` of the task's B tile (kHalfN wide halves: group g starts at column
  // 64 g, in half 0 below kHalfN, else in half 1; 64 rows from a multiple of 64 lie inside one 128-row block). With
  // 128 columns the groups are the halves; with 192 (the store GEMM, whose halves are consecutive rows) the middle
  // group spans both. A group past the last expert's rows (a partial last n-block) reads the last block's scales:
  // its columns are never stored.
  template <int kHalfN>
  __device__ __forceinline__ const float* b_scale_group(const TileTask& task, int group) const {
    const bool first_half = 64 * group < kHalfN;
    const int64_t in_tile = first_half ? this->b_half_offset0 + 64 * group : this->b_half_offset1 + 64 * group - kHalfN;
    const int64_t first_row = int64_t(task.n_block) * this->b_block_step + in_tile;
    const int64_t block = min(first_row / 128, int64_t(b_scale_blocks) - 1);
    return (first_half ? b_scales0 : b_scales1) + (int64_t(task.expert) * b_scale_blocks + block) * k_blocks;
  }
};

// The K-major B of a tile (the forward's weights): per stage two boxes of kHalfN rows, taken by offset, not by tile
// index: an expert's rows (n, or 2n fused) need not be a multiple of the half tile. A last, partial n-block reads
// rows of the next expert (or of the up half) into columns no epilogue stores, and the TMA fills rows past the last
// expert with zeros. Returns load(k_block, stage, full), which issues the stage's two boxes on `full`; used by
// load_tile and by the gathering producer (row_gather.cuh).
template <class T, class Params, class Storage>
__device__ __forceinline__ auto kmajor_b_loader(const Params& p, const TileTask& task, Storage& smem) {
  using namespace cute;
  Tensor s_b = make_tensor(make_smem_ptr(smem.b.data()), typename T::SmemLayoutB{});
  Tensor s_b_boxes = flat_divide(s_b, Shape<Int<T::kBoxRowsB>, Int<T::kBlockK>>{});  // (BR, BK, boxes, 1, S)
  Tensor m_b = p.tma_b0.get_tma_tensor(make_shape(p.b_rows, p.k));
  const int64_t b_base = int64_t(task.expert) * p.b_expert_rows + int64_t(task.n_block) * p.b_block_step;
  Tensor g_b0 = local_tile(domain_offset(make_coord(b_base + p.b_half_offset0, _0{}), m_b),
                           Shape<Int<T::kHalfN>, Int<T::kBlockK>>{}, make_coord(0, _));
  Tensor g_b1 = local_tile(domain_offset(make_coord(b_base + p.b_half_offset1, _0{}), m_b),
                           Shape<Int<T::kHalfN>, Int<T::kBlockK>>{}, make_coord(0, _));
  const auto b0 = tma_partition(p.tma_b0, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_b_boxes(_, _, 0, 0, _)),
                                group_modes<0, 2>(g_b0));
  const auto b1 = tma_partition(p.tma_b1, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_b_boxes(_, _, 1, 0, _)),
                                group_modes<0, 2>(g_b1));
  return [&p, b0, b1](int k_block, int stage, typename T::Pipeline::ProducerBarrierType* full) {
    copy(p.tma_b0.with(*full), get<0>(b0)(_, k_block), get<1>(b0)(_, stage));
    copy(p.tma_b1.with(*full), get<0>(b1)(_, k_block), get<1>(b1)(_, stage));
  };
}

// The MN-major B of a tile (the dgrads' weights, [b_rows, n] as (n, k-row) coordinates): box b of n-block nb holds
// columns nb * kBlockN + 64 b of k-rows e * b_expert_rows + 64 k_block (of the second source once k_block >=
// b_k_blocks0). A last, partial n-block's boxes past n lie outside the tensor: the TMA fills them with zeros (and
// still counts their bytes), into columns no epilogue stores. Returns load(k_block, stage, full), as
// kmajor_b_loader's; used by load_tile and by the gathering producer.
template <class T, class Params, class Storage>
__device__ __forceinline__ auto mn_major_b_loader(const Params& p, const TileTask& task, Storage& smem) {
  using namespace cute;
  static_assert(!BlockScaled<T>, "block-scaled operands are K-major");
  Tensor s_b = make_tensor(make_smem_ptr(smem.b.data()), typename T::SmemLayoutB{});
  Tensor s_b_boxes = flat_divide(s_b, Shape<Int<T::kBoxRowsB>, Int<T::kBlockK>>{});  // (BR, BK, boxes, 1, S)
  Tensor m_b = p.tma_b0.get_tma_tensor(make_shape(int64_t(p.n), p.b_rows));  // both sources: same shape
  const int64_t n_base = int64_t(task.n_block) * T::kBlockN;
  const int64_t k_base = int64_t(task.expert) * p.b_expert_rows;
  return [&p, s_b_boxes, m_b, n_base, k_base](int k_block, int stage,
                                              typename T::Pipeline::ProducerBarrierType* full) {
    const bool second = k_block >= p.b_k_blocks0;
    const auto& tma_b = second ? p.tma_b1 : p.tma_b0;
    const int64_t k_row = k_base + int64_t(second ? k_block - p.b_k_blocks0 : k_block) * T::kBlockK;
    CUTE_UNROLL
    for (int box = 0; box < T::kBoxesB; ++box) {
      Tensor g_box = local_tile(domain_offset(make_coord(n_base + box * T::kBoxRowsB, k_row), m_b),
                                Shape<Int<T::kBoxRowsB>, Int<T::kBlockK>>{}, make_coord(0, 0));
      auto [t_b_g, t_b_s] = tma_partition(tma_b, Int<0>{}, Layout<_1>{},
                                          group_modes<0, 2>(s_b_boxes(_, _, box, 0, stage)), group_modes<0, 2>(g_box));
      copy(tma_b.with(*full), t_b_g, t_b_s);
    }
  };
}

// Producer side of one tile: K / 64 stages of A and B through the pipeline. One thread calls this.
// False when a stage acquire gave up (`bound`): the rest of the tile is not issued.
template <class Traits, class Params, class Storage>
__device__ __forceinline__ bool load_tile(const Params& p, const TileTask& task, int cta_rank, Storage& smem,
                                          typename Traits::Pipeline& pipeline,
                                          typename Traits::PipelineState& state, const device::HandoffBound& bound) {
  using namespace cute;
  using T = Traits;
  Tensor m_a = p.tma_a.get_tma_tensor(make_shape(p.a_rows, p.k));
  Tensor s_a = make_tensor(make_smem_ptr(smem.a.data()), typename T::SmemLayoutA{});

  // This CTA's share of the A tile: kCtaRowsA rows from buffer_row + cta_rank * kCtaRowsA (offset, then tile).
  Tensor s_a_shares = flat_divide(s_a, Shape<Int<T::kCtaRowsA>, Int<T::kBlockK>>{});  // (RA, BK, C, 1, S)
  Tensor g_a = local_tile(domain_offset(make_coord(int64_t(task.buffer_row) + cta_rank * T::kCtaRowsA, _0{}), m_a),
                          Shape<Int<T::kCtaRowsA>, Int<T::kBlockK>>{}, make_coord(0, _));
  auto [t_a_g, t_a_s] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{},
                                      group_modes<0, 2>(s_a_shares(_, _, cta_rank, 0, _)), group_modes<0, 2>(g_a));
  // This CTA's share of A for one stage: multicast to every CTA of the cluster.
  const auto load_a = [&](int k_block, int stage, typename T::Pipeline::ProducerBarrierType* full) {
    if constexpr (T::kClusterN > 1)
      copy(p.tma_a.with(*full, uint16_t((1u << T::kClusterN) - 1)), t_a_g(_, k_block), t_a_s(_, stage));
    else
      copy(p.tma_a.with(*full), t_a_g(_, k_block), t_a_s(_, stage));
  };
  const int num_k_blocks = T::num_k_blocks(p.k);
  // Block-scaled: the tile rows' A scales of each k-block, into the stage's ScaleStages row (kBlockM floats;
  // every CTA of a cluster loads its own, not multicast).
  const auto load_a_scales = [&](int k_block, int stage, typename T::Pipeline::ProducerBarrierType* full) {
    if constexpr (BlockScaled<T>) {
      Tensor m_sa = p.tma_a_scales.get_tma_tensor(make_shape(p.a_rows, p.k_blocks));
      Tensor s_sa = make_tensor(make_smem_ptr(&smem.a_scales[0][0]),
                                make_layout(make_shape(Int<T::kBlockM>{}, _1{}, Int<T::kStages>{})));
      Tensor g_sa = local_tile(domain_offset(make_coord(int64_t(task.buffer_row), _0{}), m_sa),
                               Shape<Int<T::kBlockM>, _1>{}, make_coord(0, _));  // (M, 1, k-blocks)
      auto [t_sa_g, t_sa_s] = tma_partition(p.tma_a_scales, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_sa),
                                            group_modes<0, 2>(g_sa));
      copy(p.tma_a_scales.with(*full), t_sa_g(_, k_block), t_sa_s(_, stage));
    }
  };
  if constexpr (T::Mainloop::kBKMajor) {
    const auto load_b = kmajor_b_loader<T>(p, task, smem);
    for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
      // Waits until the consumers of every CTA of the cluster released the stage: our A rows land in all.
      if (!producer_acquire_bounded(pipeline, state, bound)) return false;
      auto* full = pipeline.producer_get_barrier(state);
      const int stage = state.index();
      load_a(k_block, stage, full);
      load_a_scales(k_block, stage, full);
      load_b(k_block, stage, full);
      ++state;
    }
  } else {
    const auto load_b = mn_major_b_loader<T>(p, task, smem);
    for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
      if (!producer_acquire_bounded(pipeline, state, bound)) return false;  // as above
      auto* full = pipeline.producer_get_barrier(state);
      const int stage = state.index();
      load_a(k_block, stage, full);
      load_b(k_block, stage, full);
      ++state;
    }
  }
  return true;
}

}  // namespace mok::gemm
