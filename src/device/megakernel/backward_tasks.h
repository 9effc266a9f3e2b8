// The backward megakernel's tables: its ten GEMMs, seven counter arrays and its compute and communication
// phases, walked by task_order.h (BackwardWalker). Host + device code. The math is src/host/moe_backward.cu's
// (docs/design.md, "Backward"); per rank, between the EP barriers, every buffer capacity-sized (no ring reuse):
//
//   shared expert (token rows [0, shared_rows), walked first; with MoeOptions::keep_gate_up off):
//   shared recompute     g | u, h = SwiGLU(x · [Wg; Wu]^T)                          needs nothing
//   shared down dgrad    d_g | d_u = SwiGLU'(d_out · W_down, g, u)                  needs shared_gate_up_ready
//   shared gate/up dgrad shared d_x = [d_g, d_u] · [Wg; Wu]                         needs shared_dgrad_ready
//   per minibatch (routed rows, ascending):
//   pull grad            d_out, rw, dy = rw · d_out (and x when not kept) rows     (comm, needs nothing)
//   expert recompute     g | u, h of rows >= recompute_from                         needs rows_pulled
//   expert down dgrad    d_g | d_u, d_rw partials                                   needs gate_up_ready (rows
//                                                                                   below recompute_from: rows_pulled)
//   expert gate/up dgrad d_x_route rows                                             needs dgrad_ready
//   expert wgrads        dW_down_e = Σ dyᵀ h, dW_gate/up_e = Σ [d_g, d_u]ᵀ x of every expert whose segment
//                        ends in the minibatch                                      needs dgrad_ready, whole segment
//   push grad            d_x_route rows and d_rw to the token's rank                (comm) needs dx_ready
//   tail (after the last minibatch): the shared expert's wgrads                     needs shared_dgrad_ready, all rows
// Who adds, who waits and why it cannot deadlock: docs/sync_protocol.md, "backward megakernel".
#pragma once

#include <cstdint>

#include "mok/status.h"
#include "mok/timeline.h"
#include "src/device/common/host_device.h"
#include "src/device/megakernel/task_order.h"
#include "src/device/megakernel/task_tables.h"

