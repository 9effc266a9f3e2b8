// Tests of the reference's FP8 recipe (reference/fp8.h, reference/moe_reference.h Fp8Recipe): the e4m3 rounding
// against CUDA's conversion bitwise; the block quantization against the GPU tests' quantizer (tests/common/fp8.h,
// itself bitwise the GPU's); the layer with the recipe against straightforward loops written from its definition
// (one token and one route at a time); the weights' blocks; how far each quantization point moves the layer from
// the unquantized one; NaN kept to its token; rw == 0; validation; determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "reference/fp8.h"
#include "reference/moe_reference.h"
#include "tests/common/fp8.h"

namespace {

namespace ref = mok::reference;
using ref::Fp8Recipe;
using ref::LayerInputs;
using ref::LayerParams;
using ref::LayerShape;

LayerShape make_shape(int tokens, int hidden, int intermediate, int num_experts, int top_k, bool shared_expert,
                      double swiglu_limit = 0) {
  return {.tokens_per_rank = tokens,
          .hidden = hidden,
          .intermediate = intermediate,
          .num_experts = num_experts,
          .top_k = top_k,
          .shared_expert = shared_expert,
          .swiglu_limit = swiglu_limit};
}

std::string describe(const Fp8Recipe& r) {
  return std::string("recipe{forward ") + (r.forward ? "1" : "0") + ", dgrads " + (r.dgrads ? "1" : "0") +
         ", wgrad from quantized " + (r.weight_gradients_from_quantized ? "1" : "0") + ", dy from d_out_q " +
         (r.dy_from_quantized_d_out ? "1" : "0") + ", fp8 wgrad " +
         (r.weight_gradients_fp8 ? "1" : "0") + ", activation blocks " +
         (r.weight_gradient_activation_blocks ? "1" : "0") + ", fused " + (r.gate_up_fused ? "1" : "0") + ", pow2 " +
         (r.power_of_two_scales ? "1" : "0") + "}";
}

bool same_value(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// CUDA's conversion (the GPU's, run here on the host), as a float.
float cuda_e4m3(float v) {
  return mok::testing::from_e4m3_bits(mok::testing::to_e4m3_bits(v));
}

// ---------------------------------------------------------------------------------------------------
// Primitives

TEST(Fp8Primitives, RoundToE4m3IsCudasConversionBitwise) {
  std::vector<float> values;
  // Every e4m3 magnitude, the midpoints between neighbours (the ties) and one float either side of each.
  std::vector<float> grid;
  for (int bits = 0; bits < 0x7f; ++bits) grid.push_back(mok::testing::from_e4m3_bits(uint8_t(bits)));
  for (size_t i = 0; i < grid.size(); ++i) {
    const float mid = i + 1 < grid.size() ? 0.5f * (grid[i] + grid[i + 1]) : 464.0f;
    for (float v : {grid[i], mid}) {
      values.insert(values.end(), {v, std::nextafter(v, 0.0f), std::nextafter(v, 1e30f)});
    }
  }
  values.insert(values.end(), {479.0f, 480.0f, 1e30f, std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::quiet_NaN()});
  int64_t checked = 0, mismatches = 0;
  float first_bad = 0;
  auto check = [&](float v) {
    for (float s : {v, -v}) {
      ++checked;
      if (!same_value(ref::round_to_e4m3(s), cuda_e4m3(s)) && mismatches++ == 0) first_bad = s;
    }
  };
  for (float v : values) check(v);
  // Every 1021st float bit pattern (a prime stride: the low bits take every value), about 2M values and their
  // negations.
  for (uint64_t bits = 0; bits < (uint64_t{1} << 31); bits += 1021) check(std::bit_cast<float>(uint32_t(bits)));
  EXPECT_EQ(mismatches, 0) << "of " << checked << "; first " << first_bad << " (bits 0x" << std::hex
                           << std::bit_cast<uint32_t>(first_bad) << "): ours " << ref::round_to_e4m3(first_bad)
                           << ", CUDA's " << cuda_e4m3(first_bad);
  EXPECT_GT(checked, 1000000);
}

// Blocks quantized by reference/fp8.h against tests/common/fp8.h's quantizer (bitwise the GPU's kernels,
// tests/gpu/test_quantize_fp8.cpp): same values for rows with zero blocks, NaN, infinities, values past 448, tiny
// amax (the scales' floor, 2^-126), with and without power-of-two scales.
TEST(Fp8Primitives, RowsQuantizeAsTheGpuQuantizerDoes) {
  const int rows = 9, cols = 300;  // blocks of 128, 128 and 44 columns
  std::vector<float> values(rows * cols);
  uint64_t state = 12345;
  for (float& v : values) {
    state = mok::testing::mix64(state);
    v = float(int64_t(state % 20001) - 10000) / 997.0f;
  }
  for (int c = 0; c < 128; ++c) values[1 * cols + c] = 0;            // an all-zero block
  values[2 * cols + 5] = std::numeric_limits<float>::quiet_NaN();    // NaN: the block's scale NaN
  values[3 * cols + 200] = -std::numeric_limits<float>::infinity();  // infinity likewise
  for (int c = 0; c < cols; ++c) values[4 * cols + c] *= 1e6f;       // past e4m3's range
  for (int c = 0; c < cols; ++c) values[5 * cols + c] = std::ldexp(values[5 * cols + c], -125);  // the scales' floor
  values[6 * cols + 299] = 1e-42f;                                                               // a lone subnormal
  for (bool power_of_two : {false, true}) {
    const auto expected = mok::testing::Fp8Matrix::quantize(values, rows, rows, cols, true, power_of_two);
    std::vector<double> ours(values.begin(), values.end());
    for (int r = 0; r < rows; ++r) ref::quantize_row(ours.data() + r * cols, cols, power_of_two);
    int64_t mismatches = 0, first = -1;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const double want = double(mok::testing::from_e4m3_bits(expected.bits[r * cols + c])) *
                            double(expected.scales[expected.scale_index(r, c)]);
        const double got = ours[r * cols + c];
        if (!((std::isnan(want) && std::isnan(got)) || want == got) && mismatches++ == 0) first = r * cols + c;
      }
    EXPECT_EQ(mismatches, 0) << "power_of_two " << power_of_two << ", first at row " << first / cols << " col "
                             << first % cols;
  }
  // What the cases above are for: a zero block stays zero (scale 1), a NaN block is NaN, the others finite.
  std::vector<double> row(values.begin() + 2 * cols, values.begin() + 3 * cols);
  ref::quantize_row(row.data(), cols, false);
  EXPECT_TRUE(std::isnan(row[0]) && std::isnan(row[127]) && std::isfinite(row[128]) && std::isfinite(row[299]));
}

// The recipe's scale and quotient, written out here: scale = amax / 448, at least 2^-126 (so 1 / scale is finite:
// a subnormal scale's reciprocal can overflow, and 0 * inf is NaN); the value before its conversion is
// value * fp32(1 / scale), which a power-of-two scale makes value / scale exactly.
TEST(Fp8Primitives, ScalesHaveAFloorAndValuesAreMultipliedByTheReciprocal) {
  const float floor = std::ldexp(1.0f, -126);
  for (bool power_of_two : {false, true}) {
    for (float amax : {1e-42f, 1e-40f, 1e-38f, 448.0f * std::ldexp(1.0f, -127)})
      EXPECT_EQ(ref::fp8_block_scale(amax, true, power_of_two), floor) << amax << " pow2 " << power_of_two;
    EXPECT_EQ(ref::fp8_block_scale(448.0f * std::ldexp(1.0f, -100), true, power_of_two), std::ldexp(1.0f, -100));
    EXPECT_EQ(ref::fp8_block_scale(0.0f, true, power_of_two), 1.0f);
    EXPECT_TRUE(std::isnan(ref::fp8_block_scale(1.0f, false, power_of_two)));
  }
  EXPECT_EQ(ref::fp8_block_scale(3.0f, true, false), 3.0f / 448.0f);
  EXPECT_EQ(ref::fp8_block_scale(3.0f, true, true), 1.0f / 128.0f);  // 3 / 448 rounded up to a power of two

  // A block at the floor: finite, zero stays zero, each value e4m3(value * 2^126) * 2^-126.
  std::vector<double> tiny = {0.0, 1e-40, -3e-39, 2.5e-38, -1e-45};
  const std::vector<double> given = tiny;
  EXPECT_EQ(ref::quantize_block(tiny.data(), int64_t(tiny.size()), 1, false), floor);
  for (size_t i = 0; i < tiny.size(); ++i) {
    const float v = float(given[i]);
    EXPECT_EQ(tiny[i], double(ref::round_to_e4m3(v * std::ldexp(1.0f, 126))) * double(floor)) << i;
  }
  EXPECT_EQ(tiny[0], 0.0);

  uint64_t state = 99;
  int64_t differ_from_division = 0;
  for (int i = 0; i < 200000; ++i) {
    state = mok::testing::mix64(state);
    const float value = float(int64_t(state % 2000001) - 1000000) / 1237.0f;
    const float scale = ref::fp8_block_scale(float(state >> 40) / 4096.0f + 1e-3f, true, false);
    const float reciprocal = 1.0f / scale;
    ASSERT_EQ(ref::scaled_for_e4m3(value, scale), value * reciprocal);
    const float pow2 = std::ldexp(1.0f, int(state % 61) - 30);
    ASSERT_EQ(ref::scaled_for_e4m3(value, pow2), value / pow2) << value << " / 2^" << int(state % 61) - 30;
    differ_from_division += ref::round_to_e4m3(value * reciprocal) != ref::round_to_e4m3(value / scale);
  }
  // The two roundings differ from one division's only where the quotient is within an fp32 ulp of an e4m3 tie.
  std::printf("e4m3(value * (1 / scale)) != e4m3(value / scale): %lld of 200000\n", (long long)differ_from_division);
  EXPECT_LT(differ_from_division, 200);
}

TEST(Fp8Primitives, MatrixBlocksAre128By128) {
  // [200, 300]: blocks of rows [0, 128), [128, 200) and columns [0, 128), [128, 256), [256, 300). One large value in
  // block (1, 2) changes that block's quantization only.
  const int rows = 200, cols = 300, big = 150 * cols + 270;
  std::vector<double> plain(rows * cols);
  for (int i = 0; i < rows * cols; ++i) plain[i] = 1.0 + (i % 7) / 8.0 + (i % 3) / 64.0;
  std::vector<double> with_big = plain;
  with_big[big] = 1000;
  ref::quantize_matrix(plain.data(), rows, cols, false);
  ref::quantize_matrix(with_big.data(), rows, cols, false);
  int64_t changed_outside = 0, changed_inside = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      if (r * cols + c == big) continue;
      const bool differs = plain[r * cols + c] != with_big[r * cols + c];
      (r >= 128 && c >= 256 ? changed_inside : changed_outside) += differs;
    }
  EXPECT_EQ(changed_outside, 0);
  EXPECT_GT(changed_inside, 0) << "the large value's block is quantized with its own, coarser scale";
}

