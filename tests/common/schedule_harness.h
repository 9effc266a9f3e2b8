// Drives the GPU schedule for every rank of a peer group from host-side ids, for tests and the bench.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/peer_group.h"
#include "mok/schedule.h"

namespace mok::testing {

class ScheduleHarness {
 public:
  // Virtual ranks share one stream (every gather is issued before any build); device peers get one each.
  ScheduleHarness(PeerGroup group, const RoutingShape& shape, const ScheduleOptions& options);
  ~ScheduleHarness();
  ScheduleHarness(const ScheduleHarness&) = delete;
  ScheduleHarness& operator=(const ScheduleHarness&) = delete;

  // Copies each rank's ids [num_tokens][top_k] to its GPU, as int32 or int64.
  void upload(const std::vector<std::vector<int32_t>>& per_rank_topk, IndexType index_type);
  // Fills every rank's row map with a poison value, so unwritten rows are caught.
  void poison();
  // gather_topk on every rank, then build on every rank (asynchronous).
  void launch();
  void synchronize();
  std::vector<HostSchedule> download();

  ScheduleWorkspace& workspace() { return *workspace_; }
  const PeerGroup& group() const { return group_; }
  cudaStream_t stream(int rank) const { return streams_.at(group_.is_virtual() ? 0 : rank); }

 private:
  PeerGroup group_;
  std::unique_ptr<ScheduleWorkspace> workspace_;
  std::vector<cudaStream_t> streams_;
  std::vector<void*> topk_device_;
  IndexType index_type_ = IndexType::kInt32;
};

// Concatenates per-rank ids into the gathered layout [ep_size][num_tokens][top_k].
std::vector<int32_t> gather_on_host(const std::vector<std::vector<int32_t>>& per_rank_topk);

// Empty when equal; else names the first differing field and index, with both values.
std::string compare_schedules(const HostSchedule& expected, const HostSchedule& actual);

}  // namespace mok::testing
