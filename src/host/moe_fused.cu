// Host side of the forward megakernel: GEMM descriptors for the four GEMMs, counters, the persistent grid.
#include "src/host/moe_fused.h"

#include "src/device/megakernel/forward_kernel.cuh"
#include "src/device/megakernel/timeline_record.h"
#include "src/host/gemm_params.h"
#include "src/host/megakernel_launch.h"

namespace mok::detail {
namespace {

// The megakernel's gate/up and down GEMMs: the standalone GEMM's tiles (src/host/gemm_params.h). kKeepGateUp:
// the gate/up epilogue also writes the raw g and u into the context (MoeOptions::keep_gate_up).
template <int kClusterN, bool kKeepGateUp = false>
using GateUpTraits = ExpertGemmTraits<KMajorMainloop, gemm::SwiGLUEpilogue<kKeepGateUp>, kClusterN>;
template <int kClusterN>
using DownTraits = StoreTraits<kClusterN>;

template <int kClusterN, bool kKeepGateUp>
auto kernel_of() {
  using T = GateUpTraits<kClusterN, kKeepGateUp>;
  using Params = megakernel::ForwardParams<decltype(make_gemm_params<T>(ExpertGemmArgs{}))>;
  return megakernel::forward_kernel<T, DownTraits<kClusterN>, Params>;
}

template <int kClusterN, bool kKeepGateUp>
int grid_ctas(int device) {
  return megakernel_grid_ctas<GateUpTraits<kClusterN, kKeepGateUp>>(kernel_of<kClusterN, kKeepGateUp>(), device,
                                                                    "forward megakernel");
}

// The forward's task order for gate/up tiles T and down tiles TDown, and each GEMM's n-blocks (by forward::Gemm:
// the shared and the routed gate/up and down GEMMs).
struct ForwardOrder {
  int32_t n_blocks[megakernel::forward::kNumGemms];
  megakernel::TaskOrderShape shape;
};
template <class T, class TDown>
ForwardOrder forward_order(const FusedForwardArgs& a) {
  namespace forward = megakernel::forward;
  const MegakernelArgs& c = a.common;
  ForwardOrder o{{T::n_blocks(c.intermediate), TDown::n_blocks(c.hidden), T::n_blocks(c.intermediate),
                  TDown::n_blocks(c.hidden)},
                 {}};
  o.shape = forward::task_order(c.expert_row_offsets, c.local_experts, c.shared_rows, a.ring_rows, c.minibatch_rows,
                                o.n_blocks, T::kClusterN);
  return o;
}

template <int kClusterN, bool kKeepGateUp>
void launch(const FusedForwardArgs& a, cudaStream_t stream) {
  using T = GateUpTraits<kClusterN, kKeepGateUp>;
  using TDown = DownTraits<kClusterN>;
  using GemmP = decltype(make_gemm_params<T>(ExpertGemmArgs{}));
  namespace forward = megakernel::forward;
  const MegakernelArgs& c = a.common;
  const ForwardOrder order = forward_order<T, TDown>(a);
  const megakernel::ForwardParams<GemmP> p{
      .gemms = {make_gemm_params<T>(a.shared_gate_up), make_gemm_params<TDown>(a.shared_down),
                make_gemm_params<T>(a.expert_gate_up), make_gemm_params<TDown>(a.expert_down)},
      .common = megakernel_params(c, order.shape, forward::kCounters, order.n_blocks),
      .x = a.x,
      .combined = a.combined,
      .expert_rows = static_cast<uint4*>(a.expert_rows),
      .expert_out = static_cast<const uint4*>(a.expert_out),
      .combine_in_place = a.combine_in_place};
  launch_megakernel<T>(kernel_of<kClusterN, kKeepGateUp>(), p, c, forward::kCounters, stream);
}

// FP8 (MoeOptions::precision kFP8): the gate/up GEMM writing h quantized and the store GEMM, one tile storage for
// both, 128 x 256 tiles (the gate/up's as detail::Fp8WideGateUpTraits; the down's two 128-column halves promoted in
// turn as the gate/up's are). Without the side outputs: 4 stages of 48 KB, one staging box a warpgroup (the down
// stores its 256 columns in four passes: with two boxes the megakernel's shared memory is 1 KB past the 227 KB a CTA
// may have). kKeepGateUp (the bf16 g | u and h a training context keeps, MoeOptions::keep_gate_up): 3 stages of
// 48 KB beside the gate/up's three side-output boxes (detail::Fp8WideGateUpSideTraits), of which the down stages
// through two (two passes).
template <class Base, int kBoxes>
struct Fp8MegakernelTraits : Base {
  using TileStorage = typename Base::Collective::template Storage<kBoxes>;
};
template <int kStages, class Epilogue, int kClusterN>
using Fp8WideTile = gemm::GemmTraits<128, 256, kStages, gemm::Fp8Mainloop, Epilogue, kClusterN>;
template <class Epilogue, int kClusterN>
using Fp8WideMegakernelTraits = gemm::OneBoxStaging<Fp8MegakernelTraits<Fp8WideTile<4, Epilogue, kClusterN>, 1>>;
template <class Epilogue, int kClusterN>
using Fp8WideSideMegakernelTraits =
    Fp8MegakernelTraits<Fp8WideTile<3, Epilogue, kClusterN>, gemm::SwiGLUQuantEpilogue<true>::kSideBoxes>;
template <int kClusterN, bool kKeepGateUp>
using Fp8GateUpTraits =
    std::conditional_t<kKeepGateUp, Fp8WideSideMegakernelTraits<gemm::SwiGLUQuantEpilogue<true, 1>, kClusterN>,
                       Fp8WideMegakernelTraits<gemm::SwiGLUQuantEpilogue<false, 1>, kClusterN>>;
template <int kClusterN, bool kKeepGateUp>
using Fp8DownTraits = std::conditional_t<kKeepGateUp, Fp8WideSideMegakernelTraits<gemm::StoreEpilogue, kClusterN>,
                                         Fp8WideMegakernelTraits<gemm::StoreEpilogue, kClusterN>>;

static_assert(sizeof(megakernel::MegakernelSharedStorage<Fp8GateUpTraits<2, false>>) <= 227 * 1024 &&
                  sizeof(megakernel::MegakernelSharedStorage<Fp8GateUpTraits<2, true>>) <= 227 * 1024,
              "the FP8 megakernel's shared memory fits the 227 KB an H100 or H200 CTA may have");

template <int kClusterN, bool kKeepGateUp>
auto fp8_kernel_of() {
  using T = Fp8GateUpTraits<kClusterN, kKeepGateUp>;
  using TDown = Fp8DownTraits<kClusterN, kKeepGateUp>;
  using Params = megakernel::Fp8ForwardParams<decltype(make_block_scaled_params<T>(ExpertGemmArgs{})),
                                              decltype(make_block_scaled_params<TDown>(ExpertGemmArgs{}))>;
  return megakernel::fp8_forward_kernel<T, TDown, Params>;
}

template <int kClusterN, bool kKeepGateUp>
int fp8_grid_ctas(int device) {
  return megakernel_grid_ctas<Fp8GateUpTraits<kClusterN, kKeepGateUp>>(fp8_kernel_of<kClusterN, kKeepGateUp>(), device,
                                                                       "FP8 forward megakernel");
}

template <int kClusterN, bool kKeepGateUp>
void launch_fp8(const FusedForwardArgs& a, cudaStream_t stream) {
  using T = Fp8GateUpTraits<kClusterN, kKeepGateUp>;
  using TDown = Fp8DownTraits<kClusterN, kKeepGateUp>;
  namespace forward = megakernel::forward;
  const MegakernelArgs& c = a.common;
  const ForwardOrder order = forward_order<T, TDown>(a);
  using Params = megakernel::Fp8ForwardParams<decltype(make_block_scaled_params<T>(ExpertGemmArgs{})),
                                              decltype(make_block_scaled_params<TDown>(ExpertGemmArgs{}))>;
  const Params p{.gate_up = {make_block_scaled_params<T>(a.shared_gate_up), make_block_scaled_params<T>(a.expert_gate_up)},
                 .down = {make_block_scaled_params<TDown>(a.shared_down), make_block_scaled_params<TDown>(a.expert_down)},
                 .common = megakernel_params(c, order.shape, forward::kCounters, order.n_blocks),
                 .x = a.x,
                 .combined = a.combined,
                 .expert_rows = static_cast<uint4*>(a.expert_rows),
                 .expert_out = static_cast<const uint4*>(a.expert_out),
                 .combine_in_place = a.combine_in_place,
                 .expert_row_scales = a.expert_row_scales,
                 .fp8_row_vectors = a.fp8_row_vectors,
                 .hidden = c.hidden,
                 .k_blocks = (c.hidden + 127) / 128};
  launch_megakernel<T>(fp8_kernel_of<kClusterN, kKeepGateUp>(), p, c, forward::kCounters, stream);
}

}  // namespace

int fused_cluster_n(int hidden, int intermediate, Precision precision) {
  // FP8: a quantizing gate/up task covers 128 h columns (a last task of 64 columns computes 64 past n), and the two
  // CTAs of a pair run the same stages, so pairs need I % 256 == 0: an even number of whole tasks; and an even
  // number of down tiles (the choice does not depend on keep_gate_up).
  static_assert(Fp8GateUpTraits<1, false>::kOutCols == 128 && Fp8GateUpTraits<1, true>::kOutCols == 128,
                "h columns per quantizing gate/up task");
  if (precision == Precision::kFP8)
    return intermediate % 256 == 0 && Fp8DownTraits<1, false>::n_blocks(hidden) % 2 == 0 &&
                   Fp8DownTraits<1, true>::n_blocks(hidden) % 2 == 0
               ? 2
               : 1;
  return fused_cluster_n(hidden, intermediate);
}

int fused_fp8_grid_ctas(const MoeShape& shape, bool keep_gate_up, int device) {
  if (fused_cluster_n(shape.hidden, shape.intermediate, Precision::kFP8) == 2)
    return keep_gate_up ? fp8_grid_ctas<2, true>(device) : fp8_grid_ctas<2, false>(device);
  return keep_gate_up ? fp8_grid_ctas<1, true>(device) : fp8_grid_ctas<1, false>(device);
}

int fused_cluster_n(int hidden, int intermediate) {
  const bool pairs = GateUpTraits<1>::n_blocks(intermediate) % 2 == 0 &&
                     DownTraits<1>::n_blocks(hidden) % 2 == 0;
  return pairs ? 2 : 1;
}

int fused_grid_ctas(const MoeShape& shape, bool keep_gate_up, int device) {
  if (fused_cluster_n(shape.hidden, shape.intermediate) == 2)
    return keep_gate_up ? grid_ctas<2, true>(device) : grid_ctas<2, false>(device);
  return keep_gate_up ? grid_ctas<1, true>(device) : grid_ctas<1, false>(device);
}

int64_t fused_counter_words(int64_t capacity_units, int64_t shared_units) {
  return megakernel::counter_words(megakernel::forward::kCounters, capacity_units, shared_units);
}

int64_t fused_timeline_words(int grid_ctas, int capacity) {
  return megakernel::timeline_words(grid_ctas, capacity);
}

void launch_fused_forward(const FusedForwardArgs& args, cudaStream_t stream) {
  const bool keep = args.expert_gate_up.gate_up_out != nullptr;  // MoeOptions::keep_gate_up
  if (args.expert_gate_up.precision == Precision::kFP8) {
    if (fused_cluster_n(args.common.hidden, args.common.intermediate, Precision::kFP8) == 2)
      keep ? launch_fp8<2, true>(args, stream) : launch_fp8<2, false>(args, stream);
    else
      keep ? launch_fp8<1, true>(args, stream) : launch_fp8<1, false>(args, stream);
    return;
  }
  if (fused_cluster_n(args.common.hidden, args.common.intermediate) == 2)
    keep ? launch<2, true>(args, stream) : launch<2, false>(args, stream);
  else
    keep ? launch<1, true>(args, stream) : launch<1, false>(args, stream);
}

}  // namespace mok::detail
