// FP8 quantization kernels (include/mok/fp8.h): bf16 -> e4m3 with block scales.
//   rows:    a warp per (row, 128-column block) in turn (grid-stride): 4 columns a lane, the block's amax by a
//            butterfly (every lane the same value), the scale, then each lane converts its own columns.
//   weights: one CTA of 256 threads per 128 x 128 block: each thread's amax over its values, a shared-memory
//            reduction, then the conversion (the block is read twice; the second read hits L1/L2).
//   columns: one CTA per 128 rows x 128 columns of a schedule's rows, transposed through shared memory
//            (quantize_columns_fp8, src/host/quantize_fp8.h).
// The scale, its reciprocal and every product are IEEE fp32 (amax / 448, 1 / scale, value * (1 / scale);
// src/device/common/fp8_quant.cuh), so the CPU reference (reference/fp8.h) gives the same bits.
#include "mok/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>

#include "src/device/common/fp8_quant.cuh"
#include "src/device/common/status.cuh"
#include "src/device/schedule/placement.h"
#include "src/host/check.h"
#include "src/host/launch_cache.h"
#include "src/host/quantize_fp8.h"

namespace mok {
namespace {

using device::to_e4m3;

constexpr int kBlock = 128;

// One warp's 128-column block of a row: lane l holds columns col + 0..3 (col = block start + 4 l; a null `src`, or
// columns past k: zeros), read as one 8-byte load (k % 8 == 0, validate: a lane's 4 columns lie all inside k or all
// past it). Returns the block's scale (the same in every lane) and the lane's 4 e4m3 values packed little-endian.
__device__ __forceinline__ float quantize_block_warp(const __nv_bfloat16* src, int col, int k, bool power_of_two,
                                                     uint32_t& packed) {
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (src != nullptr && col < k) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src + col);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < 4; ++i) {
    finite = finite && isfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  finite = __all_sync(0xffffffffu, finite);
  const float scale = device::fp8_block_scale(amax, finite, power_of_two);
  packed = 0;
  for (int i = 0; i < 4; ++i) packed |= uint32_t(to_e4m3(v[i], scale)) << (8 * i);
  return scale;
}

// Stores a lane's 4 e4m3 bytes at `out` (the lane's first column; past k: nothing): one 4-byte store when `out` is
// 4-byte aligned (warp-uniform: the row's base and k % 8 == 0 decide it), else 4 byte stores.
__device__ __forceinline__ void store_e4m3x4(uint8_t* out, int col, int k, uint32_t packed) {
  if (col >= k) return;
  if (reinterpret_cast<uintptr_t>(out) % 4 == 0) {
    *reinterpret_cast<uint32_t*>(out) = packed;
  } else {
    for (int i = 0; i < 4; ++i) out[i] = uint8_t(packed >> (8 * i));
  }
}

// The row kernels' grid: a few CTAs per SM, each warp looping over (row, block) items (a warp per item and a CTA
// per 8 items made the launch itself the bottleneck: 1.98 ms for two d_out-sized calls, perf_notes round 30).
constexpr int kRowThreads = 256;
unsigned row_kernel_ctas(int64_t items) {
  int device = 0;
  MOK_CHECK_CUDA(cudaGetDevice(&device));
  const int64_t wanted = (items + kRowThreads / 32 - 1) / (kRowThreads / 32);
  const int64_t most = 16LL * detail::device_limits(device).num_sms;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(wanted, most)));
}

// The row kernels' loop: each warp takes (row, 128-column block) items of rows [0, rows) in turn, f(row, block, col)
// with col the lane's first column (warp-uniform items: f may shuffle).
template <class F>
__device__ __forceinline__ void for_each_row_block(int64_t rows, int k, F&& f) {
  const int k_blocks = (k + kBlock - 1) / kBlock;
  const int64_t items = rows * k_blocks;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; item < items; item += warps) {
    const int block = static_cast<int>(item % k_blocks);
    f(item / k_blocks, block, block * kBlock + 4 * int(threadIdx.x % 32));
  }
}

