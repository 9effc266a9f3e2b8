// MoeWorkspace's per-rank state and the helpers its two translation units share: src/host/moe.cu (workspace,
// forward) and src/host/moe_backward.cu (backward, recompute_forward_context). Include from .cu files only.
// Headers with non-template kernels (peer_barrier.cuh, row_kernels.cuh) stay out: each has one .cu home.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "mok/moe.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/schedule/placement.h"
#include "src/host/check.h"

namespace mok {
namespace detail {

inline constexpr int64_t kBf16Bytes = 2;
inline constexpr int64_t kFloatBytes = 4;

// Tickets of the GEMM launches (each launch zeroes its own on the stream). The forward's four: an MLP takes
// two consecutive ones (gate/up, down); the fused forward uses the first two as its compute and
// communication tickets. Then the backward's: per MLP (shared, routed) the g/u recompute, the down dgrad,
// the gate/up dgrad and the two weight-gradient GEMMs.
enum Ticket : int {
  kSharedGateUp = 0,
  kSharedDown,
  kExpertGateUp,
  kExpertDown,
  kBackwardShared,                 // five consecutive: kBackwardStep order
  kBackwardExpert = kBackwardShared + 5,
  kNumTickets = kBackwardExpert + 5,
};
// The backward GEMMs of one MLP, as offsets from kBackwardShared / kBackwardExpert.
enum BackwardStep : int { kRecompute = 0, kDownDgrad, kGateUpDgrad, kDownWgrad, kGateUpWgrad };

// The shared expert as a one-expert schedule over the rank's own tokens: counts {T}, row offsets
// {0, padded T}, scheduled rows {padded T}.
struct SharedSchedule {
  int32_t counts[1];
  int32_t row_offsets[2];
  int32_t scheduled_rows[1];
};

// The next `count` elements of T from a 256-byte aligned carve of one allocation.
template <typename T>
T* carve(char*& cursor, int64_t count) {
  T* p = reinterpret_cast<T*>(cursor);
  cursor += schedule::round_up(count * int64_t(sizeof(T)), 256);
  return p;
}

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

// Per-rank scratch of the backward (MoeOptions::backward), one allocation (docs/design.md, "Backward").
// Routed rows are the schedule's (capacity rows, expert-major); shared rows the rank's padded tokens.
struct MoeWorkspace::BackwardScratch {
  void* allocation = nullptr;
  int64_t bytes = 0;
  int n_blocks = 0;             // gemm_n_blocks(kSwiGLUBackward, I): the d_rw partials per row
  // Routed experts, [capacity, ...]
  void* x_rows = nullptr;       // bf16 [capacity, H]: the x rows, when the context keeps fewer than all of
                                // them (ring < capacity); null otherwise (the GEMMs read the context's)
  void* d_out_rows = nullptr;   // bf16 [capacity, H]: pulled d_out rows; the gate/up dgrad then overwrites them
                                // with the d_x_route rows (the down dgrad, their last reader, is done)
  void* dy_rows = nullptr;      // bf16 [capacity, H]: bf16(rw * d_out), the down weight gradient's A
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

  void* d_x_rows() const { return d_out_rows; }  // bf16 [capacity, H], see d_out_rows
};

// Per local rank scratch that does not outlive a call: expert outputs, shared-expert output, tickets, the
// megakernel's counters and timeline, the backward's scratch.
struct MoeWorkspace::RankState {
  int device = -1;
  int num_sms = 0;
  void* allocation = nullptr;
  void* y = nullptr;             // bf16 [ring rows, H]
  void* shared_out = nullptr;    // bf16 [padded T, H]
  int32_t* tickets = nullptr;    // [kNumTickets]
  detail::SharedSchedule* shared_schedule = nullptr;
  uint64_t* fused_counters = nullptr;  // detail::fused_counter_words
  uint64_t* timeline = nullptr;        // detail::fused_timeline_words, or null
  BackwardScratch backward;            // allocation null without MoeOptions::backward
  // The rank's last call issued outside a CUDA-graph capture: its stream, and an event recorded after its
  // last kernel. A call on another stream waits for that event first (the buffers above, the symmetric
  // buffers, counters and tickets are shared by every call of the workspace).
  cudaEvent_t call_done = nullptr;
  mutable cudaStream_t call_stream = nullptr;  // mutable: read_status (const) orders itself too
  mutable bool has_call = false;
};

}  // namespace mok
