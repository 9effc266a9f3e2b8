// Epilogue policies of the expert GEMM (src/device/gemm/expert_gemm.cuh): what a consumer warpgroup does
// with its rows of the fp32 accumulator tile acc [kBlockM, kBlockN] once the mainloop is done. Per tile
// (r: a row of the tile, c: an accumulator column, nb: the n-block, n: the GEMM's n, rw: the row scale,
// 1 without one; L: the clamp, 0 for none; padding rows, past the expert's count, are stored as zeros):
//
//   StoreEpilogue          out[r, nb * kBlockN + c] = rw * acc[r, c]                          out [a_rows, n]
//   SwiGLUEpilogue<kGU>    out[r, j] = rw * silu(min(g, L)) * clamp(u, -L, L)                  out [a_rows, n]
//                          g = acc[r, c], u = acc[r, kBlockN/2 + c], j = nb * kBlockN/2 + c; with kGU also the
//                          raw g and u (bf16, before the clamp): gate_up_out[r, j] = g, gate_up_out[r, n + j] = u
//   SwiGLUBackwardEpilogue d_hu = acc[r, c], j = nb * kBlockN + c, g = gate_up[r, j], u = gate_up[r, n + j]:
//                          out[r, j] = d_g, out[r, n + j] = d_u (formulas: include/mok/expert_gemm.h)  [a_rows, 2n]
//                          row_partials[r, nb] = sum over the tile's columns j < n of d_hu * silu(g_c) * u_c
//
// A thread's accumulator fragment (per warpgroup 64 rows; wgmma's layout): value i holds row
// 16 * warp + lane / 4 + 8 * ((i / 2) % 2) and column 8 * (i / 4) + 2 * (lane % 4) + i % 2. So a thread owns
// two rows, the quad of lanes 4q..4q+3 shares them, and column groups of 8 are the outermost mode (a range
// of columns is a contiguous range of values). The code reads rows and columns from the identity tensor
// `coords`, not from this formula.
//
// Output path (all three): registers -> bf16 boxes of 64 x 64 in shared memory (the TMA's 128-byte swizzle;
// the fragment-order writes, 8 rows x 4 lanes a warp, hit 32 distinct banks) -> TMA stores issued by the
// warpgroup's first thread, which drain while the warpgroup runs its next tile. A pass stages
// kStagingBoxes boxes; the next pass reuses them once the stores have read them (TileStager). Passes:
// store 2 (128 columns each), SwiGLU 1 (+ 2 for g and u), SwiGLU backward kBlockN / 64 (d_g and d_u of 64
// columns each).
// Determinism: each output element is computed by one thread from its own accumulators; the row partials
// sum a thread's columns in order, then the quad's four sums by a butterfly (identical bits in every
// lane, see SwiGLUBackwardEpilogue). No atomics.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "mok/expert_gemm.h"
#include "src/device/common/fp8_quant.cuh"
#include "src/device/common/status.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/row_scatter.cuh"
#include "src/device/gemm/tile_task.cuh"

namespace mok::gemm {

// A consumer warpgroup's completion count for the megakernel, added late: its store leader remembers the
// counter of the rows it just stored and adds 1 only when the stores are surely written: at its next
// epilogue (by then they long are), before it blocks on a tile's first stage (its producer, or the partner
// CTA's, may be waiting for exactly this count: not adding it there could deadlock), or at the end.
// Adding it right after the stores would stall the warpgroup on their latency every tile.
struct RowsDoneSignal {
  uint64_t* pending = nullptr;  // counter to add 1 to once this thread's issued stores are written

  __device__ __forceinline__ void flush() {
    if (pending == nullptr) return;
    // Why: the reader (another CTA's TMA loads, or a communication CTA) acquires this count and must find
    // the rows written, not just issued.
    device::bulk_stores_written();
    device::add_release_gpu(pending, 1);
    pending = nullptr;
  }

  // Before a consumer warpgroup blocks on a tile's first stage: whoever it waits for may wait for this count
  // (not adding it could deadlock). `leader` (the store leader, with stages to wait for) adds it.
  template <class Pipeline, class State>
  __device__ __forceinline__ static void flush_before_blocking(RowsDoneSignal* signal, bool leader,
                                                                Pipeline& pipeline, const State& read_state) {
    if (signal != nullptr && leader && signal->pending != nullptr &&
        pipeline.consumer_try_wait(read_state) == cutlass::BarrierStatus::WaitAgain)
      signal->flush();
  }
};

// The rows of a tile as the epilogue sees them.
struct TileRows {
  int valid_rows;      // rows of the tile that are real rows of the expert; the rest are padding
  float row_scale[2];  // of the thread's two fragment rows: 1 without a scale or for a padding row
};

// Shared-memory staging and TMA stores of one consumer warpgroup's output boxes, every GEMM's (the weight
// gradient's writes its boxes itself and issues them through end_pass_with). All 128 threads of the warpgroup
// call begin_pass, stage and end_pass the same number of times (named barrier kStagingBarrier + warpgroup).
template <class T, class Storage>
struct TileStager {
  Storage& smem;  // the GEMM's shared memory (mainloop.cuh, GemmSharedStorage)
  int warpgroup;
  bool store_leader;       // the warpgroup's first thread: waits for and issues the stores
  RowsDoneSignal* signal;  // nullable: the megakernel's late completion count
  int box_row;             // the 64-row box of the output buffers that these rows are

  // Why: the previous pass's (or tile's) TMA stores of this warpgroup read the boxes we overwrite now.
  // The previous tile's stores are written by now too: its late count goes out here (only where may_flush).
  __device__ __forceinline__ void begin_pass(bool may_flush = true) const {
    if (store_leader) {
      if (may_flush && signal != nullptr && signal->pending != nullptr)
        signal->flush();
      else
        cute::tma_store_wait<0>();
    }
    cutlass::arch::NamedBarrier::sync(128, T::kStagingBarrier + warpgroup);
  }

