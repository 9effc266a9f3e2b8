// The unfused path's row kernels (the fused path runs the same row operations in its communication CTAs):
//
//   pull_rows_kernel  every scheduled row of the expert-major buffer = its token's row on the source rank,
//                     zeros for padding rows; rows at or above scheduled_rows (or row_limit:
//                     recompute_forward_context pulls only the context's kept rows) are not touched (no
//                     GEMM reads them; 0 rows after a capacity overflow)
//   push_rows_kernel  every scheduled row with a route = into its (token, slot) row of the source rank's
//                     combine buffer
// Roles: one warp per row, the grid's warps striding over rows.
// Sync: pull only reads peers' x, complete before the barrier its stream waited on; push fences at system
// scope so the barrier arrive that follows releases its peer stores (docs/sync_protocol.md).
#pragma once

#include <cstdint>

#include "mok/peer_group.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/common/row_copy.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/dispatch/pull_rows.cuh"

namespace mok::kernels {

struct PullTraits {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
};

struct PullParams {
  PeerPointers x;              // every rank's symmetric x buffer, bf16 [padded T, H]
  uint4* dst;                  // [capacity, copy_vectors], this rank's expert-major rows
  const int32_t* row_route;    // [capacity]
  const int32_t* scheduled_rows;
  int64_t row_limit;           // rows at or above it are not pulled (the capacity: all scheduled rows)
  int num_tokens;
  int top_k;
  int row_vectors;             // H * 2 / 16
  int copy_vectors;            // of each row, the first ones pulled (row_vectors, or an FP8 row's: fewer), and
                               // dst's row stride
};

__global__ void __launch_bounds__(PullTraits::kThreads) pull_rows_kernel(PullParams p) {
  const int64_t rows = *p.scheduled_rows < p.row_limit ? int64_t(*p.scheduled_rows) : p.row_limit;
  device::for_each_row_by_warp(rows, [&](int64_t row, int lane) {
    dispatch::pull_row(p.x, p.dst + row * p.copy_vectors, p.row_route[row], p.num_tokens, p.top_k, p.row_vectors,
                       p.copy_vectors, lane);
  });
}

struct PushTraits {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
};

struct PushParams {
  PeerPointers combined;       // every rank's symmetric combine buffer, bf16 [T * k, H]
  const uint4* y;              // bf16 [capacity, H], this rank's expert outputs
  const int32_t* row_route;    // [capacity]
  const int32_t* scheduled_rows;
  int num_tokens;
  int top_k;
  int row_vectors;             // H * 2 / 16
};

__global__ void __launch_bounds__(PushTraits::kThreads) push_rows_kernel(PushParams p) {
  device::for_each_row_by_warp(*p.scheduled_rows, [&](int64_t row, int lane) {
    combine::push_row(p.combined, p.y + row * p.row_vectors, p.row_route[row], p.num_tokens, p.top_k, p.row_vectors, lane);
  });
  // Why: the barrier arrive after this kernel publishes these peer stores; order them at system scope.
  device::fence_acq_rel_sys();
}

}  // namespace mok::kernels
