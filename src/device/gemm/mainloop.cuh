// The collective mainloop every GEMM tile runs (Hopper: TMA + wgmma, warp-specialized): the expert GEMM's
// (expert_gemm.cuh: forward, dgrads, recompute) and the weight gradients' (weight_grad_gemm.cuh), standalone
// (gemm_kernel.cuh) and inside the megakernels.
//
//   accum[64 rows of a warpgroup, kBlockN] = sum over the tile's k-blocks, ascending, of A[rows, k] · B[k, cols]
//   fp32 accumulators in registers, one wgmma batch (one stage) in flight.
//
// What differs between the GEMMs is a policy, not a second mainloop (as CUTLASS's collective, which derives
// both operand majors from its strides):
//   operands     Bf16Mainloop<A major, B major>: element type and majorness (expert GEMM: A K-major, B either;
//                weight gradient, K = tokens: both MN-major); Fp8Mainloop: e4m3, both K-major, block-scaled
//                (A scales loaded with the stages, B scales read by the consumers; promoted per k-block:
//                mainloop_block_scaled); Fp8KScaledMainloop (the FP8 weight gradient's): e4m3, both K-major, each
//                scaled per row per 128 of K (both scales loaded with the stages; mainloop_k_scaled).
//   tile shape   CollectiveMainloop<operands, kBlockM, kBlockN, kBlockK, kStages>.
//   task mode    T::Walker (task_walker.cuh): a tile's k-blocks, its idle warpgroups, AccumulatorStart (the first
//                wgmma overwrites, or zeroed accumulators to which every wgmma adds: not the same bits for a -0
//                product, so both stay).
//   epilogue     T::Epilogue (gemm_epilogue.cuh's interface). The producers' loads stay with their GEMM.
// Shared memory (GemmSharedStorage, one type per tile shape and staging size whatever the operand majors or
// epilogue, so every tile kind of a megakernel shares it without reinterpretation): A stages | B stages |
// per consumer warpgroup kStagingBoxes boxes of 64 rows x 128 bytes (the TMA's 128-byte swizzle) | pipeline
// barriers | the kernel's task hand-off. A stage is laid out by the tile that loads it.
// Sync: PipelineTmaAsync full/empty mbarriers per stage (producer: acquire empty, arm transaction bytes;
// consumers: wait full, release after the wgmma that read the stage retired); every wait bounded
// (device::HandoffBound), a timeout reported in the status word (docs/sync_protocol.md).
// Determinism: each output element is one thread's fixed-order K reduction; no atomics.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mok/expert_gemm.h"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/gemm_epilogue.cuh"

namespace mok::gemm {

// Operand policy: element type and the majorness of A and B. A stage's k-block is one 128-byte swizzle row
// of the element: 64 bf16, 128 e4m3.
template <class Element_, OperandMajor kAMajor_, OperandMajor kBMajor_>
struct DenseOperands {
  using Element = Element_;
  static constexpr OperandMajor kAMajor = kAMajor_;
  static constexpr OperandMajor kBMajor = kBMajor_;
  static constexpr bool kBKMajor = kBMajor == OperandMajor::kK;
  static constexpr int kBlockK = 128 / static_cast<int>(sizeof(Element));
  static constexpr cute::GMMA::Major gmma_major(OperandMajor major) {
    return major == OperandMajor::kK ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  }
  using SmemAtom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});  // K-major operands
  // MN-major atoms are 64 m (or n) x 8 k (128 bytes of m per k); stacked along k first (CUTLASS's order for
  // MN-major operands), so that each 64-column slice of a stage is one contiguous block of kBlockK rows of
  // 128 bytes: one TMA box, and the wgmma descriptor's m- (n-) stride.
  using SmemAtomMN = decltype(cute::GMMA::Layout_MN_SW128_Atom<Element>{});
  // The stages of an operand of kRows m (or n) rows and kCols k columns (only the chosen major's layout is
  // formed: the other's atom need not divide the shape).
  template <OperandMajor kMajor, int kRows, int kCols, int kStages>
  static constexpr auto stage_layout() {
    const auto shape = cute::make_shape(cute::Int<kRows>{}, cute::Int<kCols>{}, cute::Int<kStages>{});
    if constexpr (kMajor == OperandMajor::kK)
      return cute::tile_to_shape(SmemAtom{}, shape);
    else
      return cute::tile_to_shape(SmemAtomMN{}, shape, cute::Step<cute::_2, cute::_1, cute::_3>{});
  }
  template <OperandMajor kMajor, int kRows, int kCols, int kStages>
  using StageLayout = decltype(stage_layout<kMajor, kRows, kCols, kStages>());
};

