// FP8 quantization, DeepSeek-V3's recipe (docs/design.md, "FP8"): e4m3 values (round to nearest even,
// saturating to +-448) with fp32 scales; value = e4m3 * scale.
//   scale of a block = amax / 448, at least 2^-126 (amax: the largest |value| of the block; 1 for an all-zero
//   block), or with power_of_two_scales that value rounded up to a power of two (scaling is then exact in any
//   precision); e4m3 = e4m3(value * (1 / scale)), each operation IEEE fp32.
//   A block holding a NaN or an infinity gets a NaN scale: every product that reads it is NaN (the rows of that
//   block only, for activations), never a finite wrong number.
// Activations (quantize_rows_fp8): per row per 128 columns, the GEMM's A operand with a_scales [ceil(k/128),
// rows] (include/mok/expert_gemm.h). Weights (quantize_weights_fp8): per 128 x 128 block of each expert's
// [rows, k] matrix, the GEMM's B operand with b_scales [experts, ceil(rows/128), ceil(k/128)].
// Both asynchronous on `stream`, no host synchronization; they throw std::invalid_argument naming the argument.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mok {

struct Fp8QuantizeArgs {
  const void* in = nullptr;   // bf16 [experts, rows, k] (quantize_rows_fp8: experts = 1), 16-byte aligned rows
  int experts = 1;
  int64_t rows = 0;
  int k = 0;                  // a multiple of 8
  void* out = nullptr;        // e4m3 [experts, rows, k]
  float* scales = nullptr;    // see the header; rows: 16-byte aligned for quantize_rows_fp8
  bool power_of_two_scales = false;
  // quantize_weights_fp8, optional (both or neither): each expert's matrix transposed, e4m3 [experts, k, rows],
  // and its scales [experts, ceil(k/128), ceil(rows/128)]. A 128 x 128 block's scale serves its transpose, so
  // these are the transposed values exactly (what a GEMM that reads the weight the other way round, K-major, needs:
  // the backward's dgrad through it). 2 x the values' and the scales' bytes in all.
  void* out_transposed = nullptr;
  float* scales_transposed = nullptr;
  // quantize_rows_fp8, optional: a device int32 count; rows at or past it are left as they are (a schedule's rows
  // in a buffer of `rows` allocated: read on the GPU, no host synchronization).
  const int32_t* rows_used = nullptr;
};

void quantize_rows_fp8(const Fp8QuantizeArgs& args, cudaStream_t stream);
void quantize_weights_fp8(const Fp8QuantizeArgs& args, cudaStream_t stream);

}  // namespace mok
