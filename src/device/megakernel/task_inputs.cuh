// What a persistent megakernel's compute roles share (the forward's forward_kernel.cuh, the backward's
// backward_kernel.cuh): a decoded task as one CTA's GEMM tile, and the producer's wait for the task's inputs.
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
// Reads from Params: counters, rank, status, timeout_ns.
template <class Params>
__device__ __forceinline__ void wait_for_inputs(const Params& p, const PhaseDesc& phase, const ComputeTask& t) {
  if (phase.waits == kNoCounter) return;  // inputs complete before the launch
  const uint64_t* counter = p.counters.base[phase.waits];
  for (int32_t unit = t.row / kUnitRows; unit * kUnitRows < t.row + t.rows; ++unit)
    device::wait_at_least(counter + unit, p.counters.target[phase.waits],
                          {p.rank, Role::kGemmProducer, p.counters.id[phase.waits], unit}, p.status, p.timeout_ns);
  // Why: the TMA loads that follow read, through the async proxy, rows the acquire above made visible.
  device::fence_proxy_async_global();
}

// Producer thread of the backward megakernel: as wait_for_inputs, but a tile's units below the order's
// recompute_from wait on the phase's waits_kept counter (counter_awaited), and a long run of units on one
// counter (a weight-gradient tile waits for its expert's whole segment, up to thousands of rows) is checked
// with relaxed loads, kBatch in flight, and one acquire fence, instead of one acquire round trip per unit;
// a unit found short falls back to the bounded wait.
template <class Params>
__device__ __forceinline__ void wait_for_backward_inputs(const Params& p, const PhaseDesc& phase, const ComputeTask& t) {
  constexpr int32_t kBatch = 4;
  const int32_t first = t.row / kUnitRows, end = (t.row + t.rows + kUnitRows - 1) / kUnitRows;
  for (int32_t unit = first; unit < end; unit += kBatch) {
    uint64_t seen[kBatch];
    int8_t counter[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      counter[j] = unit + j < end ? counter_awaited(phase, p.order, unit + j) : kNoCounter;
      seen[j] = counter[j] == kNoCounter ? 0 : device::load_relaxed_gpu(p.counters.base[counter[j]] + unit + j);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int8_t c = counter[j];
      if (c != kNoCounter && seen[j] < p.counters.target[c])
        device::wait_at_least(p.counters.base[c] + unit + j, p.counters.target[c],
                              {p.rank, Role::kGemmProducer, p.counters.id[c], unit + j}, p.status, p.timeout_ns);
    }
  }
  // Why: the relaxed reads that saw complete counts become acquires with this fence; then the TMA loads that
  // follow (async proxy) read rows those counts published.
  device::fence_acq_rel_gpu();
  device::fence_proxy_async_global();
}

}  // namespace mok::megakernel
