// Host side of the device status word (include/mok/status.h).
#include "mok/status.h"

#include <cstring>
#include <limits>
#include <sstream>

namespace mok {
namespace {

const char* role_name(int32_t role) {
  switch (static_cast<Role>(role)) {
    case Role::kNone: return "none";
    case Role::kScheduleGather: return "schedule gather";
    case Role::kScheduleCount: return "schedule count";
    case Role::kBarrier: return "EP barrier";
    case Role::kGemmProducer: return "megakernel GEMM producer";
    case Role::kDispatch: return "megakernel dispatch";
    case Role::kCombine: return "megakernel combine";
  }
  return "unknown";
}

const char* counter_name(int32_t counter) {
  switch (static_cast<CounterId>(counter)) {
    case CounterId::kNone: return "none";
    case CounterId::kTopkArrived: return "topk_arrived";
    case CounterId::kBarrierArrived: return "barrier arrived";
    case CounterId::kRowsArrived: return "rows_arrived";
    case CounterId::kHiddenReady: return "hidden_ready";
    case CounterId::kSharedHiddenReady: return "shared_hidden_ready";
    case CounterId::kOutputReady: return "output_ready";
    case CounterId::kRowsCombined: return "rows_combined";
  }
  return "unknown";
}

}  // namespace

DeviceStatus initial_device_status() {
  DeviceStatus status;
  std::memset(&status, 0, sizeof(status));
  status.bad_route_key = std::numeric_limits<uint64_t>::max();
  return status;
}

int64_t StatusReport::bad_route() const {
  if (!(raw.error_bits & kStatusBadExpertId)) return -1;
  return static_cast<int64_t>(raw.bad_route_key >> 32);
}

int32_t StatusReport::bad_expert_id() const {
  return static_cast<int32_t>(static_cast<uint32_t>(raw.bad_route_key & 0xffffffffu));
}

std::string StatusReport::describe(int num_tokens, int top_k, int num_experts) const {
  if (ok()) return "ok";
  std::ostringstream out;
  if (raw.error_bits & kStatusBadExpertId) {
    const int64_t route = bad_route();
    const int64_t token_global = route / top_k;
    out << "expert id " << bad_expert_id() << " out of range [-1, " << num_experts << ") at route " << route
        << " (src rank " << token_global / num_tokens << ", token " << token_global % num_tokens << ", slot "
        << route % top_k << ")\n";
  }
  if (raw.error_bits & kStatusCapacityOverflow)
    out << "capacity overflow: the schedule needs " << raw.rows_needed << " rows, capacity is " << raw.rows_capacity
        << " (raise ScheduleOptions.capacity_rows)\n";
  if (raw.error_bits & kStatusWaitTimeout)
    out << "spin-wait timed out on rank " << raw.timeout_rank << ", SM " << raw.timeout_sm << ", role "
        << role_name(raw.timeout_role) << ", counter " << counter_name(raw.timeout_counter) << "["
        << raw.timeout_index << "]: awaited >= "
        << raw.timeout_awaited << ", saw " << raw.timeout_seen << "\n";
  std::string text = out.str();
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

}  // namespace mok
