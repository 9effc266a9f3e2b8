// CPU tests of the schedule: the CPU twin of the GPU kernels (build_schedule_host) against an independent
// oracle written from the specification, for random, skewed and adversarial routings.
#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>

#include "mok/routing.h"
#include "mok/schedule.h"
#include "reference/routing_gen.h"
#include "src/device/schedule/placement.h"
#include "tests/common/schedule_harness.h"

namespace mok {
namespace {

// The specification, written the slow and obvious way: for each local expert, the routes of each source
// in (token, slot) order; rows taken round-robin over sources; segments padded to tile_m.
HostSchedule oracle_schedule(const RoutingShape& shape, int tile_m, int64_t capacity, int rank,
                             const std::vector<int32_t>& gathered) {
  const int ep = shape.ep_size, local_experts = shape.local_experts();
  const int64_t routes = shape.routes_per_rank();
  HostSchedule s;
  s.own_ids.assign(gathered.begin() + rank * routes, gathered.begin() + (rank + 1) * routes);
  s.expert_counts.assign(local_experts, 0);
  s.expert_src_counts.assign(size_t(local_experts) * ep, 0);
  s.expert_row_offsets.assign(local_experts + 1, 0);
  std::vector<std::vector<std::vector<int32_t>>> lists(local_experts, std::vector<std::vector<int32_t>>(ep));
  for (int src = 0; src < ep; ++src)
    for (int64_t q = 0; q < routes; ++q) {
      const int32_t id = gathered[src * routes + q];
      if (id >= rank * local_experts && id < (rank + 1) * local_experts)
        lists[id - rank * local_experts][src].push_back(static_cast<int32_t>(src * routes + q));
    }
  std::vector<int32_t> rows;
  for (int e = 0; e < local_experts; ++e) {
    s.expert_row_offsets[e] = static_cast<int32_t>(rows.size());
    for (size_t i = 0;; ++i) {
      bool any = false;
      for (int src = 0; src < ep; ++src)
        if (i < lists[e][src].size()) { rows.push_back(lists[e][src][i]); any = true; }
      if (!any) break;
    }
    for (int src = 0; src < ep; ++src) {
      s.expert_src_counts[size_t(e) * ep + src] = static_cast<int32_t>(lists[e][src].size());
      s.expert_counts[e] += static_cast<int32_t>(lists[e][src].size());
    }
    while (rows.size() % tile_m != 0) rows.push_back(-1);
  }
  s.expert_row_offsets[local_experts] = static_cast<int32_t>(rows.size());
  const bool fits = int64_t(rows.size()) <= capacity;
  s.scheduled_rows = fits ? static_cast<int32_t>(rows.size()) : 0;
  s.row_route.assign(capacity, -1);
  if (fits) std::copy(rows.begin(), rows.end(), s.row_route.begin());
  s.route_row.assign(size_t(ep) * routes, -1);  // the inverse, written separately: each real row's route
  if (fits)
    for (size_t row = 0; row < rows.size(); ++row)
      if (rows[row] >= 0) s.route_row[rows[row]] = static_cast<int32_t>(row);
  s.status.raw = initial_device_status();
  if (!fits) {
    s.status.raw.error_bits |= kStatusCapacityOverflow;
    s.status.raw.rows_needed = int64_t(rows.size());
    s.status.raw.rows_capacity = capacity;
  }
  return s;
}

std::vector<int32_t> balanced_ids(const RoutingShape& shape, double skew, uint64_t seed) {
  std::vector<int32_t> ids;
  for (int r = 0; r < shape.ep_size; ++r) {
    auto routing = reference::random_routing(shape.num_tokens, shape.top_k, shape.num_experts, skew, seed + r);
    ids.insert(ids.end(), routing.topk_idx.begin(), routing.topk_idx.end());
  }
  return ids;
}

std::string describe(const RoutingShape& s, int tile_m, uint64_t seed, int rank) {
  std::ostringstream out;
  out << "ep=" << s.ep_size << " T=" << s.num_tokens << " k=" << s.top_k << " E=" << s.num_experts
      << " tile_m=" << tile_m << " seed=" << seed << " rank=" << rank;
  return out.str();
}

// capacity 0: the worst case (placement under any skew; the default capacity is tested on its own below).
void expect_twin_matches_oracle(const RoutingShape& shape, int tile_m, const std::vector<int32_t>& gathered,
                                uint64_t seed, int64_t capacity = 0) {
  ScheduleOptions options;
  options.tile_m = tile_m;
  options.capacity_rows = capacity > 0 ? capacity : worst_case_capacity_rows(shape, tile_m);
  for (int rank = 0; rank < shape.ep_size; ++rank) {
    const HostSchedule twin = build_schedule_host(shape, options, rank, gathered);
    const HostSchedule oracle =
        oracle_schedule(shape, tile_m, resolved_capacity_rows(shape, options), rank, gathered);
    const std::string diff = testing::compare_schedules(oracle, twin);
    ASSERT_TRUE(diff.empty()) << describe(shape, tile_m, seed, rank) << ": " << diff;
  }
}

// The int32 form of a caller's id that the gather stores and the combine's ids check compares: 64-bit ids
// saturate, so no out-of-range id wraps onto a valid expert.
TEST(PlacementTest, IdsSaturateIntoInt32) {
  EXPECT_EQ(schedule::saturate_id(-1), -1);
  EXPECT_EQ(schedule::saturate_id(7), 7);
  EXPECT_EQ(schedule::saturate_id(int64_t(1) << 31), INT32_MAX);
  EXPECT_EQ(schedule::saturate_id((int64_t(1) << 32) + 3), INT32_MAX);
  EXPECT_EQ(schedule::saturate_id(-(int64_t(1) << 40)), INT32_MIN);
  EXPECT_EQ(schedule::saturate_id(INT64_MIN), INT32_MIN);
  EXPECT_EQ(schedule::saturate_id(INT32_MIN), INT32_MIN);
}

TEST(PlacementTest, InterleavedOffsetsFollowTheRotation) {
  // Counts {3, 1, 2}: rows are s0#0 s1#0 s2#0 s0#1 s2#1 s0#2.
  const int32_t counts[3] = {3, 1, 2};
  EXPECT_EQ(schedule::interleaved_offset(counts, 3, 0, 0), 0);
  EXPECT_EQ(schedule::interleaved_offset(counts, 3, 1, 0), 1);
  EXPECT_EQ(schedule::interleaved_offset(counts, 3, 2, 0), 2);
  EXPECT_EQ(schedule::interleaved_offset(counts, 3, 0, 1), 3);
  EXPECT_EQ(schedule::interleaved_offset(counts, 3, 2, 1), 4);
  EXPECT_EQ(schedule::interleaved_offset(counts, 3, 0, 2), 5);
}

TEST(PlacementTest, ExpertOfRowSkipsEmptyExperts) {
  const int32_t offsets[5] = {0, 0, 128, 128, 384};  // experts 0 and 2 empty
  EXPECT_EQ(schedule::expert_of_row(offsets, 4, 0), 1);
  EXPECT_EQ(schedule::expert_of_row(offsets, 4, 127), 1);
  EXPECT_EQ(schedule::expert_of_row(offsets, 4, 128), 3);
  EXPECT_EQ(schedule::expert_of_row(offsets, 4, 383), 3);
}

TEST(PlacementTest, RouteIdsRoundTrip) {
  for (int src = 0; src < 3; ++src)
    for (int t = 0; t < 5; ++t)
      for (int j = 0; j < 4; ++j) {
        const auto c = schedule::route_coords(schedule::route_id(src, t, j, 5, 4), 5, 4);
        EXPECT_EQ(c.src, src);
        EXPECT_EQ(c.token, t);
        EXPECT_EQ(c.slot, j);
      }
}

TEST(ScheduleCpuTest, RandomRoutingsMatchOracle) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    for (int ep : {1, 2, 3, 8}) {
      for (int tile_m : {1, 64, 128}) {
        RoutingShape shape{ep, 777 + int(seed) * 100, 3 + int(seed), 24};
        expect_twin_matches_oracle(shape, tile_m, balanced_ids(shape, 0.0, seed), seed);
        expect_twin_matches_oracle(shape, tile_m, balanced_ids(shape, 1.5, seed), seed);
      }
    }
  }
}

