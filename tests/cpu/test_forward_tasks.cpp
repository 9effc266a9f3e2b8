// CPU tests of the forward megakernel's task order: its tables (src/device/megakernel/forward_tasks.h) walked
// by src/device/megakernel/task_order.h, the same code the GPU runs. For random schedules (empty experts,
// tile_m 64 and 128), n-block counts, CTA pairs and ring / minibatch settings down to forced ring reuse:
//   - every output tile of every phase is handed out exactly once, inside one expert segment, one minibatch
//     and one macrobatch, at its ring row; every unit is copied once by every comm phase
//   - the walk is the documented order (a nested-loop spelling of it, independent of the walker)
//   - dependencies, from the tables alone: with one compute cluster and one communication group taking
//     tasks in ticket order and waiting on the counters as the kernel does, every task runs (no deadlock;
//     with more workers the ticket orders and the waits form the same acyclic graph), every counter ends
//     exactly at its target (no waiter can pass before all its producers), and every access to a ring
//     row's unit happens after every access to the unit that held the row before
//   - broken tables fail these checks and tables_are_consistent
// Plus the timeline's record format (encode / decode at its limits) and its Chrome trace.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "mok/timeline.h"
#include "src/device/megakernel/forward_tasks.h"
#include "src/device/megakernel/task_order.h"
#include "src/device/megakernel/timeline_record.h"
#include "tests/cpu/task_sim.h"

namespace mok::megakernel {
namespace {

namespace fwd = forward;

struct Case {
  std::vector<int32_t> offsets;  // padded segment starts, [experts + 1]
  int32_t scheduled_rows = 0;
  int cluster_n = 1;
  int32_t n_blocks[fwd::kNumGemms] = {};
  TaskOrderShape shape{};                  // shape.expert_row_offsets: see order()
  CounterDesc counters[fwd::kNumCounters] = {};

