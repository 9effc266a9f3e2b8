// Host side of the weight-gradient GEMM's kernel parameters: the tile configurations and the TMA
// descriptors of src/device/gemm/weight_grad_gemm.cuh, built from WeightGradArgs. Shared by the standalone
// launch (src/host/weight_grad_gemm.cu) and the backward megakernel's, so both run the same tiles: the
// megakernel's in the expert GEMM's shared memory (WeightGradTraitsInGemmLayout, weight_grad_gemm.cuh), each GEMM's
// output mode a run-time value (make_any_weight_grad_params).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "mok/weight_grad_gemm.h"
#include "src/device/gemm/weight_grad_gemm.cuh"
#include "src/host/gemm_params.h"

namespace mok::detail {

// The tile configurations every launch uses: 128 x 256 tiles, and beside the whole tile's staging as
// many stages as fit in 227 KB of shared memory (the launch checks the device's limit). bf16 (64 KB of
// staging): 3 stages of 64 rows (48 KB each). fp32 (128 KB): 4 stages of 32 rows (24 KB each) rather than 2
// of 64: the same bytes, but a released stage is needed again 3 half-k-blocks later instead of 1 k-block
// later, so a TMA load has 1.5x the time to arrive (a stage is released once the next one's wgmma issued).
template <GradOutput kOutput>
using WeightGradConfig = std::conditional_t<kOutput == GradOutput::kBFloat16,
                                            gemm::WeightGradTraits<kOutput, 256, 64, 3>,
                                            gemm::WeightGradTraits<kOutput, 256, 32, 4>>;

// The FP8 configuration (Precision::kFP8: e4m3 operands K-major, scaled per column per 128 rows): 128 x 256
// tiles, each k-block's product two wgmmas of 128 columns promoted in turn through one partial (mainloop_k_scaled:
// 128 promoted and 64 partial values a thread), 3 stages of 128 rows (48 KB and 1.5 KB of scales each) and 64 KB
// of staging: the whole tile in bf16, half of it (two passes) in fp32.
template <GradOutput kOutput>
using Fp8WeightGradConfig = gemm::WeightGradTraits<kOutput, 256, 128, 3, kOutput == GradOutput::kBFloat16 ? 256 : 128,
                                                   gemm::Fp8KScaledMainloop>;
// WeightGradArgs::b_block_scales (docs/design.md, "FP8 weight gradients"): b scaled per 128 rows x 128 columns, so
// each k-block is promoted as the forward's block-scaled tiles are (mainloop_block_scaled: one FMA a value).
template <GradOutput kOutput>
using Fp8BlockBWeightGradConfig =
    gemm::WeightGradTraits<kOutput, 256, 128, 3, kOutput == GradOutput::kBFloat16 ? 256 : 128, gemm::Fp8Mainloop>;

// The ticket is left empty; the caller sets what its launch uses. validate(args) first.
template <class Traits>
auto make_weight_grad_params(const WeightGradArgs& args) {
  using namespace cute;
  using T = Traits;
  using Element = typename T::Element;
  using OutElement = typename T::OutElement;
  const int64_t rows = args.rows_allocated;
  // bf16: a [rows, m] row-major seen as (m, rows) with m contiguous: the MN-major operand A = aᵀ; b likewise.
  // FP8: a [m, rows] row-major, the K-major A itself; b likewise.
  auto make_load = [&](const void* ptr, int cols) {
    const auto stride = [&] {
      if constexpr (T::kFp8)
        return make_stride(rows, _1{});
      else
        return make_stride(_1{}, int64_t(cols));
    }();
    auto g = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), make_shape(int64_t(cols), rows), stride);
    return make_tma_copy(SM90_TMA_LOAD{}, g, typename T::SmemLayoutLoadBox{});
  };
  auto tma_a = make_load(args.a, args.m);
  auto tma_b = make_load(args.b, args.n);

  const bool split = args.out_split != nullptr;
  const int m_split = split ? args.m_split : args.m;
  using StoreOp = std::conditional_t<T::kOutput == GradOutput::kAccumulateFloat32, SM90_TMA_REDUCE_ADD, SM90_TMA_STORE>;
  // One expert's gradient is `out_rows` consecutive rows of n columns: [E_local * out_rows, n].
  auto make_store = [&](void* ptr, int64_t out_rows) {
    auto g = make_tensor(make_gmem_ptr(static_cast<OutElement*>(ptr)),
                         make_shape(int64_t(args.local_experts) * out_rows, int64_t(args.n)),
                         make_stride(int64_t(args.n), _1{}));
    return make_tma_copy(StoreOp{}, g, typename T::SmemLayoutStoreBox{});
  };
  auto tma_out = make_store(args.out, m_split);
  // Without out_split no row reaches it (m_split = m); the descriptor only has to be a valid one.
  auto tma_out_split = split ? make_store(args.out_split, args.m - args.m_split) : tma_out;

  // The traits name the TMA copies' types.
  gemm::WeightGradParams<typename T::TmaLoad, typename T::TmaStore> p{tma_a, tma_b, tma_out, tma_out_split};
  p.rows = rows;
  p.m = args.m;
  p.n = args.n;
  p.m_split = m_split;
  p.local_experts = args.local_experts;
  p.num_m_blocks = (args.m + T::kBlockM - 1) / T::kBlockM;
  p.num_n_blocks = (args.n + T::kBlockN - 1) / T::kBlockN;
  p.num_tasks = args.local_experts * p.num_m_blocks * p.num_n_blocks;  // validate() bounds it
  p.expert_row_offsets = args.expert_row_offsets;
  p.scheduled_rows = args.scheduled_rows;
  if constexpr (T::kFp8) {  // the scales [rows / 128, cols] as (column, k-block): a box of 128 columns
    auto make_scales = [&](const float* ptr, int cols) {
      auto g = make_tensor(make_gmem_ptr(ptr), make_shape(int64_t(cols), rows / T::kBlockK),
                           make_stride(_1{}, int64_t(cols)));
      return make_tma_copy(SM90_TMA_LOAD{}, g, make_layout(make_shape(Int<T::kBoxColumns>{}, _1{})),
                           Shape<Int<T::kBoxColumns>, _1>{}, Int<1>{});
    };
    if constexpr (T::kBBlockScaled) {  // b's scales read by the consumers; the descriptor only has to be a valid one
      auto a_scales = make_scales(args.a_scales, args.m);
      return typename T::Params{p, a_scales, a_scales, args.b_scales, rows / T::kBlockK};
    } else {
      return typename T::Params{p, make_scales(args.a_scales, args.m), make_scales(args.b_scales, args.n)};
    }
  } else {
    return p;
  }
}

