// Row gather in the expert GEMM's producer (issue 26 item 4; docs/design.md, "Row gather in the gate/up
// producer"): the A rows of a tile are read straight from their tokens' rows of x (the backward's down dgrad: of
// d_out) into the A stages, with no materialized expert-major copy in between.
//
//   stage s of tile (row, expert):  A_s[r, c] = x[token(row + r), 64 s + c]    route(row + r) from `rank`
//                                   A_s[r, c] = a[row + r, 64 s + c]           route from another rank (pulled)
//                                   A_s[r, c] = 0                              padding (route -1), r >= rows
//   token(row) = route_coords(row_route[row]).token: the map pull_rows copies by, so the stages hold the same
//   values at the same shared-memory positions as the TMA load of the pulled copy: same wgmma, same bits.
//
// Roles: the producer warpgroup's 128 threads. Thread t copies 16-byte chunk t % 8 of the rows t / 8 + 16 i
// (i < 8) of each stage with cp.async (zero-filled for padding: source size 0), into the 128-byte-swizzled
// K-major layout the consumers' wgmma reads (addresses from the stage layout itself, SmemLayoutA); thread 0
// also issues the B stage's TMA loads as load_tile does.
// Sync, per stage (the pipeline of mainloop.cuh; a gathering configuration's full barriers count 1 + 128
// arrivals, start_pipeline):
//   thread 0      arrive.expect_tx(B bytes), then the B TMA loads
//   every thread  waits for the stage to be free (bounded), issues its chunks, then cp.async.mbarrier.arrive.noinc:
//                 one of the phase's counted arrivals, made by the hardware once the thread's copies landed. No
//                 barrier between the threads per stage (round 13's version had a named barrier per stage and
//                 the form without .noinc); one per tile agrees on a give-up.
//   consumers     wait for the full barrier, then fence.proxy.async (the chunks were written by the generic
//                 proxy, wgmma reads through the async proxy), then the mainloop as before.
// No A multicast: cp.async writes only this CTA's shared memory, so gathered tiles run in clusters of 1.
// Determinism: copies; the consumers' K order and arithmetic are the TMA path's.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "src/device/common/mbarrier.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/gemm/mainloop.cuh"
#include "src/device/gemm/task_ring.cuh"
#include "src/device/gemm/task_walker.cuh"
#include "src/device/gemm/tile_task.cuh"
#include "src/device/schedule/placement.h"

namespace mok::gemm {

// Where a gathered tile's A rows come from.
struct RowGather {
  const cutlass::bfloat16_t* x = {};  // this rank's symmetric x [padded T, k]: rows of routes from `rank`
  const cutlass::bfloat16_t* a = {};  // the expert-major rows [a_rows, k]: rows of routes from other ranks
  const int32_t* row_route = {};      // the schedule's route id per row, -1 for padding
  int num_tokens = {};                // of the route ids (the workspace's T)
  int top_k = {};
  int rank = {};
};

// The expert GEMM's parameters plus the gather.
template <class Base>
struct RowGatherParams : Base {
  RowGather gather;
};

// The task hand-off of a gathering configuration: the task ring with four more reader warps (the producer
// warpgroup's), plus, in shared memory rather than in the producer's 48 registers, thread 0's task walker and
// the task it decoded for each entry (the producer warps read it instead of walking themselves). decoded[q] is
// rewritten only when entry q is published again, four tasks later, which thread 0 reaches only after every
// producer thread gathered the tasks in between (their named barriers), so after they read it.
template <class Base>
struct RowGatherTasks : TaskRing<Base::Collective::kTaskDepth, 4 * Base::kConsumerWarpgroups + 4, 1> {
  using Ring = TaskRing<Base::Collective::kTaskDepth, 4 * Base::kConsumerWarpgroups + 4, 1>;
  TaskWalker<TaskMode::kRowTiles, Base> walker;
  TileTask decoded[Base::Collective::kTaskDepth];
  __device__ void init() {  // as TaskRing's: one thread, before the barrier that follows barrier init
    Ring::init();
    walker = {};
  }
};

// An expert GEMM configuration whose producer warpgroup gathers A (Base: a GemmTraits with clusters of 1; B
// K-major for the forward's gate/up, MN-major for the backward's down dgrad, whose A rows are d_out's). The
// consumers are Base's; the task ring gets four more reader warps (the producer warpgroup's).
template <class Base>
struct RowGatherTraits : Base {
  using typename Base::Element;
  static constexpr bool kGatherRows = true;  // mainloop.cuh: GathersRows
  static constexpr int kGatherThreads = 128;  // the producer warpgroup
  static_assert(Base::kClusterN == 1, "cp.async writes only this CTA's shared memory: no A multicast");
  static constexpr int kChunkElements = 16 / int(sizeof(Element));
  static constexpr int kChunksPerRow = Base::kBlockK / kChunkElements;  // 8: one 128-byte swizzle row
  static constexpr int kRowsPerPass = kGatherThreads / kChunksPerRow;   // 16
  static constexpr int kRowsPerThread = Base::kBlockM / kRowsPerPass;   // 8
  static_assert(kChunksPerRow == 8 && kRowsPerPass % 8 == 0,
                "a thread's rows share their row mod 8, so one chunk column of the swizzle");
  static constexpr uint32_t kStageBytesB = Base::kBlockN * Base::kBlockK * sizeof(Element);
  // The producer warpgroup's named barrier (after the consumer warpgroups' staging barriers).
  static constexpr int kGatherBarrier = int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount) +
                                        Base::kStagingBarrier + Base::kConsumerWarpgroups;
  using SharedStorage = typename Base::Collective::template Storage<Base::kStagingBoxes, RowGatherTasks<Base>>;
  static constexpr int kSharedBytes = static_cast<int>(sizeof(SharedStorage));
};