  Case() { std::copy(std::begin(fwd::kCounters), std::end(fwd::kCounters), counters); }
  // The shape with its pointer into this case's offsets (cases are copied).
  TaskOrderShape order() const {
    TaskOrderShape s = shape;
    s.expert_row_offsets = offsets.data();
    return s;
  }
  std::string describe() const {
    std::string groups;
    for (int g = 0; g < fwd::kNumGemms; ++g) {
      if (g > 0) groups += '/';
      groups += std::to_string(shape.gemm_groups[g]);
    }
    return "experts " + std::to_string(shape.local_experts) + ", rows " + std::to_string(scheduled_rows) +
           ", shared rows " + std::to_string(shape.shared_rows) + ", ring " + std::to_string(shape.ring_rows) +
           ", minibatch " + std::to_string(shape.minibatch_rows) + ", cluster " + std::to_string(cluster_n) +
           ", n-block groups " + groups;
  }
};

// The forward's tables over a schedule.
Case make_case(std::vector<int32_t> offsets, int32_t shared_rows, int32_t ring_rows, int32_t minibatch_rows,
               const int32_t (&n_blocks)[fwd::kNumGemms], int cluster_n) {
  Case c;
  c.offsets = std::move(offsets);
  c.scheduled_rows = c.offsets.back();
  c.cluster_n = cluster_n;
  std::copy(std::begin(n_blocks), std::end(n_blocks), c.n_blocks);
  c.shape = fwd::task_order(c.offsets.data(), int(c.offsets.size()) - 1, shared_rows, ring_rows, minibatch_rows,
                            n_blocks, cluster_n);
  return c;
}

Case random_case(std::mt19937& rng, int32_t ring_rows, int32_t minibatch_rows) {
  const int experts = std::uniform_int_distribution<int>(1, 12)(rng);
  const int tile_m = rng() % 2 ? 64 : 128;
  std::vector<int32_t> offsets = {0};
  for (int e = 0; e < experts; ++e) {
    const int count = rng() % 4 == 0 ? 0 : std::uniform_int_distribution<int>(1, 700)(rng);
    offsets.push_back(offsets.back() + (count + tile_m - 1) / tile_m * tile_m);
  }
  const int32_t shared_rows = rng() % 3 == 0 ? 0 : 64 * std::uniform_int_distribution<int>(1, 20)(rng);
  const int32_t scheduled = offsets.back();
  ring_rows = ring_rows > 0 ? ring_rows : std::max<int32_t>(128, (scheduled + 127) / 128 * 128);
  const int cluster_n = rng() % 2 ? 2 : 1;
  int32_t n_blocks[fwd::kNumGemms];
  for (int32_t& n : n_blocks) n = cluster_n * std::uniform_int_distribution<int>(1, 3)(rng);
  return make_case(std::move(offsets), shared_rows, ring_rows, minibatch_rows, n_blocks, cluster_n);
}

const PhaseDesc& phase_of(const Case& c, const ComputeTask& t) { return c.shape.phases.phase[t.phase]; }
bool routed(const Case& c, const ComputeTask& t) { return phase_of(c, t).rows == PhaseRows::kMinibatch; }
const CommPhaseDesc& phase_of(const Case& c, const CommTask& t) { return c.shape.comm_phases.phase[t.phase]; }

using task_sim::Walked;

Walked walk(const Case& c) { return task_sim::walk<ComputeWalker>(c.order(), c.scheduled_rows); }

void check_coverage(const Case& c, const Walked& w) {
  const TaskOrderShape& s = c.shape;
  const int32_t units = c.scheduled_rows / kUnitRows, shared_units = s.shared_rows / kUnitRows;
  // (phase, unit, group) -> slot of the task covering it.
  std::map<std::tuple<int, int32_t, int32_t>, int32_t> covered;
  for (int32_t slot = 0; slot < int32_t(w.compute.size()); ++slot) {
    const ComputeTask& t = w.compute[slot];
    ASSERT_TRUE(t.phase >= 0 && t.phase < s.phases.count) << "slot " << slot;
    ASSERT_TRUE(t.rows == 64 || t.rows == 128) << "slot " << slot;
    ASSERT_EQ(t.row % kUnitRows, 0) << "slot " << slot;
    const std::vector<int32_t> shared_offsets = {0, s.shared_rows};
    const std::vector<int32_t>& offsets = routed(c, t) ? c.offsets : shared_offsets;
    ASSERT_TRUE(t.expert >= 0 && t.expert + 1 < int32_t(offsets.size())) << "slot " << slot;
    ASSERT_GE(t.row, offsets[t.expert]) << "slot " << slot << ": tile starts before its expert's segment";
    ASSERT_LE(t.row + t.rows, offsets[t.expert + 1]) << "slot " << slot << ": tile leaves its expert's segment";
    if (routed(c, t)) {
      ASSERT_EQ(t.row / s.ring_rows, (t.row + t.rows - 1) / s.ring_rows) << "slot " << slot << ": crosses a macrobatch";
      // Minibatches start at the macrobatch's first row.
      ASSERT_EQ(t.row % s.ring_rows / s.minibatch_rows, (t.row + t.rows - 1) % s.ring_rows / s.minibatch_rows)
          << "slot " << slot << ": crosses a minibatch";
      ASSERT_EQ(t.buffer_row, t.row % s.ring_rows) << "slot " << slot;
    } else {
      ASSERT_EQ(t.buffer_row, t.row) << "slot " << slot;
    }
    ASSERT_LT(t.n_group, s.gemm_groups[phase_of(c, t).gemm]) << "slot " << slot;
    for (int32_t u = t.row / kUnitRows; u * kUnitRows < t.row + t.rows; ++u) {
      const auto key = std::make_tuple(t.phase, u, t.n_group);
      ASSERT_EQ(covered.count(key), 0u) << "slot " << slot << ": unit " << u << " group " << t.n_group << " twice";
      covered[key] = slot;
    }
  }
  int64_t expected = 0;
  for (int i = 0; i < s.phases.count; ++i)
    expected += int64_t(s.phases.phase[i].rows == PhaseRows::kShared ? shared_units : units) *
                s.gemm_groups[s.phases.phase[i].gemm];
  ASSERT_EQ(int64_t(covered.size()), expected) << "some (unit, n-block group) of some phase is never computed";
  // Every comm phase copies every unit once.
  task_sim::check_comm_coverage(s, w, units, "some unit is never copied");
}

// The compute and communication orders as documented (task_order.h), spelled as nested loops.
Walked reference_order(const Case& c) {
  const TaskOrderShape& s = c.shape;
  Walked w;
  auto add_tiles = [&](int phase, int32_t expert, int32_t begin, int32_t end, bool ring) {
    for (int32_t g = 0; g < s.gemm_groups[s.phases.phase[phase].gemm]; ++g)
      for (int32_t row = begin; row < end; row += kTileRows)
        w.compute.push_back({.phase = phase, .row = row, .buffer_row = ring ? row % s.ring_rows : row,
                             .rows = std::min(kTileRows, end - row), .n_group = g, .expert = expert});
  };
  for (int p = 0; p < s.phases.count; ++p)
    if (s.phases.phase[p].rows == PhaseRows::kShared && s.shared_rows > 0) add_tiles(p, 0, 0, s.shared_rows, false);
  const int32_t macrobatches = (c.scheduled_rows + s.ring_rows - 1) / s.ring_rows;
  for (int32_t m = macrobatches - 1; m >= 0; --m) {
    const int32_t first = m * s.ring_rows, last = std::min(c.scheduled_rows, first + s.ring_rows);
    for (int32_t lo = first; lo < last; lo += s.minibatch_rows) {
      const int32_t hi = std::min(last, lo + s.minibatch_rows);
      for (int p = 0; p < s.phases.count; ++p) {
        if (s.phases.phase[p].rows != PhaseRows::kMinibatch) continue;
        for (int32_t e = 0; e < s.local_experts; ++e) {
          const int32_t begin = std::max(lo, c.offsets[e]), end = std::min(hi, c.offsets[e + 1]);
          if (begin < end) add_tiles(p, e, begin, end, true);
        }
      }
    }
    for (int p = 0; p < s.comm_phases.count; ++p)
      for (int32_t u = first / kUnitRows; u < last / kUnitRows; ++u) w.comm.push_back({.phase = p, .unit = u});
  }
  return w;
}

void check_order(const Case& c, const Walked& w) {
  const Walked want = reference_order(c);
  for (size_t i = 0; i < std::min(w.compute.size(), want.compute.size()); ++i) {
    const ComputeTask &a = w.compute[i], &b = want.compute[i];
    ASSERT_TRUE(a.phase == b.phase && a.row == b.row && a.buffer_row == b.buffer_row && a.rows == b.rows &&
                a.n_group == b.n_group && a.expert == b.expert)
        << "compute slot " << i << ": walked phase " << a.phase << " row " << a.row << " rows " << a.rows
        << " group " << a.n_group << " expert " << a.expert << ", documented phase " << b.phase << " row " << b.row
        << " rows " << b.rows << " group " << b.n_group << " expert " << b.expert;
  }
  ASSERT_EQ(w.compute.size(), want.compute.size()) << "compute tasks";
  for (size_t i = 0; i < std::min(w.comm.size(), want.comm.size()); ++i)
    ASSERT_TRUE(w.comm[i].phase == want.comm[i].phase && w.comm[i].unit == want.comm[i].unit)
        << "comm slot " << i << ": walked phase " << w.comm[i].phase << " unit " << w.comm[i].unit
        << ", documented phase " << want.comm[i].phase << " unit " << want.comm[i].unit;
  ASSERT_EQ(w.comm.size(), want.comm.size()) << "comm tasks";
}

// The dependency checks of the file comment, from the case's tables; "" when they hold, else the first
// violation.
std::string dependency_error(const Case& c, const Walked& w) {
  const TaskOrderShape& s = c.shape;
  const int64_t units = c.scheduled_rows / kUnitRows, shared_units = s.shared_rows / kUnitRows;
  const int64_t capacity_units = units + 3;  // units past the schedule must stay untouched
  std::vector<uint64_t> words(counter_words(c.counters, capacity_units, shared_units), 0);
  const CounterArrays counters =
      resolve_counters(c.counters, words.data(), capacity_units, shared_units, c.n_blocks);
  auto word_of = [&](int8_t counter, int64_t unit) { return counters.base[counter] + unit - words.data(); };

  // Tasks: compute slot i is task i, comm slot q is task compute.size() + q. Each waits on a list of counter
  // words (each at its counter's target) and adds to a list of words.
  struct Task : task_sim::SimTask {
    std::vector<int64_t> ring_units;  // units whose ring rows it touches
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < w.compute.size(); ++i) {
    const ComputeTask& t = w.compute[i];
    const PhaseDesc& p = phase_of(c, t);
    Task task;
    task.name = "compute slot " + std::to_string(i) + " (" + task_kind_name(p.kind) + ", row " +
                std::to_string(t.row) + ")";
    // Each CTA of the cluster stores its own n-block; each consumer warpgroup counts its 64 rows.
    for (int32_t u = t.row / kUnitRows; u * kUnitRows < t.row + t.rows; ++u) {
      if (p.waits != kNoCounter) task.waits.push_back({word_of(p.waits, u), counters.target[p.waits]});
      if (p.signals != kNoCounter) task.adds.push_back({word_of(p.signals, u), uint64_t(c.cluster_n)});
      if (p.rows == PhaseRows::kMinibatch) task.ring_units.push_back(u);
    }
    tasks.push_back(task);
  }
  const int64_t ring_units = s.ring_rows / kUnitRows;
  for (size_t q = 0; q < w.comm.size(); ++q) {
    const CommTask& t = w.comm[q];
    const CommPhaseDesc& p = phase_of(c, t);
    Task task;
    task.name = "comm slot " + std::to_string(q) + " (" + task_kind_name(p.kind) + ", unit " + std::to_string(t.unit) + ")";
    const int64_t unit = p.wait_unit == CommWait::kRingPrevious ? t.unit + ring_units : t.unit;
    if (p.waits != kNoCounter && unit < units) task.waits.push_back({word_of(p.waits, unit), counters.target[p.waits]});
    if (p.signals != kNoCounter) task.adds.push_back({word_of(p.signals, t.unit), 1});
    task.ring_units.push_back(t.unit);
    tasks.push_back(task);
  }

  // One worker per order, in ticket order (tests/cpu/task_sim.h).
  const size_t n = tasks.size();
  task_sim::Ancestry ancestry;
  const std::string deadlock = task_sim::simulate(tasks, w.compute.size(), words, ancestry, [](size_t) {});
  if (!deadlock.empty()) return deadlock;

  for (int i = 0; i < fwd::kNumCounters; ++i) {
    const int64_t in_use = c.counters[i].units == CounterUnits::kCapacity ? units : shared_units;
    const int64_t all = counter_units(c.counters[i].units, capacity_units, shared_units);
    for (int64_t u = 0; u < all; ++u) {
      const uint64_t want = u < in_use ? counters.target[i] : 0;
      if (counters.base[i][u] != want)
        return std::string("counter ") + std::to_string(int(c.counters[i].id)) + " unit " + std::to_string(u) +
               " ends at " + std::to_string(counters.base[i][u]) + ", target " + std::to_string(want);
    }
  }

  std::vector<std::vector<size_t>> touching(units);
  for (size_t id = 0; id < n; ++id)
    for (int64_t u : tasks[id].ring_units) touching[u].push_back(id);
  for (int64_t u = 0; u + ring_units < units; ++u)
    for (size_t later : touching[u])
      for (size_t earlier : touching[u + ring_units])
        if (!ancestry.ran_before(later, earlier))
          return "ring rows of unit " + std::to_string(u) + ": " + tasks[later].name + " may run before " +
                 tasks[earlier].name + " (unit " + std::to_string(u + ring_units) + ") is done with them";
  return "";
}

void check_case(const Case& c) {
  SCOPED_TRACE(c.describe());
  const Walked w = walk(c);
  check_coverage(c, w);
  if (::testing::Test::HasFatalFailure()) return;
  check_order(c, w);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(dependency_error(c, w), "");
}

TEST(ForwardTasksTest, RandomSchedulesAcrossRingsAndMinibatches) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial)
    for (int32_t ring : {0, 128, 256, 384, 1024})
      for (int32_t minibatch : {128, 256, 640, 4096}) {
        const Case c = random_case(rng, ring, minibatch);
        check_case(c);
        if (::testing::Test::HasFatalFailure()) return;
      }
}

