// Recording data-dependent errors in the device status word (include/mok/status.h). Integer atomics only.
#pragma once

#include <cstdint>

#include "mok/status.h"

namespace mok::device {

// Bad expert id at global route `route`: keeps the smallest route (deterministic across thread timing).
__device__ __forceinline__ void record_bad_expert_id(DeviceStatus* status, int64_t route, int32_t expert_id) {
  atomicOr(&status->error_bits, kStatusBadExpertId);
  const unsigned long long key = (static_cast<unsigned long long>(route) << 32) | static_cast<uint32_t>(expert_id);
  atomicMin(reinterpret_cast<unsigned long long*>(&status->bad_route_key), key);
}

}  // namespace mok::device
