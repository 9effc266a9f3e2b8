// The MoE backward (MoeWorkspace::backward and recompute_forward_context, include/mok/moe.h) on one GPU,
// virtual ranks for EP = 1, 2, 4, 8:
//   - every gradient (d_x, d_router_weights, the six weight gradients) against the CPU reference
//     (reference::backward: float storage, double accumulation) for the model shapes scaled down, within
//     the budgets of check_gradients
//   - router weight 0 routes (d_rw correct, no d_x contribution: bitwise the masked call's d_x), masked
//     routes (d_rw exactly 0), skewed routing with empty experts (their gradients exactly 0), every route on
//     one rank's experts, clamped SwiGLU, no shared expert, fused and separate gate/up weights (bitwise
//     equal), int64 ids, top_k 1
//   - GradMode: bf16 writes are the fp32 writes rounded, bitwise; fp32 accumulation over two micro-batches
//     is bitwise (0 + g1) + g2 of the written fp32 gradients; mixed modes in one call
//   - recompute_forward_context gives the forward's context bits (both forward paths, a ring of 128 rows);
//     backward bitwise equal over contexts of both paths, rings, tile heights, capacities and reruns;
//     a captured CUDA graph of forward + backward replays to the eager bits
//   - ring replay is the tested default: the fused cases run a 256-row ring below their scheduled rows (the
//     backward replays the rest, asserted each time); the library's default ring (the balanced share) and the
//     whole context are held bitwise to it
// Outputs are poisoned with NaN bits before every backward (MoeHarness::poison_grads): nothing unwritten
// passes, and NaN is infinitely far from any reference value. The bad-input rows of the backward are in
// test_bad_inputs.cpp. Full-size shapes against an fp32 GPU check on sampled rows and tiles are not built
// (issue 14 lists them; optional in this wave).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "reference/moe_reference.h"
#include "reference/routing_gen.h"
#include "src/device/schedule/placement.h"
#include "src/host/check.h"
#include "src/host/moe_args.h"
#include "tests/common/bf16.h"
#include "tests/common/device_fill.h"
#include "tests/common/gpu_env.h"
#include "tests/common/moe_harness.h"

