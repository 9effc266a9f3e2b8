// Chrome-trace JSON of a fused forward's (or backward's) task records (include/mok/timeline.h).
#include "mok/timeline.h"

#include <algorithm>
#include <cstdio>
#include <limits>

namespace mok {

const char* task_kind_name(TaskKind kind) {
  switch (kind) {
    case TaskKind::kSharedGateUp: return "shared gate/up";
    case TaskKind::kSharedDown: return "shared down";
    case TaskKind::kExpertGateUp: return "expert gate/up";
    case TaskKind::kExpertDown: return "expert down";
    case TaskKind::kDispatch: return "dispatch";
    case TaskKind::kCombine: return "combine";
    case TaskKind::kSharedRecompute: return "shared recompute";
    case TaskKind::kSharedDownDgrad: return "shared down dgrad";
    case TaskKind::kSharedGateUpDgrad: return "shared gate/up dgrad";
    case TaskKind::kSharedDownWgrad: return "shared down wgrad";
    case TaskKind::kSharedGateUpWgrad: return "shared gate/up wgrad";
    case TaskKind::kExpertRecompute: return "expert recompute";
    case TaskKind::kExpertDownDgrad: return "expert down dgrad";
    case TaskKind::kExpertGateUpDgrad: return "expert gate/up dgrad";
    case TaskKind::kExpertDownWgrad: return "expert down wgrad";
    case TaskKind::kExpertGateUpWgrad: return "expert gate/up wgrad";
    case TaskKind::kPullGrad: return "pull grad";
    case TaskKind::kPushGrad: return "push grad";
    case TaskKind::kNone: return "none";
  }
  return "unknown";
}

std::string chrome_trace_json(const std::vector<TaskRecord>& records, int rank) {
  uint64_t origin = std::numeric_limits<uint64_t>::max();
  int max_cta = -1;
  for (const TaskRecord& r : records) {
    origin = std::min(origin, r.start_ns);
    max_cta = std::max(max_cta, r.cta);
  }
  std::string json = "{\"traceEvents\": [\n";
  char line[320];
  // Two tracks per CTA: its GEMM tiles (tid 2 * CTA) and its row copies (tid 2 * CTA + 1), named for viewers.
  for (int cta = 0; cta <= max_cta; ++cta)
    for (int copies = 0; copies < 2; ++copies) {
      std::snprintf(line, sizeof(line),
                    "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": "
                    "\"CTA %d %s\"}},\n",
                    rank, 2 * cta + copies, cta, copies ? "copies" : "GEMM");
      json += line;
    }
  for (size_t i = 0; i < records.size(); ++i) {
    const TaskRecord& r = records[i];
    const bool copy = is_copy_task(r.kind);
    std::snprintf(line, sizeof(line),
                  "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f, "
                  "\"args\": {\"cta\": %d, \"sm\": %d, \"row\": %d, \"rows\": %d, \"n_block\": %d, \"expert\": %d}}%s\n",
                  task_kind_name(r.kind), rank, 2 * r.cta + (copy ? 1 : 0), double(r.start_ns - origin) / 1e3,
                  double(r.end_ns - r.start_ns) / 1e3, r.cta, r.sm, r.row, r.rows, r.n_block, r.expert,
                  i + 1 < records.size() ? "," : "");
    json += line;
  }
  json += "], \"displayTimeUnit\": \"ms\"}\n";
  return json;
}

}  // namespace mok
