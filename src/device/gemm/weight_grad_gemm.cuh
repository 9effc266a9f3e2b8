// Weight-gradient GEMM, k-grouped over the experts' row segments (Hopper: TMA + wgmma, warp-specialized).
//
//   grad_e[i, j] = sum over the rows r of expert e's segment of a[r, i] * b[r, j]     i < m, j < n, e < E_local
//   a bf16 [rows, m], b bf16 [rows, n] row-major. In GEMM terms A = aᵀ (m x K) and B = bᵀ (n x K), both
//   MN-major (the m or n index is contiguous), and K = the segment [row_offsets[e], min(row_offsets[e+1],
//   scheduled_rows)) in whole k-blocks of kBlockK rows (segments are padded to 64 or 128 rows). fp32
//   accumulation (mainloop.cuh's collective with Bf16Mainloop<kMN, kMN>).
//   kOutput: bf16 or fp32 written (rounded once from the accumulator), or fp32 added (out += grad_e).
// A task is one output tile (GradTileTask: expert, m-block of 128 gradient rows, n-block of kBlockN columns;
// order and slots: task_walker.cuh, TaskWalker<kKGrouped>); the standalone kernel is gemm_kernel.cuh's.
//
// Loads: per k-block, kBlockM/64 boxes of a (kBlockK rows x 64 m-columns) and kBlockN/64 boxes of b, straight
// from the row-major buffers into MN-major 128B-swizzled stages (a box is kBlockK rows of 128 bytes); wgmma
// reads both operands transposed. Consumer warpgroup w owns gradient rows [64w, 64w + 64) of the tile.
//
// Epilogue: registers -> shared-memory boxes (64 rows x 128 bytes, the TMA's 128-byte swizzle) -> TMA
// stores, or TMA reduce-adds for kAccumulateFloat32, through the GEMMs' TileStager (gemm_epilogue.cuh). Why
// through shared memory: with K of a few hundred rows a tile's fp32 output (128 KB) costs as much time as its
// mainloop, so it must drain while the next tile computes. The standalone kernel stages the whole tile in one
// pass and only the next tile's epilogue waits until the stores have read the boxes; the megakernel's
// configuration (WeightGradTraitsInGemmLayout) stages in 2 (bf16) or 4 (fp32) passes through 16 KB per
// warpgroup. The fragment-order writes are conflict-free: a warp's bf16x2 writes fill one 128-byte wavefront,
// its float2 writes two (8 rows x 4 lanes; the swizzle spreads the 8 rows over all banks).
// kAccumulateFloat32 uses the TMA's reduce-add (cp.reduce.async.bulk.tensor .add): the L2 reads each fp32
// value, adds the tile's value once and writes it back. One CTA owns each tile and each element gets
// exactly one addition per call, so the result is out + grad_e rounded once, whichever CTA ran it and
// whenever: no order-dependent float sum (STYLE.md's reason for banning float atomics) can arise. A
// load-add-store in the SM would need the old tile in registers (full with the accumulator) or a second
// staging buffer (shared memory is full with stages and staging), and would double the SM's traffic.
//
// Partial tiles (m, n multiples of 64, not of the tile): a load box whose 64 columns lie past m (or n) is
// loaded from the last 64 columns instead, so no box starts outside the tensor; it feeds accumulator rows
// or columns no store writes. A consumer warpgroup whose 64 rows lie past m only passes the stages back.
// Stores skip boxes past m or n, and the output tensor is addressed per expert (E_local * rows_out rows),
// so no store reaches the next expert's gradient. out_split: m_split is a multiple of 64, so each
// warpgroup's 64 rows lie on one side of it; a tile that straddles the split writes its upper half to
// `out` and its lower half to `out_split`.
//
// Shared memory (kBlockM 128, kBlockN 256): stages of A (kBlockK x 256 bytes) and B (kBlockK x 512 bytes)
// | staging, one pass of boxes per consumer warpgroup | pipeline barriers | task ring. bf16: 3 stages of 64
// rows + 64 KB = 208 KB; fp32: 4 stages of 32 rows + 128 KB = 224 KB (src/host/weight_grad_params.h says why).
// Sync (docs/sync_protocol.md, "the weight-gradient GEMM"): as the expert GEMM's, plus per warpgroup a named
// barrier around each pass's staging writes and cp.async.bulk.wait_group.read before the boxes are written
// again (next pass or tile). Every wait is bounded and reports a timeout in the status word.
// Determinism: each output element is one fixed-order K reduction (ascending rows) by one thread of one
// CTA; no value atomics; the result does not depend on which CTA takes which slot.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mok/weight_grad_gemm.h"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/gemm_epilogue.cuh"
#include "src/device/gemm/mainloop.cuh"
#include "src/device/gemm/task_ring.cuh"
#include "src/device/gemm/task_walker.cuh"
#include "src/device/gemm/tile_task.cuh"

