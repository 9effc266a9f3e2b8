// Phase and counter tables: the data a persistent megakernel's task order and its dependency counters are
// built from. Host + device code (the CPU tests walk and check the same tables the GPU reads).
//
// A kernel declares three constexpr tables (the forward's are in forward_tasks.h):
//   counters        one array each, one u64 per 64-row unit of its row space (the schedule's capacity or the
//                   padded tokens), all arrays in one zeroed allocation in table order; complete at the
//                   n-blocks of the GEMM that stores them (each stored n-block adds 1) or at 1 (a copy task)
//   compute phases  in walk order (task_order.h): the task kind, which of the kernel's GEMMs, where its rows
//                   come from (the shared expert's tokens, walked once before everything routed, or each
//                   minibatch's routed rows), the counter its producer waits on for every unit of a tile's
//                   rows, and the counter its consumers add to per stored n-block
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

inline constexpr int kMaxPhases = 8;      // compute phases of one kernel
inline constexpr int kMaxCommPhases = 4;  // communication phases
inline constexpr int kMaxCounters = 8;    // counter arrays
inline constexpr int kMaxGemms = 8;       // GEMM descriptors

inline constexpr int32_t kNoPhase = -1;   // ComputeTask / CommTask::phase past the last task
inline constexpr int8_t kNoCounter = -1;  // a phase that waits on (or signals) nothing
inline constexpr int8_t kOneTask = -1;    // CounterDesc::complete_at of a counter that one copy task completes

enum class PhaseRows : int8_t {
  kShared,     // the shared expert's token rows [0, shared_rows), one segment; walked once, before the rest
  kMinibatch,  // each minibatch's routed rows (expert segments clipped to it, rows in the macrobatch ring)
};

struct PhaseDesc {
  TaskKind kind;
  int8_t gemm;     // which of the kernel's GEMMs: its descriptors and its n-block groups
  PhaseRows rows;
  int8_t waits;    // counter the producer waits on, for every unit of a tile's rows, before its loads
  int8_t signals;  // counter the consumers add 1 to, per unit, for each n-block they stored
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

template <int N>
constexpr PhaseTable phase_table(const PhaseDesc (&phases)[N]) {
  static_assert(N <= kMaxPhases, "raise kMaxPhases");
  PhaseTable t{};
  t.count = N;
  for (int i = 0; i < N; ++i) t.phase[i] = phases[i];
  while (t.shared_count < N && phases[t.shared_count].rows == PhaseRows::kShared) ++t.shared_count;
  return t;
}

template <int N>
constexpr CommPhaseTable comm_phase_table(const CommPhaseDesc (&phases)[N]) {
  static_assert(N <= kMaxCommPhases, "raise kMaxCommPhases");
  CommPhaseTable t{};
  t.count = N;
  for (int i = 0; i < N; ++i) t.phase[i] = phases[i];
  return t;
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

// Compile-time checks of a kernel's tables: the kShared phases come first; every reference is in range;
// a phase's counters count units of its own rows (token rows for kShared, schedule rows otherwise; the
// communication's are schedule rows); and each counter is signalled by exactly one phase, whose
// contribution per unit is its target: n-blocks of the counter's GEMM from a compute phase of that GEMM,
// 1 from a communication phase.
template <int P, int C, int K>
constexpr bool tables_are_consistent(const PhaseDesc (&phases)[P], const CommPhaseDesc (&comm)[C],
                                     const CounterDesc (&counters)[K], int num_gemms) {
  if (P > kMaxPhases || C > kMaxCommPhases || K > kMaxCounters || num_gemms > kMaxGemms) return false;
  auto counter_ok = [&](int8_t c, CounterUnits units) {
    return c == kNoCounter || (c >= 0 && c < K && counters[c].units == units);
  };
  for (int i = 0; i < P; ++i) {
    const PhaseDesc& p = phases[i];
    if (i > 0 && p.rows == PhaseRows::kShared && phases[i - 1].rows != PhaseRows::kShared) return false;
    if (p.gemm < 0 || p.gemm >= num_gemms) return false;
    const CounterUnits units = p.rows == PhaseRows::kShared ? CounterUnits::kShared : CounterUnits::kCapacity;
    if (!counter_ok(p.waits, units) || !counter_ok(p.signals, units)) return false;
  }
  for (const CommPhaseDesc& p : comm)
    if (!counter_ok(p.waits, CounterUnits::kCapacity) || !counter_ok(p.signals, CounterUnits::kCapacity)) return false;
  for (int c = 0; c < K; ++c) {
    int signallers = 0;
    bool target_ok = true;
    for (const PhaseDesc& p : phases)
      if (p.signals == c) ++signallers, target_ok = target_ok && counters[c].complete_at == p.gemm;
    for (const CommPhaseDesc& p : comm)
      if (p.signals == c) ++signallers, target_ok = target_ok && counters[c].complete_at == kOneTask;
    if (signallers != 1 || !target_ok) return false;
  }
  return true;
}

}  // namespace mok::megakernel