TEST(ScheduleCpuTest, EmptyExpertsMaskedRoutesAndDuplicates) {
  RoutingShape shape{4, 300, 4, 64};
  std::mt19937 rng(7);
  std::vector<int32_t> ids(shape.total_routes());
  // Only even experts below 16 get routes; a quarter of the routes are masked; duplicates allowed.
  std::uniform_int_distribution<int> pick(0, 7), coin(0, 3);
  for (auto& id : ids) id = coin(rng) == 0 ? -1 : 2 * pick(rng);
  expect_twin_matches_oracle(shape, 128, ids, 7);
  const HostSchedule twin = build_schedule_host(shape, {}, 3, ids);  // rank 3 owns experts 48..63: nothing
  EXPECT_EQ(twin.scheduled_rows, 0);
  EXPECT_TRUE(twin.status.ok());
  EXPECT_TRUE(std::all_of(twin.row_route.begin(), twin.row_route.end(), [](int32_t r) { return r == -1; }));
}

TEST(ScheduleCpuTest, AllTokensToOneExpert) {
  RoutingShape shape{2, 5000, 2, 8};
  std::vector<int32_t> ids(shape.total_routes());
  for (int64_t g = 0; g < shape.total_routes(); ++g) ids[g] = g % 2 == 0 ? 5 : -1;
  expect_twin_matches_oracle(shape, 128, ids, 0);
  const HostSchedule twin = build_schedule_host(shape, {}, 1, ids);
  EXPECT_EQ(twin.expert_counts[1], 2 * 5000);
  EXPECT_EQ(twin.expert_src_counts[1 * 2 + 0], 5000);
  EXPECT_EQ(twin.expert_src_counts[1 * 2 + 1], 5000);
  // Sources alternate inside the segment.
  EXPECT_EQ(twin.row_route[0], 0);
  EXPECT_EQ(twin.row_route[1], 5000 * 2);
  EXPECT_EQ(twin.row_route[2], 2);
  EXPECT_EQ(twin.scheduled_rows, 10048);  // 10000 rows padded to 157 tiles of 64 (the default tile_m)
}

