// Device-side status word: how data-dependent errors (bad expert ids, capacity overflow, spin-wait
// timeouts) travel from the GPU to the host without a trap and without a host synchronization.
//
// Kernels record errors with integer atomics; nothing is reported until the host reads the word at a
// point where it synchronizes anyway (mok::MoeWorkspace::read_status). The word is sticky: it collects
// every error since the caller last reset it (MoeWorkspace::reset_status, ScheduleWorkspace::reset_status;
// workspace creation resets it too), across layers and steps. Each field keeps the *first* event: bad ids
// by a deterministic key (smallest route id), overflow and timeout by the first to claim them.
//
// Abort: the first wait that times out also sets `abort`. Every later wait on another CTA's or rank's
// counter then gives up at once instead of spinning its own timeout, so a failed step costs about one
// timeout; the abort stays set until the reset (docs/sync_protocol.md, "Timeouts and the abort word").
#pragma once

#include <cstdint>
#include <string>

namespace mok {

enum StatusBit : uint32_t {
  kStatusOk = 0,
  kStatusBadExpertId = 1u << 0,      // a top-k id outside [-1, num_experts)
  kStatusCapacityOverflow = 1u << 1, // padded expert rows exceed the configured capacity
  kStatusWaitTimeout = 1u << 2,      // a spin-wait gave up (see timeout_* fields)
  kStatusNonFinite = 1u << 3,        // FP8: a block the layer quantized (x, h, or the backward's d_out and d_g | d_u)
                                     // held a NaN or an infinity (see nonfinite_key); only the rows of that block
                                     // are NaN (and, in the backward, the weight gradients, which sum every row)
  kStatusIdsMismatch = 1u << 4,      // a forward_with_schedule's or a backward's topk_idx differ from the ids the
                                     // context's schedule was built from (see ids_mismatch_key); that call's
                                     // outputs are unspecified
};

// What a non-finite block was (DeviceStatus::nonfinite_key bits 60-63).
enum class NonFiniteWhere : uint32_t {
  kX = 0,       // a token row of x, quantized on its own rank before the dispatch
  kHidden = 1,  // a row of h, quantized by an FP8 gate/up GEMM's epilogue (a schedule row; for the shared expert,
                // a token)
  kDOut = 2,    // a row of d_out, quantized by the FP8 backward for its down dgrad (a schedule row; for the shared
                // expert, a token)
  kDGateUp = 3, // a row of d_g | d_u, quantized by the FP8 backward for its gate/up dgrad (a schedule row; for the
                // shared expert, a token): the down dgrad's bf16 output overflowing, or a NaN of x or d_out
                // (reported first, by their smaller keys, unless the status was reset in between)
};

// DeviceStatus::nonfinite_key's layout, written by the kernels and read by StatusReport: where << 60 | rank << 40 |
// row (rank < 2^20, row < 2^40), so that the smallest key is x before h before d_out before d_g | d_u (a cause
// before what it spreads to), then by rank and row.
inline constexpr int kNonFiniteWhereShift = 60;
inline constexpr int kNonFiniteRankShift = 40;
inline constexpr uint64_t kNonFiniteRankMask = 0xfffff;
constexpr uint64_t nonfinite_key(NonFiniteWhere where, int32_t rank, int64_t row) {
  return (static_cast<uint64_t>(where) << kNonFiniteWhereShift) |
         ((static_cast<uint64_t>(static_cast<uint32_t>(rank)) & kNonFiniteRankMask) << kNonFiniteRankShift) |
         static_cast<uint64_t>(row);
}

// Which stage a spin-wait belongs to (reported with a timeout).
enum class Role : int32_t {
  kNone = 0,
  kScheduleGather = 1,
  kScheduleCount = 2,
  kBarrier = 3,
  kGemmProducer = 4,  // a GEMM's TMA producer thread: its tile's inputs (megakernels), the task ring and mail,
                      // the pipeline's free stages
  kDispatch = 5,      // forward megakernel: a communication CTA pulling rows
  kCombine = 6,       // forward megakernel: a communication CTA pushing rows
  kGemmConsumer = 7,  // a GEMM consumer warpgroup (task ring, pipeline full barrier), in any GEMM kernel
  kPullGrad = 8,      // backward megakernel: a communication group pulling d_out rows
  kPushGrad = 9,      // backward megakernel: a communication group pushing d_x rows and d_rw
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
  // In-kernel hand-offs on shared-memory mbarriers (index: the ring entry or pipeline stage).
  kTaskRing = 8,       // TaskRing::full / empty (producer <-> its consumers)
  kTaskMail = 9,       // TaskRing::mail_full / mail_empty (rank-0 producer <-> rank-1 producer)
  kPipelineFull = 10,  // GEMM pipeline: consumers wait for a stage's TMA bytes
  kPipelineEmpty = 11, // GEMM pipeline: the producer waits for a stage's release
  // The backward megakernel's per-64-row counters (docs/sync_protocol.md, "backward megakernel").
  kRowsPulled = 12,
  kGateUpReady = 13,
  kDgradReady = 14,
  kDxReady = 15,
  kRowsPushed = 16,
  kSharedGateUpReady = 17,
  kSharedDgradReady = 18,
  kBulkCopy = 19,      // a communication CTA's bulk-copy slot: its loads' bytes (index: the warp's slot)
};

// Which kernel a timed-out wait ran in (reported with a timeout).
enum class KernelId : int32_t {
  kUnknown = 0,
  kSchedule = 1,            // count_chunks_kernel (src/device/schedule)
  kBarrier = 2,             // barrier_wait_kernel (the EP barrier)
  kForwardMegakernel = 3,
  kBackwardMegakernel = 4,
  kExpertGemm = 5,          // the standalone expert GEMM (mok::expert_gemm)
  kWeightGradGemm = 6,      // the standalone weight-gradient GEMM (mok::weight_grad_gemm)
};

// Values of DeviceStatus::abort (bits).
enum AbortBit : uint32_t {
  kAbortNone = 0,
  kAbortWait = 1u << 0,     // a wait on another CTA's or rank's counter timed out (data: a peer or a
                            // dependency never came); counter waits give up at once
  kAbortHandoff = 1u << 1,  // an in-kernel mbarrier hand-off timed out (a protocol bug); every wait,
                            // mbarrier waits included, gives up at once
};

// Plain-old-data; lives in device memory, one per rank. Reset only by the caller (reset_status).
struct DeviceStatus {
  uint32_t error_bits;
  uint32_t abort;  // AbortBit; set (GPU scope) with the first timeout, cleared only by a reset
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
  // Waits that gave up at once because `abort` was already set (after the first timeout), mod 2^32.
  uint32_t abandoned_waits;
  int32_t timeout_kernel;   // KernelId of the first timeout
  // Non-finite FP8 input: nonfinite_key(where, rank, row); atomicMin keeps the smallest (x before h, then
  // by rank and row: deterministic). UINT64_MAX when none.
  uint64_t nonfinite_key;
  // topk_idx differing from the schedule's: (route << 32) | uint32(the call's id, saturated to int32), route = t * k + j
  // of this rank's tokens; atomicMin keeps the first route. UINT64_MAX when none.
  uint64_t ids_mismatch_key;
};

// Where a standalone kernel's spin-waits report a timeout, and how long they may take (ExpertGemmArgs::waits,
// WeightGradArgs::waits; MoeWorkspace passes its rank's status word and ScheduleOptions::wait_timeout_s).
struct WaitBound {
  DeviceStatus* status = nullptr;  // required: device memory holding initial_device_status() or a report
  double timeout_s = 10;           // finite, in (0, kMaxWaitTimeoutS] (include/mok/routing.h)
  int32_t rank = 0;                // reported with a timeout
};

// Throws std::invalid_argument, "<prefix>waits.status ..." or "<prefix>waits.timeout_s ...", unless `bound` has a
// status word and a finite timeout in (0, kMaxWaitTimeoutS].
void validate(const WaitBound& bound, const std::string& prefix);
// The timeout in whole nanoseconds, as the kernels count it (of a validated bound).
uint64_t timeout_ns(const WaitBound& bound);

// Value a status word is reset to (at workspace creation and by reset_status).
DeviceStatus initial_device_status();

// Decoded report (host).
struct StatusReport {
  DeviceStatus raw{};
  bool ok() const { return raw.error_bits == kStatusOk; }
  // Global route id of the first bad expert id (src_rank * T * k + token * k + slot), -1 if none.
  int64_t bad_route() const;
  int32_t bad_expert_id() const;
  // The first non-finite FP8 block (kStatusNonFinite): where, the rank, the row; row -1 if none.
  NonFiniteWhere nonfinite_where() const;
  int32_t nonfinite_rank() const;
  int64_t nonfinite_row() const;
  // The first route (t * k + j, this rank's tokens) whose id differed from the schedule's, and the call's id
  // there (saturated to int32); route -1 if none.
  int64_t ids_mismatch_route() const;
  int32_t ids_mismatch_id() const;
  // One line per error, e.g. "expert id 400 out of range [-1, 384) at route 17 (src rank 0, token 2, slot 1)".
  std::string describe(int num_tokens, int top_k, int num_experts) const;
};

}  // namespace mok
