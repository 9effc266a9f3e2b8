// The expert GEMM's unit of work (one output tile of one expert's rows), shared by its producer side
// (load_tile), its consumer side (compute_tile, the epilogues) and every persistent loop that runs them.
#pragma once

#include <cstdint>

namespace mok::gemm {

// Segments are padded to 64 or 128 rows; a task covers kBlockM rows of one expert's segment, or the
// 64 rows left at its end (then the second consumer warpgroup computes rows it does not store).
inline constexpr int kUnitRows = 64;

struct TileTask {
  int32_t row;         // first row of the schedule (expert-major order): validity, row scales, counters
  int32_t buffer_row;  // where that row lives in the A and output buffers: row itself, or its place in
                       // the megakernel's ring of macrobatch rows
  int32_t rows;        // 64 or 128 (kBlockM == 128), 64 (kBlockM == 64)
  int32_t n_block;  // from TaskWalker: the cluster's group of n-blocks; after for_cta(): this CTA's n-block
  int32_t expert;

  template <int kClusterN>
  __device__ __forceinline__ TileTask for_cta(int cta_rank) const {
    TileTask t = *this;
    t.n_block = n_block * kClusterN + cta_rank;
    return t;
  }
};

}  // namespace mok::gemm
