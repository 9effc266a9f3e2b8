// Tests of the CPU reference of the MoE layer (reference/moe_reference.h): the forward against
// hand-computed values and straightforward loops, the backward against central finite differences of
// loss = sum(out ⊙ d_out) for every element of every input, plus masked routes, rw == 0, empty experts,
// float vs double, validation and bitwise determinism. Every failure prints shape, seed and the first
// mismatching index.
#include "reference/moe_reference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace ref = mok::reference;
using ref::LayerGrads;
using ref::LayerInputs;
using ref::LayerParams;
using ref::LayerShape;

LayerShape make_shape(int num_ranks, int tokens_per_rank, int hidden, int intermediate, int num_experts, int top_k,
                      bool shared_expert = true, double swiglu_limit = 0) {
  LayerShape shape;
  shape.num_ranks = num_ranks;
  shape.tokens_per_rank = tokens_per_rank;
  shape.hidden = hidden;
  shape.intermediate = intermediate;
  shape.num_experts = num_experts;
  shape.top_k = top_k;
  shape.shared_expert = shared_expert;
  shape.swiglu_limit = swiglu_limit;
  return shape;
}

std::string context(const LayerShape& shape, uint64_t seed) {
  return "shape: " + ref::describe(shape) + ", seed: " + std::to_string(seed);
}

// |actual - expected| <= atol + rtol * |expected| for every element; reports the first mismatch.
template <typename A, typename B>
testing::AssertionResult all_close(const std::string& name, const std::vector<A>& actual,
                                   const std::vector<B>& expected, double rtol, double atol) {
  if (actual.size() != expected.size()) {
    return testing::AssertionFailure() << name << ": size " << actual.size() << ", expected " << expected.size();
  }
  int64_t first_bad = -1, num_bad = 0;
  for (size_t idx = 0; idx < actual.size(); ++idx) {
    const double a = static_cast<double>(actual[idx]), e = static_cast<double>(expected[idx]);
    if (!(std::abs(a - e) <= atol + rtol * std::abs(e))) {
      if (first_bad < 0) first_bad = static_cast<int64_t>(idx);
      ++num_bad;
    }
  }
  if (num_bad == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << std::setprecision(17) << name << ": " << num_bad << " of " << actual.size()
                                     << " elements differ (rtol " << rtol << ", atol " << atol
                                     << "); first mismatching index " << first_bad << ": actual "
                                     << static_cast<double>(actual[first_bad]) << ", expected "
                                     << static_cast<double>(expected[first_bad]);
}

// Same bit pattern in every element.
template <typename T>
testing::AssertionResult bitwise_equal(const std::string& name, const std::vector<T>& actual,
                                       const std::vector<T>& expected) {
  if (actual.size() != expected.size()) {
    return testing::AssertionFailure() << name << ": size " << actual.size() << ", expected " << expected.size();
  }
  for (size_t idx = 0; idx < actual.size(); ++idx) {
    if (std::memcmp(&actual[idx], &expected[idx], sizeof(T)) != 0) {
      return testing::AssertionFailure() << std::setprecision(17) << name << ": first mismatching index " << idx
                                         << ": actual " << actual[idx] << ", expected " << expected[idx];
    }
  }
  return testing::AssertionSuccess();
}

template <typename T>
testing::AssertionResult all_zero(const std::string& name, const std::vector<T>& values, size_t begin, size_t end) {
  for (size_t idx = begin; idx < end; ++idx) {
    if (values[idx] != T(0)) {
      return testing::AssertionFailure() << std::setprecision(17) << name << ": first nonzero index " << idx
                                         << " (range [" << begin << ", " << end << ")): " << values[idx];
    }
  }
  return testing::AssertionSuccess();
}

double max_abs(const std::vector<double>& values) {
  double result = 0;
  for (double value : values) result = std::max(result, std::abs(value));
  return result;
}

double silu(double z) { return z / (1.0 + std::exp(-z)); }

// The layer as the formulas read, one token and one route at a time (independent of the reference's
// blocking, grouping and rounding placement).
std::vector<double> loops_forward(const LayerShape& shape, const LayerParams<double>& params,
                                  const LayerInputs<double>& inputs) {
  const int H = shape.hidden, I = shape.intermediate, k = shape.top_k;
  const double L = shape.swiglu_limit;
  std::vector<double> out(shape.num_tokens() * H, 0.0);
  auto add_mlp = [&](const double* w_gate, const double* w_up, const double* w_down, const double* x, double scale,
                     double* dst) {
    std::vector<double> hidden(I);
    for (int i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int h = 0; h < H; ++h) {
        g += w_gate[i * H + h] * x[h];
        u += w_up[i * H + h] * x[h];
      }
      if (L > 0) {
        g = std::min(g, L);
        u = std::clamp(u, -L, L);
      }
      hidden[i] = silu(g) * u;
    }
    for (int h = 0; h < H; ++h) {
      double y = 0;
      for (int i = 0; i < I; ++i) y += w_down[h * I + i] * hidden[i];
      dst[h] += scale * y;
    }
  };
  for (int64_t n = 0; n < shape.num_tokens(); ++n) {
    const double* x = inputs.x.data() + n * H;
    double* dst = out.data() + n * H;
    if (shape.shared_expert) {
      add_mlp(params.shared_gate.data(), params.shared_up.data(), params.shared_down.data(), x, 1.0, dst);
    }
    for (int j = 0; j < k; ++j) {
      const int e = inputs.topk_idx[n * k + j];
      if (e < 0) continue;
      const int64_t offset = int64_t{e} * I * H;
      add_mlp(params.expert_gate.data() + offset, params.expert_up.data() + offset,
              params.expert_down.data() + offset, x, inputs.router_weights[n * k + j], dst);
    }
  }
  return out;
}