namespace mok::gemm {

// Kernel parameters; the TMA copies are built on the host (src/host/weight_grad_params.h).
template <class TmaLoad, class TmaStore>
struct WeightGradParams {
  TmaLoad tma_a;            // a [rows, m] as (m, rows), m contiguous; boxes of 64 columns x 64 rows
  TmaLoad tma_b;            // b [rows, n] as (n, rows)
  TmaStore tma_out;         // out as [E_local * rows_out, n]; boxes of 64 rows x 128 bytes
  TmaStore tma_out_split;   // out_split as [E_local * (m - m_split), n]; tma_out's copy when there is none
  int64_t rows = {};        // rows allocated in a and b
  int m = {};
  int n = {};
  int m_split = {};         // rows [0, m_split) go to out, the rest to out_split; m without out_split
  int local_experts = {};
  int num_m_blocks = {};    // the last one may be partial (m % kBlockM != 0)
  int num_n_blocks = {};
  int32_t num_tasks = {};   // local_experts * num_m_blocks * num_n_blocks
  const int32_t* expert_row_offsets = {};
  const int32_t* scheduled_rows = {};
  int32_t* ticket = {};     // zeroed before the launch; each CTA takes its next slot from it
};

// The FP8 weight gradient's parameters (Operands Fp8KScaledMainloop): the bf16 GEMM's, a and b as e4m3 [m, rows]
// and [n, rows] (K-major: detail::quantize_columns_fp8's layout) and the scales of both, [rows / 128, m] and
// [rows / 128, n] as (column, k-block) coordinates: a box of a tile's 128 columns of one k-block per stage.
template <class Base, class TmaScales>
struct KScaledWeightGradParams : Base {
  TmaScales tma_a_scales;
  TmaScales tma_b_scales;
  // Operands Fp8Mainloop (WeightGradArgs::b_block_scales): b scaled per 128 rows x 128 columns,
  // b_block_scales [ceil(n / 128), rows / 128] read by the consumers (mainloop_block_scaled); tma_b_scales unused.
  const float* b_block_scales = {};
  int64_t scale_k_blocks = {};  // rows / 128
};

// The block-scaled weight gradient's B scales over k of 64-column group `group` of the tile (b_scale_groups'
// GradTileTask overload): the group's 128-column block of b, from the expert's first k-block; a group past n reads
// the last block's (its columns are never stored).
template <class T, class Params>
__device__ __forceinline__ void b_scale_groups(const Params& p, const GradTileTask& task,
                                               const float* (&rows)[T::kBlockN / 64]) {
  const int64_t last_block = (p.n - 1) / 128;
  CUTE_UNROLL
  for (int g = 0; g < T::kBlockN / 64; ++g) {
    const int64_t block = min((int64_t(task.n_block) * T::kBlockN + 64 * g) / 128, last_block);
    rows[g] = p.b_block_scales + block * p.scale_k_blocks + task.row_begin / 128;
  }
}

struct GradEpilogue;  // below: the traits name it

// kStagingColumns_: output columns staged per epilogue pass (kBlockN: the whole tile in one pass). Operands:
// both MN-major bf16 (mainloop.cuh, Bf16Mainloop<kMN, kMN>), or both K-major e4m3 scaled per column per 128 rows
// (Fp8KScaledMainloop: a and b transposed and quantized by detail::quantize_columns_fp8); 128 gradient rows a tile.
template <GradOutput kOutput_, int kBlockN_, int kBlockK_, int kStages_, int kStagingColumns_ = kBlockN_,
          class Operands_ = Bf16Mainloop<OperandMajor::kMN, OperandMajor::kMN>>
struct WeightGradTraits : CollectiveMainloop<Operands_, 128, kBlockN_, kBlockK_, kStages_> {
  using Collective = CollectiveMainloop<Operands_, 128, kBlockN_, kBlockK_, kStages_>;
  using typename Collective::Element;
  using Collective::kBlockM;  // gradient rows per tile: 64 per consumer warpgroup
  using Collective::kBlockN;  // gradient columns per tile (wgmma N)
  using Collective::kBlockK;  // schedule rows per k-block (one pipeline stage)
  using Collective::kConsumerWarpgroups;
  static constexpr GradOutput kOutput = kOutput_;
  using OutElement = std::conditional_t<kOutput == GradOutput::kBFloat16, cutlass::bfloat16_t, float>;
  static constexpr bool kFp8 = KScaled<Operands_> || BlockScaled<Operands_>;
  static constexpr bool kBBlockScaled = BlockScaled<Operands_>;  // b_block_scales' B scales (KScaledWeightGradParams)
  static_assert(kBlockN % 64 == 0, "whole 64-column load boxes");
  // FP8: segments re-padded to 128 rows (quantize_columns_fp8), one k-block each.
  static_assert(kFp8 ? kBlockK == 128 : 64 % kBlockK == 0, "segments (multiples of 64) are whole k-blocks");
  // A load box (bf16, MN-major): 64 m- (or n-) columns = one 128-byte swizzle row of bf16, by kBlockK schedule
  // rows. FP8 (K-major): a whole stage of one operand is one box, 128 columns x 128 rows (one swizzle row each).
  static constexpr int kBoxColumns = kFp8 ? 128 : 64;
  static constexpr int kBoxesA = kBlockM / kBoxColumns;
  static constexpr int kBoxesB = kBlockN / kBoxColumns;
  static_assert(kFp8 || kConsumerWarpgroups == kBoxesA, "consumer warpgroup w computes the rows of A box w");
  static constexpr int kClusterN = 1;  // for start_pipeline: no multicast, the CTA is its own cluster
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;