// bf16 operands, A and B each K-major or MN-major; one wgmma batch accumulates the whole K.
template <OperandMajor kAMajor_, OperandMajor kBMajor_>
struct Bf16Mainloop : DenseOperands<cutlass::bfloat16_t, kAMajor_, kBMajor_> {};

// e4m3 operands with DeepSeek-V3's block scales (docs/design.md, "FP8"): A scaled per row per 128 columns of
// k (a_scales [k-blocks, rows], fp32), B per 128 x 128 block of each expert's [rows, k] matrix (b_scales
// [E, ceil(rows / 128), k-blocks], fp32). FP8 wgmma reads both operands K-major. Each k-block's product goes
// into fresh fp32 accumulators, then is promoted: acc += a_scale[row] * b_scale[block] * partial (once per
// 128 of K, as DeepGEMM does: the tensor cores' FP8 accumulation keeps fewer bits than fp32).
struct Fp8Mainloop : DenseOperands<cutlass::float_e4m3_t, OperandMajor::kK, OperandMajor::kK> {
  static constexpr bool kBlockScaled = true;
};

template <class T>
concept BlockScaled = requires { requires T::kBlockScaled; };

// e4m3 operands both scaled per row per 128 of K (DeepSeek-V3's weight-gradient scaling: K is the tokens): A
// scales [k-blocks, m] and B scales [k-blocks, n], fp32, both loaded with the stage. Each k-block's product goes
// into fresh fp32 accumulators, then is promoted: acc[i][j] += (a_scale[i] * b_scale[j]) * partial[i][j]
// (mainloop_k_scaled). The weight-gradient GEMM's FP8 operands (weight_grad_gemm.cuh).
struct Fp8KScaledMainloop : DenseOperands<cutlass::float_e4m3_t, OperandMajor::kK, OperandMajor::kK> {
  static constexpr bool kKScaled = true;
};

template <class T>
concept KScaled = requires { requires T::kKScaled; };

// The A scales of every stage (block-scaled operands only; a base of GemmSharedStorage, empty otherwise, so
// that a bf16 GEMM's bytes do not move): one fp32 per tile row per stage, written by the stage's TMA.
template <int kStages, int kBlockM>
struct ScaleStages {
  alignas(128) float a_scales[kStages][kBlockM];
};
struct NoScales {};
// Both operands' scales of every stage (KScaled operands): one fp32 per tile row of A and per tile row of B.
template <int kStages, int kBlockM, int kBlockN>
struct KScaleStages {
  alignas(128) float a_scales[kStages][kBlockM];
  alignas(128) float b_scales[kStages][kBlockN];
};

// Mainloops per task: the traits' kPasses where they have one (the expert GEMM's: SwiGLUQuantEpilogue runs two),
// else 1 (the weight gradient's).
template <class T>
inline constexpr int kTilePasses = [] {
  if constexpr (requires { T::kPasses; })
    return static_cast<int>(T::kPasses);
  else
    return 1;
}();

// An epilogue that keeps each pass's results in registers (a carry) and writes the task's output from them after
// the last pass (SwiGLUQuantEpilogue: its 1 x 128 scales need a whole 128-column block of h).
template <class T>
concept KeepsCarry = requires { typename T::Epilogue::template CarryOf<T>; };

// A configuration whose A stages the producer's threads write with cp.async (row_gather.cuh) instead of TMA.
template <class T>
concept GathersRows = requires { requires T::kGatherRows; };

// How a tile's accumulators start (see the header).
enum class AccumulatorStart : int { kFirstWgmmaOverwrites = 0, kZeroed = 1 };

// The kernel's task hand-off when it keeps none beside the tiles' bytes (the megakernels keep theirs beside).
struct NoTasks {};

// A GEMM CTA's shared memory: one type for every tile kind of one shape and staging size, whatever its
// operand majors or epilogue (no reinterpretation between tile kinds). Staging boxes are 64 rows x 128 bytes:
// bf16 64 columns, fp32 32, in the TMA's 128-byte swizzle (1024-byte aligned: the swizzle is a function of the
// address bits [4, 10)).
template <class Element, int kBlockM, int kBlockN, int kBlockK, int kStages, int kStagingBoxes, class Tasks = NoTasks,
          class Scales = NoScales>
struct GemmSharedStorage : Scales {
  static constexpr int kStagingBoxBytes = 64 * 128;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  // The same bytes without a task hand-off: the megakernels' tiles, beside their own task ring.
  using Tiles = GemmSharedStorage<Element, kBlockM, kBlockN, kBlockK, kStages, kStagingBoxes, NoTasks, Scales>;

