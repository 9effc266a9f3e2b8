// FP8 on the CPU: see fp8.h.
#include "reference/fp8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

namespace mok::reference {

float round_to_e4m3(float value) {
  if (std::isnan(value)) return value;
  const float magnitude = std::fabs(value);
  if (magnitude >= kE4m3Max) return std::copysign(kE4m3Max, value);  // saturating (SATFINITE), infinities too
  // e4m3: 3 mantissa bits, exponents down to -6 (below 2^-6 the subnormals' step, 2^-9). Scaling by a power of
  // two is exact, and nearbyint rounds to nearest even in the default rounding mode.
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude = m * 2^exponent, m in [0.5, 1)
  const int step = std::max(exponent - 1, -6) - 3;
  const float rounded = std::ldexp(std::nearbyint(std::ldexp(magnitude, -step)), step);
  // 448 < magnitude < 464 rounds to 448 (480 is past e4m3's largest finite value, and 464 is the tie, to even).
  return std::copysign(std::min(rounded, kE4m3Max), value);
}

float fp8_block_scale(float amax, bool finite, bool power_of_two) {
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0.0f) return 1.0f;
  float scale = std::max(amax / kE4m3Max, std::numeric_limits<float>::min());
  if (power_of_two) {  // rounded up to a power of two, by the device's bit operations (fp8_quant.cuh)
    const uint32_t bits = std::bit_cast<uint32_t>(scale);
    if ((bits & 0x007fffffu) != 0) scale = std::bit_cast<float>((bits & 0x7f800000u) + 0x00800000u);
  }
  return scale;
}

float scaled_for_e4m3(float value, float scale) {
  const float reciprocal = 1.0f / scale;  // IEEE fp32, as __frcp_rn
  return value * reciprocal;
}

float quantize_block(double* values, int64_t count, int64_t stride, bool power_of_two) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) {
    const float v = static_cast<float>(values[i * stride]);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  const float scale = fp8_block_scale(amax, finite, power_of_two);
  for (int64_t i = 0; i < count; ++i) {
    double& v = values[i * stride];
    v = static_cast<double>(round_to_e4m3(scaled_for_e4m3(static_cast<float>(v), scale))) * static_cast<double>(scale);
  }
  return scale;
}

void quantize_row(double* row, int64_t cols, bool power_of_two) {
  for (int64_t c = 0; c < cols; c += kFp8Block)
    quantize_block(row + c, std::min<int64_t>(kFp8Block, cols - c), 1, power_of_two);
}

void quantize_matrix(double* matrix, int64_t rows, int64_t cols, bool power_of_two) {
  std::vector<double> block;
  for (int64_t r0 = 0; r0 < rows; r0 += kFp8Block) {
    const int64_t block_rows = std::min<int64_t>(kFp8Block, rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += kFp8Block) {
      const int64_t block_cols = std::min<int64_t>(kFp8Block, cols - c0);
      block.resize(block_rows * block_cols);
      for (int64_t r = 0; r < block_rows; ++r)
        std::copy_n(matrix + (r0 + r) * cols + c0, block_cols, block.begin() + r * block_cols);
      quantize_block(block.data(), block_rows * block_cols, 1, power_of_two);
      for (int64_t r = 0; r < block_rows; ++r)
        std::copy_n(block.begin() + r * block_cols, block_cols, matrix + (r0 + r) * cols + c0);
    }
  }
}

}  // namespace mok::reference
