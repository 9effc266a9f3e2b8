// What the megakernels' task sets share (the forward's forward_kernel.cuh, the backward's backward_kernel.cuh):
// a decoded task as one CTA's GEMM tile, and the producer's waits for a task's inputs.
#pragma once

#include <cstdint>

#include "mok/status.h"
#include "src/device/common/sync.cuh"
#include "src/device/gemm/tile_task.cuh"
#include "src/device/megakernel/task_order.h"

namespace mok::megakernel {

// A row GEMM's task as this CTA's tile: CTA c of the cluster takes n-block kClusterN * n_group + c.
template <int kClusterN>
__device__ __forceinline__ gemm::TileTask tile_of(const ComputeTask& t, int cta_rank) {
  return gemm::TileTask{t.row, t.buffer_row, t.rows, t.n_group, t.expert}.template for_cta<kClusterN>(cta_rank);
}

// Producer thread: waits until every 64-row unit of the task's rows [row, row + rows) is complete in the
// phase's counter (a row tile's A rows; a weight-gradient tile's whole expert segment).
// Reads p.common (MegakernelParams: counters, rank, status, timeout_ns) and Params::kKernel.
template <class Params>
__device__ __forceinline__ void wait_for_inputs(const Params& p, const PhaseDesc& phase, const ComputeTask& t) {
  if (phase.waits == kNoCounter) return;  // inputs complete before the launch
  const auto& c = p.common;
  const uint64_t* counter = c.counters.base[phase.waits];
  for (int32_t unit = t.row / kUnitRows; unit * kUnitRows < t.row + t.rows; ++unit)
    device::wait_at_least(counter + unit, c.counters.target[phase.waits],
                          {c.rank, Role::kGemmProducer, c.counters.id[phase.waits], unit, Params::kKernel}, c.status,
                          c.timeout_ns);
  // Why: the TMA loads that follow read, through the async proxy, rows the acquire above made visible.
  device::fence_proxy_async_global();
}

// The units a producer thread has already seen complete on one counter (counts only grow): the next task
// over the same rows, e.g. an expert's next weight-gradient tile, waits for nothing.
struct VerifiedUnits {
  int8_t counter = kNoCounter;
  int32_t first = 0, end = 0;
  __device__ __forceinline__ bool covers(int8_t c, int32_t unit) const {
    return c == counter && unit >= first && unit < end;
  }
};

// Producer thread of the backward megakernel: as wait_for_inputs, but a tile's units below the order's
// recompute_from wait on the phase's waits_kept counter (counter_awaited), and units this thread already
// saw complete (`verified`: a weight-gradient tile waits for its expert's whole segment, and an expert has
// hundreds of such tiles) are not read again. The acquire and the proxy fence of the earlier wait precede
// this task's loads in this thread's program order.
template <class Params>
__device__ __forceinline__ void wait_for_backward_inputs(const Params& p, const PhaseDesc& phase, const ComputeTask& t,
                                                         VerifiedUnits& verified) {
  const auto& m = p.common;
  const int32_t first = t.row / kUnitRows, end = (t.row + t.rows + kUnitRows - 1) / kUnitRows;
  bool waited = false, complete = true;
  for (int32_t unit = first; unit < end; ++unit) {
    const int8_t c = counter_awaited(phase, m.order, unit);
    if (c == kNoCounter || verified.covers(c, unit)) continue;
    complete &= device::wait_at_least(m.counters.base[c] + unit, m.counters.target[c],
                                      {m.rank, Role::kGemmProducer, m.counters.id[c], unit, Params::kKernel}, m.status,
                                      m.timeout_ns);
    waited = true;
  }
  if (!waited) return;
  if (complete && phase.waits == phase.waits_kept) verified = {phase.waits, first, end};
  // Why: the TMA loads that follow read, through the async proxy, rows the acquires above made visible.
  device::fence_proxy_async_global();
}

}  // namespace mok::megakernel
