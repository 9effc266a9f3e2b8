// MoeWorkspace's per-rank state and the helpers its two translation units share: src/host/moe.cu (workspace,
// forward) and src/host/moe_backward.cu (backward, recompute_forward_context). Include from .cu files only.
// Headers with non-template kernels (peer_barrier.cuh, row_kernels.cuh) stay out: each has one .cu home.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "mok/device_buffer.h"
#include "mok/moe.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/schedule/placement.h"
#include "src/host/check.h"
#include "src/host/cuda_event.h"
#include "src/host/moe_layouts.h"

namespace mok {
namespace detail {

inline constexpr int64_t kBf16Bytes = 2;
inline constexpr int64_t kFloatBytes = 4;

// One grid-stride launch of row kernels: enough warps to keep NVLink busy, at most a few CTAs per SM.
inline int row_kernel_ctas(int64_t rows, int warps_per_cta, int num_sms) {
  return static_cast<int>(std::clamp<int64_t>((rows + warps_per_cta - 1) / warps_per_cta, 1, int64_t(num_sms) * 4));
}

// The token-side epilogue (the forward's out, the backward's d_x and d_router_weights) on `stream`.
inline void launch_combine_epilogue(const combine::EpilogueParams& p, DType index_dtype, int num_sms,
                                    cudaStream_t stream) {
  const int64_t threads = std::max(int64_t(p.num_tokens) * p.row_vectors, int64_t(p.num_tokens) * p.top_k);
  constexpr int kThreads = combine::EpilogueTraits::kThreads;
  const int ctas = static_cast<int>(std::clamp<int64_t>((threads + kThreads - 1) / kThreads, 1, int64_t(num_sms) * 8));
  if (index_dtype == DType::kInt64)
    combine::combine_epilogue_kernel<int64_t><<<ctas, kThreads, 0, stream>>>(p);
  else
    combine::combine_epilogue_kernel<int32_t><<<ctas, kThreads, 0, stream>>>(p);
  MOK_CHECK_CUDA(cudaGetLastError());
}

}  // namespace detail

// Per-rank scratch of the backward (MoeOptions::backward), one allocation (docs/design.md, "Backward") laid
// out by detail::backward_scratch_layout. Routed rows are the schedule's (capacity rows, expert-major); shared
// rows the rank's padded tokens.
struct MoeWorkspace::BackwardScratch {
  DeviceBuffer allocation;      // empty without MoeOptions::backward
  int n_blocks = 0;             // the down dgrad's gemm_n_blocks (bf16: 256-column tiles; FP8: 128): the d_rw
                                // partials per row
  // Routed experts, [capacity, ...]
  void* x_rows = nullptr;       // bf16 [capacity, H]: the x rows, when the context keeps fewer than all of
                                // them (ring < capacity) or keeps FP8 rows; null otherwise (the GEMMs read the
                                // context's; or with FP8 weight gradients, which read them by route)
  void* d_out_rows = nullptr;   // bf16 [capacity, H]: pulled d_out rows; the gate/up dgrad then overwrites them
                                // with the d_x_route rows (the down dgrad, their last reader, is done)
  void* dy_rows = nullptr;      // bf16 [capacity, H]: bf16(rw * d_out), the down weight gradient's A (null with
                                // FP8 weight gradients: wgrad_dy_fp8 below)
  float* row_weight = nullptr;  // fp32 [capacity]: each row's router weight (0 for padding)
  void* hidden = nullptr;       // bf16 [capacity, I]: recomputed h (the forward's bits); null when the backward
                                // reads the context's (MoeWorkspace::recomputes_gate_up)
  void* gate_up = nullptr;      // bf16 [capacity, 2I]: recomputed g | u (the kept rows copied); null likewise
  void* d_gate_up = nullptr;    // bf16 [capacity, 2I]: d_g | d_u
  float* row_partials = nullptr;  // fp32 [capacity, n_blocks]: d_rw partial sums per n-block
  int32_t* kept_rows = nullptr;   // [1]: min(scheduled rows, ring), recompute_forward_context's row count
  uint64_t* counters = nullptr;   // ForwardPath::kFused: the backward megakernel's (fused_backward_counter_words)
  // Shared expert, [padded T, ...]; null without one (shared_gate_up and shared_hidden also with
  // MoeOptions::keep_gate_up: the context's are read)
  void* shared_gate_up = nullptr;     // bf16 [padded T, 2I]
  void* shared_d_gate_up = nullptr;   // bf16 [padded T, 2I]
  void* shared_hidden = nullptr;      // bf16 [padded T, I]
  void* shared_dx = nullptr;          // bf16 [padded T, H]: the shared expert's d_x partial
  float* shared_row_partials = nullptr;  // fp32 [padded T, n_blocks]: written by the down dgrad, unused (the
                                         // shared expert has no router weight)
  // MoeOptions::precision kFP8 only (docs/design.md, "FP8 backward"): the dgrads' A operands, e4m3 [rows, k] with
  // fp32 scales [ceil(k/128), rows] (quantize_rows_fp8): d_out's rows and [d_g, d_u], routed [capacity, ...] and
  // shared [padded T, ...]; the shared expert's x quantized again as FP8 rows (publish_fp8_rows, the forward's
  // bits) for its recompute, with the rank's x_scales as their A scales.
  void* d_out_fp8 = nullptr;
  float* d_out_scales = nullptr;
  void* d_gate_up_fp8 = nullptr;
  float* d_gate_up_scales = nullptr;
  void* shared_x_fp8 = nullptr;
  void* shared_d_out_fp8 = nullptr;
  float* shared_d_out_scales = nullptr;
  void* shared_d_gate_up_fp8 = nullptr;
  float* shared_d_gate_up_scales = nullptr;
  // MoeWorkspace::fp8_weight_gradients() only: one weight gradient's two operands at a time, quantize_columns_fp8's
  // e4m3 [columns, fp8_column_rows(rows, experts)] with scales [those rows / 128, columns] (sized for the routed
  // and the shared expert's rows, whichever need more), and the segment offsets in those rows (routed [E + 1],
  // shared [2]).
  void* wgrad_a_fp8 = nullptr;
  float* wgrad_a_scales = nullptr;
  void* wgrad_b_fp8 = nullptr;
  float* wgrad_b_scales = nullptr;
  int32_t* wgrad_offsets = nullptr;
  int32_t* shared_wgrad_offsets = nullptr;
  // The routed dy and x in that layout, quantized by route right after the pull (the peers' rows are read while they
  // are published): no bf16 dy or x rows then (dy_rows, x_rows null).
  void* wgrad_dy_fp8 = nullptr;
  float* wgrad_dy_scales = nullptr;
  void* wgrad_x_fp8 = nullptr;
  float* wgrad_x_scales = nullptr;