// Warps over (row, 128-column block) items of rows [0, min(rows, *rows_used)) (rows_used null: every row). Block b of
// row r: out[r, 128 b ...] and scales[b, r].
__global__ void quantize_rows_kernel(const __nv_bfloat16* in, int64_t rows, int k, uint8_t* out, float* scales,
                                     bool power_of_two, const int32_t* rows_used, DeviceStatus* status,
                                     NonFiniteWhere where, int rank) {
  const int64_t live_rows = rows_used != nullptr && *rows_used < rows ? int64_t(*rows_used) : rows;
  for_each_row_block(live_rows, k, [&](int64_t row, int block, int col) {
    uint32_t q;
    const float scale = quantize_block_warp(in + row * k, col, k, power_of_two, q);
    store_e4m3x4(out + row * k + col, col, k, q);
    if (threadIdx.x % 32 == 0) {
      scales[int64_t(block) * rows + row] = scale;
      if (status != nullptr && isnan(scale)) device::record_nonfinite(status, where, rank, row);
    }
  });
}

// Warps over (row, 128-column block) items of x [tokens, h] to padded_tokens rows: the FP8 row layout of
// src/host/quantize_fp8.h, plus the scale again at [block, row] of `scales`; power_of_two: scales rounded up to
// powers of two. Rows past `tokens`: zeros, scale 1. A block with a NaN or an infinity is reported to `status`
// (kStatusNonFinite, the row and `rank`).
__global__ void publish_fp8_rows_kernel(const __nv_bfloat16* x, int64_t tokens, int64_t padded_tokens, int h,
                                        uint8_t* rows, float* scales, bool power_of_two, DeviceStatus* status,
                                        int rank) {
  for_each_row_block(padded_tokens, h, [&](int64_t row, int block, int col) {
    uint32_t q;
    const float scale = quantize_block_warp(row < tokens ? x + row * h : nullptr, col, h, power_of_two, q);
    uint8_t* out = rows + row * 2 * int64_t(h);
    store_e4m3x4(out + col, col, h, q);
    if (threadIdx.x % 32 == 0) {
      reinterpret_cast<float*>(out + h)[block] = scale;
      scales[int64_t(block) * padded_tokens + row] = scale;
      if (isnan(scale)) device::record_nonfinite(status, NonFiniteWhere::kX, rank, row);
    }
  });
}

__global__ void unpack_fp8_row_scales_kernel(const uint8_t* rows, const int32_t* scheduled_rows, int64_t row_limit,
                                             int h, float* scales) {
  const int k_blocks = (h + kBlock - 1) / kBlock;
  const int64_t rows_used = *scheduled_rows < row_limit ? int64_t(*scheduled_rows) : row_limit;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows_used * k_blocks) return;
  const int64_t row = i % rows_used;  // consecutive threads: consecutive rows, coalesced writes
  const int block = static_cast<int>(i / rows_used);
  const uint8_t* fp8_row = rows + row * detail::fp8_row_bytes(h);
  scales[int64_t(block) * row_limit + row] = reinterpret_cast<const float*>(fp8_row + h)[block];
}

// quantize_columns_fp8 (src/host/quantize_fp8.h): each expert's segment start in `out`, its rows re-padded to 128.
// One thread: E is at most a few hundred.
// Expert e's rows in `in`: its count, cut at *scheduled_rows (null: not cut; a capacity overflow's 0 empties all).
__device__ __forceinline__ int32_t live_count(const int32_t* counts, const int32_t* in_offsets,
                                              const int32_t* scheduled_rows, int e) {
  if (scheduled_rows == nullptr) return counts[e];
  return max(0, min(counts[e], *scheduled_rows - in_offsets[e]));
}

__global__ void column_row_offsets_kernel(const int32_t* counts, const int32_t* in_offsets,
                                          const int32_t* scheduled_rows, int experts, int32_t* offsets) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int32_t at = 0;
  for (int e = 0; e < experts; ++e) {
    offsets[e] = at;
    at += (live_count(counts, in_offsets, scheduled_rows, e) + kBlock - 1) / kBlock * kBlock;
  }
  offsets[experts] = at;
}

