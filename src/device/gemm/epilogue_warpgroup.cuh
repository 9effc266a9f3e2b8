// Experiment (build flag MOK_EXP_EPILOGUE_WG; docs/development.md, round 37): the FP8 down dgrad's epilogue on a
// warpgroup of its own, so that it overlaps the next tile's mainloop. Nsight Compute put the SwiGLU-backward epilogue
// at about 44 % of the consumer warps' samples, the tensor cores idle meanwhile (docs/perf_notes.md, round 37).
//
// Roles (512 threads): producer warpgroup 0 (as in gemm_kernel.cuh), consumer warpgroups 1-2 (mainloop only),
// epilogue warpgroup 3. Per tile the consumers wait until the accumulator buffer is free (acc_empty), write their 64
// fp32 values a thread into it (value i of consumer thread c at i * 256 + c: 32 consecutive words a warp, both when
// written and when read), consumer thread 0 also the tile's task, then arrive on acc_full and take their next task.
// The epilogue warpgroup waits for acc_full, runs SwiGLUBackwardEpilogue's arithmetic for consumer warpgroup 0's rows,
// then 1's (thread t computes what consumer thread 128 w + t would have: the same values in the same order, so the
// same bits), reading d_hu from the buffer, where it also keeps the bf16 d_g | d_u pairs for the 1 x 128
// quantization (each value's slot, after its d_hu is read), and arrives on acc_empty. After the last task the
// consumers hand a stop. Registers (65536 a CTA): producer 40, consumers 176, epilogue 120.
// Every wait is bounded (HandoffBound; reported as the consumers' task-ring hand-off, index -1).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "src/device/common/mbarrier.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/gemm_epilogue.cuh"
#include "src/device/gemm/tile_task.cuh"

namespace mok::gemm {

template <class T>
concept HasEpilogueWarpgroup = requires { requires T::kEpilogueWarpgroup; };

// The epilogue warpgroup's staging barriers: past the consumer warpgroups' (kStagingBarrier + 0 / 1).
template <class T>
struct EpilogueStaging : T {
  static constexpr int kStagingBarrier = T::kStagingBarrier + 2;
};

// The hand-off of one tile's accumulators from the two consumer warpgroups to the epilogue warpgroup.
struct AccumulatorHandoff {
  static constexpr int kConsumerThreads = 256;
  static constexpr int kValues = 64;  // a consumer thread's values of a 128 x 128 tile
  alignas(16) float values[kValues * kConsumerThreads];
  TileTask task;
  int32_t stop;
  uint64_t full;   // consumers -> epilogue: 256 arrivals
  uint64_t empty;  // epilogue -> consumers: 128 arrivals

  __device__ __forceinline__ void init() {
    device::mbarrier_init(&full, kConsumerThreads);
    device::mbarrier_init(&empty, 128);
  }

  // Consumer thread `consumer_idx`'s hand-off number k: the tile's values (`accum`; null for a warpgroup without
  // rows in the tile). False when the wait gave up.
  template <class Accum>
  __device__ __forceinline__ bool hand(int k, int consumer_idx, const TileTask& cta_task, const Accum* accum,
                                       const device::HandoffBound& bound) {
    if (!device::mbarrier_wait_bounded<device::HandoffScope::kCta>(&empty, (k & 1) ^ 1, bound, Role::kGemmConsumer,
                                                                   CounterId::kTaskRing, -1))
      return false;
    if (accum != nullptr) {
      CUTE_UNROLL
      for (int i = 0; i < kValues; ++i) values[i * kConsumerThreads + consumer_idx] = (*accum)(i);
    }
    if (consumer_idx == 0) {
      task = cta_task;
      stop = 0;
    }
    device::mbarrier_arrive(&full);
    return true;
  }

