// The forward context's memory: the ring the workspace chooses (detail::choose_ring_rows: the balanced share
// of rows, within MoeOptions::context_budget_bytes) and the bytes of the context it then allocates
// (detail::context_bytes), on the host, for the model shapes at EP = 1 and EP = 8, with the default capacity
// (ScheduleOptions::load_factor) and the worst case.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "mok/routing.h"
#include "reference/routing_gen.h"
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

// The balanced share of rows the default ring keeps: expected_load_capacity_rows at load factor 1 rounded
// down to 128 (written out here from its definition: T * k + min(E_local, T * k) * (tile_m - 1), rounded up to
// tile_m).
int64_t balanced_share(const MoeShape& s, int tile_m) {
  const int64_t routes = int64_t(s.num_tokens) * s.top_k;
  const int64_t rows = routes + std::min<int64_t>(s.local_experts(), routes) * (tile_m - 1);
  return (rows + tile_m - 1) / tile_m * tile_m / 128 * 128;
}

std::vector<Case> model_cases(int ep) {
  std::vector<Case> cases;
  for (const reference::ModelShape& m : reference::model_shapes())
    cases.push_back({m.name.c_str(), shape_of(ep, m.num_experts, m.hidden, m.intermediate, m.top_k, m.shared_expert)});
  return cases;
}

TEST(ContextBudget, RingIsTheLargestMultipleOf128OfTheShareThatFits) {
  for (const int ep : {1, 8}) {
    for (const Case& c : model_cases(ep)) {
      // The worst case (an explicit capacity_rows) and the default capacity give the same ring.
      for (const int64_t capacity : {worst_case_capacity_rows(c.shape.routing(), 64),
                                     resolved_capacity_rows(c.shape.routing(), ScheduleOptions{})}) {
        const int64_t share = std::min(capacity, balanced_share(c.shape, 64));
        for (const bool keep : {true, false}) {
          for (const int64_t budget : {int64_t{1} << 30, int64_t{4} << 30, int64_t{64} << 30}) {
            MoeOptions o;
            o.keep_gate_up = keep;
            o.context_budget_bytes = budget;
            const int64_t r = ring(c.shape, o, capacity);
            const std::string at = std::string(c.name) + " EP " + std::to_string(ep) + " capacity " +
                                   std::to_string(capacity) + " keep " + std::to_string(keep) + " budget " +
                                   std::to_string(budget) + ": ring " + std::to_string(r);
            EXPECT_LE(bytes(c.shape, o, r), budget) << at;
            if (r == share) continue;
            EXPECT_EQ(r % 128, 0) << at;
            EXPECT_GE(r, 128) << at;
            EXPECT_LT(r, share) << at;
            EXPECT_GT(bytes(c.shape, o, r + 128), budget) << at << " (not the largest)";
          }
        }
      }
    }
  }
}

// EP = 1: the default capacity is the worst case (T * k + padding, a multiple of 128 for every model shape)
// and the default ring is all of it, as before the balanced-share rule: no replay.
TEST(ContextBudget, DefaultRingAtEp1IsTheWholeCapacity) {
  const MoeOptions o;
  for (const Case& c : model_cases(1)) {
    const int64_t capacity = resolved_capacity_rows(c.shape.routing(), o.schedule);
    EXPECT_EQ(capacity, worst_case_capacity_rows(c.shape.routing(), o.schedule.tile_m)) << c.name;
    EXPECT_EQ(capacity % 128, 0) << c.name;
    EXPECT_EQ(ring(c.shape, o, capacity), capacity / 128 * 128) << c.name;
    EXPECT_EQ(ring(c.shape, o, capacity), capacity) << c.name;
    std::printf("%-16s EP 1: capacity %lld rows, ring %lld rows, context %.2f GiB\n", c.name,
                static_cast<long long>(capacity), static_cast<long long>(ring(c.shape, o, capacity)),
                bytes(c.shape, o, ring(c.shape, o, capacity)) / double(1 << 30));
  }
}

