// Host side of a grouped GEMM's kernel parameters: the TMA descriptors and row/weight arithmetic of
// src/device/gemm/expert_gemm.cuh, built from ExpertGemmArgs. Shared by the standalone expert GEMM launch
// (src/host/expert_gemm.cu) and the forward megakernel's (src/host/moe_fused.cu), so both run the same tiles.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mok/expert_gemm.h"
#include "src/device/gemm/expert_gemm.cuh"

namespace mok::detail {

// The tile configurations every launch uses (the standalone GEMM and the megakernel): 128 x 256 accumulator
// tiles, 4 stages, clusters of 1 or 2.
template <int kClusterN>
using SwiGLUTraits = gemm::GemmTraits<128, 256, 4, gemm::Epilogue::kSwiGLU, kClusterN>;
template <int kClusterN>
using StoreTraits = gemm::GemmTraits<128, 256, 4, gemm::Epilogue::kStore, kClusterN>;

// The ticket and trace fields are left empty; the caller sets what its launch uses.
template <class Traits>
auto make_gemm_params(const ExpertGemmArgs& args) {
  using namespace cute;
  using T = Traits;
  using Element = typename T::Element;
  const bool swiglu = args.epilogue == GemmEpilogue::kSwiGLU;
  const bool fused = swiglu && args.b_up == nullptr;
  const int64_t b_expert_rows = fused ? 2 * int64_t(args.n) : args.n;
  const int64_t b_rows = int64_t(args.local_experts) * b_expert_rows;

  auto g_a = make_tensor(make_gmem_ptr(static_cast<const Element*>(args.a)), make_shape(args.a_rows, int64_t(args.k)),
                         make_stride(int64_t(args.k), _1{}));
  // With clusters, each CTA loads its share of the A tile's rows and multicasts it (the box is the share,
  // not split further across CTAs).
  using TmaLoadA = std::conditional_t<(T::kClusterN > 1), SM90_TMA_LOAD_MULTICAST, SM90_TMA_LOAD>;
  auto tma_a = make_tma_copy(TmaLoadA{}, g_a, typename T::SmemLayoutACta{},
                             Shape<Int<T::kCtaRowsA>, Int<T::kBlockK>>{}, Int<1>{});
  auto make_b = [&](const void* ptr) {
    auto g_b = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), make_shape(b_rows, int64_t(args.k)),
                           make_stride(int64_t(args.k), _1{}));
    return make_tma_copy(SM90_TMA_LOAD{}, g_b, typename T::SmemLayoutBHalf{});
  };
  auto tma_b0 = make_b(args.b);
  auto tma_b1 = make_b(swiglu && !fused ? args.b_up : args.b);

  const int64_t out_cols = args.n;  // SwiGLU: n hidden columns from 2n accumulator columns
  auto g_out = make_tensor(make_gmem_ptr(static_cast<Element*>(args.out)), make_shape(args.a_rows, out_cols),
                           make_stride(out_cols, _1{}));
  auto tma_out = make_tma_copy(SM90_TMA_STORE{}, g_out, typename T::SmemLayoutOutBox{});

  gemm::GemmParams<decltype(tma_a), decltype(tma_b0), decltype(tma_out)> p{tma_a, tma_b0, tma_b1, tma_out};
  p.a_rows = args.a_rows;
  p.b_rows = b_rows;
  p.k = args.k;
  p.local_experts = args.local_experts;
  p.num_n_blocks = T::n_blocks(args.n);  // the last one may be partial (n % 64 == 0)
  p.b_expert_rows = b_expert_rows;
  if (swiglu) {  // half 0: gate rows, half 1: up rows of the same output columns
    p.b_half_offset0 = 0;
    p.b_half_offset1 = fused ? args.n : 0;
    p.b_block_step = T::kHalfN;
  } else {  // two halves of kBlockN consecutive rows
    p.b_half_offset0 = 0;
    p.b_half_offset1 = T::kHalfN;
    p.b_block_step = T::kBlockN;
  }
  p.expert_counts = args.expert_counts;
  p.expert_row_offsets = args.expert_row_offsets;
  p.scheduled_rows = args.scheduled_rows;
  p.row_scale = args.row_scale;
  p.swiglu_limit = args.swiglu_limit;
  p.out_cols = out_cols;
  return p;
}

}  // namespace mok::detail