namespace mok::megakernel::backward {

// The GEMM descriptors of the backward kernel's parameters, by this index.
enum Gemm : int8_t {
  kSharedRecompute,
  kSharedDownDgrad,
  kSharedGateUpDgrad,
  kSharedDownWgrad,
  kSharedGateUpWgrad,
  kExpertRecompute,
  kExpertDownDgrad,
  kExpertGateUpDgrad,
  kExpertDownWgrad,
  kExpertGateUpWgrad,
  kNumGemms
};

// The four GEMM traits the kernel runs (it picks them by this): row GEMMs with the SwiGLU epilogue and a
// g | u side output, with the SwiGLU-backward epilogue, with a plain store; and the weight-gradient GEMM.
enum class GemmKind : int8_t { kRecompute, kDownDgrad, kGateUpDgrad, kWeightGrad };

MOK_HOST_DEVICE constexpr GemmKind gemm_kind(int gemm) {
  switch (gemm) {
    case kSharedRecompute:
    case kExpertRecompute: return GemmKind::kRecompute;
    case kSharedDownDgrad:
    case kExpertDownDgrad: return GemmKind::kDownDgrad;
    case kSharedGateUpDgrad:
    case kExpertGateUpDgrad: return GemmKind::kGateUpDgrad;
    default: return GemmKind::kWeightGrad;
  }
}

// The counter arrays of the kernel's parameters, in kCounters order.
enum Counter : int8_t {
  kRowsPulled,
  kGateUpReady,
  kDgradReady,
  kDxReady,
  kRowsPushed,
  kSharedGateUpReady,
  kSharedDgradReady,
  kNumCounters
};

inline constexpr CounterDesc kCounters[kNumCounters] = {
    // id                            units of                 complete at
    {CounterId::kRowsPulled,         CounterUnits::kCapacity, kOneTask},            // the unit's pull
    {CounterId::kGateUpReady,        CounterUnits::kCapacity, kExpertRecompute},    // every recompute n-block stored
    {CounterId::kDgradReady,         CounterUnits::kCapacity, kExpertDownDgrad},    // every down dgrad n-block stored
    {CounterId::kDxReady,            CounterUnits::kCapacity, kExpertGateUpDgrad},  // every gate/up dgrad n-block
    {CounterId::kRowsPushed,         CounterUnits::kCapacity, kOneTask},            // the unit's push; nobody waits
    {CounterId::kSharedGateUpReady,  CounterUnits::kShared,   kSharedRecompute},
    {CounterId::kSharedDgradReady,   CounterUnits::kShared,   kSharedDownDgrad},
};

static_assert(kCounters[kRowsPulled].id == CounterId::kRowsPulled &&
                  kCounters[kGateUpReady].id == CounterId::kGateUpReady &&
                  kCounters[kDgradReady].id == CounterId::kDgradReady && kCounters[kDxReady].id == CounterId::kDxReady &&
                  kCounters[kRowsPushed].id == CounterId::kRowsPushed &&
                  kCounters[kSharedGateUpReady].id == CounterId::kSharedGateUpReady &&
                  kCounters[kSharedDgradReady].id == CounterId::kSharedDgradReady,
              "Counter indexes kCounters");

// The compute phases in walk order. shared_recompute: the shared expert's g | u are recomputed (else the
// context kept them); routed_recompute: the routed rows at or past TaskOrderShape::recompute_from are
// recomputed (rows below it were kept by the context and copied into the g | u and h buffers before the
// launch; their down dgrad tiles wait only for their pull, waits_kept). Three variants occur (none, routed
// only, both: MoeWorkspace::recomputes_gate_up); all four pass the checks below.
constexpr PhaseTable phases(bool shared_recompute, bool routed_recompute) {
  PhaseTable t{};
  const int8_t shared_gate_up = shared_recompute ? int8_t(kSharedGateUpReady) : kNoCounter;
  const int8_t gate_up = routed_recompute ? kGateUpReady : kRowsPulled;
  using K = TaskKind;
  using R = PhaseRows;
  // kind                           GEMM                rows               waits on           kept rows          signals
  if (shared_recompute)
    add_phase(t, {K::kSharedRecompute, kSharedRecompute, R::kShared,      kNoCounter,        kNoCounter,        kSharedGateUpReady});
  add_phase(t, {K::kSharedDownDgrad,     kSharedDownDgrad,   R::kShared,        shared_gate_up,    shared_gate_up,    kSharedDgradReady});
  add_phase(t, {K::kSharedGateUpDgrad,   kSharedGateUpDgrad, R::kShared,        kSharedDgradReady, kSharedDgradReady, kNoCounter});
  if (routed_recompute)
    add_phase(t, {K::kExpertRecompute, kExpertRecompute, R::kMinibatchFrom, kRowsPulled,       kRowsPulled,       kGateUpReady});
  add_phase(t, {K::kExpertDownDgrad,     kExpertDownDgrad,   R::kMinibatch,     gate_up,           kRowsPulled,       kDgradReady});
  add_phase(t, {K::kExpertGateUpDgrad,   kExpertGateUpDgrad, R::kMinibatch,     kDgradReady,       kDgradReady,       kDxReady});
  add_phase(t, {K::kExpertDownWgrad,     kExpertDownWgrad,   R::kEndingExperts, kDgradReady,       kDgradReady,       kNoCounter});
  add_phase(t, {K::kExpertGateUpWgrad,   kExpertGateUpWgrad, R::kEndingExperts, kDgradReady,       kDgradReady,       kNoCounter});
  add_phase(t, {K::kSharedDownWgrad,     kSharedDownWgrad,   R::kSharedTail,    kSharedDgradReady, kSharedDgradReady, kNoCounter});
  add_phase(t, {K::kSharedGateUpWgrad,   kSharedGateUpWgrad, R::kSharedTail,    kSharedDgradReady, kSharedDgradReady, kNoCounter});
  return finish_phases(t);
}

// One macrobatch: all pulls, then all pushes.
inline constexpr CommPhaseDesc kCommPhases[] = {
    // kind                role             waits on    for              signals
    {TaskKind::kPullGrad, Role::kPullGrad, kNoCounter, CommWait::kUnit, kRowsPulled},
    {TaskKind::kPushGrad, Role::kPushGrad, kDxReady,   CommWait::kUnit, kRowsPushed},
};

// Row phases run row GEMMs, weight-gradient phases the weight-gradient GEMMs.
constexpr bool gemm_kinds_match(const PhaseTable& t) {
  for (int i = 0; i < t.count && i < kMaxPhases; ++i)
    if (weight_grad_tiles(t.phase[i].rows) != (gemm_kind(t.phase[i].gemm) == GemmKind::kWeightGrad)) return false;
  return true;
}

constexpr bool variant_is_consistent(bool shared_recompute, bool routed_recompute) {
  const PhaseTable t = phases(shared_recompute, routed_recompute);
  return tables_are_consistent(t, comm_phase_table(kCommPhases), kCounters, kNumCounters, kNumGemms) &&
         gemm_kinds_match(t);
}
static_assert(variant_is_consistent(false, false) && variant_is_consistent(false, true) &&
                  variant_is_consistent(true, true) && variant_is_consistent(true, false),
              "the backward's tables disagree");

// The backward's task order over a rank's routed schedule (host: the launch and the tests). One macrobatch:
// the ring is the capacity (rounded up to 128 rows), so minibatches are walked in ascending order, which the
// weight-gradient phases need (an expert's tiles wait for its whole segment, walked before them).
// recompute_from: a multiple of 128 (0: every routed row is recomputed); the routed recompute phase's rows
// start there. n_blocks[g]: GEMM g's n-blocks, a multiple of cluster_n (weight-gradient GEMMs: 256-column
// blocks of the gradient); m_blocks[g]: a weight-gradient GEMM's 128-row blocks of gradient rows (ignored,
// set to 0, for row GEMMs).
inline TaskOrderShape task_order(const int32_t* expert_row_offsets, int local_experts, int32_t shared_rows,
                                 int32_t capacity_rows, int32_t minibatch_rows, int32_t recompute_from,
                                 const int32_t (&n_blocks)[kNumGemms], const int32_t (&m_blocks)[kNumGemms],
                                 int cluster_n, bool shared_recompute, bool routed_recompute) {
  TaskOrderShape s{.expert_row_offsets = expert_row_offsets,
                   .local_experts = local_experts,
                   .shared_rows = shared_rows,
                   .ring_rows = ceil_div(capacity_rows > 0 ? capacity_rows : 1, kTileRows) * kTileRows,
                   .minibatch_rows = minibatch_rows,
                   .recompute_from = recompute_from,
                   .gemm_groups = {},
                   .gemm_m_blocks = {},
                   .phases = phases(shared_recompute, routed_recompute),
                   .comm_phases = comm_phase_table(kCommPhases)};
  for (int g = 0; g < kNumGemms; ++g) {
    s.gemm_groups[g] = n_blocks[g] / cluster_n;
    s.gemm_m_blocks[g] = gemm_kind(g) == GemmKind::kWeightGrad ? m_blocks[g] : 0;
  }
  return s;
}

}  // namespace mok::megakernel::backward
