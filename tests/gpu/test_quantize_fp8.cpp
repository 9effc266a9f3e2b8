// FP8 quantization kernels (include/mok/fp8.h) against the CPU reference (tests/common/fp8.h,
// Fp8Matrix::quantize): bitwise, values and scales, for both layouts and both scale modes, on bf16 inputs that
// cover the edge cases: all-zero blocks, values past e4m3's range (the scale brings them into it), tiny values
// (scales at their floor, 2^-126), a partial last k-block and row block, NaN and infinity (a NaN scale for their block only).
// Outputs are poisoned first (0xff bytes, scale NaN with a payload): every element must be written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mok/fp8.h"
#include "mok/peer_group.h"
#include "src/host/check.h"
#include "src/host/quantize_fp8.h"
#include "tests/common/bf16.h"
#include "tests/common/device_array.h"
#include "tests/common/device_fill.h"
#include "tests/common/device_status.h"
#include "tests/common/fp8.h"
#include "tests/common/gpu_env.h"

namespace mok {
namespace {

using testing::DeviceArray;
using testing::Fp8Matrix;
using testing::from_bf16_bits;
using testing::hashed_int;
using testing::to_bf16_bits;

constexpr uint32_t kScalePoison = 0x7fc0dead;

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// bf16 inputs [rows, k] with edge cases by block (b: the index of a 128 x 128 block or of a 1 x 128 block).
std::vector<uint16_t> edge_inputs(int64_t rows, int k, uint64_t seed) {
  std::vector<uint16_t> v(size_t(rows) * k);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < k; ++c) {
      const int64_t i = r * k + c;
      const int kind = hashed_int(seed, (r / 64) * 1000 + c / 128, 0, 9);  // one kind per 64 x 128 region
      float x = float(hashed_int(seed + 1, i, -1000, 1000)) / 100.0f;
      switch (kind) {
        case 0: x = 0.0f; break;                               // all-zero blocks
        case 1: x *= 1e30f; break;                             // far past 448
        case 2: x *= 1e-38f; break;                            // tiny: the scales' floor
        case 3: if (hashed_int(seed + 2, i, 0, 4000) == 0) x = NAN; break;
        case 4: if (hashed_int(seed + 2, i, 0, 4000) == 0) x = -INFINITY; break;
        default: break;
      }
      v[i] = to_bf16_bits(x);
    }
  return v;
}

std::vector<float> as_floats(const std::vector<uint16_t>& bf16) {
  std::vector<float> f(bf16.size());
  for (size_t i = 0; i < f.size(); ++i) f[i] = from_bf16_bits(bf16[i]);
  return f;
}

void expect_same(const Fp8Matrix& want, const std::vector<uint8_t>& bits, const std::vector<float>& scales,
                 const std::string& label) {
  ASSERT_EQ(bits.size(), want.bits.size());
  for (size_t i = 0; i < bits.size(); ++i)
    ASSERT_EQ(bits[i], want.bits[i]) << "e4m3 at " << i << " (row " << i / want.k << ", col " << i % want.k << "), "
                                     << label;
  ASSERT_EQ(scales.size(), want.scales.size());
  for (size_t i = 0; i < scales.size(); ++i)
    ASSERT_EQ(bits_of(scales[i]), bits_of(want.scales[i]))
        << "scale " << i << ": got " << scales[i] << ", expected " << want.scales[i] << ", " << label;
}

TEST(QuantizeFp8Test, RowsMatchTheCpuBitwise) {
  MOK_REQUIRE_GPUS(1);
  for (const bool pow2 : {false, true})
    for (const int k : {512, 2880, 72}) {  // 2880: a partial last block of 64 columns; 72: one partial block
      const int64_t rows = 388;
      const uint64_t seed = 1200 + k + pow2;
      const std::string label = "k " + std::to_string(k) + (pow2 ? ", power-of-two scales" : "") + ", seed " +
                                std::to_string(seed);
      const auto in = edge_inputs(rows, k, seed);
      const auto want = Fp8Matrix::quantize(as_floats(in), rows, rows, k, true, pow2);
      DeviceArray<uint16_t> d_in(in);
      DeviceArray<uint8_t> d_out(std::vector<uint8_t>(in.size(), 0xff));
      float poison;
      std::memcpy(&poison, &kScalePoison, sizeof poison);
      DeviceArray<float> d_scales(std::vector<float>(want.scales.size(), poison));
      quantize_rows_fp8({.in = d_in.ptr, .rows = rows, .k = k, .out = d_out.ptr, .scales = d_scales.ptr,
                         .power_of_two_scales = pow2},
                        nullptr);
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
      expect_same(want, d_out.download(), d_scales.download(), label);
    }
}

// The layer's x quantizer (detail::publish_fp8_rows, MoeOptions::fp8_power_of_two_scales): each row's e4m3 values
// and scales in its FP8 row, and the scales again in the GEMM's A layout, bitwise the CPU's; rows past `tokens` zeros
// with scale 1; a non-finite block reported with its row.
TEST(QuantizeFp8Test, PublishedRowsMatchTheCpuBitwise) {
  MOK_REQUIRE_GPUS(1);
  const int64_t tokens = 100, padded = 128;
  const int h = 320;  // a partial last block of 64 columns
  for (const bool pow2 : {false, true}) {
    const uint64_t seed = 1270 + pow2;
    const std::string label = std::string(pow2 ? "power-of-two scales" : "plain scales") + ", seed " +
                              std::to_string(seed);
    auto in = edge_inputs(tokens, h, seed);
    in[37 * h + 200] = to_bf16_bits(NAN);  // at least one report, whatever the seed's regions hold
    in[90 * h + 5] = to_bf16_bits(INFINITY);
    std::vector<float> padded_in = as_floats(in);
    padded_in.resize(size_t(padded) * h, 0.0f);
    const auto want = Fp8Matrix::quantize(padded_in, padded, padded, h, true, pow2);
    DeviceArray<uint16_t> d_in(in);
    DeviceArray<uint8_t> d_rows(std::vector<uint8_t>(size_t(padded) * 2 * h, 0xff));
    float poison;
    std::memcpy(&poison, &kScalePoison, sizeof poison);
    DeviceArray<float> d_scales(std::vector<float>(want.scales.size(), poison));
    testing::DeviceStatusWord status;
    detail::publish_fp8_rows(d_in.ptr, tokens, padded, h, d_rows.ptr, d_scales.ptr, pow2, status.word.ptr, 0, nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    const auto rows = d_rows.download();
    std::vector<uint8_t> bits(size_t(padded) * h);
    std::vector<float> row_scales(want.scales.size());
    for (int64_t r = 0; r < padded; ++r) {
      std::memcpy(bits.data() + r * h, rows.data() + r * 2 * h, size_t(h));
      for (int b = 0; b < want.k_blocks(); ++b)
        std::memcpy(&row_scales[size_t(b) * padded + r], rows.data() + r * 2 * h + h + 4 * b, 4);
    }
    expect_same(want, bits, d_scales.download(), label + " (values, A-layout scales)");
    expect_same(want, bits, row_scales, label + " (the scales in the rows)");
    int64_t first_nonfinite = -1;  // the report names the smallest row with a non-finite block
    for (int64_t r = padded - 1; r >= 0; --r)
      for (int b = 0; b < want.k_blocks(); ++b)
        if (std::isnan(want.scales[size_t(b) * padded + r])) first_nonfinite = r;
    ASSERT_GE(first_nonfinite, 0) << label;
    const StatusReport report = status.read();
    EXPECT_EQ(report.raw.error_bits, kStatusNonFinite) << label;
    EXPECT_EQ(report.nonfinite_where(), NonFiniteWhere::kX) << label;
    EXPECT_EQ(report.nonfinite_row(), first_nonfinite) << label;
  }
}

// rows_used (a device count, as the layer passes its schedule's): the rows below it as without, the rest untouched.
TEST(QuantizeFp8Test, RowsUsedBoundsTheRowsWritten) {
  MOK_REQUIRE_GPUS(1);
  const int64_t rows = 256;
  const int k = 384, used = 100;
  const auto in = edge_inputs(rows, k, 1250);
  const auto want = Fp8Matrix::quantize(as_floats(in), rows, rows, k, true);
  DeviceArray<uint16_t> d_in(in);
  DeviceArray<uint8_t> d_out(std::vector<uint8_t>(in.size(), 0xff));
  float poison;
  std::memcpy(&poison, &kScalePoison, sizeof poison);
  DeviceArray<float> d_scales(std::vector<float>(want.scales.size(), poison));
  DeviceArray<int32_t> d_used(std::vector<int32_t>{used});
  quantize_rows_fp8({.in = d_in.ptr, .rows = rows, .k = k, .out = d_out.ptr, .scales = d_scales.ptr,
                     .rows_used = d_used.ptr},
                    nullptr);
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
  const auto bits = d_out.download();
  const auto scales = d_scales.download();
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < k; ++c)
      ASSERT_EQ(bits[r * k + c], r < used ? want.bits[r * k + c] : uint8_t{0xff}) << "row " << r << " col " << c;
  for (int b = 0; b < want.k_blocks(); ++b)
    for (int64_t r = 0; r < rows; ++r)
      ASSERT_EQ(bits_of(scales[b * rows + r]), r < used ? bits_of(want.scales[b * rows + r]) : kScalePoison)
          << "scale of row " << r << " block " << b;
}

TEST(QuantizeFp8Test, WeightsMatchTheCpuBitwise) {
  MOK_REQUIRE_GPUS(1);
  for (const bool pow2 : {false, true})
    for (const auto& [rows, k] : {std::pair<int64_t, int>{256, 384}, {192, 2880}, {64, 136}}) {
      const int experts = 3;
      const uint64_t seed = 1300 + rows + k + pow2;
      const std::string label = "rows " + std::to_string(rows) + ", k " + std::to_string(k) +
                                (pow2 ? ", power-of-two scales" : "") + ", seed " + std::to_string(seed);
      const auto in = edge_inputs(experts * rows, k, seed);
      const auto want = Fp8Matrix::quantize(as_floats(in), experts * rows, rows, k, false, pow2);
      DeviceArray<uint16_t> d_in(in);
      DeviceArray<uint8_t> d_out(std::vector<uint8_t>(in.size(), 0xff));
      float poison;
      std::memcpy(&poison, &kScalePoison, sizeof poison);
      DeviceArray<float> d_scales(std::vector<float>(want.scales.size(), poison));
      quantize_weights_fp8({.in = d_in.ptr, .experts = experts, .rows = rows, .k = k, .out = d_out.ptr,
                            .scales = d_scales.ptr, .power_of_two_scales = pow2},
                           nullptr);
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
      expect_same(want, d_out.download(), d_scales.download(), label);
    }
}

TEST(QuantizeFp8Test, TransposedWeightsAreTheTransposeExactly) {
  MOK_REQUIRE_GPUS(1);
  for (const auto& [rows, k] : {std::pair<int64_t, int>{256, 384}, {192, 2880}, {64, 136}}) {
    const int experts = 2;
    const uint64_t seed = 1350 + rows + k;
    const std::string label = "rows " + std::to_string(rows) + ", k " + std::to_string(k);
    const auto in = edge_inputs(experts * rows, k, seed);
    DeviceArray<uint16_t> d_in(in);
    const int64_t rb = (rows + 127) / 128, kb = (k + 127) / 128;
    DeviceArray<uint8_t> d_out(in.size()), d_out_t(std::vector<uint8_t>(in.size(), 0xff));
    DeviceArray<float> d_scales(size_t(experts * rb * kb)), d_scales_t(std::vector<float>(size_t(experts * rb * kb), -1));
    quantize_weights_fp8({.in = d_in.ptr, .experts = experts, .rows = rows, .k = k, .out = d_out.ptr,
                          .scales = d_scales.ptr, .out_transposed = d_out_t.ptr, .scales_transposed = d_scales_t.ptr},
                         nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    const auto q = d_out.download(), q_t = d_out_t.download();
    const auto s = d_scales.download(), s_t = d_scales_t.download();
    for (int e = 0; e < experts; ++e) {
      for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < k; ++c)
          ASSERT_EQ(q_t[(e * k + c) * rows + r], q[(e * rows + r) * k + c])
              << "expert " << e << " row " << r << " col " << c << ", " << label;
      for (int64_t i = 0; i < rb; ++i)
        for (int64_t j = 0; j < kb; ++j)
          ASSERT_EQ(bits_of(s_t[(e * kb + j) * rb + i]), bits_of(s[(e * rb + i) * kb + j]))
              << "scale block " << i << ", " << j << " of expert " << e << ", " << label;
    }
  }
}

TEST(QuantizeFp8Test, EdgeCasesAreWhatTheRecipeSays) {
  // The CPU reference itself, on the cases the header names (no GPU needed).
  const std::vector<float> row = {0, 0, 0, 0};
  EXPECT_EQ(Fp8Matrix::quantize(row, 1, 1, 4, true).scales[0], 1.0f) << "an all-zero block's scale is 1";
  const auto big = Fp8Matrix::quantize({896.0f, -448.0f, 1.0f, 0.0f}, 1, 1, 4, true);
  EXPECT_EQ(big.scales[0], 2.0f);
  EXPECT_EQ(testing::from_e4m3_bits(big.bits[0]) * big.scales[0], 896.0f);
  EXPECT_EQ(testing::from_e4m3_bits(big.bits[1]) * big.scales[0], -448.0f);
  const auto pow2 = Fp8Matrix::quantize({500.0f, 1.0f, 0.0f, 0.0f}, 1, 1, 4, true, true);
  EXPECT_EQ(pow2.scales[0], 2.0f) << "500 / 448 rounded up to a power of two";
  const auto nan = Fp8Matrix::quantize({1.0f, NAN, 2.0f, 3.0f}, 1, 1, 4, true);
  EXPECT_TRUE(std::isnan(nan.scales[0]));
}

// The FP8 weight gradients' operand quantizer (detail::quantize_columns_fp8): a schedule's rows (segments padded
// to 64, an empty expert, a 1-row and a 300-row one) transposed and quantized per column per 128 rows of one
// expert, against the CPU: the 128-aligned segment offsets, every e4m3 byte (rows past an expert's count zeros,
// whatever its padding rows hold), every scale bitwise, both scale modes; a NaN gives its column's block a NaN
// scale and touches no other block; rows of `out` past the last segment are not written. Also with block_scales
// (block_scales: one scale per 128 rows x 128 columns, [ceil(k / 128), out rows / 128]; k = 192: a half block).
TEST(QuantizeFp8Test, ColumnsOfAScheduleMatchTheCpuBitwise) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> counts = {129, 0, 1, 255, 64, 300};
  const int experts = static_cast<int>(counts.size()), k = 192;
  std::vector<int32_t> offsets(experts + 1, 0);
  for (int e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + (counts[e] + 63) / 64 * 64;
  const int64_t rows = offsets[experts] + 64;  // and a spare tile
  const int64_t out_rows = detail::fp8_column_rows(rows, experts);
  for (const bool blocks : {false, true}) {
    for (const bool pow2 : {false, true}) {
      const uint64_t seed = 1500 + pow2 + 2 * blocks;
      const std::string label = std::string(pow2 ? "power-of-two scales" : "amax / 448 scales") +
                                (blocks ? ", 128 x 128 blocks" : "") + ", seed " + std::to_string(seed);
      const int col_blocks = (k + 127) / 128;
      // Where scale (row block b, column c) lives: [b, k], or with blocks [c / 128, out_rows / 128].
      const auto scale_index = [&](int64_t b, int c) {
        return blocks ? size_t(c / 128) * (out_rows / 128) + b : size_t(b) * k + c;
      };
      // Rows past an expert's count (its padding, the spare tile) hold large values the kernel must not read.
      std::vector<uint16_t> in(size_t(rows) * k, to_bf16_bits(1e30f));
      std::vector<float> values(in.size(), 0.0f);  // what the kernel should see: zeros past the counts
      for (int e = 0; e < experts; ++e)
        for (int64_t r = offsets[e]; r < offsets[e] + counts[e]; ++r)
          for (int c = 0; c < k; ++c) {
            const float x = float(hashed_int(seed, r * k + c, -1000, 1000)) / 100.0f * (c % 3 == 0 ? 1e3f : 1.0f);
            in[r * k + c] = to_bf16_bits(x);
            values[r * k + c] = from_bf16_bits(in[r * k + c]);
          }
      const int64_t nan_row = offsets[3] + 200, nan_col = 7;  // expert 3's second block, column 7
      in[nan_row * k + nan_col] = to_bf16_bits(NAN);
      values[nan_row * k + nan_col] = NAN;
      // The CPU: expert e's block j of column c is rows [offsets[e] + 128 j, + 128) of values, at out rows
      // out_offsets[e] + 128 j.
      std::vector<int32_t> want_offsets(experts + 1, 0);
      for (int e = 0; e < experts; ++e) want_offsets[e + 1] = want_offsets[e] + (counts[e] + 127) / 128 * 128;
      constexpr uint8_t kPoison = 0xee;
      std::vector<uint8_t> want(size_t(k) * out_rows, kPoison);
      float poison;
      std::memcpy(&poison, &kScalePoison, sizeof poison);
      std::vector<float> want_scales(blocks ? size_t(col_blocks) * (out_rows / 128) : size_t(out_rows / 128) * k,
                                     poison);
      for (int e = 0; e < experts; ++e)
        for (int64_t j = 0; j * 128 < want_offsets[e + 1] - want_offsets[e]; ++j)
          for (int c = 0; c < k; ++c) {
            auto value = [&](int r, int col) {
              return 128 * j + r < counts[e] ? values[(offsets[e] + 128 * j + r) * k + col] : 0.0f;
            };
            float amax = 0.0f;
            bool finite = true;
            const int first = blocks ? c / 128 * 128 : c, last = blocks ? std::min(first + 128, k) : c + 1;
            for (int col = first; col < last; ++col)
              for (int r = 0; r < 128; ++r) {
                finite = finite && std::isfinite(value(r, col));
                amax = std::max(amax, std::abs(value(r, col)));
              }
            const float scale = Fp8Matrix::block_scale(amax, finite, pow2);
            const int64_t block = want_offsets[e] / 128 + j;
            want_scales[scale_index(block, c)] = scale;
            for (int r = 0; r < 128; ++r)
              want[c * out_rows + 128 * block + r] =
                  testing::to_e4m3_bits(reference::scaled_for_e4m3(value(r, c), scale));
          }
      DeviceArray<uint16_t> d_in(in);
      DeviceArray<int32_t> d_counts(counts), d_offsets(offsets), d_out_offsets(std::vector<int32_t>(experts + 1, -1));
      DeviceArray<uint8_t> d_out(std::vector<uint8_t>(want.size(), kPoison));
      DeviceArray<float> d_scales(std::vector<float>(want_scales.size(), poison));
      detail::quantize_columns_fp8({.in = d_in.ptr,
                                    .rows_allocated = rows,
                                    .k = k,
                                    .local_experts = experts,
                                    .expert_counts = d_counts.ptr,
                                    .expert_row_offsets = d_offsets.ptr,
                                    .out_row_offsets = d_out_offsets.ptr,
                                    .out = d_out.ptr,
                                    .scales = d_scales.ptr,
                                    .power_of_two_scales = pow2,
                                    .block_scales = blocks},
                                   nullptr);
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
      ASSERT_EQ(d_out_offsets.download(), want_offsets) << label;
      const auto out = d_out.download();
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_EQ(out[i], want[i]) << "e4m3 of column " << i / out_rows << ", out row " << i % out_rows << ", "
                                   << label;
      const auto scales = d_scales.download();
      for (size_t i = 0; i < scales.size(); ++i)
        ASSERT_EQ(bits_of(scales[i]), bits_of(want_scales[i]))
            << "scale " << i << ": got " << scales[i] << ", expected " << want_scales[i] << ", " << label;
      const int64_t nan_block = want_offsets[3] / 128 + 1;
      const int other_col = blocks ? 128 : nan_col + 1;  // a column of another scale of the same row block
      ASSERT_TRUE(std::isnan(scales[scale_index(nan_block, nan_col)])) << label;
      ASSERT_FALSE(std::isnan(scales[scale_index(nan_block, other_col)])) << label;
      ASSERT_FALSE(std::isnan(scales[scale_index(nan_block - 1, nan_col)])) << label;
    }
  }
}

// Rows read by route (the FP8 weight gradients' routed dy and x, quantized right after the pull): two virtual ranks'
// token rows and router weights, a schedule's routes (an empty expert, a 1-row one, one row of a segment without a
// route, padding rows without one; k = 320: a half column tile), quantized by route with the router weight (dy) and
// without (x). Each must be bitwise the quantizer over the rows the pull writes (bf16(rw * d_out) with one fp32
// product and one rounding, the token row, zeros without a route): the scales, every byte of `out` (poisoned alike)
// and the segment offsets.
TEST(QuantizeFp8Test, ColumnsReadByRouteAreThePulledRowsBits) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> counts = {129, 0, 1, 255, 64, 300};
  const int experts = static_cast<int>(counts.size()), k = 320, ranks = 2, tokens = 96, top_k = 4;
  std::vector<int32_t> offsets(experts + 1, 0);
  for (int e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + (counts[e] + 63) / 64 * 64;
  const int64_t rows = offsets[experts] + 64;
  const int64_t out_rows = detail::fp8_column_rows(rows, experts);
  const uint64_t seed = 1600;
  std::vector<std::vector<uint16_t>> token_rows(ranks, std::vector<uint16_t>(size_t(tokens) * k));
  std::vector<std::vector<float>> weights(ranks, std::vector<float>(size_t(tokens) * top_k));
  for (int r = 0; r < ranks; ++r) {
    for (size_t i = 0; i < token_rows[r].size(); ++i)
      token_rows[r][i] = to_bf16_bits(float(hashed_int(seed + r, int64_t(i), -1000, 1000)) / 64.0f);
    for (size_t i = 0; i < weights[r].size(); ++i)
      weights[r][i] = float(hashed_int(seed + 10 + r, int64_t(i), 1, 1000)) / 997.0f;
  }
  // Routes: every row of a segment a (rank, token, slot), but one; padding rows none (-1).
  std::vector<int32_t> route(rows, -1);
  for (int e = 0; e < experts; ++e)
    for (int64_t r = offsets[e]; r < offsets[e] + counts[e]; ++r) {
      const int rank = hashed_int(seed + 20, r, 0, ranks - 1), token = hashed_int(seed + 21, r, 0, tokens - 1);
      route[r] = (rank * tokens + token) * top_k + hashed_int(seed + 22, r, 0, top_k - 1);
    }
  route[offsets[3] + 7] = -1;
  // What the pull writes: dy = bf16(rw * d_out) and x = the token row, zeros without a route.
  std::vector<uint16_t> dy(size_t(rows) * k, 0), x(size_t(rows) * k, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (route[r] < 0) continue;
    const int token_global = route[r] / top_k, rank = token_global / tokens, token = token_global % tokens;
    const float rw = weights[rank][size_t(token) * top_k + route[r] % top_k];
    for (int c = 0; c < k; ++c) {
      const uint16_t v = token_rows[rank][size_t(token) * k + c];
      x[r * k + c] = v;
      dy[r * k + c] = to_bf16_bits(rw * from_bf16_bits(v));
    }
  }
  DeviceArray<uint16_t> d_rank0(token_rows[0]), d_rank1(token_rows[1]), d_dy(dy), d_x(x);
  DeviceArray<float> d_w0(weights[0]), d_w1(weights[1]);
  DeviceArray<int32_t> d_counts(counts), d_offsets(offsets), d_route(route);
  PeerPointers token_ptrs{}, weight_ptrs{};
  token_ptrs.base[0] = d_rank0.ptr;
  token_ptrs.base[1] = d_rank1.ptr;
  weight_ptrs.base[0] = d_w0.ptr;
  weight_ptrs.base[1] = d_w1.ptr;
  constexpr uint8_t kPoison = 0xee;
  float poison;
  std::memcpy(&poison, &kScalePoison, sizeof poison);
  struct Result {
    std::vector<uint8_t> out;
    std::vector<float> scales;
    std::vector<int32_t> offsets;
  };
  const auto run = [&](const void* in, bool by_route, bool weighted) {
    DeviceArray<uint8_t> d_out(std::vector<uint8_t>(size_t(k) * out_rows, kPoison));
    DeviceArray<float> d_scales(std::vector<float>(size_t(out_rows / 128) * k, poison));
    DeviceArray<int32_t> d_out_offsets(std::vector<int32_t>(experts + 1, -1));
    detail::quantize_columns_fp8({.in = by_route ? nullptr : in,
                                  .rows_allocated = rows,
                                  .k = k,
                                  .local_experts = experts,
                                  .expert_counts = d_counts.ptr,
                                  .expert_row_offsets = d_offsets.ptr,
                                  .out_row_offsets = d_out_offsets.ptr,
                                  .out = d_out.ptr,
                                  .scales = d_scales.ptr,
                                  .pulled_rows = token_ptrs,
                                  .pulled_weights = weight_ptrs,
                                  .weighted = weighted,
                                  .row_route = by_route ? d_route.ptr : nullptr,
                                  .num_tokens = tokens,
                                  .top_k = top_k},
                                 nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    return Result{d_out.download(), d_scales.download(), d_out_offsets.download()};
  };
  for (const bool weighted : {true, false}) {
    const std::string label = weighted ? "dy (weighted)" : "x";
    const Result want = run(weighted ? d_dy.ptr : d_x.ptr, false, false);
    const Result got = run(nullptr, true, weighted);
    ASSERT_EQ(got.offsets, want.offsets) << label;
    for (size_t i = 0; i < want.scales.size(); ++i)
      ASSERT_EQ(bits_of(got.scales[i]), bits_of(want.scales[i])) << label << ": scale " << i;
    for (size_t i = 0; i < want.out.size(); ++i)
      ASSERT_EQ(got.out[i], want.out[i]) << label << ": column " << i / out_rows << ", out row " << i % out_rows;
  }
}

TEST(QuantizeFp8Test, ValidationNamesTheArgument) {
  alignas(16) static uint16_t buffer[64];
  alignas(16) static float scales[16];
  const Fp8QuantizeArgs good{.in = buffer, .rows = 4, .k = 8, .out = buffer, .scales = scales};
  auto message = [](auto fn, Fp8QuantizeArgs a) {
    try {
      fn(a, nullptr);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("other: ") + e.what();
    }
    return std::string("no throw");
  };
  const auto rows_fn = [](const Fp8QuantizeArgs& a, cudaStream_t s) { quantize_rows_fp8(a, s); };
  const auto weights_fn = [](const Fp8QuantizeArgs& a, cudaStream_t s) { quantize_weights_fp8(a, s); };
  Fp8QuantizeArgs a = good;
  a.in = nullptr;
  EXPECT_NE(message(rows_fn, a).find("quantize_rows_fp8: in must be"), std::string::npos);
  a = good;
  a.k = 12;
  EXPECT_NE(message(weights_fn, a).find("quantize_weights_fp8: k must be"), std::string::npos);
  a = good;
  a.rows = 6;
  EXPECT_NE(message(rows_fn, a).find("rows must be a multiple of 4"), std::string::npos);
  a = good;
  a.experts = 2;
  EXPECT_NE(message(rows_fn, a).find("experts must be 1"), std::string::npos);
  a = good;
  a.scales = nullptr;
  EXPECT_NE(message(weights_fn, a).find("scales must be"), std::string::npos);
  a = good;
  a.out = nullptr;
  EXPECT_NE(message(weights_fn, a).find("out must be"), std::string::npos);
  a = good;
  a.out_transposed = buffer;
  EXPECT_NE(message(weights_fn, a).find("go together"), std::string::npos);
  a.scales_transposed = scales;
  EXPECT_NE(message(rows_fn, a).find("are for quantize_weights_fp8"), std::string::npos);
  // quantize_columns_fp8's own checks (before anything is launched).
  static int32_t ints[8];
  const detail::Fp8ColumnQuantizeArgs columns{.in = buffer, .rows_allocated = 128, .k = 64, .local_experts = 1,
                                              .expert_counts = ints, .expert_row_offsets = ints,
                                              .out_row_offsets = ints, .out = buffer, .scales = scales};
  const auto column_message = [](detail::Fp8ColumnQuantizeArgs c) {
    try {
      detail::quantize_columns_fp8(c, nullptr);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  detail::Fp8ColumnQuantizeArgs c = columns;
  c.k = 96;
  EXPECT_NE(column_message(c).find("quantize_columns_fp8: k must be a positive multiple of 64"), std::string::npos);
  c = columns;
  c.out_row_offsets = nullptr;
  EXPECT_NE(column_message(c).find("out_row_offsets must be set"), std::string::npos);
  c = columns;
  c.in = reinterpret_cast<const char*>(buffer) + 2;
  EXPECT_NE(column_message(c).find("in must be a non-null, 16-byte aligned"), std::string::npos);
  c = columns;
  c.local_experts = 0;
  EXPECT_NE(column_message(c).find("local_experts must be positive"), std::string::npos);
  // Rows by route: `in` unset, and the routes' token count and top-k given.
  static int32_t routes[128];
  c = columns;
  c.row_route = routes;
  c.num_tokens = 4;
  c.top_k = 2;
  EXPECT_NE(column_message(c).find("in and row_route exclude each other"), std::string::npos);
  c.in = nullptr;
  c.top_k = 0;
  EXPECT_NE(column_message(c).find("rows read by route need num_tokens and top_k"), std::string::npos);
}

}  // namespace
}  // namespace mok