// ---------------------------------------------------------------------------------------------------
// The layer with the recipe against straightforward loops

double silu(double z) {
  return z / (1.0 + std::exp(-z));
}
double silu_grad(double z) {
  const double s = 1.0 / (1.0 + std::exp(-z));
  return s * (1.0 + z * (1.0 - s));
}

std::vector<double> quantized(std::vector<double> row, bool on, bool p2) {
  if (on) ref::quantize_row(row.data(), int64_t(row.size()), p2);
  return row;
}

struct LoopResult {
  std::vector<double> out, d_x, d_rw, d_gate, d_up, d_down;  // d_*: routed experts' weight gradients
  std::vector<double> d_shared_gate, d_shared_up, d_shared_down;
};

// The recipe's definition (moe_reference.h, Fp8Recipe) one token and one route at a time, T = double (no roundings
// but the quantizations). `params` are the weights as the layer multiplies them.
LoopResult loops(const LayerShape& shape, const LayerParams<double>& params, const LayerInputs<double>& inputs,
                 const std::vector<double>& d_out, const Fp8Recipe& recipe) {
  const int H = shape.hidden, I = shape.intermediate, k = shape.top_k, E = shape.num_experts;
  const double L = shape.swiglu_limit;
  const bool p2 = recipe.power_of_two_scales;
  const int64_t N = shape.num_tokens();
  LoopResult r;
  r.out.assign(N * H, 0);
  r.d_x.assign(N * H, 0);
  r.d_rw.assign(N * k, 0);
  r.d_gate.assign(int64_t(E) * I * H, 0);
  r.d_up.assign(int64_t(E) * I * H, 0);
  r.d_down.assign(int64_t(E) * H * I, 0);
  r.d_shared_gate.assign(int64_t(I) * H, 0);
  r.d_shared_up.assign(int64_t(I) * H, 0);
  r.d_shared_down.assign(int64_t(I) * H, 0);
  struct Factors {  // one expert's (or the shared expert's, last) weight-gradient factors, one row per route
    std::vector<std::vector<double>> dy, x, h, dg, du;
    std::array<double*, 3> dW = {};  // gate, up, down
  };
  std::vector<Factors> factors(E + 1);
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<double> x(inputs.x.begin() + n * H, inputs.x.begin() + (n + 1) * H);
    const std::vector<double> dout(d_out.begin() + n * H, d_out.begin() + (n + 1) * H);
    const std::vector<double> xq = quantized(x, recipe.forward, p2);
    const std::vector<double> doq = quantized(dout, recipe.dgrads, p2);
    for (int j = -1; j < k; ++j) {  // j = -1: the shared expert
      if (j < 0 && !shape.shared_expert) continue;
      const int e = j < 0 ? -1 : inputs.topk_idx[n * k + j];
      if (j >= 0 && e < 0) continue;
      const double rw = j < 0 ? 1.0 : inputs.router_weights[n * k + j];
      const double* wg = j < 0 ? params.shared_gate.data() : params.expert_gate.data() + int64_t(e) * I * H;
      const double* wu = j < 0 ? params.shared_up.data() : params.expert_up.data() + int64_t(e) * I * H;
      const double* wd = j < 0 ? params.shared_down.data() : params.expert_down.data() + int64_t(e) * H * I;
      double* dwg = j < 0 ? r.d_shared_gate.data() : r.d_gate.data() + int64_t(e) * I * H;
      double* dwu = j < 0 ? r.d_shared_up.data() : r.d_up.data() + int64_t(e) * I * H;
      double* dwd = j < 0 ? r.d_shared_down.data() : r.d_down.data() + int64_t(e) * H * I;
      std::vector<double> g(I), u(I), h(I);
      for (int i = 0; i < I; ++i) {
        for (int c = 0; c < H; ++c) {
          g[i] += wg[i * H + c] * xq[c];
          u[i] += wu[i * H + c] * xq[c];
        }
        const double gc = L > 0 ? std::min(g[i], L) : g[i], uc = L > 0 ? std::clamp(u[i], -L, L) : u[i];
        h[i] = silu(gc) * uc;
      }
      const std::vector<double> hq = quantized(h, recipe.forward, p2);
      std::vector<double> y(H, 0.0);
      for (int c = 0; c < H; ++c)
        for (int i = 0; i < I; ++i) y[c] += wd[c * I + i] * hq[i];
      for (int c = 0; c < H; ++c) r.out[n * H + c] += rw * y[c];
      // Backward.
      std::vector<double> dh(I, 0.0);
      double d_rw = 0;
      if (recipe.dgrads) {
        for (int i = 0; i < I; ++i) {
          double d_hu = 0;
          for (int c = 0; c < H; ++c) d_hu += wd[c * I + i] * doq[c];
          d_rw += d_hu * h[i];
          dh[i] = rw * d_hu;
        }
      } else {
        for (int c = 0; c < H; ++c) d_rw += dout[c] * y[c];
        for (int i = 0; i < I; ++i)
          for (int c = 0; c < H; ++c) dh[i] += wd[c * I + i] * rw * dout[c];
      }
      if (j >= 0) r.d_rw[n * k + j] = d_rw;
      std::vector<double> dgu(2 * I);  // [dg | du]
      for (int i = 0; i < I; ++i) {
        const bool gate_passes = !(L > 0) || g[i] < L, up_passes = !(L > 0) || (-L < u[i] && u[i] < L);
        const double gc = gate_passes ? g[i] : L, uc = up_passes ? u[i] : std::clamp(u[i], -L, L);
        dgu[i] = gate_passes ? dh[i] * uc * silu_grad(gc) : 0.0;
        dgu[I + i] = up_passes ? dh[i] * silu(gc) : 0.0;
      }
      std::vector<double> dgu_q = dgu;
      if (recipe.dgrads) {
        const auto dg = quantized({dgu.begin(), dgu.begin() + I}, true, p2);
        const auto du = quantized({dgu.begin() + I, dgu.end()}, true, p2);
        std::copy(dg.begin(), dg.end(), dgu_q.begin());
        std::copy(du.begin(), du.end(), dgu_q.begin() + I);
      }
      for (int c = 0; c < H; ++c)
        for (int i = 0; i < I; ++i) r.d_x[n * H + c] += wg[i * H + c] * dgu_q[i] + wu[i * H + c] * dgu_q[I + i];
      // The weight gradients' factors, kept per expert (routes in (token, j) order) and summed below.
      Factors& f = factors[j < 0 ? E : e];
      f.dW = {dwg, dwu, dwd};
      std::vector<double> dy(H);
      for (int c = 0; c < H; ++c) dy[c] = rw * (recipe.dy_from_quantized_d_out ? doq[c] : dout[c]);
      f.dy.push_back(dy);
      f.x.push_back(recipe.weight_gradients_from_quantized ? xq : x);
      f.h.push_back(recipe.weight_gradients_from_quantized ? hq : h);
      f.dg.emplace_back(dgu.begin(), dgu.begin() + I);
      f.du.emplace_back(dgu.begin() + I, dgu.end());
    }
  }
  for (Factors& f : factors) {
    if (f.dy.empty()) continue;
    // Each factor's columns quantized along the routes, 128 at a time: per column, or (the activations x and h
    // with weight_gradient_activation_blocks) per 128 columns.
    if (recipe.weight_gradients_fp8)
      for (auto* rows : {&f.dy, &f.x, &f.h, &f.dg, &f.du}) {
        const bool activation = rows == &f.x || rows == &f.h;
        const size_t width = activation && recipe.weight_gradient_activation_blocks ? 128 : 1;
        const size_t cols = (*rows)[0].size();
        for (size_t begin = 0; begin < rows->size(); begin += 128)
          for (size_t c0 = 0; c0 < cols; c0 += width) {
            const size_t end = std::min(rows->size(), begin + 128), c1 = std::min(cols, c0 + width);
            std::vector<double> block;
            for (size_t b = begin; b < end; ++b)
              for (size_t c = c0; c < c1; ++c) block.push_back((*rows)[b][c]);
            ref::quantize_block(block.data(), int64_t(block.size()), 1, p2);
            for (size_t b = begin, x = 0; b < end; ++b)
              for (size_t c = c0; c < c1; ++c) (*rows)[b][c] = block[x++];
          }
      }
    for (size_t q = 0; q < f.dy.size(); ++q)
      for (int c = 0; c < H; ++c)
        for (int i = 0; i < I; ++i) {
          f.dW[2][c * I + i] += f.dy[q][c] * f.h[q][i];
          f.dW[0][i * H + c] += f.dg[q][i] * f.x[q][c];
          f.dW[1][i * H + c] += f.du[q][i] * f.x[q][c];
        }
  }
  return r;
}

