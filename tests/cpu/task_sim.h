// What the forward's and the backward's task-order tests share (tests/cpu/test_forward_tasks.cpp,
// tests/cpu/backward_task_sim.h): the walk of both orders slot by slot, the check that the communication
// order copies every unit once, and the dependency simulation: one compute worker and one communication
// group, each taking its tasks in ticket order and running a task once every counter word it waits on has
// reached its target. The simulation reports a deadlock and records each task's ancestors (everything that
// added, before it ran, to the words it waited on, and their ancestors), from which each test checks its
// data flow.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "src/device/megakernel/task_order.h"

namespace mok::megakernel::task_sim {

struct Walked {
  std::vector<ComputeTask> compute;  // in slot order
  std::vector<CommTask> comm;
};

// Both orders of a shape, as the megakernel's producer (Walker: ComputeWalker or BackwardWalker) and its
// communication group hand them out.
template <class Walker>
Walked walk(const TaskOrderShape& s, int32_t scheduled_rows) {
  Walked w;
  Walker walker(s, scheduled_rows);
  ComputeTask t;
  for (int32_t slot = 0; walker.task_at(slot, t); ++slot) w.compute.push_back(t);
  for (int32_t slot = 0;; ++slot) {
    const CommTask task = comm_task_at(s, scheduled_rows, slot);
    if (task.phase == kNoPhase) break;
    w.comm.push_back(task);
  }
  return w;
}

// Every comm phase copies every one of the `units` units once (`missing`: the failure's words when one is not).
inline void check_comm_coverage(const TaskOrderShape& s, const Walked& w, int32_t units, const char* missing) {
  std::vector<std::vector<int32_t>> seen(s.comm_phases.count, std::vector<int32_t>(units, -1));
  for (int32_t slot = 0; slot < int32_t(w.comm.size()); ++slot) {
    const CommTask& t = w.comm[slot];
    ASSERT_TRUE(t.phase >= 0 && t.phase < s.comm_phases.count) << "comm slot " << slot;
    ASSERT_TRUE(t.unit >= 0 && t.unit < units) << "comm slot " << slot;
    ASSERT_EQ(seen[t.phase][t.unit], -1) << "comm slot " << slot << ": unit " << t.unit << " twice";
    seen[t.phase][t.unit] = slot;
  }
  ASSERT_EQ(w.comm.size(), size_t(s.comm_phases.count) * units) << missing;
}

// A task of the simulation: the counter words it waits on (each until it reaches the target), the words it
// adds to once it ran, and its name for messages. The tests extend it with what their data-flow checks need.
struct SimTask {
  std::vector<std::pair<int64_t, uint64_t>> waits = {};  // (word, target)
  std::vector<std::pair<int64_t, uint64_t>> adds = {};   // (word, amount)
  std::string name = {};
};

// Each task's ancestors as a bitset over the task ids.
struct Ancestry {
  std::vector<std::vector<uint64_t>> of;

  bool ran_before(size_t task, size_t ancestor) const { return (of[task][ancestor / 64] >> (ancestor % 64) & 1) != 0; }
};

// Runs tasks[0, compute_tasks) as the compute order and the rest as the communication order on `words`
// (counter words, updated in place). before_run(id) is called when task id is about to run (its waits are
// met, its adds not done). "" and the ancestry in `ancestry` when every task ran, else the deadlock.
template <class Task, class BeforeRun>
std::string simulate(const std::vector<Task>& tasks, size_t compute_tasks, std::vector<uint64_t>& words,
                     Ancestry& ancestry, BeforeRun before_run) {
  const size_t n = tasks.size(), bitset_words = (n + 63) / 64;
  ancestry.of.assign(n, {});
  std::vector<std::vector<uint64_t>> added_by(words.size(), std::vector<uint64_t>(bitset_words, 0));
  auto ready = [&](const Task& t) {
    for (const auto& [word, target] : t.waits)
      if (words[word] < target) return false;
    return true;
  };
  auto run = [&](size_t id) {
    before_run(id);
    std::vector<uint64_t> before(bitset_words, 0);
    for (const auto& wait : tasks[id].waits)
      for (size_t b = 0; b < bitset_words; ++b) before[b] |= added_by[wait.first][b];
    ancestry.of[id] = before;
    before[id / 64] |= 1ull << (id % 64);
    for (const auto& [word, amount] : tasks[id].adds) {
      words[word] += amount;
      for (size_t b = 0; b < bitset_words; ++b) added_by[word][b] |= before[b];
    }
  };
  size_t next_compute = 0, next_comm = compute_tasks;
  while (next_compute < compute_tasks || next_comm < n) {
    bool progress = false;
    while (next_compute < compute_tasks && ready(tasks[next_compute])) run(next_compute++), progress = true;
    while (next_comm < n && ready(tasks[next_comm])) run(next_comm++), progress = true;
    if (!progress)
      return "deadlock: " + (next_compute < compute_tasks ? tasks[next_compute].name : std::string("no compute")) +
             " and " + (next_comm < n ? tasks[next_comm].name : std::string("no comm")) + " wait forever";
  }
  return "";
}

}  // namespace mok::megakernel::task_sim
