// MoeOptions::gather_rows and scatter_rows on the unfused forward (the routed gate/up GEMM reads this rank's rows
// straight from x: src/device/gemm/row_gather.cuh; the down GEMM writes each row to its route's combine row:
// src/device/gemm/row_scatter.cuh), one GPU, virtual ranks:
//   - bitwise equal to the copy path (gather_rows off): every rank's output and the context's hidden rows, with
//     and without the backward's buffers (at EP = 1 without them the expert-major copy is skipped), for partial
//     n-blocks, skewed routing with empty experts, all routes to a few experts, top_k 1, tile_m 64 and 128,
//     clamped SwiGLU, no shared expert, fused gate/up weights, calls of fewer tokens than the workspace's, and
//     EP 2 and 4 (rows of other ranks come from the pulled copy);
//   - the scatter, alone and with the gather, bitwise equal to the copy path on the same cases (at EP > 1 the rows
//     land in other ranks' combine buffers);
//   - the CPU reference: exact on the provenance problem (integer values that encode rank, token and expert),
//     within the forward's error budget on random data.
// The outputs are poisoned (NaN) before every call (MoeHarness::forward).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "reference/moe_reference.h"
#include "src/host/check.h"
#include "tests/common/device_array.h"
#include "tests/common/gpu_env.h"
#include "tests/common/moe_harness.h"

namespace mok {
namespace {

using testing::download;
using testing::LayerData;
using testing::MoeHarness;
using testing::moe_shape;

// Every rank's output and the hidden rows its context keeps (the gate/up GEMM's output, scheduled rows only).
struct Result {
  std::vector<std::vector<uint16_t>> out, hidden;
  std::vector<int32_t> scheduled_rows;
};

MoeOptions unfused_options(bool gather_rows, bool backward, int tile_m = 64) {
  MoeOptions options;
  options.path = ForwardPath::kUnfused;
  options.gather_rows = gather_rows;
  options.backward = backward;
  options.schedule.tile_m = tile_m;
  return options;
}

// call_tokens < 0: every token; else each rank passes its first call_tokens tokens.
Result run(const MoeShape& shape, const MoeOptions& options, const LayerData& data, bool fused_weights = false,
           int call_tokens = -1) {
  MoeHarness harness(PeerGroup::virtual_ranks(shape.ep_size), shape, options);
  harness.upload(data);
  if (fused_weights) harness.use_fused_gate_up(data);
  if (call_tokens >= 0)
    for (int r = 0; r < shape.ep_size; ++r) harness.set_call_tokens(r, call_tokens);
  Result result;
  result.out = harness.run_checked(1);
  for (int r = 0; r < shape.ep_size; ++r) {
    const ForwardContext& ctx = *harness.args(r).context;
    const int32_t scheduled = download<int32_t>(ctx.schedule().scheduled_rows, 1)[0];
    result.scheduled_rows.push_back(scheduled);
    result.hidden.push_back(download<uint16_t>(ctx.hidden(), int64_t(scheduled) * shape.intermediate));
  }
  return result;
}

std::string first_difference(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int columns) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " and " + std::to_string(want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return "row " + std::to_string(i / columns) + " col " + std::to_string(i % columns) + ": bits " +
             std::to_string(got[i]) + ", want " + std::to_string(want[i]);
  return {};
}

void expect_same(const MoeShape& shape, const Result& got, const Result& want, const std::string& label) {
  for (int r = 0; r < shape.ep_size; ++r) {
    ASSERT_EQ(got.scheduled_rows[r], want.scheduled_rows[r]) << label << ", rank " << r;
    const std::string out = first_difference(got.out[r], want.out[r], shape.hidden);
    ASSERT_TRUE(out.empty()) << label << ", rank " << r << ": output differs at " << out;
    const std::string hidden = first_difference(got.hidden[r], want.hidden[r], shape.intermediate);
    ASSERT_TRUE(hidden.empty()) << label << ", rank " << r << ": hidden rows differ at " << hidden;
  }
}

struct Case {
  std::string name;
  MoeShape shape;
  double skew = 0;
  double masked = 0;
  int tile_m = 64;
  bool fused_weights = false;
  int call_tokens = -1;
  bool all_to_first_experts = false;

