// GPU schedule on one GPU, with virtual ranks for EP > 1: exact equality with the CPU twin for the four
// model shapes (balanced and skewed routings), 64-bit ids, bad ids, capacity overflow, reruns, CUDA-graph
// replay and spin-wait timeouts. Row maps are poisoned before every build, so unwritten rows are caught.
#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "mok/schedule.h"
#include "reference/routing_gen.h"
#include "src/host/check.h"
#include "tests/common/gpu_env.h"
#include "tests/common/schedule_harness.h"

namespace mok {
namespace {

using testing::ScheduleHarness;

constexpr int kTokens = 8192;

std::vector<std::vector<int32_t>> make_ids(const RoutingShape& shape, double skew, uint64_t seed) {
  return reference::random_topk_per_rank(shape.ep_size, shape.num_tokens, shape.top_k, shape.num_experts, skew, seed);
}

std::string context(const RoutingShape& s, const char* name, double skew, uint64_t seed, int rank) {
  return std::string(name) + " ep=" + std::to_string(s.ep_size) + " T=" + std::to_string(s.num_tokens) +
         " k=" + std::to_string(s.top_k) + " E=" + std::to_string(s.num_experts) + " skew=" + std::to_string(skew) +
         " seed=" + std::to_string(seed) + " rank=" + std::to_string(rank);
}

// Runs gather + build on the harness and compares every rank with the CPU twin.
void expect_matches_twin(ScheduleHarness& harness, const ScheduleOptions& options,
                         const std::vector<std::vector<int32_t>>& ids, const std::string& what) {
  harness.poison();
  harness.launch();
  const auto gpu = harness.download();
  const auto gathered = testing::gather_on_host(ids);
  for (int r = 0; r < harness.group().size(); ++r) {
    const HostSchedule twin = build_schedule_host(harness.workspace().shape(), options, r, gathered);
    const std::string diff = testing::compare_schedules(twin, gpu[r]);
    ASSERT_TRUE(diff.empty()) << what << " rank " << r << ": " << diff;
  }
}

TEST(ScheduleGpuTest, ModelShapesMatchCpuAtEp1Ep2Ep8Virtual) {
  MOK_REQUIRE_GPUS(1);
  std::printf("%-16s %3s %-8s %10s %10s %12s\n", "shape", "EP", "routing", "rows r0", "max rows/e", "status");
  for (const auto& model : reference::model_shapes()) {
    for (double skew : {0.0, 1.0}) {
      const uint64_t seed = 1000 + model.num_experts + static_cast<uint64_t>(skew * 10);
      const auto all_ids = make_ids(RoutingShape{8, kTokens, model.top_k, model.num_experts}, skew, seed);
      for (int ep : {1, 2, 8}) {
        const RoutingShape shape{ep, kTokens, model.top_k, model.num_experts};
        const std::vector<std::vector<int32_t>> ids(all_ids.begin(), all_ids.begin() + ep);
        // Balanced: the default capacity (twice the balanced rows). Skewed: the busiest rank of EP 8 needs up
        // to 1.99x of them (gpt-oss-120b), so the worst case (load_factor = ep_size) keeps every rank placing.
        ScheduleOptions options;
        if (skew > 0) options.load_factor = ep;
        ScheduleHarness harness(PeerGroup::virtual_ranks(ep), shape, options);
        harness.upload(ids, IndexType::kInt32);
        expect_matches_twin(harness, options, ids, context(shape, model.name.c_str(), skew, seed, -1));
        if (HasFatalFailure()) return;
        const HostSchedule r0 = harness.workspace().download(0, harness.stream(0));
        std::printf("%-16s %3d %-8s %10d %10d %12s\n", model.name.c_str(), ep, skew > 0 ? "skewed" : "balanced",
                    r0.scheduled_rows, *std::max_element(r0.expert_counts.begin(), r0.expert_counts.end()),
                    r0.status.ok() ? "ok" : "ERROR");
        EXPECT_TRUE(r0.status.ok());
      }
    }
  }
}

TEST(ScheduleGpuTest, Int64IdsMatchInt32) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{2, 3000, 6, 384};
  const auto ids = make_ids(shape, 0.5, 77);
  ScheduleOptions options;
  options.tile_m = 64;
  ScheduleHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(ids, IndexType::kInt64);
  expect_matches_twin(harness, options, ids, "int64 ids, seed=77");
}

TEST(ScheduleGpuTest, RerunsAlternateParitiesAndStayExact) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{4, 2048, 8, 256};
  ScheduleOptions options;
  ScheduleHarness harness(PeerGroup::virtual_ranks(4), shape, options);
  std::vector<HostSchedule> first;
  for (int round = 0; round < 5; ++round) {
    const uint64_t seed = round < 4 ? 500 + round : 500;  // round 4 repeats round 0's ids
    const auto ids = make_ids(shape, round % 2 ? 1.0 : 0.0, seed);
    harness.upload(ids, IndexType::kInt32);
    expect_matches_twin(harness, options, ids, "round " + std::to_string(round) + " seed=" + std::to_string(seed));
    if (HasFatalFailure()) return;
    const auto gpu = harness.download();
    if (round == 0) first = gpu;
    if (round == 4) {
      for (int r = 0; r < 4; ++r) EXPECT_EQ(testing::compare_schedules(first[r], gpu[r]), "") << "rank " << r;
    }
  }
}

