// e4m3 on the host, bit-exact with the device conversions (CUDA's cuda_fp8.h: round to nearest even,
// saturating to +-448), and FP8 operands with DeepSeek-V3's block scales in the layouts of
// include/mok/expert_gemm.h (A: 1 x 128 per row, scales [k-blocks, rows]; B: 128 x 128 per expert matrix,
// scales [experts, row blocks, k-blocks]).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <cuda_fp8.h>

#include "reference/fp8.h"
#include "tests/common/device_fill.h"

namespace mok::testing {

inline uint8_t to_e4m3_bits(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

inline float from_e4m3_bits(uint8_t bits) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(bits, __NV_E4M3))); }

inline constexpr int kScaleBlock = 128;  // columns (and B rows) per scale

inline int scale_blocks(int64_t extent) { return static_cast<int>((extent + kScaleBlock - 1) / kScaleBlock); }

// rows x k e4m3 values with their scales; value(r, c) is what the GEMM multiplies.
struct Fp8Matrix {
  int64_t rows = 0;   // all rows (experts x rows_per_expert for B)
  int64_t rows_per_expert = 0;  // B: the rows of one expert's matrix (its 128-row blocks restart per expert)
  int k = 0;
  bool per_row = true;  // A (1 x 128 scales) or B (128 x 128)
  std::vector<uint8_t> bits;
  std::vector<float> scales;

  int k_blocks() const { return scale_blocks(k); }
  int64_t scale_index(int64_t r, int c) const {
    if (per_row) return int64_t(c / kScaleBlock) * rows + r;
    const int64_t e = r / rows_per_expert, block_row = (r % rows_per_expert) / kScaleBlock;
    return (e * scale_blocks(rows_per_expert) + block_row) * k_blocks() + c / kScaleBlock;
  }
  double value(int64_t r, int c) const {
    return double(from_e4m3_bits(bits[r * k + c])) * scales[scale_index(r, c)];
  }
  // Row r of this (A) times row w_row of `w` (B), in double.
  double dot(int64_t r, const Fp8Matrix& w, int64_t w_row) const {
    double sum = 0;
    for (int c = 0; c < k; ++c) sum += value(r, c) * w.value(w_row, c);
    return sum;
  }

  static Fp8Matrix shaped(int64_t rows, int64_t rows_per_expert, int k, bool per_row) {
    Fp8Matrix m;
    m.rows = rows;
    m.rows_per_expert = rows_per_expert;
    m.k = k;
    m.per_row = per_row;
    m.bits.resize(size_t(rows) * k);
    m.scales.resize(per_row ? size_t(m.k_blocks()) * rows
                            : size_t(rows / rows_per_expert) * scale_blocks(rows_per_expert) * m.k_blocks());
    return m;
  }

  // Integer values in [-4, 4] (exact in e4m3) and power-of-two scales 2^[-2, 2]: a k-block's partial sums
  // (at most 128 * 16) are exact in the tensor cores, and so are the promoted fp32 sums.
  static Fp8Matrix exact(int64_t rows, int64_t rows_per_expert, int k, bool per_row, uint64_t seed) {
    Fp8Matrix m = shaped(rows, rows_per_expert, k, per_row);
    for (size_t i = 0; i < m.bits.size(); ++i) m.bits[i] = to_e4m3_bits(float(hashed_int(seed, int64_t(i), -4, 4)));
    for (size_t i = 0; i < m.scales.size(); ++i)
      m.scales[i] = std::ldexp(1.0f, hashed_int(seed + 1, int64_t(i), -2, 2));
    return m;
  }

  // The scale of a block (include/mok/fp8.h): amax / 448 (at least 2^-126), 1 for an all-zero block, NaN for a
  // block holding a NaN or an infinity; with power_of_two, rounded up to a power of two. The CPU reference's rule
  // (reference/fp8.h), which test_quantize_fp8 checks against the GPU's bitwise.
  static float block_scale(float amax, bool finite, bool power_of_two) {
    return reference::fp8_block_scale(amax, finite, power_of_two);
  }

  // Quantizes `values` [rows, k] as the recipe does (include/mok/fp8.h): e4m3 = round(value * (1 / scale)).
  static Fp8Matrix quantize(const std::vector<float>& values, int64_t rows, int64_t rows_per_expert, int k,
                            bool per_row, bool power_of_two = false) {
    Fp8Matrix m = shaped(rows, rows_per_expert, k, per_row);
    std::vector<float> amax(m.scales.size(), 0.0f);
    std::vector<char> finite(m.scales.size(), 1);
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < k; ++c) {
        const float v = values[r * k + c];
        const int64_t i = m.scale_index(r, c);
        amax[i] = std::max(amax[i], std::abs(v));
        finite[i] = finite[i] && std::isfinite(v);
      }
    for (size_t i = 0; i < amax.size(); ++i) m.scales[i] = block_scale(amax[i], finite[i], power_of_two);
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < k; ++c)
        m.bits[r * k + c] = to_e4m3_bits(reference::scaled_for_e4m3(values[r * k + c], m.scales[m.scale_index(r, c)]));
    return m;
  }
};

}  // namespace mok::testing