  // Each 64-column box of an MN-major stage is 64 x kBlockK contiguous (kBlockK rows of 128 bytes), which one
  // TMA box fills.
  // FP8: a K-major box of 128 columns (of m or n) x kBlockK rows of K.
  using SmemLayoutLoadBox = decltype(cute::tile_to_shape(
      std::conditional_t<kFp8, typename Collective::Operands::SmemAtom, typename Collective::Operands::SmemAtomMN>{},
      cute::make_shape(cute::Int<kBoxColumns>{}, cute::Int<kBlockK>{})));

  // Staging: per consumer warpgroup its 64 rows x kStagingColumns columns of one pass (kStagingPasses a
  // tile), as store boxes of 64 rows x 128 bytes (bf16: 64 columns, fp32: 32) in the TMA's 128-byte swizzle.
  static constexpr int kStagingColumns = kStagingColumns_;
  static_assert(kBlockN % kStagingColumns == 0, "whole staging passes");
  static constexpr int kStagingPasses = kBlockN / kStagingColumns;
  static constexpr int kStoreBoxRowBytes = 128;
  static constexpr int kStoreBoxColumns = kStoreBoxRowBytes / static_cast<int>(sizeof(OutElement));
  static constexpr int kStoreBoxes = kStagingColumns / kStoreBoxColumns;  // per warpgroup and pass
  static constexpr int kStoreBoxBytes = 64 * kStoreBoxRowBytes;
  static_assert(kStagingColumns % kStoreBoxColumns == 0, "whole store boxes");
  using SmemLayoutStoreBox = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<OutElement>{}, cute::make_shape(cute::Int<64>{}, cute::Int<kStoreBoxColumns>{})));
  static_assert(cute::cosize_v<SmemLayoutStoreBox> * sizeof(OutElement) == kStoreBoxBytes, "one box");

  // The kernel parameters' types (the TMA copies src/host/weight_grad_params.h builds, of these exact
  // tensor types), named here so that one kernel can hold any output mode's (AnyWeightGradParams).
  // bf16: a [rows, m] seen as (m, rows), m contiguous; FP8: a [m, rows] as (m, rows), rows contiguous.
  using LoadStride = std::conditional_t<kFp8, cute::Stride<int64_t, cute::_1>, cute::Stride<cute::_1, int64_t>>;
  using TmaLoad = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                        cute::make_shape(int64_t{}, int64_t{}), LoadStride{}),
      SmemLayoutLoadBox{}));
  // FP8: the scales [rows / 128, m] as (column, k-block), columns contiguous; a box of 128 columns.
  using TmaScales = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<const float*>(nullptr)), cute::make_shape(int64_t{}, int64_t{}),
                        cute::make_stride(cute::_1{}, int64_t{})),
      cute::make_layout(cute::make_shape(cute::Int<kBoxColumns>{}, cute::_1{})),
      cute::Shape<cute::Int<kBoxColumns>, cute::_1>{}, cute::Int<1>{}));
  using TmaStoreOp = std::conditional_t<kOutput == GradOutput::kAccumulateFloat32, cute::SM90_TMA_REDUCE_ADD,
                                        cute::SM90_TMA_STORE>;
  using TmaStore = decltype(cute::make_tma_copy(
      TmaStoreOp{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<OutElement*>(nullptr)), cute::make_shape(int64_t{}, int64_t{}),
                        cute::make_stride(int64_t{}, cute::_1{})),
      SmemLayoutStoreBox{}));
  using Params = std::conditional_t<kFp8, KScaledWeightGradParams<WeightGradParams<TmaLoad, TmaStore>, TmaScales>,
                                    WeightGradParams<TmaLoad, TmaStore>>;

  // The tiles' bytes (in the megakernel's configuration, WeightGradTraitsInGemmLayout, the expert GEMM's
  // TileStorage: the same type) and the standalone kernel's, with its task ring.
  using TileStorage = typename Collective::template Storage<kStoreBoxes>;
  using Walker = TaskWalker<TaskMode::kKGrouped, WeightGradTraits>;  // the standalone kernel's tasks
  using Epilogue = GradEpilogue;
  using SharedStorage = typename Collective::template Storage<
      kStoreBoxes, TaskRing<Collective::kTaskDepth, 4 * kConsumerWarpgroups, 1, GradTileTask>>;
  static_assert(TileStorage::kStagingBoxBytes == kStoreBoxBytes, "the storage's staging boxes are the store boxes");
  static constexpr int kSharedBytes = static_cast<int>(sizeof(SharedStorage));
};