  LayerData data(uint64_t seed) const {
    LayerData d = testing::random_layer(shape, seed, skew, masked);
    if (all_to_first_experts)
      for (size_t q = 0; q < d.inputs.topk_idx.size(); ++q) d.inputs.topk_idx[q] = static_cast<int32_t>(q % shape.top_k);
    return d;
  }
  // The copy path (no gather, no scatter), with the backward's buffers: what the others must equal.
  MoeOptions copy_path() const {
    MoeOptions options = unfused_options(false, true, tile_m);
    // Every routing here fits the worst case; skewed ones need more than the default capacity.
    options.schedule.load_factor = std::max(2, shape.ep_size) * (skew > 0 || all_to_first_experts ? 4 : 1);
    return options;
  }
};

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"EP 1, balanced", moe_shape(1, 300, 8, 48, 512, 256), 0, 0.02});
  c.push_back({"EP 1, partial n-blocks (H 448, I 192)", moe_shape(1, 257, 4, 16, 448, 192), 0.5, 0});
  c.push_back({"EP 1, skewed: empty experts", moe_shape(1, 200, 6, 32, 256, 128), 3.0, 0.1});
  c.push_back({"EP 1, tile_m 128", moe_shape(1, 300, 8, 48, 512, 256), 1.0, 0, 128});
  c.push_back({"EP 1, fused gate/up weights", moe_shape(1, 160, 4, 16, 256, 128), 0, 0, 64, true});
  c.push_back({"EP 1, 77 of 300 tokens", moe_shape(1, 300, 8, 48, 512, 256), 0, 0.02, 64, false, 77});
  c.push_back({"EP 1, every route to experts 0..k-1", moe_shape(1, 200, 6, 32, 256, 128), 0, 0, 64, false, -1, true});
  c.push_back({"EP 1, top_k 1", moe_shape(1, 333, 1, 8, 256, 128), 0, 0});
  MoeShape clamped = moe_shape(1, 200, 6, 32, 768, 384);
  clamped.swiglu_limit = 0.5f;
  clamped.shared_expert = false;
  c.push_back({"EP 1, clamped SwiGLU, no shared expert", clamped, 0.5, 0});
  c.push_back({"EP 2, rows of the other rank pulled", moe_shape(2, 300, 8, 48, 512, 256), 1.0, 0.02});
  c.push_back({"EP 4, skewed", moe_shape(4, 200, 6, 32, 256, 128), 1.0, 0.1});
  return c;
}

TEST(RowGatherTest, GatheredGateUpBitwiseEqualToTheCopyPath) {
  MOK_REQUIRE_GPUS(1);
  uint64_t seed = 900;
  for (const Case& c : cases()) {
    const LayerData data = c.data(++seed);
    const MoeOptions base = c.copy_path();
    const Result want = run(c.shape, base, data, c.fused_weights, c.call_tokens);
    for (bool backward : {true, false}) {
      MoeOptions gather = base;
      gather.gather_rows = true;
      gather.backward = backward;
      const std::string label = c.name + (backward ? ", backward buffers" : ", forward only") + ", seed " +
                                std::to_string(seed);
      const Result got = run(c.shape, gather, data, c.fused_weights, c.call_tokens);
      expect_same(c.shape, got, want, label);
      if (HasFatalFailure()) return;
    }
    std::printf("%-44s same bits\n", c.name.c_str());
  }
}

