// bf16 on the host, bit-exact with the device conversions (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>

namespace mok::testing {

inline constexpr uint16_t kBf16Poison = 0x7fc1;  // a bf16 NaN: written into outputs before a run

inline uint16_t to_bf16_bits(float v) { return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(v)).x; }

inline float from_bf16_bits(uint16_t bits) {
  __nv_bfloat16_raw raw;
  raw.x = bits;
  return __bfloat162float(__nv_bfloat16(raw));
}

inline float round_to_bf16(float v) { return from_bf16_bits(to_bf16_bits(v)); }

// An fp32 value's bits (bitwise comparisons: -0 and +0 differ, a NaN equals its own bits).
inline uint32_t float_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits;
}

}  // namespace mok::testing
