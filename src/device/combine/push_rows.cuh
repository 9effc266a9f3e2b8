// Combine, in two kernels on either side of a barrier:
//
//   push_rows_kernel (expert rank)  combined_src[token * k + slot, :] = y[row, :] for every scheduled row
//                                   with a route; each (token, slot) has exactly one expert row, so each
//                                   destination row has one writer on one rank.
//   combine_epilogue_kernel (source rank, after the barrier)
//       out[t, c] = bf16( s[t, c] + sum_{j = 0..k-1, id valid} rw[t, j] * combined[t * k + j, c] )
//       s = shared expert output (0 without one); fp32 arithmetic, j ascending: bitwise deterministic.
//       Masked routes (-1) and invalid ids (reported by the schedule) are skipped; their rows are never read.
//
// Roles: push is one warp per row (copy_row_warp over NVLink); the epilogue is one thread per 8 columns.
// Sync: each push thread fences at system scope before exiting, so the barrier arrive that follows in the
// stream releases its peer stores (docs/sync_protocol.md).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "mok/peer_group.h"
#include "src/device/common/row_copy.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/schedule/placement.h"

namespace mok::combine {

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
    const int32_t route = p.row_route[row];
    if (route < 0) return;  // padding
    const schedule::RouteCoords c = schedule::route_coords(route, p.num_tokens, p.top_k);
    uint4* dst = static_cast<uint4*>(p.combined.base[c.src]) + (int64_t(c.token) * p.top_k + c.slot) * p.row_vectors;
    device::copy_row_warp(p.y + row * p.row_vectors, dst, p.row_vectors, lane);
  });
  // Why: the barrier arrive after this kernel publishes these peer stores; order them at system scope.
  device::fence_acq_rel_sys();
}

struct EpilogueTraits {
  static constexpr int kThreads = 256;
  static constexpr int kColumns = 8;  // one 16-byte vector of bf16 per thread
};

struct EpilogueParams {
  const uint4* combined;       // bf16 [T * k, H], this rank's combine buffer
  const uint4* shared_out;     // bf16 [padded T, H], or nullptr without a shared expert
  const float* router_weights; // [T, k]
  const void* topk_idx;        // int32 or int64 [T, k]
  uint4* out;                  // bf16 [T, H]
  int num_tokens;
  int top_k;
  int num_experts;
  int row_vectors;             // H / 8
};

template <typename Index>
__global__ void __launch_bounds__(EpilogueTraits::kThreads) combine_epilogue_kernel(EpilogueParams p) {
  const int64_t total = int64_t(p.num_tokens) * p.row_vectors;
  const Index* topk = static_cast<const Index*>(p.topk_idx);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t token = i / p.row_vectors;
    const int64_t vector = i % p.row_vectors;
    float acc[EpilogueTraits::kColumns];
    if (p.shared_out != nullptr) {
      const uint4 s = p.shared_out[i];
      const __nv_bfloat162* s2 = reinterpret_cast<const __nv_bfloat162*>(&s);
#pragma unroll
      for (int c = 0; c < EpilogueTraits::kColumns / 2; ++c) {
        const float2 f = __bfloat1622float2(s2[c]);
        acc[2 * c] = f.x;
        acc[2 * c + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int c = 0; c < EpilogueTraits::kColumns; ++c) acc[c] = 0.f;
    }
    for (int j = 0; j < p.top_k; ++j) {
      const int64_t route = token * p.top_k + j;
      const int64_t id = static_cast<int64_t>(topk[route]);
      if (id < 0 || id >= p.num_experts) continue;
      const float rw = p.router_weights[route];
      const uint4 y = p.combined[route * p.row_vectors + vector];
      const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
      for (int c = 0; c < EpilogueTraits::kColumns / 2; ++c) {
        const float2 f = __bfloat1622float2(y2[c]);
        acc[2 * c] = __fmaf_rn(rw, f.x, acc[2 * c]);
        acc[2 * c + 1] = __fmaf_rn(rw, f.y, acc[2 * c + 1]);
      }
    }
    uint4 o;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int c = 0; c < EpilogueTraits::kColumns / 2; ++c) o2[c] = __floats2bfloat162_rn(acc[2 * c], acc[2 * c + 1]);
    p.out[i] = o;
  }
}

}  // namespace mok::combine
