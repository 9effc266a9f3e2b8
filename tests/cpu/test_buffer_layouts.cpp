// The allocation layouts of the workspace and the forward context (src/host/moe_layouts.h), on the host: for
// the model shapes and random ones, every option that adds or drops a buffer, each layout's buffers are
// 256-byte aligned and disjoint, absent buffers (0 bytes) carve to null, the total is the end of the last
// buffer rounded up to 256, each buffer has the bytes its comment promises, and the context's total equals
// the byte sum the workspace used before the layouts (every buffer rounded up to 256 bytes, written out here
// from its definition), so the memory a context takes did not change. Also the limits that keep the kernels'
// int32 task slots and sums from overflowing: task_slot_bound and MoeShape's bounds on H and I.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "reference/routing_gen.h"
#include "src/host/buffer_layout.h"
#include "src/host/moe_args.h"
#include "src/host/moe_layouts.h"
#include "src/host/quantize_fp8.h"

namespace mok {
namespace {

using detail::BufferLayout;
using detail::BufferSlot;

int64_t round256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Aligned, disjoint, in order, total = the last end rounded up; absent slots carve to null, present ones to
// base + offset. `where` names the case in every failure.
void check_layout(const BufferLayout& layout, const std::string& where) {
  int64_t end = 0;
  std::set<std::string> names;
  char* const base = reinterpret_cast<char*>(uintptr_t{1} << 20);  // never dereferenced
  for (const BufferSlot& slot : layout.slots()) {
    const std::string at = where + ", buffer " + slot.name + " at " + std::to_string(slot.offset) + " (" +
                           std::to_string(slot.bytes) + " bytes)";
    EXPECT_TRUE(names.insert(slot.name).second) << at << ": a second buffer of this name";
    EXPECT_GE(slot.bytes, 0) << at;
    EXPECT_EQ(slot.offset % BufferLayout::kAlignment, 0) << at << ": not 256-byte aligned";
    if (slot.bytes == 0) {
      EXPECT_EQ(slot.in(base), nullptr) << at << ": an absent buffer must carve to null";
      continue;
    }
    EXPECT_GE(slot.offset, end) << at << ": overlaps the buffer before it (which ends at " << end << ")";
    EXPECT_EQ(slot.in<char>(base), base + slot.offset) << at;
    end = slot.end();
  }
  EXPECT_EQ(layout.total_bytes(), round256(end)) << where << ": total is not the end rounded up to 256";
  EXPECT_GE(layout.total_bytes(), end) << where;
}

MoeShape shape_of(int ep, int tokens, int top_k, int experts, int hidden, int intermediate, bool shared) {
  return MoeShape{ep, tokens, top_k, experts, hidden, intermediate, shared};  // MoeShape's field order
}

// The model shapes at EP 1 and 8, and random small ones (H, I multiples of 64, T not a multiple of a tile).
std::vector<MoeShape> shapes() {
  std::vector<MoeShape> out;
  for (const int ep : {1, 8})
    for (const reference::ModelShape& m : reference::model_shapes())
      out.push_back(shape_of(ep, 8192, m.top_k, m.num_experts, m.hidden, m.intermediate, m.shared_expert));
  std::mt19937 gen(7);
  for (int n = 0; n < 50; ++n) {
    const int ep = 1 << (gen() % 4);
    out.push_back(shape_of(ep, 1 + gen() % 3000, 1 + gen() % 8, ep * (8 + gen() % 8), 64 * (1 + gen() % 40),
                           64 * (1 + gen() % 40), gen() % 2 == 0));
  }
  return out;
}

std::string describe(const MoeShape& s) {
  return "EP " + std::to_string(s.ep_size) + " T " + std::to_string(s.num_tokens) + " k " + std::to_string(s.top_k) +
         " E " + std::to_string(s.num_experts) + " H " + std::to_string(s.hidden) + " I " +
         std::to_string(s.intermediate) + (s.shared_expert ? " shared" : " no shared");
}

TEST(BufferLayout, SlotsAreAlignedDisjointAndTheTotalIsTheEnd) {
  BufferLayout layout;
  const BufferSlot a = layout.add("a", 1);
  const BufferSlot none = layout.add("none", 0);
  const BufferSlot b = layout.add("b", 256);
  const BufferSlot c = layout.add("c", 300, 1024);
  EXPECT_EQ(a.offset, 0);
  EXPECT_EQ(b.offset, 256);
  EXPECT_EQ(none.bytes, 0);
  EXPECT_EQ(c.offset, 1024);
  EXPECT_EQ(layout.total_bytes(), 1024 + 512);
  check_layout(layout, "hand-made");
  EXPECT_EQ(BufferLayout().total_bytes(), 0);
  EXPECT_THROW(layout.add("bad alignment", 16, 128), std::logic_error);
  EXPECT_THROW(layout.add("not a power of two", 16, 768), std::logic_error);
  EXPECT_THROW(layout.add("negative", -1), std::logic_error);
}

TEST(MoeLayouts, ContextLayoutIsTheContextBytes) {
  for (const MoeShape& s : shapes()) {
    const int64_t h = s.hidden, i = s.intermediate;
    for (const bool keep : {true, false}) {
      for (const int64_t ring : {int64_t{128}, int64_t{4096}, int64_t{s.num_tokens} * s.top_k}) {
        const int64_t schedule_elements = 1000 + ring, padded = (s.num_tokens + 127) / 128 * 128;
        const std::string where = describe(s) + " keep " + std::to_string(keep) + " ring " + std::to_string(ring);
        const detail::ContextLayout l = detail::context_layout(s, keep, schedule_elements, ring, padded);
        check_layout(l.buffers, "context, " + where);
        EXPECT_EQ(l.schedule.bytes, schedule_elements * 4) << where;
        EXPECT_EQ(l.expert_rows.bytes, ring * h * 2) << where;
        EXPECT_EQ(l.hidden.bytes, ring * i * 2) << where;
        EXPECT_EQ(l.shared_hidden.bytes, padded * i * 2) << where;
        EXPECT_EQ(l.gate_up.bytes, keep ? ring * 2 * i * 2 : 0) << where;
        EXPECT_EQ(l.shared_gate_up.bytes, keep && s.shared_expert ? padded * 2 * i * 2 : 0) << where;
        // The byte sum the workspace used before the layout (and bench/layer_bench.py reports).
        const int64_t before = round256(schedule_elements * 4) + round256(ring * h * 2) + round256(ring * i * 2) +
                               round256(padded * i * 2) + (keep ? round256(ring * 2 * i * 2) : 0) +
                               (keep && s.shared_expert ? round256(padded * 2 * i * 2) : 0);
        EXPECT_EQ(l.buffers.total_bytes(), before) << where;
        EXPECT_EQ(detail::context_bytes(s, keep, schedule_elements, ring, padded), before) << where;
      }
    }
  }
}

// MoeOptions::precision kFP8: the x rows as FP8 rows (packed), the scales and h in e4m3; no bf16 h or g | u (the
// gate/up GEMM writes h quantized) unless keep_gate_up (a training context: then both, as bf16 keeps them, for the
// routed rows and the shared expert's).
TEST(MoeLayouts, Fp8AddsScalesAndHiddenInE4m3) {
  for (const MoeShape& s : shapes()) {
    const int64_t h = s.hidden, i = s.intermediate, hb = (h + 127) / 128, ib = (i + 127) / 128;
    const int64_t ring = 4096, schedule_elements = 5096, padded = (s.num_tokens + 127) / 128 * 128;
    const std::string where = describe(s);
    const detail::ContextLayout bf16 = detail::context_layout(s, false, schedule_elements, ring, padded);
    const detail::ContextLayout l = detail::context_layout(s, false, schedule_elements, ring, padded, true);
    check_layout(l.buffers, "FP8 context, " + where);
    const detail::ContextLayout kept = detail::context_layout(s, true, schedule_elements, ring, padded, true);
    check_layout(kept.buffers, "FP8 context keeping g | u, " + where);
    EXPECT_EQ(l.hidden.bytes + l.shared_hidden.bytes + l.gate_up.bytes + l.shared_gate_up.bytes, 0) << where;
    const int64_t shared_rows = s.shared_expert ? padded : 0;
    EXPECT_EQ(kept.hidden.bytes, ring * i * 2) << where;
    EXPECT_EQ(kept.gate_up.bytes, ring * 2 * i * 2) << where;
    EXPECT_EQ(kept.shared_hidden.bytes, shared_rows * i * 2) << where;
    EXPECT_EQ(kept.shared_gate_up.bytes, shared_rows * 2 * i * 2) << where;
    EXPECT_GE(kept.buffers.total_bytes(), l.buffers.total_bytes() + (ring + shared_rows) * 3 * i * 2) << where;
    EXPECT_EQ(kept.hidden_fp8.bytes, l.hidden_fp8.bytes) << where << ": the down GEMM's quantized h as well";
    // The context's FP8 rows packed: values and scales, each row 16-byte aligned.
    const int64_t row_bytes = (h + 4 * hb + 15) / 16 * 16;
    EXPECT_EQ(detail::fp8_row_bytes(h), row_bytes) << where;
    EXPECT_EQ(l.expert_rows.bytes, ring * row_bytes) << where;
    EXPECT_LT(l.expert_rows.bytes, bf16.expert_rows.bytes) << where;
    EXPECT_EQ(l.expert_row_scales.bytes, hb * ring * 4) << where;
    EXPECT_EQ(l.hidden_fp8.bytes, ring * i) << where;
    EXPECT_EQ(l.hidden_scales.bytes, ib * ring * 4) << where;
    EXPECT_EQ(l.shared_hidden_fp8.bytes, s.shared_expert ? padded * i : 0) << where;
    EXPECT_EQ(l.shared_hidden_scales.bytes, s.shared_expert ? ib * padded * 4 : 0) << where;
    EXPECT_EQ(bf16.expert_row_scales.bytes + bf16.hidden_fp8.bytes + bf16.hidden_scales.bytes, 0) << where;
    // An FP8 row (e4m3 [H] and its scales) fits in the bf16 row's 2H bytes (the symmetric x buffer's published row).
    EXPECT_LE(row_bytes, 2 * h) << where;
    const detail::RankScratchLayout r = detail::rank_scratch_layout(s, ring, padded, 777, 0, true);
    check_layout(r.buffers, "FP8 rank scratch, " + where);
    EXPECT_EQ(r.x_scales.bytes, hb * padded * 4) << where;
    EXPECT_EQ(detail::rank_scratch_layout(s, ring, padded, 777, 0).x_scales.bytes, 0) << where;
  }
}

TEST(MoeLayouts, RankScratchLayout) {
  for (const MoeShape& s : shapes()) {
    for (const int64_t timeline_words : {int64_t{0}, int64_t{12345}}) {
      const int64_t ring = 4096, padded = (s.num_tokens + 63) / 64 * 64, counters = 777;
      const std::string where = describe(s) + " timeline " + std::to_string(timeline_words);
      const detail::RankScratchLayout l = detail::rank_scratch_layout(s, ring, padded, counters, timeline_words);
      check_layout(l.buffers, "rank scratch, " + where);
      EXPECT_EQ(l.y.bytes, ring * s.hidden * 2) << where;
      EXPECT_EQ(l.shared_out.bytes, padded * s.hidden * 2) << where;
      EXPECT_EQ(l.tickets.bytes, detail::kNumTickets * 4) << where;
      EXPECT_EQ(l.shared_schedule.bytes, int64_t(sizeof(detail::SharedSchedule))) << where;
      EXPECT_EQ(l.fused_counters.bytes, counters * 8) << where;
      EXPECT_EQ(l.timeline.bytes, timeline_words * 8) << where;
    }
  }
}

TEST(MoeLayouts, BackwardScratchLayout) {
  for (const MoeShape& s : shapes()) {
    const int64_t h = s.hidden, i = s.intermediate;
    for (int flags = 0; flags < 64; ++flags) {
      detail::BackwardScratchShape b;
      b.capacity_rows = int64_t(s.num_tokens) * s.top_k / 64 * 64 + 64;
      b.padded_tokens = (s.num_tokens + 63) / 64 * 64;
      b.n_blocks = (s.intermediate + 255) / 256;
      b.copies_x = flags & 1;
      b.recomputes = flags & 2;
      b.shared_recomputes = flags & 4;
      b.counter_words = flags & 8 ? 999 : 0;
      b.fp8 = flags & 16;
      b.fp8_weight_gradients = flags & 32;
      const std::string where = describe(s) + " flags " + std::to_string(flags);
      const detail::BackwardScratchLayout l = detail::backward_scratch_layout(s, b);
      check_layout(l.buffers, "backward scratch, " + where);
      const int64_t cap = b.capacity_rows, pt = b.padded_tokens;
      const bool shared = s.shared_expert;
      // FP8 weight gradients read the routed dy and x by route: no bf16 copies of them.
      const bool w = b.fp8 && b.fp8_weight_gradients;
      EXPECT_EQ(l.x_rows.bytes, b.copies_x && !w ? cap * h * 2 : 0) << where;
      EXPECT_EQ(l.d_out_rows.bytes, cap * h * 2) << where;
      EXPECT_EQ(l.dy_rows.bytes, w ? 0 : cap * h * 2) << where;
      EXPECT_EQ(l.row_weight.bytes, cap * 4) << where;
      EXPECT_EQ(l.hidden.bytes, b.recomputes ? cap * i * 2 : 0) << where;
      EXPECT_EQ(l.gate_up.bytes, b.recomputes ? cap * 2 * i * 2 : 0) << where;
      EXPECT_EQ(l.d_gate_up.bytes, cap * 2 * i * 2) << where;
      EXPECT_EQ(l.row_partials.bytes, cap * b.n_blocks * 4) << where;
      EXPECT_EQ(l.kept_rows.bytes, 4) << where;
      EXPECT_EQ(l.counters.bytes, b.counter_words * 8) << where;
      EXPECT_EQ(l.shared_gate_up.bytes, shared && b.shared_recomputes ? pt * 2 * i * 2 : 0) << where;
      EXPECT_EQ(l.shared_hidden.bytes, shared && b.shared_recomputes ? pt * i * 2 : 0) << where;
      EXPECT_EQ(l.shared_d_gate_up.bytes, shared ? pt * 2 * i * 2 : 0) << where;
      EXPECT_EQ(l.shared_dx.bytes, shared ? pt * h * 2 : 0) << where;
      EXPECT_EQ(l.shared_row_partials.bytes, shared ? pt * b.n_blocks * 4 : 0) << where;
      // FP8: the dgrads' e4m3 A operands [rows, k] with scales [ceil(k/128), rows], and for the shared expert's
      // recompute its x rows quantized again (FP8 rows in the bf16 rows' bytes).
      const int64_t hb = (h + 127) / 128, ib2 = (2 * i + 127) / 128;
      const bool f = b.fp8, sf = b.fp8 && shared;
      EXPECT_EQ(l.d_out_fp8.bytes, f ? cap * h : 0) << where;
      EXPECT_EQ(l.d_out_scales.bytes, f ? hb * cap * 4 : 0) << where;
      EXPECT_EQ(l.d_gate_up_fp8.bytes, f ? cap * 2 * i : 0) << where;
      EXPECT_EQ(l.d_gate_up_scales.bytes, f ? ib2 * cap * 4 : 0) << where;
      EXPECT_EQ(l.shared_x_fp8.bytes, sf && b.shared_recomputes ? pt * h * 2 : 0) << where;
      EXPECT_EQ(l.shared_d_out_fp8.bytes, sf ? pt * h : 0) << where;
      EXPECT_EQ(l.shared_d_out_scales.bytes, sf ? hb * pt * 4 : 0) << where;
      EXPECT_EQ(l.shared_d_gate_up_fp8.bytes, sf ? pt * 2 * i : 0) << where;
      EXPECT_EQ(l.shared_d_gate_up_scales.bytes, sf ? ib2 * pt * 4 : 0) << where;
      // FP8 weight gradients: one gradient's a and b transposed, [columns, rows] with rows the routed or shared
      // segments re-padded to 128, scales per 128 rows: routed a d(g|u) [2I] and b h [I], the shared expert's a dy or
      // d(g|u) [H or 2I] and b h or x [I or H]; the routed dy and x [H] in buffers of their own.
      const int64_t routed = w ? detail::fp8_column_rows(cap, s.local_experts()) : 0;
      const int64_t shared_rows = w && shared ? detail::fp8_column_rows(pt, 1) : 0;
      EXPECT_EQ(l.wgrad_rows, std::max(routed, shared_rows)) << where;
      EXPECT_EQ(routed % 128 + shared_rows % 128, 0) << where;
      const int64_t a_bytes = std::max(2 * i * routed, std::max(h, 2 * i) * shared_rows);
      const int64_t b_bytes = std::max(i * routed, std::max(h, i) * shared_rows);
      EXPECT_EQ(l.wgrad_a_fp8.bytes, a_bytes) << where;
      EXPECT_EQ(l.wgrad_a_scales.bytes, a_bytes / 128 * 4) << where;
      EXPECT_EQ(l.wgrad_b_fp8.bytes, b_bytes) << where;
      EXPECT_EQ(l.wgrad_b_scales.bytes, b_bytes / 128 * 4) << where;
      EXPECT_EQ(l.wgrad_dy_fp8.bytes, h * routed) << where;
      EXPECT_EQ(l.wgrad_dy_scales.bytes, routed / 128 * h * 4) << where;
      EXPECT_EQ(l.wgrad_x_fp8.bytes, h * routed) << where;
      EXPECT_EQ(l.wgrad_x_scales.bytes, routed / 128 * h * 4) << where;
      EXPECT_EQ(l.wgrad_offsets.bytes, w ? (s.local_experts() + 1) * 4 : 0) << where;
      EXPECT_EQ(l.shared_wgrad_offsets.bytes, w && shared ? 8 : 0) << where;
    }
  }
}

// task_slot_bound: every GEMM's tiles counted (checked by hand on a small shape); the largest legal model
// workloads stay below int32 slots; an absurd one does not.
TEST(MoeLayouts, TaskSlotBoundCountsEveryTileAndFitsTheModels) {
  // H 128 (2 blocks), I 64 (1), 8 local experts; 1024 routed rows, 256 padded tokens: (16 + 4) row tiles x
  // (5 * 1 + 2 * 2) blocks, plus (8 + 1) experts x 3 x 1 x 2 gradient tiles.
  EXPECT_EQ(detail::task_slot_bound(shape_of(1, 256, 2, 8, 128, 64, true), 1024, 256), 20 * 9 + 9 * 3 * 2);
  for (const reference::ModelShape& m : reference::model_shapes())
    for (const int ep : {1, 8}) {
      // 2^18 tokens per rank and every route on one rank, the worst-case capacity at 64-row tiles.
      const MoeShape s = shape_of(ep, 1 << 18, m.top_k, m.num_experts, m.hidden, m.intermediate, true);
      const int64_t capacity = worst_case_capacity_rows(s.routing(), 64);
      EXPECT_LT(detail::task_slot_bound(s, capacity, s.num_tokens), std::numeric_limits<int32_t>::max())
          << describe(s);
    }
  const MoeShape absurd = shape_of(1, 1 << 20, 16, 64, 16384, MoeShape::kMaxFeatures, true);
  EXPECT_GT(detail::task_slot_bound(absurd, worst_case_capacity_rows(absurd.routing(), 64), absurd.num_tokens),
            std::numeric_limits<int32_t>::max());
}

// H and I: positive multiples of 64 up to kMaxFeatures, the message naming the field and the bound.
TEST(MoeShapeTest, HiddenAndIntermediateAreBounded) {
  auto message = [](const MoeShape& s) {
    try {
      s.validate();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  const int max = MoeShape::kMaxFeatures;
  EXPECT_EQ(message(shape_of(1, 256, 2, 8, max, max, true)), "no throw");
  EXPECT_EQ(message(shape_of(1, 256, 2, 8, max + 64, 64, true)),
            "MoeShape.hidden must be a positive multiple of 64 up to 1048576, got 1048640");
  EXPECT_EQ(message(shape_of(1, 256, 2, 8, 64, max + 64, true)),
            "MoeShape.intermediate must be a positive multiple of 64 up to 1048576, got 1048640");
  EXPECT_EQ(message(shape_of(1, 256, 2, 8, 100, 64, true)),
            "MoeShape.hidden must be a positive multiple of 64 up to 1048576, got 100");
}

}  // namespace
}  // namespace mok