TEST(ForwardTasksTest, NoRowsLeavesOnlyTheSharedExpert) {
  // e.g. after a capacity overflow
  const Case c = make_case({0, 0, 0}, 192, 128, 128, {4, 6, 4, 6}, 2);
  const Walked w = walk(c);
  EXPECT_TRUE(w.comm.empty());
  ASSERT_EQ(w.compute.size(), size_t(2 * 2 + 2 * 3));  // tiles of 128 and 64 rows, per group
  for (const ComputeTask& t : w.compute) EXPECT_FALSE(routed(c, t));
  check_case(c);
}

TEST(ForwardTasksTest, MacrobatchesAreWalkedLastToFirst) {
  const Case c = make_case({0, 640}, 0, 256, 128, {1, 1, 1, 1}, 1);
  const Walked w = walk(c);
  // Macrobatches [512, 640), [256, 512), [0, 256): the first gate/up tile is the last macrobatch's, and
  // the context keeps macrobatch 0, so the last routed tile is in it.
  ASSERT_FALSE(w.compute.empty());
  EXPECT_EQ(w.compute.front().row, 512);
  EXPECT_LT(w.compute.back().row, 256);
  EXPECT_EQ(w.comm.front().unit, 8);  // the first unit of the last macrobatch
  check_case(c);
}

