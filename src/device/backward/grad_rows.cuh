// The backward's row movements, one scheduled row by one warp: the reverse of the forward's communication
// (pull on the expert's rank in the dispatch direction, push into the token's rank in the combine
// direction; docs/design.md, "Backward"). Used by the unfused stage kernels in
// src/device/kernels/backward_row_kernels.cuh.
//
//   pull_grad_row (expert rank, after the barrier that published every rank's x, d_out and router weights)
//       row_route[row] = (src, token, slot), rw = rw_src[token * k + slot]:
//       d_out_rows[row] = d_out_src[token]                      (peer read; not for src == gathered_rank: the
//                                                                down dgrad gathers those rows from d_out itself)
//       dy_rows[row]    = bf16(rw * d_out_src[token])           one fp32 product and one rounding per element (not
//                                                                with FP8 weight gradients: quantize_columns_fp8
//                                                                reads it by route)
//       row_weight[row] = rw
//       x_rows[row]     = kept_x_rows[row] when row < kept_rows (the context's copy), else x_src[token]
//                         (only when x_rows is set: a context that keeps every row is read in place)
//       padding rows (route -1): zeros, row_weight 0
//       FP8 (GradPullFp8, the unfused FP8 backward): d_out_rows[row] is not written; the row is quantized per
//       1 x 128 instead, into the down dgrad's e4m3 A and its scales: quantize_rows_fp8's bits (a block's scale is
//       its amax / 448 whichever kernel takes it), without a bf16 copy written and read again
//   push_grad_row (expert rank, after the gate/up dgrad)
//       combined_src[token * k + slot, :] = d_x_rows[row, :]   (peer write: the forward's combine rows)
//       d_rw_src[token * k + slot]        = sum over n-blocks nb = 0, 1, ... of row_partials[row, nb]
//       nothing for padding rows
// Lanes move 16-byte vectors (8 bf16), kUnroll (kRowCopyUnroll by default) of them in flight per lane, as
// copy_row_warp.
// Determinism: every destination row and value has one writer; the d_rw sum has one fixed order in fp32.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "mok/peer_group.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/common/fp8_quant.cuh"
#include "src/device/common/row_copy.cuh"
#include "src/device/common/status.cuh"
#include "src/device/dispatch/pull_rows.cuh"
#include "src/device/schedule/placement.h"

namespace mok::backward {

// Where a scheduled row's inputs live.
struct GradPullSources {
  PeerPointers x;               // every rank's symmetric x, bf16 [padded T, H]
  PeerPointers d_out;           // every rank's symmetric d_out, bf16 [padded T, H]
  PeerPointers router_weights;  // every rank's symmetric router weights, fp32 [T * k]
  const uint4* kept_x_rows;     // the context's x rows, bf16 [kept_rows, H] (schedule rows [0, kept_rows))
  int64_t kept_rows;
  int gathered_rank = -1;       // routes from this rank get no d_out row (MoeOptions::gather_rows); -1: all do
};

// One scheduled row's outputs on this rank.
struct GradPullRow {
  uint4* x;            // bf16 [H], or null (the GEMMs read the context's rows)
  uint4* d_out;        // bf16 [H]
  uint4* dy;           // bf16 [H], or null (the FP8 weight gradients read dy where it is pulled)
  float* row_weight;   // one fp32
};

// FP8: where the pull writes each d_out row quantized (its bf16 copy is then not written).
struct GradPullFp8 {
  uint8_t* d_out = nullptr;        // e4m3 [rows, H]; null: bf16 d_out rows as usual
  float* d_out_scales = nullptr;   // fp32 [ceil(H / 128), rows]
  int64_t rows = 0;                // the scales' row stride (the capacity)
  bool power_of_two = false;       // MoeOptions::fp8_power_of_two_scales
  DeviceStatus* status = nullptr;  // a non-finite block reported here (kDOut, the row)
  int rank = 0;
};

// Where a scheduled row's results go.
struct GradPushDestinations {
  PeerPointers combined;  // every rank's symmetric combine buffer, bf16 [T * k, H]: the d_x_route rows
  PeerPointers d_rw;      // every rank's symmetric d_rw, fp32 [T * k]
};

// bf16(scale * v) of the 8 bf16 in a 16-byte vector: one fp32 product (no contraction) and one rounding each.
__device__ __forceinline__ uint4 scale_bf16x8(const uint4& v, float scale) {
  const __nv_bfloat162* in = reinterpret_cast<const __nv_bfloat162*>(&v);
  uint4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float2 f = __bfloat1622float2(in[c]);
    o[c] = __floats2bfloat162_rn(__fmul_rn(scale, f.x), __fmul_rn(scale, f.y));
  }
  return out;
}