// Producer side of one tile: its k-blocks through the pipeline, each stage the A boxes then the B boxes.
// One thread calls this. False when a stage acquire gave up (`bound`): the rest of the tile is not issued.
// (cta_rank: unused, no multicast; the expert GEMM's load_tile signature.)
template <class Traits, class Params, class Storage>
__device__ __forceinline__ bool load_tile(const Params& p, const GradTileTask& task, int /*cta_rank*/, Storage& smem,
                                          typename Traits::Pipeline& pipeline,
                                               typename Traits::PipelineState& state,
                                               const device::HandoffBound& bound) {
  using namespace cute;
  using T = Traits;
  using Box = Shape<Int<T::kBoxColumns>, Int<T::kBlockK>>;
  Tensor m_a = p.tma_a.get_tma_tensor(make_shape(int64_t(p.m), p.rows));  // (m, rows)
  Tensor m_b = p.tma_b.get_tma_tensor(make_shape(int64_t(p.n), p.rows));  // (n, rows)
  Tensor s_a = make_tensor(make_smem_ptr(smem.a.data()), typename T::SmemLayoutA{});  // (BM, BK, S)
  Tensor s_b = make_tensor(make_smem_ptr(smem.b.data()), typename T::SmemLayoutB{});  // (BN, BK, S)
  Tensor s_a_boxes = flat_divide(s_a, Box{});  // (64, BK, BM/64, 1, S)
  Tensor s_b_boxes = flat_divide(s_b, Box{});  // (64, BK, BN/64, 1, S)
  // Boxes of the whole operand from the expert's first row on: (64, BK, column boxes, k-blocks). By row
  // offset: a segment starts at any multiple of 64.
  Tensor g_a = local_tile(domain_offset(make_coord(_0{}, int64_t(task.row_begin)), m_a), Box{}, make_coord(_, _));
  Tensor g_b = local_tile(domain_offset(make_coord(_0{}, int64_t(task.row_begin)), m_b), Box{}, make_coord(_, _));
  auto [t_a_g, t_a_s] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_a_boxes), group_modes<0, 2>(g_a));
  auto [t_b_g, t_b_s] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_b_boxes), group_modes<0, 2>(g_b));
  // Column boxes past m (n) load the last box instead: in bounds, into rows (columns) nothing stores.
  // FP8: a box past m (n) starts inside the tensor (m, n multiples of 64) and the TMA fills what lies past it
  // with zeros; so do its scales. A 256-column tile's second B box wholly past n loads the last box again, as bf16's.
  const int last_a_box = T::kFp8 ? (p.m - 1) / T::kBoxColumns : p.m / T::kBoxColumns - 1;
  const int last_b_box = T::kFp8 ? (p.n - 1) / T::kBoxColumns : p.n / T::kBoxColumns - 1;
  const int first_a_box = task.m_block * T::kBoxesA;
  const int first_b_box = task.n_block * T::kBoxesB;
  // FP8: the stage's column scales of A and B (one k-block of 128 rows each), into the stage's KScaleStages rows.
  const auto load_scales = [&](int k_block, int stage, typename T::Pipeline::ProducerBarrierType* full) {
    if constexpr (T::kFp8) {
      const int64_t k_blocks = p.rows / T::kBlockK;
      const auto load = [&](const auto& tma, float* first, int columns, int column_block) {
        Tensor m_s = tma.get_tma_tensor(make_shape(int64_t(columns), k_blocks));
        Tensor s_s = make_tensor(make_smem_ptr(first), make_layout(make_shape(Int<T::kBoxColumns>{}, _1{})));
        Tensor g_s = local_tile(m_s, Shape<Int<T::kBoxColumns>, _1>{},
                                make_coord(column_block, task.row_begin / T::kBlockK + k_block));
        auto [t_g, t_s] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_s), group_modes<0, 2>(g_s));
        copy(tma.with(*full), t_g, t_s);
      };
      load(p.tma_a_scales, &smem.a_scales[stage][0], p.m, task.m_block);
      if constexpr (!T::kBBlockScaled) {
        CUTE_UNROLL
        for (int box = 0; box < T::kBoxesB; ++box)
          load(p.tma_b_scales, &smem.b_scales[stage][box * T::kBoxColumns], p.n, min(first_b_box + box, last_b_box));
      }
    }
  };
  for (int k_block = 0; k_block < task.k_blocks; ++k_block) {
    if (!producer_acquire_bounded(pipeline, state, bound)) return false;
    auto* full = pipeline.producer_get_barrier(state);
    const int stage = state.index();
    CUTE_UNROLL
    for (int box = 0; box < T::kBoxesA; ++box)
      copy(p.tma_a.with(*full), t_a_g(_, min(first_a_box + box, last_a_box), k_block), t_a_s(_, box, 0, stage));
    CUTE_UNROLL
    for (int box = 0; box < T::kBoxesB; ++box)
      copy(p.tma_b.with(*full), t_b_g(_, min(first_b_box + box, last_b_box), k_block), t_b_s(_, box, 0, stage));
    load_scales(k_block, stage, full);
    ++state;
  }
  return true;
}