  // After the consumers' last task (or their give-up): hand-off number k carries the stop.
  __device__ __forceinline__ void hand_stop(int k, int consumer_idx, const device::HandoffBound& bound) {
    if (!device::mbarrier_wait_bounded<device::HandoffScope::kCta>(&empty, (k & 1) ^ 1, bound, Role::kGemmConsumer,
                                                                   CounterId::kTaskRing, -1))
      return;
    if (consumer_idx == 0) stop = 1;
    device::mbarrier_arrive(&full);
  }
};

// The SwiGLU backward of consumer thread c's values (SwiGLUBackwardEpilogue::store, the FP8 tile: its arithmetic and
// order), d_hu read from the hand-off buffer, the bf16 d_g | d_u pairs kept in the values' slots.
template <class T, class Params, class Coords, class Stager>
__device__ __forceinline__ void swiglu_backward_from_shared(const Params& p, const TileTask& task, float* values, int c,
                                                            const Coords& coords, const TileRows& rows,
                                                            const Stager& stager) {
  using cute::get;
  using Epilogue = SwiGLUBackwardEpilogue;
  constexpr int kStride = AccumulatorHandoff::kConsumerThreads;
  constexpr int kValues = AccumulatorHandoff::kValues;
  constexpr int kPasses = T::kBlockN / T::kBoxCols;
  constexpr int kPassValues = kValues / kPasses;
  constexpr int kPairs = kPassValues / 2;
  static_assert(T::kBlockScaled && T::kBlockN == 128 && kValues == decltype(cute::size(coords))::value,
                "the FP8 down dgrad's 128 x 128 tile");
  const int64_t n = p.n, tile_col = int64_t(task.n_block) * T::kBlockN;
  const float limit = p.swiglu_limit;
  const __nv_bfloat162* gate_up[2];
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
  Epilogue::BlockStats stats;
  int passes_done = 0;  // a partial last n-block's later passes keep no pairs: zeros, as store's kept
#pragma unroll 1
  for (int pass = 0; pass < kPasses; ++pass) {
    const int pass_begin = pass * T::kBoxCols;
    if (tile_col + pass_begin >= n) break;
    passes_done = pass + 1;
    float* slots = values + pass * kPassValues * kStride + c;
    __nv_bfloat162 g2[kPairs / 2], u2[kPairs / 2];
    const auto load_half = [&](int h) {
      CUTE_UNROLL
      for (int w = 0; w < kPairs / 2; ++w) {
        const int i = 2 * (h * kPairs / 2 + w);
        const int half = (i / 2) % 2, col = get<1>(coords(i)) + pass_begin;
        g2[w] = real[half] ? gate_up[half][col / 2] : zero;
        u2[w] = real[half] ? gate_up[half][(n + col) / 2] : zero;
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
        const bool gate_passes = !clamped || g < limit;
        const bool up_passes = !clamped || (-limit < u && u < limit);
        const float g_c = clamped ? fminf(g, limit) : g;
        const float u_c = clamped ? fminf(fmaxf(u, -limit), limit) : u;
        const float s = 1.0f / (1.0f + __expf(-g_c));
        const float silu_g = g_c * s;
        const float d_hu = slots[(i + j) * kStride];
        const float d_h = d_hu * rows.row_scale[half];
        d_g[j] = gate_passes ? d_h * u_c * (s * (1.0f + g_c * (1.0f - s))) : 0.0f;
        d_u[j] = up_passes ? d_h * silu_g : 0.0f;
        if (real[half]) partial[half] += d_hu * silu_g * u_c;
      }
      const int r = get<0>(coords(i)), col = get<1>(coords(i));
      const __nv_bfloat162 g_out = real[half] ? __floats2bfloat162_rn(d_g[0], d_g[1]) : zero;
      const __nv_bfloat162 u_out = real[half] ? __floats2bfloat162_rn(d_u[0], d_u[1]) : zero;
      stager.stage(r, col, g_out);
      stager.stage(r, T::kBoxCols + col, u_out);
      // Kept for the quantization in the pair's own two slots (their d_hu is read above): d_g, then d_u.
      *reinterpret_cast<__nv_bfloat162*>(&slots[i * kStride]) = g_out;
      *reinterpret_cast<__nv_bfloat162*>(&slots[(i + 1) * kStride]) = u_out;
      stats.add(0, half, g_out);
      stats.add(1, half, u_out);
    }
    const int col = int(tile_col) + pass_begin;
    stager.end_pass(p.tma_out, p.a_rows, 2 * n, [&](int box) { return (box * p.n + col) / T::kBoxCols; });
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
  if (p.out_scales == nullptr) return;
  // Epilogue::quantize_kept's arithmetic, the kept pairs read back from their slots.
  float scale[2][2];
  CUTE_UNROLL
  for (int part = 0; part < 2; ++part) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      scale[part][half] =
          device::quad_block_scale(stats.amax[part][half], !isnan(stats.check[part][half]), p.out_power_of_two);
      const int r = get<0>(coords(2 * half));
      if (threadIdx.x % 4 == 0) {
        p.out_scales[int64_t(part * (p.n / 128) + task.n_block) * p.a_rows + task.buffer_row + r] = scale[part][half];
        if (isnan(scale[part][half]))
          device::record_nonfinite(p.status, NonFiniteWhere::kDGateUp, p.rank, task.row + r);
      }
    }
  }
  stager.begin_pass();
#pragma unroll 1
  for (int step = 0; step < 2 * kPasses; ++step) {  // pass step / 2, part step % 2
    const int part = step % 2;
    const float scale_row[2] = {part == 0 ? scale[0][0] : scale[1][0], part == 0 ? scale[0][1] : scale[1][1]};
    const float* slots = values + ((step / 2) * kPassValues + part) * kStride + c;
    CUTE_UNROLL
    for (int v = 0; v < kPairs; ++v) {
      const int r = get<0>(coords(2 * v)), col = get<1>(coords(2 * v)) + step / 2 * T::kBoxCols;
      const float2 x = step / 2 < passes_done
                           ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&slots[2 * v * kStride]))
                           : make_float2(0.0f, 0.0f);
      stager.stage_bytes(part, r, col, device::to_e4m3x2(x.x, x.y, scale_row[v % 2]));
    }
  }
  stager.end_pass_with([&] {
    stager.store_box(p.tma_side_out, p.a_rows, p.n, 0, task.n_block);
    stager.store_box(p.tma_side_out, p.a_rows, p.n, 1, p.n / 128 + task.n_block);
  });
}

