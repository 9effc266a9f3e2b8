// The forward context's memory budget (MoeOptions::context_budget_bytes): the ring the workspace chooses
// (detail::choose_ring_rows) and the bytes of the context it then allocates (detail::context_bytes), on the
// host, for the model shapes at EP = 1 and at EP = 8 with the worst-case capacity.
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "mok/routing.h"
#include "src/host/moe_args.h"

namespace mok {
namespace {

struct Case {
  const char* name;
  MoeShape shape;
};

MoeShape shape_of(int ep, int experts, int hidden, int intermediate, int top_k, bool shared) {
  MoeShape s;
  s.ep_size = ep;
  s.num_tokens = 8192;
  s.top_k = top_k;
  s.num_experts = experts;
  s.hidden = hidden;
  s.intermediate = intermediate;
  s.shared_expert = shared;
  return s;
}

constexpr int64_t kScheduleElements = 1 << 20;  // any: a fixed part of the context
constexpr int64_t kPaddedTokens = 8192;

int64_t ring(const MoeShape& s, const MoeOptions& o, int64_t capacity) {
  return detail::choose_ring_rows(s, o, capacity, kScheduleElements, kPaddedTokens);
}

int64_t bytes(const MoeShape& s, const MoeOptions& o, int64_t rows) {
  return detail::context_bytes(s, o.keep_gate_up, kScheduleElements, rows, kPaddedTokens);
}

TEST(ContextBudget, RingIsTheLargestMultipleOf128ThatFits) {
  for (const int ep : {1, 8}) {
    for (const Case& c : {Case{"Kimi-K2.7", shape_of(ep, 384, 7168, 2048, 8, true)},
                          Case{"DeepSeek-V4-Pro", shape_of(ep, 384, 7168, 3072, 6, true)},
                          Case{"gpt-oss-120b", shape_of(ep, 128, 2880, 2880, 4, false)}}) {
      const int64_t capacity = worst_case_capacity_rows(c.shape.routing(), 64);
      for (const bool keep : {true, false}) {
        for (const int64_t budget : {int64_t{1} << 30, int64_t{4} << 30, int64_t{64} << 30}) {
          MoeOptions o;
          o.keep_gate_up = keep;
          o.context_budget_bytes = budget;
          const int64_t r = ring(c.shape, o, capacity);
          const std::string at = std::string(c.name) + " EP " + std::to_string(ep) + " keep " + std::to_string(keep) +
                                 " budget " + std::to_string(budget) + ": ring " + std::to_string(r);
          if (r == capacity) {
            EXPECT_LE(bytes(c.shape, o, r), budget) << at;
            continue;
          }
          EXPECT_EQ(r % 128, 0) << at;
          EXPECT_GE(r, 128) << at;
          EXPECT_LT(r, capacity) << at;
          EXPECT_LE(bytes(c.shape, o, r), budget) << at;
          EXPECT_GT(bytes(c.shape, o, r + 128), budget) << at << " (not the largest)";
        }
      }
    }
  }
}

TEST(ContextBudget, DefaultBoundsTheWorstCaseCapacityOnly) {
  // At EP = 1 (capacity = T * k) the default 4 GiB holds every row of every model shape; at EP = 8 the
  // worst case (8 T k rows) would not fit and the ring is cut.
  const MoeOptions o;
  const MoeShape kimi1 = shape_of(1, 384, 7168, 2048, 8, true), kimi8 = shape_of(8, 384, 7168, 2048, 8, true);
  const int64_t cap1 = worst_case_capacity_rows(kimi1.routing(), 64), cap8 = worst_case_capacity_rows(kimi8.routing(), 64);
  EXPECT_EQ(ring(kimi1, o, cap1), cap1);
  const int64_t r8 = ring(kimi8, o, cap8);
  EXPECT_LT(r8, cap8);
  EXPECT_LE(bytes(kimi8, o, r8), o.context_budget_bytes);
  std::printf("Kimi-K2.7 EP 8: capacity %lld rows, context %.2f GiB unbounded, default budget: ring %lld rows, "
              "%.2f GiB\n",
              static_cast<long long>(cap8), bytes(kimi8, o, cap8) / double(1 << 30), static_cast<long long>(r8),
              bytes(kimi8, o, r8) / double(1 << 30));
}

TEST(ContextBudget, ExplicitRingUnfusedPathAndNoBudget) {
  const MoeShape s = shape_of(8, 384, 7168, 2048, 8, true);
  const int64_t capacity = worst_case_capacity_rows(s.routing(), 64);
  MoeOptions o;
  o.fused.macrobatch_rows = 1024;
  EXPECT_EQ(ring(s, o, capacity), 1024);  // an explicit ring wins
  o.fused.macrobatch_rows = 0;
  o.path = ForwardPath::kUnfused;
  EXPECT_EQ(ring(s, o, capacity), capacity);  // the unfused path holds every row
  o.path = ForwardPath::kFused;
  o.context_budget_bytes = 0;
  EXPECT_EQ(ring(s, o, capacity), capacity);
}

TEST(ContextBudget, BadBudgetsNameTheOption) {
  const MoeShape s = shape_of(1, 384, 7168, 2048, 8, true);
  const int64_t capacity = worst_case_capacity_rows(s.routing(), 64);
  for (const int64_t budget : {int64_t{-1}, int64_t{1} << 20}) {
    MoeOptions o;
    o.context_budget_bytes = budget;
    try {
      ring(s, o, capacity);
      ADD_FAILURE() << "budget " << budget << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("context_budget_bytes"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace mok
