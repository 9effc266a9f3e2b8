// Launch of the backward megakernel (src/device/megakernel/backward_kernel.cuh) for one rank: descriptors,
// counters, grid. Called by MoeWorkspace::backward (src/host/moe_backward.cu) for ForwardPath::kFused.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "mok/expert_gemm.h"
#include "mok/fp8.h"
#include "mok/moe.h"
#include "mok/peer_group.h"
#include "mok/status.h"
#include "mok/weight_grad_gemm.h"
#include "src/device/backward/grad_rows.cuh"
#include "src/host/megakernel_args.h"
#include "src/host/quantize_fp8.h"

namespace mok::detail {

// One MLP's backward GEMMs as the unfused path would launch them (tickets unused). A weight gradient whose
// `out` is null is not wanted: it gets no tiles. A GEMM whose MLP runs no such phase (no shared expert, no
// recompute) is never read and may repeat another one's arguments.
struct MlpBackwardGemms {
  ExpertGemmArgs recompute, down_dgrad, gate_up_dgrad;
  WeightGradArgs down_wgrad, gate_up_wgrad;
  // MoeOptions::precision kFP8 (the stage kernels only): quantize_rows_fp8 of the down dgrad's A (d_out's rows) before
  // it; `in` null in bf16 or where the pull quantized them (the down dgrad's epilogue quantizes the gate/up dgrad's A).
  Fp8QuantizeArgs quantize_d_out;
  // MoeWorkspace::fp8_weight_gradients(): quantize_columns_fp8 of each weight gradient's a and b before it; `in` null
  // otherwise.
  Fp8ColumnQuantizeArgs quantize_down_wgrad[2], quantize_gate_up_wgrad[2];
};

struct FusedBackwardArgs {
  MlpBackwardGemms shared, routed;
  MegakernelArgs common;           // counters: fused_backward_counter_words(...) u64; the ring is the capacity
  bool shared_recompute = false;   // the shared expert's g | u are recomputed (MoeOptions::keep_gate_up false)
  bool routed_recompute = false;   // routed rows [recompute_from, ...) are recomputed
  int32_t recompute_from = 0;      // a multiple of 128; the rows below it were copied from the context
  backward::GradPullSources pull;
  backward::GradPullFp8 pull_fp8;  // precision kFP8 (the row GEMMs'): where the pull quantizes d_out's rows
  void* x_rows = nullptr;          // null: the context keeps every row (the GEMMs read its rows)
  void* d_out_rows = nullptr;      // also the d_x rows (the gate/up dgrad's output)
  void* dy_rows = nullptr;         // null with FP8 weight gradients (quantize_columns_fp8 reads dy by route)
  float* row_weight = nullptr;
  backward::GradPushDestinations push;
  const float* row_partials = nullptr;
  int n_blocks = 0;                // the down dgrad's, d_rw partials per row
};

// CTAs sharing an A tile: 2 when every backward GEMM's output tiles pair up, else 1.
int fused_backward_cluster_n(int hidden, int intermediate);
// The same for a precision: kFP8's row GEMMs (the megakernel's FP8 variant: FusedBackwardArgs' row GEMMs in kFP8).
int fused_backward_cluster_n(int hidden, int intermediate, Precision precision);
// CTAs of the persistent launch on `device` (sets the kernel's shared-memory attribute there, as
// fused_grid_ctas does for the forward).
int fused_backward_grid_ctas(const MoeShape& shape, Precision precision, int device);
int64_t fused_backward_counter_words(int64_t capacity_units, int64_t shared_units);

void launch_fused_backward(const FusedBackwardArgs& args, cudaStream_t stream);

}  // namespace mok::detail