namespace mok {
namespace {

using testing::GradSetups;
using testing::GradTensor;
using testing::kNumGradTensors;
using testing::LayerData;
using testing::MoeHarness;
using testing::moe_shape;
using testing::bf16_values;
using testing::all_weight_grads;
using testing::float_bits;
using testing::token_grads;
using Grads = testing::WeightGrads;  // [rank * kNumGradTensors + tensor]
using testing::first_difference;
using testing::raw_grads;
using testing::RawGrads;

// Error budgets, per element. The reference stores fp32 where the GPU stores bf16 (relative rounding 2^-9
// each): the recomputed g and u (the SwiGLU backward reads them rounded), h, dy = rw * d_out, d_g and d_u,
// each route's d_x partial, the shared expert's d_x partial and d_x itself; bf16 gradients once more. Sums
// are fp32 (GEMM accumulators, d_rw's n-block partials, the d_x epilogue); their errors are far below these.
// d_x and d_router_weights: |gpu - ref| <= kRelative * (|ref| + rms(ref)) over a rank's tensor (+ the d_x
// term below).
constexpr double kRelative = 0x1p-6;
// d_x sums the shared partial and the route partials after each was rounded: where they cancel, their
// roundings and their own dgrad errors (from the bf16 g, u, d_g, d_u) are the error: a few 2^-9 of each.
constexpr double kPartialsRelative = 0x1p-7;
// Weight gradients sum R rows of products whose factors carry a few 2^-9 of relative error each (d_g, d_u
// from the bf16 g, u and their own rounding, a rounding boundary flipped by the GPU's fp32 order now and
// then; dy, h rounded), so an element's error is at most a few 2^-9 of the sum of its terms' magnitudes,
// sum_r |a_r| |b_r| (reference::backward's magnitudes): where the terms cancel, that sum, not |ref|, is the
// scale (a skewed routing's experts with many rows showed 10% relative errors on near-zero elements). Budget
// kWeightRelative * sum_r |a_r b_r|: a bound, not a fit. An expert without rows must give exactly zero (its
// budget is zero). A dropped or doubled row of R errs by about 1/R of that sum, so structural errors are the
// job of the bitwise and integer-exact tests (test_weight_grad_gemm, the path/ring comparisons below).
constexpr double kWeightRelative = 0x1p-6;

struct Worst {
  double ratio = 0;
  int64_t index = -1;
  double got = 0, want = 0;
};

// Largest |got - want| / budget[n]; a zero budget needs exact equality, NaN (or any non-finite value) is
// infinitely far.
Worst worst_ratio(const float* got, const float* want, const std::vector<double>& budgets) {
  const int64_t count = static_cast<int64_t>(budgets.size());
  Worst worst;
  for (int64_t n = 0; n < count; ++n) {
    const double budget = budgets[n];
    const double error = std::fabs(double(got[n]) - want[n]);
    double ratio = 0;
    if (!std::isfinite(got[n]))
      ratio = std::numeric_limits<double>::infinity();
    else if (budget > 0)
      ratio = error / budget;
    else if (error > 0)
      ratio = std::numeric_limits<double>::infinity();
    if (worst.index < 0 || ratio > worst.ratio) worst = {ratio, n, got[n], want[n]};
  }
  return worst;
}

double rms(const float* v, int64_t count) {
  double squares = 0;
  for (int64_t n = 0; n < count; ++n) squares += double(v[n]) * v[n];
  return std::sqrt(squares / std::max<int64_t>(count, 1));
}

// Budget kRelative * (|want| + rms(want)) + extra[n].
Worst compare(const float* got, const float* want, int64_t count, const float* extra = nullptr) {
  const double floor = rms(want, count);
  std::vector<double> budgets(count);
  for (int64_t n = 0; n < count; ++n)
    budgets[n] = kRelative * (std::fabs(want[n]) + floor) + (extra != nullptr ? extra[n] : 0.0);
  return worst_ratio(got, want, budgets);
}

// One weight gradient's elements: budget kWeightRelative * magnitude (sum of its terms' |a_r b_r|).
Worst compare_weight_grad(const float* got, const float* want, const float* magnitude, int64_t count) {
  std::vector<double> budgets(count);
  for (int64_t n = 0; n < count; ++n) budgets[n] = kWeightRelative * magnitude[n];
  return worst_ratio(got, want, budgets);
}

// Every gradient of every rank against the CPU reference; returns the worst budget ratio. `label` names the
// case (shape, seed) in every failure. call_tokens (optional, per rank): the calls passed only that many of
// the rank's first tokens: d_x and d_router_weights are compared on those rows, and the rows past them must
// still hold the poison (nothing written there).
double check_gradients(MoeHarness& harness, const LayerData& data, const std::vector<float>& d_out,
                       const std::string& label, const std::vector<int>& call_tokens = {}) {
  const reference::LayerShape& s = data.shape;
  const reference::LayerGrads<float> ref = reference::backward(s, data.params, data.inputs, d_out, 0, true);
  const int64_t t = s.tokens_per_rank, h = s.hidden, i = s.intermediate, k = s.top_k;
  const int64_t e_local = s.local_experts(), expert = h * i;
  double worst_all = 0;
  auto report = [&](const Worst& w, const std::string& what, const std::string& where) {
    EXPECT_LE(w.ratio, 1.0) << label << ", " << what << ": worst |gpu - ref| / budget " << w.ratio << " at " << where
                            << " (gpu " << w.got << ", ref " << w.want << ")";
    worst_all = std::max(worst_all, w.ratio);
  };
  for (int r = 0; r < s.num_ranks; ++r) {
    const std::string rank = "rank " + std::to_string(r);
    const int64_t tr = call_tokens.empty() ? t : call_tokens[r];  // the rows this rank's call passed
    // d_x, with the partials' term.
    std::vector<float> extra(t * h);
    for (int64_t n = 0; n < tr; ++n) {
      const int64_t token = r * t + n;
      for (int64_t c = 0; c < h; ++c) {
        double sum = std::fabs(ref.route_d_x[(s.num_tokens() * k + token) * h + c]);
        for (int64_t j = 0; j < k; ++j) sum += std::fabs(ref.route_d_x[(token * k + j) * h + c]);
        extra[n * h + c] = static_cast<float>(kPartialsRelative * sum);
      }
    }
    const std::vector<uint16_t> d_x_bits = harness.d_x_bits(r);
    const std::vector<float> d_x = bf16_values(d_x_bits);
    const Worst wx = compare(d_x.data(), ref.d_x.data() + r * t * h, tr * h, extra.data());
    if (tr > 0)
      report(wx, rank + " d_x", "token " + std::to_string(wx.index / h) + ", column " + std::to_string(wx.index % h));
    // d_router_weights: within budget, and exactly +0 at masked routes.
    const std::vector<float> d_rw = harness.d_router_weights(r);
    const Worst wr = compare(d_rw.data(), ref.d_router_weights.data() + r * t * k, tr * k);
    if (tr > 0)
      report(wr, rank + " d_router_weights",
             "token " + std::to_string(wr.index / k) + ", slot " + std::to_string(wr.index % k));
    // Past the call's tokens: the poison, untouched.
    for (int64_t n = tr * h; n < t * h; ++n) {
      if (d_x_bits[n] == 0xffff) continue;
      ADD_FAILURE() << label << ", " << rank << " d_x row " << n / h << " (past the call's " << tr
                    << " tokens) was written";
      worst_all = std::numeric_limits<double>::infinity();
      break;
    }
    for (int64_t q = tr * k; q < t * k; ++q) {
      uint32_t bits = 0;
      std::memcpy(&bits, &d_rw[q], 4);
      if (bits == 0xffffffffu) continue;
      ADD_FAILURE() << label << ", " << rank << " d_router_weights row " << q / k << " (past the call's " << tr
                    << " tokens) was written";
      worst_all = std::numeric_limits<double>::infinity();
      break;
    }
    for (int64_t q = 0; q < tr * k; ++q) {
      const int32_t id = data.inputs.topk_idx[r * t * k + q];
      if (id >= 0 && id < s.num_experts) continue;
      uint32_t bits = 0;
      std::memcpy(&bits, &d_rw[q], 4);
      if (bits == 0) continue;
      ADD_FAILURE() << label << ", " << rank << " d_router_weights at the masked route (token " << q / k << ", slot "
                    << q % k << ") must be exactly 0, got " << d_rw[q] << " (first such route)";
      worst_all = std::numeric_limits<double>::infinity();
      break;
    }
    // Routed weight gradients, expert by expert (a rank's experts are global experts r * E_local + e).
    const std::tuple<GradTensor, const std::vector<float>*, const std::vector<float>*> routed[] = {
        {GradTensor::kExpertGate, &ref.d_expert_gate, &ref.magnitude_expert_gate},
        {GradTensor::kExpertUp, &ref.d_expert_up, &ref.magnitude_expert_up},
        {GradTensor::kExpertDown, &ref.d_expert_down, &ref.magnitude_expert_down}};
    for (const auto& [which, want, magnitude] : routed) {
      const std::vector<float> got = harness.weight_grad(r, which);
      if (got.empty()) continue;
      const int64_t rows = which == GradTensor::kExpertDown ? h : i, cols = expert / rows;
      for (int64_t e = 0; e < e_local; ++e) {
        const Worst w = compare_weight_grad(got.data() + e * expert, want->data() + (r * e_local + e) * expert,
                                            magnitude->data() + (r * e_local + e) * expert, expert);
        report(w, rank + " " + testing::grad_tensor_name(which) + " expert " + std::to_string(r * e_local + e),
               "row " + std::to_string(w.index / cols) + ", column " + std::to_string(w.index % cols));
      }
    }
    if (!s.shared_expert) continue;
    const reference::LayerGrads<float> shared = testing::shared_reference(data, data.params, d_out, r, true);
    const std::tuple<GradTensor, const std::vector<float>*, const std::vector<float>*> own[] = {
        {GradTensor::kSharedGate, &shared.d_shared_gate, &shared.magnitude_shared_gate},
        {GradTensor::kSharedUp, &shared.d_shared_up, &shared.magnitude_shared_up},
        {GradTensor::kSharedDown, &shared.d_shared_down, &shared.magnitude_shared_down}};
    for (const auto& [which, want, magnitude] : own) {
      const std::vector<float> got = harness.weight_grad(r, which);
      if (got.empty()) continue;
      const int64_t cols = which == GradTensor::kSharedDown ? i : h;
      const Worst w = compare_weight_grad(got.data(), want->data(), magnitude->data(), expert);
      report(w, rank + " " + testing::grad_tensor_name(which),
             "row " + std::to_string(w.index / cols) + ", column " + std::to_string(w.index % cols));
    }
  }
  return worst_all;
}

// Forward then backward of `data` with `d_out` on `harness`; throws on a status error.
void forward_backward(MoeHarness& harness, const LayerData& data, const std::vector<float>& d_out,
                      DType index_dtype = DType::kInt32) {
  harness.upload(data, index_dtype);
  harness.upload_d_out(d_out);
  harness.forward();
  harness.backward();
  harness.check_status();
}

// Ring replay, the tested default: most tests below run the fused forward with a ring of kReplayRing rows
// (replay_options), below every rank's scheduled rows, so the context keeps schedule rows [0, 256) and the
// backward replays the others (pulls their x rows again and recomputes g, u and h): the path a step takes
// past the default ring (the balanced share) whenever its routing is imbalanced. expect_replay checks that
// the replay happened, so a test cannot silently stop covering it. The default ring itself (macrobatch_rows
// 0) is the base of BitwiseEqualAcross..., checked against the CPU reference; the whole context (ring =
// capacity, nothing replayed) is one of its bitwise variants, and EP 1's default in ScaledModelShapes.
constexpr int64_t kReplayRing = 256;

// Fused: the kReplayRing ring. Unfused: the library's defaults (that path holds every row; it rejects a ring
// below the capacity).
MoeOptions replay_options(ForwardPath path = ForwardPath::kFused) {
  MoeOptions options;
  options.path = path;
  if (path == ForwardPath::kFused) options.fused.macrobatch_rows = kReplayRing;
  return options;
}

// The largest scheduled row count over the local ranks' contexts (synchronizes).
int64_t most_scheduled_rows(MoeHarness& harness) {
  harness.synchronize();
  int64_t most = 0;
  for (const RankForward& f : harness.all_args()) {
    int32_t rows = 0;
    MOK_CHECK_CUDA(cudaMemcpy(&rows, f.context->schedule().scheduled_rows, sizeof(rows), cudaMemcpyDeviceToHost));
    most = std::max<int64_t>(most, rows);
  }
  return most;
}

// After forward_backward: some rank scheduled more rows than the context kept, so its backward replayed them.
void expect_replay(MoeHarness& harness, const std::string& label) {
  const int64_t ring = harness.workspace().ring_rows(), most = most_scheduled_rows(harness);
  EXPECT_LT(ring, most) << label << ": the context kept every scheduled row (ring " << ring << ", at most " << most
                        << " rows on a rank); the backward replayed nothing";
}

std::string describe(const MoeShape& s) {
  return "EP " + std::to_string(s.ep_size) + " T " + std::to_string(s.num_tokens) + " k " + std::to_string(s.top_k) +
         " E " + std::to_string(s.num_experts) + " H " + std::to_string(s.hidden) + " I " +
         std::to_string(s.intermediate) + (s.shared_expert ? " shared" : " no-shared") +
         (s.swiglu_limit > 0 ? " L " + std::to_string(s.swiglu_limit) : "");
}

TEST(MoeBackwardTest, ScaledModelShapesMatchCpuReference) {
  MOK_REQUIRE_GPUS(1);
  const bool reduced = testing::reduced_sizes();
  const std::vector<int> eps = reduced ? std::vector<int>{1, 2} : std::vector<int>{1, 2, 4, 8};
  const int tokens = reduced ? 64 : 160;
  std::printf("shape            EP  tokens  context              worst error / budget\n");
  uint64_t seed = 200;
  int shapes = 0;
  for (const auto& m : reference::model_shapes()) {
    if (reduced && ++shapes > 2) break;
    for (int ep : eps) {
      const MoeShape shape = testing::scaled_model_shape(m, ep, tokens);
      const LayerData data = testing::random_layer(shape, ++seed, 0, ep == 4 ? 0.05 : 0);
      const std::vector<float> d_out = testing::random_d_out(shape, seed + 5000);
      // The unfused forward's context at EP 2; the fused one's with the defaults at EP 1 (the whole capacity:
      // nothing replayed), with the replay ring at EP 4 and 8.
      const MoeOptions options = ep == 1   ? MoeOptions{}
                                 : ep == 2 ? replay_options(ForwardPath::kUnfused)
                                           : replay_options();
      const char* context = ep == 1 ? "fused, whole" : ep == 2 ? "unfused" : "fused, ring 256";
      MoeHarness harness(PeerGroup::virtual_ranks(ep), shape, options);
      forward_backward(harness, data, d_out, ep == 2 ? DType::kInt64 : DType::kInt32);
      const std::string label = m.name + " (" + describe(shape) + ", " + context + "), seed " + std::to_string(seed);
      if (ep == 1) {
        EXPECT_EQ(harness.workspace().ring_rows(), harness.workspace().capacity_rows()) << label;
      }
      if (ep >= 4) expect_replay(harness, label);
      const double worst = check_gradients(harness, data, d_out, label);
      std::printf("%-16s %2d %7d  %-19s  %.3f\n", m.name.c_str(), ep, tokens, context, worst);
    }
  }
}

// Router weight 0 on some routes: their d_rw is still right (d_rw = <d_hu, h> is unscaled) and they add
// nothing to d_x, so d_x is bitwise the d_x of the same call with those routes masked. Masked routes get
// d_rw exactly 0. With and without a shared expert (without one, a token whose every weight is 0 gets d_x
// exactly +0).
TEST(MoeBackwardTest, RouterWeightZeroAndMaskedRoutes) {
  MOK_REQUIRE_GPUS(1);
  for (bool shared : {true, false}) {
    const MoeShape shape = moe_shape(2, 128, 4, 16, 256, 128, shared);
    const uint64_t seed = shared ? 301 : 302;
    LayerData data = testing::random_layer(shape, seed, 0, 0.1);
    const int64_t k = shape.top_k, tokens = int64_t(shape.ep_size) * shape.num_tokens;
    int zero_routes = 0;
    for (int64_t n = 0; n < tokens; ++n)
      for (int64_t j = 0; j < k; ++j)
        if (n % 7 == 0 || (n % 3 == 0 && j == 1)) {
          data.inputs.router_weights[n * k + j] = 0.f;
          zero_routes += data.inputs.topk_idx[n * k + j] >= 0;
        }
    ASSERT_GT(zero_routes, 0);
    const std::vector<float> d_out = testing::random_d_out(shape, seed + 5000);
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape, replay_options());
    forward_backward(harness, data, d_out);
    const std::string label = "rw = 0 (" + describe(shape) + "), seed " + std::to_string(seed);
    expect_replay(harness, label);
    std::printf("%s: worst error / budget %.3f\n", label.c_str(), check_gradients(harness, data, d_out, label));
    std::vector<std::vector<uint16_t>> d_x;
    for (int r = 0; r < 2; ++r) d_x.push_back(harness.d_x_bits(r));

    LayerData masked = data;
    for (size_t q = 0; q < masked.inputs.topk_idx.size(); ++q)
      if (masked.inputs.router_weights[q] == 0.f) masked.inputs.topk_idx[q] = -1;
    forward_backward(harness, masked, d_out);
    for (int r = 0; r < 2; ++r) {
      const std::vector<uint16_t> want = harness.d_x_bits(r);
      for (size_t n = 0; n < want.size(); ++n)
        ASSERT_EQ(d_x[r][n], want[n]) << label << ": rank " << r << " d_x token " << n / shape.hidden << " column "
                                      << n % shape.hidden << " differs from the call with the rw = 0 routes masked";
    }
  }
}

// Zipf-skewed routing (several experts get no rows: their gradients must be exactly zero), and every route
// on rank 0's experts (ranks 1..3 receive nothing), EP 4. Both need more rows on a rank than the default
// capacity (twice the balanced rows): they run with the worst case (load_factor = ep_size), and the replay ring.
TEST(MoeBackwardTest, SkewedRoutingAndEmptyExperts) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(4, 200, 6, 32, 256, 128);
  MoeOptions options = replay_options();
  options.schedule.load_factor = shape.ep_size;
  {
    const LayerData data = testing::random_layer(shape, 311, 3.0, 0.1);
    std::vector<int> rows(shape.num_experts, 0);
    for (int32_t id : data.inputs.topk_idx)
      if (id >= 0) ++rows[id];
    ASSERT_GT(std::count(rows.begin(), rows.end(), 0), 0) << "the skewed routing left no expert empty";
    const std::vector<float> d_out = testing::random_d_out(shape, 5311);
    MoeHarness harness(PeerGroup::virtual_ranks(4), shape, options);
    forward_backward(harness, data, d_out);
    expect_replay(harness, "skewed, seed 311");
    std::printf("skewed: worst error / budget %.3f\n",
                check_gradients(harness, data, d_out, "skewed (" + describe(shape) + "), seed 311"));
  }
  {
    LayerData data = testing::random_layer(shape, 312);
    for (size_t q = 0; q < data.inputs.topk_idx.size(); ++q)
      data.inputs.topk_idx[q] = static_cast<int32_t>(q % shape.top_k);  // experts 0..5 live on rank 0
    const std::vector<float> d_out = testing::random_d_out(shape, 5312);
    MoeHarness harness(PeerGroup::virtual_ranks(4), shape, options);
    forward_backward(harness, data, d_out);
    expect_replay(harness, "all to rank 0, seed 312");
    std::printf("all to rank 0: worst error / budget %.3f\n",
                check_gradients(harness, data, d_out, "all to rank 0 (" + describe(shape) + "), seed 312"));
  }
}

