// The token schedule: built on the GPU from the all-gathered top-k ids, with no host synchronization.
//
//   ScheduleWorkspace ws(group, shape, options);        // setup: allocates, synchronous
//   ws.gather_topk(rank, topk, IndexType::kInt32, s);   // push this rank's ids to every peer (async)
//   ws.build(rank, s);                                  // count, prefix-sum, place (async)
//   ScheduleView v = ws.view(rank);                     // device pointers for later stages
//   StatusReport r = ws.read_status(rank, s);           // synchronizes s; bad ids / overflow / timeouts
//   ws.reset_status(rank, s);                           // the status word is sticky until this (async)
//
// With virtual ranks, call gather_topk for every rank before build for any rank (build waits for all
// ranks' ids). With device peers or NCCL, each rank uses its own stream; the order of host calls does not
// matter. Every rank argument must be a local rank of the group (PeerGroup::is_local).
// The layout of the buffers is documented in src/device/schedule/placement.h.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/peer_group.h"
#include "mok/routing.h"
#include "mok/status.h"

namespace mok {

// Device pointers into one rank's schedule, read by dispatch, GEMM and combine stages.
struct ScheduleView {
  const int32_t* expert_counts = nullptr;       // [E_local] routed rows per local expert
  const int32_t* expert_src_counts = nullptr;   // [E_local][ep_size] routed rows per (expert, source rank)
  const int32_t* expert_row_offsets = nullptr;  // [E_local + 1] padded segment starts; last = rows needed
  const int32_t* row_route = nullptr;           // [capacity] global route id (src*T*k + t*k + j) or -1
  const int32_t* route_row = nullptr;           // [ep_size * T * k] the row of each global route to a local
                                                // expert (row_route's inverse), -1 for the others
  const int32_t* own_ids = nullptr;             // [T * k] this rank's ids as the schedule read them (int32,
                                                // saturated; -1 past the call's tokens)
  const int32_t* scheduled_rows = nullptr;      // [1] rows in use, 0 after a capacity overflow
  int64_t capacity_rows = 0;
};

// The same schedule on the host (from the CPU twin or downloaded from the GPU), compared exactly in tests.
struct HostSchedule {
  std::vector<int32_t> expert_counts;
  std::vector<int32_t> expert_src_counts;
  std::vector<int32_t> expert_row_offsets;
  std::vector<int32_t> row_route;
  std::vector<int32_t> route_row;
  std::vector<int32_t> own_ids;
  int32_t scheduled_rows = 0;
  StatusReport status;
};

// CPU twin of the GPU schedule for `rank`, from the gathered ids [ep_size][num_tokens][top_k].
HostSchedule build_schedule_host(const RoutingShape& shape, const ScheduleOptions& options, int rank,
                                 const std::vector<int32_t>& gathered_topk);

class ScheduleWorkspace {
 public:
  // Allocates the gather buffers (symmetric: collective for NCCL groups) and each local rank's schedule and
  // status word. Synchronous. A throw at any step frees what was made (SymmetricAllocation's exception).
  ScheduleWorkspace(const PeerGroup& group, const RoutingShape& shape, const ScheduleOptions& options);
  // Frees the local buffers; never a collective (NCCL gather windows not closed are leaked with a warning).
  ~ScheduleWorkspace();
  ScheduleWorkspace(const ScheduleWorkspace&) = delete;
  ScheduleWorkspace& operator=(const ScheduleWorkspace&) = delete;

  // Pushes `rank`'s ids [tokens][top_k] (device memory on the rank's GPU; tokens in [0, num_tokens], -1 for
  // num_tokens; topk may be null when 0) into every peer's gather buffer, -1 (masked) for the routes of
  // tokens [tokens, num_tokens), and raises its arrival counters. Asynchronous on `stream`.
  void gather_topk(int rank, const void* topk, IndexType index_type, cudaStream_t stream, int tokens = -1);
  // Waits (on the GPU) for every rank's ids, then counts, prefix-sums and places, into `schedule`
  // (schedule_elements() int32 on the rank's GPU, e.g. a forward context's) or, when null, the workspace's
  // own buffers. Reports into the rank's status word (sticky: see reset_status). Asynchronous.
  void build(int rank, cudaStream_t stream, int32_t* schedule = nullptr);

  // Device pointers into a built schedule: `schedule` as passed to build, or null for the workspace's own.
  ScheduleView view(int rank, const int32_t* schedule = nullptr) const;
  int64_t schedule_elements() const;
  // The rank's status word in device memory, for later stages of the same step to report into.
  DeviceStatus* device_status(int rank) const;
  const RoutingShape& shape() const { return shape_; }
  int64_t capacity_rows() const { return capacity_rows_; }

  // Status word of `rank`: every error since the last reset_status (or the workspace's creation), across
  // builds. Synchronizes `stream`.
  StatusReport read_status(int rank, cudaStream_t stream) const;
  // Resets `rank`'s status word, its abort flag included (include/mok/status.h), and its side of the gather
  // counters (epoch, top-k arrivals), which a timed-out build leaves out of step with the peers'. Call it on
  // every rank, and let every rank's reset finish before any rank gathers again (synchronize the streams;
  // across processes, a host barrier). Asynchronous on `stream`, CUDA-graph capturable (one kernel).
  void reset_status(int rank, cudaStream_t stream);
  // Copies `rank`'s schedule (see view) to the host. Synchronizes `stream`.
  HostSchedule download(int rank, cudaStream_t stream, const int32_t* schedule = nullptr) const;

  // Frees everything: collective for NCCL groups (SymmetricAllocation::close), synchronous; the work issued on
  // the workspace must be finished. Idempotent; every other call afterwards throws std::logic_error.
  void close();
  bool closed() const { return closed_; }
  bool needs_close() const { return gather_.needs_close(); }
  // Gives up the NCCL gather windows without deregistering them (SymmetricAllocation::leak_windows).
  void leak_windows() noexcept { gather_.leak_windows(); }

 private:
  struct RankState;
  const RankState& local_state(int rank, const char* caller) const;
  PeerGroup group_;  // a copy: callers may pass a temporary
  RoutingShape shape_;
  ScheduleOptions options_;
  int64_t capacity_rows_ = 0;
  SymmetricAllocation gather_;         // arrival counters + two parities of gathered ids, per rank
  std::vector<RankState> ranks_;
  bool closed_ = false;
};

}  // namespace mok