// Stores (or reduce-adds) consumer warpgroup `warpgroup`'s staged boxes of pass kPass to `tma`'s tensor of
// `out_rows` rows, from row `row` on, skipping the boxes past n. Called by the warpgroup's first thread.
template <class Traits, int kPass, class Params, class Tma, class Storage>
__device__ __forceinline__ void store_staged_rows(const Params& p, const Tma& tma, int64_t out_rows, int64_t row,
                                                  int n_block, Storage& smem, int warpgroup) {
  using namespace cute;
  using T = Traits;
  using OutElement = typename T::OutElement;
  Tensor m_out = tma.get_tma_tensor(make_shape(out_rows, int64_t(p.n)));
  const int box_row = static_cast<int>(row / 64);
  int first_col = n_block * T::kBlockN;
  if constexpr (kPass > 0) first_col += kPass * T::kStagingColumns;
  CUTE_UNROLL
  for (int box = 0; box < T::kStoreBoxes; ++box) {
    if (first_col + box * T::kStoreBoxColumns >= p.n) break;  // a partial last n-block
    Tensor s_box = make_tensor(make_smem_ptr(reinterpret_cast<OutElement*>(smem.staging[warpgroup][box])),
                               typename T::SmemLayoutStoreBox{});
    Tensor g_box = local_tile(m_out, Shape<_64, Int<T::kStoreBoxColumns>>{},
                              make_coord(box_row, first_col / T::kStoreBoxColumns + box));
    auto [t_g, t_s] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_box), group_modes<0, 2>(g_box));
    copy(tma, t_s, t_g);
  }
}