TEST(ScheduleGpuTest, CapacityOverflowIsReportedAndPlacesNothing) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{2, kTokens, 8, 256};
  const auto ids = make_ids(shape, 1.0, 9);
  const HostSchedule fit = build_schedule_host(shape, {}, 0, testing::gather_on_host(ids));
  ScheduleOptions options;
  options.capacity_rows = fit.expert_row_offsets.back() - 1;
  ScheduleHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(ids, IndexType::kInt32);
  expect_matches_twin(harness, options, ids, "overflow seed=9");
  const StatusReport report = harness.workspace().read_status(0, harness.stream(0));
  EXPECT_EQ(report.raw.error_bits & kStatusCapacityOverflow, kStatusCapacityOverflow);
  EXPECT_EQ(report.raw.rows_needed, fit.expert_row_offsets.back());
  std::printf("overflow report: %s\n", report.describe(shape.num_tokens, shape.top_k, shape.num_experts).c_str());
  const HostSchedule gpu = harness.workspace().download(0, harness.stream(0));
  EXPECT_EQ(gpu.scheduled_rows, 0);
  EXPECT_TRUE(std::all_of(gpu.row_route.begin(), gpu.row_route.end(), [](int32_t r) { return r == -1; }));
}

TEST(ScheduleGpuTest, BadExpertIdsAreReportedExactly) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{2, 4096, 8, 64};
  auto ids = make_ids(shape, 0.0, 21);
  ids[1][5000] = 64;     // route 4096*8 + 5000 on rank 1
  ids[1][7000] = -3;
  ids[0][30000] = 1000;  // the smallest bad route
  for (IndexType type : {IndexType::kInt32, IndexType::kInt64}) {
    ScheduleOptions options;
    ScheduleHarness harness(PeerGroup::virtual_ranks(2), shape, options);
    harness.upload(ids, type);
    expect_matches_twin(harness, options, ids, "bad ids");
    for (int r = 0; r < 2; ++r) {
      const StatusReport report = harness.workspace().read_status(r, harness.stream(r));
      EXPECT_EQ(report.raw.error_bits, kStatusBadExpertId);
      EXPECT_EQ(report.bad_route(), 30000);
      EXPECT_EQ(report.bad_expert_id(), 1000);
    }
  }
}

// The status word is sticky across builds until reset_status; a good build after the reset matches the
// CPU twin again, status included.
TEST(ScheduleGpuTest, StatusIsStickyAcrossBuildsUntilReset) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{2, 2048, 8, 64};
  auto bad = make_ids(shape, 0.0, 23);
  bad[0][1234] = 64;
  const auto good = make_ids(shape, 0.0, 24);
  ScheduleOptions options;
  ScheduleHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(bad, IndexType::kInt32);
  harness.launch();
  harness.upload(good, IndexType::kInt32);
  harness.launch();
  for (int r = 0; r < 2; ++r) {
    const StatusReport report = harness.workspace().read_status(r, harness.stream(r));
    EXPECT_EQ(report.raw.error_bits, kStatusBadExpertId) << "seed 23/24 rank " << r;
    EXPECT_EQ(report.bad_route(), 1234);
  }
  for (int r = 0; r < 2; ++r) harness.workspace().reset_status(r, harness.stream(r));
  harness.synchronize();
  expect_matches_twin(harness, options, good, "after reset, seed=24");
}