// max |a - b| / (max |b| over the vector): a normwise comparison that an element near zero does not dominate.
double relative_max_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

// ||a - b|| / ||b||.
double relative_norm_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// H 160 and I 192: partial last blocks, and fused gate/up weight blocks that straddle the two halves.
TEST(ReferenceFp8, MatchesStraightforwardLoops) {
  const uint64_t seed = 7;
  for (double limit : {0.0, 1.5}) {
    for (bool shared : {true, false}) {
      const LayerShape shape = make_shape(6, 160, 192, 4, 2, shared, limit);
      auto inputs = ref::random_inputs<double>(shape, seed);
      inputs.topk_idx[3] = -1;  // a masked route
      const auto d_out = ref::random_normal<double>(shape.num_tokens() * shape.hidden, seed + 2);
      for (const Fp8Recipe recipe :
           {Fp8Recipe{.forward = true}, Fp8Recipe{.forward = true, .dgrads = true},
            Fp8Recipe{.forward = true, .dgrads = true, .gate_up_fused = true},
            Fp8Recipe{.forward = true, .dgrads = true, .weight_gradients_from_quantized = true, .gate_up_fused = true},
            Fp8Recipe{.dgrads = true, .power_of_two_scales = true},
            Fp8Recipe{.forward = true, .dgrads = true, .weight_gradients_fp8 = true},
            Fp8Recipe{.dgrads = true, .dy_from_quantized_d_out = true},
            Fp8Recipe{.forward = true, .dgrads = true, .dy_from_quantized_d_out = true, .weight_gradients_fp8 = true},
            Fp8Recipe{.forward = true,
            .dgrads = true,
            .weight_gradients_from_quantized = true,
            .weight_gradients_fp8 = true,
            .power_of_two_scales = true},
            Fp8Recipe{.forward = true,
            .dgrads = true,
            .weight_gradients_from_quantized = true,
            .power_of_two_scales = true}}) {
        const std::string where = ref::describe(shape) + ", " + describe(recipe);
        const auto params = ref::quantize_weights(shape, ref::random_params<double>(shape, seed + 1, 0.08), recipe);
        const LoopResult want = loops(shape, params, inputs, d_out, recipe);
        const auto trace = ref::forward(shape, params, inputs, 0, recipe);
        const auto grads = ref::backward(shape, params, inputs, d_out, 0, false, recipe);
        const std::vector<std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>>>
            pairs = {{"out", {&trace.out, &want.out}},
                     {"d_x", {&grads.d_x, &want.d_x}},
                     {"d_router_weights", {&grads.d_router_weights, &want.d_rw}},
                     {"d_expert_gate", {&grads.d_expert_gate, &want.d_gate}},
                     {"d_expert_up", {&grads.d_expert_up, &want.d_up}},
                     {"d_expert_down", {&grads.d_expert_down, &want.d_down}},
                     {"d_shared_gate", {&grads.d_shared_gate, &want.d_shared_gate}},
                     {"d_shared_up", {&grads.d_shared_up, &want.d_shared_up}},
                     {"d_shared_down", {&grads.d_shared_down, &want.d_shared_down}}};
        for (const auto& [name, p] : pairs) {
          // Summation order only (both in double; a quantization that rounded differently would be ~2^-4).
          EXPECT_LE(relative_max_error(*p.first, *p.second), 1e-12) << name << "; " << where;
        }
      }
    }
  }
}

