// The FP8 recipe's per-block arithmetic on the device (include/mok/fp8.h): a block's scale from its largest
// |value|, and one value's e4m3 bits. Shared by the quantization kernels (src/host/quantize_fp8.cu) and the FP8
// epilogues that quantize their rows (h, d(g|u): src/device/gemm/gemm_epilogue.cuh), so that all give the same bits.
// The scale is an IEEE fp32 division (once per block); a value is multiplied by the scale's correctly rounded
// reciprocal (not divided by the scale: an IEEE division per value is an inline fast path and a CALL to its slow
// path, 840 of the FP8 forward megakernel's SASS instructions, perf_notes round 33), and the conversion is CUDA's
// (round to nearest even, saturating): the CPU reference (reference/fp8.h) gives the same bits.
#pragma once

#include <cfloat>
#include <cstdint>

#include <cuda_fp8.h>

namespace mok::device {

inline constexpr float kE4m3Max = 448.0f;

// The scale of a block whose largest |value| is `amax` (NaN when the block holds a NaN or an infinity): amax / 448,
// at least FLT_MIN (2^-126: a normal scale, whose reciprocal is finite; amax below 448 * 2^-126 ~ 5.3e-36 only).
__device__ __forceinline__ float fp8_block_scale(float amax, bool finite, bool power_of_two) {
  if (!finite) return __int_as_float(0x7fc00000);
  if (amax == 0.0f) return 1.0f;
  float scale = fmaxf(__fdiv_rn(amax, kE4m3Max), FLT_MIN);
  if (power_of_two) {  // rounded up to a power of two (bit operations: exact, the CPU reference's too)
    const uint32_t bits = __float_as_uint(scale);
    if ((bits & 0x007fffffu) != 0) scale = __uint_as_float((bits & 0x7f800000u) + 0x00800000u);
  }
  return scale;
}

// The scale of a row's 1 x 128 block whose values a quad of lanes (4q .. 4q + 3, the wgmma accumulator's columns of one
// row) holds, from each lane's `amax` and `finite` over its values: the quad's by a butterfly, so that every lane of
// the quad returns the same scale (NaN when any lane saw a NaN or an infinity). All 32 lanes call it.
__device__ __forceinline__ float quad_block_scale(float amax, bool finite, bool power_of_two) {
#pragma unroll
  for (int offset = 1; offset < 4; offset *= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, offset));
    finite = __shfl_xor_sync(0xffffffff, int(finite), offset) != 0 && finite;
  }
  return fp8_block_scale(amax, finite, power_of_two);
}

// value * (1 / scale), each IEEE fp32 (a power-of-two scale: exactly value / scale). The reciprocal is the same
// for every value of a block: inlined beside them, it is computed once.
__device__ __forceinline__ float scaled_for_e4m3(float value, float scale) {
  return __fmul_rn(value, __frcp_rn(scale));
}

__device__ __forceinline__ uint8_t to_e4m3(float value, float scale) {
  return __nv_cvt_float_to_fp8(scaled_for_e4m3(value, scale), __NV_SATFINITE, __NV_E4M3);
}

// Two values of one block, `a` in the low byte: to_e4m3's bits, one conversion instruction for both.
__device__ __forceinline__ uint16_t to_e4m3x2(float a, float b, float scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(scaled_for_e4m3(a, scale), scaled_for_e4m3(b, scale)), __NV_SATFINITE,
                                  __NV_E4M3);
}

}  // namespace mok::device