// Vector i (8 bf16, `present` when i < row_vectors; absent: zeros) of a d_out row, quantized as its 128-column block
// (the 16 vectors held by this half-warp: every lane of the warp calls this) into q's e4m3 row and scale.
__device__ __forceinline__ void quantize_pulled_vector(const GradPullFp8& q, const uint4& v, bool present, int i,
                                                       int64_t row, int row_vectors, int lane) {
  float f[8];
  const __nv_bfloat162* in = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float2 pair = present ? __bfloat1622float2(in[c]) : make_float2(0.f, 0.f);
    f[2 * c] = pair.x;
    f[2 * c + 1] = pair.y;
  }
  float amax = 0.f;
  int finite = 1;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    finite &= isfinite(f[j]) ? 1 : 0;
    amax = fmaxf(amax, fabsf(f[j]));
  }
  for (int offset = 8; offset > 0; offset /= 2) {  // the block's 16 lanes (half-warps hold whole blocks)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    finite &= __shfl_xor_sync(0xffffffffu, finite, offset);
  }
  const float scale = device::fp8_block_scale(amax, finite != 0, q.power_of_two);
  if (!present) return;
  uint2 packed = {0, 0};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    packed.x |= uint32_t(device::to_e4m3(f[j], scale)) << (8 * j);
    packed.y |= uint32_t(device::to_e4m3(f[4 + j], scale)) << (8 * j);
  }
  reinterpret_cast<uint2*>(q.d_out + row * int64_t(row_vectors) * 8)[i] = packed;
  if (lane % 16 == 0) {
    q.d_out_scales[int64_t(i / 16) * q.rows + row] = scale;
    if (isnan(scale) && q.status != nullptr) device::record_nonfinite(q.status, NonFiniteWhere::kDOut, q.rank, row);
  }
}

// kUnroll: 16-byte vectors a lane keeps in flight (fewer where registers are short: the FP8 backward megakernel's
// copy warps).
template <int kUnroll = device::kRowCopyUnroll>
__device__ __forceinline__ void pull_grad_row(const GradPullSources& src, const GradPullRow& dst, int64_t row,
                                              int32_t route, int num_tokens, int top_k, int row_vectors, int lane,
                                              const GradPullFp8& fp8 = {}) {
  const bool quantize = fp8.d_out != nullptr;
  if (route < 0) {
    if (dst.x != nullptr) device::zero_row_warp(dst.x, row_vectors, lane);
    if (quantize) {  // zeros and the scale of a zero block, as quantize_rows_fp8 gives the zeroed bf16 row
      for (int base = 0; base < row_vectors; base += 32)
        quantize_pulled_vector(fp8, make_uint4(0, 0, 0, 0), base + lane < row_vectors, base + lane, row, row_vectors,
                               lane);
    } else {
      device::zero_row_warp(dst.d_out, row_vectors, lane);
    }
    if (dst.dy != nullptr) device::zero_row_warp(dst.dy, row_vectors, lane);
    if (lane == 0) *dst.row_weight = 0.f;
    return;
  }
  const schedule::RouteCoords c = schedule::route_coords(route, num_tokens, top_k);
  // Every lane reads the same word (one transaction); each needs the weight for its own vectors.
  const float rw = static_cast<const float*>(src.router_weights.base[c.src])[int64_t(c.token) * top_k + c.slot];
  if (lane == 0) *dst.row_weight = rw;
  if (dst.x != nullptr) {
    const uint4* x_src = row < src.kept_rows ? src.kept_x_rows + row * row_vectors
                                             : dispatch::source_row(src.x, route, num_tokens, top_k, row_vectors);
    device::copy_row_warp<kUnroll>(x_src, dst.x, row_vectors, lane);
  }
  const uint4* __restrict__ d_out_src = dispatch::source_row(src.d_out, route, num_tokens, top_k, row_vectors);
  for (int base = 0; base < row_vectors; base += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < row_vectors) v[u] = d_out_src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < row_vectors) {
        if (!quantize && c.src != src.gathered_rank) dst.d_out[i] = v[u];
        if (dst.dy != nullptr) dst.dy[i] = scale_bf16x8(v[u], rw);
      }
      if (quantize) quantize_pulled_vector(fp8, v[u], i < row_vectors, i, row, row_vectors, lane);
    }
  }
}

// d_x_row and partials (n_blocks fp32) of a scheduled row, to the token's rank.
template <int kUnroll = device::kRowCopyUnroll>
__device__ __forceinline__ void push_grad_row(const GradPushDestinations& dst, const uint4* d_x_row,
                                              const float* partials, int n_blocks, int32_t route, int num_tokens,
                                              int top_k, int row_vectors, int lane) {
  if (route < 0) return;
  if (d_x_row != nullptr)  // null: the row stays (scattered by the gate/up dgrad, or read in place at EP = 1)
    device::copy_row_warp<kUnroll>(d_x_row,
                                   combine::destination_row(dst.combined, route, num_tokens, top_k, row_vectors),
                                   row_vectors, lane);
  if (lane == 0) {
    float d_rw = partials[0];
    for (int nb = 1; nb < n_blocks; ++nb) d_rw = __fadd_rn(d_rw, partials[nb]);
    const schedule::RouteCoords c = schedule::route_coords(route, num_tokens, top_k);
    static_cast<float*>(dst.d_rw.base[c.src])[int64_t(c.token) * top_k + c.slot] = d_rw;
  }
}

}  // namespace mok::backward
