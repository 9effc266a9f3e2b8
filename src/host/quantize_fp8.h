// The layer's FP8 row kernels (MoeOptions::precision kFP8; src/host/quantize_fp8.cu). A published FP8 row lives in
// the bf16 row's 2H bytes of the symmetric x buffer (the pull copies it as it copies a bf16 row):
//   bytes [0, H)                     e4m3 values, quantized per 128 columns (include/mok/fp8.h)
//   bytes [H, H + 4 * ceil(H/128))   the fp32 scales of its 128-column blocks
// The pull copies its first fp8_row_bytes(H) into the context's expert-major rows, packed at that stride.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "mok/fp8.h"
#include "mok/status.h"

namespace mok::detail {

// Bytes of an FP8 row (values and scales) rounded up to 16: the pulled part and the context's row stride.
constexpr int64_t fp8_row_bytes(int64_t h) { return (h + 4 * ((h + 127) / 128) + 15) / 16 * 16; }

// x bf16 [tokens, h] -> FP8 rows [padded_tokens, 2h bytes] (rows past `tokens`: zeros, scales 1) and their scales
// again as the GEMM's A scales, fp32 [ceil(h/128), padded_tokens]; power_of_two: the scales rounded up to powers
// of two (include/mok/fp8.h). A block holding a NaN or an infinity is reported to `status` (kStatusNonFinite with the
// token row and `rank`).
void publish_fp8_rows(const void* x, int64_t tokens, int64_t padded_tokens, int h, void* rows, float* scales,
                      bool power_of_two, DeviceStatus* status, int rank, cudaStream_t stream);

// mok::quantize_rows_fp8 (include/mok/fp8.h) that also reports a block holding a NaN or an infinity to `status`
// (kStatusNonFinite: `where`, `rank` and the row; status null: no report).
void quantize_rows_fp8(const Fp8QuantizeArgs& args, DeviceStatus* status, NonFiniteWhere where, int rank,
                       cudaStream_t stream);

// The scales of FP8 rows [row_limit, fp8_row_bytes(h)] (rows at or past *scheduled_rows are skipped) as the GEMM's
// A scales, fp32 [ceil(h/128), row_limit].
void unpack_fp8_row_scales(const void* rows, const int32_t* scheduled_rows, int64_t row_limit, int h, float* scales,
                           cudaStream_t stream);

}  // namespace mok::detail
