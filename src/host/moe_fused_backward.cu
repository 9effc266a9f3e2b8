// Host side of the backward megakernel: the descriptors of its ten GEMMs, its counters, the persistent grid.
#include "src/host/moe_fused_backward.h"

#include <stdexcept>
#include <type_traits>

#include "src/device/megakernel/backward_kernel.cuh"
#include "src/host/gemm_params.h"
#include "src/host/megakernel_launch.h"
#include "src/host/moe_fused.h"
#include "src/host/weight_grad_params.h"

namespace mok::detail {
namespace {

namespace bwd = megakernel::backward;

// The standalone GEMMs' tiles (src/host/gemm_params.h), so every tile is the unfused backward's.
template <int kClusterN>
using RecomputeTraits = ExpertGemmTraits<KMajorMainloop, gemm::SwiGLUEpilogue<true>, kClusterN>;
template <int kClusterN>
using DownDgradTraits = ExpertGemmTraits<MNMajorMainloop, gemm::SwiGLUBackwardEpilogue, kClusterN>;
template <int kClusterN>
using GateUpDgradTraits = ExpertGemmTraits<MNMajorMainloop, gemm::StoreEpilogue, kClusterN>;

template <int kClusterN>
using RecomputeGemm = decltype(make_gemm_params<RecomputeTraits<kClusterN>>(ExpertGemmArgs{}));
template <int kClusterN>
using DgradGemm = decltype(make_gemm_params<GateUpDgradTraits<kClusterN>>(ExpertGemmArgs{}));
static_assert(std::is_same_v<DgradGemm<1>, decltype(make_gemm_params<DownDgradTraits<1>>(ExpertGemmArgs{}))>,
              "both dgrads have one descriptor type (one mainloop policy)");
template <int kClusterN>
using Params = megakernel::BackwardParams<RecomputeGemm<kClusterN>, DgradGemm<kClusterN>, gemm::AnyWeightGradParams>;

template <int kClusterN>
auto kernel_of() {
  return megakernel::backward_kernel<RecomputeTraits<kClusterN>, DownDgradTraits<kClusterN>,
                                     GateUpDgradTraits<kClusterN>, Params<kClusterN>>;
}

template <int kClusterN>
int grid_ctas(int device) {
  return megakernel_grid_ctas<GateUpDgradTraits<kClusterN>>(kernel_of<kClusterN>(), device, "backward megakernel");
}

// FP8 (MoeOptions::precision kFP8): the row GEMMs as the FP8 stage kernels' 128 x 128 tiles (detail::Fp8GemmTraits;
// the stage kernels' gate/up dgrad takes a 128 x 256 tile from H = 4096 on: the same bits), in one shared memory
// layout of two staging boxes a warpgroup (the recompute's SwiGLU tile stages one).
template <class Epilogue, int kClusterN>
struct Fp8BackwardTraits : Fp8GemmTraits<Epilogue, kClusterN> {
  using TileStorage = typename Fp8GemmTraits<Epilogue, kClusterN>::Collective::template Storage<2>;
};
template <int kClusterN>
using Fp8RecomputeTraits = Fp8BackwardTraits<gemm::SwiGLUEpilogue<true>, kClusterN>;
template <int kClusterN>
using Fp8DownDgradTraits = Fp8BackwardTraits<gemm::SwiGLUBackwardEpilogue, kClusterN>;
template <int kClusterN>
using Fp8GateUpDgradTraits = Fp8BackwardTraits<gemm::StoreEpilogue, kClusterN>;

template <int kClusterN>
using Fp8RecomputeGemm = decltype(make_block_scaled_params<Fp8RecomputeTraits<kClusterN>>(ExpertGemmArgs{}));
template <int kClusterN>
using Fp8DgradGemm = decltype(make_block_scaled_params<Fp8GateUpDgradTraits<kClusterN>>(ExpertGemmArgs{}));
static_assert(std::is_same_v<Fp8DgradGemm<1>,
                             decltype(make_block_scaled_params<Fp8DownDgradTraits<1>>(ExpertGemmArgs{}))>,
              "both FP8 dgrads have one descriptor type");
template <int kClusterN>
using Fp8Params =
    megakernel::BackwardParams<Fp8RecomputeGemm<kClusterN>, Fp8DgradGemm<kClusterN>, gemm::AnyWeightGradParams>;
static_assert(sizeof(megakernel::MegakernelSharedStorage<Fp8GateUpDgradTraits<2>>) <= 227 * 1024,
              "the FP8 backward megakernel's shared memory fits the 227 KB an H100 or H200 CTA may have");

template <int kClusterN>
auto fp8_kernel_of() {
  return megakernel::backward_kernel<Fp8RecomputeTraits<kClusterN>, Fp8DownDgradTraits<kClusterN>,
                                     Fp8GateUpDgradTraits<kClusterN>, Fp8Params<kClusterN>>;
}

template <int kClusterN>
int fp8_grid_ctas(int device) {
  return megakernel_grid_ctas<Fp8GateUpDgradTraits<kClusterN>>(fp8_kernel_of<kClusterN>(), device,
                                                              "FP8 backward megakernel");
}

// n-blocks (output tiles of 256 or 128 columns) and, for weight gradients, m-blocks of 128 gradient rows of
// each GEMM, by bwd::Gemm. A weight gradient that is not wanted has no m-blocks: no tiles.
struct GemmBlocks {
  int32_t n[bwd::kNumGemms];
  int32_t m[bwd::kNumGemms];
};

using GradTraits = gemm::WeightGradTraitsInGemmLayout<GradOutput::kBFloat16>;  // every mode's tile shape

// FP8 (kWeightGradTiles false): no weight-gradient tiles (they run after the launch).
template <class TR, class TD, class TG, bool kWeightGradTiles>
GemmBlocks gemm_blocks(const FusedBackwardArgs& a) {
  const int h = a.common.hidden, i = a.common.intermediate;
  auto m_blocks = [](const WeightGradArgs& w) {
    return w.out == nullptr || !kWeightGradTiles ? 0 : (w.m + GradTraits::kBlockM - 1) / GradTraits::kBlockM;
  };
  auto grad_n_blocks = [](int n) { return (n + GradTraits::kBlockN - 1) / GradTraits::kBlockN; };
  GemmBlocks b{};
  for (const bool shared : {true, false}) {
    const MlpBackwardGemms& g = shared ? a.shared : a.routed;
    const auto at = [&](bwd::Gemm shared_gemm, bwd::Gemm routed_gemm) { return shared ? shared_gemm : routed_gemm; };
    b.n[at(bwd::kSharedRecompute, bwd::kExpertRecompute)] = TR::n_blocks(i);
    b.n[at(bwd::kSharedDownDgrad, bwd::kExpertDownDgrad)] = TD::n_blocks(i);
    b.n[at(bwd::kSharedGateUpDgrad, bwd::kExpertGateUpDgrad)] = TG::n_blocks(h);
    b.n[at(bwd::kSharedDownWgrad, bwd::kExpertDownWgrad)] = grad_n_blocks(i);
    b.n[at(bwd::kSharedGateUpWgrad, bwd::kExpertGateUpWgrad)] = grad_n_blocks(h);
    b.m[at(bwd::kSharedDownWgrad, bwd::kExpertDownWgrad)] = m_blocks(g.down_wgrad);
    b.m[at(bwd::kSharedGateUpWgrad, bwd::kExpertGateUpWgrad)] = m_blocks(g.gate_up_wgrad);
  }
  return b;
}

gemm::AnyWeightGradParams weight_grad_params(const WeightGradArgs& w) {
  return w.out == nullptr ? gemm::AnyWeightGradParams{} : make_any_weight_grad_params(w);
}

// One launch of kernel `kernel` over tiles TR, TD, TG with parameters P: bf16's (make_gemm_params, weight-gradient
// tiles) or FP8's (kFp8: make_block_scaled_params, the pull quantizing d_out, no weight-gradient tiles).
template <class TR, class TD, class TG, class P, bool kFp8, class Kernel>
void launch_kernel(const FusedBackwardArgs& a, Kernel kernel, cudaStream_t stream) {
  constexpr int kClusterN = TG::kClusterN;
  const MegakernelArgs& c = a.common;
  const GemmBlocks blocks = gemm_blocks<TR, TD, TG, !kFp8>(a);
  // The row GEMMs' arguments as the standalone GEMM checks them (their tickets are the kernel's own).
  for (const ExpertGemmArgs* g : {&a.shared.down_dgrad, &a.shared.gate_up_dgrad, &a.routed.down_dgrad,
                                  &a.routed.gate_up_dgrad, a.shared_recompute ? &a.shared.recompute : nullptr,
                                  a.routed_recompute ? &a.routed.recompute : nullptr}) {
    if (g == nullptr) continue;
    ExpertGemmArgs checked = *g;
    checked.ticket = c.tickets;
    validate(checked);
    if ((checked.precision == Precision::kFP8) != kFp8)
      throw std::logic_error("backward megakernel: a row GEMM's precision is not the launch's");
  }
  // FP8 weight gradients read dy by route (no dy rows); FP8 quantizes d_out's rows as they are pulled.
  if (a.d_out_rows == nullptr || (a.dy_rows == nullptr && !kFp8) || a.row_weight == nullptr ||
      a.row_partials == nullptr || (kFp8 && (a.pull_fp8.d_out == nullptr || a.pull_fp8.d_out_scales == nullptr)))
    throw std::logic_error("backward megakernel: scratch buffers missing");
  const megakernel::TaskOrderShape order =
      bwd::task_order(c.expert_row_offsets, c.local_experts, c.shared_rows, static_cast<int32_t>(c.capacity_rows),
                      c.minibatch_rows, a.recompute_from, blocks.n, blocks.m, kClusterN, a.shared_recompute,
                      a.routed_recompute);
  const auto row_gemm = [](auto traits, const ExpertGemmArgs& args) {
    using T = typename decltype(traits)::type;
    if constexpr (kFp8)
      return make_block_scaled_params<T>(args);
    else
      return make_gemm_params<T>(args);
  };
  const auto weight_grad = [](const WeightGradArgs& w) {
    return kFp8 ? gemm::AnyWeightGradParams{} : weight_grad_params(w);
  };
  const std::type_identity<TR> tr;
  const std::type_identity<TD> td;
  const std::type_identity<TG> tg;
  const P p{
      .recompute = {row_gemm(tr, a.shared_recompute ? a.shared.recompute : a.routed.recompute),
                    row_gemm(tr, a.routed_recompute ? a.routed.recompute : a.shared.recompute)},
      .down_dgrad = {row_gemm(td, a.shared.down_dgrad), row_gemm(td, a.routed.down_dgrad)},
      .gate_up_dgrad = {row_gemm(tg, a.shared.gate_up_dgrad), row_gemm(tg, a.routed.gate_up_dgrad)},
      .down_wgrad = {weight_grad(a.shared.down_wgrad), weight_grad(a.routed.down_wgrad)},
      .gate_up_wgrad = {weight_grad(a.shared.gate_up_wgrad), weight_grad(a.routed.gate_up_wgrad)},
      .common = megakernel_params(c, order, bwd::kCounters, blocks.n),
      .pull = a.pull,
      .pull_fp8 = kFp8 ? a.pull_fp8 : backward::GradPullFp8{},
      .x_rows = static_cast<uint4*>(a.x_rows),
      .d_out_rows = static_cast<uint4*>(a.d_out_rows),
      .dy_rows = static_cast<uint4*>(a.dy_rows),
      .row_weight = a.row_weight,
      .push = a.push,
      .d_x_rows = static_cast<const uint4*>(a.d_out_rows),
      .row_partials = a.row_partials,
      .n_blocks = a.n_blocks};
  launch_megakernel<TG>(kernel, p, c, bwd::kCounters, stream);
}

template <int kClusterN>
void launch(const FusedBackwardArgs& a, cudaStream_t stream) {
  launch_kernel<RecomputeTraits<kClusterN>, DownDgradTraits<kClusterN>, GateUpDgradTraits<kClusterN>,
                Params<kClusterN>, false>(a, kernel_of<kClusterN>(), stream);
}

template <int kClusterN>
void launch_fp8(const FusedBackwardArgs& a, cudaStream_t stream) {
  launch_kernel<Fp8RecomputeTraits<kClusterN>, Fp8DownDgradTraits<kClusterN>, Fp8GateUpDgradTraits<kClusterN>,
                Fp8Params<kClusterN>, true>(a, fp8_kernel_of<kClusterN>(), stream);
}

}  // namespace

int fused_backward_cluster_n(int hidden, int intermediate) {
  const auto even = [](int blocks) { return blocks % 2 == 0; };
  const auto grad_n_blocks = [](int n) { return (n + GradTraits::kBlockN - 1) / GradTraits::kBlockN; };
  const bool pairs = even(RecomputeTraits<1>::n_blocks(intermediate)) &&
                     even(DownDgradTraits<1>::n_blocks(intermediate)) && even(GateUpDgradTraits<1>::n_blocks(hidden)) &&
                     even(grad_n_blocks(intermediate)) && even(grad_n_blocks(hidden));
  return pairs ? 2 : 1;
}

// FP8: pairs when the FP8 forward's tiles pair up (the grid is a multiple of its cluster) and every FP8 row GEMM's
// tiles do, the down dgrad's quantized d_g | d_u in whole 256-column pairs (as the stage kernels choose).
int fused_backward_cluster_n(int hidden, int intermediate, Precision precision) {
  if (precision != Precision::kFP8) return fused_backward_cluster_n(hidden, intermediate);
  const auto even = [](int blocks) { return blocks % 2 == 0; };
  const bool pairs = fused_cluster_n(hidden, intermediate, Precision::kFP8) == 2 && intermediate % 256 == 0 &&
                     even(Fp8RecomputeTraits<1>::n_blocks(intermediate)) &&
                     even(Fp8DownDgradTraits<1>::n_blocks(intermediate)) &&
                     even(Fp8GateUpDgradTraits<1>::n_blocks(hidden));
  return pairs ? 2 : 1;
}

int fused_backward_grid_ctas(const MoeShape& shape, Precision precision, int device) {
  const bool pairs = fused_backward_cluster_n(shape.hidden, shape.intermediate, precision) == 2;
  if (precision == Precision::kFP8) return pairs ? fp8_grid_ctas<2>(device) : fp8_grid_ctas<1>(device);
  return pairs ? grid_ctas<2>(device) : grid_ctas<1>(device);
}

int64_t fused_backward_counter_words(int64_t capacity_units, int64_t shared_units) {
  return megakernel::counter_words(bwd::kCounters, capacity_units, shared_units);
}

void launch_fused_backward(const FusedBackwardArgs& args, cudaStream_t stream) {
  const Precision precision = args.routed.down_dgrad.precision;
  const bool pairs = fused_backward_cluster_n(args.common.hidden, args.common.intermediate, precision) == 2;
  if (precision == Precision::kFP8)
    pairs ? launch_fp8<2>(args, stream) : launch_fp8<1>(args, stream);
  else
    pairs ? launch<2>(args, stream) : launch<1>(args, stream);
}

}  // namespace mok::detail