// EP = 8: the default capacity is twice the balanced rows and the default ring their share at load factor 1
// (the rows past it, from imbalance, are replayed), whatever the load factor or an explicit worst case; the
// context is a fraction of what the worst case would keep (13.2 GiB for Kimi-K2.7).
TEST(ContextBudget, DefaultRingAtEp8IsTheBalancedShare) {
  for (const Case& c : model_cases(8)) {
    MoeOptions o;
    const RoutingShape routing = c.shape.routing();
    const int64_t capacity = resolved_capacity_rows(routing, o.schedule);
    const int64_t worst = worst_case_capacity_rows(routing, 64);
    EXPECT_EQ(capacity, expected_load_capacity_rows(routing, 64, 2.0)) << c.name;
    const int64_t want = (expected_load_capacity_rows(routing, 64, 1.0) / 128) * 128;
    EXPECT_EQ(want, balanced_share(c.shape, 64)) << c.name;
    const int64_t r = ring(c.shape, o, capacity);
    EXPECT_EQ(r, want) << c.name;
    EXPECT_LT(r, capacity) << c.name;
    EXPECT_GE(r, int64_t(c.shape.num_tokens) * c.shape.top_k) << c.name << ": below the balanced rows";
    EXPECT_EQ(ring(c.shape, o, worst), want) << c.name << ": worst-case capacity";
    for (const double factor : {1.0, 1.25, 4.0, 8.0}) {
      ScheduleOptions s;
      s.load_factor = factor;
      const int64_t cap = resolved_capacity_rows(routing, s);
      // Load factor 1: the capacity is the balanced rows themselves, kept whole (a multiple of 128 or not).
      EXPECT_EQ(ring(c.shape, o, cap), factor == 1.0 ? cap : want) << c.name << " load factor " << factor;
    }
    const double gib = double(1 << 30);
    std::printf("%-16s EP 8: capacity %lld rows (worst case %lld), ring %lld rows, context %.2f GiB "
                "(worst-case ring %.2f GiB)\n",
                c.name, static_cast<long long>(capacity), static_cast<long long>(worst), static_cast<long long>(r),
                bytes(c.shape, o, r) / gib, bytes(c.shape, o, worst) / gib);
    if (std::string(c.name) == "Kimi-K2.7") {
      EXPECT_GT(bytes(c.shape, o, worst), int64_t{13} << 30);  // what the old default kept
      EXPECT_LT(bytes(c.shape, o, r), int64_t{2} << 30);
    }
  }
}

// A capacity within the balanced rows (load factor 1, or an explicit one below them) is kept whole, a
// multiple of 128 or not; one above them gets the share; the 128-row floor never exceeds the capacity.
// Qwen3.5-397B at EP 8: the balanced rows (85952) are not a multiple of 128.
TEST(ContextBudget, CapacityWithinTheBalancedRowsIsKeptWhole) {
  const MoeShape s = shape_of(8, 512, 4096, 1024, 10, true);
  const MoeOptions o;
  const int64_t balanced = expected_load_capacity_rows(s.routing(), 64, 1.0);
  ASSERT_EQ(balanced % 128, 64);
  ASSERT_EQ(balanced_share(s, 64), balanced - 64);
  for (const int64_t capacity : {int64_t{64}, int64_t{128}, int64_t{4096 + 64}, balanced})
    EXPECT_EQ(ring(s, o, capacity), capacity) << "capacity " << capacity;
  for (const int64_t capacity : {balanced + 64, balanced + 1024})
    EXPECT_EQ(ring(s, o, capacity), balanced - 64) << "capacity " << capacity;
}