  // Two adjacent columns at row r of the tile, column col of the pass's boxes (box col / kBoxCols): V is
  // __nv_bfloat162 for bf16 outputs, uint16_t (two e4m3 bytes, the lower column first) for FP8 ones.
  template <class V>
  __device__ __forceinline__ void stage(int r, int col, V v) const {
    static_assert(sizeof(V) == 2 * sizeof(typename T::OutElement), "two output elements");
    char* box = reinterpret_cast<char*>(smem.staging[warpgroup][col / T::kBoxCols]);
    const int byte = (r % kUnitRows) * 128 + (col % T::kBoxCols) * int(sizeof(typename T::OutElement));
    *reinterpret_cast<V*>(box + (byte ^ ((r % 8) << 4))) = v;  // the TMA's 128-byte swizzle
  }

  // `v` at byte `byte` (a multiple of sizeof(V)) of row r of staged box `box`, whatever the output element: a box
  // is 64 rows of 128 bytes either way (SwiGLUQuantEpilogue<true>'s bf16 side outputs beside its e4m3 h, the FP8
  // SwiGLU backward's e4m3 d_g | d_u beside its bf16 ones).
  template <class V>
  __device__ __forceinline__ void stage_bytes(int box, int r, int byte, V v) const {
    char* base = reinterpret_cast<char*>(smem.staging[warpgroup][box]);
    const int offset = (r % kUnitRows) * 128 + byte;
    *reinterpret_cast<V*>(base + (offset ^ ((r % 8) << 4))) = v;  // the TMA's 128-byte swizzle
  }
  // Two adjacent bf16 columns at row r, column col (< 64) of staged box `box`.
  __device__ __forceinline__ void stage_bf16(int box, int r, int col, __nv_bfloat162 v) const {
    stage_bytes(box, r, col * int(sizeof(__nv_bfloat16)), v);
  }

  // The store leader, inside end_pass_with's `issue`: staged box `box` to box column `col` (128 bytes a box) of
  // `tma`'s [a_rows, cols] tensor of T::OutElement.
  template <class Tma>
  __device__ __forceinline__ void store_box(const Tma& tma, int64_t a_rows, int64_t cols, int box, int col) const {
    using namespace cute;
    Tensor m_out = tma.get_tma_tensor(make_shape(a_rows, cols));
    Tensor s_box = make_tensor(make_smem_ptr(reinterpret_cast<typename T::OutElement*>(smem.staging[warpgroup][box])),
                               typename T::SmemLayoutOutBox{});
    Tensor g_box = local_tile(m_out, Shape<Int<kUnitRows>, Int<T::kBoxCols>>{}, make_coord(box_row, col));
    auto [t_g, t_s] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_box), group_modes<0, 2>(g_box));
    copy(tma, t_s, t_g);
  }

  // Stores box b of the pass to box column box_col(b) of `tma`'s [a_rows, cols] tensor, for b = 0, 1, ...
  // until box_col returns a negative column (a partial last n-block: its boxes past its part hold columns
  // of no output). box_col runs on the store leader only.
  template <class Tma, class BoxCol>
  __device__ __forceinline__ void end_pass(const Tma& tma, int64_t a_rows, int64_t cols, BoxCol&& box_col) const {
    end_pass_with([&] {
      CUTE_UNROLL
      for (int box = 0; box < T::kStagingBoxes; ++box) {
        const int col = box_col(box);
        if (col < 0) break;
        store_box(tma, a_rows, cols, box, col);
      }
    });
  }

  // A scattering epilogue's passes (row_scatter.cuh): every thread stores one row's box of the pass by TMA, so
  // every thread waits for its own stores' reads before the boxes are overwritten.
  __device__ __forceinline__ void begin_pass_scattered() const {
    cute::tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(128, T::kStagingBarrier + warpgroup);
  }
  // Row t % 64's box t / 64 of the pass (columns col + 64 (t / 64) of n) to its destination row.
  __device__ __forceinline__ void end_pass_scattered(const ScatterRow& row, int64_t col, int n) const {
    // Why: the TMA (async proxy) reads what the warpgroup's threads wrote; fence, then wait for all of them.
    cute::tma_store_fence();
    cutlass::arch::NamedBarrier::sync(128, T::kStagingBarrier + warpgroup);
    const int thread = int(threadIdx.x % 128), box = thread / kUnitRows;
    static_assert(T::kStagingBoxes * kUnitRows == 128, "one box of one row per thread");
    if (row.map != nullptr && col + box * T::kBoxCols < n) {
      cute::SM90_TMA_STORE_2D::copy(row.map, smem.staging[warpgroup][box] + (thread % kUnitRows) * 128,
                                    int32_t(col) + box * T::kBoxCols, row.row);
      cute::tma_store_arrive();
    }
  }

  // The end of a pass whose boxes `issue` (run by the store leader) stores: one bulk group.
  template <class Issue>
  __device__ __forceinline__ void end_pass_with(Issue&& issue) const {
    // Why: the TMA (async proxy) reads what these threads wrote; fence, then wait for the whole warpgroup.
    cute::tma_store_fence();
    cutlass::arch::NamedBarrier::sync(128, T::kStagingBarrier + warpgroup);
    if (store_leader) {
      issue();
      cute::tma_store_arrive();
    }
  }
};

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// h = silu(g) * u * scale of one accumulator pair of a SwiGLU tile (gate columns in values [0, kHalf), up in
// [kHalf, 2 kHalf): value i and i + kHalf are the same h column), g and u clamped first when limit > 0
// (gpt-oss's swiglu_limit). The one definition of the forward's h: the plain and the quantizing epilogue.
template <int kHalf, class Accum>
__device__ __forceinline__ void swiglu_pair(const Accum& accum, int i, float limit, float scale, float (&h)[2]) {
  CUTE_UNROLL
  for (int j = 0; j < 2; ++j) {
    float g = accum(i + j), u = accum(i + kHalf + j);
    if (limit > 0.0f) {
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
    }
    h[j] = silu(g) * u * scale;
  }
}