  alignas(1024) cute::array_aligned<Element, kBlockM * kBlockK * kStages> a;
  alignas(1024) cute::array_aligned<Element, kBlockN * kBlockK * kStages> b;
  alignas(1024) uint8_t staging[kBlockM / 64][kStagingBoxes][kStagingBoxBytes];  // one pass of output columns
  typename Pipeline::SharedStorage pipeline;
  Tasks tasks;
};

// The collective: tile shape + operand policy -> stage layouts, the tiled wgmma, the pipeline, the register
// budget and the shared memory. One consumer warpgroup per 64 rows of the tile, one producer warpgroup.
template <class Operands_, int kBlockM_, int kBlockN_, int kBlockK_, int kStages_>
struct CollectiveMainloop {
  using Operands = Operands_;
  using Element = typename Operands::Element;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;  // accumulator columns per tile (wgmma N)
  static constexpr int kBlockK = kBlockK_;  // k per stage
  static constexpr int kStages = kStages_;
  static_assert(kBlockM == 64 || kBlockM == 128, "one consumer warpgroup per 64 rows");
  static_assert(kBlockN % 32 == 0 && kBlockN <= 256, "wgmma N");
  // The N of one wgmma: the tile's, except a scaled tile of 256 columns (block- or K-scaled), whose product is two
  // wgmmas of 128 columns promoted in turn through one 64-value partial (mainloop_block_scaled, mainloop_k_scaled):
  // a 256-column partial beside the 128 promoted values a thread would not fit in its registers.
  static constexpr bool kScaledOperands = BlockScaled<Operands_> || KScaled<Operands_>;
  static constexpr int kMmaN = kScaledOperands && kBlockN_ == 256 ? 128 : kBlockN_;
  static constexpr int kNSplits = kBlockN / kMmaN;
  static_assert(kBlockK % 16 == 0 && kBlockK * sizeof(Element) <= 128, "wgmma K steps within one swizzle row");
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // Registers per thread after setmaxnreg: the producer gives most of its share to the consumers.
  // setmaxnreg only moves registers within what the CTA got at launch (65536 / kThreads, rounded down to
  // 8, per thread): asking for more makes setmaxnreg.inc wait forever (a hang, seen with 48 / 232).
  // A scaled tile wider than 128 columns keeps 128 promoted and 64 partial values a thread: 232 registers for its
  // consumers, 40 left to the producer (which only issues TMA loads).
  static constexpr bool kWideScaled = kScaledOperands && kBlockN_ > 128;
  static constexpr int kProducerRegisters = kWideScaled ? 40 : 48;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? (kWideScaled ? 232 : 224) : 240;
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kConsumerWarpgroups <= kLaunchRegisters * kThreads,
                "setmaxnreg redistributes the CTA's launch registers, no more");

  using SmemLayoutA = typename Operands::template StageLayout<Operands::kAMajor, kBlockM, kBlockK, kStages>;
  using SmemLayoutB = typename Operands::template StageLayout<Operands::kBMajor, kBlockN, kBlockK, kStages>;
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<64>, cute::Int<kMmaN>, cute::Int<kBlockK>>,
                                 Operands::gmma_major(Operands::kAMajor), Operands::gmma_major(Operands::kBMajor)>(),
      cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>{}));

  static constexpr int kTaskDepth = 4;  // tasks a producer may publish ahead of its consumers
  // Named barrier (CUTLASS ids, offset past the reserved ones) of consumer warpgroup w's epilogue staging:
  // kStagingBarrier + w, in every tile kind, so tiles of several kinds share one kernel without a barrier each.
  static constexpr int kStagingBarrier = 1;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
  static constexpr bool kBlockScaled = BlockScaled<Operands>;
  static constexpr bool kKScaled = KScaled<Operands>;
  static constexpr int kBlockKCols = 128;  // columns of k per block scale
  static_assert(!(kBlockScaled || kKScaled) || kBlockK == kBlockKCols, "a scaled stage is one scale block of k");
  // A stage: A and B tiles, and with block scales the tile rows' A scales (K-scaled: and B's).
  static constexpr uint32_t kStageTransactionBytes =
      (kBlockM + kBlockN) * kBlockK * sizeof(Element) +
      (kBlockScaled ? kBlockM * sizeof(float) : kKScaled ? (kBlockM + kBlockN) * sizeof(float) : 0);
  using Scales = std::conditional_t<kBlockScaled, ScaleStages<kStages, kBlockM>,
                                    std::conditional_t<kKScaled, KScaleStages<kStages, kBlockM, kBlockN>, NoScales>>;

  template <int kStagingBoxes, class Tasks = NoTasks>
  using Storage = GemmSharedStorage<Element, kBlockM, kBlockN, kBlockK, kStages, kStagingBoxes, Tasks, Scales>;
  static_assert(cute::cosize_v<SmemLayoutA> == kBlockM * kBlockK * kStages &&
                    cute::cosize_v<SmemLayoutB> == kBlockN * kBlockK * kStages,
                "GemmSharedStorage's stages hold the layouts exactly");
};