TEST(ScheduleGpuTest, HugeInt64IdsSaturateAndAreReported) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{1, 64, 2, 8};
  std::vector<int64_t> ids(128, 3);
  ids[17] = int64_t(1) << 40;
  ScheduleOptions options;
  ScheduleWorkspace ws(PeerGroup::virtual_ranks(1), shape, options);
  void* device_ids = nullptr;
  MOK_CHECK_CUDA(cudaMalloc(&device_ids, ids.size() * sizeof(int64_t)));
  MOK_CHECK_CUDA(cudaMemcpy(device_ids, ids.data(), ids.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  ws.gather_topk(0, device_ids, IndexType::kInt64, nullptr);
  ws.build(0, nullptr);
  const StatusReport report = ws.read_status(0, nullptr);
  MOK_CHECK_CUDA(cudaFree(device_ids));
  EXPECT_EQ(report.raw.error_bits, kStatusBadExpertId);
  EXPECT_EQ(report.bad_route(), 17);
  EXPECT_EQ(report.bad_expert_id(), INT32_MAX);
}

TEST(ScheduleGpuTest, CudaGraphReplayRebuildsFromNewIds) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{2, 4096, 8, 128};
  ScheduleOptions options;
  ScheduleHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(make_ids(shape, 0.0, 1), IndexType::kInt32);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOK_CHECK_CUDA(cudaStreamBeginCapture(harness.stream(0), cudaStreamCaptureModeThreadLocal));
  harness.launch();
  MOK_CHECK_CUDA(cudaStreamEndCapture(harness.stream(0), &graph));
  MOK_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (uint64_t seed : {31u, 32u, 33u}) {  // three replays: both parities, new ids each time
    const auto ids = make_ids(shape, seed == 32 ? 1.0 : 0.0, seed);
    harness.upload(ids, IndexType::kInt32);
    harness.poison();
    MOK_CHECK_CUDA(cudaGraphLaunch(exec, harness.stream(0)));
    const auto gpu = harness.download();
    for (int r = 0; r < 2; ++r) {
      const HostSchedule twin = build_schedule_host(shape, options, r, testing::gather_on_host(ids));
      EXPECT_EQ(testing::compare_schedules(twin, gpu[r]), "") << "replay seed=" << seed << " rank " << r;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(ScheduleGpuTest, MissingPeerTimesOutWithRankRoleAndCounter) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{2, 1024, 4, 16};
  ScheduleOptions options;
  options.wait_timeout_s = 0.05;
  ScheduleHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(make_ids(shape, 0.0, 3), IndexType::kInt32);
  // Only rank 0 gathers: rank 0's build waits for rank 1's ids forever.
  ScheduleWorkspace& ws = harness.workspace();
  std::vector<int32_t> ids(shape.routes_per_rank(), 1);
  void* device_ids = nullptr;
  MOK_CHECK_CUDA(cudaMalloc(&device_ids, ids.size() * sizeof(int32_t)));
  MOK_CHECK_CUDA(cudaMemcpy(device_ids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  ws.gather_topk(0, device_ids, IndexType::kInt32, harness.stream(0));
  ws.build(0, harness.stream(0));
  const StatusReport report = ws.read_status(0, harness.stream(0));
  MOK_CHECK_CUDA(cudaFree(device_ids));
  EXPECT_EQ(report.raw.error_bits & kStatusWaitTimeout, kStatusWaitTimeout);
  EXPECT_EQ(report.raw.timeout_rank, 0);
  EXPECT_EQ(report.raw.timeout_role, static_cast<int32_t>(Role::kScheduleCount));
  EXPECT_EQ(report.raw.timeout_counter, static_cast<int32_t>(CounterId::kTopkArrived));
  EXPECT_EQ(report.raw.timeout_index, 1);
  EXPECT_EQ(report.raw.timeout_seen, 0u);
  EXPECT_GT(report.raw.timeout_awaited, 0u);
  std::printf("timeout report: %s\n", report.describe(shape.num_tokens, shape.top_k, shape.num_experts).c_str());
}

TEST(ScheduleGpuTest, EmptyExpertsAndAllToOneExpert) {
  MOK_REQUIRE_GPUS(1);
  const RoutingShape shape{2, 5000, 4, 64};
  std::vector<std::vector<int32_t>> ids(2, std::vector<int32_t>(shape.routes_per_rank(), -1));
  for (int r = 0; r < 2; ++r)
    for (int64_t q = 0; q < shape.routes_per_rank(); q += 4) ids[r][q] = 40;  // slot 0 -> expert 40, rest masked
  ScheduleOptions options;
  ScheduleHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(ids, IndexType::kInt32);
  expect_matches_twin(harness, options, ids, "all to expert 40");
  const auto gpu = harness.download();
  EXPECT_EQ(gpu[0].scheduled_rows, 0);
  EXPECT_EQ(gpu[1].expert_counts[40 - 32], 10000);
}

}  // namespace
}  // namespace mok