// The epilogue interface of every GEMM (T: the GEMM's traits; compute_tile, mainloop.cuh, calls it):
//   prefetch<T>(...)       before the tile's mainloop (consumer threads of an active warpgroup)
//   finish<T>(...)         after it: the warpgroup's rows of the accumulators to the outputs
// The expert GEMM's epilogues (row tiles) share finish (RowTileEpilogue) and add
//   kKind                  the public epilogue it implements
//   out_cols(kBlockN)      GEMM columns (of n) per output tile: the n-block width
//   store<T>(...)          writes the warpgroup's rows through `stager`
// The weight gradient's is GradEpilogue (weight_grad_gemm.cuh).
//
// RowTileEpilogue::finish: each warpgroup stages and stores its own 64 rows; its first thread issues the
// stores. (A reader of the output inside the same kernel, e.g. the megakernel's down GEMM, needs the stores
// complete, cp.async.bulk.wait_group 0, before the release that signals it.)
// rows_done (nullable, the megakernel's): one counter per 64 schedule rows; each warpgroup adds 1 to its rows'
// counter once its stores have reached global memory (through `signal`, late: see RowsDoneSignal), so a
// counter reaches the number of n-blocks when the rows' whole output is readable (docs/sync_protocol.md).
// `signal` is the calling thread's own; needed whenever rows_done is set.
// Epilogues without a prefetch (SwiGLUBackwardEpilogue has its own).
struct NoPrefetch {
  template <class T, class Params, class Task>
  __device__ __forceinline__ static void prefetch(const Params&, const Task&, int, int) {}
};

// The rows of task's tile that a thread's fragment holds (coords: its identity-tensor partition).
template <class Params, class Coords>
__device__ __forceinline__ TileRows tile_rows(const Params& p, const TileTask& task, const Coords& coords) {
  TileRows rows;
  rows.valid_rows = p.expert_row_offsets[task.expert] + p.expert_counts[task.expert] - task.row;
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int r = cute::get<0>(coords(2 * half));
    rows.row_scale[half] = p.row_scale != nullptr && r < rows.valid_rows ? p.row_scale[task.row + r] : 1.0f;
  }
  return rows;
}

template <class Derived>
struct RowTileEpilogue : NoPrefetch {
  using OutElement = cutlass::bfloat16_t;  // what the output boxes hold
  static constexpr int kPasses = 1;        // mainloops per tile (SwiGLUQuantEpilogue: 2)
  static constexpr int kSideBoxes = 0;     // staging boxes a warpgroup needs beside its passes' (GemmTraits)

  template <class T, class Params, class Tile, class Accum, class Mma, class Storage>
  __device__ __forceinline__ static void finish(const Params& p, const TileTask& task, const Tile&, const Accum& accum,
                                                Mma& mma, Storage& smem, int warpgroup, int consumer_idx,
                                                bool store_leader, uint64_t* rows_done, RowsDoneSignal* signal) {
    using namespace cute;
    // Why opaque (epilogues with many staged values, kOpaqueCoordinates, or tiles that ask for it,
    // T::kOpaqueCoordinates): the fragment coordinates and the staging addresses derived from the thread index
    // are loop invariants of a persistent loop; hoisted out of it they outgrow the consumers' registers (ptxas
    // spilled). Recomputed per tile they cost nothing.
    constexpr bool kOpaque = Derived::kOpaqueCoordinates || requires { requires T::kOpaqueCoordinates; };
    int coords_idx = consumer_idx;
    if constexpr (kOpaque) asm volatile("mov.u32 %0, %1;" : "=r"(coords_idx) : "r"(consumer_idx));
    Tensor coords =
        mma.get_thread_slice(coords_idx).partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
    // A thread's fragment covers two rows (r0 and r0 + 8 of its warp's 16): value i lies in row half
    // (i / 2) % 2; load the two row scales once.
    const TileRows rows = tile_rows(p, task, coords);
    const TileStager<T, Storage> stager{smem, warpgroup, store_leader, signal,
                                        (task.buffer_row + warpgroup * kUnitRows) / kUnitRows};
    Derived::template store<T>(p, task, accum, coords, rows, stager);
    if (rows_done != nullptr && store_leader) signal->pending = rows_done + (task.row / kUnitRows + warpgroup);
  }
};

struct StoreEpilogue : RowTileEpilogue<StoreEpilogue> {
  static constexpr GemmEpilogue kKind = GemmEpilogue::kStore;
  static constexpr bool kOpaqueCoordinates = false;
  static constexpr int out_cols(int block_n) { return block_n; }

  template <class T, class Params, class Accum, class Coords, class Stager>
  __device__ __forceinline__ static void store(const Params& p, const TileTask& task, const Accum& accum,
                                               const Coords& coords, const TileRows& rows,
                                               const Stager& stager) {
    using cute::get;
    constexpr int kValues = decltype(cute::size(accum))::value;
    constexpr int kPasses = T::kOutCols / T::kStagingCols;
    constexpr int kPassValues = kValues / kPasses;  // a pass owns a contiguous range of values
    // ExpertGemmArgs::scatter: the warpgroup's rows go to their routes' combine rows (row_scatter.cuh); this
    // thread stores row t % 64.
    [[maybe_unused]] ScatterRow scatter_row;
    if constexpr (ScattersRows<Params>) {
      const int r = int(threadIdx.x % kUnitRows);
      scatter_row = ScatterRow::resolve(p.scatter, int64_t(task.row) + stager.warpgroup * kUnitRows + r,
                                        r < rows.valid_rows - stager.warpgroup * kUnitRows);
    }
    CUTE_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      const int pass_begin = pass * T::kStagingCols;
      if constexpr (ScattersRows<Params>)
        stager.begin_pass_scattered();
      else
        stager.begin_pass();
      CUTE_UNROLL
      for (int i = pass * kPassValues; i < (pass + 1) * kPassValues; i += 2) {
        const int r = get<0>(coords(i));
        const float scale = rows.row_scale[(i / 2) % 2];
        stager.stage(r, get<1>(coords(i)) - pass_begin,
                     r < rows.valid_rows ? __floats2bfloat162_rn(accum(i) * scale, accum(i + 1) * scale)
                                         : __floats2bfloat162_rn(0.0f, 0.0f));
      }
      if constexpr (ScattersRows<Params>) {
        stager.end_pass_scattered(scatter_row, int64_t(task.n_block) * T::kOutCols + pass_begin, p.n);
      } else {
        const int box_col = (task.n_block * T::kOutCols + pass_begin) / T::kBoxCols;
        stager.end_pass(p.tma_out, p.a_rows, p.out_cols, [&](int box) {
          return (box_col + box) * T::kBoxCols < p.out_cols ? box_col + box : -1;
        });
      }
    }
  }
};