// The forward's tables pass the compile-time checks; tables that break each rule do not.
TEST(ForwardTasksTest, TableChecksRejectInconsistentTables) {
  EXPECT_TRUE(tables_are_consistent(fwd::kPhases, fwd::kCommPhases, fwd::kCounters, fwd::kNumGemms));
  auto phases_with = [](int i, auto change) {
    PhaseDesc p[std::size(fwd::kPhases)];
    std::copy(std::begin(fwd::kPhases), std::end(fwd::kPhases), p);
    change(p[i]);
    return tables_are_consistent(p, fwd::kCommPhases, fwd::kCounters, fwd::kNumGemms);
  };
  EXPECT_FALSE(phases_with(3, [](PhaseDesc& p) { p.rows = PhaseRows::kShared; })) << "a shared phase after a routed one";
  EXPECT_FALSE(phases_with(2, [](PhaseDesc& p) { p.waits = fwd::kSharedHiddenReady; })) << "a counter of token rows";
  EXPECT_FALSE(phases_with(0, [](PhaseDesc& p) { p.gemm = fwd::kNumGemms; })) << "no such GEMM";
  EXPECT_FALSE(phases_with(3, [](PhaseDesc& p) { p.signals = fwd::kHiddenReady; })) << "two signallers";
  EXPECT_FALSE(phases_with(3, [](PhaseDesc& p) { p.signals = kNoCounter; })) << "a counter nobody signals";
  EXPECT_FALSE(phases_with(2, [](PhaseDesc& p) { p.gemm = fwd::kSharedGateUpGemm; }))
      << "hidden_ready completes at the n-blocks of a GEMM that does not store it";
  CommPhaseDesc comm[std::size(fwd::kCommPhases)];
  std::copy(std::begin(fwd::kCommPhases), std::end(fwd::kCommPhases), comm);
  comm[0].signals = fwd::kRowsCombined;
  EXPECT_FALSE(tables_are_consistent(fwd::kPhases, comm, fwd::kCounters, fwd::kNumGemms)) << "two signallers";
  CounterDesc counters[fwd::kNumCounters];
  std::copy(std::begin(fwd::kCounters), std::end(fwd::kCounters), counters);
  counters[fwd::kRowsArrived].complete_at = fwd::kExpertGateUpGemm;
  EXPECT_FALSE(tables_are_consistent(fwd::kPhases, fwd::kCommPhases, counters, fwd::kNumGemms))
      << "a copy's counter completing at n-blocks";
}

