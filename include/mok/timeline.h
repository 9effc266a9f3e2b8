// Timeline of a fused forward (or backward): per CTA, the tasks it ran and when (MoeOptions::fused.timeline_records),
// written as Chrome-trace JSON (chrome://tracing, ui.perfetto.dev; tools/timeline_png.py draws a PNG).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mok {

// The megakernels' tasks (the phase tables of src/device/megakernel/forward_tasks.h and backward_tasks.h
// name them). Below 256: the timeline record's kind field (timeline_record.h).
enum class TaskKind : int32_t {
  kSharedGateUp = 0,  // shared expert, gate/up GEMM tile with the SwiGLU epilogue
  kSharedDown = 1,
  kExpertGateUp = 2,  // routed experts
  kExpertDown = 3,
  kDispatch = 4,      // communication: pull 64 rows from their source ranks
  kCombine = 5,       // communication: push 64 expert output rows to their source ranks
  // The backward's (row tiles unless noted; wgrad: weight-gradient tiles over an expert's segment)
  kSharedRecompute = 6,     // shared expert: g | u and h again (gate/up GEMM, SwiGLU epilogue)
  kSharedDownDgrad = 7,     // shared expert: d_g | d_u (down dgrad, SwiGLU-backward epilogue)
  kSharedGateUpDgrad = 8,   // shared expert: its d_x partial
  kSharedDownWgrad = 9,     // shared expert: dW_down tile (wgrad)
  kSharedGateUpWgrad = 10,  // shared expert: dW_gate/up tile (wgrad)
  kExpertRecompute = 11,    // routed experts, as the shared ones
  kExpertDownDgrad = 12,
  kExpertGateUpDgrad = 13,  // d_x_route rows
  kExpertDownWgrad = 14,
  kExpertGateUpWgrad = 15,
  kPullGrad = 16,           // communication: pull 64 d_out rows (and router weights, x rows) from their source ranks
  kPushGrad = 17,           // communication: push 64 d_x_route rows and their d_rw to their source ranks
  kNone = 18,
};

// Communication tasks (a CTA's copies track); the others are GEMM tiles.
constexpr bool is_copy_task(TaskKind kind) {
  return kind == TaskKind::kDispatch || kind == TaskKind::kCombine || kind == TaskKind::kPullGrad ||
         kind == TaskKind::kPushGrad;
}

const char* task_kind_name(TaskKind kind);

struct TaskRecord {
  int32_t cta = 0;
  int32_t sm = 0;
  TaskKind kind = TaskKind::kNone;
  int32_t row = 0;      // first schedule row (token row for the shared expert)
  int32_t rows = 0;     // 64 or 128 (a weight-gradient tile's segment: recorded below 256 only)
  int32_t n_block = 0;  // GEMM tasks: output column block
  int32_t expert = 0;   // GEMM tasks: local expert
  uint64_t start_ns = 0;  // GPU global timer
  uint64_t end_ns = 0;
};

// {"traceEvents": [...]}: one complete event per record, pid = rank, two tracks per CTA (tid 2 * CTA: its
// GEMM tiles, 2 * CTA + 1: its row copies; named by metadata events), microseconds from the earliest start
// of `records`. A copy task's span includes its wait for its rows (a combine waits for the down tiles).
std::string chrome_trace_json(const std::vector<TaskRecord>& records, int rank);

}  // namespace mok