TEST(ContextBudget, ExplicitRingUnfusedPathAndNoBudget) {
  const MoeShape s = shape_of(8, 384, 7168, 2048, 8, true);
  const int64_t capacity = worst_case_capacity_rows(s.routing(), 64);
  MoeOptions o;
  o.fused.macrobatch_rows = 1024;
  EXPECT_EQ(ring(s, o, capacity), 1024);  // an explicit ring wins
  o.fused.macrobatch_rows = 1 << 30;
  EXPECT_EQ(ring(s, o, capacity), capacity);  // ... up to the whole capacity
  o.fused.macrobatch_rows = 0;
  o.path = ForwardPath::kUnfused;
  EXPECT_EQ(ring(s, o, capacity), capacity);  // the unfused path holds every row
  o.path = ForwardPath::kFused;
  o.context_budget_bytes = 0;
  EXPECT_EQ(ring(s, o, capacity), balanced_share(s, 64));  // no budget: the share
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

// FP8 workspaces (MoeOptions::precision kFP8) allocate another layout (FP8 h and the rows' scales, no g | u without
// the backward): the ring is sized by that layout, so the context never exceeds the budget, a budget that holds
// FP8's 128-row ring is accepted, and keep_gate_up (which an FP8 inference context does not keep) does not change
// the ring.
TEST(ContextBudget, Fp8RingIsSizedByTheFp8Layout) {
  const auto fp8_bytes = [](const MoeShape& s, int64_t rows) {
    return detail::context_bytes(s, false, kScheduleElements, rows, kPaddedTokens, /*fp8=*/true);
  };
  for (const MoeShape& s : {shape_of(8, 256, 7168, 192, 8, true), shape_of(8, 256, 7168, 2048, 8, true),
                            shape_of(1, 384, 7168, 2048, 8, true)}) {
    const int64_t capacity = worst_case_capacity_rows(s.routing(), 64);
    MoeOptions o;
    o.precision = Precision::kFP8;
    o.backward = false;
    for (const int64_t budget : {fp8_bytes(s, 128), fp8_bytes(s, 4096) + 1000, int64_t{1} << 30}) {
      o.context_budget_bytes = budget;
      for (const bool keep : {true, false}) {
        o.keep_gate_up = keep;
        const int64_t r = ring(s, o, capacity);
        EXPECT_LE(fp8_bytes(s, r), budget) << "H " << s.hidden << " I " << s.intermediate << " budget " << budget;
        // The largest multiple of 128 that fits (or the whole share).
        if (r % 128 == 0 && r + 128 <= capacity && r < balanced_share(s, 64)) {
          EXPECT_GT(fp8_bytes(s, r + 128), budget) << "H " << s.hidden << " I " << s.intermediate << " ring " << r;
        }
      }
    }
  }
}

// The FP8 backward keeps g, u and h (keep_gate_up, the default) or recomputes them from the context's FP8 x rows,
// so with MoeOptions::backward its default ring is every capacity row, the EP = 8 load factor's headroom included
// (not the balanced share); a budget below that context (with or without g | u) is refused naming
// context_budget_bytes, not cut to a smaller ring.
TEST(ContextBudget, Fp8BackwardKeepsEveryCapacityRow) {
  const auto fp8_bytes = [](const MoeShape& s, int64_t rows, bool keep) {
    return detail::context_bytes(s, keep, kScheduleElements, rows, kPaddedTokens, /*fp8=*/true);
  };
  for (const MoeShape& s : {shape_of(8, 256, 7168, 2048, 8, true), shape_of(1, 384, 7168, 2048, 8, true)}) {
    for (const bool keep : {true, false}) {
      const std::string where = "EP " + std::to_string(s.ep_size) + (keep ? ", keep_gate_up" : ", recompute");
      const int64_t capacity = expected_load_capacity_rows(s.routing(), 64, 2.0);
      MoeOptions o;
      o.precision = Precision::kFP8;
      o.keep_gate_up = keep;
      EXPECT_EQ(ring(s, o, capacity), capacity) << where;
      o.context_budget_bytes = fp8_bytes(s, capacity, keep);
      EXPECT_EQ(ring(s, o, capacity), capacity) << where << ": a budget of exactly that context";
      o.backward = false;  // the forward alone: the balanced share, as in bf16
      EXPECT_EQ(ring(s, o, capacity), std::min(capacity, balanced_share(s, 64))) << where;
      o.backward = true;
      o.context_budget_bytes = fp8_bytes(s, capacity, keep) - 4096;
      try {
        ring(s, o, capacity);
        ADD_FAILURE() << where << ": a budget below the FP8 backward's context accepted";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("context_budget_bytes"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("every one of the"), std::string::npos) << e.what();
      }
    }
  }
}

// A decode-sized step (fewer routes than local experts): only experts with a route pad, so the worst case is
// T * k rows padded to one tile each, not one tile for every local expert.
TEST(ContextBudget, FewRoutesPadOnlyTheirExperts) {
  const RoutingShape decode{1, 1, 8, 256};
  EXPECT_EQ(worst_case_capacity_rows(decode, 64), 8 * 64);
  EXPECT_EQ(worst_case_capacity_rows(decode, 128), 8 * 128);
  EXPECT_EQ(expected_load_capacity_rows(RoutingShape{8, 1, 8, 2048}, 64, 2.0), 16 * 64);
  // Enough routes for every expert: one tile's padding per expert, as before.
  EXPECT_EQ(worst_case_capacity_rows(RoutingShape{1, 8192, 8, 256}, 64), 65536 + 256 * 63);
}

}  // namespace
}  // namespace mok