TEST(ScheduleCpuTest, CapacityOverflowPlacesNothingAndReports) {
  RoutingShape shape{2, 1000, 4, 16};
  const auto ids = balanced_ids(shape, 0.0, 11);
  ScheduleOptions options;
  const HostSchedule fit = build_schedule_host(shape, options, 0, ids);
  const int64_t needed = fit.expert_row_offsets.back();
  ASSERT_GT(needed, 0);
  options.capacity_rows = needed;
  EXPECT_TRUE(build_schedule_host(shape, options, 0, ids).status.ok());
  options.capacity_rows = needed - 1;
  const HostSchedule over = build_schedule_host(shape, options, 0, ids);
  EXPECT_EQ(over.status.raw.error_bits, kStatusCapacityOverflow);
  EXPECT_EQ(over.status.raw.rows_needed, needed);
  EXPECT_EQ(over.status.raw.rows_capacity, needed - 1);
  EXPECT_EQ(over.scheduled_rows, 0);
  EXPECT_EQ(int64_t(over.row_route.size()), needed - 1);
  EXPECT_TRUE(std::all_of(over.row_route.begin(), over.row_route.end(), [](int32_t r) { return r == -1; }));
  const std::string text = over.status.describe(1000, 4, 16);
  EXPECT_NE(text.find("needed " + std::to_string(needed) + " expert rows"), std::string::npos) << text;
  EXPECT_NE(text.find("capacity_rows >= " + std::to_string(needed)), std::string::npos) << text;
  expect_twin_matches_oracle(shape, 128, ids, 11, needed - 1);
}