// FP8 weight gradients with more than 128 routes per expert: 160 tokens, each routed to both experts and the shared
// one, so each factor's columns have a block of 128 routes and one of 32; x's 256 columns are two 128-column blocks
// (weight_gradient_activation_blocks).
TEST(ReferenceFp8, Fp8WeightGradientsQuantize128RoutesAtATime) {
  const uint64_t seed = 23;
  const LayerShape shape = make_shape(160, 256, 128, 2, 2, true);
  const auto inputs = ref::random_inputs<double>(shape, seed);
  const auto d_out = ref::random_normal<double>(shape.num_tokens() * shape.hidden, seed + 2);
  for (const Fp8Recipe recipe :
       {Fp8Recipe{.forward = true, .dgrads = true, .weight_gradients_fp8 = true}, Fp8Recipe{.weight_gradients_fp8 = true},
        Fp8Recipe{.forward = true, .dgrads = true, .weight_gradients_fp8 = true,
                  .weight_gradient_activation_blocks = true}}) {
    const auto params = ref::quantize_weights(shape, ref::random_params<double>(shape, seed + 1, 0.09), recipe);
    const LoopResult want = loops(shape, params, inputs, d_out, recipe);
    const auto grads = ref::backward(shape, params, inputs, d_out, 0, false, recipe);
    EXPECT_LE(relative_max_error(grads.d_expert_gate, want.d_gate), 1e-12) << describe(recipe);
    EXPECT_LE(relative_max_error(grads.d_expert_up, want.d_up), 1e-12) << describe(recipe);
    EXPECT_LE(relative_max_error(grads.d_expert_down, want.d_down), 1e-12) << describe(recipe);
    EXPECT_LE(relative_max_error(grads.d_shared_gate, want.d_shared_gate), 1e-12) << describe(recipe);
    EXPECT_LE(relative_max_error(grads.d_shared_down, want.d_shared_down), 1e-12) << describe(recipe);
    // and they are not the bf16 weight gradients
    Fp8Recipe bf16_grads = recipe;
    bf16_grads.weight_gradients_fp8 = false;
    const auto other = ref::backward(shape, params, inputs, d_out, 0, false, bf16_grads);
    EXPECT_GT(relative_max_error(grads.d_expert_down, other.d_expert_down), 1e-3) << describe(recipe);
    // nor, with activation blocks, the per-column recipe's
    if (recipe.weight_gradient_activation_blocks) {
      Fp8Recipe columns = recipe;
      columns.weight_gradient_activation_blocks = false;
      const auto per_column = ref::backward(shape, params, inputs, d_out, 0, false, columns);
      EXPECT_GT(relative_max_error(grads.d_expert_down, per_column.d_expert_down), 1e-4) << describe(recipe);
      EXPECT_GT(relative_max_error(grads.d_expert_gate, per_column.d_expert_gate), 1e-4) << describe(recipe);
    }
  }
}