// Writes the accumulators of pass `pass` (columns [pass * kStagingColumns, + kStagingColumns) of the tile)
// of a consumer warpgroup into its staging boxes (rounded to OutElement), in the TMA's 128-byte swizzle.
// The wgmma accumulator layout (CuTe's CLayout_64xN): value i of thread t of the warpgroup holds row
// 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2) and column 2 * (t % 4) + i % 2 + 8 * (i / 4), so a pass's
// columns are a contiguous range of values. The byte of a column within its 128-byte box row is a
// compile-time part (the 8-column group) plus a part of the lane with disjoint bits, and the swizzle (XOR
// with row % 8 = (t % 32) / 4 in bits [4, 7)) is a per-thread constant: each write is a register base plus
// an immediate offset (`pass` is a compile-time constant once inlined: store_grad_pass's kPass).
template <class Traits, class Accum>
__device__ __forceinline__ void write_staging(const Accum& accum, int pass, uint8_t (*boxes)[Traits::kStoreBoxBytes],
                                              int thread) {
  using T = Traits;
  constexpr int kBytes = int(sizeof(typename T::OutElement));
  constexpr int kGroupsPerBox = T::kStoreBoxColumns / 8;  // 8-column groups per 128-byte box row
  const int lane = thread % 32;
  const int row = 16 * (thread / 32) + lane / 4;
  const int lane_bytes = (2 * (lane % 4) * kBytes) ^ ((row % 8) << 4);
  uint8_t* base = &boxes[0][0] + row * T::kStoreBoxRowBytes;
  constexpr int kValues = decltype(cute::size(accum))::value;
  static_assert(kValues == 64 * T::kBlockN / 128, "a warpgroup's 64 x kBlockN accumulators, 128 threads");
  constexpr int kPassValues = kValues / T::kStagingPasses;
  static_assert(kPassValues % 4 == 0, "a pass covers whole 8-column groups");
  CUTE_UNROLL
  for (int v = 0; v < kPassValues; v += 2) {
    const int i = pass * kPassValues + v;
    const int group = v / 4;  // 8-column group of the pass
    const int half = (v / 2) % 2;  // rows row and row + 8
    const int offset = (group / kGroupsPerBox) * T::kStoreBoxBytes + half * 8 * T::kStoreBoxRowBytes +
                       (((group % kGroupsPerBox) * 8 * kBytes) ^ lane_bytes);
    if constexpr (T::kOutput == GradOutput::kBFloat16)
      *reinterpret_cast<__nv_bfloat162*>(base + offset) = __floats2bfloat162_rn(accum(i), accum(i + 1));
    else
      *reinterpret_cast<float2*>(base + offset) = make_float2(accum(i), accum(i + 1));
  }
}