// A capacity from the expected load (expected_load_capacity_rows): balanced routings at EP = 8 fit in
// 1.25x the balanced rows; all of every rank's routes to one rank's experts overflow, and the status says
// how many rows were needed; the capacity never exceeds the worst case and rejects factors below 1.
TEST(ScheduleCpuTest, ExpectedLoadCapacityFitsBalancedRoutingAndReportsSkew) {
  RoutingShape shape{8, 2048, 8, 64};
  const int tile_m = 64;
  const int64_t capacity = expected_load_capacity_rows(shape, tile_m, 1.25);
  const int64_t worst = worst_case_capacity_rows(shape, tile_m);
  EXPECT_EQ(capacity % tile_m, 0);
  EXPECT_GE(capacity, int64_t(1.25 * shape.num_tokens * shape.top_k));
  EXPECT_LT(capacity, worst / 4);
  EXPECT_EQ(expected_load_capacity_rows(shape, tile_m, 100.0), worst);
  EXPECT_THROW(expected_load_capacity_rows(shape, tile_m, 0.5), std::invalid_argument);
  ScheduleOptions options;
  options.capacity_rows = capacity;
  const auto ids = balanced_ids(shape, 0.0, 21);
  for (int rank = 0; rank < shape.ep_size; ++rank)
    EXPECT_TRUE(build_schedule_host(shape, options, rank, ids).status.ok()) << describe(shape, tile_m, 21, rank);
  std::vector<int32_t> skewed(shape.total_routes());
  for (int64_t g = 0; g < shape.total_routes(); ++g) skewed[g] = int32_t(g % shape.top_k);  // rank 0's experts
  const HostSchedule over = build_schedule_host(shape, options, 0, skewed);
  EXPECT_EQ(over.status.raw.error_bits, kStatusCapacityOverflow);
  EXPECT_EQ(over.status.raw.rows_capacity, capacity);
  EXPECT_GT(over.status.raw.rows_needed, capacity);
  EXPECT_EQ(over.scheduled_rows, 0);
}

