// The workspace's and the context's allocation layouts (src/host/moe_layouts.h).
#include "src/host/moe_layouts.h"

#include <algorithm>

#include "src/host/quantize_fp8.h"

namespace mok::detail {
namespace {
constexpr int64_t kBf16 = 2;
}  // namespace

ContextLayout context_layout(const MoeShape& s, bool keep_gate_up, int64_t schedule_elements, int64_t ring_rows,
                             int64_t padded_tokens, bool fp8) {
  const int64_t h = s.hidden, i = s.intermediate;
  ContextLayout l;
  l.schedule = l.buffers.add_array<int32_t>("schedule", schedule_elements);
  l.expert_rows = l.buffers.add("expert_rows", ring_rows * (fp8 ? fp8_row_bytes(h) : h * kBf16));
  // FP8: h is written quantized by the gate/up GEMM (hidden_fp8 below); the bf16 h only beside g | u (keep_gate_up).
  l.hidden = l.buffers.add("hidden", !fp8 || keep_gate_up ? ring_rows * i * kBf16 : 0);
  l.shared_hidden = l.buffers.add(
      "shared_hidden", !fp8 || (keep_gate_up && s.shared_expert) ? padded_tokens * i * kBf16 : 0);
  l.gate_up = l.buffers.add("gate_up", keep_gate_up ? ring_rows * 2 * i * kBf16 : 0);
  l.shared_gate_up =
      l.buffers.add("shared_gate_up", keep_gate_up && s.shared_expert ? padded_tokens * 2 * i * kBf16 : 0);
  const int64_t h_blocks = (h + 127) / 128, i_blocks = (i + 127) / 128;
  const bool shared_fp8 = fp8 && s.shared_expert;
  l.expert_row_scales = l.buffers.add_array<float>("expert_row_scales", fp8 ? h_blocks * ring_rows : 0);
  l.hidden_fp8 = l.buffers.add("hidden_fp8", fp8 ? ring_rows * i : 0);
  l.hidden_scales = l.buffers.add_array<float>("hidden_scales", fp8 ? i_blocks * ring_rows : 0);
  l.shared_hidden_fp8 = l.buffers.add("shared_hidden_fp8", shared_fp8 ? padded_tokens * i : 0);
  l.shared_hidden_scales = l.buffers.add_array<float>("shared_hidden_scales", shared_fp8 ? i_blocks * padded_tokens : 0);
  return l;
}

RankScratchLayout rank_scratch_layout(const MoeShape& s, int64_t ring_rows, int64_t padded_tokens,
                                      int64_t counter_words, int64_t timeline_words, bool fp8) {
  const int64_t h = s.hidden;
  RankScratchLayout l;
  l.y = l.buffers.add("y", ring_rows * h * kBf16);
  l.shared_out = l.buffers.add("shared_out", padded_tokens * h * kBf16);
  l.tickets = l.buffers.add_array<int32_t>("tickets", kNumTickets);
  l.shared_schedule = l.buffers.add_array<SharedSchedule>("shared_schedule", 1);
  l.fused_counters = l.buffers.add_array<uint64_t>("fused_counters", counter_words);
  l.timeline = l.buffers.add_array<uint64_t>("timeline", timeline_words);
  l.x_scales = l.buffers.add_array<float>("x_scales", fp8 ? (h + 127) / 128 * padded_tokens : 0);
  return l;
}

int64_t task_slot_bound(const MoeShape& s, int64_t capacity_rows, int64_t padded_tokens) {
  const int64_t h_blocks = s.hidden / 64, i_blocks = s.intermediate / 64;
  const int64_t row_tiles = capacity_rows / 64 + padded_tokens / 64;  // routed rows, then the shared expert's
  // Forward: gate/up (2I) and down (H); backward: the recompute (2I), the down dgrad (I), the gate/up dgrad (H).
  const int64_t row_tile_blocks = 5 * i_blocks + 2 * h_blocks;
  // Weight gradients per expert (the shared one too): gate/up [2I, H] and down [H, I].
  const int64_t grad_tiles = (s.local_experts() + 1) * 3 * i_blocks * h_blocks;
  return row_tiles * row_tile_blocks + grad_tiles;
}

BackwardScratchLayout backward_scratch_layout(const MoeShape& s, const BackwardScratchShape& b) {
  const int64_t h = s.hidden, i = s.intermediate, cap = b.capacity_rows, pt = b.padded_tokens;
  const bool shared = s.shared_expert;
  BackwardScratchLayout l;
  BufferLayout& a = l.buffers;
  // FP8 weight gradients read the routed dy and x where they are pulled (quantize_columns_fp8 by route): no bf16 copy.
  const bool w = b.fp8 && b.fp8_weight_gradients;
  l.x_rows = a.add("x_rows", b.copies_x && !w ? cap * h * kBf16 : 0);
  l.d_out_rows = a.add("d_out_rows", cap * h * kBf16);
  l.dy_rows = a.add("dy_rows", w ? 0 : cap * h * kBf16);
  l.row_weight = a.add_array<float>("row_weight", cap);
  l.hidden = a.add("hidden", b.recomputes ? cap * i * kBf16 : 0);
  l.gate_up = a.add("gate_up", b.recomputes ? cap * 2 * i * kBf16 : 0);
  l.d_gate_up = a.add("d_gate_up", cap * 2 * i * kBf16);
  l.row_partials = a.add_array<float>("row_partials", cap * b.n_blocks);
  l.kept_rows = a.add_array<int32_t>("kept_rows", 1);
  l.counters = a.add_array<uint64_t>("counters", b.counter_words);
  l.shared_gate_up = a.add("shared_gate_up", shared && b.shared_recomputes ? pt * 2 * i * kBf16 : 0);
  l.shared_hidden = a.add("shared_hidden", shared && b.shared_recomputes ? pt * i * kBf16 : 0);
  l.shared_d_gate_up = a.add("shared_d_gate_up", shared ? pt * 2 * i * kBf16 : 0);
  l.shared_dx = a.add("shared_dx", shared ? pt * h * kBf16 : 0);
  l.shared_row_partials = a.add_array<float>("shared_row_partials", shared ? pt * b.n_blocks : 0);
  // FP8: d_out and [d_g, d_u] quantized per 1 x 128 (the dgrads' A operands), and the shared expert's x rows
  // quantized again as the forward published them (FP8 rows in the bf16 row's bytes: the recompute's A).
  const int64_t hb = (h + 127) / 128, ib2 = (2 * i + 127) / 128;
  const bool f = b.fp8, sf = b.fp8 && shared;
  l.d_out_fp8 = a.add("d_out_fp8", f ? cap * h : 0);
  l.d_out_scales = a.add_array<float>("d_out_scales", f ? hb * cap : 0);
  l.d_gate_up_fp8 = a.add("d_gate_up_fp8", f ? cap * 2 * i : 0);
  l.d_gate_up_scales = a.add_array<float>("d_gate_up_scales", f ? ib2 * cap : 0);
  l.shared_x_fp8 = a.add("shared_x_fp8", sf && b.shared_recomputes ? pt * h * kBf16 : 0);  // the recompute's A
  l.shared_d_out_fp8 = a.add("shared_d_out_fp8", sf ? pt * h : 0);
  l.shared_d_out_scales = a.add_array<float>("shared_d_out_scales", sf ? hb * pt : 0);
  l.shared_d_gate_up_fp8 = a.add("shared_d_gate_up_fp8", sf ? pt * 2 * i : 0);
  l.shared_d_gate_up_scales = a.add_array<float>("shared_d_gate_up_scales", sf ? ib2 * pt : 0);
  const int64_t e = s.local_experts();
  // One weight gradient's a and b at a time: routed d(g|u) [2I] and h [I] (its dy and x have their own buffers),
  // the shared expert's dy and d(g|u) [H, 2I], h and x [I, H].
  const int64_t routed_rows = w ? fp8_column_rows(cap, e) : 0, shared_rows = w && shared ? fp8_column_rows(pt, 1) : 0;
  l.wgrad_rows = std::max(routed_rows, shared_rows);
  const auto operand = [&](const char* name, const char* scales_name, int64_t routed_cols, int64_t shared_cols,
                           BufferSlot& values, BufferSlot& scales) {
    values = a.add(name, std::max(routed_cols * routed_rows, shared_cols * shared_rows));
    scales = a.add_array<float>(scales_name, std::max(routed_cols * routed_rows, shared_cols * shared_rows) / 128);
  };
  operand("wgrad_a_fp8", "wgrad_a_scales", 2 * i, std::max(h, 2 * i), l.wgrad_a_fp8, l.wgrad_a_scales);
  operand("wgrad_b_fp8", "wgrad_b_scales", i, std::max(h, i), l.wgrad_b_fp8, l.wgrad_b_scales);
  operand("wgrad_dy_fp8", "wgrad_dy_scales", h, 0, l.wgrad_dy_fp8, l.wgrad_dy_scales);
  operand("wgrad_x_fp8", "wgrad_x_scales", h, 0, l.wgrad_x_fp8, l.wgrad_x_scales);
  l.wgrad_offsets = a.add_array<int32_t>("wgrad_offsets", w ? e + 1 : 0);
  l.shared_wgrad_offsets = a.add_array<int32_t>("shared_wgrad_offsets", w && shared ? 2 : 0);
  return l;
}

}  // namespace mok::detail