// Clamped SwiGLU needs integer data: the SwiGLU backward masks on the stored bf16 g and u ([g < L],
// [-L < u < L]), the reference on its fp32 ones, so a g within a rounding of L would flip the mask in one of
// them. With x in [-2, 2] and weights in [-2, 2] / 64 every g and u is a multiple of 1/64, exact in bf16 (for
// |g| < 4, all but never), and L = 0.3 lies between two such values: both masks agree. About a quarter of
// the g and half of the u are clamped.
LayerData integer_layer(const MoeShape& shape, uint64_t seed) {
  LayerData data = testing::random_layer(shape, seed);
  int64_t index = 0;
  auto fill = [&](std::vector<float>& v, float scale) {
    for (float& x : v) x = scale * static_cast<float>(testing::hashed_int(seed, index++, -2, 2));
  };
  fill(data.inputs.x, 1.f);
  for (auto* w : {&data.params.expert_gate, &data.params.expert_up, &data.params.expert_down, &data.params.shared_gate,
                  &data.params.shared_up, &data.params.shared_down})
    fill(*w, 1.f / 64);
  return data;
}

// Clamped SwiGLU without a shared expert; fused [E, 2I, H] gate/up weights give the separate weights' bits
// (every gradient); int64 ids; top_k 1 with a shared expert (its partial and the one route's may cancel).
TEST(MoeBackwardTest, ClampedSwiGLUFusedAndSeparateGateUp) {
  MOK_REQUIRE_GPUS(1);
  struct Case {
    MoeShape shape;
    bool integer;
  };
  MoeShape clamped = moe_shape(2, 128, 4, 16, 256, 128, false);
  clamped.swiglu_limit = 0.3f;
  const std::vector<Case> cases = {{clamped, true}, {moe_shape(2, 200, 1, 16, 512, 256), false}};
  uint64_t seed = 320;
  for (const Case& c : cases) {
    const LayerData data = c.integer ? integer_layer(c.shape, ++seed) : testing::random_layer(c.shape, ++seed);
    const std::vector<float> d_out = testing::random_d_out(c.shape, seed + 5000);
    const std::string label = describe(c.shape) + ", seed " + std::to_string(seed);
    MoeHarness harness(PeerGroup::virtual_ranks(2), c.shape, replay_options());
    forward_backward(harness, data, d_out, DType::kInt64);
    expect_replay(harness, label);
    std::printf("%s, separate gate/up: worst error / budget %.3f\n", label.c_str(),
                check_gradients(harness, data, d_out, label + ", separate gate/up"));
    std::vector<std::vector<float>> separate;
    for (int r = 0; r < 2; ++r)
      for (int n = 0; n < kNumGradTensors; ++n) separate.push_back(harness.weight_grad(r, GradTensor(n)));
    std::vector<std::vector<uint16_t>> d_x;
    std::vector<std::vector<float>> d_rw;
    for (int r = 0; r < 2; ++r) d_x.push_back(harness.d_x_bits(r)), d_rw.push_back(harness.d_router_weights(r));

    harness.use_fused_gate_up(data);
    forward_backward(harness, data, d_out, DType::kInt64);
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(harness.d_x_bits(r), d_x[r]) << label << ": fused gate/up d_x differs from separate, rank " << r;
      const std::vector<float> rw = harness.d_router_weights(r);
      ASSERT_EQ(std::memcmp(rw.data(), d_rw[r].data(), rw.size() * 4), 0) << label << ": d_router_weights, rank " << r;
      for (int n = 0; n < kNumGradTensors; ++n) {
        const std::vector<float> got = harness.weight_grad(r, GradTensor(n));
        const std::vector<float>& want = separate[r * kNumGradTensors + n];
        ASSERT_EQ(got.size(), want.size()) << label << ": " << testing::grad_tensor_name(GradTensor(n));
        ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
            << label << ": fused gate/up " << testing::grad_tensor_name(GradTensor(n)) << " differs, rank " << r;
      }
    }
  }
}