// StatusReport::describe: every error on its own line, in the text format the tests and logs rely on.
TEST(ScheduleCpuTest, StatusDescribesEveryError) {
  StatusReport report;
  report.raw = initial_device_status();
  EXPECT_EQ(report.describe(100, 2, 8), "ok");
  report.raw.error_bits = kStatusBadExpertId | kStatusCapacityOverflow | kStatusWaitTimeout;
  report.raw.bad_route_key = (uint64_t(301) << 32) | uint32_t(-5);
  report.raw.rows_needed = 4096;
  report.raw.rows_capacity = 1024;
  report.raw.timeout_rank = 1;
  report.raw.timeout_sm = 17;
  report.raw.timeout_role = static_cast<int32_t>(Role::kGemmConsumer);
  report.raw.timeout_counter = static_cast<int32_t>(CounterId::kPipelineFull);
  report.raw.timeout_index = 3;
  report.raw.timeout_awaited = 1;
  report.raw.timeout_seen = 0;
  report.raw.abandoned_waits = 12;
  EXPECT_EQ(report.describe(100, 2, 8),
            "expert id -5 out of range [-1, 8) at route 301 (src rank 1, token 50, slot 1)\n"
            "capacity overflow: the routing needed 4096 expert rows on a rank, the workspace holds 1024 (raise "
            "ScheduleOptions.load_factor or set capacity_rows >= 4096)\n"
            "spin-wait timed out on rank 1, SM 17, role GEMM consumer, counter pipeline full[3]: awaited >= 1, saw 0\n"
            "12 later waits gave up at once (abort set)");
  report.raw.error_bits = kStatusWaitTimeout;
  report.raw.abandoned_waits = 0;
  report.raw.timeout_role = static_cast<int32_t>(Role::kBarrier);
  report.raw.timeout_counter = static_cast<int32_t>(CounterId::kBarrierArrived);
  report.raw.timeout_awaited = 18446744073709551615ull;
  EXPECT_EQ(report.describe(100, 2, 8),
            "spin-wait timed out on rank 1, SM 17, role EP barrier, counter barrier arrived[3]: awaited >= "
            "18446744073709551615, saw 0");
  // The kernel, when the wait named it (every wait of the library's kernels does).
  report.raw.timeout_kernel = static_cast<int32_t>(KernelId::kExpertGemm);
  report.raw.timeout_role = static_cast<int32_t>(Role::kGemmConsumer);
  report.raw.timeout_counter = static_cast<int32_t>(CounterId::kPipelineFull);
  report.raw.timeout_index = 0;
  report.raw.timeout_awaited = 1;
  EXPECT_EQ(report.describe(100, 2, 8),
            "spin-wait timed out on rank 1, SM 17, kernel expert_gemm, role GEMM consumer, counter pipeline full[0]: "
            "awaited >= 1, saw 0");
  report.raw.timeout_kernel = static_cast<int32_t>(KernelId::kWeightGradGemm);
  EXPECT_NE(report.describe(100, 2, 8).find("kernel weight_grad_gemm, "), std::string::npos);
  // A non-finite FP8 block (x first, then h), with the rank and the row decoded from the key.
  StatusReport nonfinite;
  nonfinite.raw = initial_device_status();
  EXPECT_EQ(nonfinite.nonfinite_row(), -1);
  nonfinite.raw.error_bits = kStatusNonFinite;
  nonfinite.raw.nonfinite_key = nonfinite_key(NonFiniteWhere::kX, 3, 77);
  EXPECT_EQ(nonfinite.nonfinite_where(), NonFiniteWhere::kX);
  EXPECT_EQ(nonfinite.nonfinite_rank(), 3);
  EXPECT_EQ(nonfinite.nonfinite_row(), 77);
  EXPECT_EQ(nonfinite.describe(100, 2, 8),
            "NaN or infinity in x: token row 77 of rank 3 (FP8: its block's scale is NaN, so that token's outputs are "
            "NaN; other tokens are not affected)");
  nonfinite.raw.nonfinite_key = nonfinite_key(NonFiniteWhere::kHidden, 0, 4100);
  EXPECT_EQ(nonfinite.describe(100, 2, 8),
            "NaN or infinity in h (the down GEMM's input) at row 4100 of an FP8 gate/up GEMM on rank 0 (that row's "
            "outputs are NaN; other rows are not affected)");
  nonfinite.raw.nonfinite_key = nonfinite_key(NonFiniteWhere::kDOut, 1, 12);
  EXPECT_EQ(nonfinite.describe(100, 2, 8),
            "NaN or infinity in d_out at row 12 of the FP8 backward's down dgrad on rank 1 (that row's token gets NaN "
            "d_x and d_router_weights, other tokens are not affected; the weight gradients, sums over every row, get "
            "NaN too)");
  nonfinite.raw.nonfinite_key = nonfinite_key(NonFiniteWhere::kDGateUp, 1, 13);
  EXPECT_NE(nonfinite.describe(100, 2, 8).find("NaN or infinity in d_g | d_u at row 13 of the FP8 backward's gate/up "
                                               "dgrad on rank 1"),
            std::string::npos);
  // The smallest key is the first cause: x, then h, then d_out, then d_g | d_u.
  EXPECT_LT(nonfinite_key(NonFiniteWhere::kHidden, 7, 1 << 20), nonfinite_key(NonFiniteWhere::kDOut, 0, 0));
  EXPECT_LT(nonfinite_key(NonFiniteWhere::kDOut, 7, 1 << 20), nonfinite_key(NonFiniteWhere::kDGateUp, 0, 0));
  // topk_idx differing from the schedule's ids: the route decoded as token and slot, the call's id.
  StatusReport mismatch;
  mismatch.raw = initial_device_status();
  EXPECT_EQ(mismatch.ids_mismatch_route(), -1);
  mismatch.raw.error_bits = kStatusIdsMismatch;
  mismatch.raw.ids_mismatch_key = (uint64_t(22) << 32) | uint32_t(-1);
  EXPECT_EQ(mismatch.ids_mismatch_route(), 22);
  EXPECT_EQ(mismatch.ids_mismatch_id(), -1);
  EXPECT_EQ(mismatch.describe(100, 4, 8),
            "topk_idx differ from the ids the context's schedule was built from, first at token 5, slot 2 (id -1 in this "
            "call): pass the forward's topk_idx, or build_schedule with these first (this call's outputs are "
            "unspecified)");
  report.raw.timeout_kernel = static_cast<int32_t>(KernelId::kForwardMegakernel);
  report.raw.timeout_role = static_cast<int32_t>(Role::kDispatch);
  report.raw.timeout_counter = static_cast<int32_t>(CounterId::kBulkCopy);
  EXPECT_NE(report.describe(100, 2, 8).find("kernel forward megakernel, role megakernel dispatch, counter bulk copy slot[0]"),
            std::string::npos)
      << report.describe(100, 2, 8);
}

