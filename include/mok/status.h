// Device-side status word: how data-dependent errors (bad expert ids, capacity overflow, spin-wait
// timeouts) travel from the GPU to the host without a trap and without a host synchronization.
//
// Kernels record errors with integer atomics; nothing is reported until the host reads the word at a
// point where it synchronizes anyway (mok::ScheduleWorkspace::read_status). Each field keeps the *first*
// event by a deterministic key (smallest route id), so a report does not depend on thread timing.
#pragma once

#include <cstdint>
#include <string>

namespace mok {

enum StatusBit : uint32_t {
  kStatusOk = 0,
  kStatusBadExpertId = 1u << 0,      // a top-k id outside [-1, num_experts)
  kStatusCapacityOverflow = 1u << 1, // padded expert rows exceed the configured capacity
  kStatusWaitTimeout = 1u << 2,      // a spin-wait gave up (see timeout_* fields)
};

// Which stage a spin-wait belongs to (reported with a timeout).
enum class Role : int32_t {
  kNone = 0,
  kScheduleGather = 1,
  kScheduleCount = 2,
  kBarrier = 3,
  kGemmProducer = 4,  // forward megakernel: a compute CTA's TMA producer waiting for its tile's inputs
  kDispatch = 5,      // forward megakernel: a communication CTA pulling rows
  kCombine = 6,       // forward megakernel: a communication CTA pushing rows
};

// Which counter a spin-wait watched (reported with a timeout). Names match docs/sync_protocol.md.
enum class CounterId : int32_t {
  kNone = 0,
  kTopkArrived = 1,
  kBarrierArrived = 2,
  kRowsArrived = 3,        // the megakernel's per-64-row counters (docs/sync_protocol.md)
  kHiddenReady = 4,
  kSharedHiddenReady = 5,
  kOutputReady = 6,
  kRowsCombined = 7,
};

// Plain-old-data; lives in device memory, one per rank. Reset by the owner before each use.
struct DeviceStatus {
  uint32_t error_bits;
  uint32_t pad0;
  // Bad expert id: key = (global route id << 32) | uint32(id); atomicMin keeps the first route.
  uint64_t bad_route_key;
  // Capacity overflow: rows the schedule needed and the rows it had.
  int64_t rows_needed;
  int64_t rows_capacity;
  // Spin-wait timeout (first one to claim timeout_claimed writes the rest).
  uint32_t timeout_claimed;
  int32_t timeout_rank;
  int32_t timeout_sm;
  int32_t timeout_role;     // Role
  int32_t timeout_counter;  // CounterId
  int32_t timeout_index;    // which element of the counter array
  uint64_t timeout_awaited;
  uint64_t timeout_seen;
};

// Value a status word is reset to before a stage runs.
DeviceStatus initial_device_status();

// Decoded report (host).
struct StatusReport {
  DeviceStatus raw{};
  bool ok() const { return raw.error_bits == kStatusOk; }
  // Global route id of the first bad expert id (src_rank * T * k + token * k + slot), -1 if none.
  int64_t bad_route() const;
  int32_t bad_expert_id() const;
  // One line per error, e.g. "expert id 400 out of range [-1, 384) at route 17 (src rank 0, token 2, slot 1)".
  std::string describe(int num_tokens, int top_k, int num_experts) const;
};

}  // namespace mok