// bf16 writes are the fp32 writes rounded once; fp32 accumulation of two micro-batches into zeroed buffers is
// bitwise (0 + g1) + g2 of the written fp32 gradients (what kAccumulate computes: one fp32 addition per
// element and call); d_x and d_router_weights do not depend on the gradients' modes; mixed modes in one call.
TEST(MoeBackwardTest, GradModesWriteBf16Fp32AndAccumulate) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 160, 4, 16, 256, 128);
  const LayerData first = testing::random_layer(shape, 331, 0, 0.05);
  LayerData second = testing::random_layer(shape, 332, 1.0, 0.05);
  second.params = first.params;  // two micro-batches of one model
  const std::vector<float> d_out_first = testing::random_d_out(shape, 5331), d_out_second = testing::random_d_out(shape, 5332);
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape, replay_options());
  // fp32 writes of both micro-batches.
  harness.set_grads(testing::all_grads(DType::kFloat32, GradMode::kWrite));
  forward_backward(harness, first, d_out_first);
  expect_replay(harness, "fp32 write, micro-batch 1, seed 331");
  check_gradients(harness, first, d_out_first, "fp32 write, micro-batch 1, seed 331");
  const Grads g1 = all_weight_grads(harness);
  const auto tokens1 = token_grads(harness);
  forward_backward(harness, second, d_out_second);
  check_gradients(harness, second, d_out_second, "fp32 write, micro-batch 2, seed 332");
  const Grads g2 = all_weight_grads(harness);

  // bf16 writes: the fp32 values rounded once.
  harness.set_grads(testing::all_grads(DType::kBFloat16, GradMode::kWrite));
  forward_backward(harness, first, d_out_first);
  EXPECT_EQ(testing::bf16_write_difference(all_weight_grads(harness), g1), "");
  EXPECT_EQ(token_grads(harness), tokens1) << "d_x / d_router_weights depend on the weight gradients' dtype";

  // Accumulation: zero, micro-batch 1, micro-batch 2.
  harness.set_grads(testing::all_grads(DType::kFloat32, GradMode::kAccumulate));
  harness.zero_weight_grads();
  forward_backward(harness, first, d_out_first);
  EXPECT_EQ(token_grads(harness), tokens1) << "d_x / d_router_weights depend on the weight gradients' mode";
  forward_backward(harness, second, d_out_second);
  EXPECT_EQ(testing::accumulation_difference(all_weight_grads(harness), g1, g2), "");

  // Mixed in one call: down bf16 written, routed gate/up fp32 accumulated (onto zeros), shared gate/up fp32
  // written, shared down not computed.
  GradSetups mixed = testing::all_grads(DType::kFloat32, GradMode::kWrite);
  mixed[int(GradTensor::kExpertDown)].dtype = DType::kBFloat16;
  mixed[int(GradTensor::kExpertGate)].mode = GradMode::kAccumulate;
  mixed[int(GradTensor::kExpertUp)].mode = GradMode::kAccumulate;
  mixed[int(GradTensor::kSharedDown)].compute = false;
  harness.set_grads(mixed);  // zero-filled
  forward_backward(harness, first, d_out_first);
  const Grads m1 = all_weight_grads(harness);
  for (size_t n = 0; n < g1.size(); ++n) {
    const GradTensor which = GradTensor(n % kNumGradTensors);
    if (which == GradTensor::kSharedDown) {
      EXPECT_TRUE(m1[n].empty());
      continue;
    }
    ASSERT_EQ(m1[n].size(), g1[n].size());
    for (size_t x = 0; x < g1[n].size(); ++x) {
      const float want = which == GradTensor::kExpertDown ? testing::round_to_bf16(g1[n][x])
                         : (which == GradTensor::kExpertGate || which == GradTensor::kExpertUp) ? 0.f + g1[n][x]
                                                                                                 : g1[n][x];
      ASSERT_EQ(float_bits(m1[n][x]), float_bits(want))
          << "mixed modes, rank " << n / kNumGradTensors << " " << testing::grad_tensor_name(which) << " element "
          << x;
    }
  }
  EXPECT_EQ(token_grads(harness), tokens1);
}