// Bounded pipeline waits (every GEMM kernel's: the megakernels' and the standalone ones'). The fast path is
// CUTLASS's one try_wait; only a stage that is not ready yet polls the timer (docs/sync_protocol.md).
// The producer's acquire returns false when it gave up (the caller stops issuing). The consumers' wait
// goes on after a give-up as if the stage were full (garbage, in bounds): their control flow around wgmma
// stays warp-uniform, and every later hand-off gives up at once (kAbortHandoff), so the kernel ends.
// Waits until the consumers released `state`'s stage; false when the wait gave up.
template <class Pipeline, class State>
__device__ __forceinline__ bool stage_free_bounded(Pipeline& pipeline, const State& state,
                                                   const device::HandoffBound& bound) {
  const auto free = [&] { return pipeline.producer_try_acquire(state) == cutlass::BarrierStatus::WaitDone; };
  return free() ||
         device::handoff_wait_slow(free, bound, Role::kGemmProducer, CounterId::kPipelineEmpty, state.index());
}

template <class Pipeline, class State>
__device__ __forceinline__ bool producer_acquire_bounded(Pipeline& pipeline, const State& state,
                                                         const device::HandoffBound& bound) {
  if (!stage_free_bounded(pipeline, state, bound)) return false;
  pipeline.producer_acquire(state, cutlass::BarrierStatus::WaitDone);  // arms the transaction bytes; no wait left
  return true;
}

// CUTLASS's producer_tail, bounded. Why: neither CTA may exit while its consumers, or the partner CTA's,
// still release stages into it.
template <class Pipeline, class State>
__device__ __forceinline__ void producer_tail_bounded(Pipeline& pipeline, State state, const device::HandoffBound& bound) {
  for (int stage = 0; stage < int(Pipeline::Stages); ++stage, ++state)
    if (!stage_free_bounded(pipeline, state, bound)) return;
}

template <class Pipeline, class State>
__device__ __forceinline__ void consumer_wait_bounded(Pipeline& pipeline, const State& state,
                                                      const device::HandoffBound& bound) {
  if (pipeline.consumer_try_wait(state) == cutlass::BarrierStatus::WaitDone) return;
  device::handoff_wait_slow([&] { return pipeline.consumer_try_wait(state) == cutlass::BarrierStatus::WaitDone; },
                            bound, Role::kGemmConsumer, CounterId::kPipelineFull, state.index());
}

// The stage hand-back of a consumer warpgroup whose rows are not part of the tile (a 64-row task, or rows
// past m): the other warpgroup computes alone; this one waits for each stage and releases it at once.
template <class Pipeline, class State>
__device__ __forceinline__ void pass_stages_back(int num_k_blocks, Pipeline& pipeline, State& read_state,
                                                 const device::HandoffBound& bound) {
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    consumer_wait_bounded(pipeline, read_state, bound);
    pipeline.consumer_release(read_state);
    ++read_state;
  }
}

// A consumer warpgroup's wgmma operands: its partition of the A (B) stages as shared-memory descriptors.
template <class C, class Storage, class ThreadMma>
__device__ __forceinline__ auto stage_operand_a(Storage& smem, const ThreadMma& thread_mma) {
  auto s_a = cute::make_tensor(cute::make_smem_ptr(smem.a.data()), typename C::SmemLayoutA{});
  return thread_mma.make_fragment_A(thread_mma.partition_A(s_a));
}
template <class C, class Storage, class ThreadMma>
__device__ __forceinline__ auto stage_operand_b(Storage& smem, const ThreadMma& thread_mma) {
  auto s_b = cute::make_tensor(cute::make_smem_ptr(smem.b.data()), typename C::SmemLayoutB{});
  return thread_mma.make_fragment_B(thread_mma.partition_B(s_b));
}

