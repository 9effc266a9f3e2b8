// CPU tests of the backward megakernel's task order: its tables (src/device/megakernel/backward_tasks.h) walked
// by src/device/megakernel/task_order.h's BackwardWalker, the same code the GPU runs. For random schedules
// (empty experts at the start, middle and end, one expert with every row, no scheduled rows, tile_m 64 and
// 128), n-block and m-block counts, CTA pairs, minibatches down to 128 rows, recompute_from 0 / mid /
// capacity, each phase variant, with and without a shared expert:
//   - coverage: every row tile of every row GEMM exactly once inside one segment and one minibatch (the
//     recompute: only rows at or past recompute_from); every weight-gradient tile (expert x m-block x
//     n-block group) exactly once for every expert, empty ones too, over its clipped segment; the shared
//     expert's tiles once; every unit pulled once and pushed once
//   - the walk is the documented order (a nested-loop spelling of it, independent of the walker)
//   - dependencies, from the tables alone: one compute worker and one communication group taking tasks in
//     ticket order and waiting on the counters as the kernels do finish every task (no deadlock), every
//     counter ends exactly at its target, every weight-gradient tile starts only once every unit of its
//     segment is complete in the dgrad counter, and (data flow, spelled from src/host/moe_backward.cu
//     independently of the tables) every task runs after every task that writes what it reads
//   - broken tables fail these checks and tables_are_consistent
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "mok/status.h"
#include "mok/timeline.h"
#include "src/device/megakernel/backward_tasks.h"
#include "src/device/megakernel/task_order.h"
#include "tests/cpu/backward_task_sim.h"

