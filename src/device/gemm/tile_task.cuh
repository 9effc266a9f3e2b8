// The GEMMs' units of work: the expert GEMM's (one output tile of one expert's rows, TileTask) and the weight
// gradient's (one output tile of one expert's gradient, K = its rows, GradTileTask), shared by the producer
// side (load_tile), the consumer side (compute_tile, the epilogues) and every persistent loop that runs them.
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

// One weight-gradient output tile, as the producer decodes it from a slot and the task ring carries it to the
// consumers.
struct GradTileTask {
  int32_t expert;     // -1: no task (the slot lies past the last one)
  int32_t m_block;    // gradient rows [m_block * kBlockM, + kBlockM) of the expert
  int32_t n_block;    // gradient columns [n_block * kBlockN, + kBlockN)
  int32_t row_begin;  // first schedule row of the expert's segment (the K offset)
  int32_t k_blocks;   // kBlockK-row k-blocks of the segment; 0: the expert has no rows

  // When a cluster of kClusterN CTAs runs one task (the backward megakernel's, in clusters of the expert
  // GEMM's): n_block is the cluster's group of n-blocks; CTA cta_rank computes n-block kClusterN * n_block +
  // cta_rank, of the same expert, m-block and rows (so both CTAs run the same k-blocks: see
  // WeightGradTraitsInGemmLayout).
  template <int kClusterN>
  __device__ __forceinline__ GradTileTask for_cta(int cta_rank) const {
    GradTileTask t = *this;
    t.n_block = n_block * kClusterN + cta_rank;
    return t;
  }
};

}  // namespace mok::gemm
