// The forward megakernel's tables (src/device/megakernel/forward_kernel.cuh): its four GEMMs, its five
// counter arrays and its compute and communication phases, walked by task_order.h. Host + device code.
//
//   shared gate/up   shared_hidden[t] = SwiGLU(x[t] · Wg^T, x[t] · Wu^T)       needs nothing (x is complete)
//   shared down      shared_out[t] = shared_hidden[t] · Wd^T                    needs shared_hidden_ready
//   per minibatch:
//   expert gate/up   hidden[r] = SwiGLU(expert_rows[r] · Wg_e^T, ...)           needs rows_arrived
//   expert down      y[r] = hidden[r] · Wd_e^T                                  needs hidden_ready
//   per macrobatch:
//   dispatch         expert_rows[r] = x_src[token] (pull)        needs rows_combined of the ring rows' previous unit
//   combine          combined_src[token * k + slot] = y[r] (push)                 needs output_ready
// Who adds, who waits and why it cannot deadlock: docs/sync_protocol.md, "forward megakernel".
#pragma once

#include <cstdint>

#include "mok/status.h"
#include "mok/timeline.h"
#include "src/device/common/host_device.h"
#include "src/device/megakernel/task_order.h"
#include "src/device/megakernel/task_tables.h"

namespace mok::megakernel::forward {

// The GEMM descriptors of ForwardParams::gemms.
enum Gemm : int8_t { kSharedGateUpGemm, kSharedDownGemm, kExpertGateUpGemm, kExpertDownGemm, kNumGemms };

// The gate/up GEMMs (SwiGLU epilogue, I / 128 n-blocks) and the down GEMMs (H / 256) run with different
// traits: the kernel picks them by this.
MOK_HOST_DEVICE constexpr bool is_gate_up(int gemm) { return gemm == kSharedGateUpGemm || gemm == kExpertGateUpGemm; }

// The counter arrays of ForwardParams::common.counters, in kCounters order.
enum Counter : int8_t { kRowsArrived, kHiddenReady, kOutputReady, kRowsCombined, kSharedHiddenReady, kNumCounters };

inline constexpr CounterDesc kCounters[kNumCounters] = {
    // id                           units of                 complete at
    {CounterId::kRowsArrived,       CounterUnits::kCapacity, kOneTask},           // the unit's dispatch
    {CounterId::kHiddenReady,       CounterUnits::kCapacity, kExpertGateUpGemm},  // every gate/up n-block stored
    {CounterId::kOutputReady,       CounterUnits::kCapacity, kExpertDownGemm},    // every down n-block stored
    {CounterId::kRowsCombined,      CounterUnits::kCapacity, kOneTask},           // the unit's combine
    {CounterId::kSharedHiddenReady, CounterUnits::kShared,   kSharedGateUpGemm},
};

// (waits_kept = waits: the forward keeps no rows, recompute_from is 0)
inline constexpr PhaseDesc kPhases[] = {
    // kind                    GEMM               rows                   waits on            kept rows           signals
    {TaskKind::kSharedGateUp, kSharedGateUpGemm, PhaseRows::kShared,    kNoCounter,         kNoCounter,         kSharedHiddenReady},
    {TaskKind::kSharedDown,   kSharedDownGemm,   PhaseRows::kShared,    kSharedHiddenReady, kSharedHiddenReady, kNoCounter},
    {TaskKind::kExpertGateUp, kExpertGateUpGemm, PhaseRows::kMinibatch, kRowsArrived,       kRowsArrived,       kHiddenReady},
    {TaskKind::kExpertDown,   kExpertDownGemm,   PhaseRows::kMinibatch, kHiddenReady,       kHiddenReady,       kOutputReady},
};

inline constexpr CommPhaseDesc kCommPhases[] = {
    // kind                role             waits on       for                     signals
    {TaskKind::kDispatch, Role::kDispatch, kRowsCombined, CommWait::kRingPrevious, kRowsArrived},
    {TaskKind::kCombine,  Role::kCombine,  kOutputReady,  CommWait::kUnit,         kRowsCombined},
};

static_assert(tables_are_consistent(kPhases, kCommPhases, kCounters, kNumGemms), "the forward's tables disagree");
static_assert(!uses_backward_rows(phase_table(kPhases)), "ComputeWalker (the forward kernel's) walks kShared and kMinibatch only");
static_assert(kCounters[kRowsArrived].id == CounterId::kRowsArrived && kCounters[kHiddenReady].id == CounterId::kHiddenReady &&
                  kCounters[kOutputReady].id == CounterId::kOutputReady &&
                  kCounters[kRowsCombined].id == CounterId::kRowsCombined &&
                  kCounters[kSharedHiddenReady].id == CounterId::kSharedHiddenReady,
              "Counter indexes kCounters");

// The forward's task order over a rank's routed schedule (host: the launch and the tests); n_blocks[g]:
// GEMM g's n-blocks, a multiple of cluster_n.
inline TaskOrderShape task_order(const int32_t* expert_row_offsets, int local_experts, int32_t shared_rows,
                                 int32_t ring_rows, int32_t minibatch_rows, const int32_t (&n_blocks)[kNumGemms],
                                 int cluster_n) {
  TaskOrderShape s{.expert_row_offsets = expert_row_offsets,
                   .local_experts = local_experts,
                   .shared_rows = shared_rows,
                   .ring_rows = ring_rows,
                   .minibatch_rows = minibatch_rows,
                   .recompute_from = 0,
                   .gemm_groups = {},
                   .gemm_m_blocks = {},  // no weight-gradient GEMMs
                   .phases = phase_table(kPhases),
                   .comm_phases = comm_phase_table(kCommPhases)};
  for (int g = 0; g < kNumGemms; ++g) s.gemm_groups[g] = n_blocks[g] / cluster_n;
  return s;
}

}  // namespace mok::megakernel::forward