// Tables that pass the compile-time checks but order or wait wrongly fail the dependency checks.
TEST(ForwardTasksTest, DependencyChecksCatchBrokenOrders) {
  // Two macrobatches, the ring reused, 2 n-blocks per GEMM.
  const Case base = make_case({0, 192, 512}, 128, 256, 128, {2, 2, 2, 2}, 1);
  ASSERT_EQ(dependency_error(base, walk(base)), "");

  auto expect_error = [](const Case& c, const std::string& needle, const char* what) {
    const std::string error = dependency_error(c, walk(c));
    EXPECT_NE(error.find(needle), std::string::npos) << what << ": got \"" << error << "\"";
  };
  Case down_first = base;
  std::swap(down_first.shape.phases.phase[2], down_first.shape.phases.phase[3]);
  expect_error(down_first, "deadlock", "per minibatch, down tiles before the gate/up tiles they read");

  Case combine_first = base;
  std::swap(combine_first.shape.comm_phases.phase[0], combine_first.shape.comm_phases.phase[1]);
  expect_error(combine_first, "deadlock", "per macrobatch, combines before the dispatches of their rows");

  Case own_unit = base;
  own_unit.shape.comm_phases.phase[0].wait_unit = CommWait::kUnit;
  expect_error(own_unit, "deadlock", "a dispatch that waits for its own combine");

  Case no_ring_wait = base;
  no_ring_wait.shape.comm_phases.phase[0].waits = kNoCounter;
  expect_error(no_ring_wait, "ring rows of unit", "a dispatch that overwrites ring rows without waiting for them");

  Case early_target = base;
  early_target.counters[fwd::kHiddenReady].complete_at = kOneTask;
  expect_error(early_target, "ends at 2, target 1", "hidden_ready complete after one of its two n-blocks");
}

