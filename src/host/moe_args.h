// Host validation of the MoE layer's per-call arguments (src/host/moe_args.cpp). Each throws
// std::invalid_argument naming the argument, what was expected and what was given.
#pragma once

#include "mok/moe.h"

namespace mok::detail {

// topk_idx of `f`: int32 or int64 [T, k] on `device`.
void check_routing_inputs(const RankForward& f, const MoeShape& s, int device);
// x, router_weights, out and every weight of `f`.
void check_layer_inputs(const RankForward& f, const MoeShape& s, int device);

}  // namespace mok::detail