TEST(RowScatterTest, ScatteredDownBitwiseEqualToThePushPath) {
  MOK_REQUIRE_GPUS(1);
  uint64_t seed = 950;
  for (const Case& c : cases()) {
    const LayerData data = c.data(++seed);
    const MoeOptions base = c.copy_path();
    const Result want = run(c.shape, base, data, c.fused_weights, c.call_tokens);
    for (bool gather : {false, true}) {
      for (bool backward : {true, false}) {
        MoeOptions scatter = base;
        scatter.scatter_rows = true;
        scatter.gather_rows = gather;
        scatter.backward = backward;
        const std::string label = c.name + (gather ? ", with the gather" : "") +
                                  (backward ? ", backward buffers" : ", forward only") + ", seed " +
                                  std::to_string(seed);
        // A new workspace per run: its combine buffers are zero-filled, so a row the scatter missed is read as
        // zeros by the combine and the output differs.
        const Result got = run(c.shape, scatter, data, c.fused_weights, c.call_tokens);
        expect_same(c.shape, got, want, label);
        if (HasFatalFailure()) return;
      }
    }
    std::printf("%-44s same bits\n", c.name.c_str());
  }
}

// Provenance: exact integers, so the gathered rows and the scattered outputs are checked value by value against
// what they encode.
TEST(RowGatherTest, ProvenanceIsExact) {
  MOK_REQUIRE_GPUS(1);
  struct Rows {
    bool gather, scatter;
  };
  for (const Rows rows : {Rows{true, false}, Rows{false, true}, Rows{true, true}})
  for (int ep : {1, 2}) {
    const MoeShape shape = moe_shape(ep, 96, 4, 32, 256, 128);
    for (bool backward : {true, false}) {
      MoeOptions options = unfused_options(rows.gather, backward);
      options.scatter_rows = rows.scatter;
      MoeHarness harness(PeerGroup::virtual_ranks(ep), shape, options);
      for (int hot = 0; hot < shape.top_k; ++hot) {
        const LayerData data = testing::provenance_layer(shape, 50 + hot, 0.1, hot);
        harness.upload(data);
        harness.forward();
        for (int r = 0; r < ep; ++r) {
          ASSERT_TRUE(harness.status(r).ok()) << harness.status(r).describe(96, shape.top_k, shape.num_experts);
          const std::string mismatch = testing::check_provenance(data, r, harness.out_bits(r));
          ASSERT_TRUE(mismatch.empty()) << "EP=" << ep << (backward ? "" : " forward only") << " hot slot " << hot
                                        << " gather " << rows.gather << " scatter " << rows.scatter << ": "
                                        << mismatch;
        }
      }
    }
  }
}

// Random data against the CPU reference, with test_moe_forward's budget (2^-6 (|ref| + rms(ref)) per element plus
// the bf16 rounding of partial outputs that cancel).
TEST(RowGatherTest, MatchesCpuReference) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(1, 200, 6, 32, 512, 256);
  const LayerData data = testing::random_layer(shape, 77, 1.0, 0.05);
  MoeOptions options = unfused_options(true, false);
  options.scatter_rows = true;
  options.schedule.load_factor = 4;
  MoeHarness harness(PeerGroup::virtual_ranks(1), shape, options);
  harness.upload(data);
  harness.forward();
  ASSERT_TRUE(harness.status(0).ok()) << harness.status(0).describe(200, shape.top_k, shape.num_experts);
  const reference::ForwardTrace<float> ref = reference::forward(data.shape, data.params, data.inputs);
  const int64_t h = data.shape.hidden, k = data.shape.top_k;
  std::vector<float> extra(ref.out.size());
  for (int64_t i = 0; i < int64_t(extra.size()); ++i) {
    const int64_t token = i / h, c = i % h;
    double sum = std::fabs(ref.shared_out[i]);
    for (int64_t j = 0; j < k; ++j)
      sum += std::fabs(data.inputs.router_weights[token * k + j] * ref.route_out[(token * k + j) * h + c]);
    extra[i] = static_cast<float>(std::ldexp(sum, -8));
  }
  const auto out = harness.out_bits(0);
  const auto result = testing::compare_within_budget(out, ref.out.data(), int64_t(ref.out.size()), extra.data());
  EXPECT_LE(result.worst_ratio, 1.0) << result.describe(data.shape.hidden);
}

}  // namespace
}  // namespace mok
