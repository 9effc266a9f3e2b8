// Grouped GEMM over the expert-major rows of a schedule (BF16 in, or FP8 with block scales; fp32 accumulation,
// BF16 out).
//
//   kStore:  out[r, :] = row_scale[r] * (a[r, :] · W_e^T)                       W = b [E_local, n, k]
//   kSwiGLU: out[r, :] = row_scale[r] * silu(min(g, L)) * clamp(u, -L, L)
//            g = a[r] · Wg_e^T, u = a[r] · Wu_e^T with either fused weights b [E_local, 2n, k] (n gate rows
//            then n up rows per expert) or separate b = Wg [E_local, n, k], b_up = Wu [E_local, n, k].
//   kSwiGLUBackward (the backward's down dgrad, the SwiGLU backward fused into its epilogue):
//            d_hu = a[r] · W_e^T over n = I columns (a = d_out rows, k = H; W = W_down read MN-major), then
//            with g, u from `gate_up` (bf16 [a_rows, 2n], g in columns [0, n), u in [n, 2n)), L the clamp,
//            d_h = row_scale[r] * d_hu (row_scale = the route's router weight; null: 1):
//              out[r, c]     = d_g = d_h * u_c * silu'(g_c) * [L == 0 or g < L]
//              out[r, n + c] = d_u = d_h * silu(g_c) * [L == 0 or -L < u < L]        out bf16 [a_rows, 2n]
//              row_partials[r, nb] = sum over the tile's columns c of d_hu[r, c] * silu(g_c) * u_c (fp32,
//                                    the d_rw partial of n-block nb; unscaled, so exact at rw = 0)
// Row r belongs to expert e when it lies in e's padded segment of the schedule; padding rows get zeros.
// Asynchronous on `stream`, no host synchronization (row counts are read on the GPU). Every wait between the
// kernel's roles is bounded: a stalled role is reported in args.waits.status (a StatusReport: kernel expert_gemm,
// role, counter, SM) instead of hanging, the kernel ends and the output is unspecified (docs/sync_protocol.md).
//
// Operand majorness (b_major): kK reads b as [E_local, n, k] (the forward: k contiguous); kMN reads b as
// [E_local, k, n] (n contiguous: the backward's dgrad through the forward's weights, unchanged in memory).
// kMN with b_up (kStore only): K is the concatenation of b [E_local, k/2, n] and b_up [E_local, k/2, n]
// (the gate/up dgrad over [d_g, d_u] with separate gate and up weights).
//
// Precision kFP8 (kStore, kSwiGLU and kSwiGLUBackward, b_major kK; DeepSeek-V3's recipe, docs/design.md "FP8"):
// a and b hold
// e4m3 values, each with fp32 block scales; the GEMM computes with a[r, c] * a_scales[c / 128, r] and
// b[row, c] * b_scales[e, row / 128, c / 128] (row: the row of expert e's matrix, b_expert_rows = n, or 2n for
// fused gate/up weights), promoting the tensor cores' partial sums to fp32 once per 128 of k. k may end with a
// partial 128-column block. Tiles of 128 x 128 accumulators (kStore 128 output columns, kSwiGLU 64).
// kFP8 kSwiGLUBackward (the FP8 backward's down dgrad, docs/design.md "FP8 backward"): a = d_out rows quantized
// per 1 x 128, b = W_down transposed [E_local, n = I, k = H] K-major (quantize_weights_fp8's out_transposed: the
// forward's values exactly); the epilogue is bf16's, over 128-column tiles (row_partials: gemm_n_blocks(args)).
// With out_scales (n % 128 == 0) it also writes d_g | d_u quantized per 1 x 128 into quantized_out, the gate/up
// dgrad's A: the same bits as quantize_rows_fp8 of `out` (the scheduled rows; a block holding a NaN or an infinity
// gets a NaN scale and is reported to waits.status, kStatusNonFinite with NonFiniteWhere::kDGateUp and its row).
// kFP8 kSwiGLU with out_scales: h is written quantized as the down GEMM's A, e4m3 with one scale per row per 128
// columns (include/mok/fp8.h's recipe applied to the bf16 h the plain kSwiGLU writes: the same bits as kSwiGLU
// followed by quantize_rows_fp8); a task computes 128 h columns, one scale block (two 64-column tiles in turn).
// With gate_up_out it also writes the bf16 g | u and h (hidden_out) a training context keeps: kSwiGLU's bits.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "mok/peer_group.h"
#include "mok/status.h"