// 16 bytes global -> shared, asynchronously; zeros when `zero` (source size 0: nothing is read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool zero) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(zero ? 0u : 16u) : "memory");
}

// Producer warpgroup, one tile: K / 64 stages, A gathered by all threads, B by TMA from thread 0. False when this
// thread's stage wait gave up (it issues nothing more; the caller's per-tile barrier makes every thread agree).
template <class T, class Params, class Storage>
__device__ __forceinline__ bool gather_tile(const Params& p, const TileTask& task, Storage& smem,
                                            typename T::Pipeline& pipeline, typename T::PipelineState& state,
                                            int thread_idx, const device::HandoffBound& bound) {
  using namespace cute;
  using Element = typename T::Element;
  const RowGather& g = p.gather;
  Tensor s_a = make_tensor(make_smem_ptr(smem.a.data()), typename T::SmemLayoutA{});
  const int chunk = thread_idx % T::kChunksPerRow;
  const int first_row = thread_idx / T::kChunksPerRow;

  // Each of this thread's rows, one word (registers are few: 48): a token row of x (>= 0), zeros (-1), or row
  // -2 - s of a (<= -2, a route from another rank).
  int32_t src_row[T::kRowsPerThread];
  CUTE_UNROLL
  for (int i = 0; i < T::kRowsPerThread; ++i) {
    const int r = first_row + i * T::kRowsPerPass;
    const int32_t route = r < task.rows ? g.row_route[task.row + r] : -1;
    src_row[i] = -1;
    if (route >= 0) {
      const schedule::RouteCoords c = schedule::route_coords(route, g.num_tokens, g.top_k);
      src_row[i] = c.src == g.rank ? c.token : -2 - (task.buffer_row + r);
    }
  }

  // Shared-memory address of this thread's first chunk in stage 0, from the stage layout itself; its other rows
  // and stages are whole multiples of the swizzle's period (8 rows of 128 bytes) away, so plain offsets.
  const uint32_t a_chunk0 = cute::cast_smem_ptr_to_uint(&s_a(first_row, chunk * T::kChunkElements, 0));
  constexpr uint32_t kRowPassBytes = T::kRowsPerPass * T::kBlockK * sizeof(Element);
  constexpr uint32_t kStageBytesA = T::kBlockM * T::kBlockK * sizeof(Element);
  static_assert(kRowPassBytes % 1024 == 0 && kStageBytesA % 1024 == 0, "whole swizzle periods");
  const int num_k_blocks = p.k / T::kBlockK;
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    if (!stage_free_bounded(pipeline, state, bound)) return false;
    auto* full = pipeline.producer_get_barrier(state);
    const int stage = state.index();
    if (thread_idx == 0) {
      device::mbarrier_arrive_expect_tx(full, T::kStageBytesB);
      if constexpr (T::Mainloop::kBKMajor)  // B as load_tile loads it
        kmajor_b_loader<T>(p, task, smem)(k_block, stage, full);
      else
        mn_major_b_loader<T>(p, task, smem)(k_block, stage, full);
    }
    const int64_t column = int64_t(k_block) * T::kBlockK + chunk * T::kChunkElements;
    CUTE_UNROLL
    for (int i = 0; i < T::kRowsPerThread; ++i) {
      int32_t row = src_row[i];
      // Why opaque: hoisted out of the k-loop, the eight rows' 64-bit addresses outgrow the 48 registers (spills).
      asm volatile("" : "+r"(row));
      const Element* src = row >= -1 ? g.x + int64_t(row < 0 ? 0 : row) * p.k : g.a + int64_t(-2 - row) * p.k;
      cp_async_16(a_chunk0 + stage * kStageBytesA + i * kRowPassBytes, src + column, row == -1);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(full);
    ++state;
  }
  return true;
}

}  // namespace mok::gemm