// The mainloop of an active consumer warpgroup: accum = its rows of A · B over num_k_blocks stages, one wgmma
// batch in flight; a stage is released once the batch after it issued and the batch that read it retired.
template <class Collective, AccumulatorStart kStart, class Storage, class ThreadMma, class Accum>
__device__ __forceinline__ void mainloop(int num_k_blocks, Storage& smem, typename Collective::Pipeline& pipeline,
                                         typename Collective::PipelineState& read_state,
                                         typename Collective::TiledMma& mma, const ThreadMma& thread_mma, Accum& accum,
                                         const device::HandoffBound& bound) {
  using namespace cute;
  using C = Collective;
  using Element = typename C::Element;
  static_assert(sizeof(smem.a) == sizeof(Element) * cosize_v<typename C::SmemLayoutA> &&
                    sizeof(smem.b) == sizeof(Element) * cosize_v<typename C::SmemLayoutB>,
                "the tile's stages are the collective's");
  Tensor t_r_a = stage_operand_a<C>(smem, thread_mma);  // (MMA, MMA_M, MMA_K, S)
  Tensor t_r_b = stage_operand_b<C>(smem, thread_mma);  // (MMA, MMA_N, MMA_K, S)
  typename C::PipelineState release_state = read_state;
  if constexpr (kStart == AccumulatorStart::kZeroed) {
    clear(accum);
    mma.accumulate_ = GMMA::ScaleOut::One;
  } else {
    mma.accumulate_ = GMMA::ScaleOut::Zero;
  }
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    consumer_wait_bounded(pipeline, read_state, bound);
    // Why: gathered A chunks were written through the generic proxy; wgmma reads them through the async proxy.
    if constexpr (GathersRows<C>) cutlass::arch::fence_view_async_shared();
    const int stage = read_state.index();
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int k = 0; k < size<2>(t_r_a); ++k) {
      cute::gemm(mma, t_r_a(_, _, k, stage), t_r_b(_, _, k, stage), accum);
      if constexpr (kStart == AccumulatorStart::kFirstWgmmaOverwrites) mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();
    warpgroup_fence_operand(accum);
    if (k_block > 0) {
      pipeline.consumer_release(release_state);
      ++release_state;
    }
    ++read_state;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(accum);
  if (num_k_blocks > 0) {
    pipeline.consumer_release(release_state);
    ++release_state;
  }
}

// The scaled mainloops' operands and per-k-block product: the stage's wgmma batch of one split (the B rows
// [split kMmaN, (split + 1) kMmaN) of the stage; one split unless the tile is wider than a wgmma) into fresh fp32
// accumulators (`partial`, one split's fragment: the first wgmma overwrites it), issued, then waited for before
// the caller promotes it into its accumulators; the stage is handed back after its last split (retire).
template <class OperandA, class OperandB, class Partial>
struct ScaledProduct {
  OperandA t_r_a;  // (MMA, MMA_M, MMA_K, S), MMA_M = 1
  OperandB t_r_b;  // (MMA, MMA_N, MMA_K, S), MMA_N = the splits
  Partial partial;  // (MMA)

  template <class Mma>
  __device__ __forceinline__ void issue(Mma& mma, int stage, int split = 0) {
    using namespace cute;
    warpgroup_fence_operand(partial);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(t_r_a); ++k) {
      cute::gemm(mma, t_r_a(_, 0, k, stage), t_r_b(_, split, k, stage), partial);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  }

  // The batch issued last has completed: `partial` holds its product.
  __device__ __forceinline__ void wait() {
    cute::warpgroup_wait<0>();
    cute::warpgroup_fence_operand(partial);
  }

  // Once the stage's operands (and whatever else of it the caller read) are no longer needed.
  template <class Pipeline, class State>
  __device__ __forceinline__ void retire(Pipeline& pipeline, State& read_state) {
    wait();
    pipeline.consumer_release(read_state);
    ++read_state;
  }
};

template <class Collective, class Storage, class ThreadMma, class Accum>
__device__ __forceinline__ auto scaled_product(Storage& smem, const ThreadMma& thread_mma, const Accum& accum) {
  using A = decltype(stage_operand_a<Collective>(smem, thread_mma));
  using B = decltype(stage_operand_b<Collective>(smem, thread_mma));
  using P = decltype(cute::make_fragment_like(accum(cute::_, 0, 0)));
  static_assert(decltype(cute::size<1>(accum))::value == 1 &&
                    decltype(cute::size<2>(accum))::value == Collective::kNSplits,
                "a warpgroup's 64 rows, one (MMA) fragment per split");
  return ScaledProduct<A, B, P>{stage_operand_a<Collective>(smem, thread_mma),
                                stage_operand_b<Collective>(smem, thread_mma),
                                cute::make_fragment_like(accum(cute::_, 0, 0))};
}

