// What MoeWorkspace's constructor checks and resolves before its first collective allocation
// (detail::plan_workspace, src/host/moe_args.h), on the host: every rule of the shape and the options throws
// std::invalid_argument whose message names the field, and the plan's capacity, padded tokens and ring are those
// of the functions the constructor used before (resolved_capacity_rows, choose_ring_rows). Also the routing rule
// top_k <= num_experts, a non-finite swiglu_limit, the timeline's words at the largest record count, and
// require_distinct_ranks.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "mok/routing.h"
#include "reference/routing_gen.h"
#include "src/device/megakernel/timeline_record.h"
#include "src/device/schedule/placement.h"
#include "src/host/moe_args.h"
#include "tests/common/moe_harness.h"

namespace mok {
namespace {

MoeShape small_shape() { return testing::moe_shape(2, 300, 4, 16, 256, 128); }

// The error plan_workspace throws, or "no throw".
std::string plan_error(const MoeShape& shape, const MoeOptions& options) {
  try {
    detail::plan_workspace(shape, options);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no throw";
}

struct BadCase {
  const char* name;
  std::function<void(MoeShape&, MoeOptions&)> change;
  const char* message_start;  // what the message starts with: the field
};

TEST(WorkspacePlan, EveryRuleNamesItsField) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<BadCase> cases = {
      {"hidden", [](MoeShape& s, MoeOptions&) { s.hidden = 100; }, "MoeShape.hidden must be"},
      {"intermediate", [](MoeShape& s, MoeOptions&) { s.intermediate = 0; }, "MoeShape.intermediate must be"},
      {"swiglu_limit < 0", [](MoeShape& s, MoeOptions&) { s.swiglu_limit = -1; }, "MoeShape.swiglu_limit must be"},
      {"swiglu_limit inf", [inf](MoeShape& s, MoeOptions&) { s.swiglu_limit = inf; }, "MoeShape.swiglu_limit must be"},
      {"swiglu_limit nan", [](MoeShape& s, MoeOptions&) { s.swiglu_limit = std::nanf(""); },
       "MoeShape.swiglu_limit must be"},
      {"top_k > num_experts", [](MoeShape& s, MoeOptions&) { s.top_k = 17; }, "RoutingShape.top_k must be at most"},
      {"top_k 0", [](MoeShape& s, MoeOptions&) { s.top_k = 0; }, "RoutingShape.top_k must be >= 1"},
      {"num_experts", [](MoeShape& s, MoeOptions&) { s.num_experts = 15; }, "RoutingShape.num_experts (15)"},
      {"tile_m 32", [](MoeShape&, MoeOptions& o) { o.schedule.tile_m = 32; }, "MoeOptions.schedule.tile_m must be"},
      {"capacity_rows", [](MoeShape&, MoeOptions& o) { o.schedule.capacity_rows = 1000; },
       "MoeOptions.schedule.capacity_rows must be a multiple of tile_m"},
      {"load_factor", [](MoeShape&, MoeOptions& o) { o.schedule.load_factor = 0.5; },
       "ScheduleOptions.load_factor must be"},
      {"wait_timeout_s", [inf](MoeShape&, MoeOptions& o) { o.schedule.wait_timeout_s = inf; },
       "ScheduleOptions.wait_timeout_s must be"},
      {"setup_timeout_s 0", [](MoeShape&, MoeOptions& o) { o.setup_timeout_s = 0; },
       "MoeOptions.setup_timeout_s must be a finite number of seconds in (0, 86400]"},
      {"setup_timeout_s nan", [](MoeShape&, MoeOptions& o) { o.setup_timeout_s = std::nan(""); },
       "MoeOptions.setup_timeout_s must be"},
      {"setup_timeout_s inf", [inf](MoeShape&, MoeOptions& o) { o.setup_timeout_s = inf; },
       "MoeOptions.setup_timeout_s must be"},
      {"setup_timeout_s above a day", [](MoeShape&, MoeOptions& o) { o.setup_timeout_s = 86401; },
       "MoeOptions.setup_timeout_s must be"},
      {"macrobatch_rows", [](MoeShape&, MoeOptions& o) { o.fused.macrobatch_rows = 100; },
       "MoeOptions.fused.macrobatch_rows must be"},
      {"minibatch_rows", [](MoeShape&, MoeOptions& o) { o.fused.minibatch_rows = 0; },
       "MoeOptions.fused.minibatch_rows must be"},
      {"comm_ctas", [](MoeShape&, MoeOptions& o) { o.fused.comm_ctas = -2; }, "MoeOptions.fused.comm_ctas must be"},
      {"timeline_records < 0", [](MoeShape&, MoeOptions& o) { o.fused.timeline_records = -1; },
       "MoeOptions.fused.timeline_records must be in [0, 1048576]"},
      {"timeline_records INT_MAX",
       [](MoeShape&, MoeOptions& o) { o.fused.timeline_records = std::numeric_limits<int>::max(); },
       "MoeOptions.fused.timeline_records must be in [0, 1048576]"},
      {"backward_megakernel, unfused",
       [](MoeShape&, MoeOptions& o) {
         o.path = ForwardPath::kUnfused;
         o.fused.backward_megakernel = true;
       },
       "MoeOptions.fused.backward_megakernel needs ForwardPath::kFused"},
      {"backward_megakernel, no backward",
       [](MoeShape&, MoeOptions& o) {
         o.backward = false;
         o.fused.backward_megakernel = true;
       },
       "MoeOptions.fused.backward_megakernel needs ForwardPath::kFused"},
      {"precision", [](MoeShape&, MoeOptions& o) { o.precision = static_cast<Precision>(7); },
       "MoeOptions.precision must be kBF16 or kFP8, got 7"},
      {"fp8 backward with I not a multiple of 128",
       [](MoeShape& s, MoeOptions& o) {
         o.precision = Precision::kFP8;
         s.intermediate = 192;
       },
       "MoeOptions.precision kFP8 with MoeOptions.backward needs MoeShape.intermediate a multiple of 128"},
      {"fp8 backward with a ring below the capacity",
       [](MoeShape&, MoeOptions& o) {
         o.precision = Precision::kFP8;
         o.fused.macrobatch_rows = 128;
       },
       "MoeOptions.precision kFP8 with MoeOptions.backward needs a context that keeps every row"},
      {"fp8 with gather_rows",
       [](MoeShape&, MoeOptions& o) {
         o.precision = Precision::kFP8;
         o.backward = false;
         o.gather_rows = true;
       },
       "MoeOptions.precision kFP8 does not gather rows"},
      {"power-of-two scales in bf16", [](MoeShape&, MoeOptions& o) { o.fp8_power_of_two_scales = true; },
       "MoeOptions.fp8_power_of_two_scales is for precision kFP8"},
      {"weight-gradient columns in bf16", [](MoeShape&, MoeOptions& o) { o.fp8_weight_gradient_columns = true; },
       "MoeOptions.fp8_weight_gradient_columns is for FP8 weight gradients"},
      {"weight-gradient columns with bf16 weight gradients",
       [](MoeShape&, MoeOptions& o) {
         o.precision = Precision::kFP8;
         o.bf16_weight_gradients = true;
         o.fp8_weight_gradient_columns = true;
       },
       "MoeOptions.fp8_weight_gradient_columns is for FP8 weight gradients (precision kFP8, bf16_weight_gradients "
       "false), got precision kFP8, bf16_weight_gradients true"},
      {"task slots", [](MoeShape& s, MoeOptions&) {
         s.ep_size = 1;
         s.num_tokens = 1 << 20;
         s.top_k = 16;
         s.num_experts = 64;
         s.hidden = 16384;
         s.intermediate = MoeShape::kMaxFeatures;
       },
       "MoeShape: its GEMMs could take up to"},
      {"context budget", [](MoeShape&, MoeOptions& o) { o.context_budget_bytes = 1; },
       "MoeOptions.context_budget_bytes 1 leaves no 128-row ring"},
      {"ring below the capacity, unfused",
       [](MoeShape&, MoeOptions& o) {
         o.path = ForwardPath::kUnfused;
         o.fused.macrobatch_rows = 128;
       },
       "MoeOptions.fused.macrobatch_rows below the capacity needs ForwardPath::kFused"},
  };
  EXPECT_EQ(plan_error(small_shape(), MoeOptions{}), "no throw");
  MoeOptions fp8_backward;  // the FP8 backward's stage kernels on the unfused path's context (every row)
  fp8_backward.precision = Precision::kFP8;
  fp8_backward.path = ForwardPath::kUnfused;
  EXPECT_EQ(plan_error(small_shape(), fp8_backward), "no throw");
  fp8_backward.path = ForwardPath::kFused;  // and the backward megakernel in FP8
  fp8_backward.fused.backward_megakernel = true;
  EXPECT_EQ(plan_error(small_shape(), fp8_backward), "no throw");
  for (const BadCase& c : cases) {
    MoeShape shape = small_shape();
    MoeOptions options;
    c.change(shape, options);
    const std::string message = plan_error(shape, options);
    EXPECT_EQ(message.rfind(c.message_start, 0), 0u) << c.name << ": " << message;
  }
}

// Good options resolve to what the constructor computed from the schedule workspace and the options before.
TEST(WorkspacePlan, ResolvesTheCapacityPaddingAndRing) {
  for (const reference::ModelShape& m : reference::model_shapes())
    for (const int ep : {1, 8})
      for (const ForwardPath path : {ForwardPath::kFused, ForwardPath::kUnfused})
        for (const int tile_m : {64, 128}) {
          const MoeShape s = testing::moe_shape(ep, 1000, m.top_k, m.num_experts, m.hidden, m.intermediate,
                                                m.shared_expert);
          MoeOptions o;
          o.path = path;
          o.schedule.tile_m = tile_m;
          const detail::WorkspacePlan plan = detail::plan_workspace(s, o);
          const int64_t capacity = resolved_capacity_rows(s.routing(), o.schedule);
          const int64_t padded = schedule::round_up(s.num_tokens, tile_m);
          const int64_t elements = schedule::ScheduleLayout::make(ep, s.local_experts(), s.routing().routes_per_rank(),
                                                                  capacity)
                                       .total_elements;
          EXPECT_EQ(plan.capacity_rows, capacity) << m.name;
          EXPECT_EQ(plan.padded_tokens, padded) << m.name;
          EXPECT_EQ(plan.ring_rows, detail::choose_ring_rows(s, o, capacity, elements, padded)) << m.name;
          if (path == ForwardPath::kUnfused) {
            EXPECT_EQ(plan.ring_rows, capacity) << m.name;
          }
        }
}

// The timeline's words at the largest record count fit int64 without wrapping (capacity + 1 in int64).
TEST(WorkspacePlan, TimelineWordsAtTheBound) {
  const int most = FusedOptions::kMaxTimelineRecords;
  EXPECT_EQ(megakernel::timeline_words(132, most), int64_t(132) * 2 * (int64_t(most) + 1) * 4);
  EXPECT_GT(megakernel::timeline_block_words(std::numeric_limits<int>::max()), 0);
}

struct RankOnly {
  int rank;
};

TEST(WorkspacePlan, RanksOfOneCallAreDistinct) {
  const std::vector<RankOnly> good = {{0}, {2}, {1}}, twice = {{0}, {1}, {0}};
  EXPECT_NO_THROW(detail::require_distinct_ranks(std::span<const RankOnly>(good), "MoeWorkspace::forward"));
  try {
    detail::require_distinct_ranks(std::span<const RankOnly>(twice), "MoeWorkspace::forward");
    ADD_FAILURE() << "a rank twice passed";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "MoeWorkspace::forward: rank 0 is passed twice (one argument set per rank and call)");
  }
}

}  // namespace
}  // namespace mok
