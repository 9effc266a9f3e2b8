// Weight gradients of the routed (or shared) experts as k-grouped GEMMs: the reduction runs over each
// expert's rows of the schedule, both operands read MN-major (rows of a and b are the K dimension).
//
//   grad_e[m, n] = sum_{r in segment e} a[r, m] * b[r, n]          e = 0 .. local_experts - 1
//     the backward's uses:  dW_down_e  = sum_r dy[r]ᵀ h[r]        a = dy = rw * d_out rows [rows, H], b = h [rows, I]
//                           dW_gu_e    = sum_r d_gu[r]ᵀ x[r]      a = [d_g, d_u] [rows, 2I],        b = x rows [rows, H]
//   a bf16 [rows_allocated, m], b bf16 [rows_allocated, n] row-major (FP8: see below); fp32 accumulation.
//   Segment e is [expert_row_offsets[e], min(expert_row_offsets[e + 1], *scheduled_rows)): padding rows
//   (past the expert's count inside its segment) must be zero in a or in b and finite in the other (the
//   forward's and the backward's GEMMs write them as zeros). An expert without rows gets a zero gradient.
//
// Output (GradOutput): kBFloat16 / kFloat32 write grad_e, rounded once; kAccumulateFloat32 adds grad_e to the
// fp32 values already there (Megatron's main_grad: out = out + grad_e, one fp32 addition per element).
// Rows [0, m_split) of each expert's gradient go to `out` [E_local, m_split, n] and rows [m_split, m) to
// `out_split` [E_local, m - m_split, n] when out_split is set (separate gate and up gradients from one
// [d_g, d_u] operand); otherwise `out` is [E_local, m, n].
//
// Precision::kFP8 (DeepSeek-V3's weight-gradient recipe): a and b are e4m3, transposed, [m, rows_allocated] and
// [n, rows_allocated] row-major (K-major), each column scaled per 128 rows (a_scales fp32 [rows_allocated / 128, m],
// b_scales [rows_allocated / 128, n]); segments are multiples of 128 rows (tile_m 128), as
// detail::quantize_columns_fp8 writes them with its own row offsets: expert_row_offsets are those and
// scheduled_rows points at their last entry. grad_e = sum over k-blocks of (a_scale * b_scale) * (the block's
// e4m3 product, fp32), in ascending order. m and n: multiples of 64 (a 128-column tile past m or n is read as
// zeros).
//
// Deterministic: each output tile is owned by one CTA, which reduces its expert's rows in ascending order
// in fp32; no atomics on values. Asynchronous on `stream`, no host synchronization. Waits bounded and reported
// as expert_gemm's (args.waits; kernel weight_grad_gemm).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "mok/expert_gemm.h"
#include "mok/status.h"

namespace mok {

enum class GradOutput : int32_t {
  kBFloat16 = 0,           // write, bf16
  kFloat32 = 1,            // write, fp32
  kAccumulateFloat32 = 2,  // fp32 out += this call's gradient
};

struct WeightGradArgs {
  const void* a = nullptr;      // bf16 [rows_allocated, m], 16-byte aligned
  const void* b = nullptr;      // bf16 [rows_allocated, n], 16-byte aligned
  int64_t rows_allocated = 0;   // a multiple of tile_m
  int m = 0;                    // multiple of 64
  int n = 0;                    // multiple of 64
  int local_experts = 0;
  const int32_t* expert_row_offsets = nullptr;  // from ScheduleView: [local_experts + 1], segments padded to tile_m
  const int32_t* scheduled_rows = nullptr;      // from ScheduleView
  int tile_m = 64;                              // the schedule's padding (64 or 128)
  GradOutput output = GradOutput::kBFloat16;
  void* out = nullptr;          // [E_local, m_split or m, n], bf16 or fp32 as `output` says, 16-byte aligned
  void* out_split = nullptr;    // optional: [E_local, m - m_split, n]
  int m_split = 0;              // with out_split: a multiple of 64 in (0, m)
  int32_t* ticket = nullptr;    // one int32 of device memory, zeroed by the call on its stream
  WaitBound waits;              // required: as ExpertGemmArgs::waits
  Precision precision = Precision::kBF16;  // kFP8: a and b as above (e4m3, K-major) with their scales
  const float* a_scales = nullptr;         // kFP8: [rows_allocated / 128, m]
  const float* b_scales = nullptr;         // kFP8: [rows_allocated / 128, n]
  // kFP8 (the layer's default; perf_notes rounds 46-47): b scaled per 128 rows x 128 columns,
  // b_scales then [ceil(n / 128), rows_allocated / 128] (detail::Fp8ColumnQuantizeArgs::block_scales): one FMA a
  // value promotes.
  bool b_block_scales = false;
};

// Throws std::invalid_argument naming the offending field.
void validate(const WeightGradArgs& args);

void weight_grad_gemm(const WeightGradArgs& args, cudaStream_t stream);

}  // namespace mok