namespace mok {

enum class GemmEpilogue : int32_t { kStore = 0, kSwiGLU = 1, kSwiGLUBackward = 2 };

enum class Precision : int32_t {
  kBF16 = 0,  // bf16 operands
  kFP8 = 1,   // e4m3 operands with fp32 block scales (1 x 128 for A, 128 x 128 for B)
};

enum class OperandMajor : int32_t {
  kK = 0,   // rows of the operand are contiguous along k
  kMN = 1,  // rows of the operand are contiguous along m (A) or n (B): a transposed view, no copy
};

// A rows gathered by the GEMM's producer instead of read from `a` (kSwiGLU with b_major kK: the forward's gate/up
// from x; kSwiGLUBackward: the down dgrad from d_out; docs/design.md, "Row gather in the gate/up
// producer"): row r of A is row `token` of x when row_route[r] is a route from `rank`, row r of `a` when it is
// another rank's (a must then hold that row, pulled), zeros for padding (route -1). The same A values as reading
// `a` after pull_rows (pull_grad_rows), so the same bits. Runs in clusters of 1.
struct RowGatherArgs {
  const void* x = nullptr;             // bf16 [tokens, k], this rank's token rows; nullptr: no gather (A is `a`)
  const int32_t* row_route = nullptr;  // [a_rows] the schedule's route id per row (ScheduleView::row_route)
  int num_tokens = 0;                  // T of the route ids (src * T * top_k + token * top_k + slot)
  int top_k = 0;
  int rank = 0;                        // this rank: routes from it read x
};

// Output rows scattered to their routes' combine rows instead of stored to `out` (kStore, bf16; docs/design.md,
// "Row scatter in the store epilogue"): row r whose route row_route[r] = (src, token, slot) is not -1 goes to row
// token * top_k + slot of rank src's combine buffer (bf16 [num_tokens * top_k, n]); padding rows are written
// nowhere. The values are those `out` would hold, so the same bits as storing to `out` and copying each row to its
// route's row afterwards (the forward's push_rows). The rows are written by TMA through one tensor map per rank
// (encode_row_scatter_maps); the stores go to peers' memory, and each consumer thread waits for them and fences at
// system scope before the kernel ends (a barrier arrive after it in the stream then releases them).
struct RowScatterArgs {
  const void* maps = nullptr;          // device memory, 64-byte aligned: `ranks` tensor maps of kRowScatterMapBytes
                                       // each, rank r's from encode_row_scatter_maps (rows num_tokens * top_k, this n)
  const int32_t* row_route = nullptr;  // [a_rows] the schedule's route id per row; nullptr: no scatter
  int num_tokens = 0;                  // T of the route ids (src * T * top_k + token * top_k + slot)
  int top_k = 0;
  int ranks = 0;                       // the routes' sources: maps holds this many
};

// Bytes of one rank's tensor map in RowScatterArgs::maps.
inline constexpr int kRowScatterMapBytes = 128;

// Writes the tensor maps of the combine buffers combined.base[0 .. ranks) (each bf16 [rows, n], 16-byte aligned,
// addressable from the GPU that runs the GEMM) to host_maps (ranks * kRowScatterMapBytes bytes), for the caller to
// copy to device memory (RowScatterArgs::maps). Host only; throws std::invalid_argument naming a bad argument.
void encode_row_scatter_maps(const PeerPointers& combined, int ranks, int64_t rows, int n, void* host_maps);

struct ExpertGemmArgs {
  GemmEpilogue epilogue = GemmEpilogue::kStore;
  Precision precision = Precision::kBF16;
  const void* a = nullptr;      // bf16 (kFP8: e4m3) [a_rows, k], 16-byte aligned rows
  int64_t a_rows = 0;           // rows allocated (the schedule's capacity)
  int64_t a_row_stride = 0;     // elements from one row of a to the next (16-byte multiple); 0: k
  int k = 0;                    // multiple of 64
  const void* b = nullptr;      // bf16 weights, see above
  const void* b_up = nullptr;   // kSwiGLU with separate gate/up weights; nullptr: b is fused [E, 2n, k];
                                // kStore with b_major kMN: the second half of K (see above)
  OperandMajor b_major = OperandMajor::kK;
  const float* a_scales = nullptr;     // kFP8: [ceil(k / 128), a_rows] (rows contiguous), 16-byte aligned
  const float* b_scales = nullptr;     // kFP8: b's, [local_experts, ceil(b_expert_rows / 128), ceil(k / 128)]
  const float* b_up_scales = nullptr;  // kFP8 with b_up: b_up's, [local_experts, ceil(n / 128), ceil(k / 128)]
  int n = 0;                    // output columns, a multiple of 64; the last output tile (kStore and
                                // kSwiGLUBackward 256 columns, kSwiGLU 128: gemm_n_blocks) is partial when n is
                                // not a multiple of it
  int local_experts = 0;
  const int32_t* expert_counts = nullptr;       // from ScheduleView
  const int32_t* expert_row_offsets = nullptr;  // from ScheduleView; segments padded to tile_m
  const int32_t* scheduled_rows = nullptr;      // from ScheduleView
  int tile_m = 64;              // the schedule's padding (64 or 128); a 64-row segment end runs as a half
                                // task on one consumer warpgroup
  const float* row_scale = nullptr;  // optional [a_rows]
  float swiglu_limit = 0;       // 0: plain SwiGLU
  void* out = nullptr;          // bf16 [a_rows, n] (kSwiGLUBackward: [a_rows, 2n]); with out_scales e4m3 [a_rows, n];
                                // null with scatter (the rows go to the combine buffers instead)
  float* out_scales = nullptr;  // kFP8 kSwiGLU, optional: h written quantized (see above) into out, its scales
                                // here, fp32 [ceil(n / 128), a_rows] (the down GEMM's a and a_scales);
                                // kFP8 kSwiGLUBackward, optional: d_g | d_u's scales [2n / 128, a_rows]
  bool out_scales_power_of_two = false;  // with out_scales: scales rounded up to powers of two (include/mok/fp8.h)
  void* gate_up_out = nullptr;  // kSwiGLU, optional: bf16 [a_rows, 2n], the raw g (columns [0, n)) and u
                                // ([n, 2n)) of every row, before the clamp (what the backward reads); with
                                // out_scales, given with hidden_out
  void* hidden_out = nullptr;   // kFP8 kSwiGLU with out_scales and gate_up_out: bf16 [a_rows, n], h before its
                                // quantization (kSwiGLU's out)
  void* quantized_out = nullptr;  // kFP8 kSwiGLUBackward with out_scales: e4m3 [a_rows, 2n], d_g | d_u quantized
                                 // per 1 x 128 beside the bf16 `out` (the gate/up dgrad's a)
  const void* gate_up = nullptr;  // kSwiGLUBackward: bf16 [a_rows, 2n], the forward's g and u (gate_up_out)
  float* row_partials = nullptr;  // kSwiGLUBackward: fp32 [a_rows, gemm_n_blocks(kSwiGLUBackward, n)]
  int cluster_n = 0;            // CTAs sharing each A tile (1 or 2; 2 needs an even number of output tiles);
                                // 0: choose_cluster_n
  int block_n = 0;              // kFP8 kStore: output columns per tile, 128 or 256; 0: fp8_store_block_n.
                                // kFP8 kSwiGLU with out_scales: 128, each task's 128 h columns as two 128 x 128
                                // passes, or 256, one 128 x 256 tile (the same bits, faster); 0:
                                // fp8_gate_up_block_n. Other GEMMs: 0
  int32_t first_row = 0;        // rows below it are not computed (their outputs untouched): a multiple of 128
  int32_t* ticket = nullptr;    // one int32 of device memory, zeroed by the call on its stream: the task
                                // ticket (one per GEMM in flight at a time)
  void* trace = nullptr;        // optional uint64 [tasks, CTAs per cluster, 4], zeroed by the caller: per
                                // output tile, consumer start and end (globaltimer ns), SM id | SM cycles
                                // << 16, expert << 48 | n-block group << 32 | first row
  RowGatherArgs gather;         // optional: A rows gathered from x (see RowGatherArgs)
  RowScatterArgs scatter;       // optional, kStore bf16: output rows to their routes' combine rows (out null)
  WaitBound waits;              // required: the status word the kernel's waits (its roles' hand-offs, all
                                // bounded: 2 * waits.timeout_s + 1 s) report a timeout to, and the rank named.
                                // Once that word's abort is set the GEMM takes no more tiles (out unspecified)
};

// Throws std::invalid_argument naming the offending field.
void validate(const ExpertGemmArgs& args);

void expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream);

