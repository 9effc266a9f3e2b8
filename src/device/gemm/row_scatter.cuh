// Row scatter in the store epilogue (issue 26 item 4; docs/design.md, "Row scatter in the store epilogue"): the
// down GEMM's output rows go straight to their routes' rows of the combine buffers, with no expert-major y and no
// push_rows pass after the GEMM (SonicMoE's epilogue scatter).
//
//   tile row r of a pass (columns c0 .. c0 + kStagingCols):  combined[src][token * top_k + slot, c0 + c] = box(r, c)
//   (src, token, slot) = route_coords(row_route[row + r]); rows with route -1 (padding) and rows past the
//   expert's count are written nowhere.
//
// Roles: the consumer warpgroup that staged the pass (StoreEpilogue stages exactly as for the TMA store, the same
// values at the same shared-memory positions). After its staging barrier, thread t of the 128 copies 16-byte
// chunk t % 16 of rows t / 16 + 8 i (i < 8) of the warpgroup's 64: a quarter warp reads one 128-byte swizzled
// box row (no bank conflict) and a warp writes two whole 256-byte row pieces (coalesced). The destination rows
// are resolved once per tile, before the first pass is staged (their loads overlap the staging).
// Sync: the next pass (or tile) overwrites the boxes only after the warpgroup's begin_pass barrier, which every
// thread reaches after its copies' shared-memory reads. The stores reach peers' memory (NVLink, or this GPU's
// for virtual ranks): every consumer thread of a scattering kernel fences at system scope before it exits
// (run_gemm_consumers), as push_rows_kernel's threads do, so the barrier arrive after the kernel releases them.
// Determinism: copies of the store epilogue's values; each destination row has one writer.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "mok/peer_group.h"
#include "src/device/combine/push_rows.cuh"

namespace mok::gemm {

// Where a scattering GEMM's rows go (ExpertGemmArgs::scatter).
struct RowScatter {
  PeerPointers combined;     // per rank: bf16 [num_tokens * top_k, n]
  const int32_t* row_route;  // [a_rows] the schedule's route per row, -1 for padding
  int num_tokens;
  int top_k;
};

// The expert GEMM's parameters plus the scatter.
template <class Base>
struct RowScatterParams : Base {
  RowScatter scatter;
};

template <class Params>
concept ScattersRows = requires(const Params& p) { p.scatter.row_route; };

// The copy of one staged pass: 128 threads, kBoxes boxes of 64 rows x 128 bytes each (the TMA's 128-byte swizzle:
// the 16-byte chunk j of row r sits at chunk j ^ (r % 8)).
template <int kBoxes>
struct ScatterCopy {
  static constexpr int kChunksPerRow = kBoxes * 8;           // 16-byte chunks of one staged row
  static constexpr int kRowsPerStep = 128 / kChunksPerRow;   // rows the warpgroup copies at once
  static constexpr int kRowsPerThread = 64 / kRowsPerStep;
  static_assert(128 % kChunksPerRow == 0 && 64 % kRowsPerStep == 0, "whole rows per step");

  // This thread's destination row starts (nullptr: not written) of the warpgroup's 64 rows, from the tile's
  // first row `row` (the warpgroup's first schedule row) and the rows that are real (`valid_rows` of them).
  uint4* row[kRowsPerThread];

  __device__ __forceinline__ void resolve(const RowScatter& s, int64_t first_row, int valid_rows, int n, int thread) {
    CUTE_UNROLL
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = thread / kChunksPerRow + i * kRowsPerStep;
      const int32_t route = r < valid_rows ? s.row_route[first_row + r] : -1;
      row[i] = route >= 0 ? combine::destination_row(s.combined, route, s.num_tokens, s.top_k, n / 8) : nullptr;
    }
  }

  // Copies the staged boxes (box b: columns col + 64 b; boxes from column n on hold no output) to the rows.
  __device__ __forceinline__ void copy(const char* staging, int box_bytes, int64_t col, int n, int thread) const {
    const int chunk = thread % kChunksPerRow, box = chunk / 8;
    const int64_t vector = col / 8 + chunk;  // the chunk's 16-byte column of the destination row
    if (col + 64 * box >= n) return;
    const char* box_base = staging + box * box_bytes;
    CUTE_UNROLL
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = thread / kChunksPerRow + i * kRowsPerStep;
      const uint4 v = *reinterpret_cast<const uint4*>(box_base + r * 128 + (((chunk % 8) ^ (r % 8)) << 4));
      if (row[i] != nullptr) row[i][vector] = v;
    }
  }
};

}  // namespace mok::gemm
