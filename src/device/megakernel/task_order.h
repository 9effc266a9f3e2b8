// Task order of a persistent megakernel (the forward's: src/device/megakernel/forward_kernel.cuh; the
// backward's tables: backward_tasks.h): which task a ticket slot is, for the compute CTAs and for the
// communication, walked over the kernel's phase tables (task_tables.h; the forward's in forward_tasks.h).
// Host + device code, so the CPU tests walk the same order the GPU does and check that it covers every tile
// once and cannot deadlock.
//
// Vocabulary (rows are schedule rows: the expert-major order of src/device/schedule/placement.h)
//   unit         64 rows; the grain of every dependency counter and of communication tasks
//   tile         a GEMM task: up to 128 rows of one expert x one group of n-blocks (TileTask); or (the
//                backward's weight gradients) one expert's whole segment x one m-block of 128 gradient
//                rows x one group of n-blocks
//   macrobatch   ring_rows consecutive rows. The expert-side buffers (x rows, hidden, expert outputs) hold
//                one macrobatch: schedule row r lives at ring row r % ring_rows. Macrobatches are walked
//                last to first, so macrobatch 0 is what stays resident for the backward. (The backward
//                has one: its ring is the capacity.)
//   minibatch    minibatch_rows consecutive rows of a macrobatch (the last one may be shorter); the unit
//                of ordering: its phases one after the other.
//
// Compute order (one atomic ticket): the kShared phases in table order; (the backward) the kEndingExperts
// phases over the experts whose clipped segment ends at row 0; then per minibatch in walk order its
// kMinibatch / kMinibatchFrom / kEndingExperts phases in table order (the forward: shared gate/up, shared
// down, then per minibatch gate/up, down); then (the backward) the kSharedTail phases. Inside a phase,
// tiles go expert by expert, n-block group by group, m-tiles (or a weight gradient's m-blocks) fastest
// (PhaseWalker's order, clipped to the phase's rows): tiles that share weights start together.
// Communication order (a second ticket): per macrobatch in walk order, each comm phase over its units (the
// forward: dispatch of its units, then their combine).
// Every task waits only for tasks earlier in its own order or in the other one, and each of those waits
// only for earlier ones again, so handing tasks out in ticket order cannot deadlock (docs/sync_protocol.md;
// tests/cpu/test_forward_tasks.cpp and test_backward_tasks.cpp check it from the tables).
#pragma once

#include <cstdint>

#include "mok/timeline.h"
#include "src/device/common/host_device.h"
#include "src/device/megakernel/task_tables.h"
#include "src/device/schedule/placement.h"

namespace mok::megakernel {

inline constexpr int kUnitRows = 64;
inline constexpr int kTileRows = 128;

// What the task order needs to know, all of it readable on the host and on the device (on the GPU it lives
// in kernel parameter space).
struct TaskOrderShape {
  const int32_t* expert_row_offsets;  // [local_experts + 1], the routed schedule's padded segments
  int local_experts;
  int32_t shared_rows;                // padded tokens, or 0 without a shared expert
  int32_t ring_rows;                  // macrobatch rows, a multiple of 128
  int32_t minibatch_rows;             // a multiple of 128
  int32_t recompute_from;             // a multiple of 128: kMinibatchFrom phases start here, phases wait on
                                      // waits_kept below it (the backward; 0 for the forward)
  int32_t gemm_groups[kMaxGemms];     // n-block groups (of cluster_n CTAs) of each GEMM: n-blocks / cluster_n
  int32_t gemm_m_blocks[kMaxGemms];   // weight-gradient GEMMs: m-blocks of 128 gradient rows; 0 for row GEMMs
  PhaseTable phases;
  CommPhaseTable comm_phases;
};

struct ComputeTask {
  int32_t phase;        // entry of TaskOrderShape::phases, or kNoPhase past the last task
  int32_t row;          // first schedule row (token row for the shared expert's phases)
  int32_t buffer_row;   // where it lives in the A and output buffers
  int32_t rows;         // row tiles: 64 or 128; weight-gradient tiles: the expert's segment clipped to the
                        // scheduled rows (any multiple of 64, 0 for an expert without rows)
  int32_t n_group;      // group of cluster_n adjacent n-blocks
  int32_t expert;       // local expert (0 for the shared expert)
  int32_t m_block = 0;  // weight-gradient tiles: gradient rows [m_block * 128, + 128); 0 for row tiles
};

struct CommTask {
  int32_t phase;  // entry of TaskOrderShape::comm_phases, or kNoPhase past the last task
  int32_t unit;   // schedule rows [unit * 64, unit * 64 + 64)
};

MOK_HOST_DEVICE int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

// The counter a tile of `phase` waits on for `unit` (the backward kernel's producer and the CPU tests):
// waits_kept below recompute_from, waits from there on. Any phase: a token-row phase's waits_kept is its
// waits (tables_are_consistent). The forward's recompute_from is 0: always waits.
MOK_HOST_DEVICE int8_t counter_awaited(const PhaseDesc& phase, const TaskOrderShape& s, int32_t unit) {
  return unit * kUnitRows < s.recompute_from ? phase.waits_kept : phase.waits;
}

// Macrobatches and, per macrobatch, minibatches of the routed rows: the schedule's rows in use
// (scheduled_rows, a multiple of 64; 0 after a capacity overflow).
struct Batches {
  int32_t macrobatches;        // ceil(scheduled_rows / ring_rows)
  int32_t last_rows;           // rows of the last macrobatch (walked first)
  int32_t last_minibatches;
  int32_t full_minibatches;    // of every other macrobatch