template <bool kWritesGateUp>
struct SwiGLUEpilogue : RowTileEpilogue<SwiGLUEpilogue<kWritesGateUp>> {
  static constexpr GemmEpilogue kKind = GemmEpilogue::kSwiGLU;
  static constexpr bool kGateUpOut = kWritesGateUp;
  static constexpr bool kOpaqueCoordinates = kWritesGateUp;
  static constexpr int out_cols(int block_n) { return block_n / 2; }  // gate + up columns -> hidden columns

  template <class T, class Params, class Accum, class Coords, class Stager>
  __device__ __forceinline__ static void store(const Params& p, const TileTask& task, const Accum& accum,
                                               const Coords& coords, const TileRows& rows,
                                               const Stager& stager) {
    using cute::get;
    // Fragment values [0, kValues/2) hold columns [0, kHalfN) (gate), the rest the same columns + kHalfN (up):
    // the activation is register-local.
    constexpr int kValues = decltype(cute::size(accum))::value;
    constexpr int kHalf = kValues / 2;
    static_assert(T::kOutCols == T::kStagingCols, "the SwiGLU output tile is staged in one pass");
    const int col = task.n_block * T::kOutCols;
    const float limit = p.swiglu_limit;
    stager.begin_pass();
    CUTE_UNROLL
    for (int i = 0; i < kHalf; i += 2) {
      const int r = get<0>(coords(i));
      float h[2];
      swiglu_pair<kHalf>(accum, i, limit, rows.row_scale[(i / 2) % 2], h);
      stager.stage(r, get<1>(coords(i)),
                   r < rows.valid_rows ? __floats2bfloat162_rn(h[0], h[1]) : __floats2bfloat162_rn(0.0f, 0.0f));
    }
    const int box_col = col / T::kBoxCols;
    stager.end_pass(p.tma_out, p.a_rows, p.out_cols, [&](int box) {
      return (box_col + box) * T::kBoxCols < p.out_cols ? box_col + box : -1;
    });
    if constexpr (kWritesGateUp) {
      // The raw g, then u, of the same columns, rounded once from the accumulators (h above never sees
      // these roundings): part 0 to gate_up_out[:, col + c], part 1 to gate_up_out[:, n + col + c].
      CUTE_UNROLL
      for (int part = 0; part < 2; ++part) {
        stager.begin_pass();
        CUTE_UNROLL
        for (int i = part * kHalf; i < (part + 1) * kHalf; i += 2) {
          const int r = get<0>(coords(i));
          stager.stage(r, get<1>(coords(i)) - part * T::kHalfN,
                       r < rows.valid_rows ? __floats2bfloat162_rn(accum(i), accum(i + 1))
                                           : __floats2bfloat162_rn(0.0f, 0.0f));
        }
        stager.end_pass(p.tma_gate_up_out, p.a_rows, 2 * int64_t(p.n), [&](int box) {
          const int c = col + box * T::kBoxCols;
          return c < p.n ? (part * p.n + c) / T::kBoxCols : -1;
        });
      }
    }
  }
};

// The FP8 gate/up GEMM's SwiGLU with h written quantized (DeepSeek-V3's 1 x 128 activation scales, the down
// GEMM's A): a task is 128 h columns, one scale block, computed as two passes of the 128 x 128 FP8 tile (pass q:
// the 64 gate and 64 up columns of h columns 128 nb + 64 q, a mainloop each; compute_tile runs them). After each
// pass the thread's h values are rounded to bf16 and kept in registers (keep: 16 bf16 pairs a pass, two rows);
// after the last, each row's amax over its 128 columns (the thread's 32 values, then the row's quad of lanes by a
// butterfly: every lane the same), the block's scale and the e4m3 values (include/mok/fp8.h's arithmetic on the
// bf16 h: the same bits as the bf16 SwiGLU epilogue followed by quantize_rows_fp8), staged as one 64 x 128-byte
// box per warpgroup and stored by TMA; the scales go to out_scales[nb, row] (lane 0 of each quad). A last task of
// 64 columns (n % 128 == 64) runs one pass; its block's scale covers the columns it has. Padding rows: zeros,
// scale 1. A block holding a NaN or an infinity gets a NaN scale (that row's down outputs are NaN) and is reported
// to the status word (kStatusNonFinite).
// kWritesGateUp (a training context that keeps g | u, MoeOptions::keep_gate_up): after each pass's mainloop also
// the raw g and u of its h columns (bf16, before the clamp: gate_up_out[r, j] = g, gate_up_out[r, n + j] = u, as
// SwiGLUEpilogue<true>) and the bf16 h that `keep` rounded (hidden_out[r, j], the plain SwiGLU's h), three boxes
// staged together (kSideBoxes) and stored while the next pass's mainloop runs (store_side_outputs): what the
// backward would otherwise recompute, the same bits. Their descriptors are of e4m3 over the bf16 tensors' bytes
// (a 64 x 128-byte box is 64 x 64 bf16; the TMA copies bytes): src/host/gemm_params.h.
// kPasses_ = 1 (fp8_gate_up_block_n 256, the default; the same bits, 9-11 % faster: docs/perf_notes.md, round 34;
// with the side outputs 3 stages, their 128 columns stored in two rounds, 13 % faster, round 35): the task's
// 128 h columns are one pass of a 128 x 256 tile (the 128 gate and the 128 up columns, A loaded once), whose
// mainloop promotes its two 128-column wgmma halves in turn (mainloop_block_scaled's splits); a last task of 64
// columns computes the 64 past n too (rows of the next expert or of the up half: keep zeroes those h columns, so
// they add nothing to the block's amax, and the TMA store leaves columns past n alone).
template <bool kWritesGateUp, int kPasses_ = 2>
struct SwiGLUQuantEpilogue : RowTileEpilogue<SwiGLUQuantEpilogue<kWritesGateUp, kPasses_>> {
  static constexpr GemmEpilogue kKind = GemmEpilogue::kSwiGLU;
  static constexpr bool kGateUpOut = kWritesGateUp;
  // One pass of 256 columns: store's 64 staged values' addresses, hoisted out of the persistent loop, spilled (ptxas).
  static constexpr bool kOpaqueCoordinates = kPasses_ == 1;
  using OutElement = cutlass::float_e4m3_t;
  static constexpr int kPasses = kPasses_;
  static_assert(kPasses == 2 || kPasses == 1, "two passes of 128 x 128, or one of 128 x 256");
  static constexpr int kSideBoxes = kWritesGateUp ? 3 : 0;  // g, u and h of a pass
  static constexpr int out_cols(int block_n) { return kPasses * block_n / 2; }