constexpr int kColumnTile = 128;   // columns per CTA of quantize_columns_kernel
constexpr int kColumnThreads = 256;  // 64 column pairs x 4 quarters of the block's 128 rows

// Where quantize_columns_kernel's rows come from: `in`, or each row's route (Fp8ColumnQuantizeArgs' pulled rows).
struct ColumnSource {
  const __nv_bfloat16* in;
  PeerPointers pulled_rows;
  PeerPointers pulled_weights;
  bool weighted;
  const int32_t* row_route;  // null: `in`
  int num_tokens;
  int top_k;
};

// One CTA per (128-row block of `out`, 128 columns): the block's source rows first (its expert's, by route with
// `source.row_route`; null past the count or without a route: zeros), then thread (pair p, quarter q) reads columns
// 2p, 2p + 1 of rows [32 q, 32 q + 32) of them (columns past k: none) as 32 independent 4-byte loads (a warp's are
// one 128-byte row segment each), each column's amax over the 128 rows (the quarters' combined through shared
// memory), its scale, then its 32 e4m3 bytes per column into the CTA's transposed tile in shared memory (a column's
// 128 bytes a row of it, its 16-byte chunks swizzled by the column so that a warp's chunk writes fall on distinct
// banks), written out as whole 128-byte columns of `out` (K-major: a column is a row of it). Blocks past the last
// segment write nothing. The amax is order-free and each value's conversion is to_e4m3's: the bits of the CPU
// reference.
__global__ void __launch_bounds__(kColumnThreads) quantize_columns_kernel(
    const ColumnSource source, int k, int experts, const int32_t* counts, const int32_t* in_offsets,
    const int32_t* scheduled_rows, const int32_t* out_offsets, int64_t out_rows, uint8_t* out, float* scales,
    bool power_of_two, bool block_scales) {
  constexpr int kQuarterRows = kBlock / 4;
  constexpr int kChunks = kBlock / 16;  // 16-byte chunks of a column's 128 bytes
  __shared__ __align__(16) uint8_t staged[kColumnTile][kBlock];
  __shared__ float quarter_amax[4][kColumnTile];
  __shared__ int quarter_finite[4][kColumnTile];
  __shared__ float tile_amax;  // block_scales: the whole 128 x 128 block's
  __shared__ int tile_finite;
  __shared__ const __nv_bfloat16* row_start[kBlock];  // the block's source rows (null: zeros)
  __shared__ float row_weight[kBlock];
  const int64_t out_row = int64_t(blockIdx.x) * kBlock;
  if (out_row >= out_offsets[experts]) return;  // CTA-uniform
  // The block's expert: the last one whose segment starts at or before it (an empty expert's segment is empty).
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (out_offsets[mid] <= out_row) lo = mid; else hi = mid - 1;
  }
  const int64_t first = out_row - out_offsets[lo];  // the block's first row within its expert
  const int32_t count = live_count(counts, in_offsets, scheduled_rows, lo);
  const int valid = static_cast<int>(max(int64_t(0), min(int64_t(kBlock), int64_t(count) - first)));
  const int col0 = blockIdx.y * kColumnTile;
  if (threadIdx.x < kBlock) {
    const int r = threadIdx.x;
    const int64_t row = int64_t(in_offsets[lo]) + first + r;  // the schedule's row
    const __nv_bfloat16* start = nullptr;
    float weight = 1.0f;
    if (r < valid && source.row_route == nullptr) {
      start = source.in + row * k;
    } else if (r < valid && source.row_route[row] >= 0) {
      const schedule::RouteCoords route = schedule::route_coords(source.row_route[row], source.num_tokens, source.top_k);
      start = static_cast<const __nv_bfloat16*>(source.pulled_rows.base[route.src]) + int64_t(route.token) * k;
      if (source.weighted)
        weight = static_cast<const float*>(source.pulled_weights.base[route.src])[int64_t(route.token) * source.top_k +
                                                                                 route.slot];
    }
    row_start[r] = start;
    row_weight[r] = weight;
  }
  __syncthreads();
  const int c = 2 * (threadIdx.x % 64), quarter = threadIdx.x / 64, r0 = quarter * kQuarterRows;
  const bool live = col0 + c < k;  // k % 64 == 0: both columns or neither
  __nv_bfloat162 v[kQuarterRows];