// Quantizing moves the results: each recipe differs from the bf16 layer's formulas, by what its quantization
// points explain. Printed: the table docs/design.md ("FP8 backward") quotes.
TEST(ReferenceFp8, HowFarEachQuantizationPointMovesTheLayer) {
  const uint64_t seed = 11;
  const LayerShape shape = make_shape(128, 512, 256, 8, 2, true);
  const auto params = ref::random_params<double>(shape, seed, 1.0 / std::sqrt(512.0));
  const auto inputs = ref::random_inputs<double>(shape, seed + 1);
  const auto d_out = ref::random_normal<double>(shape.num_tokens() * shape.hidden, seed + 2);
  const auto exact_out = ref::forward(shape, params, inputs).out;
  const auto exact = ref::backward(shape, params, inputs, d_out);
  struct Row {  // every row multiplies the weights as quantize_weights leaves them
    const char* name;
    Fp8Recipe recipe;
  };
  const Row rows[] = {
      {"weights only", {}},
      {"forward (x, h, weights)", {.forward = true}},
      {"forward + dgrads, bf16 wgrads", {.forward = true, .dgrads = true}},
      {"forward + dgrads, wgrads from fwd's x_q, h_q",
       {.forward = true, .dgrads = true, .weight_gradients_from_quantized = true}},
      {"same, power-of-two scales",
       {.forward = true, .dgrads = true, .weight_gradients_from_quantized = true, .power_of_two_scales = true}},
      {"wgrads from x_q, h_q, dy from d_out_q",
       {.forward = true, .dgrads = true, .weight_gradients_from_quantized = true, .dy_from_quantized_d_out = true}},
      {"forward + dgrads, FP8 wgrads (bf16 x, h)", {.forward = true, .dgrads = true, .weight_gradients_fp8 = true}},
      {"forward + dgrads, FP8 wgrads (x_q, h_q)",
       {.forward = true, .dgrads = true, .weight_gradients_from_quantized = true, .weight_gradients_fp8 = true}},
      {"same, x and h per 128 x 128 in wgrads",
       {.forward = true,
        .dgrads = true,
        .weight_gradients_from_quantized = true,
        .weight_gradients_fp8 = true,
        .weight_gradient_activation_blocks = true}},
  };
  std::printf("normwise relative error against the unquantized layer (T = double), %s\n", ref::describe(shape).c_str());
  std::printf("%-46s %7s %7s %7s %7s %7s %7s\n", "recipe", "out", "d_x", "d_rw", "dW_gate", "dW_up", "dW_down");
  for (const Row& row : rows) {
    const auto q = ref::quantize_weights(shape, params, row.recipe);
    const auto out = ref::forward(shape, q, inputs, 0, row.recipe).out;
    const auto grads = ref::backward(shape, q, inputs, d_out, 0, false, row.recipe);
    const double e[6] = {relative_norm_error(out, exact_out),
                         relative_norm_error(grads.d_x, exact.d_x),
                         relative_norm_error(grads.d_router_weights, exact.d_router_weights),
                         relative_norm_error(grads.d_expert_gate, exact.d_expert_gate),
                         relative_norm_error(grads.d_expert_up, exact.d_expert_up),
                         relative_norm_error(grads.d_expert_down, exact.d_expert_down)};
    std::printf("%-46s %7.4f %7.4f %7.4f %7.4f %7.4f %7.4f\n", row.name, e[0], e[1], e[2], e[3], e[4], e[5]);
    // e4m3 keeps 3 mantissa bits: one rounding moves a value by at most 2^-4 of itself, about 2^-5 rms; a result
    // that has passed through a few of them is off by a few percent, never by more than 2^-2 of its norm, and
    // quantized results are never exact.
    for (int i = 0; i < 6; ++i) {
      EXPECT_GT(e[i], 1e-3) << row.name << ", column " << i;
      EXPECT_LT(e[i], 0.25) << row.name << ", column " << i;
    }
  }
}