// The mainloop of an active consumer warpgroup with block-scaled (FP8) operands: per k-block, the stage's
// product into fresh fp32 accumulators (`partial`: the first wgmma overwrites), then
//   accum[i] += (a_scale[row of i] * b_scale[64-column group of i]) * partial[i]
// in ascending k-block order, so each output element is one fixed-order sum (deterministic). The wgmma batch
// is waited for before the promotion: the other consumer warpgroup's batch runs meanwhile (DeepGEMM's
// overlap). A 256-column tile does this per k-block for each 128-column split in turn (kNSplits; its values
// [64 s, 64 s + 64) are split s's columns), through the one partial. row0 / row1: the tile rows of the thread's
// fragment rows (values i with (i / 2) % 2 = 0 / 1); values [32 g, 32 g + 32) are columns [64 g, 64 g + 64), group g
// (gemm_epilogue.cuh's fragment layout). b_scales[g]: group g's B scales per k-block
// (BlockScaledParams::b_scale_group).
template <class Collective, class Storage, class ThreadMma, class Accum, int kGroups>
__device__ __forceinline__ void mainloop_block_scaled(int num_k_blocks, Storage& smem,
                                                      typename Collective::Pipeline& pipeline,
                                                      typename Collective::PipelineState& read_state,
                                                      typename Collective::TiledMma& mma, const ThreadMma& thread_mma,
                                                      Accum& accum, int row0, int row1,
                                                      const float* const (&b_scales)[kGroups],
                                                      const device::HandoffBound& bound) {
  using namespace cute;
  auto product = scaled_product<Collective>(smem, thread_mma, accum);
  constexpr int kValues = decltype(size(accum))::value;
  static_assert(kGroups * 64 == Collective::kBlockN && kValues == 32 * kGroups, "32 values a 64-column group");
  clear(accum);
  constexpr int kSplits = Collective::kNSplits, kSplitValues = kValues / kSplits, kSplitGroups = kGroups / kSplits;
  // B scales: read one k-block ahead, so their load's latency hides behind the stage wait and the wgmma. (Round 34
  // loaded a split tile's at the top of their k-block, a register saving tried while ptxas spilled; with opaque
  // epilogue coordinates both schemes fit, and the one-ahead one made the fused FP8 forward 2-5 % faster on an
  // H100: docs/perf_notes.md, round 35.)
  float next_b[kGroups];
  CUTE_UNROLL
  for (int g = 0; g < kGroups; ++g) next_b[g] = num_k_blocks > 0 ? __ldg(b_scales[g]) : 0.0f;
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    consumer_wait_bounded(pipeline, read_state, bound);
    const int stage = read_state.index();
    const float a0 = smem.a_scales[stage][row0], a1 = smem.a_scales[stage][row1];
    float b[kGroups];
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) b[g] = next_b[g];
    if (k_block + 1 < num_k_blocks) {
      CUTE_UNROLL
      for (int g = 0; g < kGroups; ++g) next_b[g] = __ldg(b_scales[g] + k_block + 1);
    }
    CUTE_UNROLL
    for (int split = 0; split < kSplits; ++split) {
      product.issue(mma, stage, split);
      if (split + 1 < kSplits)
        product.wait();
      else
        product.retire(pipeline, read_state);  // its operands and A scales are read
      float scale[2][kSplitGroups];  // of the split's 64-column groups
      CUTE_UNROLL
      for (int g = 0; g < kSplitGroups; ++g) {
        scale[0][g] = a0 * b[split * kSplitGroups + g];
        scale[1][g] = a1 * b[split * kSplitGroups + g];
      }
      CUTE_UNROLL
      for (int i = 0; i < kSplitValues; ++i)
        accum(split * kSplitValues + i) += scale[(i / 2) % 2][i / 32] * product.partial(i);
    }
  }
}