#pragma unroll
  for (int r = 0; r < kQuarterRows; ++r) {
    const __nv_bfloat16* start = row_start[r0 + r];
    const uint32_t raw = live && start != nullptr ? *reinterpret_cast<const uint32_t*>(start + col0 + c) : 0u;
    v[r] = *reinterpret_cast<const __nv_bfloat162*>(&raw);
  }
  if (source.weighted) {  // dy = bf16(rw * d_out): one fp32 product and one rounding per value, the pull's
#pragma unroll
    for (int r = 0; r < kQuarterRows; ++r) {
      const float2 f = __bfloat1622float2(v[r]);
      const float w = row_weight[r0 + r];
      v[r] = __floats2bfloat162_rn(__fmul_rn(w, f.x), __fmul_rn(w, f.y));
    }
  }
  float amax[2] = {0.0f, 0.0f};
  bool finite[2] = {true, true};
#pragma unroll
  for (int r = 0; r < kQuarterRows; ++r) {
    const float2 f = __bfloat1622float2(v[r]);
    finite[0] = finite[0] && isfinite(f.x);
    finite[1] = finite[1] && isfinite(f.y);
    amax[0] = fmaxf(amax[0], fabsf(f.x));
    amax[1] = fmaxf(amax[1], fabsf(f.y));
  }
  for (int j = 0; j < 2; ++j) {
    quarter_amax[quarter][c + j] = amax[j];
    quarter_finite[quarter][c + j] = finite[j];
  }
  __syncthreads();
  if (block_scales) {  // CTA-uniform: warp 0 reduces the block's 128 columns (4 a lane), then every thread reads it
    if (threadIdx.x < 32) {
      float m = 0.0f;
      bool f = true;
      for (int cj = threadIdx.x; cj < kColumnTile; cj += 32)
        for (int q = 0; q < 4; ++q) {
          m = fmaxf(m, quarter_amax[q][cj]);
          f = f && quarter_finite[q][cj];
        }
      for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
      f = __all_sync(0xffffffffu, f);
      if (threadIdx.x == 0) {
        tile_amax = m;
        tile_finite = f;
      }
    }
    __syncthreads();
  }
  float scale[2];
  for (int j = 0; j < 2; ++j) {
    const int cj = c + j;
    const float column_amax =
        fmaxf(fmaxf(quarter_amax[0][cj], quarter_amax[1][cj]), fmaxf(quarter_amax[2][cj], quarter_amax[3][cj]));
    const float block_amax = block_scales ? tile_amax : column_amax;
    const bool block_finite =
        block_scales ? tile_finite != 0
                     : quarter_finite[0][cj] && quarter_finite[1][cj] && quarter_finite[2][cj] && quarter_finite[3][cj];
    scale[j] = device::fp8_block_scale(block_amax, block_finite, power_of_two);
  }
  // The thread's two 16-byte chunks of each column: rows [r0, r0 + 16) and [r0 + 16, r0 + 32).
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int cj = c + j;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t words[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int r = 16 * half + 4 * w;
        const auto value = [&](int i) { return j == 0 ? __low2float(v[r + i]) : __high2float(v[r + i]); };
        words[w] = uint32_t(device::to_e4m3x2(value(0), value(1), scale[j])) |
                   uint32_t(device::to_e4m3x2(value(2), value(3), scale[j])) << 16;
      }
      const int chunk = 2 * quarter + half;
      *reinterpret_cast<uint4*>(&staged[cj][16 * (chunk ^ ((cj >> 1) % kChunks))]) =
          make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
  if (block_scales) {
    if (threadIdx.x == 0) scales[int64_t(blockIdx.y) * (out_rows / kBlock) + out_row / kBlock] = scale[0];
  } else if (quarter == 0 && live) {
    scales[(out_row / kBlock) * k + col0 + c] = scale[0];
    scales[(out_row / kBlock) * k + col0 + c + 1] = scale[1];
  }
  __syncthreads();
  // Whole columns out: 8 threads a column's 128 bytes, a warp 4 columns.
  for (int i = threadIdx.x; i < kColumnTile * kChunks; i += kColumnThreads) {
    const int cj = i / kChunks, chunk = i % kChunks;
    if (col0 + cj >= k) break;  // i only grows: every later column is past k too
    *reinterpret_cast<uint4*>(out + int64_t(col0 + cj) * out_rows + out_row + 16 * chunk) =
        *reinterpret_cast<const uint4*>(&staged[cj][16 * (chunk ^ ((cj >> 1) % kChunks))]);
  }
}

