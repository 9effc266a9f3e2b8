// Host side of a grouped GEMM's kernel parameters: the TMA descriptors and row/weight arithmetic of
// src/device/gemm/expert_gemm.cuh, built from ExpertGemmArgs. Shared by the standalone expert GEMM launch
// (src/host/expert_gemm.cu) and the forward megakernel's (src/host/moe_fused.cu), so both run the same tiles.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mok/expert_gemm.h"
#include "mok/status.h"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/gemm/gemm_kernel.cuh"
#include "src/host/gemm_test_knobs.h"

namespace mok::detail {

// The tile configurations every launch uses (the standalone GEMM and the megakernel): 128 x 256 accumulator
// tiles, 4 stages, clusters of 1 or 2; the mainloop and epilogue policies vary.
template <class Mainloop, class Epilogue, int kClusterN>
using ExpertGemmTraits = gemm::GemmTraits<128, 256, 4, Mainloop, Epilogue, kClusterN>;
// Operand policies (mainloop.cuh): A K-major (the expert-major rows), B K-major (the forward's weights) or
// MN-major (the backward's dgrads through the same weights).
using KMajorMainloop = gemm::Bf16Mainloop<OperandMajor::kK, OperandMajor::kK>;
using MNMajorMainloop = gemm::Bf16Mainloop<OperandMajor::kK, OperandMajor::kMN>;
// The forward's two (K-major weights, no side outputs).
template <int kClusterN>
using SwiGLUTraits = ExpertGemmTraits<KMajorMainloop, gemm::SwiGLUEpilogue<false>, kClusterN>;
template <int kClusterN>
using StoreTraits = ExpertGemmTraits<KMajorMainloop, gemm::StoreEpilogue, kClusterN>;
// FP8 (Precision::kFP8): 128 x 128 accumulator tiles (a k-block's partial sums beside the promoted ones: two
// accumulator sets), k-blocks of 128, 5 stages of 32 KB.
template <class Epilogue, int kClusterN>
using Fp8GemmTraits = gemm::GemmTraits<128, 128, 5, gemm::Fp8Mainloop, Epilogue, kClusterN>;
// The FP8 store GEMM's wide tile (ExpertGemmArgs::block_n 256, the choice from n = 4096 on), the FP8 megakernel's
// down tile standalone: 128 x 256, its two 128-column halves promoted in turn; 4 stages of 48 KB; staged one
// 64-column box at a time, as in the megakernel, its coordinates opaque (ptxas spilled 108-120 bytes with two boxes a
// pass, 12 with hoisted coordinates). Standalone only (the megakernel has its own traits of the same tile).
template <int kClusterN>
struct Fp8WideStoreTraits
    : gemm::OneBoxStaging<gemm::GemmTraits<128, 256, 4, gemm::Fp8Mainloop, gemm::StoreEpilogue, kClusterN>> {
  static constexpr bool kOpaqueCoordinates = true;
};
// The FP8 gate/up GEMM writing h quantized with one 128 x 256 tile a task (fp8_gate_up_block_n 256, the
// default): A loaded once for the task's 128 gate and 128 up columns instead of once per
// 128 x 128 pass; 4 stages of 48 KB; 232 / 40 registers. The FP8 megakernel's own variant of it is
// Fp8WideMegakernelTraits (src/host/moe_fused.cu: 224 / 56 registers, one staging box).
template <int kClusterN>
using Fp8WideGateUpTraits =
    gemm::GemmTraits<128, 256, 4, gemm::Fp8Mainloop, gemm::SwiGLUQuantEpilogue<false, 1>, kClusterN>;
// The same tile beside the side outputs (a training context's g | u and h; the default there too): 3 stages of 48 KB,
// for the three side-output boxes a warpgroup (4 stages and them would need 242 KB).
template <int kClusterN>
using Fp8WideGateUpSideTraits =
    gemm::GemmTraits<128, 256, 3, gemm::Fp8Mainloop, gemm::SwiGLUQuantEpilogue<true, 1>, kClusterN>;

// A standalone GEMM launch's second kernel argument: its waits' bound (`waits` validated) and the test knob.
inline gemm::StandaloneWaits standalone_waits(const WaitBound& waits, KernelId kernel) {
  return {{waits.status, timeout_ns(waits), waits.rank, kernel}, stalled_producer(kernel)};
}

// The ticket and trace fields are left empty; the caller sets what its launch uses. `args` is validated.
template <class Traits>
auto make_gemm_params(const ExpertGemmArgs& args) {
  using namespace cute;
  using T = Traits;
  using Element = typename T::Element;
  constexpr GemmEpilogue kEpilogue = T::kEpilogue;
  static_assert(T::kBMajor == OperandMajor::kK || kEpilogue != GemmEpilogue::kSwiGLU, "SwiGLU reads B K-major");

  const int64_t a_row_stride = args.a_row_stride != 0 ? args.a_row_stride : args.k;
  auto g_a = make_tensor(make_gmem_ptr(static_cast<const Element*>(args.a)), make_shape(args.a_rows, int64_t(args.k)),
                         make_stride(a_row_stride, _1{}));
  // With clusters, each CTA loads its share of the A tile's rows and multicasts it (the box is the share,
  // not split further across CTAs).
  using TmaLoadA = std::conditional_t<(T::kClusterN > 1), SM90_TMA_LOAD_MULTICAST, SM90_TMA_LOAD>;
  auto tma_a = make_tma_copy(TmaLoadA{}, g_a, typename T::SmemLayoutACta{},
                             Shape<Int<T::kCtaRowsA>, Int<T::kBlockK>>{}, Int<1>{});

  // B: K-major [b_rows, k] (rows: n per expert, 2n fused gate/up); MN-major [b_rows, n] (rows: the k of
  // each expert, half of it per source when K is split over b and b_up). Both sources share one shape.
  const bool swiglu = kEpilogue == GemmEpilogue::kSwiGLU;
  const bool fused = swiglu && args.b_up == nullptr;
  const bool k_split = T::kBMajor == OperandMajor::kMN && args.b_up != nullptr;
  int64_t b_expert_rows;
  if constexpr (T::kBMajor == OperandMajor::kK)
    b_expert_rows = fused ? 2 * int64_t(args.n) : args.n;
  else
    b_expert_rows = k_split ? args.k / 2 : args.k;
  const int64_t b_rows = int64_t(args.local_experts) * b_expert_rows;
  auto make_b = [&](const void* ptr) {
    if constexpr (T::kBMajor == OperandMajor::kK) {
      auto g_b = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), make_shape(b_rows, int64_t(args.k)),
                             make_stride(int64_t(args.k), _1{}));
      return make_tma_copy(SM90_TMA_LOAD{}, g_b, typename T::SmemLayoutBBox{});
    } else {  // (n, k-row) coordinates, n contiguous
      auto g_b = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), make_shape(int64_t(args.n), b_rows),
                             make_stride(_1{}, int64_t(args.n)));
      return make_tma_copy(SM90_TMA_LOAD{}, g_b, typename T::SmemLayoutBBox{});
    }
  };
  auto tma_b0 = make_b(args.b);
  auto tma_b1 = make_b(args.b_up != nullptr && !fused ? args.b_up : args.b);

  // kSwiGLU: n hidden columns from 2n accumulator columns; kSwiGLUBackward: d_g and d_u, 2n.
  const int64_t out_cols = kEpilogue == GemmEpilogue::kSwiGLUBackward ? 2 * int64_t(args.n) : args.n;
  auto make_store = [&](void* ptr, int64_t cols) {
    using Out = typename T::OutElement;  // bf16 whatever the operands (not T::Element: e4m3 in FP8)
    auto g_out = make_tensor(make_gmem_ptr(static_cast<Out*>(ptr)), make_shape(args.a_rows, cols), make_stride(cols, _1{}));
    return make_tma_copy(SM90_TMA_STORE{}, g_out, typename T::SmemLayoutOutBox{});
  };
  // A scattering GEMM (args.scatter) stores no rows to `out` (null): its descriptor stays empty, never used.
  decltype(make_store(args.out, out_cols)) tma_out{};
  if (args.out != nullptr) tma_out = make_store(args.out, out_cols);
  decltype(tma_out) tma_gate_up_out{}, tma_side_out{};
  if constexpr (kEpilogue == GemmEpilogue::kSwiGLU) {
    // bf16 side outputs through descriptors of the output element (e4m3 beside a quantized h: its columns are
    // the tensor's bytes, `per_bf16` of them a bf16 column).
    constexpr int64_t per_bf16 = sizeof(__nv_bfloat16) / sizeof(typename T::OutElement);
    if constexpr (T::Epilogue::kGateUpOut) tma_gate_up_out = make_store(args.gate_up_out, 2 * args.n * per_bf16);
    if constexpr (T::Epilogue::kGateUpOut && per_bf16 > 1)
      tma_side_out = make_store(args.hidden_out, args.n * per_bf16);
  }
  // The FP8 down dgrad's e4m3 d_g | d_u [a_rows, 2n] beside its bf16 output, as bf16 [a_rows, n] (2n bytes a row).
  if constexpr (kEpilogue == GemmEpilogue::kSwiGLUBackward)
    if (args.quantized_out != nullptr) tma_side_out = make_store(args.quantized_out, args.n);

  gemm::GemmParams<decltype(tma_a), decltype(tma_b0), decltype(tma_out)> p{tma_a, tma_b0, tma_b1, tma_out,
                                                                           tma_gate_up_out, tma_side_out};
  p.a_rows = args.a_rows;
  p.b_rows = b_rows;
  p.k = args.k;
  p.n = args.n;
  p.local_experts = args.local_experts;
  p.num_n_blocks = T::n_blocks(args.n);  // the last one may be partial (n % 64 == 0)
  p.b_expert_rows = b_expert_rows;
  if (swiglu) {  // half 0: gate rows, half 1: up rows of the same output columns
    p.b_half_offset0 = 0;
    p.b_half_offset1 = fused ? args.n : 0;
    p.b_block_step = T::kHalfN;
  } else {  // K-major: two halves of kBlockN consecutive rows (MN-major B reads neither)
    p.b_half_offset0 = 0;
    p.b_half_offset1 = T::kHalfN;
    p.b_block_step = T::kBlockN;
  }
  p.b_k_blocks0 = static_cast<int>(b_expert_rows / T::kBlockK);  // kMN: all k-blocks, or those of b
  p.expert_counts = args.expert_counts;
  p.expert_row_offsets = args.expert_row_offsets;
  p.scheduled_rows = args.scheduled_rows;
  p.first_row = args.first_row;
  p.row_scale = args.row_scale;
  p.swiglu_limit = args.swiglu_limit;
  p.out_cols = out_cols;
  p.gate_up = static_cast<const __nv_bfloat16*>(args.gate_up);
  p.row_partials = args.row_partials;
  return p;
}