TEST(ScheduleCpuTest, BadExpertIdsReportTheFirstRoute) {
  RoutingShape shape{2, 100, 2, 8};
  auto ids = balanced_ids(shape, 0.0, 5);
  ids[150] = 8;    // one past the last expert
  ids[260] = -7;   // below the mask value
  const HostSchedule s = build_schedule_host(shape, {}, 0, ids);
  EXPECT_EQ(s.status.raw.error_bits, kStatusBadExpertId);
  EXPECT_EQ(s.status.bad_route(), 150);
  EXPECT_EQ(s.status.bad_expert_id(), 8);
  EXPECT_EQ(s.status.describe(100, 2, 8), "expert id 8 out of range [-1, 8) at route 150 (src rank 0, token 75, slot 0)");
  // The rank's own ids are kept as gathered, bad ones too (the combine compares a later call's with them).
  EXPECT_EQ(s.own_ids, std::vector<int32_t>(ids.begin(), ids.begin() + shape.routes_per_rank()));
  // Bad ids are skipped, never placed.
  for (int32_t route : s.row_route) EXPECT_TRUE(route != 150 && route != 260);
}

TEST(ScheduleCpuTest, ValidationNamesTheField) {
  auto message = [](auto&& f) {
    try { f(); } catch (const std::invalid_argument& e) { return std::string(e.what()); }
    return std::string("no throw");
  };
  EXPECT_NE(message([] { RoutingShape{3, 10, 2, 8}.validate(); }).find("num_experts"), std::string::npos);
  EXPECT_NE(message([] { RoutingShape{0, 10, 2, 8}.validate(); }).find("ep_size"), std::string::npos);
  EXPECT_NE(message([] { RoutingShape{1, 10, 0, 8}.validate(); }).find("top_k"), std::string::npos);
  EXPECT_NE(message([] { ScheduleOptions o; o.tile_m = 0; o.validate(RoutingShape{1, 10, 2, 8}); }).find("tile_m"),
            std::string::npos);
  for (const double bad : {0.0, 0.999, -2.0, std::nan("")}) {
    const std::string text = message([bad] {
      ScheduleOptions o;
      o.load_factor = bad;
      o.validate(RoutingShape{4, 10, 2, 8});
    });
    EXPECT_NE(text.find("ScheduleOptions.load_factor"), std::string::npos) << bad << ": " << text;
    EXPECT_NE(message([bad] {
                ScheduleOptions o;
                o.load_factor = bad;
                build_schedule_host(RoutingShape{4, 10, 2, 8}, o, 0, std::vector<int32_t>(80, 0));
              }).find("ScheduleOptions.load_factor"),
              std::string::npos)
        << bad;
  }
  // The timeout reaches the kernels as integer nanoseconds: non-finite, non-positive or over a day is refused.
  for (const double bad : {0.0, -1.0, std::nan(""), HUGE_VAL, kMaxWaitTimeoutS * 2, 1e300}) {
    const std::string text = message([bad] {
      ScheduleOptions o;
      o.wait_timeout_s = bad;
      o.validate(RoutingShape{1, 10, 2, 8});
    });
    EXPECT_NE(text.find("ScheduleOptions.wait_timeout_s"), std::string::npos) << bad << ": " << text;
  }
  for (const double good : {1e-6, 10.0, kMaxWaitTimeoutS}) {
    EXPECT_EQ(message([good] {
                ScheduleOptions o;
                o.wait_timeout_s = good;
                o.validate(RoutingShape{1, 10, 2, 8});
                return 0;
              }),
              "no throw")
        << good;
  }
  EXPECT_EQ(message([] {
              ScheduleOptions o;
              o.load_factor = 1;  // the smallest: the balanced rows, no headroom
              o.validate(RoutingShape{4, 10, 2, 8});
              return 0;
            }),
            "no throw");
  EXPECT_NE(message([] { build_schedule_host(RoutingShape{1, 10, 2, 8}, {}, 0, std::vector<int32_t>(3)); })
                .find("gathered_topk"),
            std::string::npos);
}