TEST(ReferenceFp8, NanStaysWithItsToken) {
  const uint64_t seed = 13;
  const LayerShape shape = make_shape(8, 256, 128, 4, 2, true);
  const int64_t H = shape.hidden, k = shape.top_k;
  const Fp8Recipe recipe{.forward = true, .dgrads = true};
  const auto params = ref::quantize_weights(shape, ref::random_params<double>(shape, seed, 0.06), recipe);
  auto inputs = ref::random_inputs<double>(shape, seed + 1);
  auto d_out = ref::random_normal<double>(shape.num_tokens() * H, seed + 2);
  inputs.x[3 * H + 200] = std::numeric_limits<double>::quiet_NaN();  // token 3's second x block
  d_out[5 * H + 7] = std::numeric_limits<double>::infinity();        // token 5's first d_out block
  const auto out = ref::forward(shape, params, inputs, 0, recipe).out;
  const auto grads = ref::backward(shape, params, inputs, d_out, 0, false, recipe);
  for (int64_t n = 0; n < shape.num_tokens(); ++n) {
    bool out_nan = false, d_x_nan = false, d_rw_nan = false;
    for (int64_t c = 0; c < H; ++c) {
      out_nan = out_nan || !std::isfinite(out[n * H + c]);
      d_x_nan = d_x_nan || !std::isfinite(grads.d_x[n * H + c]);
    }
    for (int64_t j = 0; j < k; ++j) d_rw_nan = d_rw_nan || !std::isfinite(grads.d_router_weights[n * k + j]);
    EXPECT_EQ(out_nan, n == 3) << "token " << n;
    EXPECT_EQ(d_x_nan, n == 3 || n == 5) << "token " << n;
    EXPECT_EQ(d_rw_nan, n == 3 || n == 5) << "token " << n;
  }
  // The weight gradients sum over their experts' tokens: the experts of tokens 3 and 5 are not finite, the others are.
  for (int e = 0; e < shape.num_experts; ++e) {
    bool routed = false, finite = true;
    for (int64_t j = 0; j < k; ++j)
      routed = routed || inputs.topk_idx[3 * k + j] == e || inputs.topk_idx[5 * k + j] == e;
    const int64_t size = int64_t(shape.intermediate) * H;
    for (int64_t i = 0; i < size; ++i) finite = finite && std::isfinite(grads.d_expert_gate[e * size + i]);
    EXPECT_EQ(finite, !routed) << "expert " << e;
  }
}

