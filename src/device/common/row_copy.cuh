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

// dst[0..vectors) = src[0..vectors) by the 32 lanes of a warp, kUnroll vectors a lane in flight. Either side may be
// a peer GPU's memory.
template <int kUnroll = kRowCopyUnroll>
__device__ __forceinline__ void copy_row_warp(const uint4* __restrict__ src, uint4* __restrict__ dst, int vectors,
                                              int lane) {
  for (int base = 0; base < vectors; base += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < vectors) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
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
// mbarrier), then slot -> global. Sizes and addresses 16-byte aligned.
//   copy(src, dst, bytes, role)      one row, in chunks of at most slot_bytes
//   begin(); load(src, bytes, at)... loaded(role); store(dst, bytes, at)...
//                                    several whole rows at once (rows of a few KB fill the slot this way)
// The wait for the loads is a bounded hand-off (its partner is the copy engine; `bound`, reported as `role`,
// CounterId::kBulkCopy, index `slot_index`); after a give-up the stores copy whatever the slot holds.
struct BulkRowCopier {
  char* slot;         // shared memory of slot_bytes
  uint64_t* loaded_bar;  // mbarrier initialized with one arrival; one phase per batch or chunk
  int slot_bytes;
  HandoffBound bound;
  int32_t slot_index;
  uint32_t phase = 0;

  // Why: the previous batch's stores must have read the slot before new loads overwrite it.
  __device__ __forceinline__ void begin() const { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

  // Global -> slot[at, at + bytes), completing on the barrier.
  __device__ __forceinline__ void load(const void* src, int bytes, int at) const {
    mbarrier_expect_tx(loaded_bar, bytes);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_address(slot + at)),
                 "l"(src), "r"(bytes), "r"(smem_address(loaded_bar))
                 : "memory");
  }

  // Waits for every load since begin(); false when the wait gave up.
  __device__ __forceinline__ bool loaded(Role role) {
    mbarrier_arrive(loaded_bar);
    const bool done = mbarrier_wait_bounded(loaded_bar, phase, bound, role, CounterId::kBulkCopy, slot_index);
    phase ^= 1;
    return done;
  }

  // Slot[at, at + bytes) -> global; its completion is tracked by finish().
  __device__ __forceinline__ void store(void* dst, int bytes, int at) const {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_address(slot + at)),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }

  __device__ __forceinline__ void copy(const void* src, void* dst, int bytes, Role role) {
    for (int offset = 0; offset < bytes; offset += slot_bytes) {
      const int n = bytes - offset < slot_bytes ? bytes - offset : slot_bytes;
      begin();
      load(static_cast<const char*>(src) + offset, n, 0);
      loaded(role);
      store(static_cast<char*>(dst) + offset, n, 0);
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
