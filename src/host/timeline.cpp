// Chrome-trace JSON of a fused forward's task records (include/mok/timeline.h).
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
    case TaskKind::kNone: return "none";
  }
  return "unknown";
}

std::string chrome_trace_json(const std::vector<TaskRecord>& records, int rank) {
  uint64_t origin = std::numeric_limits<uint64_t>::max();
  for (const TaskRecord& r : records) origin = std::min(origin, r.start_ns);
  std::string json = "{\"traceEvents\": [\n";
  char line[320];
  for (size_t i = 0; i < records.size(); ++i) {
    const TaskRecord& r = records[i];
    std::snprintf(line, sizeof(line),
                  "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f, "
                  "\"args\": {\"sm\": %d, \"row\": %d, \"rows\": %d, \"n_block\": %d, \"expert\": %d}}%s\n",
                  task_kind_name(r.kind), rank, r.cta, double(r.start_ns - origin) / 1e3,
                  double(r.end_ns - r.start_ns) / 1e3, r.sm, r.row, r.rows, r.n_block, r.expert,
                  i + 1 < records.size() ? "," : "");
    json += line;
  }
  json += "], \"displayTimeUnit\": \"ms\"}\n";
  return json;
}

}  // namespace mok
