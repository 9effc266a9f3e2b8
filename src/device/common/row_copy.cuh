// Row copies, the data movement of dispatch (pull) and combine (push). Either side may be a peer GPU's memory.
//   copy_row_warp   one warp, 16-byte vectors through registers (the unfused stage kernels)
//   BulkRowCopier   one thread, the bulk-copy (TMA) engine through a shared-memory slot: a whole row in
//                   flight per thread, so a CTA keeps many rows in flight (the megakernel's communication CTAs)
#pragma once

#include <cstdint>

#include "src/device/common/mbarrier.cuh"
#include "src/device/common/sync.cuh"

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

// One thread's bulk copies, staged through its shared-memory slot: global -> slot (completing on the slot's
// mbarrier), then slot -> global. Chunks of at most slot_bytes; sizes and addresses 16-byte aligned.
struct BulkRowCopier {
  char* slot;         // shared memory of slot_bytes
  uint64_t* loaded;   // mbarrier initialized with one arrival; phases alternate with each chunk
  int slot_bytes;
  uint32_t phase = 0;

  __device__ __forceinline__ void copy(const void* src, void* dst, int bytes) {
    for (int offset = 0; offset < bytes; offset += slot_bytes) {
      const int n = bytes - offset < slot_bytes ? bytes - offset : slot_bytes;
      // Why: the previous chunk's store must have read the slot before this load overwrites it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      mbarrier_arrive_expect_tx(loaded, n);
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              smem_address(slot)),
          "l"(static_cast<const char*>(src) + offset), "r"(n), "r"(smem_address(loaded))
          : "memory");
      mbarrier_wait_cluster(loaded, phase);
      phase ^= 1;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(static_cast<char*>(dst) + offset),
                   "r"(smem_address(slot)), "r"(n)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }

  // Waits until this thread's stores have written global memory and orders them before its later
  // generic operations (the release that publishes the rows).
  __device__ __forceinline__ void finish() const { bulk_stores_written(); }
};

__device__ __forceinline__ void zero_row_warp(uint4* __restrict__ dst, int vectors, int lane) {
  for (int i = lane; i < vectors; i += 32) dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace mok::device
