// One warp copies one row of 16-byte vectors: the data movement of dispatch (pull) and combine (push).
#pragma once

#include <cstdint>

namespace mok::device {

// Vectors per lane in flight: four 16-byte loads before the first store, so a warp keeps 2 KB of NVLink
// reads outstanding.
inline constexpr int kRowCopyUnroll = 4;

// dst[0..vectors) = src[0..vectors) by the 32 lanes of a warp. Either side may be a peer GPU's memory.
__device__ __forceinline__ void copy_row_warp(const uint4* __restrict__ src, uint4* __restrict__ dst, int vectors,
                                              int lane) {
  for (int base = 0; base < vectors; base += 32 * kRowCopyUnroll) {
    uint4 v[kRowCopyUnroll];
#pragma unroll
    for (int u = 0; u < kRowCopyUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < vectors) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kRowCopyUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < vectors) dst[i] = v[u];
    }
  }
}

// Calls row_fn(row, lane) for every row in [0, rows): one warp per row, the grid's warps striding over rows.
template <class RowFn>
__device__ __forceinline__ void for_each_row_by_warp(int64_t rows, RowFn&& row_fn) {
  const int warps_per_cta = blockDim.x / 32;
  const int64_t warps = int64_t(gridDim.x) * warps_per_cta;
  for (int64_t row = int64_t(blockIdx.x) * warps_per_cta + threadIdx.x / 32; row < rows; row += warps)
    row_fn(row, static_cast<int>(threadIdx.x % 32));
}

__device__ __forceinline__ void zero_row_warp(uint4* __restrict__ dst, int vectors, int lane) {
  for (int i = lane; i < vectors; i += 32) dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace mok::device
