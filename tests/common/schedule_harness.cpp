#include "tests/common/schedule_harness.h"

#include <cstring>
#include <sstream>
#include <stdexcept>

#include "src/host/check.h"
#include "src/host/device_guard.h"

namespace mok::testing {

using detail::DeviceGuard;

ScheduleHarness::ScheduleHarness(PeerGroup group, const RoutingShape& shape, const ScheduleOptions& options)
    : group_(std::move(group)) {
  workspace_ = std::make_unique<ScheduleWorkspace>(group_, shape, options);
  const int num_streams = group_.is_virtual() ? 1 : group_.size();
  streams_.resize(num_streams);
  for (int s = 0; s < num_streams; ++s) {
    DeviceGuard guard(group_.device(s));
    MOK_CHECK_CUDA(cudaStreamCreateWithFlags(&streams_[s], cudaStreamNonBlocking));
  }
  topk_device_.assign(group_.size(), nullptr);
}

ScheduleHarness::~ScheduleHarness() {
  for (int r = 0; r < group_.size(); ++r) {
    DeviceGuard guard(group_.device(r));
    if (topk_device_[r] != nullptr) cudaFree(topk_device_[r]);
  }
  for (size_t s = 0; s < streams_.size(); ++s) {
    DeviceGuard guard(group_.device(static_cast<int>(s)));
    cudaStreamDestroy(streams_[s]);
  }
  workspace_.reset();
}

void ScheduleHarness::upload(const std::vector<std::vector<int32_t>>& per_rank_topk, IndexType index_type) {
  const RoutingShape& shape = workspace_->shape();
  if (static_cast<int>(per_rank_topk.size()) != group_.size()) throw std::invalid_argument("upload: one id list per rank");
  index_type_ = index_type;
  const size_t routes = static_cast<size_t>(shape.routes_per_rank());
  for (int r = 0; r < group_.size(); ++r) {
    if (per_rank_topk[r].size() != routes) throw std::invalid_argument("upload: wrong id count");
    DeviceGuard guard(group_.device(r));
    if (topk_device_[r] == nullptr) MOK_CHECK_CUDA(cudaMalloc(&topk_device_[r], routes * sizeof(int64_t)));
    if (index_type == IndexType::kInt32) {
      MOK_CHECK_CUDA(cudaMemcpy(topk_device_[r], per_rank_topk[r].data(), routes * sizeof(int32_t),
                                cudaMemcpyHostToDevice));
    } else {
      std::vector<int64_t> wide(per_rank_topk[r].begin(), per_rank_topk[r].end());
      MOK_CHECK_CUDA(cudaMemcpy(topk_device_[r], wide.data(), routes * sizeof(int64_t), cudaMemcpyHostToDevice));
    }
  }
}

void ScheduleHarness::poison() {
  for (int r = 0; r < group_.size(); ++r) {
    DeviceGuard guard(group_.device(r));
    const ScheduleView v = workspace_->view(r);
    MOK_CHECK_CUDA(cudaMemset(const_cast<int32_t*>(v.row_route), 0x7f, size_t(v.capacity_rows) * sizeof(int32_t)));
    MOK_CHECK_CUDA(cudaMemset(const_cast<int32_t*>(v.route_row), 0x7f,
                              size_t(workspace_->shape().ep_size) * workspace_->shape().routes_per_rank() *
                                  sizeof(int32_t)));
    MOK_CHECK_CUDA(cudaMemset(const_cast<int32_t*>(v.own_ids), 0x7f,
                              size_t(workspace_->shape().routes_per_rank()) * sizeof(int32_t)));
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
  }
}

void ScheduleHarness::launch() {
  for (int r = 0; r < group_.size(); ++r) workspace_->gather_topk(r, topk_device_[r], index_type_, stream(r));
  for (int r = 0; r < group_.size(); ++r) workspace_->build(r, stream(r));
}

void ScheduleHarness::synchronize() {
  for (size_t s = 0; s < streams_.size(); ++s) {
    DeviceGuard guard(group_.device(static_cast<int>(s)));
    MOK_CHECK_CUDA(cudaStreamSynchronize(streams_[s]));
  }
}

std::vector<HostSchedule> ScheduleHarness::download() {
  std::vector<HostSchedule> out;
  for (int r = 0; r < group_.size(); ++r) out.push_back(workspace_->download(r, stream(r)));
  return out;
}

std::vector<int32_t> gather_on_host(const std::vector<std::vector<int32_t>>& per_rank_topk) {
  std::vector<int32_t> gathered;
  for (const auto& ids : per_rank_topk) gathered.insert(gathered.end(), ids.begin(), ids.end());
  return gathered;
}

namespace {

std::string compare_field(const char* name, const std::vector<int32_t>& expected, const std::vector<int32_t>& actual) {
  if (expected.size() != actual.size()) {
    std::ostringstream out;
    out << name << ": size " << actual.size() << ", expected " << expected.size();
    return out.str();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] != actual[i]) {
      std::ostringstream out;
      out << name << "[" << i << "] = " << actual[i] << ", expected " << expected[i];
      return out.str();
    }
  }
  return {};
}

}  // namespace

std::string compare_schedules(const HostSchedule& expected, const HostSchedule& actual) {
  for (auto [name, e, a] : {std::tuple{"expert_counts", &expected.expert_counts, &actual.expert_counts},
                            std::tuple{"expert_src_counts", &expected.expert_src_counts, &actual.expert_src_counts},
                            std::tuple{"expert_row_offsets", &expected.expert_row_offsets, &actual.expert_row_offsets},
                            std::tuple{"row_route", &expected.row_route, &actual.row_route},
                            std::tuple{"route_row", &expected.route_row, &actual.route_row},
                            std::tuple{"own_ids", &expected.own_ids, &actual.own_ids}}) {
    std::string diff = compare_field(name, *e, *a);
    if (!diff.empty()) return diff;
  }
  std::ostringstream out;
  if (expected.scheduled_rows != actual.scheduled_rows)
    out << "scheduled_rows = " << actual.scheduled_rows << ", expected " << expected.scheduled_rows;
  else if (std::memcmp(&expected.status.raw, &actual.status.raw, sizeof(DeviceStatus)) != 0)
    out << "status differs: got error bits " << actual.status.raw.error_bits << " key " << actual.status.raw.bad_route_key
        << " rows " << actual.status.raw.rows_needed << ", expected " << expected.status.raw.error_bits << " key "
        << expected.status.raw.bad_route_key << " rows " << expected.status.raw.rows_needed;
  return out.str();
}

}  // namespace mok::testing
