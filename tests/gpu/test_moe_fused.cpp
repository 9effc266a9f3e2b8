// The fused forward (the megakernel, src/device/megakernel) on one GPU, virtual ranks:
//   - bitwise equal to its unfused twin, outputs and the context's resident rows, across communication-CTA
//     counts, minibatch sizes and macrobatch (ring) sizes (the default: the balanced share of rows; the whole
//     capacity; rings down to 128 rows that force reuse), for a shape with CTA pairs (cluster 2) and one
//     without, with and without a shared expert, clamped SwiGLU
//   - the timeline: one record per task, GEMM tiles counted against the task order walked on the host;
//     Chrome-trace JSON with one event per record
//   - a dependency that does not arrive in time is reported through the status word (rank, SM, role,
//     counter), and the kernel finishes instead of hanging; bad FusedOptions are rejected by name
// (The CPU reference, provenance, graph, validation and status tests of test_moe_forward.cpp run the fused
// path too: it is the default.)
#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "mok/timeline.h"
#include "src/device/megakernel/forward_tasks.h"
#include "src/host/check.h"
#include "src/host/moe_fused.h"
#include "tests/common/device_array.h"
#include "tests/common/gpu_env.h"
#include "tests/common/moe_harness.h"

namespace mok {
namespace {

using testing::download;
using testing::LayerData;
using testing::MoeHarness;
using testing::moe_shape;

// Each rank's output and what its context keeps: the expert-side rows of the first macrobatch.
struct Result {
  std::vector<std::vector<uint16_t>> out, expert_rows, hidden;
  std::vector<int32_t> scheduled_rows;
  int64_t ring_rows = 0, capacity_rows = 0;
};

Result run(const MoeShape& shape, const MoeOptions& options, const LayerData& data, int64_t kept_rows) {
  MoeHarness harness(PeerGroup::virtual_ranks(shape.ep_size), shape, options);
  harness.upload(data);
  Result result;
  result.out = harness.run_checked(1);
  result.ring_rows = harness.workspace().ring_rows();
  result.capacity_rows = harness.workspace().capacity_rows();
  for (int r = 0; r < shape.ep_size; ++r) {
    const ForwardContext& ctx = *harness.args(r).context;
    const int32_t scheduled = download<int32_t>(ctx.schedule().scheduled_rows, 1)[0];
    const int64_t rows = std::min<int64_t>({kept_rows, ctx.ring_rows(), scheduled});
    result.scheduled_rows.push_back(scheduled);
    result.expert_rows.push_back(download<uint16_t>(ctx.expert_rows(), rows * shape.hidden));
    result.hidden.push_back(download<uint16_t>(ctx.hidden(), rows * shape.intermediate));
  }
  return result;
}

std::string describe(const FusedOptions& f) {
  return "comm CTAs " + std::to_string(f.comm_ctas) + ", minibatch " + std::to_string(f.minibatch_rows) +
         ", macrobatch " + std::to_string(f.macrobatch_rows);
}

TEST(MoeFusedTest, BitwiseEqualToUnfusedAcrossCommMinibatchAndMacrobatch) {
  MOK_REQUIRE_GPUS(1);
  struct ShapeCase {
    MoeShape shape;
    double skew;
  };
  MoeShape clamped = moe_shape(4, 200, 6, 32, 768, 384);  // 3 n-blocks each: no CTA pairs (cluster 1)
  clamped.swiglu_limit = 0.5f;
  MoeShape no_shared = moe_shape(2, 256, 4, 16, 512, 256);
  no_shared.shared_expert = false;
  const std::vector<ShapeCase> cases = {
      {moe_shape(2, 300, 8, 48, 512, 256), 1.0},  // CTA pairs (cluster 2), skewed
      {clamped, 0.0},
      {no_shared, 0.5},
      // H and I multiples of 64 only: both GEMMs end in a partial n-block (2 of each: CTA pairs)
      {moe_shape(2, 257, 4, 16, 448, 192), 0.5},
  };
  // Reduced sizes (MOK_TEST_REDUCED, under compute-sanitizer): 4 of the 36 settings, still with and without
  // dedicated communication CTAs and with and without ring reuse.
  const bool reduced = testing::reduced_sizes();
  const std::vector<int> comms = reduced ? std::vector<int>{0, 2} : std::vector<int>{0, 2, 12, 40};
  const std::vector<int> minibatches = reduced ? std::vector<int>{128} : std::vector<int>{128, 384, 4096};
  const std::vector<int64_t> macrobatches = reduced ? std::vector<int64_t>{0, 128} : std::vector<int64_t>{0, 128, 512};
  // Macrobatch 0 is the default ring (the balanced share of rows, below the capacity at EP > 1); one more
  // setting keeps the whole context (ring = capacity).
  constexpr int64_t kWholeContext = int64_t{1} << 30;
  std::vector<FusedOptions> settings;
  for (int comm : comms)
    for (int minibatch : minibatches)
      for (int64_t macrobatch : macrobatches) {
        FusedOptions f;
        f.comm_ctas = comm;
        f.minibatch_rows = minibatch;
        f.macrobatch_rows = macrobatch;
        settings.push_back(f);
      }
  settings.push_back(FusedOptions{});
  settings.back().macrobatch_rows = kWholeContext;
  int compared = 0;
  for (const ShapeCase& c : cases) {
    const LayerData data = testing::random_layer(c.shape, 40 + compared, c.skew, 0.02);
    MoeOptions unfused;
    unfused.path = ForwardPath::kUnfused;
    const Result want = run(c.shape, unfused, data, 1 << 30);
    for (const FusedOptions& f : settings) {
      MoeOptions options;
      options.fused = f;
      const Result got = run(c.shape, options, data, 1 << 30);
      const std::string label = "H " + std::to_string(c.shape.hidden) + ", I " + std::to_string(c.shape.intermediate) +
                                ", EP " + std::to_string(c.shape.ep_size) + ": " + describe(f);
      ASSERT_EQ(want.ring_rows, want.capacity_rows) << label << ": the unfused path keeps every row";
      ASSERT_EQ(got.capacity_rows, want.capacity_rows) << label;
      // The ring: the macrobatch, at most the capacity; by default the balanced share (T * k + padding at load
      // factor 1, rounded down to 128 rows), below the capacity at EP > 1.
      const int64_t share = expected_load_capacity_rows(c.shape.routing(), 64, 1.0) / 128 * 128;
      ASSERT_EQ(got.ring_rows, f.macrobatch_rows > 0 ? std::min(f.macrobatch_rows, got.capacity_rows) : share)
          << label;
      if (f.macrobatch_rows == kWholeContext) {
        ASSERT_EQ(got.ring_rows, got.capacity_rows) << label;
      }
      // A ring of 128 rows is below the busiest rank's scheduled rows here: the forward reuses it (macrobatches).
      if (f.macrobatch_rows == 128) {
        ASSERT_LT(got.ring_rows, *std::max_element(got.scheduled_rows.begin(), got.scheduled_rows.end()))
            << label << ": no ring reuse";
      }
      for (int r = 0; r < c.shape.ep_size; ++r) {
        ASSERT_EQ(got.scheduled_rows[r], want.scheduled_rows[r]) << label;
        ASSERT_EQ(got.out[r], want.out[r]) << label << ", rank " << r << ": output differs";
        // The fused context keeps the first macrobatch's rows (run() downloads min(ring, scheduled) of them);
        // they equal the unfused context's.
        ASSERT_TRUE(std::equal(got.expert_rows[r].begin(), got.expert_rows[r].end(), want.expert_rows[r].begin()))
            << label << ", rank " << r << ": context expert rows differ";
        ASSERT_TRUE(std::equal(got.hidden[r].begin(), got.hidden[r].end(), want.hidden[r].begin()))
            << label << ", rank " << r << ": context hidden rows differ";
      }
      ++compared;
    }
  }
  std::printf("fused == unfused bitwise (outputs and context rows) for %d (shape, settings) pairs\n", compared);
}

TEST(MoeFusedTest, TimelineRecordsEveryTaskOnce) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 300, 8, 48, 512, 256);
  for (int comm_ctas : {4, 0}) {  // dedicated communication CTAs, and the producer warps
    MoeOptions options;
    options.fused.timeline_records = 4096;
    options.fused.macrobatch_rows = 256;
    options.fused.comm_ctas = comm_ctas;
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
    harness.upload(testing::random_layer(shape, 50));
    harness.run_checked(1);
    const int cluster_n = detail::fused_cluster_n(shape.hidden, shape.intermediate);
    for (int r = 0; r < 2; ++r) {
      const std::vector<TaskRecord> records = harness.workspace().read_timeline(r, harness.stream(r));
      // The task order, walked on the host from the rank's schedule.
      const ForwardContext& ctx = *harness.args(r).context;
      const int32_t scheduled = download<int32_t>(ctx.schedule().scheduled_rows, 1)[0];
      const std::vector<int32_t> offsets =
          download<int32_t>(ctx.schedule().expert_row_offsets, shape.local_experts() + 1);
      namespace forward = megakernel::forward;
      const int32_t gate_up_n_blocks = shape.intermediate / 128, down_n_blocks = shape.hidden / 256;
      const megakernel::TaskOrderShape order = forward::task_order(
          offsets.data(), shape.local_experts(), static_cast<int32_t>(harness.workspace().padded_tokens()),
          static_cast<int32_t>(harness.workspace().ring_rows()), options.fused.minibatch_rows,
          {gate_up_n_blocks, down_n_blocks, gate_up_n_blocks, down_n_blocks}, cluster_n);
      std::vector<int64_t> want(7, 0), got(7, 0);
      megakernel::ComputeWalker walker(order, scheduled);
      megakernel::ComputeTask task;
      for (int32_t slot = 0; walker.task_at(slot, task); ++slot)
        want[int(order.phases.phase[task.phase].kind)] += cluster_n;  // one per CTA
      want[int(TaskKind::kDispatch)] = want[int(TaskKind::kCombine)] = scheduled / 64;
      for (const TaskRecord& record : records) {
        ++got[int(record.kind)];
        ASSERT_GE(record.end_ns, record.start_ns);
        const bool comm = record.kind == TaskKind::kDispatch || record.kind == TaskKind::kCombine;
        const bool comm_cta = record.cta < harness.workspace().comm_ctas();
        if (comm_cta) {
          ASSERT_TRUE(comm) << "a GEMM tile ran in a communication CTA";
        }
        if (harness.workspace().comm_ctas() > 0) {
          ASSERT_EQ(comm, comm_cta) << "a copy ran outside the communication CTAs";
        }
      }
      for (int kind = 0; kind < 6; ++kind)
        EXPECT_EQ(got[kind], want[kind]) << "rank " << r << ": records of " << task_kind_name(TaskKind(kind));
      const std::string json = chrome_trace_json(records, r);
      EXPECT_EQ(json.rfind("{\"traceEvents\": [", 0), 0u);
      int64_t events = 0;
      for (size_t at = json.find("\"ph\": \"X\""); at != std::string::npos; at = json.find("\"ph\": \"X\"", at + 1))
        ++events;
      EXPECT_EQ(events, int64_t(records.size()));
      std::printf("comm CTAs %d, rank %d: %zu task records (%lld gate/up, %lld down, %lld dispatch, %lld combine)\n",
                  comm_ctas, r, records.size(), static_cast<long long>(got[2]), static_cast<long long>(got[3]),
                  static_cast<long long>(got[4]), static_cast<long long>(got[5]));
    }
  }
}

