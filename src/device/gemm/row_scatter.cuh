// Row scatter in the store epilogue (issue 26 item 4; docs/design.md, "Row scatter in the store epilogue"): the
// store GEMM's output rows go straight to their routes' rows of the combine buffers, with no expert-major output
// and no copy pass after the GEMM (SonicMoE's epilogue scatter).
//
//   tile row r, columns c0 .. c0 + 64 of a staged box:  combined[src][token * top_k + slot, c0 + c] = box(r, c)
//   (src, token, slot) = route_coords(row_route[row + r]); rows with route -1 (padding) and rows past the
//   expert's count are written nowhere.
//
// Roles: the consumer warpgroup that staged the pass (StoreEpilogue stages exactly as for its TMA store: the same
// values at the same shared-memory positions, 64 x 64 boxes with the 128-byte swizzle). Thread t of the 128 owns
// row t % 64 of the warpgroup's 64 for the whole tile and stores box t / 64 of each pass of it: one TMA store of
// a 1 x 64 box (128 bytes) through its rank's tensor map. The TMA applies the 128-byte swizzle from the
// shared-memory address, whose bits 7-9 are the row's index in its 1024-byte-aligned box, so a one-row box at the
// row's address reads the row as the whole box's store would. The tensor maps (one per rank: its combine buffer,
// bf16 [T * k, n], box 64 x 1) live in device memory (encode_row_scatter_maps, include/mok/expert_gemm.h).
// Each thread resolves its row's destination once per tile, before the first pass is staged (the load overlaps
// the staging).
// Sync: as the TMA store's, per thread: each storing thread commits its store as a bulk group and, before the
// next pass overwrites the boxes, waits until its groups have read shared memory (begin_pass_scattered), then the
// warpgroup's barrier. The stores reach peers' memory (NVLink, or this GPU's for virtual ranks): every consumer
// thread of a scattering kernel waits for its stores to be written and fences at system scope before it exits
// (run_gemm_consumers), as push_rows_kernel's threads fence, so the barrier arrive after the kernel releases them.
// Determinism: copies of the store epilogue's values; each destination row has one writer.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm90_desc.hpp>

namespace mok::gemm {

// Where a scattering GEMM's rows go (ExpertGemmArgs::scatter).
struct RowScatter {
  const cute::TmaDescriptor* maps;  // per rank, in device memory: its combine buffer, bf16 [num_tokens * top_k, n]
  const int32_t* row_route;         // [a_rows] the schedule's route per row, -1 for padding
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

// A thread's destination row of a tile: the tensor map of the route's rank (null: the row is written nowhere) and
// the row in it, token * top_k + slot = route - src * T * k.
struct ScatterRow {
  const cute::TmaDescriptor* map = nullptr;
  int32_t row = 0;

  __device__ __forceinline__ static ScatterRow resolve(const RowScatter& s, int64_t schedule_row, bool real) {
    ScatterRow d;
    const int32_t route = real ? s.row_route[schedule_row] : -1;
    if (route >= 0) {
      const int32_t per_rank = s.num_tokens * s.top_k;
      const int32_t src = route / per_rank;
      d.map = s.maps + src;
      d.row = route - src * per_rank;
    }
    return d;
  }
};

}  // namespace mok::gemm