// recompute_forward_context into fresh contexts gives the forward's context bits: x rows, hidden rows and the
// shared expert's hidden rows, after either forward path and with a ring of 128 rows (the context keeps the
// first macrobatch only); the backward of the recomputed contexts equals the backward of the forward's.
TEST(MoeBackwardTest, RecomputeGivesTheForwardContextBits) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 200, 4, 16, 256, 128);
  const LayerData data = testing::random_layer(shape, 341, 1.0, 0.05);
  const std::vector<float> d_out = testing::random_d_out(shape, 5341);
  struct Case {
    const char* name;
    ForwardPath path;
    int64_t macrobatch_rows;
  };
  for (const Case& c : {Case{"fused", ForwardPath::kFused, 0}, Case{"unfused", ForwardPath::kUnfused, 0},
                        Case{"fused, ring 128", ForwardPath::kFused, 128}}) {
    MoeOptions options;
    options.path = c.path;
    options.fused.macrobatch_rows = c.macrobatch_rows;
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
    forward_backward(harness, data, d_out);
    if (c.macrobatch_rows > 0) {
      ASSERT_LT(harness.workspace().ring_rows(), harness.workspace().capacity_rows());
      expect_replay(harness, c.name);
    }
    const RawGrads want = raw_grads(harness);
    std::vector<std::vector<uint16_t>> kept;
    for (int r = 0; r < 2; ++r) kept.push_back(harness.context_bits(*harness.args(r).context));

    std::vector<ForwardContext> fresh;
    std::vector<ForwardContext*> forward_contexts;
    for (int r = 0; r < 2; ++r) {
      fresh.push_back(harness.workspace().make_context(r));
      forward_contexts.push_back(harness.args(r).context);
    }
    std::vector<RankForward> args = harness.all_args();
    for (int r = 0; r < 2; ++r) args[r].context = &fresh[r];
    harness.workspace().build_schedule(args);
    harness.workspace().recompute_forward_context(args);
    harness.check_status();
    for (int r = 0; r < 2; ++r) {
      const std::vector<uint16_t> got = harness.context_bits(fresh[r]);
      ASSERT_EQ(got.size(), kept[r].size());
      for (size_t n = 0; n < got.size(); ++n)
        ASSERT_EQ(got[n], kept[r][n]) << c.name << ": recomputed context of rank " << r << " differs at bf16 element "
                                      << n << " (expert rows [ring, H], hidden [ring, I], shared hidden, kept g/u "
                                      << "[ring, 2I], kept shared g/u)";
    }
    for (int r = 0; r < 2; ++r) harness.args(r).context = &fresh[r];
    harness.backward();
    harness.check_status();
    EXPECT_EQ(first_difference(raw_grads(harness), want), "") << c.name << ": backward of the recomputed context";
    harness.synchronize();  // `fresh` dies before the harness
    for (int r = 0; r < 2; ++r) harness.args(r).context = forward_contexts[r];
  }
}

// The gradients do not depend on which forward path made the context, on the ring (rows beyond it are
// pulled again), the tile height or the capacity, nor on the run: bitwise. The base is the library's
// defaults (capacity at load factor 2, the ring the balanced share), against the CPU reference.
TEST(MoeBackwardTest, BitwiseEqualAcrossPathsRingsTileHeightsCapacitiesKeptGateUpAndReruns) {
  MOK_REQUIRE_GPUS(1);
  const bool reduced = testing::reduced_sizes();
  const MoeShape shape = moe_shape(4, reduced ? 96 : 300, 8, 64, 512, 256);
  const LayerData data = testing::random_layer(shape, 351, 1.0, 0.02);
  const std::vector<float> d_out = testing::random_d_out(shape, 5351);
  MoeHarness base(PeerGroup::virtual_ranks(4), shape);
  forward_backward(base, data, d_out);
  ASSERT_EQ(base.workspace().capacity_rows(), expected_load_capacity_rows(shape.routing(), 64, 2.0));
  ASSERT_EQ(base.workspace().ring_rows(), expected_load_capacity_rows(shape.routing(), 64, 1.0) / 128 * 128);
  check_gradients(base, data, d_out, "base (" + describe(shape) + "), seed 351");
  const RawGrads want = raw_grads(base);
  for (int run = 1; run < 3; ++run) {
    base.backward();
    base.check_status();
    ASSERT_EQ(first_difference(raw_grads(base), want), "") << "backward rerun " << run;
  }
  struct Variant {
    const char* name;
    MoeOptions options;
  };
  std::vector<Variant> variants(15);
  variants[0].name = "unfused forward";
  variants[0].options.path = ForwardPath::kUnfused;
  variants[1].name = "fused forward, ring 128";
  variants[1].options.fused.macrobatch_rows = 128;
  variants[2].name = "fused forward, ring 512";
  variants[2].options.fused.macrobatch_rows = 512;
  variants[3].name = "tile_m 128";
  variants[3].options.schedule.tile_m = 128;
  // Below the default (5824 rows at T = 300, 2560 at T = 96) at T = 300, above it at T = 96, and below the
  // worst case (10624, 4096); enough for this routing (at most about 3300 and 1600 rows on a rank).
  variants[4].name = "capacity below the worst case";
  variants[4].options.schedule.capacity_rows = reduced ? 3072 : 5120;
  // The default keeps g and u from the forward; recomputing them in the backward gives the same bits.
  variants[5].name = "g/u recomputed (keep_gate_up false), fused forward";
  variants[5].options.keep_gate_up = false;
  variants[6].name = "g/u recomputed (keep_gate_up false), unfused forward";
  variants[6].options.keep_gate_up = false;
  variants[6].options.path = ForwardPath::kUnfused;
  // The whole context: every row of the (worst-case) capacity kept, nothing replayed.
  variants[7].name = "whole context (ring = worst-case capacity)";
  variants[7].options.schedule.load_factor = shape.ep_size;
  variants[7].options.fused.macrobatch_rows = int64_t{1} << 30;
  variants[8].name = "fused forward, ring 256 (replay)";
  variants[8].options = replay_options();
  // MoeOptions::scatter_rows: the unfused forward's down GEMM and the backward's gate/up dgrad write the combine
  // rows themselves (the fused forward ignores it; its backward still scatters).
  variants[9].name = "scatter rows, unfused forward";
  variants[9].options.path = ForwardPath::kUnfused;
  variants[9].options.scatter_rows = true;
  variants[10].name = "scatter rows, fused forward, ring 256 (replay)";
  variants[10].options = replay_options();
  variants[10].options.scatter_rows = true;
  variants[11].name = "scatter rows, tile_m 128, g/u recomputed, unfused forward";
  variants[11].options.path = ForwardPath::kUnfused;
  variants[11].options.schedule.tile_m = 128;
  variants[11].options.keep_gate_up = false;
  variants[11].options.scatter_rows = true;
  // MoeOptions::gather_rows: the unfused forward's gate/up GEMM and the stage backward's down dgrad read this
  // rank's rows from x and d_out themselves (EP 4: the other ranks' rows from the pulled copies); the fused
  // forward ignores it, its stage backward still gathers.
  variants[12].name = "gather rows, unfused forward";
  variants[12].options.path = ForwardPath::kUnfused;
  variants[12].options.gather_rows = true;
  variants[13].name = "gather rows, fused forward, ring 256 (replay)";
  variants[13].options = replay_options();
  variants[13].options.gather_rows = true;
  variants[14].name = "gather and scatter rows, tile_m 128, g/u recomputed, unfused forward";
  variants[14].options.path = ForwardPath::kUnfused;
  variants[14].options.schedule.tile_m = 128;
  variants[14].options.keep_gate_up = false;
  variants[14].options.gather_rows = true;
  variants[14].options.scatter_rows = true;
  for (const Variant& v : variants) {
    MoeHarness harness(PeerGroup::virtual_ranks(4), shape, v.options);
    forward_backward(harness, data, d_out);
    EXPECT_EQ(first_difference(raw_grads(harness), want), "") << v.name;
    const MoeWorkspace& ws = harness.workspace();
    if (v.options.path == ForwardPath::kUnfused || v.options.fused.macrobatch_rows > ws.capacity_rows()) {
      EXPECT_EQ(ws.ring_rows(), ws.capacity_rows()) << v.name;
    }
    if (v.options.fused.macrobatch_rows > 0 && v.options.fused.macrobatch_rows <= 512) expect_replay(harness, v.name);
  }
}

