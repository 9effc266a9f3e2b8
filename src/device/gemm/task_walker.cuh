// The GEMMs' tile schedulers: which output tile a task slot is, as DeepGEMM's Scheduler<GemmType>: one concept,
// a mode per grouping. Each CTA takes increasing slots from an atomic ticket (docs/sync_protocol.md), so a
// walker is a cursor over the experts, not a search per slot (between two tiles every role is on the critical
// path). A scheduled_rows of 0 (after a capacity overflow) leaves every expert empty.
//   kRowTiles  (expert GEMM, grouped along M): kBlockM-row tiles of each expert's row segment times the n-block
//              groups; expert by expert, n-block group by group, the expert's m-tiles fastest, so the m-tiles
//              that share one weight block start within microseconds and stream it through L2 together (an
//              expert's gate/up weights, 59-88 MB, do not fit in L2; its A rows do). A strided static
//              assignment let clusters drift apart and read the weights from DRAM 1.5-2 times (perf_notes
//              round 3). Empty experts have no slots.
//   kKGrouped  (weight gradient, grouped along K): every (expert, m-block, n-block) of the gradient, K = the
//              expert's whole segment; expert by expert (its rows stay in L2), n-blocks fastest. An expert
//              without rows has tasks too (its zero tile, or nothing added).
// The concept:
//   Task, Payload            the unit of work (tile_task.cuh); what the task ring carries: the slot
//                            (kRowTiles: each consumer warp decodes it) or the decoded task (kKGrouped)
//   kClaimAhead              the producer claims its next slot before the current tile's loads (kKGrouped: a
//                            tile of few k-blocks takes about as long as the atomic's round trip)
//   kAccumulatorStart        row tiles have K > 0 always; a k-grouped tile may have none (mainloop.cuh)
//   task_at(p, slot, task)   the producer's decode; false past the last task (kStopSlot included)
//   payload(more, slot, task), consumer_task(p, payload, task)   the ring's entry, and back (false: no more)
//   consumer_tile(p, task, warpgroup)  k-blocks, whether the warpgroup's rows are in the tile (active), whether
//                            it waits for stages at all (may_block); values broadcast from lane 0
#pragma once

#include <cstdint>

#include "src/device/gemm/mainloop.cuh"
#include "src/device/gemm/task_ring.cuh"
#include "src/device/gemm/tile_task.cuh"