// Unclamped gate and up pre-activations of every live route (shared included).
void collect_preactivations(const LayerShape& shape, const LayerParams<double>& params,
                            const LayerInputs<double>& inputs, std::vector<double>& gates, std::vector<double>& ups) {
  const int H = shape.hidden, I = shape.intermediate, k = shape.top_k;
  auto collect = [&](const double* w_gate, const double* w_up, const double* x) {
    for (int i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int h = 0; h < H; ++h) {
        g += w_gate[i * H + h] * x[h];
        u += w_up[i * H + h] * x[h];
      }
      gates.push_back(g);
      ups.push_back(u);
    }
  };
  for (int64_t n = 0; n < shape.num_tokens(); ++n) {
    const double* x = inputs.x.data() + n * H;
    if (shape.shared_expert) collect(params.shared_gate.data(), params.shared_up.data(), x);
    for (int j = 0; j < k; ++j) {
      const int e = inputs.topk_idx[n * k + j];
      if (e < 0) continue;
      const int64_t offset = int64_t{e} * I * H;
      collect(params.expert_gate.data() + offset, params.expert_up.data() + offset, x);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Finite differences

struct GradientCase {
  LayerShape shape;
  uint64_t seed = 0;
  LayerParams<double> params;
  LayerInputs<double> inputs;
  std::vector<double> d_out;
};

// The tiny case of the brief: 2 ranks x 3 tokens, H=5, I=4, E=4, k=2; token 1 slot 1 masked and token
// 0 slot 0 with router weight 0 (its d_rw must still be right).
GradientCase make_gradient_case(bool shared_expert, double swiglu_limit, uint64_t seed) {
  GradientCase c;
  c.shape = make_shape(2, 3, 5, 4, 4, 2, shared_expert, swiglu_limit);
  c.seed = seed;
  c.params = ref::random_params<double>(c.shape, seed, 0.6);
  c.inputs = ref::random_inputs<double>(c.shape, seed + 1000);
  c.inputs.topk_idx[1 * 2 + 1] = -1;
  c.inputs.router_weights[0 * 2 + 0] = 0.0;
  c.d_out = ref::random_normal<double>(c.shape.num_tokens() * c.shape.hidden, seed + 2000);
  return c;
}

double loss(const GradientCase& c, const LayerParams<double>& params, const LayerInputs<double>& inputs) {
  const auto trace = ref::forward(c.shape, params, inputs, 1);
  double sum = 0;
  for (size_t idx = 0; idx < trace.out.size(); ++idx) sum += trace.out[idx] * c.d_out[idx];
  return sum;
}

void expect_gradients_match_finite_differences(const GradientCase& c) {
  constexpr double kEps = 1e-6, kRtol = 1e-6, kAtol = 1e-8;
  const std::string where = context(c.shape, c.seed);
  const LayerGrads<double> grads = ref::backward(c.shape, c.params, c.inputs, c.d_out, 1);
  LayerParams<double> params = c.params;
  LayerInputs<double> inputs = c.inputs;
  auto check = [&](const std::string& name, std::vector<double>& values, const std::vector<double>& analytic) {
    ASSERT_EQ(values.size(), analytic.size()) << name << ", " << where;
    std::vector<double> numeric(values.size());
    for (size_t idx = 0; idx < values.size(); ++idx) {
      const double original = values[idx];
      values[idx] = original + kEps;
      const double plus = loss(c, params, inputs);
      values[idx] = original - kEps;
      const double minus = loss(c, params, inputs);
      values[idx] = original;
      numeric[idx] = (plus - minus) / (2 * kEps);
    }
    EXPECT_TRUE(all_close(name + " (finite differences vs backward)", numeric, analytic, kRtol, kAtol)) << where;
    EXPECT_GT(max_abs(analytic), 1e-3) << name << " is (nearly) all zero, the check would be vacuous; " << where;
  };
  check("d_x", inputs.x, grads.d_x);
  check("d_router_weights", inputs.router_weights, grads.d_router_weights);
  if (c.shape.shared_expert) {
    check("d_shared_gate", params.shared_gate, grads.d_shared_gate);
    check("d_shared_up", params.shared_up, grads.d_shared_up);
    check("d_shared_down", params.shared_down, grads.d_shared_down);
  }
  check("d_expert_gate", params.expert_gate, grads.d_expert_gate);
  check("d_expert_up", params.expert_up, grads.d_expert_up);
  check("d_expert_down", params.expert_down, grads.d_expert_down);
  // The masked route gets no router-weight gradient; the rw == 0 route does.
  EXPECT_EQ(grads.d_router_weights[1 * 2 + 1], 0.0) << where;
  EXPECT_NE(grads.d_router_weights[0 * 2 + 0], 0.0) << where;
}

TEST(ReferenceBackward, FiniteDifferencesPlainSwiGLU) {
  for (bool shared_expert : {true, false}) {
    SCOPED_TRACE(shared_expert ? "with shared expert" : "without shared expert");
    expect_gradients_match_finite_differences(make_gradient_case(shared_expert, 0.0, 11));
  }
}

TEST(ReferenceBackward, FiniteDifferencesClampedSwiGLU) {
  // Pick (seed, L) deterministically so that at least one gate (g > L) and one up (|u| > L) value is
  // clamped, at least one of each is not, and no value lies within kMargin of a kink.
  constexpr double kMargin = 1e-4;
  const double limits[] = {0.3, 0.45, 0.6, 0.8, 1.0, 1.25};
  bool found = false;
  for (uint64_t seed = 100; seed < 150 && !found; ++seed) {
    GradientCase c = make_gradient_case(true, 0.0, seed);
    std::vector<double> gates, ups;
    collect_preactivations(c.shape, c.params, c.inputs, gates, ups);
    for (double limit : limits) {
      int gates_clamped = 0, gates_free = 0, ups_clamped = 0, ups_free = 0;
      double margin = 1e9;
      for (double g : gates) {
        (g > limit ? gates_clamped : gates_free) += 1;
        margin = std::min(margin, std::abs(g - limit));
      }
      for (double u : ups) {
        (std::abs(u) > limit ? ups_clamped : ups_free) += 1;
        margin = std::min(margin, std::abs(std::abs(u) - limit));
      }
      if (gates_clamped == 0 || gates_free == 0 || ups_clamped == 0 || ups_free == 0 || margin < kMargin) continue;
      found = true;
      c.shape.swiglu_limit = limit;
      const std::string where = context(c.shape, c.seed);
      SCOPED_TRACE(where + ": " + std::to_string(gates_clamped) + " gates and " + std::to_string(ups_clamped) +
                   " ups clamped, margin " + std::to_string(margin));
      ASSERT_GE(gates_clamped, 1);
      ASSERT_GE(ups_clamped, 1);
      // Clamping must really change the forward, and match the straightforward loops.
      const auto clamped = ref::forward(c.shape, c.params, c.inputs);
      LayerShape plain_shape = c.shape;
      plain_shape.swiglu_limit = 0;
      const auto plain = ref::forward(plain_shape, c.params, c.inputs);
      EXPECT_FALSE(all_close("out", clamped.out, plain.out, 1e-9, 1e-12)) << "clamping changed nothing; " << where;
      EXPECT_TRUE(all_close("out vs loops", clamped.out, loops_forward(c.shape, c.params, c.inputs), 1e-12, 1e-12))
          << where;
      expect_gradients_match_finite_differences(c);
      break;
    }
  }
  EXPECT_TRUE(found) << "no seed in [100, 150) gives clamped gates and ups away from the kinks";
}

TEST(ReferenceBackward, ZeroRouterWeightStillGetsGradient) {
  const uint64_t seed = 21;
  const LayerShape shape = make_shape(2, 8, 16, 8, 4, 2);
  const std::string where = context(shape, seed);
  const auto params = ref::random_params<double>(shape, seed, 0.3);
  auto inputs = ref::random_inputs<double>(shape, seed + 1);
  const auto d_out = ref::random_normal<double>(shape.num_tokens() * shape.hidden, seed + 2);
  const int64_t zero_route = 5 * shape.top_k + 1;  // token 5, slot 1
  inputs.router_weights[zero_route] = 0.0;
  const auto trace = ref::forward(shape, params, inputs);
  const auto grads = ref::backward(shape, params, inputs, d_out);

  double expected = 0;  // <d_out[5], y_1[5]>
  for (int h = 0; h < shape.hidden; ++h) {
    expected += d_out[5 * shape.hidden + h] * trace.route_out[zero_route * shape.hidden + h];
  }
  EXPECT_NE(expected, 0.0) << where;
  EXPECT_NEAR(grads.d_router_weights[zero_route], expected, 1e-12 * (1 + std::abs(expected)))
      << "d_rw of the rw == 0 route (token 5, slot 1); " << where;

  // The route contributes nothing else: same gradients as with the route masked.
  auto masked_inputs = inputs;
  masked_inputs.topk_idx[zero_route] = -1;
  const auto masked_grads = ref::backward(shape, params, masked_inputs, d_out);
  EXPECT_TRUE(all_close("d_expert_gate", grads.d_expert_gate, masked_grads.d_expert_gate, 0, 0)) << where;
  EXPECT_TRUE(all_close("d_expert_up", grads.d_expert_up, masked_grads.d_expert_up, 0, 0)) << where;
  EXPECT_TRUE(all_close("d_expert_down", grads.d_expert_down, masked_grads.d_expert_down, 0, 0)) << where;
  EXPECT_TRUE(all_close("d_shared_down", grads.d_shared_down, masked_grads.d_shared_down, 0, 0)) << where;
  EXPECT_TRUE(all_close("d_x", grads.d_x, masked_grads.d_x, 0, 0)) << where;
  EXPECT_EQ(masked_grads.d_router_weights[zero_route], 0.0) << "masked route; " << where;
  auto d_rw = grads.d_router_weights;
  d_rw[zero_route] = 0.0;
  EXPECT_TRUE(all_close("d_router_weights (other routes)", d_rw, masked_grads.d_router_weights, 0, 0)) << where;
}

// ---------------------------------------------------------------------------------------------------
// Hand-computed values

// 2 ranks x 1 token, H = 2, I = 1, E = 2 (one per rank), k = 2, dyadic router weights.
struct HandCase {
  LayerShape shape = make_shape(2, 1, 2, 1, 2, 2);
  LayerParams<double> params;
  LayerInputs<double> inputs;
  HandCase() {
    params.shared_gate = {1, -1};
    params.shared_up = {2, 1};
    params.shared_down = {1, 3};
    params.expert_gate = {0, 1, /* expert 1 */ 1, 1};
    params.expert_up = {1, 1, /* expert 1 */ -1, 0};
    params.expert_down = {2, -1, /* expert 1 */ 1, 1};
    inputs.x = {1, 2, /* token 1 */ 2, -1};
    inputs.topk_idx = {0, 1, /* token 1 */ 1, -1};
    inputs.router_weights = {0.5, 0.25, /* token 1 */ 0.75, 0.125};
  }
};

TEST(ReferenceForward, HandComputedPlainSwiGLU) {
  const HandCase c;
  const std::string where = context(c.shape, 0);
  // Token 0: shared g = 1 - 2 = -1, u = 2 + 2 = 4; expert 0 g = 2, u = 3; expert 1 g = 3, u = -1.
  const double h_s0 = silu(-1) * 4, h_00 = silu(2) * 3, h_01 = silu(3) * -1;
  // Token 1: shared g = 2 + 1 = 3, u = 4 - 1 = 3; expert 1 g = 1, u = -2; slot 1 masked.
  const double h_s1 = silu(3) * 3, h_11 = silu(1) * -2;
  const std::vector<double> shared_out = {h_s0, 3 * h_s0, h_s1, 3 * h_s1};
  const std::vector<double> route_out = {2 * h_00, -h_00, h_01, h_01, h_11, h_11, 0, 0};
  const std::vector<double> out = {h_s0 + 0.5 * 2 * h_00 + 0.25 * h_01, 3 * h_s0 - 0.5 * h_00 + 0.25 * h_01,
                                   h_s1 + 0.75 * h_11, 3 * h_s1 + 0.75 * h_11};
  const auto trace = ref::forward(c.shape, c.params, c.inputs);
  EXPECT_TRUE(all_close("shared_out", trace.shared_out, shared_out, 1e-15, 1e-15)) << where;
  EXPECT_TRUE(all_close("route_out", trace.route_out, route_out, 1e-15, 1e-15)) << where;
  EXPECT_TRUE(all_close("out", trace.out, out, 1e-15, 1e-15)) << where;
  EXPECT_TRUE(all_zero("route_out (masked slot)", trace.route_out, 6, 8)) << where;
}

TEST(ReferenceForward, HandComputedClampedSwiGLU) {
  HandCase c;
  c.shape.swiglu_limit = 2.5;
  const std::string where = context(c.shape, 0);
  // L = 2.5: token 0 shared u 4 -> 2.5; expert 0 u 3 -> 2.5; expert 1 g 3 -> 2.5.
  // Token 1 shared g 3 -> 2.5, u 3 -> 2.5; expert 1 unchanged (g = 1, u = -2).
  const double h_s0 = silu(-1) * 2.5, h_00 = silu(2) * 2.5, h_01 = silu(2.5) * -1;
  const double h_s1 = silu(2.5) * 2.5, h_11 = silu(1) * -2;
  const std::vector<double> out = {h_s0 + 0.5 * 2 * h_00 + 0.25 * h_01, 3 * h_s0 - 0.5 * h_00 + 0.25 * h_01,
                                   h_s1 + 0.75 * h_11, 3 * h_s1 + 0.75 * h_11};
  const auto trace = ref::forward(c.shape, c.params, c.inputs);
  EXPECT_TRUE(all_close("out", trace.out, out, 1e-15, 1e-15)) << where;
}

TEST(ReferenceBackward, HandComputedSingleRoute) {
  // One token, one expert, k = 1, H = I = 1, no shared expert: out = rw * w_d * silu(w_g x) * (w_u x).
  const LayerShape shape = make_shape(1, 1, 1, 1, 1, 1, false);
  const std::string where = context(shape, 0);
  const double x = 2, w_g = 0.5, w_u = 1.5, w_d = -2, rw = 0.75, d_out = 1.25;
  LayerParams<double> params;
  params.expert_gate = {w_g};
  params.expert_up = {w_u};
  params.expert_down = {w_d};
  const LayerInputs<double> inputs{{x}, {0}, {rw}};
  const double g = 1, u = 3, s = 1 / (1 + std::exp(-1.0)), silu_g = g * s, d_silu_g = s * (1 + g * (1 - s));
  const double h = silu_g * u, y = w_d * h;
  const double d_y = rw * d_out, d_h = w_d * d_y, d_g = d_h * u * d_silu_g, d_u = d_h * silu_g;

  const auto trace = ref::forward(shape, params, inputs);
  EXPECT_NEAR(trace.out[0], rw * y, 1e-15) << where;
  const auto grads = ref::backward(shape, params, inputs, {d_out});
  EXPECT_NEAR(grads.d_router_weights[0], d_out * y, 1e-15) << where;
  EXPECT_NEAR(grads.d_expert_down[0], d_y * h, 1e-15) << where;
  EXPECT_NEAR(grads.d_expert_gate[0], d_g * x, 1e-15) << where;
  EXPECT_NEAR(grads.d_expert_up[0], d_u * x, 1e-15) << where;
  EXPECT_NEAR(grads.d_x[0], w_g * d_g + w_u * d_u, 1e-15) << where;
  EXPECT_EQ(grads.d_shared_gate, std::vector<double>{0.0}) << "zeros of the parameter shape; " << where;
  EXPECT_EQ(grads.d_shared_up, std::vector<double>{0.0}) << where;
  EXPECT_EQ(grads.d_shared_down, std::vector<double>{0.0}) << where;
}

// ---------------------------------------------------------------------------------------------------
// Forward properties

TEST(ReferenceForward, MatchesStraightforwardLoops) {
  const uint64_t seed = 31;
  for (bool shared_expert : {true, false}) {
    for (double limit : {0.0, 0.7}) {
      const LayerShape shape = make_shape(4, 5, 24, 12, 8, 3, shared_expert, limit);
      const std::string where = context(shape, seed);
      const auto params = ref::random_params<double>(shape, seed, 0.3);
      auto inputs = ref::random_inputs<double>(shape, seed + 1);
      inputs.topk_idx[7] = -1;
      inputs.topk_idx[11] = -1;
      const auto trace = ref::forward(shape, params, inputs);
      EXPECT_TRUE(all_close("out", trace.out, loops_forward(shape, params, inputs), 1e-12, 1e-13)) << where;
    }
  }
}

TEST(ReferenceForward, NoSharedExpert) {
  const uint64_t seed = 41;
  const LayerShape with_shared = make_shape(2, 6, 16, 8, 4, 2, true);
  LayerShape without_shared = with_shared;
  without_shared.shared_expert = false;
  const std::string where = context(without_shared, seed);
  const auto params = ref::random_params<double>(without_shared, seed, 0.3);
  EXPECT_TRUE(params.shared_gate.empty() && params.shared_up.empty() && params.shared_down.empty()) << where;
  const auto inputs = ref::random_inputs<double>(without_shared, seed + 1);
  const auto trace = ref::forward(without_shared, params, inputs);
  EXPECT_TRUE(all_zero("shared_out", trace.shared_out, 0, trace.shared_out.size())) << where;
  EXPECT_EQ(trace.shared_out.size(), trace.out.size()) << where;

  // out = sum_j rw_j * y_j in j order, exactly.
  const int H = without_shared.hidden, k = without_shared.top_k;
  std::vector<double> expected(trace.out.size());
  for (int64_t n = 0; n < without_shared.num_tokens(); ++n) {
    for (int h = 0; h < H; ++h) {
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += inputs.router_weights[n * k + j] * trace.route_out[(n * k + j) * H + h];
      expected[n * H + h] = sum;
    }
  }
  EXPECT_TRUE(all_close("out", trace.out, expected, 0, 0)) << where;

  // The routed experts are the same with the shared expert on: out differs by exactly shared_out.
  const auto shared_params = ref::random_params<double>(with_shared, seed, 0.3);
  EXPECT_EQ(shared_params.expert_gate, params.expert_gate) << where;
  const auto shared_trace = ref::forward(with_shared, shared_params, inputs);
  EXPECT_TRUE(bitwise_equal("route_out", shared_trace.route_out, trace.route_out)) << where;
  std::vector<double> difference(trace.out.size());
  for (size_t idx = 0; idx < difference.size(); ++idx) difference[idx] = shared_trace.out[idx] - trace.out[idx];
  EXPECT_TRUE(all_close("out(shared) - out(no shared)", difference, shared_trace.shared_out, 1e-12, 1e-12)) << where;

  // Backward: shared gradients are zeros of the parameter shape.
  const auto d_out = ref::random_normal<double>(without_shared.num_tokens() * H, seed + 2);
  const auto grads = ref::backward(without_shared, params, inputs, d_out);
  const size_t expert_size = size_t(without_shared.intermediate) * H;
  for (const auto* grad : {&grads.d_shared_gate, &grads.d_shared_up, &grads.d_shared_down}) {
    EXPECT_EQ(grad->size(), expert_size) << where;
    EXPECT_TRUE(all_zero("d_shared_*", *grad, 0, grad->size())) << where;
  }
}

TEST(ReferenceForward, MaskedRoutes) {
  const uint64_t seed = 51;
  const LayerShape shape = make_shape(2, 6, 16, 8, 4, 3);
  const std::string where = context(shape, seed);
  const auto params = ref::random_params<double>(shape, seed, 0.3);
  auto masked = ref::random_inputs<double>(shape, seed + 1);
  const int k = shape.top_k, H = shape.hidden;
  const std::vector<int64_t> masked_routes = {0 * k + 2, 3 * k + 0, 7 * k + 1, 7 * k + 2};
  auto zero_weight = masked;
  for (int64_t route : masked_routes) {
    masked.topk_idx[route] = -1;
    zero_weight.router_weights[route] = 0.0;
  }
  const auto trace = ref::forward(shape, params, masked);
  const auto zero_trace = ref::forward(shape, params, zero_weight);
  for (int64_t route : masked_routes) {
    EXPECT_TRUE(all_zero("route_out (masked route " + std::to_string(route) + ")", trace.route_out, route * H,
                         (route + 1) * H))
        << where;
  }
  // A masked route contributes like a route with weight 0.
  EXPECT_TRUE(all_close("out (masked vs rw = 0)", trace.out, zero_trace.out, 0, 0)) << where;
  const auto d_out = ref::random_normal<double>(shape.num_tokens() * H, seed + 2);
  const auto grads = ref::backward(shape, params, masked, d_out);
  for (int64_t route : masked_routes) {
    EXPECT_EQ(grads.d_router_weights[route], 0.0) << "masked route " << route << "; " << where;
  }
  // A token with all routes masked gets only the shared expert.
  auto all_masked = masked;
  for (int j = 0; j < k; ++j) all_masked.topk_idx[4 * k + j] = -1;
  const auto all_masked_trace = ref::forward(shape, params, all_masked);
  const std::vector<double> out_4(all_masked_trace.out.begin() + 4 * H, all_masked_trace.out.begin() + 5 * H);
  const std::vector<double> shared_4(all_masked_trace.shared_out.begin() + 4 * H,
                                     all_masked_trace.shared_out.begin() + 5 * H);
  EXPECT_TRUE(all_close("out (token 4, all routes masked)", out_4, shared_4, 0, 0)) << where;
}

// ---------------------------------------------------------------------------------------------------
// Backward properties

TEST(ReferenceBackward, ExpertWithoutTokensGetsZeroGradient) {
  const uint64_t seed = 61;
  const LayerShape shape = make_shape(2, 8, 16, 8, 8, 2);
  const std::string where = context(shape, seed);
  const int k = shape.top_k, empty_expert = 5;
  const auto params = ref::random_params<double>(shape, seed, 0.3);
  auto inputs = ref::random_inputs<double>(shape, seed + 1);
  for (int64_t n = 0; n < shape.num_tokens(); ++n) {
    for (int j = 0; j < k; ++j) {
      if (inputs.topk_idx[n * k + j] != empty_expert) continue;
      int replacement = 0;  // smallest expert that is neither the empty one nor used by the token
      while (replacement == empty_expert || replacement == inputs.topk_idx[n * k + (1 - j)]) ++replacement;
      inputs.topk_idx[n * k + j] = replacement;
    }
  }
  ASSERT_EQ(std::count(inputs.topk_idx.begin(), inputs.topk_idx.end(), empty_expert), 0) << where;
  const auto d_out = ref::random_normal<double>(shape.num_tokens() * shape.hidden, seed + 2);
  const auto grads = ref::backward(shape, params, inputs, d_out);
  const size_t expert_size = size_t(shape.intermediate) * shape.hidden;
  const size_t begin = empty_expert * expert_size, end = begin + expert_size;
  EXPECT_TRUE(all_zero("d_expert_gate (empty expert 5)", grads.d_expert_gate, begin, end)) << where;
  EXPECT_TRUE(all_zero("d_expert_up (empty expert 5)", grads.d_expert_up, begin, end)) << where;
  EXPECT_TRUE(all_zero("d_expert_down (empty expert 5)", grads.d_expert_down, begin, end)) << where;
  // A used expert does get gradient (the check above is not vacuous).
  const int used_expert = inputs.topk_idx[0];
  EXPECT_FALSE(all_zero("d_expert_gate (used expert)", grads.d_expert_gate, used_expert * expert_size,
                        (used_expert + 1) * expert_size))
      << where;
  // The empty expert's weights do not influence the forward.
  auto changed = params;
  for (size_t idx = begin; idx < end; ++idx) changed.expert_down[idx] += 1.0;
  EXPECT_TRUE(bitwise_equal("out (empty expert changed)", ref::forward(shape, changed, inputs).out,
                            ref::forward(shape, params, inputs).out))
      << where;
}

// ---------------------------------------------------------------------------------------------------
// Precision, determinism, validation, random data

template <typename To, typename From>
std::vector<To> convert(const std::vector<From>& values) {
  return std::vector<To>(values.begin(), values.end());
}

template <typename To, typename From>
LayerParams<To> convert_params(const LayerParams<From>& p) {
  return {convert<To>(p.shared_gate), convert<To>(p.shared_up),   convert<To>(p.shared_down),
          convert<To>(p.expert_gate), convert<To>(p.expert_up), convert<To>(p.expert_down)};
}

template <typename To, typename From>
LayerInputs<To> convert_inputs(const LayerInputs<From>& in) {
  return {convert<To>(in.x), in.topk_idx, convert<To>(in.router_weights)};
}

TEST(ReferencePrecision, FloatAgreesWithDouble) {
  const uint64_t seed = 71;
  const LayerShape shape = make_shape(2, 8, 64, 32, 4, 2);
  const std::string where = context(shape, seed);
  // Float-representable data, so both precisions see identical inputs.
  const auto params_f = ref::random_params<float>(shape, seed, 0.15);
  auto inputs_f = ref::random_inputs<float>(shape, seed + 1);
  inputs_f.topk_idx[3] = -1;
  const auto d_out_f = ref::random_normal<float>(shape.num_tokens() * shape.hidden, seed + 2);
  const auto params_d = convert_params<double>(params_f);
  const auto inputs_d = convert_inputs<double>(inputs_f);
  const auto d_out_d = convert<double>(d_out_f);

  auto expect_close = [&](const std::string& name, const std::vector<float>& f, const std::vector<double>& d) {
    // Relative to each tensor's largest magnitude (single elements may cancel to ~0).
    EXPECT_TRUE(all_close(name + " (float vs double)", f, d, 1e-5, 1e-5 * max_abs(d))) << where;
  };
  const auto trace_f = ref::forward(shape, params_f, inputs_f);
  const auto trace_d = ref::forward(shape, params_d, inputs_d);
  expect_close("out", trace_f.out, trace_d.out);
  expect_close("route_out", trace_f.route_out, trace_d.route_out);
  const auto grads_f = ref::backward(shape, params_f, inputs_f, d_out_f);
  const auto grads_d = ref::backward(shape, params_d, inputs_d, d_out_d);
  const auto named_f = grads_f.named();
  const auto named_d = grads_d.named();
  for (size_t i = 0; i < named_f.size(); ++i) expect_close(named_f[i].first, *named_f[i].second, *named_d[i].second);
}

template <typename T>
void expect_bitwise_deterministic(uint64_t seed) {
  const LayerShape shape = make_shape(4, 12, 40, 24, 8, 3, true, 1.5);
  const std::string where = context(shape, seed) + (sizeof(T) == 4 ? ", float" : ", double");
  const auto params = ref::random_params<T>(shape, seed, 0.3);
  auto inputs = ref::random_inputs<T>(shape, seed + 1);
  inputs.topk_idx[4] = -1;
  inputs.topk_idx[40] = -1;
  const auto d_out = ref::random_normal<T>(shape.num_tokens() * shape.hidden, seed + 2);
  const auto trace = ref::forward(shape, params, inputs, 1);
  const auto grads = ref::backward(shape, params, inputs, d_out, 1);
  for (int num_threads : {0, 1, 2, 3, 7}) {
    const std::string run = where + ", num_threads " + std::to_string(num_threads);
    const auto trace_again = ref::forward(shape, params, inputs, num_threads);
    const auto grads_again = ref::backward(shape, params, inputs, d_out, num_threads);
    EXPECT_TRUE(bitwise_equal("shared_out", trace_again.shared_out, trace.shared_out)) << run;
    EXPECT_TRUE(bitwise_equal("route_out", trace_again.route_out, trace.route_out)) << run;
    EXPECT_TRUE(bitwise_equal("out", trace_again.out, trace.out)) << run;
    const auto again = grads_again.named();
    const auto first = grads.named();
    for (size_t i = 0; i < first.size(); ++i)
      EXPECT_TRUE(bitwise_equal(first[i].first, *again[i].second, *first[i].second)) << run;
  }
}

TEST(ReferenceDeterminism, BitwiseAcrossRunsAndThreadCounts) {
  expect_bitwise_deterministic<float>(81);
  expect_bitwise_deterministic<double>(82);
}

TEST(ReferenceShape, CountsTokensAndLocalExperts) {
  const LayerShape shape = make_shape(4, 7, 8, 4, 16, 2);
  EXPECT_EQ(shape.num_tokens(), 28) << ref::describe(shape);
  EXPECT_EQ(shape.local_experts(), 4) << ref::describe(shape);
  EXPECT_NO_THROW(shape.validate()) << ref::describe(shape);
}

// Expects `action` to throw Exception whose message contains `needle`.
template <typename Exception, typename Action>
testing::AssertionResult throws_naming(const Action& action, const std::string& needle) {
  try {
    action();
  } catch (const Exception& error) {
    if (std::string(error.what()).find(needle) != std::string::npos) return testing::AssertionSuccess();
    return testing::AssertionFailure() << "message \"" << error.what() << "\" does not name \"" << needle << "\"";
  } catch (const std::exception& error) {
    return testing::AssertionFailure() << "wrong exception type: " << error.what();
  }
  return testing::AssertionFailure() << "nothing thrown (expected a message naming \"" << needle << "\")";
}

TEST(ReferenceValidation, ShapeNamesTheBadField) {
  const LayerShape good = make_shape(2, 3, 8, 4, 4, 2);
  struct BadShape {
    const char* field;
    void (*spoil)(LayerShape&);
  };
  const BadShape bad_shapes[] = {
      {"num_ranks", [](LayerShape& s) { s.num_ranks = 0; }},
      {"tokens_per_rank", [](LayerShape& s) { s.tokens_per_rank = -1; }},
      {"hidden", [](LayerShape& s) { s.hidden = 0; }},
      {"intermediate", [](LayerShape& s) { s.intermediate = -4; }},
      {"num_experts", [](LayerShape& s) { s.num_experts = 0; }},
      {"num_experts", [](LayerShape& s) { s.num_experts = 5; }},  // not a multiple of num_ranks = 2
      {"top_k", [](LayerShape& s) { s.top_k = 0; }},
      {"top_k", [](LayerShape& s) { s.top_k = 5; }},  // more than num_experts
      {"swiglu_limit", [](LayerShape& s) { s.swiglu_limit = -1; }},
  };
  for (const BadShape& bad : bad_shapes) {
    LayerShape shape = good;
    bad.spoil(shape);
    EXPECT_TRUE(throws_naming<std::invalid_argument>([&] { shape.validate(); }, bad.field)) << ref::describe(shape);
  }
}

TEST(ReferenceValidation, RejectsBadExpertIdsAndSizes) {
  const uint64_t seed = 91;
  const LayerShape shape = make_shape(2, 3, 8, 4, 4, 2);
  const std::string where = context(shape, seed);
  const auto params = ref::random_params<double>(shape, seed, 0.3);
  const auto inputs = ref::random_inputs<double>(shape, seed + 1);
  const auto d_out = ref::random_normal<double>(shape.num_tokens() * shape.hidden, seed + 2);
  EXPECT_NO_THROW(ref::forward(shape, params, inputs)) << where;

  for (int bad_id : {-2, 4, 1000}) {
    auto bad = inputs;
    bad.topk_idx[4 * 2 + 1] = bad_id;  // token 4, slot 1
    const std::string needle = "token 4, slot 1] = " + std::to_string(bad_id);
    EXPECT_TRUE(throws_naming<std::out_of_range>([&] { ref::forward(shape, params, bad); }, needle)) << where;
    EXPECT_TRUE(throws_naming<std::out_of_range>([&] { ref::backward(shape, params, bad, d_out); }, needle)) << where;
  }
  {
    auto bad = inputs;
    bad.x.pop_back();
    EXPECT_TRUE(throws_naming<std::invalid_argument>([&] { ref::forward(shape, params, bad); }, "x")) << where;
  }
  {
    auto bad = inputs;
    bad.router_weights.push_back(0);
    EXPECT_TRUE(throws_naming<std::invalid_argument>([&] { ref::forward(shape, params, bad); }, "router_weights"))
        << where;
  }
  {
    auto bad = params;
    bad.expert_down.resize(bad.expert_down.size() / 2);
    EXPECT_TRUE(throws_naming<std::invalid_argument>([&] { ref::forward(shape, bad, inputs); }, "expert_down"))
        << where;
  }
  {
    auto bad = params;
    bad.shared_up.clear();  // required with shared_expert = true
    EXPECT_TRUE(throws_naming<std::invalid_argument>([&] { ref::forward(shape, bad, inputs); }, "shared_up")) << where;
  }
  {
    auto bad_d_out = d_out;
    bad_d_out.pop_back();
    EXPECT_TRUE(throws_naming<std::invalid_argument>([&] { ref::backward(shape, params, inputs, bad_d_out); },
                                                     "d_out"))
        << where;
  }
  {
    LayerShape bad_shape = shape;
    bad_shape.num_experts = 3;
    EXPECT_TRUE(throws_naming<std::invalid_argument>([&] { ref::forward(bad_shape, params, inputs); },
                                                     "num_experts"))
        << where;
  }
}

TEST(ReferenceRandomData, InputsAreValidAndDeterministic) {
  const uint64_t seed = 101;
  const LayerShape shape = make_shape(2, 16, 8, 4, 6, 3);
  const std::string where = context(shape, seed);
  const auto inputs = ref::random_inputs<double>(shape, seed);
  const int k = shape.top_k;
  std::vector<int> expert_count(shape.num_experts, 0);
  for (int64_t n = 0; n < shape.num_tokens(); ++n) {
    double weight_sum = 0;
    for (int j = 0; j < k; ++j) {
      const int e = inputs.topk_idx[n * k + j];
      ASSERT_TRUE(e >= 0 && e < shape.num_experts) << "token " << n << " slot " << j << "; " << where;
      ++expert_count[e];
      for (int other = 0; other < j; ++other) {
        EXPECT_NE(inputs.topk_idx[n * k + other], e) << "token " << n << " repeats an expert; " << where;
      }
      EXPECT_GT(inputs.router_weights[n * k + j], 0.0) << "token " << n << " slot " << j << "; " << where;
      weight_sum += inputs.router_weights[n * k + j];
    }
    EXPECT_NEAR(weight_sum, 1.0, 1e-12) << "token " << n << "; " << where;
  }
  for (int e = 0; e < shape.num_experts; ++e) EXPECT_GT(expert_count[e], 0) << "expert " << e << "; " << where;
  const auto again = ref::random_inputs<double>(shape, seed);
  EXPECT_EQ(again.topk_idx, inputs.topk_idx) << where;
  EXPECT_TRUE(bitwise_equal("x", again.x, inputs.x)) << where;
  const auto other = ref::random_inputs<double>(shape, seed + 1);
  EXPECT_NE(other.x, inputs.x) << where;
  const auto params = ref::random_params<double>(shape, seed, 0.5);
  EXPECT_TRUE(bitwise_equal("expert_gate", ref::random_params<double>(shape, seed, 0.5).expert_gate,
                            params.expert_gate))
      << where;
  const double rms = std::sqrt(std::inner_product(params.expert_gate.begin(), params.expert_gate.end(),
                                                  params.expert_gate.begin(), 0.0) /
                               params.expert_gate.size());
  EXPECT_NEAR(rms, 0.5, 0.05) << "normal(0, 0.5) weights; " << where;
}

}  // namespace