// EP = 1: the stage kernels' epilogue reads the d_x_route rows where the gate/up dgrad wrote them (and the unfused
// forward's combine the y rows: MoeWorkspace::local_combine). The same bits as the paths that copy them into the
// combine buffer first: the scattered dgrad (scatter_rows) and the backward megakernel's copies; and the gathered
// gate/up and down dgrad (gather_rows); the forward's output too (unfused local == unfused scattered == fused).
// Skewed routing with empty experts, masked routes, tile_m 128, fewer tokens than the workspace's; against the CPU
// reference once.
TEST(MoeBackwardTest, EpOneCombinesFromTheExpertRowsBitwise) {
  MOK_REQUIRE_GPUS(1);
  struct Case {
    MoeShape shape;
    double skew, masked;
    int tile_m, call_tokens;
  };
  // Without a shared expert the kernels read x, d_out and the router weights where the caller keeps them (no
  // symmetric copies at EP 1): the last two cases.
  const std::vector<Case> cases = {{moe_shape(1, 300, 8, 48, 512, 256), 0, 0.02, 64, -1},
                                   {moe_shape(1, 257, 4, 16, 448, 192), 2.0, 0.1, 128, -1},
                                   {moe_shape(1, 300, 6, 32, 256, 128), 0.5, 0, 64, 77},
                                   {moe_shape(1, 257, 4, 16, 448, 192, false), 1.0, 0.05, 64, -1},
                                   {moe_shape(1, 300, 6, 32, 256, 128, false), 0.5, 0.02, 128, 77}};
  uint64_t seed = 640;
  for (const Case& c : cases) {
    const LayerData data = testing::random_layer(c.shape, ++seed, c.skew, c.masked);
    const std::vector<float> d_out = testing::random_d_out(c.shape, seed + 5000);
    const std::string label = describe(c.shape) + ", tile_m " + std::to_string(c.tile_m) + ", seed " +
                              std::to_string(seed);
    struct Variant {
      const char* name;
      MoeOptions options;
    };
    std::vector<Variant> variants(5);
    for (Variant& v : variants) {
      v.options.schedule.tile_m = c.tile_m;
      v.options.schedule.load_factor = 4;  // the skewed routing's rows fit
    }
    variants[0].name = "unfused forward, local combine (the default at EP 1)";
    variants[0].options.path = ForwardPath::kUnfused;
    variants[1].name = "unfused forward, scatter_rows (combine buffer)";
    variants[1].options.path = ForwardPath::kUnfused;
    variants[1].options.scatter_rows = true;
    variants[2].name = "fused forward, backward megakernel (combine buffer)";
    variants[2].options.fused.backward_megakernel = true;
    variants[3].name = "fused forward, stage backward with local combine";
    // Every route local: the down dgrad gathers all of d_out's rows, pull_grad_rows copies none.
    variants[4].name = "unfused forward, gather_rows (x and d_out rows read by the GEMMs' producers)";
    variants[4].options.path = ForwardPath::kUnfused;
    variants[4].options.gather_rows = true;
    RawGrads want;
    std::vector<std::vector<uint16_t>> want_out;
    for (size_t i = 0; i < variants.size(); ++i) {
      MoeHarness harness(PeerGroup::virtual_ranks(1), c.shape, variants[i].options);
      harness.upload(data);
      harness.upload_d_out(d_out);
      if (c.call_tokens >= 0) harness.set_call_tokens(0, c.call_tokens);
      harness.forward();
      harness.backward();
      harness.check_status();
      const RawGrads grads = raw_grads(harness);
      const std::vector<uint16_t> out = harness.out_bits(0);
      if (i == 0) {
        if (c.call_tokens < 0) check_gradients(harness, data, d_out, label);
        want = grads;
        want_out = {out};
        continue;
      }
      EXPECT_EQ(first_difference(grads, want), "") << variants[i].name << " vs " << variants[0].name << ", " << label;
      EXPECT_TRUE(out == want_out[0]) << "forward output: " << variants[i].name << " vs " << variants[0].name << ", "
                                      << label;
    }
  }
}

// forward + backward captured in one CUDA graph (virtual ranks: one stream) replays to the eager bits, and
// reads its inputs at replay (alternating inputs give alternating results).
TEST(MoeBackwardTest, CudaGraphReplayOfForwardAndBackward) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 256, 4, 16, 256, 128);
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape, replay_options());
  const LayerData data = testing::random_layer(shape, 361), other = testing::random_layer(shape, 362);
  const std::vector<float> d_out = testing::random_d_out(shape, 5361), d_out_other = testing::random_d_out(shape, 5362);
  forward_backward(harness, data, d_out);
  expect_replay(harness, "graph, eager, seed 361");
  const RawGrads eager = raw_grads(harness);

  cudaStream_t stream = harness.stream(0);
  const std::vector<RankBackward> backward_args = harness.all_backward_args();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOK_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  harness.workspace().forward(harness.all_args());
  harness.workspace().backward(backward_args);
  MOK_CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  MOK_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 4; ++replay) {
    const bool first = replay % 2 == 0;
    harness.upload(first ? data : other);
    harness.upload_d_out(first ? d_out : d_out_other);
    harness.poison_outputs();
    harness.poison_grads();
    MOK_CHECK_CUDA(cudaGraphLaunch(exec, stream));
    harness.check_status();
    const RawGrads got = raw_grads(harness);
    if (first) {
      ASSERT_EQ(first_difference(got, eager), "") << "replay " << replay;
    } else {
      ASSERT_NE(first_difference(got, eager), "") << "replay " << replay << " ignored its new inputs";
    }
  }
  // The odd replays against the CPU reference too.
  harness.upload(other);
  harness.upload_d_out(d_out_other);
  harness.poison_grads();
  MOK_CHECK_CUDA(cudaGraphLaunch(exec, stream));
  harness.check_status();
  check_gradients(harness, other, d_out_other, "graph replay, seed 362");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// The backward megakernel (FusedOptions::backward_megakernel: one launch per rank) equals the unfused