  MOK_HOST_DEVICE static Batches of(const TaskOrderShape& s, int32_t scheduled_rows) {
    Batches b{};
    b.macrobatches = ceil_div(scheduled_rows, s.ring_rows);
    b.last_rows = scheduled_rows - (b.macrobatches - 1) * s.ring_rows;
    b.last_minibatches = b.macrobatches > 0 ? ceil_div(b.last_rows, s.minibatch_rows) : 0;
    b.full_minibatches = ceil_div(s.ring_rows, s.minibatch_rows);
    return b;
  }
  MOK_HOST_DEVICE int32_t total_minibatches() const {
    return macrobatches > 0 ? last_minibatches + (macrobatches - 1) * full_minibatches : 0;
  }
  MOK_HOST_DEVICE int32_t rows_of(int32_t macrobatch, const TaskOrderShape& s) const {
    return macrobatch == macrobatches - 1 ? last_rows : s.ring_rows;
  }
};

// The j-th minibatch in walk order: schedule rows [lo, hi).
MOK_HOST_DEVICE void minibatch_rows_at(const TaskOrderShape& s, const Batches& b, int32_t j, int32_t& lo, int32_t& hi) {
  int32_t macrobatch, index;
  if (j < b.last_minibatches) {
    macrobatch = b.macrobatches - 1;
    index = j;
  } else {
    const int32_t rest = j - b.last_minibatches;
    macrobatch = b.macrobatches - 2 - rest / b.full_minibatches;
    index = rest % b.full_minibatches;
  }
  const int32_t begin = macrobatch * s.ring_rows;
  lo = begin + index * s.minibatch_rows;
  const int32_t end = begin + b.rows_of(macrobatch, s);
  hi = lo + s.minibatch_rows < end ? lo + s.minibatch_rows : end;
}

// The communication task of `slot`: per macrobatch in walk order, comm phase by phase, unit by unit.
MOK_HOST_DEVICE CommTask comm_task_at(const TaskOrderShape& s, int32_t scheduled_rows, int32_t slot) {
  const Batches b = Batches::of(s, scheduled_rows);
  if (b.macrobatches == 0) return {kNoPhase, 0};
  const int32_t phases = s.comm_phases.count;
  const int32_t last_units = b.last_rows / kUnitRows;
  const int32_t full_units = s.ring_rows / kUnitRows;
  int32_t macrobatch, local, units;
  if (slot < phases * last_units) {
    macrobatch = b.macrobatches - 1;
    local = slot;
    units = last_units;
  } else {
    const int32_t rest = slot - phases * last_units;
    macrobatch = b.macrobatches - 2 - rest / (phases * full_units);
    if (macrobatch < 0) return {kNoPhase, 0};
    local = rest % (phases * full_units);
    units = full_units;
  }
  const int32_t first_unit = macrobatch * full_units;
  return {local / units, first_unit + local % units};
}

// Walks the compute order slot by slot, asked for increasing slots, so a cursor over phases and experts
// replaces a search per slot. Holds a reference to the shape (on the GPU: kernel parameter space, read when
// needed rather than held in registers; the producer thread that walks has few).
// kBackwardPhases: the tables may hold the backward's kinds (kMinibatchFrom, kEndingExperts, kSharedTail);
// false (ComputeWalker, the forward's) compiles the walk of kShared and kMinibatch phases alone.
template <bool kBackwardPhases>
struct PhaseWalker {
  const TaskOrderShape& shape;
  Batches batches;
  int32_t scheduled_rows;     // weight-gradient segments are clipped to it
  int32_t phase = -1;         // entry of shape.phases being walked
  int32_t minibatch = kBackwardPhases ? -1 : 0;  // of a per-minibatch phase, in walk order; -1: the backward's
                                                 // weight-gradient tiles of the experts that end at row 0
  int32_t lo = 0, hi = 0;     // the phase's rows: [lo, hi) of row tiles, (lo, hi] of segment ends
  int experts = 0;
  int groups = 0;
  int32_t m_blocks = 0;       // weight-gradient tiles per n-block group and expert
  int32_t expert = 0;         // the cursor: current expert of the phase
  int32_t begin = 0, end = 0; // its rows inside [lo, hi), or its (clipped) segment
  int32_t tiles = 0;          // per n-block group: m-tiles of [begin, end), or m_blocks
  int32_t slot_begin = 0, slot_end = 0;
  bool weight_grad = false;   // the backward's: the phase's tiles are weight-gradient tiles
  bool token_phase = false;   // the backward's: the phase's rows are the shared expert's

