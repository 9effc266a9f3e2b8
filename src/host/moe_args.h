// Host validation of the MoE layer's per-call arguments (src/host/moe_args.cpp). Each throws
// std::invalid_argument naming the argument, what was expected and what was given.
#pragma once

#include "mok/moe.h"

namespace mok::detail {

// topk_idx of `f`: int32 or int64 [T, k] on `device`.
void check_routing_inputs(const RankForward& f, const MoeShape& s, int device);
// x, router_weights, out and every weight of `f`.
void check_layer_inputs(const RankForward& f, const MoeShape& s, int device);
// x and every weight of `f` (recompute_forward_context's inputs).
void check_recompute_inputs(const RankForward& f, const MoeShape& s, int device);
// Every tensor of `b`: the forward's inputs and weights as the forward checks them, d_out, d_x,
// d_router_weights, and every weight gradient (the parameter's shape, bf16 or fp32; kAccumulate needs fp32;
// separate gate and up gradients both or neither, of one dtype and mode).
void check_backward_inputs(const RankBackward& b, const MoeShape& s, int device);

}  // namespace mok::detail
