// CPU tests of the forward megakernel's task order (src/device/megakernel/forward_tasks.h), the same code
// the GPU walks. For random schedules (empty experts, tile_m 64 and 128) and ring / minibatch settings
// down to forced ring reuse:
//   - every output tile of every GEMM is handed out exactly once, inside one expert segment, one minibatch
//     and one macrobatch, at its ring row
//   - every unit is dispatched once and combined once
//   - deadlock freedom: every task waits only for tasks with an earlier ticket in its own order, or for
//     tasks of the other order whose own waits are earlier again (checked along the ring-reuse chain)
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "mok/timeline.h"
#include "src/device/megakernel/forward_tasks.h"

namespace mok::megakernel {
namespace {

struct Case {
  std::vector<int32_t> offsets;  // padded segment starts, [experts + 1]
  int32_t scheduled_rows = 0;
  TaskOrderShape shape{};
  std::string describe() const {
    return "experts " + std::to_string(shape.local_experts) + ", rows " + std::to_string(scheduled_rows) +
           ", shared rows " + std::to_string(shape.shared_rows) + ", ring " + std::to_string(shape.ring_rows) +
           ", minibatch " + std::to_string(shape.minibatch_rows) + ", groups " +
           std::to_string(shape.gate_up_groups) + "/" + std::to_string(shape.down_groups);
  }
};

Case random_case(std::mt19937& rng, int32_t ring_rows, int32_t minibatch_rows) {
  Case c;
  const int experts = std::uniform_int_distribution<int>(1, 12)(rng);
  const int tile_m = rng() % 2 ? 64 : 128;
  c.offsets.push_back(0);
  for (int e = 0; e < experts; ++e) {
    const int count = rng() % 4 == 0 ? 0 : std::uniform_int_distribution<int>(1, 700)(rng);
    c.offsets.push_back(c.offsets.back() + (count + tile_m - 1) / tile_m * tile_m);
  }
  c.scheduled_rows = c.offsets.back();
  c.shape.expert_row_offsets = c.offsets.data();
  c.shape.local_experts = experts;
  c.shape.shared_rows = rng() % 3 == 0 ? 0 : 64 * std::uniform_int_distribution<int>(1, 20)(rng);
  c.shape.ring_rows = ring_rows > 0 ? ring_rows : std::max<int32_t>(128, (c.scheduled_rows + 127) / 128 * 128);
  c.shape.minibatch_rows = minibatch_rows;
  c.shape.gate_up_groups = std::uniform_int_distribution<int>(1, 3)(rng);
  c.shape.down_groups = std::uniform_int_distribution<int>(1, 3)(rng);
  return c;
}

bool gate_up(TaskKind k) { return k == TaskKind::kSharedGateUp || k == TaskKind::kExpertGateUp; }
bool routed(TaskKind k) { return k == TaskKind::kExpertGateUp || k == TaskKind::kExpertDown; }

struct Walked {
  std::vector<ComputeTask> compute;  // in slot order
  std::vector<CommTask> comm;
};

Walked walk(const Case& c) {
  Walked w;
  ComputeWalker walker(c.shape, c.scheduled_rows);
  ComputeTask t;
  for (int32_t slot = 0; walker.task_at(slot, t); ++slot) w.compute.push_back(t);
  for (int32_t slot = 0;; ++slot) {
    const CommTask task = comm_task_at(c.shape, c.scheduled_rows, slot);
    if (task.kind == TaskKind::kNone) break;
    w.comm.push_back(task);
  }
  return w;
}

void check_case(const Case& c) {
  SCOPED_TRACE(c.describe());
  const Walked w = walk(c);
  const TaskOrderShape& s = c.shape;
  const int32_t units = c.scheduled_rows / kUnitRows, shared_units = s.shared_rows / kUnitRows;

  // Coverage: (kind, unit, group) -> slot of the task covering it.
  std::map<std::tuple<int, int32_t, int32_t>, int32_t> covered;
  for (int32_t slot = 0; slot < int32_t(w.compute.size()); ++slot) {
    const ComputeTask& t = w.compute[slot];
    ASSERT_TRUE(t.rows == 64 || t.rows == 128) << "slot " << slot;
    ASSERT_EQ(t.row % kUnitRows, 0) << "slot " << slot;
    const std::vector<int32_t> shared_offsets = {0, s.shared_rows};
    const std::vector<int32_t>& offsets = routed(t.kind) ? c.offsets : shared_offsets;
    ASSERT_GE(t.row, offsets[t.expert]) << "slot " << slot << ": tile starts before its expert's segment";
    ASSERT_LE(t.row + t.rows, offsets[t.expert + 1]) << "slot " << slot << ": tile leaves its expert's segment";
    if (routed(t.kind)) {
      ASSERT_EQ(t.row / s.ring_rows, (t.row + t.rows - 1) / s.ring_rows) << "slot " << slot << ": crosses a macrobatch";
      // Minibatches start at the macrobatch's first row.
      ASSERT_EQ(t.row % s.ring_rows / s.minibatch_rows, (t.row + t.rows - 1) % s.ring_rows / s.minibatch_rows)
          << "slot " << slot << ": crosses a minibatch";
      ASSERT_EQ(t.buffer_row, t.row % s.ring_rows) << "slot " << slot;
    } else {
      ASSERT_EQ(t.buffer_row, t.row) << "slot " << slot;
    }
    const int32_t groups = gate_up(t.kind) ? s.gate_up_groups : s.down_groups;
    ASSERT_LT(t.n_group, groups) << "slot " << slot;
    for (int32_t u = t.row / kUnitRows; u * kUnitRows < t.row + t.rows; ++u) {
      const auto key = std::make_tuple(static_cast<int>(t.kind), u, t.n_group);
      ASSERT_EQ(covered.count(key), 0u) << "slot " << slot << ": unit " << u << " group " << t.n_group << " twice";
      covered[key] = slot;
    }
  }
  const int64_t expected = int64_t(shared_units) * (s.gate_up_groups + s.down_groups) +
                           int64_t(units) * (s.gate_up_groups + s.down_groups);
  ASSERT_EQ(int64_t(covered.size()), expected) << "some (unit, n-block group) of some GEMM is never computed";

  // Communication order: each unit dispatched once, then combined once.
  std::vector<int32_t> dispatch_slot(units, -1), combine_slot(units, -1);
  for (int32_t slot = 0; slot < int32_t(w.comm.size()); ++slot) {
    const CommTask& t = w.comm[slot];
    ASSERT_TRUE(t.unit >= 0 && t.unit < units) << "comm slot " << slot;
    auto& seen = t.kind == TaskKind::kDispatch ? dispatch_slot : combine_slot;
    ASSERT_EQ(seen[t.unit], -1) << "comm slot " << slot << ": unit " << t.unit << " twice";
    seen[t.unit] = slot;
  }
  for (int32_t u = 0; u < units; ++u) {
    ASSERT_GE(dispatch_slot[u], 0) << "unit " << u << " never dispatched";
    ASSERT_GT(combine_slot[u], dispatch_slot[u]) << "unit " << u << " combined before (or without) its dispatch";
  }

  // Deadlock freedom. Compute waits: shared down / expert down on all gate/up groups of their units (earlier
  // compute slots). A dispatch into reused ring rows waits for the combine of the unit one ring later
  // (earlier comm slot); that combine waits for the down tiles of that unit, which must hold earlier compute
  // slots than every gate/up tile that waits for this dispatch, or the gate/up tiles could hold every
  // compute CTA while the down tiles they transitively wait for have no CTA.
  const int32_t ring_units = s.ring_rows / kUnitRows;
  for (int32_t slot = 0; slot < int32_t(w.compute.size()); ++slot) {
    const ComputeTask& t = w.compute[slot];
    for (int32_t u = t.row / kUnitRows; u * kUnitRows < t.row + t.rows; ++u) {
      if (t.kind == TaskKind::kSharedDown || t.kind == TaskKind::kExpertDown) {
        const auto producer = t.kind == TaskKind::kSharedDown ? TaskKind::kSharedGateUp : TaskKind::kExpertGateUp;
        for (int32_t g = 0; g < s.gate_up_groups; ++g)
          ASSERT_LT(covered.at({static_cast<int>(producer), u, g}), slot) << "slot " << slot << " waits on a later tile";
      }
      if (t.kind == TaskKind::kExpertGateUp) {
        for (int32_t later = u + ring_units; later < units; later += ring_units) {
          ASSERT_LT(combine_slot[later], dispatch_slot[later - ring_units]) << "ring reuse of unit " << later;
          for (int32_t g = 0; g < s.down_groups; ++g)
            ASSERT_LT(covered.at({static_cast<int>(TaskKind::kExpertDown), later, g}), slot)
                << "slot " << slot << " (gate/up of unit " << u << ") transitively waits on a later down tile of unit "
                << later;
        }
      }
    }
  }
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
  Case c;
  c.offsets = {0, 0, 0};
  c.scheduled_rows = 0;  // e.g. after a capacity overflow
  c.shape = {.expert_row_offsets = c.offsets.data(), .local_experts = 2, .shared_rows = 192, .ring_rows = 128,
             .minibatch_rows = 128, .gate_up_groups = 2, .down_groups = 3};
  const Walked w = walk(c);
  EXPECT_TRUE(w.comm.empty());
  ASSERT_EQ(w.compute.size(), size_t(2 * 2 + 2 * 3));  // tiles of 128 and 64 rows, per group
  for (const ComputeTask& t : w.compute) EXPECT_FALSE(routed(t.kind));
  check_case(c);
}

TEST(ForwardTasksTest, MacrobatchesAreWalkedLastToFirst) {
  Case c;
  c.offsets = {0, 640};
  c.scheduled_rows = 640;
  c.shape = {.expert_row_offsets = c.offsets.data(), .local_experts = 1, .shared_rows = 0, .ring_rows = 256,
             .minibatch_rows = 128, .gate_up_groups = 1, .down_groups = 1};
  const Walked w = walk(c);
  // Macrobatches [512, 640), [256, 512), [0, 256): the first gate/up tile is the last macrobatch's, and
  // the context keeps macrobatch 0, so the last routed tile is in it.
  ASSERT_FALSE(w.compute.empty());
  EXPECT_EQ(w.compute.front().row, 512);
  EXPECT_LT(w.compute.back().row, 256);
  EXPECT_EQ(w.comm.front().unit, 8);  // the first unit of the last macrobatch
  check_case(c);
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