constexpr int kWeightThreads = 256;

__global__ void quantize_weights_kernel(const __nv_bfloat16* in, int64_t rows, int k, uint8_t* out, float* scales,
                                        bool power_of_two, uint8_t* out_t, float* scales_t) {
  // blockIdx.x: k-block, blockIdx.y: row block, blockIdx.z: expert.
  const int64_t expert = blockIdx.z;
  const int64_t row0 = int64_t(blockIdx.y) * kBlock;
  const int col0 = blockIdx.x * kBlock;
  const int64_t row_end = rows < row0 + kBlock ? rows : row0 + kBlock;
  const int col_end = k < col0 + kBlock ? k : col0 + kBlock;
  const __nv_bfloat16* base = in + expert * rows * k;
  float amax = 0.0f;
  bool finite = true;
  for (int i = threadIdx.x; i < kBlock * kBlock; i += kWeightThreads) {
    const int64_t r = row0 + i / kBlock;
    const int c = col0 + i % kBlock;
    if (r < row_end && c < col_end) {
      const float v = __bfloat162float(base[r * k + c]);
      finite = finite && isfinite(v);
      amax = fmaxf(amax, fabsf(v));
    }
  }
  __shared__ float warp_amax[kWeightThreads / 32];
  __shared__ int warp_finite[kWeightThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  finite = __all_sync(0xffffffffu, finite);
  if (threadIdx.x % 32 == 0) {
    warp_amax[threadIdx.x / 32] = amax;
    warp_finite[threadIdx.x / 32] = finite;
  }
  __syncthreads();
  amax = 0.0f;
  finite = true;
  for (int w = 0; w < kWeightThreads / 32; ++w) {
    amax = fmaxf(amax, warp_amax[w]);
    finite = finite && warp_finite[w];
  }
  const float scale = device::fp8_block_scale(amax, finite, power_of_two);
  uint8_t* out_base = out + expert * rows * k;
  // The transposed copy goes through shared memory: written by rows here, read by columns below (both
  // coalesced in global memory). 129 bytes a row: the column reads spread over the banks.
  __shared__ uint8_t block_t[kBlock][kBlock + 1];
  for (int i = threadIdx.x; i < kBlock * kBlock; i += kWeightThreads) {
    const int64_t r = row0 + i / kBlock;
    const int c = col0 + i % kBlock;
    if (r < row_end && c < col_end) {
      const uint8_t q = to_e4m3(__bfloat162float(base[r * k + c]), scale);
      out_base[r * k + c] = q;
      if (out_t != nullptr) block_t[i / kBlock][i % kBlock] = q;
    }
  }
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  if (out_t != nullptr) {
    __syncthreads();
    uint8_t* out_t_base = out_t + expert * rows * k;  // [k, rows] of this expert
    for (int i = threadIdx.x; i < kBlock * kBlock; i += kWeightThreads) {
      const int c = col0 + i / kBlock;
      const int64_t r = row0 + i % kBlock;
      if (r < row_end && c < col_end) out_t_base[int64_t(c) * rows + r] = block_t[i % kBlock][i / kBlock];
    }
  }
  if (threadIdx.x == 0) {
    scales[(expert * row_blocks + blockIdx.y) * gridDim.x + blockIdx.x] = scale;
    // The transposed matrix's block (column block, row block) is this block: the same scale.
    if (scales_t != nullptr) scales_t[(expert * gridDim.x + blockIdx.x) * row_blocks + blockIdx.y] = scale;
  }
}

void require(bool condition, const char* entry, const std::string& message) {
  if (!condition) throw std::invalid_argument(std::string(entry) + ": " + message);
}

void validate(const Fp8QuantizeArgs& a, const char* entry, bool rows_layout) {
  require(a.in != nullptr && reinterpret_cast<uintptr_t>(a.in) % 16 == 0, entry,
          "in must be a non-null, 16-byte aligned bf16 buffer");
  require(a.out != nullptr, entry, "out must be a non-null e4m3 buffer");
  require(a.scales != nullptr && reinterpret_cast<uintptr_t>(a.scales) % (rows_layout ? 16 : 4) == 0, entry,
          rows_layout ? "scales must be a non-null, 16-byte aligned fp32 buffer"
                      : "scales must be a non-null fp32 buffer");
  require(a.experts >= 1 && (!rows_layout || a.experts == 1), entry,
          rows_layout ? "experts must be 1 (rows of one matrix), got " + std::to_string(a.experts)
                      : "experts must be positive, got " + std::to_string(a.experts));
  require(a.rows >= 0, entry, "rows must be >= 0, got " + std::to_string(a.rows));
  require(!rows_layout || a.rows % 4 == 0, entry,
          "rows must be a multiple of 4 (the scales' rows are a TMA box's 16-byte aligned run), got " +
              std::to_string(a.rows));
  require(a.k > 0 && a.k % 8 == 0, entry, "k must be a positive multiple of 8, got " + std::to_string(a.k));
  require(a.rows <= (int64_t(1) << 31) - 1, entry, "rows must be below 2^31");
}

}  // namespace