TEST(ReferenceFp8, ZeroRouterWeightStillGetsItsGradient) {
  const uint64_t seed = 17;
  const LayerShape shape = make_shape(4, 128, 128, 4, 2, false);
  const Fp8Recipe recipe{.forward = true, .dgrads = true};
  const auto params = ref::quantize_weights(shape, ref::random_params<double>(shape, seed, 0.09), recipe);
  auto inputs = ref::random_inputs<double>(shape, seed + 1);
  const auto d_out = ref::random_normal<double>(shape.num_tokens() * shape.hidden, seed + 2);
  inputs.router_weights[2 * 2 + 1] = 0;  // token 2, slot 1
  const auto grads = ref::backward(shape, params, inputs, d_out, 0, false, recipe);
  const LoopResult want = loops(shape, params, inputs, d_out, recipe);
  EXPECT_NE(grads.d_router_weights[5], 0.0);
  EXPECT_NEAR(grads.d_router_weights[5], want.d_rw[5], 1e-12 * std::fabs(want.d_rw[5]));
  // The route adds nothing to d_x: the token's d_x is its other route's partial alone.
  const auto d_x_partial = grads.route_d_x;
  for (int64_t c = 0; c < shape.hidden; ++c) EXPECT_EQ(d_x_partial[(2 * 2 + 1) * shape.hidden + c], 0.0) << c;
}

