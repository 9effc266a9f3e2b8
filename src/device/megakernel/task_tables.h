// Phase and counter tables: the data a persistent megakernel's task order and its dependency counters are
// built from. Host + device code (the CPU tests walk and check the same tables the GPU reads).
//
// A kernel declares three constexpr tables (the forward's are in forward_tasks.h):
//   counters        one array each, one u64 per 64-row unit of its row space (the schedule's capacity or the
//                   padded tokens), all arrays in one zeroed allocation in table order; complete at the
//                   n-blocks of the GEMM that stores them (each stored n-block adds 1) or at 1 (a copy task)
//   compute phases  in walk order (task_order.h): the task kind, which of the kernel's GEMMs, its tiles and
//                   where their rows come from (PhaseRows: row tiles of the shared expert's tokens, walked
//                   once before everything routed, or of each minibatch's routed rows; the backward's
//                   weight-gradient tiles of the experts whose segment ends in a minibatch, or of the shared
//                   expert after the last minibatch), the counter its producer waits on for every unit of a
//                   tile's rows (another one for the units below TaskOrderShape::recompute_from), and the
//                   counter its consumers add to per stored n-block
//   comm phases     walked per macrobatch: the task kind, the role a timeout names, the counter its leader
//                   waits on (for the unit itself, or for the unit whose ring rows it overwrites) and the
//                   counter it adds 1 to once the unit is copied
// tables_are_consistent() checks a kernel's tables at compile time. The host copies them into the kernel's
// parameters (PhaseTable, CommPhaseTable, and CounterArrays with the arrays' pointers and targets
// resolved), so device code reads a descriptor with an indexed parameter load and holds no registers for it.
#pragma once

#include <cstdint>

#include "mok/status.h"
#include "mok/timeline.h"
#include "src/device/common/host_device.h"