  // The thread's h of each pass: bf16 pairs, pair v = accumulator values 2v, 2v + 1 of the gate half (a
  // warpgroup's 64 x kBlockN fragment is kBlockN / 2 values a thread, kBlockN / 8 pairs of h).
  template <int kPairs>
  struct Carry {
    __nv_bfloat162 h[kPasses][kPairs];
    int passes;
  };
  template <class T>
  using CarryOf = Carry<T::kBlockN / 8>;

  // Passes of a task (the producer and the consumers agree): two, or one for a last task of 64 columns (kPasses 1:
  // one).
  template <class Params>
  __device__ __forceinline__ static int passes(const Params& p, const TileTask& task) {
    return kPasses == 1 || task.n_block * 128 + 64 < p.n ? kPasses : 1;
  }
  // The FP8 tile of pass q: its n-block in 64-column units (load_tile's and b_scale_group's; kPasses 1: the task).
  __device__ __forceinline__ static TileTask pass_task(const TileTask& task, int pass) {
    TileTask t = task;
    t.n_block = task.n_block * kPasses + pass;
    return t;
  }

  // After a pass's mainloop: the thread's h values of it (into `h`, that pass's part of the carry), as the bf16
  // SwiGLU epilogue would store them.
  template <class T, class Params, class Accum, class Coords, int kPairs>
  __device__ __forceinline__ static void keep(const Params& p, const TileTask& task, const Accum& accum,
                                              const Coords& coords, __nv_bfloat162 (&h_out)[kPairs]) {
    using cute::get;
    constexpr int kValues = decltype(cute::size(accum))::value;
    constexpr int kHalf = kValues / 2;
    const TileRows rows = tile_rows(p, task, coords);
    const float limit = p.swiglu_limit;
    CUTE_UNROLL
    for (int i = 0; i < kHalf; i += 2) {
      float h[2];
      swiglu_pair<kHalf>(accum, i, limit, rows.row_scale[(i / 2) % 2], h);
      bool real = get<0>(coords(i)) < rows.valid_rows;
      if constexpr (kPasses == 1) real = real && task.n_block * 128 + get<1>(coords(i)) < p.n;  // (see above)
      h_out[i / 2] = real ? __floats2bfloat162_rn(h[0], h[1]) : __floats2bfloat162_rn(0.0f, 0.0f);
    }
  }

