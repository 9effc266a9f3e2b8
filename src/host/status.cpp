// Host side of the device status word (include/mok/status.h).
#include "mok/status.h"

#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "mok/routing.h"
#include "src/host/check.h"

namespace mok {
namespace {

const char* role_name(int32_t role) {
  switch (static_cast<Role>(role)) {
    case Role::kNone: return "none";
    case Role::kScheduleGather: return "schedule gather";
    case Role::kScheduleCount: return "schedule count";
    case Role::kBarrier: return "EP barrier";
    case Role::kGemmProducer: return "GEMM producer";
    case Role::kDispatch: return "megakernel dispatch";
    case Role::kCombine: return "megakernel combine";
    case Role::kGemmConsumer: return "GEMM consumer";
    case Role::kPullGrad: return "megakernel gradient pull";
    case Role::kPushGrad: return "megakernel gradient push";
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
    case CounterId::kTaskRing: return "task ring";
    case CounterId::kTaskMail: return "task mail";
    case CounterId::kPipelineFull: return "pipeline full";
    case CounterId::kPipelineEmpty: return "pipeline empty";
    case CounterId::kRowsPulled: return "rows_pulled";
    case CounterId::kGateUpReady: return "gate_up_ready";
    case CounterId::kDgradReady: return "dgrad_ready";
    case CounterId::kDxReady: return "dx_ready";
    case CounterId::kRowsPushed: return "rows_pushed";
    case CounterId::kSharedGateUpReady: return "shared_gate_up_ready";
    case CounterId::kSharedDgradReady: return "shared_dgrad_ready";
    case CounterId::kBulkCopy: return "bulk copy slot";
  }
  return "unknown";
}

// "" for an unknown kernel (a report from before the field existed reads as before).
const char* kernel_name(int32_t kernel) {
  switch (static_cast<KernelId>(kernel)) {
    case KernelId::kUnknown: return "";
    case KernelId::kSchedule: return "count_chunks_kernel";
    case KernelId::kBarrier: return "barrier_wait_kernel";
    case KernelId::kForwardMegakernel: return "forward megakernel";
    case KernelId::kBackwardMegakernel: return "backward megakernel";
    case KernelId::kExpertGemm: return "expert_gemm";
    case KernelId::kWeightGradGemm: return "weight_grad_gemm";
  }
  return "unknown kernel";
}

}  // namespace

DeviceStatus initial_device_status() {
  DeviceStatus status;
  std::memset(&status, 0, sizeof(status));
  status.bad_route_key = std::numeric_limits<uint64_t>::max();
  status.nonfinite_key = std::numeric_limits<uint64_t>::max();
  status.ids_mismatch_key = std::numeric_limits<uint64_t>::max();
  return status;
}

void validate(const WaitBound& bound, const std::string& prefix) {
  if (bound.status == nullptr)
    throw std::invalid_argument(prefix + "waits.status must point to the DeviceStatus (device memory) that the "
                                         "kernel's spin-waits report a timeout to");
  detail::require_seconds(bound.timeout_s, prefix + "waits.timeout_s");
}

uint64_t timeout_ns(const WaitBound& bound) { return static_cast<uint64_t>(bound.timeout_s * 1e9); }

int64_t StatusReport::bad_route() const {
  if (!(raw.error_bits & kStatusBadExpertId)) return -1;
  return static_cast<int64_t>(raw.bad_route_key >> 32);
}

int32_t StatusReport::bad_expert_id() const {
  return static_cast<int32_t>(static_cast<uint32_t>(raw.bad_route_key & 0xffffffffu));
}

NonFiniteWhere StatusReport::nonfinite_where() const {
  return static_cast<NonFiniteWhere>(raw.nonfinite_key >> kNonFiniteWhereShift);
}
int32_t StatusReport::nonfinite_rank() const {
  return static_cast<int32_t>((raw.nonfinite_key >> kNonFiniteRankShift) & kNonFiniteRankMask);
}
int64_t StatusReport::nonfinite_row() const {
  if (!(raw.error_bits & kStatusNonFinite)) return -1;
  return static_cast<int64_t>(raw.nonfinite_key & ((uint64_t(1) << kNonFiniteRankShift) - 1));
}

int64_t StatusReport::ids_mismatch_route() const {
  if (!(raw.error_bits & kStatusIdsMismatch)) return -1;
  return static_cast<int64_t>(raw.ids_mismatch_key >> 32);
}
int32_t StatusReport::ids_mismatch_id() const {
  return static_cast<int32_t>(static_cast<uint32_t>(raw.ids_mismatch_key & 0xffffffffu));
}

namespace {

// Appends printf-formatted text to `out` (no iostreams in the library's host code).
__attribute__((format(printf, 2, 3))) void append(std::string& out, const char* format, ...) {
  char line[512];
  va_list args;
  va_start(args, format);
  const int n = std::vsnprintf(line, sizeof(line), format, args);
  va_end(args);
  if (n > 0) out.append(line, static_cast<size_t>(n) < sizeof(line) ? static_cast<size_t>(n) : sizeof(line) - 1);
}

}  // namespace

std::string StatusReport::describe(int num_tokens, int top_k, int num_experts) const {
  if (ok()) return "ok";
  std::string out;
  if (raw.error_bits & kStatusBadExpertId) {
    const int64_t route = bad_route();
    const int64_t token_global = route / top_k;
    append(out, "expert id %d out of range [-1, %d) at route %" PRId64 " (src rank %" PRId64 ", token %" PRId64
                ", slot %" PRId64 ")\n",
           bad_expert_id(), num_experts, route, token_global / num_tokens, token_global % num_tokens, route % top_k);
  }
  if (raw.error_bits & kStatusCapacityOverflow)
    append(out, "capacity overflow: the routing needed %" PRId64 " expert rows on a rank, the workspace holds %" PRId64
                " (raise ScheduleOptions.load_factor or set capacity_rows >= %" PRId64 ")\n",
           raw.rows_needed, raw.rows_capacity, raw.rows_needed);
  if (raw.error_bits & kStatusWaitTimeout) {
    const char* kernel = kernel_name(raw.timeout_kernel);
    const std::string in_kernel = *kernel ? std::string("kernel ") + kernel + ", " : std::string();
    append(out, "spin-wait timed out on rank %d, SM %d, %srole %s, counter %s[%d]: awaited >= %" PRIu64 ", saw %" PRIu64 "\n",
           raw.timeout_rank, raw.timeout_sm, in_kernel.c_str(), role_name(raw.timeout_role),
           counter_name(raw.timeout_counter), raw.timeout_index, raw.timeout_awaited, raw.timeout_seen);
    if (raw.abandoned_waits > 0)
      append(out, "%u later waits gave up at once (abort set)\n", raw.abandoned_waits);
  }
  if (raw.error_bits & kStatusNonFinite) {
    switch (nonfinite_where()) {
      case NonFiniteWhere::kX:
        append(out, "NaN or infinity in x: token row %" PRId64 " of rank %d (FP8: its block's scale is NaN, so that "
                    "token's outputs are NaN; other tokens are not affected)\n",
               nonfinite_row(), nonfinite_rank());
        break;
      case NonFiniteWhere::kHidden:
        append(out, "NaN or infinity in h (the down GEMM's input) at row %" PRId64 " of an FP8 gate/up GEMM on rank %d "
                    "(that row's outputs are NaN; other rows are not affected)\n",
               nonfinite_row(), nonfinite_rank());
        break;
      case NonFiniteWhere::kDOut:
        append(out, "NaN or infinity in d_out at row %" PRId64 " of the FP8 backward's down dgrad on rank %d (that "
                    "row's token gets NaN d_x and d_router_weights, other tokens are not affected; the weight "
                    "gradients, sums over every row, get NaN too)\n",
               nonfinite_row(), nonfinite_rank());
        break;
      default:
        append(out, "NaN or infinity in d_g | d_u at row %" PRId64 " of the FP8 backward's gate/up dgrad on rank %d "
                    "(the down dgrad's bf16 output overflowed, or a NaN of that row's x; that row's token gets NaN "
                    "d_x, other tokens are not affected; the weight gradients get NaN too)\n",
               nonfinite_row(), nonfinite_rank());
    }
  }
  if (raw.error_bits & kStatusIdsMismatch) {
    const int64_t route = ids_mismatch_route();
    append(out, "topk_idx differ from the ids the context's schedule was built from, first at token %" PRId64
                ", slot %" PRId64 " (id %d in this call): pass the forward's topk_idx, or build_schedule with these "
                "first (this call's outputs are unspecified)\n",
           route / top_k, route % top_k, ids_mismatch_id());
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace mok
