// Dispatch, pull direction: every scheduled row of this rank's expert-major buffer reads its token's row
// from the source rank's symmetric x buffer.
//
//   dst[row, :] = x_src[token, :]   for row < scheduled_rows with row_route[row] = (src, token, slot)
//   dst[row, :] = 0                 for padding rows (row_route = -1) below scheduled_rows
// Rows at or above scheduled_rows are not touched (no GEMM reads them; 0 rows after a capacity overflow).
//
// Roles: one warp per row, warps striding over rows; lanes move 16-byte vectors (copy_row_warp).
// Sync: the source ranks wrote x before the barrier this rank's stream waited on; reads only, so nothing
// is signalled here: the next barrier arrive (after combine) tells the sources their x may be reused.
// Determinism: each destination row has exactly one writer and is a copy.
#pragma once

#include <cstdint>

#include "mok/peer_group.h"
#include "src/device/common/row_copy.cuh"
#include "src/device/schedule/placement.h"

namespace mok::dispatch {

struct PullTraits {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
};

struct PullParams {
  PeerPointers x;              // every rank's symmetric x buffer, bf16 [padded T, H]
  uint4* dst;                  // bf16 [capacity, H], this rank's expert-major rows
  const int32_t* row_route;    // [capacity]
  const int32_t* scheduled_rows;
  int num_tokens;
  int top_k;
  int row_vectors;             // H * 2 / 16
};

__global__ void __launch_bounds__(PullTraits::kThreads) pull_rows_kernel(PullParams p) {
  device::for_each_row_by_warp(*p.scheduled_rows, [&](int64_t row, int lane) {
    uint4* dst = p.dst + row * p.row_vectors;
    const int32_t route = p.row_route[row];
    if (route < 0) {
      device::zero_row_warp(dst, p.row_vectors, lane);
      return;
    }
    const schedule::RouteCoords c = schedule::route_coords(route, p.num_tokens, p.top_k);
    const uint4* src = static_cast<const uint4*>(p.x.base[c.src]) + int64_t(c.token) * p.row_vectors;
    device::copy_row_warp(src, dst, p.row_vectors, lane);
  });
}

}  // namespace mok::dispatch