  // kWritesGateUp, after `keep` of pass `pass`: its g, u (from the accumulators) and h (keep's bf16 values), 64 h
  // columns a round (one round a pass of 128 x 128, two for the 128 x 256 tile: values [32 round, 32 round + 32) of
  // each half), staged in boxes 0-2 and stored to gate_up_out's columns 128 nb + 64 (pass + round) and n further,
  // and hidden_out's (box column = bf16 column / 64). A round from column n on (a last task of 64 columns) stores
  // nothing: g's box there would be u's first. Padding rows: zeros. Each round waits for the staging's previous
  // stores (the last round's, or the last task's h).
  // The fragment coordinates come from an opaque copy of the thread index, as RowTileEpilogue::finish's do with
  // kOpaqueCoordinates: hoisted out of the persistent loop, their staging addresses spilled (ptxas).
  template <class T, class Params, class Accum, int kPairs, class Storage>
  __device__ __forceinline__ static void store_side_outputs(const Params& p, const TileTask& task, int pass,
                                                            const Accum& accum, int consumer_idx,
                                                            const __nv_bfloat162 (&h)[kPairs], Storage& smem,
                                                            int warpgroup, bool store_leader, RowsDoneSignal* signal) {
    if constexpr (kWritesGateUp) {
      using namespace cute;
      constexpr int kHalf = decltype(size(accum))::value / 2;
      constexpr int kRounds = T::kHalfN / 64, kRoundValues = kHalf / kRounds;
      static_assert(kPairs * 2 == kHalf && kRoundValues == 32, "a round's 64 h columns: one box each of g, u and h");
      int coords_idx = consumer_idx;
      asm volatile("mov.u32 %0, %1;" : "=r"(coords_idx) : "r"(consumer_idx));
      Tensor coords = typename T::TiledMma{}.get_thread_slice(coords_idx).partition_C(
          make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
      const TileRows rows = tile_rows(p, task, coords);
      const TileStager<T, Storage> stager{smem, warpgroup, store_leader, signal,
                                          (task.buffer_row + warpgroup * kUnitRows) / kUnitRows};
      const __nv_bfloat162 zero = __floats2bfloat162_rn(0.0f, 0.0f);
      CUTE_UNROLL
      for (int round = 0; round < kRounds; ++round) {
        const int first_col = task.n_block * 128 + (pass + round) * 64;  // of h, g and u
        if (first_col >= p.n) break;
        stager.begin_pass();
        CUTE_UNROLL
        for (int i = round * kRoundValues; i < (round + 1) * kRoundValues; i += 2) {
          const int r = get<0>(coords(i)), c = get<1>(coords(i)) - round * 64;
          const bool real = r < rows.valid_rows;
          stager.stage_bf16(0, r, c, real ? __floats2bfloat162_rn(accum(i), accum(i + 1)) : zero);
          stager.stage_bf16(1, r, c, real ? __floats2bfloat162_rn(accum(kHalf + i), accum(kHalf + i + 1)) : zero);
          stager.stage_bf16(2, r, c, h[i / 2]);
        }
        // Byte columns of the e4m3-typed descriptors: twice the bf16 columns.
        const int box_col = first_col / 64;
        stager.end_pass_with([&] {
          stager.store_box(p.tma_gate_up_out, p.a_rows, 4 * int64_t(p.n), 0, box_col);
          stager.store_box(p.tma_gate_up_out, p.a_rows, 4 * int64_t(p.n), 1, p.n / 64 + box_col);
          stager.store_box(p.tma_side_out, p.a_rows, 2 * int64_t(p.n), 2, box_col);
        });
      }
    }
  }

  template <class T, class Params, class C, class Coords, class Stager>
  __device__ __forceinline__ static void store(const Params& p, const TileTask& task, const C& carry,
                                               const Coords& coords, const TileRows&, const Stager& stager) {
    using cute::get;
    constexpr int kPairs = sizeof(carry.h[0]) / sizeof(carry.h[0][0]);
    static_assert(T::kOutCols == T::kBoxCols && T::kStagingBoxes == 1, "a task's h is one 128-byte box a row (box 0)");
    // Row half of pair v: (v % 2) (value 2v lies in row half (2v / 2) % 2).
    float amax[2] = {0.0f, 0.0f};
    bool finite[2] = {true, true};
    CUTE_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      if (pass >= carry.passes) break;
      CUTE_UNROLL
      for (int v = 0; v < kPairs; ++v) {
        const float2 h = __bfloat1622float2(carry.h[pass][v]);
        finite[v % 2] = finite[v % 2] && isfinite(h.x) && isfinite(h.y);
        amax[v % 2] = fmaxf(amax[v % 2], fmaxf(fabsf(h.x), fabsf(h.y)));
      }
    }
    const float scale[2] = {device::quad_block_scale(amax[0], finite[0], p.out_power_of_two),
                            device::quad_block_scale(amax[1], finite[1], p.out_power_of_two)};
    // The scales first: stored before the staging barrier in end_pass, so that a release after it (the
    // megakernel's rows-done count) covers them as it covers the TMA stores.
    if (threadIdx.x % 4 == 0) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        const int r = get<0>(coords(2 * half));
        p.out_scales[int64_t(task.n_block) * p.a_rows + task.buffer_row + r] = scale[half];
        if (isnan(scale[half])) device::record_nonfinite(p.status, NonFiniteWhere::kHidden, p.rank, task.row + r);
      }
    }
    stager.begin_pass();
    CUTE_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      if (pass >= carry.passes) break;  // the box's columns past n are not stored
      CUTE_UNROLL
      for (int v = 0; v < kPairs; ++v) {
        const int i = 2 * v;
        const float2 h = __bfloat1622float2(carry.h[pass][v]);
        const uint16_t q = device::to_e4m3x2(h.x, h.y, scale[v % 2]);
        stager.stage(get<0>(coords(i)), pass * T::kHalfN + get<1>(coords(i)), q);
      }
    }
    stager.end_pass(p.tma_out, p.a_rows, p.out_cols, [&](int box) { return box == 0 ? task.n_block : -1; });
  }
};

// The SwiGLU backward fused into the down dgrad's epilogue (acc = d_hu, 256 columns a tile). g and u come
// from global memory: prefetched into L2 before the mainloop, loaded into registers pass by pass (64
// columns: box 0 takes d_g, box 1 d_u), the first half of each pass's loads issued before it waits for the
// previous pass's stores, so their latency overlaps that wait.
// The passes are a rolled loop over one pass's code. Why: unrolled, the four passes were about 8000 of the
// kernel's 9000 instructions, more than the SM's instruction cache keeps: warps waited on instruction fetch
// (Nsight Compute's no_instruction stall: 19 % of the samples, and a few hundred more instructions elsewhere,
// the bounded waits', took the down dgrad from 577 to 703 us: docs/perf_notes.md, round 17). A pass reads values
// [0, kPassValues) of `window`, which then shifts down by one pass; a value's fragment column is that of the
// same value in pass 0 plus 64 columns per pass (the accumulator fragment repeats every 8 columns).
// Row partials: each thread sums its columns of a row in a fixed order (pass by pass, ascending value
// index), then the row's quad adds its four sums by a butterfly, x += shfl_xor(x, 1); x += shfl_xor(x, 2):
// every lane computes (s0 + s1) + (s2 + s3) up to the order of the operands of each addition, and IEEE
// addition is commutative, so all four lanes hold identical bits; lane 0 of the quad writes them.
// FP8 (a block-scaled GEMM: 128-column tiles, two passes) with out_scales: d_g and d_u also written quantized per
// 1 x 128 for the gate/up dgrad (ExpertGemmArgs::quantized_out; quantize_kept, after the passes).
struct SwiGLUBackwardEpilogue : RowTileEpilogue<SwiGLUBackwardEpilogue> {
  static constexpr GemmEpilogue kKind = GemmEpilogue::kSwiGLUBackward;
  static constexpr bool kOpaqueCoordinates = true;
  static constexpr int out_cols(int block_n) { return block_n; }

