// The FP8 recipe's per-block arithmetic on the device (include/mok/fp8.h): a block's scale from its largest
// |value|, and one value's e4m3 bits. Shared by the quantization kernels (src/host/quantize_fp8.cu) and the FP8
// SwiGLU epilogue that writes h quantized (src/device/gemm/gemm_epilogue.cuh), so that both give the same bits.
// Every division is IEEE fp32 and the conversion is CUDA's (round to nearest even, saturating): the CPU reference
// (tests/common/fp8.h) gives the same bits.
#pragma once

#include <cstdint>

#include <cuda_fp8.h>

namespace mok::device {

inline constexpr float kE4m3Max = 448.0f;

// The scale of a block whose largest |value| is `amax` (NaN when the block holds a NaN or an infinity).
__device__ __forceinline__ float fp8_block_scale(float amax, bool finite, bool power_of_two) {
  if (!finite) return __int_as_float(0x7fc00000);
  if (amax == 0.0f) return 1.0f;
  float scale = __fdiv_rn(amax, kE4m3Max);
  if (power_of_two) {  // rounded up to a power of two (bit operations: exact, the CPU reference's too)
    const uint32_t bits = __float_as_uint(scale);
    const uint32_t exponent = bits & 0x7f800000u, mantissa = bits & 0x007fffffu;
    if (exponent == 0)  // subnormal (amax below 2^-117), never zero: the next power of two of the mantissa
      scale = (mantissa & (mantissa - 1)) == 0 ? scale : __uint_as_float(1u << (32 - __clz(mantissa)));
    else if (mantissa != 0)
      scale = __uint_as_float(exponent + 0x00800000u);
  }
  return scale;
}

__device__ __forceinline__ uint8_t to_e4m3(float value, float scale) {
  return __nv_cvt_float_to_fp8(__fdiv_rn(value, scale), __NV_SATFINITE, __NV_E4M3);
}

// Two values of one block, `a` in the low byte: to_e4m3's bits, one conversion instruction for both.
__device__ __forceinline__ uint16_t to_e4m3x2(float a, float b, float scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(a, scale), __fdiv_rn(b, scale)), __NV_SATFINITE, __NV_E4M3);
}

}  // namespace mok::device
