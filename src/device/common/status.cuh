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

// A block quantized to FP8 held a NaN or an infinity (row < 2^40, rank < 2^20): keeps the smallest key.
__device__ __forceinline__ void record_nonfinite(DeviceStatus* status, NonFiniteWhere where, int32_t rank,
                                                 int64_t row) {
  atomicOr(&status->error_bits, kStatusNonFinite);
  atomicMin(reinterpret_cast<unsigned long long*>(&status->nonfinite_key),
            static_cast<unsigned long long>(nonfinite_key(where, rank, row)));
}

// A call's topk_idx differ from the schedule's ids at this rank's route `route` (t * k + j): keeps the first.
__device__ __forceinline__ void record_ids_mismatch(DeviceStatus* status, int64_t route, int32_t call_id) {
  atomicOr(&status->error_bits, kStatusIdsMismatch);
  const unsigned long long key = (static_cast<unsigned long long>(route) << 32) | static_cast<uint32_t>(call_id);
  atomicMin(reinterpret_cast<unsigned long long*>(&status->ids_mismatch_key), key);
}

}  // namespace mok::device