namespace mok::gemm {

enum class TaskMode : int { kRowTiles = 0, kKGrouped = 1 };

template <TaskMode kMode, class Traits>
struct TaskWalker;

// The mode's types and constants (the concept above).
template <class Task_, class Payload_, bool kClaimAhead_, AccumulatorStart kAccumulatorStart_>
struct TaskWalkerMode {
  using Task = Task_;
  using Payload = Payload_;
  static constexpr bool kClaimAhead = kClaimAhead_;
  static constexpr AccumulatorStart kAccumulatorStart = kAccumulatorStart_;
};

template <class Traits>
struct TaskWalker<TaskMode::kRowTiles, Traits>
    : TaskWalkerMode<TileTask, int32_t, false, AccumulatorStart::kFirstWgmmaOverwrites> {
  struct ConsumerTile {
    bool active;  // a 64-row task: only the first warpgroup's rows
    int num_k_blocks;
    bool may_block;
  };

  int32_t expert = -1;
  int32_t segment_begin = 0;  // row_offsets[expert]
  int32_t segment_end = 0;    // row_offsets[expert + 1]
  int32_t tiles_begin = 0;    // max(segment_begin, first_row): where the expert's tiles start
  int32_t m_tiles = 0;        // m-tiles of the expert
  int32_t slot_begin = 0;     // the expert's first slot
  int32_t slot_end = 0;       // one past its last
  int32_t scheduled_rows = 0; // the schedule's row count; 0 after a capacity overflow: no tasks at all

  // The task of `slot`, or false when the slot lies past the last task.
  template <class Params>
  __device__ __forceinline__ bool walk(const Params& p, int32_t slot, TileTask& t) {
    const int num_groups = p.num_n_blocks / Traits::kClusterN;
    while (slot >= slot_end) {  // empty experts have no slots and are skipped
      if (++expert >= p.local_experts) return false;
      if (expert == 0) {
        scheduled_rows = *p.scheduled_rows;
        segment_end = min(p.expert_row_offsets[0], scheduled_rows);
      }
      segment_begin = segment_end;
      segment_end = min(p.expert_row_offsets[expert + 1], scheduled_rows);
      tiles_begin = max(segment_begin, p.first_row);
      m_tiles = tiles_begin < segment_end ? (segment_end - tiles_begin + Traits::kBlockM - 1) / Traits::kBlockM : 0;
      slot_begin = slot_end;
      slot_end += m_tiles * num_groups;
    }
    const int32_t local = slot - slot_begin;
    t.expert = expert;
    t.n_block = local / m_tiles;
    t.row = tiles_begin + (local % m_tiles) * Traits::kBlockM;
    t.buffer_row = t.row;
    t.rows = min(segment_end - t.row, Traits::kBlockM);
    return true;
  }

  template <class Params>
  __device__ __forceinline__ bool task_at(const Params& p, int32_t slot, TileTask& t) {
    return slot != kStopSlot && walk(p, slot, t);
  }
  __device__ __forceinline__ static Payload payload(bool more, int32_t slot, const TileTask&) {
    return more ? slot : int32_t{kStopSlot};
  }
  // kStopSlot, or a slot past the last task, walks past the last expert: false.
  template <class Params>
  __device__ __forceinline__ bool consumer_task(const Params& p, Payload slot, TileTask& t) {
    return walk(p, slot, t);
  }
  template <class Params>
  __device__ __forceinline__ static ConsumerTile consumer_tile(const Params& p, const TileTask& task, int warpgroup) {
    return {warpgroup * kUnitRows < __shfl_sync(0xffffffff, task.rows, 0), Traits::num_k_blocks(p.k), true};
  }
};

// Accumulators zeroed, every wgmma adds: an expert without rows gets a zero tile (the alternative, the first
// wgmma overwriting and a zero fill on the no-rows path, made ptxas spill the 168 registers the kernel has).
template <class Traits>
struct TaskWalker<TaskMode::kKGrouped, Traits>
    : TaskWalkerMode<GradTileTask, GradTileTask, true, AccumulatorStart::kZeroed> {
  struct ConsumerTile {
    int num_k_blocks;
    int first_row;  // of the gradient: the warpgroup's first
    bool active;    // rows past m (a partial last m-block): the other warpgroup computes the tile alone
    bool may_block;
  };

  int32_t expert = -1;
  int32_t row_begin = 0;
  int32_t k_blocks = 0;
  int32_t scheduled_rows = -1;  // read at the first task

  // The task of `slot`; false (and expert -1) when the slot lies past the last task. The expert's K range is
  // read once per expert, not per tile.
  template <class Params>
  __device__ __forceinline__ bool task_at(const Params& p, int32_t slot, GradTileTask& t) {
    if (slot >= p.num_tasks) {  // kStopSlot too
      t = GradTileTask{-1, 0, 0, 0, 0};
      return false;
    }
    const int32_t tiles = p.num_m_blocks * p.num_n_blocks;
    const int32_t e = slot / tiles;
    if (e != expert) {
      if (scheduled_rows < 0) scheduled_rows = *p.scheduled_rows;
      const int32_t begin = min(p.expert_row_offsets[e], scheduled_rows);
      const int32_t end = min(p.expert_row_offsets[e + 1], scheduled_rows);
      expert = e;
      row_begin = begin;
      k_blocks = max(end - begin, 0) / Traits::kBlockK;  // segments are whole k-blocks (padded to 64 or 128 rows)
    }
    const int32_t local = slot - e * tiles;
    t = GradTileTask{e, local / p.num_n_blocks, local % p.num_n_blocks, row_begin, k_blocks};
    return true;
  }
  __device__ __forceinline__ static Payload payload(bool, int32_t, const GradTileTask& t) { return t; }
  template <class Params>
  __device__ __forceinline__ bool consumer_task(const Params&, const Payload& task, GradTileTask& t) {
    t = task;
    return t.expert >= 0;
  }
  template <class Params>
  __device__ __forceinline__ static ConsumerTile consumer_tile(const Params& p, const GradTileTask& task,
                                                               int warpgroup) {
    const int k_blocks = __shfl_sync(0xffffffff, task.k_blocks, 0);
    const int first_row = __shfl_sync(0xffffffff, task.m_block, 0) * Traits::kBlockM + warpgroup * 64;
    return {k_blocks, first_row, first_row < p.m, k_blocks > 0};
  }
};

}  // namespace mok::gemm
