// FP8 on the CPU, for the reference (moe_reference.h, Fp8Recipe): DeepSeek-V3's recipe as the GPU's quantization
// kernels and epilogues apply it (include/mok/fp8.h; docs/design.md, "FP8"): e4m3 values (OCP FP8, max 448, round
// to nearest even, saturating) with fp32 scales, one per block: scale = amax / 448 in fp32, at least 2^-126 (1 for
// an all-zero block, NaN for a block holding a NaN or an infinity, so that everything read from it turns NaN),
// optionally rounded up to a power of two; a value is stored as e4m3(value * (1 / scale)), each operation IEEE
// fp32, and multiplied as e4m3 * scale.
// Plain C++ (no CUDA): tests/cpu/test_reference_fp8.cpp checks round_to_e4m3 against CUDA's conversion bitwise.
#pragma once

#include <cstdint>
#include <vector>

namespace mok::reference {

inline constexpr int kFp8Block = 128;  // columns per activation scale; rows and columns per weight scale
inline constexpr float kE4m3Max = 448.0f;

// The e4m3 value nearest to `value` (ties to even), saturated to +-448 (infinities too); NaN stays NaN. The value
// of CUDA's __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3), as a float.
float round_to_e4m3(float value);

// The scale of a block whose largest magnitude is amax (`finite`: no NaN or infinity in it).
float fp8_block_scale(float amax, bool finite, bool power_of_two);

// What a value is before its conversion to e4m3: value * (1 / scale), each IEEE fp32 (the device's
// scaled_for_e4m3; with a power-of-two scale exactly value / scale).
float scaled_for_e4m3(float value, float scale);

// One block's values as an FP8 GEMM multiplies them: e4m3(scaled_for_e4m3(float(v), scale)) * scale for each of
// `count` values at `values` (stride `stride`), in place; returns the scale. The values are first rounded to float
// (the GPU quantizes what it holds in fp32 or bf16).
float quantize_block(double* values, int64_t count, int64_t stride, bool power_of_two);

// A row of `cols` values quantized per 1 x 128 (the last block may be shorter), in place.
void quantize_row(double* row, int64_t cols, bool power_of_two);

// A matrix [rows, cols] (row-major) quantized per 128 x 128 block, in place: a weight matrix of one expert.
void quantize_matrix(double* matrix, int64_t rows, int64_t cols, bool power_of_two);

}  // namespace mok::reference