  MOK_HOST_DEVICE PhaseWalker(const TaskOrderShape& s, int32_t rows)
      : shape(s), batches(Batches::of(s, rows)), scheduled_rows(rows) {}

  // The task of `slot` (slots asked in increasing order), or false past the last task.
  MOK_HOST_DEVICE bool task_at(int32_t slot, ComputeTask& t) {
    while (slot >= slot_end)
      if (!next_expert()) return false;
    const int32_t local = slot - slot_begin;
    t.phase = phase;
    t.expert = expert;
    t.n_group = local / tiles;
    t.m_block = 0;
    if constexpr (kBackwardPhases) {
      if (weight_grad) {  // the whole segment, every m-block
        t.m_block = local % tiles;
        t.row = begin;
        t.rows = end - begin;
        t.buffer_row = begin;
        return true;
      }
    }
    t.row = begin + (local % tiles) * kTileRows;
    t.rows = end - t.row < kTileRows ? end - t.row : kTileRows;
    t.buffer_row = shared_phase() ? t.row : t.row % shape.ring_rows;
    return true;
  }

 private:
  MOK_HOST_DEVICE bool shared_phase() const {
    if constexpr (kBackwardPhases) return token_phase;
    else return phase < shape.phases.shared_count;
  }

  MOK_HOST_DEVICE bool next_phase() {
    if constexpr (kBackwardPhases) return next_backward_phase();
    else return next_forward_phase();
  }

  // The forward's: the kShared phases once, then the kMinibatch ones for each minibatch.
  MOK_HOST_DEVICE bool next_forward_phase() {
    const PhaseTable& table = shape.phases;
    if (++phase == table.count) {  // past a minibatch's last phase: the next minibatch's first
      phase = table.shared_count;
      ++minibatch;
    }
    if (shared_phase()) {
      lo = 0;
      hi = shape.shared_rows;
      experts = 1;
    } else {
      if (table.count == table.shared_count || minibatch >= batches.total_minibatches()) return false;
      minibatch_rows_at(shape, batches, minibatch, lo, hi);
      experts = shape.local_experts;
    }
    groups = shape.gemm_groups[table.phase[phase].gemm];
    expert = shared_phase() ? -1 : schedule::expert_of_row(shape.expert_row_offsets, experts, lo) - 1;
    return true;                                                 // next_expert moves to the first one
  }

