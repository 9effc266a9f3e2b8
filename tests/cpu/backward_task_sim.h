// The backward megakernel's task order on the CPU, for tests/cpu/test_backward_tasks.cpp: test cases (a schedule
// with its TaskOrderShape from backward::task_order), the walk of both orders, and the dependency checks (the
// simulation of tests/cpu/task_sim.h, waiting on the counters as the kernels do, plus the data-flow check
// against src/host/moe_backward.cu's stages).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mok/timeline.h"
#include "src/device/megakernel/backward_tasks.h"
#include "src/device/megakernel/task_order.h"
#include "tests/cpu/task_sim.h"

namespace mok::megakernel::task_sim {

namespace bwd = backward;

struct Case {
  std::vector<int32_t> offsets;  // padded segment starts, [experts + 1]
  int32_t scheduled_rows = 0;
  int32_t capacity = 0;
  int cluster_n = 1;
  bool shared_recompute = false, routed_recompute = false;
  int32_t n_blocks[bwd::kNumGemms] = {};
  TaskOrderShape shape{};  // shape.expert_row_offsets: see order()
  CounterDesc counters[bwd::kNumCounters] = {};
  int32_t preset_gate_up_units = 0;  // gate_up_ready units set to their target before the run (a rejected design)

  Case() { std::copy(std::begin(bwd::kCounters), std::end(bwd::kCounters), counters); }
  TaskOrderShape order() const {
    TaskOrderShape s = shape;
    s.expert_row_offsets = offsets.data();
    return s;
  }
  std::string describe() const {
    std::string groups, segments;
    for (int g = 0; g < bwd::kNumGemms; ++g) {
      if (g > 0) groups += '/';
      groups += std::to_string(shape.gemm_groups[g]) + "x" + std::to_string(shape.gemm_m_blocks[g]);
    }
    for (int32_t o : offsets) {
      if (!segments.empty()) segments += ',';
      segments += std::to_string(o);
    }
    return "offsets {" + segments + "}, rows " + std::to_string(scheduled_rows) + ", capacity " +
           std::to_string(capacity) + ", shared rows " + std::to_string(shape.shared_rows) + ", minibatch " +
           std::to_string(shape.minibatch_rows) + ", recompute from " + std::to_string(shape.recompute_from) +
           ", recompute shared/routed " + std::to_string(shared_recompute) + "/" + std::to_string(routed_recompute) +
           ", cluster " + std::to_string(cluster_n) + ", groups x m-blocks " + groups;
  }
};

inline Case make_case(std::vector<int32_t> offsets, int32_t scheduled_rows, int32_t capacity, int32_t shared_rows,
               int32_t minibatch_rows, int32_t recompute_from, int cluster_n, int32_t groups, int32_t m_blocks,
               bool shared_recompute, bool routed_recompute) {
  Case c;
  c.offsets = std::move(offsets);
  c.scheduled_rows = scheduled_rows;
  c.capacity = capacity;
  c.cluster_n = cluster_n;
  c.shared_recompute = shared_recompute;
  c.routed_recompute = routed_recompute;
  int32_t m[bwd::kNumGemms];
  for (int g = 0; g < bwd::kNumGemms; ++g) c.n_blocks[g] = cluster_n * (1 + (groups + g) % 3), m[g] = 1 + (m_blocks + g) % 3;
  c.shape = bwd::task_order(c.offsets.data(), int(c.offsets.size()) - 1, shared_rows, capacity, minibatch_rows,
                            recompute_from, c.n_blocks, m, cluster_n, shared_recompute, routed_recompute);
  return c;
}

// variant: 0 no recompute, 1 routed only, 2 both (the three MoeWorkspace uses).
inline Case random_case(std::mt19937& rng, int variant, int32_t minibatch_rows) {
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int experts = uniform(1, 12), tile_m = rng() % 2 ? 64 : 128, pattern = uniform(0, 5);
  const int all_rows_expert = uniform(0, experts - 1);
  std::vector<int32_t> offsets = {0};
  for (int e = 0; e < experts; ++e) {
    int count = rng() % 4 == 0 ? 0 : uniform(1, 700);
    if (pattern == 0) count = e == all_rows_expert ? uniform(1, 2000) : 0;  // one expert with every row
    if ((pattern == 1 && e == 0) || (pattern == 2 && e == experts - 1)) count = 0;
    offsets.push_back(offsets.back() + (count + tile_m - 1) / tile_m * tile_m);
  }
  const int32_t scheduled = rng() % 10 == 0 ? 0 : offsets.back();  // 0: a capacity overflow
  const int32_t capacity = offsets.back() + 64 * uniform(0, 4);
  const int32_t ring = (std::max(capacity, 1) + 127) / 128 * 128;
  const int32_t shared_rows = rng() % 3 == 0 ? 0 : 64 * uniform(1, 20);
  const int which = uniform(0, 2);
  const int32_t recompute_from = which == 0 ? 0 : which == 1 ? 128 * uniform(0, ring / 128) : ring;
  return make_case(std::move(offsets), scheduled, capacity, shared_rows, minibatch_rows, recompute_from,
                   rng() % 2 ? 2 : 1, uniform(0, 2), uniform(0, 2), variant == 2, variant >= 1);
}

inline const PhaseDesc& phase_of(const Case& c, const ComputeTask& t) { return c.shape.phases.phase[t.phase]; }
inline const CommPhaseDesc& phase_of(const Case& c, const CommTask& t) { return c.shape.comm_phases.phase[t.phase]; }
inline int32_t clipped(const Case& c, int32_t row) { return std::min(row, c.scheduled_rows); }

inline Walked walk(const Case& c) { return walk<BackwardWalker>(c.order(), c.scheduled_rows); }

// The dependency checks of test_backward_tasks.cpp's comment, from the case's tables; "" when they hold, else the first violation.
inline std::string dependency_error(const Case& c, const Walked& w) {
  const TaskOrderShape s = c.order();
  const int64_t units = c.scheduled_rows / kUnitRows, shared_units = s.shared_rows / kUnitRows;
  const int64_t capacity_units = s.ring_rows / kUnitRows + 3;  // units past the schedule must stay untouched
  std::vector<uint64_t> words(counter_words(c.counters, capacity_units, shared_units), 0);
  const CounterArrays counters = resolve_counters(c.counters, words.data(), capacity_units, shared_units, c.n_blocks);
  auto word_of = [&](int8_t counter, int64_t unit) { return counters.base[counter] + unit - words.data(); };
  for (int32_t u = 0; u < c.preset_gate_up_units; ++u) words[word_of(bwd::kGateUpReady, u)] = counters.target[bwd::kGateUpReady];

  struct Task : SimTask {
    TaskKind kind = TaskKind::kNone;
    std::vector<int64_t> units = {};  // the units it reads: a tile's rows, a weight gradient's whole segment
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < w.compute.size(); ++i) {
    const ComputeTask& t = w.compute[i];
    const PhaseDesc& p = phase_of(c, t);
    Task task;
    task.kind = p.kind;
    task.name = "compute slot " + std::to_string(i) + " (" + task_kind_name(p.kind) + ", row " +
                std::to_string(t.row) + ", expert " + std::to_string(t.expert) + ")";
    for (int32_t u = t.row / kUnitRows; u * kUnitRows < t.row + t.rows; ++u) {  // wait_for_inputs' loop
      const int8_t awaited = counter_awaited(p, s, u);
      if (awaited != kNoCounter) task.waits.push_back({word_of(awaited, u), counters.target[awaited]});
      if (p.signals != kNoCounter) task.adds.push_back({word_of(p.signals, u), uint64_t(c.cluster_n)});
    }
    // What it reads, independently of the task's rows for a weight gradient: the expert's clipped segment.
    const bool shared = token_rows(p.rows);
    const int32_t begin = !weight_grad_tiles(p.rows) ? t.row : shared ? 0 : clipped(c, c.offsets[t.expert]);
    const int32_t end = !weight_grad_tiles(p.rows) ? t.row + t.rows : shared ? s.shared_rows : clipped(c, c.offsets[t.expert + 1]);
    for (int32_t u = begin / kUnitRows; u < end / kUnitRows; ++u) task.units.push_back(u);
    tasks.push_back(task);
  }
  for (size_t q = 0; q < w.comm.size(); ++q) {
    const CommTask& t = w.comm[q];
    const CommPhaseDesc& p = phase_of(c, t);
    Task task;
    task.kind = p.kind;
    task.units = {t.unit};
    task.name = "comm slot " + std::to_string(q) + " (" + task_kind_name(p.kind) + ", unit " + std::to_string(t.unit) + ")";
    const int64_t unit = p.wait_unit == CommWait::kRingPrevious ? t.unit + s.ring_rows / kUnitRows : t.unit;
    if (p.waits != kNoCounter && unit < units) task.waits.push_back({word_of(p.waits, unit), counters.target[p.waits]});
    if (p.signals != kNoCounter) task.adds.push_back({word_of(p.signals, t.unit), 1});
    tasks.push_back(task);
  }

  // The simulation; before each weight-gradient tile runs, whether its segment's dgrad is complete.
  const size_t n = tasks.size();
  std::string early;  // the first weight-gradient tile that started before its segment's dgrad was complete
  Ancestry ancestry;
  const std::string deadlock = simulate(tasks, w.compute.size(), words, ancestry, [&](size_t id) {
    const Task& t = tasks[id];
    const bool routed_grad = t.kind == TaskKind::kExpertDownWgrad || t.kind == TaskKind::kExpertGateUpWgrad;
    if (early.empty() && (routed_grad || t.kind == TaskKind::kSharedDownWgrad || t.kind == TaskKind::kSharedGateUpWgrad)) {
      const int8_t dgrad = routed_grad ? bwd::kDgradReady : bwd::kSharedDgradReady;
      for (int64_t u : t.units)
        if (early.empty() && words[word_of(dgrad, u)] != counters.target[dgrad])
          early = t.name + " starts before unit " + std::to_string(u) + " of its segment is complete";
    }
  });
  if (!deadlock.empty()) return deadlock;
  if (!early.empty()) return early;

  // Final counter values: the target on every unit its signaller covers (and the preset ones), 0 elsewhere.
  for (int i = 0; i < bwd::kNumCounters; ++i) {
    int64_t from = 0, to = 0;
    for (int p = 0; p < s.phases.count; ++p)
      if (s.phases.phase[p].signals == i) {
        const PhaseRows rows = s.phases.phase[p].rows;
        to = token_rows(rows) ? shared_units : units;
        from = rows == PhaseRows::kMinibatchFrom ? std::min<int64_t>(to, s.recompute_from / kUnitRows) : 0;
      }
    for (int p = 0; p < s.comm_phases.count; ++p)
      if (s.comm_phases.phase[p].signals == i) to = units;
    const int64_t all = counter_units(c.counters[i].units, capacity_units, shared_units);
    for (int64_t u = 0; u < all; ++u) {
      const bool preset = i == bwd::kGateUpReady && u < c.preset_gate_up_units;
      const uint64_t want = (u >= from && u < to) || preset ? counters.target[i] : 0;
      if (counters.base[i][u] != want)
        return std::string("counter ") + std::to_string(int(c.counters[i].id)) + " unit " + std::to_string(u) +
               " ends at " + std::to_string(counters.base[i][u]) + ", target " + std::to_string(want);
    }
  }

  // Data flow (src/host/moe_backward.cu): what each task reads, by unit, and which tasks write it.
  std::map<std::pair<TaskKind, int64_t>, std::vector<size_t>> writers;
  for (size_t id = 0; id < n; ++id)
    for (int64_t u : tasks[id].units)
      if (tasks[id].kind != TaskKind::kExpertDownWgrad && tasks[id].kind != TaskKind::kExpertGateUpWgrad &&
          tasks[id].kind != TaskKind::kSharedDownWgrad && tasks[id].kind != TaskKind::kSharedGateUpWgrad)
        writers[{tasks[id].kind, u}].push_back(id);
  for (size_t id = 0; id < n; ++id) {
    const Task& t = tasks[id];
    for (int64_t u : t.units) {
      std::vector<TaskKind> needs;
      const bool recomputed = c.routed_recompute && u * kUnitRows >= s.recompute_from;
      switch (t.kind) {
        case TaskKind::kSharedDownDgrad: if (c.shared_recompute) needs = {TaskKind::kSharedRecompute}; break;
        case TaskKind::kSharedGateUpDgrad: needs = {TaskKind::kSharedDownDgrad}; break;
        case TaskKind::kSharedDownWgrad:   // h, d_g | d_u
        case TaskKind::kSharedGateUpWgrad:
          needs = {TaskKind::kSharedDownDgrad};
          if (c.shared_recompute) needs.push_back(TaskKind::kSharedRecompute);
          break;
        case TaskKind::kExpertRecompute: needs = {TaskKind::kPullGrad}; break;  // x rows
        case TaskKind::kExpertDownDgrad:   // d_out, rw (pulled); g | u (recomputed, or kept before the launch)
        case TaskKind::kExpertDownWgrad:   // dy (pulled), h; d_g | d_u for the order below
        case TaskKind::kExpertGateUpWgrad: // x (pulled), d_g | d_u
          needs = {TaskKind::kPullGrad};
          if (recomputed) needs.push_back(TaskKind::kExpertRecompute);
          if (t.kind != TaskKind::kExpertDownDgrad) needs.push_back(TaskKind::kExpertDownDgrad);
          break;
        case TaskKind::kExpertGateUpDgrad: needs = {TaskKind::kExpertDownDgrad}; break;  // d_g | d_u; its d_x
                                                                                         // overwrites the d_out rows
        case TaskKind::kPushGrad: needs = {TaskKind::kExpertGateUpDgrad, TaskKind::kExpertDownDgrad}; break;
        default: break;
      }
      for (TaskKind need : needs) {
        const auto found = writers.find({need, u});
        if (found == writers.end())
          return t.name + " reads unit " + std::to_string(u) + " of " + task_kind_name(need) + ", which nothing writes";
        for (size_t writer : found->second)
          if (!ancestry.ran_before(id, writer))
            return t.name + " may run before " + tasks[writer].name + " (unit " + std::to_string(u) + ")";
      }
    }
  }
  return "";
}

}  // namespace mok::megakernel::task_sim
