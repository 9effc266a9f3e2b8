// Dispatch, pull direction, one row: a row of this rank's expert-major buffer reads its token's row from
// the source rank's symmetric x buffer. The reader sits on the destination: the faster direction for
// dispatch on our NVLink (bench/dispatch_bench, docs/perf_notes.md round 6).
//
//   dst[row, :] = x_src[token, :]   row_route[row] = (src, token, slot)
//   dst[row, :] = 0                 padding rows (row_route = -1)
//
// One warp per row; lanes move 16-byte vectors (copy_row_warp). Used by the unfused stage kernel
// (src/device/kernels/row_kernels.cuh) and the megakernel's communication CTAs.
// Determinism: each destination row has exactly one writer and is a copy.
#pragma once

#include <cstdint>

#include "mok/peer_group.h"
#include "src/device/common/row_copy.cuh"
#include "src/device/schedule/placement.h"

namespace mok::dispatch {

// Where the row of `route` (not -1) lives: its token's row of the source rank's symmetric x.
__device__ __forceinline__ const uint4* source_row(const PeerPointers& x, int32_t route, int num_tokens, int top_k,
                                                   int row_vectors) {
  const schedule::RouteCoords c = schedule::route_coords(route, num_tokens, top_k);
  return static_cast<const uint4*>(x.base[c.src]) + int64_t(c.token) * row_vectors;
}

// One row by one warp: the first copy_vectors 16-byte vectors of the token's row of `route` from its source rank
// (rows of row_vectors vectors), or zeros for padding (route -1). copy_vectors < row_vectors: an FP8 row in a bf16
// row's bytes (src/host/quantize_fp8.h), the rest of the row neither read nor written.
__device__ __forceinline__ void pull_row(const PeerPointers& x, uint4* dst, int32_t route, int num_tokens, int top_k,
                                         int row_vectors, int copy_vectors, int lane) {
  if (route < 0)
    device::zero_row_warp(dst, copy_vectors, lane);
  else
    device::copy_row_warp(source_row(x, route, num_tokens, top_k, row_vectors), dst, copy_vectors, lane);
}

}  // namespace mok::dispatch
