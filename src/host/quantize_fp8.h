// The layer's FP8 row kernels (MoeOptions::precision kFP8; src/host/quantize_fp8.cu). A published FP8 row lives in
// the bf16 row's 2H bytes of the symmetric x buffer (the pull copies it as it copies a bf16 row):
//   bytes [0, H)                     e4m3 values, quantized per 128 columns (include/mok/fp8.h)
//   bytes [H, H + 4 * ceil(H/128))   the fp32 scales of its 128-column blocks
// The pull copies its first fp8_row_bytes(H) into the context's expert-major rows, packed at that stride.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "mok/fp8.h"
#include "mok/peer_group.h"
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

// FP8 weight gradients' operands (docs/design.md, "FP8 weight gradients: the plan"; the transpose-and-quantize
// kernel that comes first): a schedule's expert-major bf16 rows [rows_allocated, k] transposed to e4m3
// [k, fp8_column_rows(rows_allocated, E)] and quantized along the rows, one scale per column per 128 rows of one
// expert. Each expert's segment is re-padded to 128 rows: out_row_offsets [E + 1] (written, multiples of 128) are
// the segments' first rows in `out`; rows of an expert past its count, and the padding, are zeros. scales: fp32
// [fp8_column_rows(...) / 128, k], block b = rows [128 b, 128 b + 128) of `out`. A block holding a NaN or an
// infinity gets a NaN scale (the gradients it feeds are NaN; d_out's and d(g|u)'s NaNs are reported where they are
// quantized along their rows). The operands of weight_grad_gemm's precision kFP8
// (MoeWorkspace::fp8_weight_gradients()).
struct Fp8ColumnQuantizeArgs {
  const void* in = nullptr;                    // bf16 [rows_allocated, k], 16-byte aligned (or row_route below)
  int64_t rows_allocated = 0;
  int k = 0;                                   // a positive multiple of 64
  int local_experts = 0;
  const int32_t* expert_counts = nullptr;      // [E]: the rows of each expert (ScheduleView's)
  const int32_t* expert_row_offsets = nullptr; // [E + 1]: each expert's first row in `in` (ScheduleView's)
  const int32_t* scheduled_rows = nullptr;     // nullable: rows of `in` at or past it are none of an expert's
  int32_t* out_row_offsets = nullptr;          // [E + 1], written
  void* out = nullptr;                         // e4m3 [k, fp8_column_rows(rows_allocated, E)], 16-byte aligned
  float* scales = nullptr;                     // fp32 [fp8_column_rows(rows_allocated, E) / 128, k]
  bool power_of_two_scales = false;
  // The FP8 weight gradients' x and h (unless MoeOptions::fp8_weight_gradient_columns): one scale per 128 rows x
  // 128 columns instead of per column, scales then fp32 [ceil(k / 128), fp8_column_rows(rows_allocated, E) / 128] (a
  // column block's k-blocks contiguous: the FP8 weight gradient's block-scaled B operand,
  // WeightGradArgs::b_block_scales).
  bool block_scales = false;
  // Instead of `in` (null then, rows read by route when row_route is set): each scheduled row read where the backward's
  // pull reads it, so that no bf16 copy of it is written and read again (the routed dy and x of the FP8 weight
  // gradients): row r is the token row of its route row_route[r] in the source rank's pulled_rows (bf16
  // [padded T, k]) or zeros without a route, times the route's router weight in pulled_weights (fp32 [T * top_k]) when
  // `weighted`, rounded to bf16 (dy = bf16(rw * d_out), the pull's bits).
  PeerPointers pulled_rows = {};
  PeerPointers pulled_weights = {};
  bool weighted = false;
  const int32_t* row_route = nullptr;          // [rows_allocated]
  int num_tokens = 0;                          // per rank
  int top_k = 0;
};
// The rows `out` holds for any schedule of these rows: each segment grows by at most 64 rows (tile_m 64 -> 128).
constexpr int64_t fp8_column_rows(int64_t rows_allocated, int local_experts) {
  return (rows_allocated + 64 * int64_t(local_experts) + 127) / 128 * 128;
}
void quantize_columns_fp8(const Fp8ColumnQuantizeArgs& args, cudaStream_t stream);

// The scales of FP8 rows [row_limit, fp8_row_bytes(h)] (rows at or past *scheduled_rows are skipped) as the GEMM's
// A scales, fp32 [ceil(h/128), row_limit].
void unpack_fp8_row_scales(const void* rows, const int32_t* scheduled_rows, int64_t row_limit, int h, float* scales,
                           cudaStream_t stream);

}  // namespace mok::detail
