// Combine, on either side of a barrier:
//
//   push_row (expert rank: the unfused push_rows_kernel in src/device/kernels/row_kernels.cuh, or the
//             megakernel's communication CTAs)  combined_src[token * k + slot, :] = y[row, :] for a row with
//             a route; each (token, slot) has exactly one expert row, so each destination row has one
//             writer on one rank.
//   combine_epilogue_kernel (source rank, after the barrier)
//       out[t, c] = bf16( s[t, c] + sum_{j = 0..k-1, id valid} rw[t, j] * combined[t * k + j, c] )
//       or, where the expert rows are this rank's (EP = 1: MoeWorkspace's local combine, no push before it),
//       the same sum over rows[route_row[t * k + j], c]: the expert-major rows themselves, read through the
//       schedule's inverse map (the values push_row would have copied, so the same bits).
//       s = shared expert output (0 without one); fp32 arithmetic, j ascending: bitwise deterministic.
//       Masked routes (-1) and invalid ids (reported by the schedule) are skipped; their rows are never read.
//       The backward's d_x is the same sum with rw = 1 (router_weights null; fma(1, y, acc) rounds like
//       acc + y), s = the shared expert's d_x partial, combined = the pushed d_x_route rows; it also writes
//       route_out[t, j] = route_values[t * k + j] (the pushed d_rw) at valid routes and 0 elsewhere.
//       A call on a schedule built before (forward_with_schedule, the backward) passes the schedule's own_ids:
//       every route whose id differs from it is reported (kStatusIdsMismatch); the sum is the same either way.
//
// Roles: push is one warp per row (copy_row_warp over NVLink); the epilogue is one thread per 8 columns.
// Sync: every pushing thread fences at system scope before its kernel exits, so the barrier arrive that
// follows in the stream releases its peer stores (docs/sync_protocol.md).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "mok/peer_group.h"
#include "src/device/common/row_copy.cuh"
#include "src/device/common/status.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/schedule/placement.h"

