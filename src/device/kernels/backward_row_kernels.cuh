// The unfused backward's row kernels (src/device/backward/grad_rows.cuh has the row operations):
//
//   pull_grad_rows_kernel  every scheduled row: its d_out row (FP8: quantized per 1 x 128 instead), dy =
//                          bf16(rw * d_out), its router weight and (when the context does not keep every row) its
//                          x row; zeros for padding rows
//   push_grad_rows_kernel  every scheduled row with a route: its d_x_route row into the (token, slot) row of
//                          the source rank's combine buffer (unless d_x_rows is null: the gate/up dgrad scattered
//                          them, MoeOptions::scatter_rows, or the combine reads them in place at EP = 1), its d_rw
//                          into the source rank's d_rw
//   kept_rows_kernel       (one thread) kept = min(scheduled_rows, limit): the row count of
//                          recompute_forward_context's gate/up GEMM over the rows a context keeps
// Rows at or above scheduled_rows are not touched (no GEMM reads them; 0 rows after a capacity overflow).
// Roles: one warp per row, the grid's warps striding over rows.
// Sync: pull only reads what peers published before the barrier its stream waited on; push fences at system
// scope so the barrier arrive that follows releases its peer stores (docs/sync_protocol.md, "Backward").
#pragma once

#include <cstdint>

#include "src/device/backward/grad_rows.cuh"
#include "src/device/common/row_copy.cuh"
#include "src/device/common/sync.cuh"

namespace mok::kernels {

struct GradRowTraits {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
};

struct GradPullParams {
  backward::GradPullSources src;
  uint4* x_rows;               // bf16 [capacity, H], or null: the context keeps every row
  uint4* d_out_rows;           // bf16 [capacity, H]
  uint4* dy_rows;              // bf16 [capacity, H], or null: not written (FP8 weight gradients)
  float* row_weight;           // fp32 [capacity]
  const int32_t* row_route;    // [capacity]
  const int32_t* scheduled_rows;
  int num_tokens;
  int top_k;
  int row_vectors;             // H * 2 / 16
  backward::GradPullFp8 fp8;   // FP8: d_out quantized as it is pulled (d_out_rows not written); .d_out null: bf16
};

__global__ void __launch_bounds__(GradRowTraits::kThreads) pull_grad_rows_kernel(GradPullParams p) {
  device::for_each_row_by_warp(*p.scheduled_rows, [&](int64_t row, int lane) {
    const int64_t at = row * p.row_vectors;
    const backward::GradPullRow dst{p.x_rows != nullptr ? p.x_rows + at : nullptr, p.d_out_rows + at,
                                    p.dy_rows != nullptr ? p.dy_rows + at : nullptr, p.row_weight + row};
    backward::pull_grad_row(p.src, dst, row, p.row_route[row], p.num_tokens, p.top_k, p.row_vectors, lane, p.fp8);
  });
}

struct GradPushParams {
  backward::GradPushDestinations dst;
  const uint4* d_x_rows;       // bf16 [capacity, H]; null: not moved (scattered by the dgrad, or read in place)
  const float* row_partials;   // fp32 [capacity, n_blocks]
  int n_blocks;
  const int32_t* row_route;    // [capacity]
  const int32_t* scheduled_rows;
  int num_tokens;
  int top_k;
  int row_vectors;             // H * 2 / 16
};

__global__ void __launch_bounds__(GradRowTraits::kThreads) push_grad_rows_kernel(GradPushParams p) {
  device::for_each_row_by_warp(*p.scheduled_rows, [&](int64_t row, int lane) {
    backward::push_grad_row(p.dst, p.d_x_rows != nullptr ? p.d_x_rows + row * p.row_vectors : nullptr,
                            p.row_partials + row * p.n_blocks, p.n_blocks,
                            p.row_route[row], p.num_tokens, p.top_k, p.row_vectors, lane);
  });
  // Why: the barrier arrive after this kernel publishes these peer stores; order them at system scope.
  device::fence_acq_rel_sys();
}

__global__ void __launch_bounds__(32) kept_rows_kernel(const int32_t* scheduled_rows, int32_t limit, int32_t* kept) {
  if (threadIdx.x == 0) *kept = *scheduled_rows < limit ? *scheduled_rows : limit;
}

}  // namespace mok::kernels
