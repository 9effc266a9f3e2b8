// What both megakernel launches take besides their GEMMs and buffers (the forward's FusedForwardArgs,
// src/host/moe_fused.h; the backward's FusedBackwardArgs, src/host/moe_fused_backward.h): the schedule, the task
// order's knobs, the grid, the counters, tickets and timeline the launch zeroes, where waits report. Filled
// once for both passes by MoeWorkspace::megakernel_args (src/host/moe.cu); read by src/host/megakernel_launch.h.
#pragma once

#include <cstdint>

#include "mok/status.h"

namespace mok::detail {

struct MegakernelArgs {
  const int32_t* expert_row_offsets = nullptr;  // the routed schedule
  const int32_t* scheduled_rows = nullptr;
  const int32_t* row_route = nullptr;
  int local_experts = 0;
  int32_t shared_rows = 0;      // padded tokens, 0 without a shared expert
  int64_t capacity_rows = 0;    // the schedule's capacity (a multiple of 64)
  int32_t minibatch_rows = 0;
  int comm_ctas = 0;            // a multiple of the cluster size; 0: the producer warps copy
  int grid_ctas = 0;            // the persistent grid on this device (which prepared the kernel)
  int num_tokens = 0, top_k = 0, hidden = 0, intermediate = 0;
  uint64_t* counters = nullptr;  // the pass's counter words (its kCounters over capacity and shared rows), zeroed
  int32_t* tickets = nullptr;    // 2 int32 (compute, communication), zeroed by the launch
  int rank = 0;
  DeviceStatus* status = nullptr;
  uint64_t timeout_ns = 0;
  uint64_t* timeline = nullptr;  // timeline_words(grid_ctas, timeline_capacity) u64 or null, zeroed by the launch
  int timeline_capacity = 0;
};

}  // namespace mok::detail