namespace mok::combine {

// Where the expert output row of `route` (not -1) goes: its (token, slot) row of the source rank's
// combine buffer.
__device__ __forceinline__ uint4* destination_row(const PeerPointers& combined, int32_t route, int num_tokens,
                                                  int top_k, int row_vectors) {
  const schedule::RouteCoords c = schedule::route_coords(route, num_tokens, top_k);
  return static_cast<uint4*>(combined.base[c.src]) + (int64_t(c.token) * top_k + c.slot) * row_vectors;
}

// One row by one warp: expert output row `src` to its destination row; nothing for padding (route -1).
__device__ __forceinline__ void push_row(const PeerPointers& combined, const uint4* src, int32_t route, int num_tokens,
                                         int top_k, int row_vectors, int lane) {
  if (route >= 0)
    device::copy_row_warp(src, destination_row(combined, route, num_tokens, top_k, row_vectors), row_vectors, lane);
}

struct EpilogueTraits {
  static constexpr int kThreads = 256;
  static constexpr int kColumns = 8;  // one 16-byte vector of bf16 per thread
  static constexpr int kRouteBatch = 4;  // routes whose rows a thread loads before it adds them
};

struct EpilogueParams {
  const uint4* combined;       // bf16 [T * k, H], this rank's combine buffer (unused with rows)
  const uint4* shared_out;     // bf16 [padded T, H], or nullptr without a shared expert
  const float* router_weights; // [T, k]; nullptr: every weight is 1
  const void* topk_idx;        // int32 or int64 [T, k]
  uint4* out;                  // bf16 [T, H]
  const float* route_values;   // fp32 [T * k] read at valid routes, or nullptr (then route_out is too)
  float* route_out;            // fp32 [T, k]: route_values at valid routes, 0 at masked and invalid ones
  int num_tokens;
  int top_k;
  int num_experts;
  int row_vectors;             // H / 8
  const uint4* rows = nullptr;         // bf16 [capacity, H]: the expert-major rows, read instead of combined
  const int32_t* route_row = nullptr;  // with rows: [T * k] the row of route t * k + j (-1: none, skipped)
  const int32_t* schedule_ids = nullptr;  // [T * k] the ids the schedule was built from, checked against
                                          // topk_idx (nullptr: no check, the call built its schedule)
  DeviceStatus* status = nullptr;         // with schedule_ids: where a difference is reported
};

template <typename Index>
__device__ __forceinline__ bool is_valid_route(const Index* topk, int64_t route, int num_experts) {
  const int64_t id = static_cast<int64_t>(topk[route]);
  return id >= 0 && id < num_experts;
}

template <typename Index>
__global__ void __launch_bounds__(EpilogueTraits::kThreads) combine_epilogue_kernel(EpilogueParams p) {
  const int64_t total = int64_t(p.num_tokens) * p.row_vectors;
  const Index* topk = static_cast<const Index*>(p.topk_idx);
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  if (p.route_out != nullptr || p.schedule_ids != nullptr) {
    for (int64_t route = first; route < int64_t(p.num_tokens) * p.top_k; route += stride) {
      if (p.schedule_ids != nullptr) {
        const int32_t id = schedule::saturate_id(static_cast<int64_t>(topk[route]));
        if (id != p.schedule_ids[route]) device::record_ids_mismatch(p.status, route, id);
      }
      if (p.route_out != nullptr)
        p.route_out[route] = is_valid_route(topk, route, p.num_experts) ? p.route_values[route] : 0.f;
    }
  }
  for (int64_t i = first; i < total; i += stride) {
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
    // The token's routes in batches: a batch's ids and row indices, then its rows, are loaded before any row is
    // added, so a thread has a batch of loads in flight at each step instead of one (a row's address waits on two
    // loads: the id and route_row). Those two are read for every route of the batch (clamped to the token's last
    // one: in bounds), so that no load waits on another's value; a masked or invalid route's row is never read.
    // The sum's order is unchanged: j ascending, within and across batches.
    const uint4* source = p.rows != nullptr ? p.rows : p.combined;
    for (int j0 = 0; j0 < p.top_k; j0 += EpilogueTraits::kRouteBatch) {
      int32_t row[EpilogueTraits::kRouteBatch];  // route ids and rows are int32 (RoutingShape: below 2^30)
#pragma unroll
      for (int b = 0; b < EpilogueTraits::kRouteBatch; ++b) {
        const int64_t route = token * p.top_k + min(j0 + b, p.top_k - 1);
        const int64_t id = static_cast<int64_t>(topk[route]);
        const int32_t placed = p.rows != nullptr ? p.route_row[route] : static_cast<int32_t>(route);
        // -1: past k, masked, invalid, or not placed (only after a capacity overflow: reported)
        row[b] = j0 + b < p.top_k && id >= 0 && id < p.num_experts ? placed : -1;
      }
      uint4 y[EpilogueTraits::kRouteBatch];
      float rw[EpilogueTraits::kRouteBatch];
#pragma unroll
      for (int b = 0; b < EpilogueTraits::kRouteBatch; ++b) {
        if (row[b] < 0) continue;
        y[b] = source[int64_t(row[b]) * p.row_vectors + vector];
        rw[b] = p.router_weights != nullptr ? p.router_weights[token * p.top_k + j0 + b] : 1.f;
      }
#pragma unroll
      for (int b = 0; b < EpilogueTraits::kRouteBatch; ++b) {
        if (row[b] < 0) continue;
        const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(&y[b]);
#pragma unroll
        for (int c = 0; c < EpilogueTraits::kColumns / 2; ++c) {
          const float2 f = __bfloat1622float2(y2[c]);
          acc[2 * c] = __fmaf_rn(rw[b], f.x, acc[2 * c]);
          acc[2 * c + 1] = __fmaf_rn(rw[b], f.y, acc[2 * c + 1]);
        }
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