// backward bit for bit, for the scaled model shapes at EP 1, 2, 4 and 8 on virtual ranks with skewed routing
// (empty experts), in every weight-gradient mode (written bf16, written fp32, accumulated over two calls),
// across the fused knobs: communication in the producer warps or in two dedicated CTAs, minibatches of 128
// rows, rings small enough that the backward recomputes the rows past them, g/u recomputed for every row, and
// reruns.
TEST(MoeBackwardTest, FusedBackwardEqualsUnfusedBitwise) {
  MOK_REQUIRE_GPUS(1);
  const bool reduced = testing::reduced_sizes();
  const std::vector<int> eps = reduced ? std::vector<int>{1, 2} : std::vector<int>{1, 2, 4, 8};
  const int tokens = reduced ? 64 : 192;
  struct Variant {
    const char* name;
    MoeOptions options;
  };
  std::vector<Variant> variants(5);
  variants[0].name = "fused defaults";
  variants[1].name = "two communication CTAs";
  variants[1].options.fused.comm_ctas = 2;
  variants[2].name = "minibatch 128";
  variants[2].options.fused.minibatch_rows = 128;
  variants[3].name = "ring 256 (rows past it recomputed)";
  variants[3].options.fused.macrobatch_rows = 256;
  variants[4].name = "g/u recomputed, ring 128, minibatch 256";
  variants[4].options.keep_gate_up = false;
  variants[4].options.fused.macrobatch_rows = 128;
  variants[4].options.fused.minibatch_rows = 256;
  const std::pair<const char*, GradSetups> modes[] = {
      {"fp32 write", testing::all_grads(DType::kFloat32, GradMode::kWrite)},
      {"bf16 write", testing::all_grads(DType::kBFloat16, GradMode::kWrite)},
      {"fp32 accumulate", testing::all_grads(DType::kFloat32, GradMode::kAccumulate)}};
  uint64_t seed = 900;
  int shapes = 0;
  for (const auto& m : reference::model_shapes()) {
    if (reduced && ++shapes > 2) break;
    for (int ep : eps) {
      const MoeShape shape = testing::scaled_model_shape(m, ep, tokens);
      const LayerData data = testing::random_layer(shape, ++seed, 1.0, 0.05);
      const std::vector<float> d_out = testing::random_d_out(shape, seed + 5000);
      const std::string label = m.name + " (" + describe(shape) + "), seed " + std::to_string(seed);
      MoeOptions unfused;
      unfused.path = ForwardPath::kUnfused;
      // Every rank may receive every route (the skew): capacities that never overflow, for both paths.
      unfused.schedule.capacity_rows = worst_case_capacity_rows(shape.routing(), unfused.schedule.tile_m);
      MoeHarness want_harness(PeerGroup::virtual_ranks(ep), shape, unfused);
      std::vector<RawGrads> want;  // by mode
      for (const auto& [mode_name, setups] : modes) {
        want_harness.set_grads(setups);
        forward_backward(want_harness, data, d_out);
        if (want.empty()) check_gradients(want_harness, data, d_out, "unfused, fp32 write, " + label);
        if (setups[0].mode == GradMode::kAccumulate) forward_backward(want_harness, data, d_out);  // adds twice
        want.push_back(raw_grads(want_harness));
      }
      for (const Variant& v : variants) {
        MoeOptions options = v.options;
        options.fused.backward_megakernel = true;
        options.schedule.capacity_rows = unfused.schedule.capacity_rows;
        MoeHarness harness(PeerGroup::virtual_ranks(ep), shape, options);
        for (size_t n = 0; n < std::size(modes); ++n) {
          harness.set_grads(modes[n].second);
          forward_backward(harness, data, d_out);
          if (modes[n].second[0].mode == GradMode::kAccumulate) forward_backward(harness, data, d_out);
          ASSERT_EQ(first_difference(raw_grads(harness), want[n]), "")
              << v.name << ", " << modes[n].first << ", " << label;
        }
        // A rerun of the last mode (accumulate: buffers zeroed first) repeats its bits.
        harness.zero_weight_grads();
        forward_backward(harness, data, d_out);
        forward_backward(harness, data, d_out);
        ASSERT_EQ(first_difference(raw_grads(harness), want.back()), "") << v.name << ", rerun, " << label;
      }
      std::printf("%-16s EP %d: fused backward bitwise equal to unfused in %zu variants x %zu modes\n",
                  m.name.c_str(), ep, variants.size(), std::size(modes));
    }
  }
}

// What the backward keeps per layer and per rank, printed for the record (docs/design.md, "Backward"): with
// the defaults (at EP 2 the capacity is the worst case, the ring the balanced share below it), and with the
// whole context (ring = capacity).
// The problem a call of `tokens[r]` of rank r's first tokens computes: the rows past them absent (x and
// d_out rows zero, routes masked: they add nothing to any output or gradient).
std::pair<LayerData, std::vector<float>> first_tokens_only(const LayerData& data, const std::vector<float>& d_out,
                                                          const std::vector<int>& tokens) {
  LayerData masked = data;
  std::vector<float> masked_d_out = d_out;
  const int64_t t = data.shape.tokens_per_rank, h = data.shape.hidden, k = data.shape.top_k;
  for (int r = 0; r < data.shape.num_ranks; ++r) {
    for (int64_t n = tokens[r]; n < t; ++n) {
      const int64_t token = r * t + n;
      std::fill_n(masked.inputs.x.begin() + token * h, h, 0.f);
      std::fill_n(masked_d_out.begin() + token * h, h, 0.f);
      std::fill_n(masked.inputs.topk_idx.begin() + token * k, k, -1);
    }
  }
  return {masked, masked_d_out};
}

// out of every rank's call against the reference of `reference_data` (rows [0, tokens[r])), and the rows past
// the call's tokens still the poison. Returns the worst budget ratio.
double check_call_outputs(MoeHarness& harness, const LayerData& reference_data, const std::vector<int>& tokens,
                          const std::string& label) {
  const reference::ForwardTrace<float> ref =
      reference::forward(reference_data.shape, reference_data.params, reference_data.inputs);
  const int64_t t = reference_data.shape.tokens_per_rank, h = reference_data.shape.hidden,
                k = reference_data.shape.top_k;
  double worst = 0;
  for (int r = 0; r < reference_data.shape.num_ranks; ++r) {
    const std::vector<uint16_t> out = harness.out_bits(r);
    const int64_t rows = tokens[r];
    std::vector<float> extra(rows * h);  // the bf16 roundings of shared and expert outputs where they cancel
    for (int64_t n = 0; n < rows * h; ++n) {
      const int64_t token = r * t + n / h, c = n % h;
      double sum = std::fabs(ref.shared_out[token * h + c]);
      for (int64_t j = 0; j < k; ++j)
        sum += std::fabs(reference_data.inputs.router_weights[token * k + j] * ref.route_out[(token * k + j) * h + c]);
      extra[n] = static_cast<float>(std::ldexp(sum, -8));
    }
    const auto result = testing::compare_within_budget(out, ref.out.data() + r * t * h, rows * h, extra.data());
    if (rows > 0) {
      EXPECT_LE(result.worst_ratio, 1.0) << label << " rank " << r << " out: " << result.describe(h);
    }
    worst = std::max(worst, rows > 0 ? result.worst_ratio : 0.0);
    for (int64_t n = rows * h; n < t * h; ++n) {
      if (out[n] == testing::kBf16Poison) continue;
      ADD_FAILURE() << label << " rank " << r << ": out row " << n / h << " (past the call's " << rows
                    << " tokens) was written";
      return std::numeric_limits<double>::infinity();
    }
  }
  return worst;
}

// Any token count up to the workspace's per call, different ones per rank (0 too: that rank still serves its
// experts), both paths: out and every gradient against the reference of the same problem without the rows
// past each rank's count; the inputs' rows past the count hold real values and ids, which must be ignored.
TEST(MoeBackwardTest, AnyTokenCountPerRankUpToTheWorkspaces) {
  MOK_REQUIRE_GPUS(1);
  const std::pair<int, std::vector<int>> cases[] = {
      {1, {130}}, {1, {0}}, {2, {192, 0}}, {4, {77, 192, 0, 1}}, {8, {192, 0, 77, 130, 1, 64, 191, 100}}};
  std::printf("EP  tokens per rank (workspace 192)        path     out / budget  grads / budget\n");
  uint64_t seed = 300;
  for (const auto& [ep, tokens] : cases) {
    for (const ForwardPath path : {ForwardPath::kFused, ForwardPath::kUnfused}) {
      const MoeShape shape = moe_shape(ep, 192, 4, 4 * ep, 256, 128);
      const LayerData data = testing::random_layer(shape, ++seed, 0, 0.05);
      const std::vector<float> d_out = testing::random_d_out(shape, seed);
      const auto [reference_data, reference_d_out] = first_tokens_only(data, d_out, tokens);
      MoeOptions options;
      options.path = path;
      MoeHarness harness(PeerGroup::virtual_ranks(ep), shape, options);
      harness.upload(data);
      harness.upload_d_out(d_out);
      for (int r = 0; r < ep; ++r) harness.set_call_tokens(r, tokens[r]);
      harness.forward();
      harness.backward();
      harness.check_status();
      std::string list;
      for (int n : tokens) {
        if (!list.empty()) list += ',';
        list += std::to_string(n);
      }
      const std::string label = describe(shape) + " tokens " + list + " seed " + std::to_string(seed) +
                                (path == ForwardPath::kFused ? " fused" : " unfused");
      const double out_worst = check_call_outputs(harness, reference_data, tokens, label);
      const double grad_worst = check_gradients(harness, reference_data, reference_d_out, label, tokens);
      std::printf("%2d  %-38s %-8s %12.3f  %14.3f\n", ep, list.c_str(),
                  path == ForwardPath::kFused ? "fused" : "unfused", out_worst, grad_worst);
    }
  }
}