TEST(ScheduleCpuTest, WorstCaseCapacityNeverOverflows) {
  for (const int ep : {2, 8}) {
    RoutingShape shape{ep, 333, 3, 8};
    std::vector<int32_t> ids(shape.total_routes(), 0);  // every route of every rank to expert 0, duplicates too
    ScheduleOptions worst;
    worst.capacity_rows = worst_case_capacity_rows(shape, worst.tile_m);
    ScheduleOptions factor_ep;  // load_factor >= ep_size: the worst case
    factor_ep.load_factor = ep;
    for (const ScheduleOptions& options : {worst, factor_ep}) {
      const HostSchedule s = build_schedule_host(shape, options, 0, ids);
      EXPECT_TRUE(s.status.ok()) << "ep " << ep << ": " << s.status.describe(333, 3, 8);
      EXPECT_EQ(s.expert_counts[0], ep * 333 * 3) << "ep " << ep;
    }
  }
}

// The default capacity (capacity_rows 0) is expected_load_capacity_rows(shape, tile_m, load_factor = 2):
// the worst case at EP 1 and 2, load_factor * T * k + the worst padding above; an explicit capacity_rows
// overrides it. At EP 8 all routes to one rank overflow it, and the report says how to fix it.
TEST(ScheduleCpuTest, DefaultCapacityIsTwiceTheExpectedLoad) {
  for (const int tile_m : {64, 128}) {
    for (const int ep : {1, 2, 4, 8}) {
      const RoutingShape shape{ep, 8192, 8, 384};
      ScheduleOptions options;
      options.tile_m = tile_m;
      EXPECT_EQ(options.load_factor, 2.0);
      const int64_t worst = worst_case_capacity_rows(shape, tile_m);
      const int64_t want = std::min<int64_t>(
          worst, schedule::round_up(2 * int64_t(8192) * 8 + int64_t(shape.local_experts()) * (tile_m - 1), tile_m));
      const std::string at = "ep " + std::to_string(ep) + " tile_m " + std::to_string(tile_m);
      EXPECT_EQ(resolved_capacity_rows(shape, options), want) << at;
      EXPECT_EQ(resolved_capacity_rows(shape, options), expected_load_capacity_rows(shape, tile_m, 2.0)) << at;
      if (ep <= 2) {
        EXPECT_EQ(resolved_capacity_rows(shape, options), worst) << at;
      } else {
        EXPECT_LT(resolved_capacity_rows(shape, options), worst) << at;
      }
      options.load_factor = ep;
      EXPECT_EQ(resolved_capacity_rows(shape, options), worst) << at;
      options.load_factor = 1e300;  // far past ep_size: still the worst case, no overflow of the arithmetic
      EXPECT_EQ(resolved_capacity_rows(shape, options), worst) << at;
      options.load_factor = 1.5;
      options.capacity_rows = 4096;  // explicit: overrides load_factor
      EXPECT_EQ(resolved_capacity_rows(shape, options), 4096) << at;
    }
  }
  const RoutingShape shape{8, 2048, 8, 64};
  std::vector<int32_t> skewed(shape.total_routes());
  for (int64_t g = 0; g < shape.total_routes(); ++g) skewed[g] = int32_t(g % shape.top_k);  // rank 0's experts
  const HostSchedule over = build_schedule_host(shape, {}, 0, skewed);
  ASSERT_EQ(over.status.raw.error_bits, kStatusCapacityOverflow);
  EXPECT_EQ(over.status.raw.rows_capacity, expected_load_capacity_rows(shape, 64, 2.0));
  EXPECT_EQ(over.status.raw.rows_needed, 8 * 2048 * 8);  // 8 experts of 16384 rows each: no padding
  const std::string text = over.status.describe(2048, 8, 64);
  EXPECT_NE(text.find("ScheduleOptions.load_factor"), std::string::npos) << text;
  EXPECT_NE(text.find("capacity_rows >= 131072"), std::string::npos) << text;
  ScheduleOptions worst;
  worst.load_factor = 8;
  EXPECT_TRUE(build_schedule_host(shape, worst, 0, skewed).status.ok());
}

}  // namespace
}  // namespace mok
