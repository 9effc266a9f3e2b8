// GPU schedule on two GPUs (one rank per GPU, CUDA peer access): ids really cross NVLink, each rank's
// build spins on its peer's arrival counter. Checked exactly against the CPU twin and bitwise against the
// same ranks run as virtual ranks on one GPU.
#include <cstdio>
#include <vector>

#include <gtest/gtest.h>

#include "mok/schedule.h"
#include "reference/routing_gen.h"
#include "tests/common/gpu_env.h"
#include "tests/common/schedule_harness.h"

namespace mok {
namespace {

using testing::ScheduleHarness;

std::vector<std::vector<int32_t>> make_ids(const RoutingShape& shape, double skew, uint64_t seed) {
  return reference::random_topk_per_rank(shape.ep_size, shape.num_tokens, shape.top_k, shape.num_experts, skew, seed);
}

TEST(ScheduleMultiGpuTest, TwoGpusMatchCpuAndVirtualRanks) {
  MOK_REQUIRE_GPUS(2);
  std::printf("%-16s %-8s %10s %10s %8s\n", "shape", "routing", "rows r0", "rows r1", "result");
  for (const auto& model : reference::model_shapes()) {
    const RoutingShape shape{2, 8192, model.top_k, model.num_experts};
    ScheduleOptions options;
    ScheduleHarness devices(PeerGroup::device_peers({0, 1}), shape, options);
    ScheduleHarness virtual_ranks(PeerGroup::virtual_ranks(2), shape, options);
    for (double skew : {0.0, 1.0}) {
      const uint64_t seed = 4000 + model.num_experts + static_cast<uint64_t>(skew * 10);
      const auto ids = make_ids(shape, skew, seed);
      const auto gathered = testing::gather_on_host(ids);
      for (ScheduleHarness* h : {&devices, &virtual_ranks}) {
        h->upload(ids, IndexType::kInt32);
        h->poison();
        h->launch();
      }
      const auto on_devices = devices.download();
      const auto on_virtual = virtual_ranks.download();
      for (int r = 0; r < 2; ++r) {
        const HostSchedule twin = build_schedule_host(shape, options, r, gathered);
        ASSERT_EQ(testing::compare_schedules(twin, on_devices[r]), "")
            << model.name << " skew=" << skew << " seed=" << seed << " rank " << r << " (two GPUs vs CPU)";
        ASSERT_EQ(testing::compare_schedules(on_virtual[r], on_devices[r]), "")
            << model.name << " skew=" << skew << " seed=" << seed << " rank " << r << " (two GPUs vs virtual)";
      }
      std::printf("%-16s %-8s %10d %10d %8s\n", model.name.c_str(), skew > 0 ? "skewed" : "balanced",
                  on_devices[0].scheduled_rows, on_devices[1].scheduled_rows, "exact");
    }
  }
}

TEST(ScheduleMultiGpuTest, ConsecutiveBuildsWithInt64Ids) {
  MOK_REQUIRE_GPUS(2);
  const RoutingShape shape{2, 4096, 8, 384};
  ScheduleOptions options;
  options.tile_m = 64;
  ScheduleHarness devices(PeerGroup::device_peers({0, 1}), shape, options);
  for (int round = 0; round < 6; ++round) {
    const auto ids = make_ids(shape, round % 3 * 0.5, 900 + round);
    devices.upload(ids, round % 2 ? IndexType::kInt64 : IndexType::kInt32);
    devices.poison();
    devices.launch();
    const auto gpu = devices.download();
    for (int r = 0; r < 2; ++r) {
      const HostSchedule twin = build_schedule_host(shape, options, r, testing::gather_on_host(ids));
      ASSERT_EQ(testing::compare_schedules(twin, gpu[r]), "") << "round " << round << " rank " << r;
    }
  }
}

TEST(ScheduleMultiGpuTest, BackToBackBuildsWithoutHostSync) {
  MOK_REQUIRE_GPUS(2);
  // Ten gather+build rounds queued with no host synchronization in between: arrival counts and epochs
  // must stay in step on both GPUs (a slip deadlocks into a timeout or reads the wrong parity's ids).
  const RoutingShape shape{2, 8192, 8, 256};
  ScheduleOptions options;
  ScheduleHarness devices(PeerGroup::device_peers({0, 1}), shape, options);
  const auto ids = make_ids(shape, 0.0, 77);
  devices.upload(ids, IndexType::kInt32);
  for (int round = 0; round < 10; ++round) devices.launch();
  const auto gpu = devices.download();
  for (int r = 0; r < 2; ++r) {
    const HostSchedule twin = build_schedule_host(shape, options, r, testing::gather_on_host(ids));
    EXPECT_EQ(testing::compare_schedules(twin, gpu[r]), "") << "rank " << r;
    EXPECT_TRUE(gpu[r].status.ok()) << gpu[r].status.describe(shape.num_tokens, shape.top_k, shape.num_experts);
  }
}

}  // namespace
}  // namespace mok