  // One thread per (row of the warpgroup, g or u): the row's 128-byte lines (64 columns) of the tile below n.
  template <class T, class Params>
  __device__ __forceinline__ static void prefetch(const Params& p, const TileTask& task, int warpgroup, int thread) {
    const int r = warpgroup * kUnitRows + thread / 2;
    if (r >= p.expert_row_offsets[task.expert] + p.expert_counts[task.expert] - task.row) return;  // padding
    const int64_t n = p.n, tile_col = int64_t(task.n_block) * T::kBlockN;
    const __nv_bfloat16* line = p.gate_up + (int64_t(task.buffer_row) + r) * 2 * n + (thread % 2) * n + tile_col;
    CUTE_UNROLL
    for (int c = 0; c < T::kBlockN; c += T::kBoxCols)
      if (tile_col + c < n) cute::prefetch(line + c);  // prefetch.global.L2
  }

  template <class T, class Params, class Accum, class Coords, class Stager>
  __device__ __forceinline__ static void store(const Params& p, const TileTask& task, const Accum& accum,
                                               const Coords& coords, const TileRows& rows,
                                               const Stager& stager) {
    using cute::get;
    constexpr int kValues = decltype(cute::size(accum))::value;
    constexpr int kPasses = T::kBlockN / T::kBoxCols;
    constexpr int kPassValues = kValues / kPasses;  // 8 columns x 2 rows per 8-column group
    constexpr int kPairs = kPassValues / 2;         // bf16 pairs of g (and of u) a pass
    static_assert(kPassValues % 4 == 0, "a pass covers whole 8-column groups");
    static_assert(kPassValues / 4 * 8 == T::kBoxCols, "a pass's values are pass 0's, 64 columns further");
    const int64_t n = p.n, tile_col = int64_t(task.n_block) * T::kBlockN;
    const float limit = p.swiglu_limit;
    const __nv_bfloat162* gate_up[2];  // the thread's two rows of g (u: n columns further)
    bool real[2];
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = get<0>(coords(2 * half));
      real[half] = r < rows.valid_rows;
      gate_up[half] =
          reinterpret_cast<const __nv_bfloat162*>(p.gate_up + (int64_t(task.buffer_row) + r) * 2 * n + tile_col);
    }
    const __nv_bfloat162 zero = __floats2bfloat162_rn(0.0f, 0.0f);
    float partial[2] = {0.0f, 0.0f};
    float window[kValues];
    CUTE_UNROLL
    for (int i = 0; i < kValues; ++i) window[i] = accum(i);
    // FP8: every pass's bf16 d_g and d_u pairs as stored, kept for quantize_kept in one window (as `window`: each
    // pass first shifts it down by one pass, then writes its d_g pairs and its d_u pairs at the top, so that pass q's
    // d_g pair v ends at 2 q kPairs + v and its d_u pair kPairs further), and per part (d_g, d_u) and row half the
    // running amax and a check that turns NaN once a value is not finite.
    constexpr int kKept = T::kBlockScaled ? 2 * kPasses * kPairs : 1;
    BlockStats stats;
    __nv_bfloat162 kept[kKept];
    CUTE_UNROLL
    for (int v = 0; v < kKept; ++v) kept[v] = zero;
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) {
      const int pass_begin = pass * T::kBoxCols;
      if (tile_col + pass_begin >= n) break;  // the partial last n-block (uniform over the warpgroup)
      if constexpr (T::kBlockScaled) {
        CUTE_UNROLL
        for (int v = 0; v + 2 * kPairs < kKept; ++v) kept[v] = kept[v + 2 * kPairs];
      }
      // An opaque 0, new every pass. Why: the staging addresses are the same every pass; hoisted out of the
      // loop they take 16 registers, which the consumers do not have (ptxas spilled).
      int opaque_zero;
      asm volatile("mov.u32 %0, 0;" : "=r"(opaque_zero));
      // The pass's g and u in two halves of kPairs / 2 pairs: the second half's loads go out once the first
      // half is staged (all at once, beside the 128 accumulators, ptxas spilled).
      __nv_bfloat162 g2[kPairs / 2], u2[kPairs / 2];
      const auto load_half = [&](int h) {
        CUTE_UNROLL
        for (int w = 0; w < kPairs / 2; ++w) {
          const int i = 2 * (h * kPairs / 2 + w);
          const int half = (i / 2) % 2, c = get<1>(coords(i)) + pass_begin;  // c even: one 4-byte pair
          g2[w] = real[half] ? gate_up[half][c / 2] : zero;
          u2[w] = real[half] ? gate_up[half][(n + c) / 2] : zero;
        }
      };
      load_half(0);
      stager.begin_pass();
      CUTE_UNROLL
      for (int v = 0; v < kPairs; ++v) {
        if (v == kPairs / 2) load_half(1);
        const int i = 2 * v;
        const int half = (i / 2) % 2;
        const float2 g_pair = __bfloat1622float2(g2[v % (kPairs / 2)]);
        const float2 u_pair = __bfloat1622float2(u2[v % (kPairs / 2)]);
        float d_g[2], d_u[2];
        CUTE_UNROLL
        for (int j = 0; j < 2; ++j) {
          const float g = j == 0 ? g_pair.x : g_pair.y, u = j == 0 ? u_pair.x : u_pair.y;
          const bool clamped = limit > 0.0f;
          // Masks on the raw g, u; g_c = min(g, L), u_c = clamp(u, -L, L) (reference/moe_reference.h).
          const bool gate_passes = !clamped || g < limit;
          const bool up_passes = !clamped || (-limit < u && u < limit);
          const float g_c = clamped ? fminf(g, limit) : g;
          const float u_c = clamped ? fminf(fmaxf(u, -limit), limit) : u;
          const float s = 1.0f / (1.0f + __expf(-g_c));
          const float silu_g = g_c * s;
          const float d_hu = window[i + j];
          const float d_h = d_hu * rows.row_scale[half];
          d_g[j] = gate_passes ? d_h * u_c * (s * (1.0f + g_c * (1.0f - s))) : 0.0f;
          d_u[j] = up_passes ? d_h * silu_g : 0.0f;
          if (real[half]) partial[half] += d_hu * silu_g * u_c;
        }
        const int r = get<0>(coords(i)), col = get<1>(coords(i)) + opaque_zero;  // the pass's column: pass 0's
        const __nv_bfloat162 g_out = real[half] ? __floats2bfloat162_rn(d_g[0], d_g[1]) : zero;
        const __nv_bfloat162 u_out = real[half] ? __floats2bfloat162_rn(d_u[0], d_u[1]) : zero;
        stager.stage(r, col, g_out);
        stager.stage(r, T::kBoxCols + col, u_out);
        if constexpr (T::kBlockScaled) {
          kept[kKept - 2 * kPairs + v] = g_out;
          kept[kKept - kPairs + v] = u_out;
          stats.add(0, half, g_out);
          stats.add(1, half, u_out);
        }
      }
      const int c = int(tile_col) + pass_begin;  // < n (see above); box 0: d_g, box 1: d_u
      stager.end_pass(p.tma_out, p.a_rows, 2 * n, [&](int box) { return (box * p.n + c) / T::kBoxCols; });
      CUTE_UNROLL
      for (int i = 0; i + kPassValues < kValues; ++i) window[i] = window[i + kPassValues];
    }
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      float x = partial[half];
      x += __shfl_xor_sync(0xffffffff, x, 1);
      x += __shfl_xor_sync(0xffffffff, x, 2);
      const int r = get<0>(coords(2 * half));
      if (threadIdx.x % 4 == 0)
        p.row_partials[(int64_t(task.buffer_row) + r) * p.num_n_blocks + task.n_block] = real[half] ? x : 0.0f;
    }
    if constexpr (T::kBlockScaled)
      if (p.out_scales != nullptr) quantize_kept<T>(p, task, coords, stager, stats, kept);
  }

  // The amax and finiteness of a thread's values of the 1 x 128 blocks of its two fragment rows, d_g's and d_u's.
  struct BlockStats {
    float amax[2][2] = {};   // [part][row half]
    float check[2][2] = {};  // sum of value * 0: NaN once a value is a NaN or an infinity, else 0
    __device__ __forceinline__ void add(int part, int half, __nv_bfloat162 pair) {
      const float2 v = __bfloat1622float2(pair);
      amax[part][half] = fmaxf(amax[part][half], fmaxf(fabsf(v.x), fabsf(v.y)));
      check[part][half] = fmaf(v.y, 0.0f, fmaf(v.x, 0.0f, check[part][half]));
    }
  };

  // The tile's d_g and d_u (the bf16 values stored above) quantized per 1 x 128 as the gate/up dgrad's A: a
  // 128-column tile is one scale block of each (part 0: d_g, 1: d_u). Each row's amax and finiteness over its 128
  // columns (the thread's, `stats`, then its quad's by a butterfly: every lane the same), the block's scale (to
  // out_scales[part n / 128 + nb, row], by lane 0 of the quad), then a pass's part at a time the e4m3 values (`kept`,
  // shifted down a part after each), staged in box `part` and stored by TMA to quantized_out's columns part n + 128
  // nb (tma_side_out: e4m3 [a_rows, 2n] as bf16 [a_rows, n]). quantize_rows_fp8's arithmetic on the values it would
  // read: the same bits. Padding rows: zeros, scale 1. A block holding a NaN or an infinity gets a NaN scale and is
  // reported (kDGateUp). The conversions are a rolled loop, as the SwiGLU backward's passes: unrolled, the 128 a
  // thread took the kernel to 7064 SASS instructions (tests/cpu/check_sass's budget is 6000, the instruction cache).
  template <class T, class Params, class Coords, class Stager, int kKept>
  __device__ __forceinline__ static void quantize_kept(const Params& p, const TileTask& task, const Coords& coords,
                                                       const Stager& stager, BlockStats stats,
                                                       __nv_bfloat162 (&kept)[kKept]) {
    using cute::get;
    constexpr int kPasses = T::kBlockN / T::kBoxCols;
    constexpr int kPairs = kKept / (2 * kPasses);
    static_assert(T::kBlockN == 128 && kKept == decltype(cute::size(coords))::value,
                  "a tile is one 1 x 128 block of d_g and one of d_u, all of its values kept");
    float scale[2][2];
    CUTE_UNROLL
    for (int part = 0; part < 2; ++part) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        scale[part][half] =
            device::quad_block_scale(stats.amax[part][half], !isnan(stats.check[part][half]), p.out_power_of_two);
        const int r = get<0>(coords(2 * half));
        if (threadIdx.x % 4 == 0) {
          p.out_scales[int64_t(part * (p.n / 128) + task.n_block) * p.a_rows + task.buffer_row + r] =
              scale[part][half];
          if (isnan(scale[part][half]))
            device::record_nonfinite(p.status, NonFiniteWhere::kDGateUp, p.rank, task.row + r);
        }
      }
    }
    stager.begin_pass();  // the last pass's bf16 boxes are read by now
#pragma unroll 1
    for (int step = 0; step < 2 * kPasses; ++step) {  // pass step / 2, part step % 2
      const int part = step % 2;
      const float scale_row[2] = {part == 0 ? scale[0][0] : scale[1][0], part == 0 ? scale[0][1] : scale[1][1]};
      CUTE_UNROLL
      for (int v = 0; v < kPairs; ++v) {  // pair v: values 2v, 2v + 1 of the pass, row half v % 2
        const int r = get<0>(coords(2 * v)), c = get<1>(coords(2 * v)) + step / 2 * T::kBoxCols;  // e4m3: a byte
        const float2 x = __bfloat1622float2(kept[v]);
        stager.stage_bytes(part, r, c, device::to_e4m3x2(x.x, x.y, scale_row[v % 2]));
      }
      CUTE_UNROLL
      for (int v = 0; v + kPairs < kKept; ++v) kept[v] = kept[v + kPairs];
    }
    stager.end_pass_with([&] {
      stager.store_box(p.tma_side_out, p.a_rows, p.n, 0, task.n_block);
      stager.store_box(p.tma_side_out, p.a_rows, p.n, 1, p.n / 128 + task.n_block);
    });
  }
};

}  // namespace mok::gemm