// Epilogue pass kPass of a consumer warpgroup (all its 128 threads call it; `thread` is the index among
// them, store_leader thread 0): its columns [kPass * kStagingColumns, + kStagingColumns) of the tile
// through the staging boxes to the output (first_row: the warpgroup's first gradient row). A pass whose
// columns all lie past n (a partial last n-block) is skipped: warpgroup-uniform, as p.n and the task are.
// signal: see compute_tile.
template <class Traits, int kPass, class Params, class Accum, class Stager>
__device__ __forceinline__ void store_grad_pass(const Params& p, const GradTileTask& task, const Accum& accum,
                                                const Stager& stager, int first_row, int thread) {
  using T = Traits;
  if constexpr (kPass > 0) {
    if (task.n_block * T::kBlockN + kPass * T::kStagingColumns >= p.n) return;
  }
  // A previous expert GEMM tile's late count goes out at the first pass (its stores are written by now).
  stager.begin_pass(kPass == 0);
  write_staging<T>(accum, kPass, stager.smem.staging[stager.warpgroup], thread);
  stager.end_pass_with([&] {
    const int64_t expert = task.expert;
    if (first_row < p.m_split)
      store_staged_rows<T, kPass>(p, p.tma_out, int64_t(p.local_experts) * p.m_split,
                                  expert * p.m_split + first_row, task.n_block, stager.smem, stager.warpgroup);
    else
      store_staged_rows<T, kPass>(p, p.tma_out_split, int64_t(p.local_experts) * (p.m - p.m_split),
                                  expert * (p.m - p.m_split) + (first_row - p.m_split), task.n_block, stager.smem,
                                  stager.warpgroup);
  });
}

// The weight gradient's epilogue policy (gemm_epilogue.cuh's interface), every output mode: pass by pass
// (kStagingPasses; the standalone kernel's one pass is the whole tile) through the TileStager. Each pass index
// is a compile-time constant: with one pass this compiles to the SASS of an epilogue without passes (a run-time
// pass index, even a constant one after inlining, moved the store leader's column arithmetic out of the uniform
// registers). rows_done: unused (a weight-gradient tile signals nothing; the megakernel passes null).
struct GradEpilogue : NoPrefetch {
  template <class T, class Params, class Tile, class Accum, class Mma, class Storage>
  __device__ __forceinline__ static void finish(const Params& p, const GradTileTask& task, const Tile& tile,
                                                const Accum& accum, Mma&, Storage& smem, int warpgroup,
                                                int consumer_idx, bool store_leader, uint64_t*,
                                                RowsDoneSignal* signal) {
    if constexpr (T::kOutput == GradOutput::kAccumulateFloat32) {
      if (tile.num_k_blocks == 0) return;  // no rows: adds nothing, out stays as it is
    }
    const TileStager<T, Storage> stager{smem, warpgroup, store_leader, signal, 0};
    [&]<int... kPass>(std::integer_sequence<int, kPass...>) {
      (store_grad_pass<T, kPass>(p, task, accum, stager, tile.first_row, consumer_idx % 128), ...);
    }(std::make_integer_sequence<int, T::kStagingPasses>{});
  }
};

// The backward megakernel's configuration (its tiles run beside the expert GEMM's on one pipeline): kBlockK 64
// and 4 stages, so a stage is byte for byte the expert GEMM's (48 KB of transaction bytes; each kind of tile
// lays out the stage it loads), and 2 staging boxes per warpgroup: its TileStorage is the expert GEMM's type.
// The staging barrier (kStagingBarrier + w) and the store leader (thread 0 of the warpgroup) are the expert
// GEMM's too; bulk async-groups are per thread, so each kind's first wait before it writes the boxes covers the
// stores the other kind left in flight.
// Clusters of 2 (the megakernel's, for its expert GEMM tiles' multicast A): both CTAs get the same task, with
// n-blocks 2g and 2g + 1 (GradTileTask::for_cta), and load their own A and B without multicast, with the same
// 48 KB of transaction bytes as a GEMM stage. A release that reaches the partner's empty barrier for a stage it
// never read is only conservative, and the arrival counts match because both CTAs consume the same stage
// sequence in lockstep (same tasks, same k-blocks). An n-block 2g + 1 past n still runs its k-blocks and stores
// nothing; a warpgroup whose rows lie past m passes its stages back, in both CTAs alike.
constexpr int grad_output_bytes(GradOutput output) { return output == GradOutput::kBFloat16 ? 2 : 4; }
inline constexpr int kGemmLayoutStagingBoxes = 2;  // the expert GEMM's GemmTraits::kStagingBoxes
template <GradOutput kOutput>
using WeightGradTraitsInGemmLayout =
    WeightGradTraits<kOutput, 256, 64, 4, kGemmLayoutStagingBoxes * 128 / grad_output_bytes(kOutput)>;