// The mainloop of an active consumer warpgroup with K-scaled (FP8 weight-gradient) operands: per k-block, the
// stage's product into fresh fp32 accumulators (`partial`: the first wgmma overwrites), then
//   accum[i] += (a_scale[row of i] * b_scale[column of i]) * partial[i]
// in ascending k-block order (one fixed-order sum per element: deterministic). Both scales come with the stage
// (KScaleStages); the A scales are read while the wgmma runs, the B scales from the stage as the product is
// promoted (a split's 32 held in registers beside the 128 promoted and 64 partial values spilled: ptxas), and the
// stage is released after the last split's promotion. A 256-column tile does this per k-block for each 128-column
// split in turn (kNSplits; its values [64 s, 64 s + 64) are split s's columns) through the one partial, as
// mainloop_block_scaled does. row0 / row1: the thread's fragment rows (values i with (i / 2) % 2 = 0 / 1); col0:
// its first column, value i's column is col0 + i % 2 + 8 (i / 4) (gemm_epilogue.cuh's fragment layout).
template <class Collective, class Storage, class ThreadMma, class Accum>
__device__ __forceinline__ void mainloop_k_scaled(int num_k_blocks, Storage& smem,
                                                  typename Collective::Pipeline& pipeline,
                                                  typename Collective::PipelineState& read_state,
                                                  typename Collective::TiledMma& mma, const ThreadMma& thread_mma,
                                                  Accum& accum, int row0, int row1, int col0,
                                                  const device::HandoffBound& bound) {
  using namespace cute;
  auto product = scaled_product<Collective>(smem, thread_mma, accum);
  constexpr int kValues = decltype(size(accum))::value;
  constexpr int kSplits = Collective::kNSplits, kSplitValues = kValues / kSplits;
  constexpr int kColumnPairs = kSplitValues / 4;  // the thread's 2-column groups of a split: 8 columns apart
  static_assert(kValues * 2 == Collective::kBlockN, "a 64-row warpgroup's kBlockN columns, 128 threads");
  clear(accum);
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    consumer_wait_bounded(pipeline, read_state, bound);
    const int stage = read_state.index();
    float a0 = 0.0f, a1 = 0.0f;
    CUTE_UNROLL
    for (int split = 0; split < kSplits; ++split) {
      product.issue(mma, stage, split);
      if (split == 0) a0 = smem.a_scales[stage][row0], a1 = smem.a_scales[stage][row1];
      const float* b_scales = &smem.b_scales[stage][split * Collective::kMmaN + col0];
      product.wait();
      CUTE_UNROLL
      for (int j = 0; j < kColumnPairs; ++j) {
        const float2 b = *reinterpret_cast<const float2*>(b_scales + 8 * j);
        CUTE_UNROLL
        for (int i = 4 * j; i < 4 * j + 4; ++i) {
          const float a = (i / 2) % 2 == 0 ? a0 : a1;
          const float bj = i % 2 == 0 ? b.x : b.y;
          accum(split * kSplitValues + i) += (a * bj) * product.partial(i);
        }
      }
    }
    pipeline.consumer_release(read_state);  // its operands and scales are read
    ++read_state;
  }
}

// A block-scaled tile's B scale rows, one per 64-column group (BlockScaledParams::b_scale_group).
template <class T, class Params>
__device__ __forceinline__ void b_scale_groups(const Params& p, const TileTask& task,
                                               const float* (&rows)[T::kBlockN / 64]) {
  CUTE_UNROLL
  for (int g = 0; g < T::kBlockN / 64; ++g) rows[g] = p.template b_scale_group<T::kHalfN>(task, g);
}