TEST(ReferenceFp8, FusedGateUpBlocksStraddleTheHalvesWhenIIsNotAMultipleOf128) {
  const uint64_t seed = 19;
  for (int I : {192, 256}) {
    const LayerShape shape = make_shape(4, 128, I, 2, 1, false);
    auto params = ref::random_params<double>(shape, seed, 0.1);
    params.expert_up[5] = 40;  // up row 0 of expert 0
    const auto separate = ref::quantize_weights(shape, params, {.forward = true});
    const auto fused = ref::quantize_weights(shape, params, {.forward = true, .gate_up_fused = true});
    // I = 192, fused: row block [128, 256) of [2I, H] holds gate rows [128, 192) and up rows [0, 64), so the large
    // value coarsens those gate rows, and up rows [64, 128) share a block with [128, 192) instead of with row 0.
    // I = 256: the fused blocks are the separate ones.
    EXPECT_EQ(separate.expert_gate == fused.expert_gate, I % 128 == 0) << "I " << I;
    EXPECT_EQ(separate.expert_up == fused.expert_up, I % 128 == 0) << "I " << I;
    EXPECT_EQ(separate.expert_down, fused.expert_down);
  }
}

TEST(ReferenceFp8, RecipeIsValidatedAndDeterministic) {
  const LayerShape shape = make_shape(5, 128, 64, 4, 2, true);
  const auto params = ref::random_params<double>(shape, 3, 0.1);
  const auto inputs = ref::random_inputs<double>(shape, 4);
  const auto d_out = ref::random_normal<double>(shape.num_tokens() * shape.hidden, 5);
  EXPECT_THROW(
      ref::backward(shape, params, inputs, d_out, 0, false, {.dgrads = true, .weight_gradients_from_quantized = true}),
      std::invalid_argument);
  EXPECT_THROW(
      ref::backward(shape, params, inputs, d_out, 0, false, {.forward = true, .dy_from_quantized_d_out = true}),
      std::invalid_argument);
  const Fp8Recipe recipe{.forward = true, .dgrads = true, .weight_gradients_from_quantized = true};
  const auto a = ref::backward(shape, params, inputs, d_out, 1, true, recipe);
  const auto b = ref::backward(shape, params, inputs, d_out, 3, true, recipe);
  for (size_t i = 0; i < a.named().size(); ++i)
    EXPECT_EQ(*a.named()[i].second, *b.named()[i].second) << a.named()[i].first << " across thread counts";
}

}  // namespace