// A megakernel task as the tile of (expert, m_block, n_block) over `rows` rows of the expert's segment from
// row `row_begin` of a and b (a multiple of 64, the segment padding: whole k-blocks). With a cluster,
// n_block is the cluster's group; then take .for_cta<kClusterN>(cta_rank).
template <class Traits>
__device__ __forceinline__ GradTileTask grad_tile_task(int32_t expert, int32_t m_block, int32_t n_block,
                                                       int32_t row_begin, int32_t rows) {
  static_assert(64 % Traits::kBlockK == 0, "segments of 64-row multiples are whole k-blocks");
  return GradTileTask{expert, m_block, n_block, row_begin, rows / Traits::kBlockK};
}

template <class Traits>
struct TraitsTag {
  using type = Traits;
};

// One weight-gradient GEMM's kernel parameters in the megakernel's configuration, its output mode a run-time
// value: the mode's WeightGradParams in `storage`. Built on the host by detail::make_any_weight_grad_params
// (src/host/weight_grad_params.h); read in a kernel through visit_weight_grad. A kernel parameter: the TMA
// descriptors need 64-byte alignment in parameter space (CUtensorMap declares 128 with CUDA 13), hence the
// storage's alignment, the largest of the three.
struct AnyWeightGradParams {
  template <GradOutput kOutput>
  using ParamsOf = typename WeightGradTraitsInGemmLayout<kOutput>::Params;
  static constexpr size_t kStorageBytes =
      std::max({sizeof(ParamsOf<GradOutput::kBFloat16>), sizeof(ParamsOf<GradOutput::kFloat32>),
                sizeof(ParamsOf<GradOutput::kAccumulateFloat32>)});
  static constexpr size_t kStorageAlignment =
      std::max({alignof(ParamsOf<GradOutput::kBFloat16>), alignof(ParamsOf<GradOutput::kFloat32>),
                alignof(ParamsOf<GradOutput::kAccumulateFloat32>), size_t(64)});

  GradOutput output = GradOutput::kBFloat16;
  alignas(kStorageAlignment) unsigned char storage[kStorageBytes] = {};

  template <GradOutput kOutput>
  CUTE_HOST_DEVICE const ParamsOf<kOutput>& params() const {
    static_assert(std::is_trivially_copyable_v<ParamsOf<kOutput>>, "copied into the storage as bytes");
    return *reinterpret_cast<const ParamsOf<kOutput>*>(storage);
  }
};
static_assert(std::is_trivially_copyable_v<AnyWeightGradParams>, "a kernel parameter");

// f(TraitsTag<T>{}, params) for the stored output mode, T = WeightGradTraitsInGemmLayout<mode> and params
// its WeightGradParams; returns what f returns (the same type for every mode). For consumers the mode must
// be warp-uniform (it is when `p` is a kernel parameter indexed by a warp-uniform value): the branch
// surrounds the tile's wgmma (see compute_tile).
template <class F>
__device__ __forceinline__ decltype(auto) visit_weight_grad(const AnyWeightGradParams& p, F&& f) {
  switch (p.output) {
    case GradOutput::kBFloat16:
      return f(TraitsTag<WeightGradTraitsInGemmLayout<GradOutput::kBFloat16>>{},
               p.params<GradOutput::kBFloat16>());
    case GradOutput::kFloat32:
      return f(TraitsTag<WeightGradTraitsInGemmLayout<GradOutput::kFloat32>>{}, p.params<GradOutput::kFloat32>());
    default:  // kAccumulateFloat32: make_any_weight_grad_params admits no other mode
      return f(TraitsTag<WeightGradTraitsInGemmLayout<GradOutput::kAccumulateFloat32>>{},
               p.params<GradOutput::kAccumulateFloat32>());
  }
}

}  // namespace mok::gemm