bool same_record(const TaskRecord& a, const TaskRecord& b) {
  return a.cta == b.cta && a.sm == b.sm && a.kind == b.kind && a.row == b.row && a.rows == b.rows &&
         a.n_block == b.n_block && a.expert == b.expert && a.start_ns == b.start_ns && a.end_ns == b.end_ns;
}

std::string describe(const TaskRecord& r) {
  return "cta " + std::to_string(r.cta) + " sm " + std::to_string(r.sm) + " kind " + std::to_string(int(r.kind)) +
         " row " + std::to_string(r.row) + " rows " + std::to_string(r.rows) + " n-block " + std::to_string(r.n_block) +
         " expert " + std::to_string(r.expert) + " start " + std::to_string(r.start_ns) + " end " +
         std::to_string(r.end_ns);
}

// The record format (src/device/megakernel/timeline_record.h): every field survives encode / decode at
// its limits, the words are the documented layout, and an out-of-range field is truncated alone.
TEST(ForwardTasksTest, TimelineRecordsRoundTripAtTheirLimits) {
  std::mt19937_64 rng(11);
  const uint64_t kMaxNs = std::numeric_limits<uint64_t>::max();
  const int32_t kMaxInt = std::numeric_limits<int32_t>::max();
  auto pick = [&](int64_t limit) { return rng() % 3 == 0 ? 0 : rng() % 3 == 0 ? limit : int64_t(rng() % (limit + 1)); };
  for (int trial = 0; trial < 2000; ++trial) {
    const TaskRecord r{.cta = int32_t(pick(kMaxInt)),
                       .sm = int32_t(pick(65535)),
                       .kind = TaskKind(rng() % (int(TaskKind::kNone) + 1)),
                       .row = int32_t(pick(kMaxInt)),
                       .rows = int32_t(pick(255)),
                       .n_block = int32_t(pick(65535)),
                       .expert = int32_t(pick(65535)),
                       .start_ns = rng() % 3 == 0 ? kMaxNs : rng(),
                       .end_ns = rng() % 3 == 0 ? kMaxNs : rng()};
    uint64_t words[kTimelineRecordWords + 1];
    words[kTimelineRecordWords] = 0x5a5a5a5a5a5a5a5aull;  // a canary past the record
    encode_task_record(r, words);
    const TaskRecord back = decode_task_record(words);
    ASSERT_TRUE(same_record(r, back)) << "trial " << trial << ": " << describe(r) << " came back as " << describe(back);
    ASSERT_EQ(words[kTimelineRecordWords], 0x5a5a5a5a5a5a5a5aull) << "trial " << trial << ": wrote past the record";
  }
  uint64_t words[kTimelineRecordWords];
  encode_task_record({.cta = 7, .sm = 3, .kind = TaskKind::kCombine, .row = 128, .rows = 64, .n_block = 2,
                      .expert = 9, .start_ns = 1000, .end_ns = 2000},
                     words);
  EXPECT_EQ(words[0], 1000u);
  EXPECT_EQ(words[1], 2000u);
  EXPECT_EQ(words[2], uint64_t(TaskKind::kCombine) | 64ull << 8 | 3ull << 16 | 7ull << 32);
  EXPECT_EQ(words[3], 128ull | 2ull << 32 | 9ull << 48);
  encode_task_record({.cta = 1, .sm = 2, .kind = TaskKind::kDispatch, .row = 3, .rows = 256 + 64, .n_block = 65536 + 5,
                      .expert = 4},
                     words);
  const TaskRecord truncated = decode_task_record(words);
  EXPECT_TRUE(truncated.rows == 64 && truncated.n_block == 5 && truncated.cta == 1 && truncated.sm == 2 &&
              truncated.kind == TaskKind::kDispatch && truncated.row == 3 && truncated.expert == 4)
      << describe(truncated);
  EXPECT_EQ(timeline_record_offset(0), kTimelineRecordWords);  // word 0 of a track's block is its count
  EXPECT_EQ(timeline_block_words(5), 6 * kTimelineRecordWords);
  // Per CTA its GEMM track's block, then its copy track's.
  EXPECT_EQ(timeline_block_offset(0, kCopyTrack, 5), 6 * kTimelineRecordWords);
  EXPECT_EQ(timeline_block_offset(3, kGemmTrack, 5), 3 * 2 * 6 * kTimelineRecordWords);
  EXPECT_EQ(timeline_words(3, 5), timeline_block_offset(3, kGemmTrack, 5));
}