TEST(MoeFusedTest, InvalidFusedOptionsAreRejectedAtConstruction) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 300, 8, 48, 512, 256);  // CTA pairs: communication CTAs come in twos
  auto rejects = [&](const MoeOptions& options, const std::string& needle) {
    try {
      MoeWorkspace workspace(PeerGroup::virtual_ranks(2), shape, options);
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "accepted options that should name " << needle;
  };
  MoeOptions odd;
  odd.fused.comm_ctas = 3;
  rejects(odd, "comm_ctas");
  MoeOptions all;
  all.fused.comm_ctas = 1000;
  rejects(all, "comm_ctas");
  MoeOptions ragged;
  ragged.fused.macrobatch_rows = 100;
  rejects(ragged, "macrobatch_rows");
  MoeOptions minibatch;
  minibatch.fused.minibatch_rows = 0;
  rejects(minibatch, "minibatch_rows");
  // Past 2^30 the task order's ring rows + minibatch rows would overflow int32.
  minibatch.fused.minibatch_rows = (1 << 30) + 128;
  rejects(minibatch, "minibatch_rows must be a positive multiple of 128 up to 2^30");
  MoeOptions huge_minibatch;
  huge_minibatch.fused.minibatch_rows = 1 << 30;  // the bound itself is valid
  EXPECT_NO_THROW(MoeWorkspace(PeerGroup::virtual_ranks(2), shape, huge_minibatch));
  MoeOptions unfused_ring;
  unfused_ring.path = ForwardPath::kUnfused;
  unfused_ring.fused.macrobatch_rows = 128;
  rejects(unfused_ring, "macrobatch_rows");
}

TEST(MoeFusedTest, LateDependencyIsReportedNotHung) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 300, 8, 48, 512, 256);
  MoeOptions options;
  // A timeout far below a tile's time: the first wait that has to spin gives up and reports. (Virtual ranks
  // issue every rank's gather and barrier arrive before any wait, so only the megakernel's waits spin.)
  options.schedule.wait_timeout_s = 1e-7;
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(testing::random_layer(shape, 60));
  harness.forward();
  harness.synchronize();  // returns: nothing hangs
  const StatusReport report = harness.status(0);
  ASSERT_TRUE(report.raw.error_bits & kStatusWaitTimeout) << report.describe(300, 8, 48);
  const auto role = static_cast<Role>(report.raw.timeout_role);
  EXPECT_TRUE(role == Role::kGemmProducer || role == Role::kDispatch || role == Role::kCombine)
      << report.describe(300, 8, 48);
  EXPECT_EQ(report.raw.timeout_rank, 0);
  std::printf("reported: %s\n", report.describe(300, 8, 48).c_str());
}

}  // namespace
}  // namespace mok