// Output tiles along n (the columns of kSwiGLUBackward's row_partials) of a bf16 GEMM; the last one may be
// partial.
int gemm_n_blocks(GemmEpilogue epilogue, int n);
// The same for a call of either precision (kFP8: 128-column tiles, or the store's block_n).
int gemm_n_blocks(const ExpertGemmArgs& args);

// Output columns per tile of the FP8 store GEMM: block_n, or for 0 the 256-column tile from n = 4096 on (the same
// bits; 1-12 % faster there than the 128 x 192 tile it replaced, which was 7-10 % faster than 128: docs/perf_notes.md,
// rounds 37 and 21; at n = 2880 128 is as fast), else 128.
int fp8_store_block_n(int block_n, int n);

// Gate and up columns per tile of the FP8 gate/up GEMM writing h quantized: block_n, or for 0 the 128 x 256 tile
// (one per 128 h columns, A loaded once; the same bits as two 128 x 128 passes and faster: 9-11 % without the side
// outputs, docs/perf_notes.md round 34; 13 % beside them, 3 stages instead of 4, round 35).
int fp8_gate_up_block_n(int block_n);

// CTAs per cluster for a GEMM with `n` output columns: 2 (the A tile multicast to a pair of n-blocks) when
// the output tiles pair up, else 1.
int choose_cluster_n(GemmEpilogue epilogue, int n);

}  // namespace mok