void detail::publish_fp8_rows(const void* x, int64_t tokens, int64_t padded_tokens, int h, void* rows, float* scales,
                              bool power_of_two, DeviceStatus* status, int rank, cudaStream_t stream) {
  const int64_t items = padded_tokens * ((h + kBlock - 1) / kBlock);
  if (items == 0) return;
  publish_fp8_rows_kernel<<<row_kernel_ctas(items), kRowThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), tokens, padded_tokens, h, static_cast<uint8_t*>(rows), scales, power_of_two,
      status, rank);
  MOK_CHECK_CUDA(cudaGetLastError());
}

void detail::quantize_columns_fp8(const Fp8ColumnQuantizeArgs& a, cudaStream_t stream) {
  const std::string entry = "quantize_columns_fp8: ";
  if (a.row_route == nullptr) {
    require(a.in != nullptr && reinterpret_cast<uintptr_t>(a.in) % 16 == 0,
            entry + "in must be a non-null, 16-byte aligned bf16 [rows_allocated, k] buffer");
  } else {
    require(a.in == nullptr, entry + "in and row_route exclude each other (rows read from `in` or by route)");
    require(a.num_tokens > 0 && a.top_k > 0, entry + "rows read by route need num_tokens and top_k");
  }
  require(a.k > 0 && a.k % 64 == 0, entry + "k must be a positive multiple of 64, got " + std::to_string(a.k));
  require(a.rows_allocated >= 0, entry + "rows_allocated must be >= 0, got " + std::to_string(a.rows_allocated));
  require(a.local_experts >= 1, entry + "local_experts must be positive, got " + std::to_string(a.local_experts));
  require(a.expert_counts != nullptr && a.expert_row_offsets != nullptr && a.out_row_offsets != nullptr,
          entry + "expert_counts, expert_row_offsets and out_row_offsets must be set");
  require(a.out != nullptr && reinterpret_cast<uintptr_t>(a.out) % 16 == 0,
          entry + "out must be a non-null, 16-byte aligned e4m3 [k, fp8_column_rows(rows_allocated, local_experts)] "
                  "buffer");
  require(a.scales != nullptr && reinterpret_cast<uintptr_t>(a.scales) % 4 == 0,
          entry + "scales must be a non-null fp32 [fp8_column_rows(rows_allocated, local_experts) / 128, k] buffer "
                  "([ceil(k / 128), fp8_column_rows(...) / 128] with block_scales)");
  const int64_t out_rows = fp8_column_rows(a.rows_allocated, a.local_experts);
  const dim3 grid(static_cast<unsigned>(out_rows / kBlock), static_cast<unsigned>((a.k + kColumnTile - 1) / kColumnTile));
  require(grid.y <= 65535, entry + "k too large for one launch");
  column_row_offsets_kernel<<<1, 32, 0, stream>>>(a.expert_counts, a.expert_row_offsets, a.scheduled_rows,
                                                  a.local_experts, a.out_row_offsets);
  MOK_CHECK_CUDA(cudaGetLastError());
  const ColumnSource source{.in = static_cast<const __nv_bfloat16*>(a.in),
                            .pulled_rows = a.pulled_rows,
                            .pulled_weights = a.pulled_weights,
                            .weighted = a.weighted,
                            .row_route = a.row_route,
                            .num_tokens = a.num_tokens,
                            .top_k = a.top_k};
  quantize_columns_kernel<<<grid, kColumnThreads, 0, stream>>>(
      source, a.k, a.local_experts, a.expert_counts, a.expert_row_offsets,
      a.scheduled_rows, a.out_row_offsets, out_rows, static_cast<uint8_t*>(a.out), a.scales, a.power_of_two_scales,
      a.block_scales);
  MOK_CHECK_CUDA(cudaGetLastError());
}