// The megakernel's weight-gradient tiles run in the shared memory and pipeline of its expert GEMM tiles
// (MN-major B: the backward's dgrads; every ExpertGemmTraits has this TileStorage), with and without clusters.
template <GradOutput kOutput, int kClusterN>
inline constexpr bool kGradTilesFitGemmLayout =
    std::is_same_v<typename gemm::WeightGradTraitsInGemmLayout<kOutput>::TileStorage,
                   typename ExpertGemmTraits<MNMajorMainloop, gemm::StoreEpilogue, kClusterN>::TileStorage> &&
    std::is_same_v<typename gemm::WeightGradTraitsInGemmLayout<kOutput>::Pipeline,
                   typename ExpertGemmTraits<MNMajorMainloop, gemm::StoreEpilogue, kClusterN>::Pipeline> &&
    gemm::WeightGradTraitsInGemmLayout<kOutput>::kStageTransactionBytes ==
        ExpertGemmTraits<MNMajorMainloop, gemm::StoreEpilogue, kClusterN>::kStageTransactionBytes;
static_assert(kGradTilesFitGemmLayout<GradOutput::kBFloat16, 1> && kGradTilesFitGemmLayout<GradOutput::kBFloat16, 2> &&
                  kGradTilesFitGemmLayout<GradOutput::kFloat32, 1> && kGradTilesFitGemmLayout<GradOutput::kFloat32, 2> &&
                  kGradTilesFitGemmLayout<GradOutput::kAccumulateFloat32, 1> &&
                  kGradTilesFitGemmLayout<GradOutput::kAccumulateFloat32, 2>,
              "weight-gradient tiles: the expert GEMM's shared memory, pipeline and stage bytes");
static_assert(gemm::WeightGradTraitsInGemmLayout<GradOutput::kFloat32>::kBlockM == WeightGradConfig<GradOutput::kFloat32>::kBlockM &&
                  gemm::WeightGradTraitsInGemmLayout<GradOutput::kFloat32>::kBlockN == WeightGradConfig<GradOutput::kFloat32>::kBlockN,
              "the same tiles as the standalone launch (validate() counts them)");

// validate() but for the ticket (src/host/weight_grad_gemm.cu): the megakernel takes no slots from it.
void validate_weight_grad_operands(const WeightGradArgs& args);

// One weight-gradient GEMM of the megakernel, its output mode args.output: validated as the standalone
// launch validates (but for the ticket), then the mode's parameters in the megakernel's configuration. The
// ticket is args.ticket, possibly null (only the standalone loop over these parameters takes slots).
inline gemm::AnyWeightGradParams make_any_weight_grad_params(const WeightGradArgs& args) {
  validate_weight_grad_operands(args);
  if (args.precision != Precision::kBF16)
    throw std::invalid_argument("weight_grad_gemm: the backward megakernel's weight gradients are bf16 (precision "
                                "kFP8 runs as the standalone kernel)");
  gemm::AnyWeightGradParams any;
  any.output = args.output;
  auto store = [&](auto params) {
    static_assert(sizeof(params) <= sizeof(any.storage) && std::is_trivially_copyable_v<decltype(params)>);
    params.ticket = args.ticket;
    std::memcpy(any.storage, &params, sizeof(params));
  };
  switch (args.output) {
    case GradOutput::kBFloat16:
      store(make_weight_grad_params<gemm::WeightGradTraitsInGemmLayout<GradOutput::kBFloat16>>(args));
      break;
    case GradOutput::kFloat32:
      store(make_weight_grad_params<gemm::WeightGradTraitsInGemmLayout<GradOutput::kFloat32>>(args));
      break;
    case GradOutput::kAccumulateFloat32:
      store(make_weight_grad_params<gemm::WeightGradTraitsInGemmLayout<GradOutput::kAccumulateFloat32>>(args));
      break;
  }
  return any;
}

}  // namespace mok::detail