// Consumer side of one tile, every GEMM's: mainloop over the tile's k-blocks, then the epilogue policy's
// finish. All consumer threads call this; consumer_idx is the thread's index among the consumer warpgroups.
// The task mode (T::Walker: task_walker.cuh) says how many k-blocks the tile has, whether this warpgroup's
// rows are part of it (one that is not only passes the stages back: the other computes alone) and how the
// accumulators start. signal (nullable; the megakernel's, the calling thread's own): the late completion count
// a row tile of this warpgroup left pending (RowsDoneSignal); rows_done: see RowTileEpilogue.
template <class T, class Params, class Task, class Storage>
__device__ __forceinline__ void compute_tile(const Params& p, const Task& task, Storage& smem,
                                             typename T::Pipeline& pipeline, typename T::PipelineState& read_state,
                                             int consumer_idx, uint64_t* rows_done, RowsDoneSignal* signal,
                                             const device::HandoffBound& bound) {
  using namespace cute;
  using Walker = typename T::Walker;
  typename T::TiledMma mma;
  auto thread_mma = mma.get_thread_slice(consumer_idx);
  Tensor accum = partition_fragment_C(mma, Shape<Int<T::kBlockM>, Int<T::kBlockN>>{});  // (MMA, MMA_M, MMA_N)
  // Why the shuffle: ptxas serializes every wgmma of the kernel (warning C7518) unless it can prove the
  // branches around them warp-uniform; a value broadcast from lane 0 is (consumer_tile broadcasts its own).
  const int warpgroup = __shfl_sync(0xffffffff, consumer_idx / 128, 0);
  const auto tile = Walker::consumer_tile(p, task, warpgroup);
  const bool store_leader = consumer_idx % 128 == 0;
  RowsDoneSignal::flush_before_blocking(signal, store_leader && tile.may_block, pipeline, read_state);
  if (!tile.active) {
    if constexpr (kTilePasses<T> > 1)
      pass_stages_back(tile.num_k_blocks * T::Epilogue::passes(p, task), pipeline, read_state, bound);
    else
      pass_stages_back(tile.num_k_blocks, pipeline, read_state, bound);
    return;
  }
  T::Epilogue::template prefetch<T>(p, task, warpgroup, consumer_idx % 128);
  if constexpr (BlockScaled<T> && KeepsCarry<T>) {
    // A task of one or several tiles along n (SwiGLUQuantEpilogue: two of 128 x 128, or one of 128 x 256): a
    // mainloop per pass, its results kept in registers by the epilogue, which then writes the task's output from them.
    Tensor coords = thread_mma.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
    typename T::Epilogue::template CarryOf<T> carry;
    carry.passes = T::Epilogue::passes(p, task);
    for (int pass = 0; pass < carry.passes; ++pass) {
      const TileTask sub = T::Epilogue::pass_task(task, pass);
      const float* b_rows[T::kBlockN / 64];
      b_scale_groups<T>(p, sub, b_rows);
      mainloop_block_scaled<T>(tile.num_k_blocks, smem, pipeline, read_state, mma, thread_mma, accum,
                               get<0>(coords(0)), get<0>(coords(2)), b_rows, bound);
      // One keep for both passes, then its values into the pass's part of the carry by constant indices (a
      // runtime index would put the carry in local memory). Why not a keep per branch: each is the SwiGLU of 32
      // values, and code size counts here: perf_notes round 17.
      std::remove_reference_t<decltype(carry.h[0])> fresh;
      T::Epilogue::template keep<T>(p, task, accum, coords, fresh);
      // A training context's bf16 g | u and h of the pass (SwiGLUQuantEpilogue<true>; nothing otherwise).
      T::Epilogue::template store_side_outputs<T>(p, task, pass, accum, consumer_idx, fresh, smem, warpgroup,
                                                  store_leader, signal);
      constexpr int kPairs = sizeof(fresh) / sizeof(fresh[0]);
      if (pass == 0) {
        CUTE_UNROLL
        for (int v = 0; v < kPairs; ++v) carry.h[0][v] = fresh[v];
      } else if constexpr (T::Epilogue::kPasses > 1) {
        CUTE_UNROLL
        for (int v = 0; v < kPairs; ++v) carry.h[1][v] = fresh[v];
      }
    }
    T::Epilogue::template finish<T>(p, task, tile, carry, mma, smem, warpgroup, consumer_idx, store_leader, rows_done,
                                    signal);
  } else {
    if constexpr (BlockScaled<T>) {
      Tensor coords = thread_mma.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
      const float* b_rows[T::kBlockN / 64];
      b_scale_groups<T>(p, task, b_rows);
      mainloop_block_scaled<T>(tile.num_k_blocks, smem, pipeline, read_state, mma, thread_mma, accum,
                               get<0>(coords(0)), get<0>(coords(2)), b_rows, bound);
    } else if constexpr (KScaled<T>) {
      Tensor coords = thread_mma.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
      mainloop_k_scaled<T>(tile.num_k_blocks, smem, pipeline, read_state, mma, thread_mma, accum, get<0>(coords(0)),
                           get<0>(coords(2)), get<1>(coords(0)), bound);
    } else {
      mainloop<T, Walker::kAccumulatorStart>(tile.num_k_blocks, smem, pipeline, read_state, mma, thread_mma, accum,
                                             bound);
    }
    T::Epilogue::template finish<T>(p, task, tile, accum, mma, smem, warpgroup, consumer_idx, store_leader, rows_done,
                                    signal);
  }
}

// A persistent GEMM CTA's start: its TMA pipeline over `smem` and its task ring, initialized by thread 0,
// then a barrier over the cluster. Why the cluster: the partner CTA arrives on our barriers and multicasts
// into our shared memory; both CTAs' barrier initialization must be visible cluster-wide first.
template <class T, class Storage, class TaskRingT>
__device__ __forceinline__ typename T::Pipeline start_pipeline(Storage& smem, TaskRingT& tasks, bool consumer) {
  typename T::Pipeline::Params params;
  params.transaction_bytes = T::kStageTransactionBytes;
  params.role = consumer ? T::Pipeline::ThreadCategory::Consumer : T::Pipeline::ThreadCategory::Producer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = 128 * T::kConsumerWarpgroups;
  // A gathering configuration's full barrier: thread 0's arrive.expect_tx plus each gathering thread's
  // cp.async.mbarrier.arrive.noinc (row_gather.cuh).
  if constexpr (GathersRows<T>) params.num_producers = 1 + T::kGatherThreads;
  typename T::Pipeline pipeline(smem.pipeline, params, typename T::ClusterShape{});
  if (threadIdx.x == 0) {
    tasks.init();
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (T::kClusterN > 1)
    cute::cluster_sync();
  else
    __syncthreads();
  return pipeline;
}

}  // namespace mok::gemm