void detail::unpack_fp8_row_scales(const void* rows, const int32_t* scheduled_rows, int64_t row_limit, int h,
                                   float* scales, cudaStream_t stream) {
  const int64_t threads = row_limit * ((h + kBlock - 1) / kBlock);  // an upper bound: the kernel reads the count
  if (threads == 0) return;
  constexpr int kThreads = 256;
  unpack_fp8_row_scales_kernel<<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(rows), scheduled_rows, row_limit, h, scales);
  MOK_CHECK_CUDA(cudaGetLastError());
}

namespace {

// quantize_rows_fp8, a block holding a NaN or an infinity reported to `status` unless it is null.
void quantize_rows(const Fp8QuantizeArgs& args, DeviceStatus* status, NonFiniteWhere where, int rank,
                   cudaStream_t stream) {
  validate(args, "quantize_rows_fp8", true);
  require(args.out_transposed == nullptr && args.scales_transposed == nullptr, "quantize_rows_fp8",
          "out_transposed and scales_transposed are for quantize_weights_fp8 (1 x 128 scales do not transpose)");
  const int64_t items = args.rows * ((args.k + kBlock - 1) / kBlock);  // an upper bound with rows_used
  if (items == 0) return;
  quantize_rows_kernel<<<row_kernel_ctas(items), kRowThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(args.in), args.rows, args.k, static_cast<uint8_t*>(args.out), args.scales,
      args.power_of_two_scales, args.rows_used, status, where, rank);
  MOK_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void quantize_rows_fp8(const Fp8QuantizeArgs& args, cudaStream_t stream) {
  quantize_rows(args, nullptr, NonFiniteWhere::kX, 0, stream);
}

void detail::quantize_rows_fp8(const Fp8QuantizeArgs& args, DeviceStatus* status, NonFiniteWhere where, int rank,
                               cudaStream_t stream) {
  quantize_rows(args, status, where, rank, stream);
}

void quantize_weights_fp8(const Fp8QuantizeArgs& args, cudaStream_t stream) {
  validate(args, "quantize_weights_fp8", false);
  if (args.rows == 0) return;
  const dim3 grid((args.k + kBlock - 1) / kBlock, static_cast<unsigned>((args.rows + kBlock - 1) / kBlock),
                  static_cast<unsigned>(args.experts));
  require(grid.y <= 65535 && grid.z <= 65535, "quantize_weights_fp8", "too many row blocks or experts for one launch");
  require((args.out_transposed == nullptr) == (args.scales_transposed == nullptr), "quantize_weights_fp8",
          "out_transposed and scales_transposed go together (both, or neither)");
  require(args.rows_used == nullptr, "quantize_weights_fp8", "rows_used is for quantize_rows_fp8");
  quantize_weights_kernel<<<grid, kWeightThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(args.in), args.rows, args.k, static_cast<uint8_t*>(args.out), args.scales,
      args.power_of_two_scales, static_cast<uint8_t*>(args.out_transposed), args.scales_transposed);
  MOK_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mok