// A block-scaled GEMM's parameters (Precision::kFP8): make_gemm_params' and the scales. `args` is validated.
template <class Traits>
auto make_block_scaled_params(const ExpertGemmArgs& args) {
  using namespace cute;
  using T = Traits;
  auto base = make_gemm_params<T>(args);
  const int k_blocks = T::num_k_blocks(args.k);
  // a_scales [k_blocks, a_rows] as (row, k-block) coordinates: a box of kBlockM rows of one k-block per stage.
  auto g_sa = make_tensor(make_gmem_ptr(args.a_scales), make_shape(args.a_rows, int64_t(k_blocks)),
                          make_stride(_1{}, args.a_rows));
  auto tma_sa = make_tma_copy(SM90_TMA_LOAD{}, g_sa, make_layout(make_shape(Int<T::kBlockM>{}, _1{})),
                              Shape<Int<T::kBlockM>, _1>{}, Int<1>{});
  gemm::BlockScaledParams<decltype(base), decltype(tma_sa)> p{base, tma_sa};
  const bool separate_up = T::kEpilogue == GemmEpilogue::kSwiGLU && args.b_up != nullptr;
  p.b_scales0 = args.b_scales;
  p.b_scales1 = separate_up ? args.b_up_scales : args.b_scales;
  p.b_scale_blocks = static_cast<int>((base.b_expert_rows + 127) / 128);
  p.k_blocks = k_blocks;
  p.out_scales = args.out_scales;
  p.out_power_of_two = args.out_scales_power_of_two;
  p.status = args.waits.status;
  p.rank = args.waits.rank;
  return p;
}

}  // namespace mok::detail