// The timeline's Chrome trace: every record one complete event on its CTA's GEMM or copy track, times in
// microseconds from the first start, and a name for each track.
TEST(ForwardTasksTest, ChromeTraceHasOneEventPerRecordOnItsTrack) {
  const std::vector<TaskRecord> records = {
      {.cta = 0, .sm = 3, .kind = TaskKind::kDispatch, .row = 64, .rows = 64, .start_ns = 1000, .end_ns = 4000},
      {.cta = 1, .sm = 5, .kind = TaskKind::kExpertGateUp, .row = 128, .rows = 128, .n_block = 2, .expert = 7,
       .start_ns = 2000, .end_ns = 9500},
      {.cta = 1, .sm = 5, .kind = TaskKind::kCombine, .row = 64, .rows = 64, .start_ns = 3000, .end_ns = 3500}};
  const std::string json = chrome_trace_json(records, 1);
  auto count = [&](const std::string& needle) {
    int n = 0;
    for (size_t at = json.find(needle); at != std::string::npos; at = json.find(needle, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("\"ph\": \"X\""), 3);
  EXPECT_EQ(count("\"ph\": \"M\""), 4);  // two tracks for each of CTAs 0 and 1
  EXPECT_NE(json.find("{\"name\": \"dispatch\", \"ph\": \"X\", \"pid\": 1, \"tid\": 1, \"ts\": 0.000, \"dur\": 3.000"),
            std::string::npos) << json;
  EXPECT_NE(json.find("{\"name\": \"expert gate/up\", \"ph\": \"X\", \"pid\": 1, \"tid\": 2, \"ts\": 1.000, \"dur\": 7.500"),
            std::string::npos) << json;
  EXPECT_NE(json.find("\"tid\": 3, \"ts\": 2.000"), std::string::npos) << json;  // CTA 1's copies
  EXPECT_NE(json.find("\"name\": \"CTA 1 copies\""), std::string::npos) << json;
}

}  // namespace
}  // namespace mok::megakernel