// The epilogue warpgroup's loop (thread 0-127 of warpgroup 3), staging through EpilogueStaging<T>'s barriers.
template <class T, class Params, class Storage>
__device__ __forceinline__ void run_epilogue_warpgroup(const Params& p, const device::HandoffBound& bound,
                                                       Storage& smem, int thread) {
  using namespace cute;
  AccumulatorHandoff& handoff = smem.handoff;
  typename T::TiledMma mma;
  for (int k = 0;; ++k) {
    if (!device::mbarrier_wait_bounded<device::HandoffScope::kCta>(&handoff.full, k & 1, bound, Role::kGemmConsumer,
                                                                   CounterId::kTaskRing, -1))
      break;
    if (handoff.stop) break;
    const TileTask task = handoff.task;
#pragma unroll 1
    for (int w = 0; w < T::kConsumerWarpgroups; ++w) {
      if (!T::Walker::consumer_tile(p, task, w).active) continue;  // warp-uniform (a 64-row task)
      const int c = w * 128 + thread;
      // Opaque, as RowTileEpilogue::finish makes it for this epilogue (kOpaqueCoordinates).
      int coords_idx = c;
      asm volatile("mov.u32 %0, %1;" : "=r"(coords_idx) : "r"(c));
      Tensor coords =
          mma.get_thread_slice(coords_idx).partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
      const TileRows rows = tile_rows(p, task, coords);
      using TE = EpilogueStaging<T>;
      const TileStager<TE, Storage> stager{smem, w, thread == 0, nullptr, (task.buffer_row + w * kUnitRows) / kUnitRows};
      swiglu_backward_from_shared<TE>(p, task, handoff.values, c, coords, rows, stager);
    }
    device::mbarrier_arrive(&handoff.empty);
  }
  // Why: the shared memory must outlive the last TMA stores' reads of it.
  if (thread == 0) cute::tma_store_wait<0>();
}

}  // namespace mok::gemm