namespace mok::megakernel {
namespace {

namespace bwd = backward;
using task_sim::Case;
using task_sim::clipped;
using task_sim::dependency_error;
using task_sim::make_case;
using task_sim::phase_of;
using task_sim::random_case;
using task_sim::walk;
using task_sim::Walked;

void check_coverage(const Case& c, const Walked& w) {
  const TaskOrderShape& s = c.shape;
  const int32_t units = c.scheduled_rows / kUnitRows, shared_units = s.shared_rows / kUnitRows;
  const int32_t experts = s.local_experts;
  ASSERT_GE(s.ring_rows, c.capacity) << "one macrobatch";
  std::map<std::tuple<int, int32_t, int32_t, int32_t>, int32_t> covered;  // (phase, unit or expert, m-block, group)
  for (int32_t slot = 0; slot < int32_t(w.compute.size()); ++slot) {
    const ComputeTask& t = w.compute[slot];
    ASSERT_TRUE(t.phase >= 0 && t.phase < s.phases.count) << "slot " << slot;
    const PhaseDesc& p = phase_of(c, t);
    ASSERT_LT(t.n_group, s.gemm_groups[p.gemm]) << "slot " << slot;
    ASSERT_EQ(t.buffer_row, t.row) << "slot " << slot << ": the backward's buffers hold every row";
    if (weight_grad_tiles(p.rows)) {
      const bool shared = p.rows == PhaseRows::kSharedTail;
      ASSERT_TRUE(t.expert >= 0 && t.expert < (shared ? 1 : experts)) << "slot " << slot;
      const int32_t begin = shared ? 0 : clipped(c, c.offsets[t.expert]);
      const int32_t end = shared ? s.shared_rows : clipped(c, c.offsets[t.expert + 1]);
      ASSERT_TRUE(t.row == begin && t.rows == end - begin) << "slot " << slot << ": not the expert's clipped segment";
      ASSERT_LT(t.m_block, s.gemm_m_blocks[p.gemm]) << "slot " << slot;
      const auto key = std::make_tuple(t.phase, t.expert, t.m_block, t.n_group);
      ASSERT_EQ(covered.count(key), 0u) << "slot " << slot << ": weight-gradient tile twice";
      covered[key] = slot;
      continue;
    }
    ASSERT_TRUE(t.rows == 64 || t.rows == 128) << "slot " << slot;
    ASSERT_EQ(t.row % kUnitRows, 0) << "slot " << slot;
    ASSERT_EQ(t.m_block, 0) << "slot " << slot;
    const std::vector<int32_t> shared_offsets = {0, s.shared_rows};
    const std::vector<int32_t>& offsets = token_rows(p.rows) ? shared_offsets : c.offsets;
    ASSERT_TRUE(t.expert >= 0 && t.expert + 1 < int32_t(offsets.size())) << "slot " << slot;
    ASSERT_GE(t.row, offsets[t.expert]) << "slot " << slot << ": tile starts before its expert's segment";
    ASSERT_LE(t.row + t.rows, offsets[t.expert + 1]) << "slot " << slot << ": tile leaves its expert's segment";
    if (!token_rows(p.rows)) {
      ASSERT_LE(t.row + t.rows, c.scheduled_rows) << "slot " << slot;
      ASSERT_EQ(t.row / s.minibatch_rows, (t.row + t.rows - 1) / s.minibatch_rows) << "slot " << slot << ": crosses a minibatch";
    }
    if (p.rows == PhaseRows::kMinibatchFrom) {
      ASSERT_GE(t.row, s.recompute_from) << "slot " << slot << ": a kept row";
    }
    for (int32_t u = t.row / kUnitRows; u * kUnitRows < t.row + t.rows; ++u) {
      const auto key = std::make_tuple(t.phase, u, 0, t.n_group);
      ASSERT_EQ(covered.count(key), 0u) << "slot " << slot << ": unit " << u << " group " << t.n_group << " twice";
      covered[key] = slot;
    }
  }
  int64_t expected = 0;
  for (int i = 0; i < s.phases.count; ++i) {
    const PhaseDesc& p = s.phases.phase[i];
    const int64_t groups = s.gemm_groups[p.gemm], m = s.gemm_m_blocks[p.gemm];
    switch (p.rows) {
      case PhaseRows::kShared: expected += shared_units * groups; break;
      case PhaseRows::kMinibatch: expected += units * groups; break;
      case PhaseRows::kMinibatchFrom: expected += std::max(0, units - s.recompute_from / kUnitRows) * groups; break;
      case PhaseRows::kEndingExperts: expected += experts * m * groups; break;
      case PhaseRows::kSharedTail: expected += (s.shared_rows > 0 ? 1 : 0) * m * groups; break;
    }
  }
  ASSERT_EQ(int64_t(covered.size()), expected) << "some tile of some phase is never computed";
  task_sim::check_comm_coverage(s, w, units, "some unit is never pulled or pushed");
}

// The compute and communication orders as documented (task_order.h, backward_tasks.h), as nested loops.
Walked reference_order(const Case& c) {
  const TaskOrderShape& s = c.shape;
  Walked w;
  auto add_rows = [&](int phase, int32_t expert, int32_t begin, int32_t end) {
    for (int32_t g = 0; g < s.gemm_groups[s.phases.phase[phase].gemm]; ++g)
      for (int32_t row = begin; row < end; row += kTileRows)
        w.compute.push_back({.phase = phase, .row = row, .buffer_row = row, .rows = std::min(kTileRows, end - row),
                             .n_group = g, .expert = expert, .m_block = 0});
  };
  auto add_grads = [&](int phase, int32_t expert, int32_t begin, int32_t end) {
    const int gemm = s.phases.phase[phase].gemm;
    for (int32_t g = 0; g < s.gemm_groups[gemm]; ++g)
      for (int32_t m = 0; m < s.gemm_m_blocks[gemm]; ++m)
        w.compute.push_back({.phase = phase, .row = begin, .buffer_row = begin, .rows = end - begin, .n_group = g,
                             .expert = expert, .m_block = m});
  };
  auto rows_of = [&](int p) { return s.phases.phase[p].rows; };
  for (int p = 0; p < s.phases.count; ++p)
    if (rows_of(p) == PhaseRows::kShared && s.shared_rows > 0) add_rows(p, 0, 0, s.shared_rows);
  for (int p = 0; p < s.phases.count; ++p)  // experts that end at row 0
    for (int32_t e = 0; e < s.local_experts && rows_of(p) == PhaseRows::kEndingExperts; ++e)
      if (clipped(c, c.offsets[e + 1]) == 0) add_grads(p, e, 0, 0);
  for (int32_t lo = 0; lo < c.scheduled_rows; lo += s.minibatch_rows) {
    const int32_t hi = std::min(c.scheduled_rows, lo + s.minibatch_rows);
    for (int p = 0; p < s.phases.count; ++p)
      for (int32_t e = 0; e < s.local_experts; ++e) {
        const int32_t first = rows_of(p) == PhaseRows::kMinibatchFrom ? std::max(lo, s.recompute_from) : lo;
        const int32_t begin = std::max(first, c.offsets[e]), end = std::min(hi, c.offsets[e + 1]);
        if ((rows_of(p) == PhaseRows::kMinibatch || rows_of(p) == PhaseRows::kMinibatchFrom) && begin < end)
          add_rows(p, e, begin, end);
        const int32_t segment_end = clipped(c, c.offsets[e + 1]);
        if (rows_of(p) == PhaseRows::kEndingExperts && lo < segment_end && segment_end <= hi)
          add_grads(p, e, clipped(c, c.offsets[e]), segment_end);
      }
  }
  for (int p = 0; p < s.phases.count; ++p)
    if (rows_of(p) == PhaseRows::kSharedTail && s.shared_rows > 0) add_grads(p, 0, 0, s.shared_rows);
  for (int p = 0; p < s.comm_phases.count; ++p)
    for (int32_t u = 0; u < c.scheduled_rows / kUnitRows; ++u) w.comm.push_back({.phase = p, .unit = u});
  return w;
}

void check_order(const Case& c, const Walked& w) {
  const Walked want = reference_order(c);
  for (size_t i = 0; i < std::min(w.compute.size(), want.compute.size()); ++i) {
    const ComputeTask &a = w.compute[i], &b = want.compute[i];
    ASSERT_TRUE(a.phase == b.phase && a.row == b.row && a.buffer_row == b.buffer_row && a.rows == b.rows &&
                a.n_group == b.n_group && a.expert == b.expert && a.m_block == b.m_block)
        << "compute slot " << i << ": walked phase " << a.phase << " row " << a.row << " rows " << a.rows << " group "
        << a.n_group << " m-block " << a.m_block << " expert " << a.expert << ", documented phase " << b.phase
        << " row " << b.row << " rows " << b.rows << " group " << b.n_group << " m-block " << b.m_block << " expert "
        << b.expert;
  }
  ASSERT_EQ(w.compute.size(), want.compute.size()) << "compute tasks";
  for (size_t i = 0; i < std::min(w.comm.size(), want.comm.size()); ++i)
    ASSERT_TRUE(w.comm[i].phase == want.comm[i].phase && w.comm[i].unit == want.comm[i].unit) << "comm slot " << i;
  ASSERT_EQ(w.comm.size(), want.comm.size()) << "comm tasks";
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

TEST(BackwardTasksTest, RandomSchedulesAcrossVariantsAndMinibatches) {
  std::mt19937 rng(15);
  for (int trial = 0; trial < 40; ++trial)
    for (int variant = 0; variant < 3; ++variant)
      for (int32_t minibatch : {128, 256, 640, 4096}) {
        const Case c = random_case(rng, variant, minibatch);
        check_case(c);
        if (::testing::Test::HasFatalFailure()) return;
      }
}

TEST(BackwardTasksTest, ExpertsWithoutRowsGetTheirWeightGradientsFirst) {
  // Experts 0 and 1 end at row 0, expert 3 (empty) at 256 = the end of minibatch 1, expert 5 (empty) at the end.
  const Case c = make_case({0, 0, 0, 256, 256, 448, 448}, 448, 448, 64, 128, 0, 1, 0, 0, true, true);
  const Walked w = walk(c);
  check_case(c);
  std::vector<std::pair<int32_t, int32_t>> grads;  // (expert, slot) of the first down wgrad tile of each expert
  for (int32_t slot = 0; slot < int32_t(w.compute.size()); ++slot)
    if (phase_of(c, w.compute[slot]).kind == TaskKind::kExpertDownWgrad &&
        (grads.empty() || grads.back().first != w.compute[slot].expert))
      grads.push_back({w.compute[slot].expert, slot});
  ASSERT_EQ(grads.size(), 6u);
  for (int e = 0; e < 6; ++e) ASSERT_EQ(grads[e].first, e);
  // Experts 0 and 1 right after the shared phases (recompute, down dgrad, gate/up dgrad: one 64-row tile per group).
  const int32_t shared_tiles = c.shape.gemm_groups[bwd::kSharedRecompute] + c.shape.gemm_groups[bwd::kSharedDownDgrad] +
                               c.shape.gemm_groups[bwd::kSharedGateUpDgrad];
  EXPECT_EQ(grads[0].second, shared_tiles);
  EXPECT_EQ(w.compute[grads[0].second].rows, 0);
  // Experts 2 and 3 after the gate/up dgrad tiles of minibatch [128, 256), before anything of [256, 384);
  // expert 5 after the last gate/up dgrad tile.
  auto slots_of = [&](TaskKind kind, auto pick) {
    std::vector<int32_t> found;
    for (int32_t slot = 0; slot < int32_t(w.compute.size()); ++slot)
      if (phase_of(c, w.compute[slot]).kind == kind && pick(w.compute[slot])) found.push_back(slot);
    return found;
  };
  const auto dgrad_256 = slots_of(TaskKind::kExpertGateUpDgrad, [](const ComputeTask& t) { return t.row < 256; });
  const auto past_256 = slots_of(TaskKind::kExpertRecompute, [](const ComputeTask& t) { return t.row >= 256; });
  const auto dgrads = slots_of(TaskKind::kExpertGateUpDgrad, [](const ComputeTask&) { return true; });
  ASSERT_FALSE(dgrad_256.empty() || past_256.empty());
  EXPECT_TRUE(dgrad_256.back() < grads[2].second && grads[3].second < past_256.front());
  EXPECT_GT(grads[5].second, dgrads.back());
  EXPECT_EQ(phase_of(c, w.compute.back()).kind, TaskKind::kSharedGateUpWgrad);
}

TEST(BackwardTasksTest, NoRowsLeavesTheSharedExpertAndEveryExpertsEmptyWeightGradients) {
  const Case c = make_case({0, 128, 128, 512}, 0, 512, 192, 128, 128, 2, 1, 1, true, true);  // a capacity overflow
  const Walked w = walk(c);
  EXPECT_TRUE(w.comm.empty());
  for (const ComputeTask& t : w.compute)
    if (!token_rows(phase_of(c, t).rows)) {
      EXPECT_TRUE(weight_grad_tiles(phase_of(c, t).rows) && t.rows == 0 && t.row == 0);
    }
  check_case(c);
  const Case none = make_case({0, 128, 128, 512}, 0, 512, 0, 128, 0, 1, 1, 1, false, false);  // no shared expert either
  check_case(none);
  for (const ComputeTask& t : walk(none).compute) EXPECT_EQ(phase_of(none, t).rows, PhaseRows::kEndingExperts);
}

// Every variant passes the compile-time checks; tables that break each rule do not.
TEST(BackwardTasksTest, TableChecksRejectInconsistentTables) {
  const CommPhaseTable comm = comm_phase_table(bwd::kCommPhases);
  auto consistent = [](const PhaseTable& t, const CommPhaseTable& cm = comm_phase_table(bwd::kCommPhases),
                       const CounterDesc* counters = bwd::kCounters) {
    return tables_are_consistent(t, cm, counters, bwd::kNumCounters, bwd::kNumGemms);
  };
  for (bool shared : {false, true})
    for (bool routed : {false, true}) EXPECT_TRUE(consistent(bwd::phases(shared, routed))) << shared << routed;
  auto changed = [](bool shared, bool routed, TaskKind kind, auto change) {
    PhaseTable t = bwd::phases(shared, routed);
    for (int i = 0; i < t.count; ++i)
      if (t.phase[i].kind == kind) change(t.phase[i]);
    return finish_phases(t);
  };
  EXPECT_FALSE(consistent(changed(true, true, TaskKind::kExpertDownDgrad, [](PhaseDesc& p) { p.waits_kept = bwd::kGateUpReady; })))
      << "kept rows waiting on gate_up_ready, which only the recompute (rows past recompute_from) signals";
  EXPECT_FALSE(consistent(changed(false, false, TaskKind::kExpertDownDgrad, [](PhaseDesc& p) { p.waits = bwd::kGateUpReady; })))
      << "a wait on a counter that no phase of the variant signals";
  EXPECT_FALSE(consistent(changed(true, true, TaskKind::kSharedDownDgrad, [](PhaseDesc& p) { p.waits_kept = kNoCounter; })))
      << "a shared phase with a separate kept-rows wait";
  EXPECT_FALSE(consistent(changed(true, true, TaskKind::kExpertDownWgrad, [](PhaseDesc& p) { p.waits = bwd::kSharedDgradReady; })))
      << "a routed phase waiting on token-row units";
  CounterDesc counters[bwd::kNumCounters];
  std::copy(std::begin(bwd::kCounters), std::end(bwd::kCounters), counters);
  counters[bwd::kGateUpReady].complete_at = bwd::kExpertDownWgrad;
  EXPECT_TRUE(consistent(bwd::phases(false, false), comm, counters));
  EXPECT_FALSE(consistent(changed(false, false, TaskKind::kExpertDownWgrad, [](PhaseDesc& p) { p.signals = bwd::kGateUpReady; }),
                          comm, counters))
      << "a weight-gradient phase that signals";
  PhaseTable tail_early = bwd::phases(false, true);
  std::swap(tail_early.phase[2], tail_early.phase[tail_early.count - 1]);
  EXPECT_FALSE(consistent(finish_phases(tail_early))) << "a kSharedTail phase before the per-minibatch ones";
  CommPhaseTable push_early = comm;
  push_early.phase[1].waits = bwd::kGateUpReady;
  EXPECT_FALSE(consistent(bwd::phases(true, true), push_early)) << "a push waiting on a counter kept units never reach";
  EXPECT_FALSE(bwd::gemm_kinds_match(changed(true, true, TaskKind::kExpertDownWgrad, [](PhaseDesc& p) { p.gemm = bwd::kExpertDownDgrad; })))
      << "weight-gradient tiles of a row GEMM";
}

// Tables that pass the compile-time checks but order or wait wrongly fail the dependency checks.
TEST(BackwardTasksTest, DependencyChecksCatchBrokenOrders) {
  // Kept rows below 256, a segment [128, 448) across minibatches, empty experts, a shared expert.
  const Case base = make_case({0, 0, 128, 448, 448, 640}, 640, 640, 192, 128, 256, 1, 1, 1, true, true);
  ASSERT_EQ(dependency_error(base, walk(base)), "");
  auto expect_error = [](const Case& c, const std::string& needle, const char* what) {
    const std::string error = dependency_error(c, walk(c));
    EXPECT_NE(error.find(needle), std::string::npos) << what << ": got \"" << error << "\"";
  };
  auto with_phase = [&](TaskKind kind, auto change) {
    Case c = base;
    for (int i = 0; i < c.shape.phases.count; ++i)
      if (c.shape.phases.phase[i].kind == kind) change(c.shape.phases.phase[i]);
    return c;
  };
  auto index_of = [&](TaskKind kind) {
    for (int i = 0; i < base.shape.phases.count; ++i)
      if (base.shape.phases.phase[i].kind == kind) return i;
    return -1;
  };
  Case swapped = base;
  std::swap(swapped.shape.phases.phase[index_of(TaskKind::kExpertDownDgrad)],
            swapped.shape.phases.phase[index_of(TaskKind::kExpertGateUpDgrad)]);
  expect_error(swapped, "deadlock", "gate/up dgrad tiles before the down dgrad tiles they read");
  Case grads_first = base;  // per minibatch: recompute, down wgrad, gate/up wgrad, down dgrad, gate/up dgrad
  std::swap(grads_first.shape.phases.phase[index_of(TaskKind::kExpertDownDgrad)],
            grads_first.shape.phases.phase[index_of(TaskKind::kExpertDownWgrad)]);
  std::swap(grads_first.shape.phases.phase[index_of(TaskKind::kExpertGateUpDgrad)],
            grads_first.shape.phases.phase[index_of(TaskKind::kExpertGateUpWgrad)]);
  expect_error(grads_first, "deadlock", "weight gradients before their minibatch's down dgrad");
  auto no_wait = [](PhaseDesc& p) { p.waits = p.waits_kept = kNoCounter; };
  // In ticket order with one worker they happen to run late enough; nothing orders them (ancestors).
  expect_error(with_phase(TaskKind::kExpertGateUpWgrad, no_wait), "may run before", "a weight gradient waiting for nothing");
  expect_error(with_phase(TaskKind::kSharedDownWgrad, no_wait), "may run before", "the shared one waiting for nothing");
  for (int i = 0; i < grads_first.shape.phases.count; ++i)
    if (weight_grad_tiles(grads_first.shape.phases.phase[i].rows)) no_wait(grads_first.shape.phases.phase[i]);
  expect_error(grads_first, "starts before unit", "weight gradients before their minibatch's down dgrad, not waiting");
  // The design without waits_kept: gate_up_ready preset on the kept units, the down dgrad waiting on it alone.
  Case preset = with_phase(TaskKind::kExpertDownDgrad, [](PhaseDesc& p) { p.waits_kept = bwd::kGateUpReady; });
  preset.preset_gate_up_units = base.shape.recompute_from / kUnitRows;
  expect_error(preset, "may run before comm slot", "kept rows' down dgrad before their d_out rows are pulled");
  Case no_push_wait = base;
  no_push_wait.shape.comm_phases.phase[1].waits = kNoCounter;
  expect_error(no_push_wait, "may run before", "a push before its d_x rows");
  Case early_target = base;
  early_target.counters[bwd::kDxReady].complete_at = kOneTask;
  expect_error(early_target, "ends at", "dx_ready complete after one n-block");
  // Two macrobatches (walked last to first): the segment [128, 448) waits for a minibatch walked later.
  Case two_macrobatches = base;
  two_macrobatches.shape.ring_rows = 384;
  expect_error(two_macrobatches, "deadlock", "the backward needs one macrobatch");
}

// Every task kind, role and counter of the backward has a name (timelines and timeout reports).
TEST(BackwardTasksTest, KindsRolesAndCountersAreNamed) {
  std::vector<std::string> names;
  for (int k = 0; k <= int(TaskKind::kNone); ++k) names.push_back(task_kind_name(TaskKind(k)));
  for (const std::string& name : names) EXPECT_NE(name, "unknown");
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end()) << "two kinds share a name";
  EXPECT_TRUE(is_copy_task(TaskKind::kPullGrad) && is_copy_task(TaskKind::kPushGrad) &&
              !is_copy_task(TaskKind::kExpertDownWgrad));
  for (const CounterDesc& counter : bwd::kCounters) {
    StatusReport report;
    report.raw.error_bits = kStatusWaitTimeout;
    report.raw.timeout_role = int32_t(Role::kPushGrad);
    report.raw.timeout_counter = int32_t(counter.id);
    const std::string line = report.describe(1, 1, 1);
    EXPECT_EQ(line.find("unknown"), std::string::npos) << line;
    EXPECT_NE(line.find("gradient push"), std::string::npos) << line;
  }
}

}  // namespace
}  // namespace mok::megakernel
