// The layouts of MoeWorkspace's per-rank allocations and of a ForwardContext (docs/design.md, "Lifetimes"):
// one BufferLayout (src/host/buffer_layout.h) each, which both sizes the allocation and carves its buffers.
// Host-only; tests/cpu/test_buffer_layouts.cpp checks them (aligned, disjoint, total = end).
#pragma once

#include <cstdint>

#include "mok/moe.h"
#include "src/host/buffer_layout.h"

namespace mok::detail {

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

// A ForwardContext's one allocation (what MoeWorkspace::make_context allocates): the schedule, the kept x
// rows, h (and g | u with keep_gate_up) of `ring_rows` rows and the shared expert's h (and g | u) of
// `padded_tokens` rows.
struct ContextLayout {
  BufferLayout buffers;
  BufferSlot schedule;        // int32 [schedule_elements]
  BufferSlot expert_rows;     // bf16 [ring, H]; FP8: [ring, fp8_row_bytes(H) bytes]
  BufferSlot hidden;          // bf16 [ring, I]; FP8: keep_gate_up only
  BufferSlot shared_hidden;   // bf16 [padded T, I]; FP8: keep_gate_up only
  BufferSlot gate_up;         // bf16 [ring, 2I], keep_gate_up only
  BufferSlot shared_gate_up;  // bf16 [padded T, 2I], keep_gate_up with a shared expert only
  // FP8 only (MoeOptions::precision): expert_rows then holds each row as x's published FP8 row (e4m3 [H] and
  // its fp32 scales, packed: src/host/quantize_fp8.h); the GEMMs' A scales and h in e4m3 with its scales.
  BufferSlot expert_row_scales;     // fp32 [ceil(H/128), ring]
  BufferSlot hidden_fp8;            // e4m3 [ring, I]
  BufferSlot hidden_scales;         // fp32 [ceil(I/128), ring]
  BufferSlot shared_hidden_fp8;     // e4m3 [padded T, I], with a shared expert only
  BufferSlot shared_hidden_scales;  // fp32 [ceil(I/128), padded T], with a shared expert only
};
// keep_gate_up: as the context honours it (detail::context_keeps_gate_up).
ContextLayout context_layout(const MoeShape& s, bool keep_gate_up, int64_t schedule_elements, int64_t ring_rows,
                             int64_t padded_tokens, bool fp8 = false);

// A local rank's scratch of the forward (MoeWorkspace::RankState).
struct RankScratchLayout {
  BufferLayout buffers;
  BufferSlot y;                // bf16 [ring, H]: expert outputs
  BufferSlot shared_out;       // bf16 [padded T, H]
  BufferSlot tickets;          // int32 [kNumTickets]
  BufferSlot shared_schedule;  // SharedSchedule
  BufferSlot fused_counters;   // u64 [counter_words]
  BufferSlot timeline;         // u64 [timeline_words], absent when 0
  BufferSlot x_scales;         // FP8 only: fp32 [ceil(H/128), padded T], the shared expert's A scales
};
RankScratchLayout rank_scratch_layout(const MoeShape& s, int64_t ring_rows, int64_t padded_tokens,
                                      int64_t counter_words, int64_t timeline_words, bool fp8 = false);

// An upper bound on the task slots of any one of the workspace's GEMM launches or megakernels, forward or
// backward: every row tile at 64 rows, every GEMM's output in 64-column blocks, every weight gradient in 64 x 64
// tiles, all of them in one launch. The walkers' slots and tickets are int32 with kStopSlot = INT32_MAX
// (task_ring.cuh), so the constructor refuses a shape and capacity whose bound reaches it.
int64_t task_slot_bound(const MoeShape& s, int64_t capacity_rows, int64_t padded_tokens);

// What decides the backward scratch's buffers (MoeWorkspace::allocate_backward).
struct BackwardScratchShape {
  int64_t capacity_rows = 0;
  int64_t padded_tokens = 0;
  int n_blocks = 0;                // the down dgrad's d_rw partials per row
  bool copies_x = false;           // the context keeps fewer rows than the capacity
  bool recomputes = false;         // routed g | u and h recomputed (MoeWorkspace::recomputes_gate_up)
  bool shared_recomputes = false;  // the shared expert's too (no keep_gate_up)
  int64_t counter_words = 0;       // the backward megakernel's counters, 0 without it
  bool fp8 = false;                // MoeOptions::precision kFP8: the dgrads' quantized operands
  bool fp8_weight_gradients = false;  // MoeWorkspace::fp8_weight_gradients(): the weight gradients' quantized operands
};
// A local rank's scratch of the backward (MoeWorkspace::BackwardScratch says what each buffer holds).
struct BackwardScratchLayout {
  BufferLayout buffers;
  BufferSlot x_rows, d_out_rows, dy_rows, row_weight, hidden, gate_up, d_gate_up, row_partials, kept_rows, counters;
  BufferSlot shared_gate_up, shared_hidden, shared_d_gate_up, shared_dx, shared_row_partials;
  // FP8 only: e4m3 values [rows, k] and their fp32 scales [ceil(k/128), rows] (quantize_rows_fp8's layout)
  BufferSlot d_out_fp8, d_out_scales, d_gate_up_fp8, d_gate_up_scales;
  BufferSlot shared_x_fp8, shared_d_out_fp8, shared_d_out_scales, shared_d_gate_up_fp8, shared_d_gate_up_scales;
  // FP8 weight gradients only: one weight gradient's two operands at a time (down: dy and h, then gate/up: d(g|u)
  // and x; routed, then shared), each e4m3 [columns, rows] with fp32 scales [rows / 128, columns]
  // (quantize_columns_fp8's layout; rows: the routed or shared segments re-padded to 128, at most wgrad_rows), and
  // the segments' offsets in those rows, routed [E + 1] and shared [2]. The routed dy and x are quantized as they
  // are pulled, before the dgrads, into buffers of their own (no bf16 copy: dy_rows and x_rows are absent then).
  int64_t wgrad_rows = 0;
  BufferSlot wgrad_a_fp8, wgrad_a_scales, wgrad_b_fp8, wgrad_b_scales, wgrad_offsets, shared_wgrad_offsets;
  BufferSlot wgrad_dy_fp8, wgrad_dy_scales, wgrad_x_fp8, wgrad_x_scales;
};
BackwardScratchLayout backward_scratch_layout(const MoeShape& s, const BackwardScratchShape& b);

}  // namespace mok::detail