// A call of T tokens on a workspace made for more gives the bits of a workspace made for exactly T (out and
// every gradient; EP 1 with and without a shared expert -- without one the kernels read the caller's tensors
// in place -- and EP 2 with T on both ranks), on both paths, and the two paths agree bitwise.
TEST(MoeBackwardTest, FewerTokensGiveTheBitsOfAWorkspaceOfExactlyThatMany) {
  MOK_REQUIRE_GPUS(1);
  uint64_t seed = 400;
  for (const auto& [ep, shared] : {std::pair{1, true}, std::pair{1, false}, std::pair{2, true}}) {
    for (const int tokens : {100, 64, 1}) {
      const MoeShape shape = moe_shape(ep, 256, 4, 8, 256, 192, shared);
      const LayerData data = testing::random_layer(shape, ++seed, 0, 0.05);
      const std::vector<float> d_out = testing::random_d_out(shape, seed);
      const auto [exact_data, exact_d_out] = testing::exactly_tokens(data, d_out, tokens);
      MoeShape exact_shape = shape;
      exact_shape.num_tokens = tokens;
      const std::string label = describe(shape) + " calls of " + std::to_string(tokens) + " tokens";
      std::vector<std::vector<uint16_t>> path_out;
      std::vector<RawGrads> path_grads;
      for (const ForwardPath path : {ForwardPath::kFused, ForwardPath::kUnfused}) {
        MoeOptions options;
        options.path = path;
        MoeHarness larger(PeerGroup::virtual_ranks(ep), shape, options);
        larger.upload(data);
        larger.upload_d_out(d_out);
        for (int r = 0; r < ep; ++r) larger.set_call_tokens(r, tokens);
        larger.forward();
        larger.backward();
        larger.check_status();
        MoeHarness exact(PeerGroup::virtual_ranks(ep), exact_shape, options);
        exact.upload(exact_data);
        exact.upload_d_out(exact_d_out);
        exact.forward();
        exact.backward();
        exact.check_status();
        const std::string where = label + (path == ForwardPath::kFused ? " fused" : " unfused");
        std::vector<uint16_t> all_out;
        for (int r = 0; r < ep; ++r) {
          std::vector<uint16_t> out = larger.out_bits(r);
          out.resize(int64_t(tokens) * shape.hidden);
          EXPECT_EQ(out, exact.out_bits(r)) << where << ": rank " << r << " out differs from the exact workspace's";
          all_out.insert(all_out.end(), out.begin(), out.end());
        }
        const RawGrads grads = raw_grads(larger);
        EXPECT_EQ(first_difference(grads, raw_grads(exact)), "") << where << ": gradients differ from the exact "
                                                                 << "workspace's";
        path_out.push_back(all_out);
        path_grads.push_back(grads);
      }
      EXPECT_EQ(path_out[0], path_out[1]) << label << ": out differs between the fused and unfused paths";
      EXPECT_EQ(first_difference(path_grads[0], path_grads[1]), "") << label << ": gradients differ between paths";
      std::printf("%s: bitwise equal to a workspace of exactly %d tokens, both paths\n", describe(shape).c_str(),
                  tokens);
    }
  }
}

// Token counts the workspace cannot serve are refused before anything is issued, naming the argument, and
// the next good call is correct: more tokens than the workspace's num_tokens; tensors of one call that
// disagree on T; a backward whose T is not its forward's.
TEST(MoeBackwardTest, TokenCountsOutsideTheWorkspaceAreRefused) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 128, 2, 8, 256, 128);
  const LayerData data = testing::random_layer(shape, 501);
  const std::vector<float> d_out = testing::random_d_out(shape, 501);
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
  harness.upload(data);
  harness.upload_d_out(d_out);
  auto refused = [&](auto&& call, const std::string& expected) {
    try {
      call();
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no std::invalid_argument; expected one naming \"" << expected << "\"";
  };
  std::vector<RankForward> args = harness.all_args();
  args[1].topk_idx.shape[0] = 129;  // past the workspace's 128
  refused([&] { harness.workspace().forward(args); }, "at most MoeShape.num_tokens = 128");
  args = harness.all_args();
  args[0].topk_idx.shape[0] = 100;  // x, router_weights and out still say 128
  refused([&] { harness.workspace().forward(args); }, "x: expected bf16 [100, 256]");
  harness.set_call_tokens(0, 100);
  harness.set_call_tokens(1, 50);
  harness.forward();
  std::vector<RankBackward> back = harness.all_backward_args();
  back[1].topk_idx.shape[0] = back[1].x.shape[0] = back[1].router_weights.shape[0] = 51;
  back[1].d_out.shape[0] = back[1].d_x.shape[0] = back[1].d_router_weights.shape[0] = 51;
  refused([&] { harness.workspace().backward(back); }, "the context holds a forward of 50");
  harness.backward();
  harness.check_status();
  const auto [reference_data, reference_d_out] = first_tokens_only(data, d_out, {100, 50});
  EXPECT_LE(check_call_outputs(harness, reference_data, {100, 50}, "after the refused calls"), 1.0);
  EXPECT_LE(check_gradients(harness, reference_data, reference_d_out, "after the refused calls", {100, 50}), 1.0);
}

TEST(MoeBackwardTest, ContextAndBackwardBytes) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 256, 4, 16, 256, 128);
  for (const bool whole : {false, true}) {
    for (const bool keep : {true, false}) {
      MoeOptions options;
      options.keep_gate_up = keep;
      if (whole) options.fused.macrobatch_rows = int64_t{1} << 30;
      MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
      const MoeWorkspace& ws = harness.workspace();
      const int64_t h = shape.hidden, i = shape.intermediate, cap = ws.capacity_rows(), pt = ws.padded_tokens();
      const int64_t ring = ws.ring_rows(), context = harness.args(0).context->bytes();
      EXPECT_EQ(cap, worst_case_capacity_rows(shape.routing(), 64));
      EXPECT_EQ(ring, whole ? cap : expected_load_capacity_rows(shape.routing(), 64, 1.0) / 128 * 128);
      EXPECT_EQ(harness.args(0).context->ring_rows(), ring);
      // The context: x rows and h of the ring's rows and the shared h, plus g | u of both when kept. The
      // backward's scratch: d_out rows, dy rows, d_g | d_u of every row of the capacity, the shared d_x, plus
      // the recomputed h and g | u when not kept or the ring is below the capacity.
      const bool recomputes = !keep || ring < cap;
      EXPECT_GE(context, ring * (h + i + (keep ? 2 * i : 0)) * 2 + pt * (i + (keep ? 2 * i : 0)) * 2);
      const int64_t schedule_elements =
          schedule::ScheduleLayout::make(2, shape.local_experts(), shape.routing().routes_per_rank(), cap)
              .total_elements;
      EXPECT_EQ(context, detail::context_bytes(shape, keep, schedule_elements, ring, pt));  // the ring's rows only
      EXPECT_GE(ws.backward_bytes(), cap * (2 * h + 2 * i + (recomputes ? 3 * i : 0)) * 2 + pt * h * 2);
      EXPECT_EQ(ws.recomputes_gate_up(), recomputes);
      std::printf("%s, keep_gate_up %d, %s: context %lld bytes per layer and rank (ring %lld rows), backward "
                  "buffers %lld bytes per rank (capacity %lld rows)\n",
                  describe(shape).c_str(), keep, whole ? "whole context" : "default ring",
                  static_cast<long long>(context), static_cast<long long>(ring),
                  static_cast<long long>(ws.backward_bytes()), static_cast<long long>(cap));
    }
  }
  MoeOptions inference;
  inference.backward = false;
  MoeHarness plain(PeerGroup::virtual_ranks(2), shape, inference);
  EXPECT_EQ(plain.workspace().backward_bytes(), 0);
}

}  // namespace
}  // namespace mok