  void* d_x_rows() const { return d_out_rows; }  // bf16 [capacity, H], see d_out_rows
};

// Per local rank scratch that does not outlive a call: expert outputs, shared-expert output, tickets, the
// megakernel's counters and timeline, the backward's scratch.
struct MoeWorkspace::RankState {
  int device = -1;
  int num_sms = 0;
  DeviceBuffer allocation;       // detail::rank_scratch_layout
  void* y = nullptr;             // bf16 [ring rows, H]
  void* shared_out = nullptr;    // bf16 [padded T, H]
  int32_t* tickets = nullptr;    // [kNumTickets]
  detail::SharedSchedule* shared_schedule = nullptr;
  uint64_t* fused_counters = nullptr;  // detail::fused_counter_words
  uint64_t* timeline = nullptr;        // detail::fused_timeline_words, or null
  float* x_scales = nullptr;           // MoeOptions::precision kFP8: fp32 [ceil(H/128), padded T], the rank's
                                       // published x rows' scales (the shared expert's A scales)
  BackwardScratch backward;
  DeviceBuffer scatter_maps;  // MoeOptions::scatter_rows: the tensor maps of every rank's combine buffer as this
                              // rank addresses it (encode_row_scatter_maps), for the scattering GEMMs
  // The rank's last call issued outside a CUDA-graph capture: its stream, and an event recorded after its
  // last kernel. A call on another stream waits for that event first (the buffers above, the symmetric
  // buffers, counters and tickets are shared by every call of the workspace).
  detail::CudaEvent call_done;
  mutable cudaStream_t call_stream = nullptr;  // mutable: read_status (const) orders itself too
  mutable bool has_call = false;
};

}  // namespace mok