namespace mok::megakernel {

inline constexpr int kMaxPhases = 10;     // compute phases of one kernel (the backward's: 10)
inline constexpr int kMaxCommPhases = 4;  // communication phases
inline constexpr int kMaxCounters = 8;    // counter arrays (the backward's: 7)
inline constexpr int kMaxGemms = 10;      // GEMM descriptors (the backward's: 10)

inline constexpr int32_t kNoPhase = -1;   // ComputeTask / CommTask::phase past the last task
inline constexpr int8_t kNoCounter = -1;  // a phase that waits on (or signals) nothing
inline constexpr int8_t kOneTask = -1;    // CounterDesc::complete_at of a counter that one copy task completes

// A phase's tiles and their rows. Row tiles: up to 128 rows of one expert segment x an n-block group.
// Weight-gradient tiles (the backward's): one expert's whole segment (the GEMM's K) x an m-block of
// gradient rows x an n-block group. The walk (task_order.h): the kShared phases once, then per minibatch
// the kMinibatch, kMinibatchFrom and kEndingExperts phases in table order, then the kSharedTail phases once.
enum class PhaseRows : int8_t {
  kShared,         // row tiles of the shared expert's token rows [0, shared_rows), one segment; walked once, first
  kMinibatch,      // row tiles of each minibatch's routed rows (expert segments clipped to it, rows in the ring)
  kMinibatchFrom,  // as kMinibatch, only the rows at or past TaskOrderShape::recompute_from (the backward's
                   // recompute: the rows below it were kept by the forward's context)
  kEndingExperts,  // weight-gradient tiles of the routed experts whose segment, clipped to the scheduled rows,
                   // ends in the minibatch: lo < end <= hi. Experts whose clipped end is 0 (empty experts
                   // before the first row; every expert when no row is scheduled) are walked once, before
                   // the first minibatch (after the kShared phases)
  kSharedTail,     // weight-gradient tiles of the shared expert [0, shared_rows); walked once, after the last
                   // minibatch (none without a shared expert)
};

// The shared expert's phases (their counters count token-row units), and the weight-gradient ones.
MOK_HOST_DEVICE constexpr bool token_rows(PhaseRows rows) {
  return rows == PhaseRows::kShared || rows == PhaseRows::kSharedTail;
}
MOK_HOST_DEVICE constexpr bool weight_grad_tiles(PhaseRows rows) {
  return rows == PhaseRows::kEndingExperts || rows == PhaseRows::kSharedTail;
}

struct PhaseDesc {
  TaskKind kind;
  int8_t gemm;        // which of the kernel's GEMMs: its descriptors, n-block groups and m-blocks
  PhaseRows rows;
  int8_t waits;       // counter the producer waits on, for every unit of a tile's rows, before its loads
  int8_t waits_kept;  // ... for the units below TaskOrderShape::recompute_from instead (routed phases; rows the
                      // context kept, which no kMinibatchFrom tile signals); `waits` where that does not apply
  int8_t signals;     // counter the consumers add 1 to, per unit, for each n-block they stored
};

enum class CommWait : int8_t {
  kUnit,          // the task's own unit
  kRingPrevious,  // the unit whose ring rows the task overwrites: one macrobatch later (walked earlier);
                  // nothing to wait for in the first macrobatch walked
};

struct CommPhaseDesc {
  TaskKind kind;
  Role role;           // named by a timeout report
  int8_t waits;        // counter the group's leader waits on before the copy
  CommWait wait_unit;  // ... for which unit
  int8_t signals;      // counter the leader adds 1 to after the unit is copied
};

enum class CounterUnits : int8_t {
  kCapacity,  // one per 64 schedule rows of the capacity (routed rows, PhaseRows::kMinibatch)
  kShared,    // one per 64 padded token rows (the shared expert's, PhaseRows::kShared)
};

struct CounterDesc {
  CounterId id;        // its name in timeout reports and docs/sync_protocol.md
  CounterUnits units;
  int8_t complete_at;  // the target: the n-blocks of this GEMM, or kOneTask (1)
};

// The tables as kernel parameters (device code indexes them at run time: parameter-space loads).
struct PhaseTable {
  int32_t count;
  int32_t shared_count;  // phases [0, shared_count) are the kShared ones
  int32_t tail_begin;    // phases [tail_begin, count) are the kSharedTail ones (count: none)
  PhaseDesc phase[kMaxPhases];
};

struct CommPhaseTable {
  int32_t count;
  CommPhaseDesc phase[kMaxCommPhases];
};

// A kernel's counters resolved: unit u of counter i is base[i][u]; complete at target[i].
struct CounterArrays {
  uint64_t* base[kMaxCounters];
  uint64_t target[kMaxCounters];
  CounterId id[kMaxCounters];
};

// Appends a phase to a table under construction (a kernel's phases chosen at launch); then finish_phases.
constexpr void add_phase(PhaseTable& t, const PhaseDesc& phase) {
  if (t.count < kMaxPhases) t.phase[t.count] = phase;
  ++t.count;  // past kMaxPhases: tables_are_consistent says no
}

// shared_count and tail_begin of a table whose phases are in place.
constexpr PhaseTable finish_phases(PhaseTable t) {
  const int32_t n = t.count < kMaxPhases ? t.count : kMaxPhases;
  t.shared_count = 0;
  while (t.shared_count < n && t.phase[t.shared_count].rows == PhaseRows::kShared) ++t.shared_count;
  t.tail_begin = n;
  while (t.tail_begin > t.shared_count && t.phase[t.tail_begin - 1].rows == PhaseRows::kSharedTail) --t.tail_begin;
  return t;
}

template <int N>
constexpr PhaseTable phase_table(const PhaseDesc (&phases)[N]) {
  static_assert(N <= kMaxPhases, "raise kMaxPhases");
  PhaseTable t{};
  for (const PhaseDesc& p : phases) add_phase(t, p);
  return finish_phases(t);
}

template <int N>
constexpr CommPhaseTable comm_phase_table(const CommPhaseDesc (&phases)[N]) {
  static_assert(N <= kMaxCommPhases, "raise kMaxCommPhases");
  CommPhaseTable t{};
  t.count = N;
  for (int i = 0; i < N; ++i) t.phase[i] = phases[i];
  return t;
}

// Whether a table holds phases that only the backward's walker knows (PhaseWalker<true>, task_order.h).
constexpr bool uses_backward_rows(const PhaseTable& t) {
  for (int i = 0; i < t.count && i < kMaxPhases; ++i)
    if (t.phase[i].rows != PhaseRows::kShared && t.phase[i].rows != PhaseRows::kMinibatch) return true;
  return false;
}

constexpr int64_t counter_units(CounterUnits units, int64_t capacity_units, int64_t shared_units) {
  return units == CounterUnits::kCapacity ? capacity_units : shared_units;
}

// u64 words of all of a kernel's counters.
template <int N>
constexpr int64_t counter_words(const CounterDesc (&counters)[N], int64_t capacity_units, int64_t shared_units) {
  int64_t words = 0;
  for (const CounterDesc& c : counters) words += counter_units(c.units, capacity_units, shared_units);
  return words;
}

// The counters laid out in `words` (counter_words of them, table order); gemm_n_blocks[g]: GEMM g's n-blocks.
template <int N>
CounterArrays resolve_counters(const CounterDesc (&counters)[N], uint64_t* words, int64_t capacity_units,
                               int64_t shared_units, const int32_t* gemm_n_blocks) {
  static_assert(N <= kMaxCounters, "raise kMaxCounters");
  CounterArrays a{};
  for (int i = 0; i < N; ++i) {
    a.base[i] = words;
    a.target[i] = counters[i].complete_at == kOneTask ? 1 : uint64_t(gemm_n_blocks[counters[i].complete_at]);
    a.id[i] = counters[i].id;
    words += counter_units(counters[i].units, capacity_units, shared_units);
  }
  return a;
}

// Compile-time checks of a kernel's tables:
//   - walk order: the kShared phases first, the kSharedTail ones last, the per-minibatch ones between
//   - every reference is in range, and a phase's counters count units of its own rows (token rows for
//     kShared and kSharedTail, schedule rows otherwise; the communication's are schedule rows); a token-row
//     phase has no separate wait for kept rows (recompute_from is a schedule row)
//   - each counter is signalled by at most one phase, whose contribution per unit is its target: n-blocks of
//     the counter's GEMM from a row-tile phase of that GEMM (weight-gradient tiles signal nothing), 1 from a
//     communication phase; a counter that no phase signals (a variant without its GEMM) has no waiter
//   - a counter that a kMinibatchFrom phase signals is complete only at or past recompute_from: no phase
//     waits on it for kept units (waits_kept), and no communication phase waits on it
constexpr bool tables_are_consistent(const PhaseTable& phases, const CommPhaseTable& comm, const CounterDesc* counters,
                                     int num_counters, int num_gemms) {
  const int P = phases.count, C = comm.count, K = num_counters;
  if (P > kMaxPhases || C > kMaxCommPhases || K > kMaxCounters || num_gemms > kMaxGemms) return false;
  auto counter_ok = [&](int8_t c, CounterUnits units) {
    return c == kNoCounter || (c >= 0 && c < K && counters[c].units == units);
  };
  auto walk_group = [](PhaseRows rows) { return rows == PhaseRows::kShared ? 0 : rows == PhaseRows::kSharedTail ? 2 : 1; };
  for (int i = 0; i < P; ++i) {
    const PhaseDesc& p = phases.phase[i];
    if (i > 0 && walk_group(p.rows) < walk_group(phases.phase[i - 1].rows)) return false;
    if (p.gemm < 0 || p.gemm >= num_gemms) return false;
    const CounterUnits units = token_rows(p.rows) ? CounterUnits::kShared : CounterUnits::kCapacity;
    if (!counter_ok(p.waits, units) || !counter_ok(p.waits_kept, units) || !counter_ok(p.signals, units)) return false;
    if (token_rows(p.rows) && p.waits_kept != p.waits) return false;
    if (weight_grad_tiles(p.rows) && p.signals != kNoCounter) return false;
  }
  if (phases.shared_count != finish_phases(phases).shared_count || phases.tail_begin != finish_phases(phases).tail_begin)
    return false;
  for (int i = 0; i < C; ++i)
    if (!counter_ok(comm.phase[i].waits, CounterUnits::kCapacity) ||
        !counter_ok(comm.phase[i].signals, CounterUnits::kCapacity))
      return false;
  for (int c = 0; c < K; ++c) {
    int signallers = 0, waiters = 0;
    bool target_ok = true, from_recompute_from = false;
    for (int i = 0; i < P; ++i) {
      const PhaseDesc& p = phases.phase[i];
      if (p.signals == c) {
        ++signallers;
        target_ok = target_ok && counters[c].complete_at == p.gemm;
        from_recompute_from = p.rows == PhaseRows::kMinibatchFrom;
      }
      waiters += (p.waits == c) + (p.waits_kept == c);
    }
    for (int i = 0; i < C; ++i) {
      if (comm.phase[i].signals == c) ++signallers, target_ok = target_ok && counters[c].complete_at == kOneTask;
      waiters += comm.phase[i].waits == c;
    }
    if (signallers > 1 || !target_ok || (signallers == 0 && waiters > 0)) return false;
    if (from_recompute_from) {
      for (int i = 0; i < P; ++i)
        if (phases.phase[i].waits_kept == c && phases.phase[i].rows != PhaseRows::kMinibatchFrom) return false;
      for (int i = 0; i < C; ++i)
        if (comm.phase[i].waits == c) return false;
    }
  }
  return true;
}

// The same over tables spelled as arrays (the forward's).
template <int P, int C, int K>
constexpr bool tables_are_consistent(const PhaseDesc (&phases)[P], const CommPhaseDesc (&comm)[C],
                                     const CounterDesc (&counters)[K], int num_gemms) {
  if (P > kMaxPhases || C > kMaxCommPhases) return false;
  PhaseTable t{};
  for (const PhaseDesc& p : phases) add_phase(t, p);
  CommPhaseTable c{};
  c.count = C;
  for (int i = 0; i < C; ++i) c.phase[i] = comm[i];
  return tables_are_consistent(finish_phases(t), c, counters, K, num_gemms);
}

}  // namespace mok::megakernel