  // The backward's: the kShared phases once; the per-minibatch ones for minibatch -1 (only its
  // kEndingExperts phases have tiles: the experts that end at row 0) and each minibatch; the kSharedTail ones.
  MOK_HOST_DEVICE bool next_backward_phase() {
    const PhaseTable& table = shape.phases;
    if (++phase == table.tail_begin && table.shared_count < table.tail_begin &&
        minibatch + 1 < batches.total_minibatches()) {  // past a minibatch's last phase: the next one's first
      phase = table.shared_count;
      ++minibatch;
    }
    if (phase >= table.count) return false;
    const PhaseDesc& p = table.phase[phase];
    weight_grad = weight_grad_tiles(p.rows);
    token_phase = token_rows(p.rows);
    groups = shape.gemm_groups[p.gemm];
    m_blocks = shape.gemm_m_blocks[p.gemm];
    if (token_phase) {
      lo = 0;
      hi = shape.shared_rows;
      experts = 1;
      expert = -1;
      return true;
    }
    experts = shape.local_experts;
    if (minibatch < 0) {  // segment ends in (-1, 0]; no row tiles
      lo = -1;
      hi = 0;
      if (!weight_grad) experts = 0;
    } else {
      minibatch_rows_at(shape, batches, minibatch, lo, hi);
      if (p.rows == PhaseRows::kMinibatchFrom && lo < shape.recompute_from) lo = shape.recompute_from;
    }
    // The first expert whose segment reaches past lo (every earlier one ends at or before it).
    expert = schedule::expert_of_row(shape.expert_row_offsets, experts, lo) - 1;
    return true;
  }

  // Start of segment e of the phase's rows; the shared expert is one segment [0, shared_rows).
  MOK_HOST_DEVICE int32_t offset(int32_t e) const {
    return shared_phase() ? (e == 0 ? 0 : shape.shared_rows) : shape.expert_row_offsets[e];
  }

  // Row tiles: the next expert with rows in [lo, hi).
  MOK_HOST_DEVICE bool next_row_expert() {
    while (++expert < experts && offset(expert) < hi) {
      const int32_t segment_begin = offset(expert), segment_end = offset(expert + 1);
      begin = segment_begin > lo ? segment_begin : lo;
      end = segment_end < hi ? segment_end : hi;
      tiles = end > begin ? ceil_div(end - begin, kTileRows) : 0;
      if (tiles == 0) continue;  // an empty expert
      slot_begin = slot_end;
      slot_end += tiles * groups;
      return true;
    }
    return false;
  }

  // Weight-gradient tiles: the next expert whose clipped segment ends in (lo, hi] (an empty one too).
  MOK_HOST_DEVICE bool next_weight_grad_expert() {
    const int32_t clip = token_phase ? shape.shared_rows : scheduled_rows;
    while (++expert < experts) {
      const int32_t segment_end = offset(expert + 1) < clip ? offset(expert + 1) : clip;
      if (segment_end > hi) return false;  // it ends in a later minibatch, and so do the ones after it
      if (segment_end <= lo || m_blocks * groups == 0) continue;  // the shared expert without rows
      begin = offset(expert) < clip ? offset(expert) : clip;
      end = segment_end;
      tiles = m_blocks;
      slot_begin = slot_end;
      slot_end += tiles * groups;
      return true;
    }
    return false;
  }

  MOK_HOST_DEVICE bool next_expert() {
    while (true) {
      if (phase >= 0) {
        if constexpr (kBackwardPhases) {
          if (weight_grad ? next_weight_grad_expert() : next_row_expert()) return true;
        } else if (next_row_expert()) {
          return true;
        }
      }
      if (!next_phase()) return false;
    }
  }
};

// The forward's walker: kShared and kMinibatch phases (forward_kernel.cuh's producer).
using ComputeWalker = PhaseWalker<false>;
// The backward's: every PhaseRows kind.
using BackwardWalker = PhaseWalker<true>;

}  // namespace mok::megakernel
