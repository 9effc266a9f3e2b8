// Host side of the backward megakernel: the descriptors of its ten GEMMs, its counters, the persistent grid.
#include "src/host/moe_fused_backward.h"

#include <stdexcept>
#include <type_traits>

#include "src/device/megakernel/backward_kernel.cuh"
#include "src/host/gemm_params.h"
#include "src/host/megakernel_launch.h"
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

// n-blocks (output tiles of 256 or 128 columns) and, for weight gradients, m-blocks of 128 gradient rows of
// each GEMM, by bwd::Gemm. A weight gradient that is not wanted has no m-blocks: no tiles.
struct GemmBlocks {
  int32_t n[bwd::kNumGemms];
  int32_t m[bwd::kNumGemms];
};

using GradTraits = gemm::WeightGradTraitsInGemmLayout<GradOutput::kBFloat16>;  // every mode's tile shape

template <int kClusterN>
GemmBlocks gemm_blocks(const FusedBackwardArgs& a) {
  const int h = a.common.hidden, i = a.common.intermediate;
  auto m_blocks = [](const WeightGradArgs& w) {
    return w.out == nullptr ? 0 : (w.m + GradTraits::kBlockM - 1) / GradTraits::kBlockM;
  };
  auto grad_n_blocks = [](int n) { return (n + GradTraits::kBlockN - 1) / GradTraits::kBlockN; };
  GemmBlocks b{};
  for (const bool shared : {true, false}) {
    const MlpBackwardGemms& g = shared ? a.shared : a.routed;
    const auto at = [&](bwd::Gemm shared_gemm, bwd::Gemm routed_gemm) { return shared ? shared_gemm : routed_gemm; };
    b.n[at(bwd::kSharedRecompute, bwd::kExpertRecompute)] = RecomputeTraits<kClusterN>::n_blocks(i);
    b.n[at(bwd::kSharedDownDgrad, bwd::kExpertDownDgrad)] = DownDgradTraits<kClusterN>::n_blocks(i);
    b.n[at(bwd::kSharedGateUpDgrad, bwd::kExpertGateUpDgrad)] = GateUpDgradTraits<kClusterN>::n_blocks(h);
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

template <int kClusterN>
void launch(const FusedBackwardArgs& a, cudaStream_t stream) {
  using TR = RecomputeTraits<kClusterN>;
  using TD = DownDgradTraits<kClusterN>;
  using TG = GateUpDgradTraits<kClusterN>;
  const MegakernelArgs& c = a.common;
  const GemmBlocks blocks = gemm_blocks<kClusterN>(a);
  // The row GEMMs' arguments as the standalone GEMM checks them (their tickets are the kernel's own).
  for (const ExpertGemmArgs* g : {&a.shared.down_dgrad, &a.shared.gate_up_dgrad, &a.routed.down_dgrad,
                                  &a.routed.gate_up_dgrad, a.shared_recompute ? &a.shared.recompute : nullptr,
                                  a.routed_recompute ? &a.routed.recompute : nullptr}) {
    if (g == nullptr) continue;
    ExpertGemmArgs checked = *g;
    checked.ticket = c.tickets;
    validate(checked);
  }
  if (a.d_out_rows == nullptr || a.dy_rows == nullptr || a.row_weight == nullptr || a.row_partials == nullptr)
    throw std::logic_error("backward megakernel: scratch buffers missing");
  const megakernel::TaskOrderShape order =
      bwd::task_order(c.expert_row_offsets, c.local_experts, c.shared_rows, static_cast<int32_t>(c.capacity_rows),
                      c.minibatch_rows, a.recompute_from, blocks.n, blocks.m, kClusterN, a.shared_recompute,
                      a.routed_recompute);
  const Params<kClusterN> p{
      .recompute = {make_gemm_params<TR>(a.shared_recompute ? a.shared.recompute : a.routed.recompute),
                    make_gemm_params<TR>(a.routed_recompute ? a.routed.recompute : a.shared.recompute)},
      .down_dgrad = {make_gemm_params<TD>(a.shared.down_dgrad), make_gemm_params<TD>(a.routed.down_dgrad)},
      .gate_up_dgrad = {make_gemm_params<TG>(a.shared.gate_up_dgrad), make_gemm_params<TG>(a.routed.gate_up_dgrad)},
      .down_wgrad = {weight_grad_params(a.shared.down_wgrad), weight_grad_params(a.routed.down_wgrad)},
      .gate_up_wgrad = {weight_grad_params(a.shared.gate_up_wgrad), weight_grad_params(a.routed.gate_up_wgrad)},
      .common = megakernel_params(c, order, bwd::kCounters, blocks.n),
      .pull = a.pull,
      .x_rows = static_cast<uint4*>(a.x_rows),
      .d_out_rows = static_cast<uint4*>(a.d_out_rows),
      .dy_rows = static_cast<uint4*>(a.dy_rows),
      .row_weight = a.row_weight,
      .push = a.push,
      .d_x_rows = static_cast<const uint4*>(a.d_out_rows),
      .row_partials = a.row_partials,
      .n_blocks = a.n_blocks};
  launch_megakernel<TG>(kernel_of<kClusterN>(), p, c, bwd::kCounters, stream);
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

int fused_backward_grid_ctas(const MoeShape& shape, int device) {
  return fused_backward_cluster_n(shape.hidden, shape.intermediate) == 2 ? grid_ctas<2>(device) : grid_ctas<1>(device);
}

int64_t fused_backward_counter_words(int64_t capacity_units, int64_t shared_units) {
  return megakernel::counter_words(bwd::kCounters, capacity_units, shared_units);
}

void launch_fused_backward(const FusedBackwardArgs& args, cudaStream_t stream) {
  if (fused_backward_cluster_n(args.common.hidden, args.common.intermediate) == 2)
    launch<2>(args, stream);
  else
    launch<1>(args, stream);
}

}  // namespace mok::detail
