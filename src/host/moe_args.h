// Host validation of the MoE layer's per-call arguments (src/host/moe_args.cpp). Each throws
// std::invalid_argument naming the argument, what was expected and what was given.
#pragma once

#include <span>
#include <string>

#include "mok/moe.h"
#include "src/host/check.h"

namespace mok::detail {

// The ranks of one call (RankForward or RankBackward): each at most once. A rank passed twice would wait for
// its own second arrival at the call's barriers until the timeout.
template <class RankArgs>
void require_distinct_ranks(std::span<const RankArgs> ranks, const std::string& call) {
  for (size_t i = 0; i < ranks.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      require(ranks[i].rank != ranks[j].rank, call + ": rank " + std::to_string(ranks[i].rank) +
                                                  " is passed twice (one argument set per rank and call)");
}

// The call's token count T: `t`'s first extent, in [0, s.num_tokens] (the workspace's maximum per call).
int call_tokens(const TensorRef& t, const char* name, const MoeShape& s);
// topk_idx of `f`: int32 or int64 [T, k] on `device` (T = call_tokens(topk_idx)).
void check_routing_inputs(const RankForward& f, const MoeShape& s, int device);
// x, router_weights, out (each with topk_idx's T) and every weight of `f`.
// precision kFP8: the weights' FP8 form (MoeWeights).
void check_layer_inputs(const RankForward& f, const MoeShape& s, int device, Precision precision = Precision::kBF16);
// x and every weight of `f` (recompute_forward_context's inputs); precision kFP8: the weights' FP8 form.
void check_recompute_inputs(const RankForward& f, const MoeShape& s, int device, Precision precision);
// Every tensor of `b`: the forward's inputs and weights as the forward checks them, d_out, d_x,
// d_router_weights, and every weight gradient (the parameter's shape, bf16 or fp32; kAccumulate needs fp32;
// separate gate and up gradients both or neither, of one dtype and mode). precision kFP8: the weights' FP8
// form with the transposed copies (MoeWeights::expert_gate_up_t, ...).
void check_backward_inputs(const RankBackward& b, const MoeShape& s, int device, Precision precision);

// Device bytes of one ForwardContext (what MoeWorkspace::make_context allocates): the total of
// context_layout (src/host/moe_layouts.h): the schedule, the kept x rows, h (and g | u with keep_gate_up) of
// `ring_rows` rows and the shared expert's h (and g | u) of `padded_tokens` rows, each buffer rounded up to
// 256 bytes. fp8: MoeOptions::precision kFP8's layout (FP8 h and the rows' scales, no g | u).
// MoeOptions::keep_gate_up as the context honours it: bf16 always, FP8 with the backward (an inference context
// keeps only the quantized h the down GEMM reads).
bool context_keeps_gate_up(const MoeOptions& options);
int64_t context_bytes(const MoeShape& s, bool keep_gate_up, int64_t schedule_elements, int64_t ring_rows,
                      int64_t padded_tokens, bool fp8 = false);
// The workspace's ring (the rows a fused forward's context keeps; the backward replays the rows past it):
//   MoeOptions::fused.macrobatch_rows > 0   that, at most the capacity
//   the unfused path                         the capacity (it holds every row at once)
//   the fused path, macrobatch_rows 0        the balanced share, min(capacity, expected_load_capacity_rows(
//                                            shape, tile_m, 1) rounded down to 128, at least 128) -- the whole
//                                            capacity when that is within the share (EP = 1 by default) --,
//                                            then the largest multiple of 128 rows of it whose context fits
//                                            MoeOptions::context_budget_bytes (0: no budget)
// Throws std::invalid_argument naming the option when the budget leaves no 128 rows.
int64_t choose_ring_rows(const MoeShape& s, const MoeOptions& options, int64_t capacity_rows,
                         int64_t schedule_elements, int64_t padded_tokens);

// What MoeWorkspace's constructor resolves from its shape and options alone, with no device and nothing
// allocated. Checks MoeShape::validate, ScheduleOptions::validate and every MoeOptions rule, each
// std::invalid_argument naming the field. The constructor runs it on every rank, and all-gathers the outcome
// before its first collective allocation, so a rejected argument leaves no NCCL window behind.
struct WorkspacePlan {
  int64_t capacity_rows = 0;  // resolved_capacity_rows (include/mok/routing.h)
  int64_t padded_tokens = 0;  // MoeShape::num_tokens rounded up to the row tile
  int64_t ring_rows = 0;      // choose_ring_rows
};
WorkspacePlan plan_workspace(const MoeShape& shape, const MoeOptions& options);
// MoeOptions::setup_timeout_s's rule (plan_workspace checks it; the C API and Python before they make a
// communicator with it): std::invalid_argument naming it unless finite in (0, kMaxWaitTimeoutS].
void validate_setup_timeout(double setup_timeout_s);

}  // namespace mok::detail
