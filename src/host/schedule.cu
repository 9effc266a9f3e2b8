// ScheduleWorkspace: buffers and launches of the GPU schedule (kernels in
// src/device/schedule/schedule_kernels.cuh). The only place these kernels are launched.
#include "mok/schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "mok/device_buffer.h"
#include "src/device/schedule/schedule_kernels.cuh"
#include "src/host/buffer_layout.h"
#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "src/host/launch_cache.h"
#include "src/host/teardown.h"

namespace mok {
using detail::DeviceGuard;
namespace {

// The rank's status word, and its side of the cross-rank counters: its epoch and the arrival counters in its
// own gather buffer (ScheduleWorkspace::reset_status says when that is safe).
__global__ void reset_rank_kernel(DeviceStatus* status, DeviceStatus initial, uint64_t* epoch, uint64_t* topk_arrived,
                                  int ep_size) {
  *status = initial;
  *epoch = 0;
  for (int src = 0; src < ep_size; ++src) topk_arrived[src] = 0;
}

}  // namespace

// One rank's private allocation: its status word, its epoch and its schedule (ScheduleLayout's int32 buffers).
struct ScheduleWorkspace::RankState {
  int device = 0;
  int num_sms = 0;
  DeviceBuffer allocation;
  DeviceStatus* status = nullptr;
  uint64_t* epoch = nullptr;
  int32_t* schedule = nullptr;
};

ScheduleWorkspace::ScheduleWorkspace(const PeerGroup& group, const RoutingShape& shape, const ScheduleOptions& options)
    : group_(group), shape_(shape), options_(options) {
  shape_.validate();
  options_.validate(shape_);
  if (group.size() != shape.ep_size)
    throw std::invalid_argument("ScheduleWorkspace: peer group has " + std::to_string(group.size()) +
                                " ranks, RoutingShape.ep_size is " + std::to_string(shape.ep_size));
  capacity_rows_ = resolved_capacity_rows(shape_, options_);
  // The count kernel's histogram holds one int32 per local expert. Checked before the collective allocation
  // below: a throw after it would leak its NCCL windows.
  const int histogram_bytes = shape_.local_experts() * int(sizeof(int32_t));
  for (int r : group.local_ranks())
    if (histogram_bytes > detail::device_limits(group.device(r)).max_shared_bytes)
      throw std::invalid_argument("ScheduleWorkspace: " + std::to_string(shape_.local_experts()) +
                                  " local experts exceed the shared-memory histogram limit");
  gather_ = group.allocate(schedule::GatherLayout::bytes(shape_.ep_size, shape_.routes_per_rank()));

  detail::BufferLayout layout;
  const detail::BufferSlot status = layout.add_array<DeviceStatus>("status", 1);
  const detail::BufferSlot epoch = layout.add_array<uint64_t>("epoch", 1);
  const detail::BufferSlot schedule = layout.add_array<int32_t>("schedule", schedule_elements());
  ranks_.resize(shape_.ep_size);
  for (int r : group.local_ranks()) {
    RankState& state = ranks_[r];
    state.device = group.device(r);
    state.num_sms = detail::device_limits(state.device).num_sms;
    state.allocation = DeviceBuffer(state.device, layout.total_bytes());
    DeviceGuard guard(state.device);
    MOK_CHECK_CUDA(cudaMemset(state.allocation.get(), 0, layout.total_bytes()));
    state.status = status.in<DeviceStatus>(state.allocation.get());
    state.epoch = epoch.in<uint64_t>(state.allocation.get());
    state.schedule = schedule.in<int32_t>(state.allocation.get());
    const DeviceStatus initial = initial_device_status();
    MOK_CHECK_CUDA(cudaMemcpy(state.status, &initial, sizeof(initial), cudaMemcpyHostToDevice));
    if (histogram_bytes > 48 * 1024)  // past the default dynamic shared memory
      detail::prepare_kernel(reinterpret_cast<const void*>(schedule::count_chunks_kernel), histogram_bytes,
                             state.device, "count_chunks_kernel");
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
  }
}

ScheduleWorkspace::~ScheduleWorkspace() = default;

// The collective is reached whatever fails before it (the peers wait in it); the first error is thrown after.
void ScheduleWorkspace::close() {
  if (closed_) return;
  closed_ = true;
  std::vector<int> devices;
  for (int r : group_.local_ranks()) devices.push_back(ranks_[r].device);
  const std::string error = detail::synchronize_devices(devices);  // the buffers must be idle before they go
  for (RankState& state : ranks_) state.allocation.reset();
  gather_.close();
  if (!error.empty()) throw std::runtime_error("ScheduleWorkspace::close: " + error);
}

namespace {

schedule::ScheduleParams make_params(const RoutingShape& shape, const ScheduleOptions& options, int64_t capacity,
                                     int rank, int32_t* schedule_base, void* gather_base, uint64_t* epoch,
                                     DeviceStatus* status) {
  schedule::ScheduleParams p{};
  p.rank = rank;
  p.ep_size = shape.ep_size;
  p.num_tokens = shape.num_tokens;
  p.top_k = shape.top_k;
  p.num_experts = shape.num_experts;
  p.local_experts = shape.local_experts();
  p.tile_m = options.tile_m;
  p.routes_per_rank = shape.routes_per_rank();
  p.timeout_ns = static_cast<uint64_t>(options.wait_timeout_s * 1e9);
  p.layout = schedule::ScheduleLayout::make(shape.ep_size, shape.local_experts(), shape.routes_per_rank(), capacity);
  p.schedule = schedule_base;
  p.gather_base = gather_base;
  p.epoch = epoch;
  p.status = status;
  return p;
}

}  // namespace

const ScheduleWorkspace::RankState& ScheduleWorkspace::local_state(int rank, const char* caller) const {
  if (closed_) throw std::logic_error(std::string("ScheduleWorkspace::") + caller + ": closed (close() was called)");
  if (!group_.is_local(rank))
    throw std::invalid_argument(std::string(caller) + ": rank " + std::to_string(rank) + " is not a local rank of the group");
  return ranks_[rank];
}

void ScheduleWorkspace::gather_topk(int rank, const void* topk, IndexType index_type, cudaStream_t stream,
                                    int tokens) {
  const RankState& state = local_state(rank, "gather_topk");
  if (tokens == -1) tokens = shape_.num_tokens;
  if (tokens < 0 || tokens > shape_.num_tokens)
    throw std::invalid_argument("gather_topk: tokens = " + std::to_string(tokens) + " outside [0, " +
                                std::to_string(shape_.num_tokens) + "]");
  if (topk == nullptr && tokens > 0) throw std::invalid_argument("gather_topk: topk is null");
  const int64_t valid_routes = int64_t(tokens) * shape_.top_k;
  DeviceGuard guard(state.device);
  const auto p = make_params(shape_, options_, capacity_rows_, rank, state.schedule, gather_.on(rank), state.epoch,
                             state.status);
  const int ctas = schedule::gather_ctas(shape_.routes_per_rank());
  constexpr int kThreads = schedule::GatherTraits::kThreads;
  switch (index_type) {
    case IndexType::kInt32:
      schedule::gather_topk_kernel<<<ctas, kThreads, 0, stream>>>(static_cast<const int32_t*>(topk), valid_routes,
                                                                  gather_.peers(rank), p);
      break;
    case IndexType::kInt64:
      schedule::gather_topk_kernel<<<ctas, kThreads, 0, stream>>>(static_cast<const int64_t*>(topk), valid_routes,
                                                                  gather_.peers(rank), p);
      break;
    default:
      throw std::invalid_argument("gather_topk: index_type must be kInt32 or kInt64");
  }
  MOK_CHECK_CUDA(cudaGetLastError());
}

void ScheduleWorkspace::build(int rank, cudaStream_t stream, int32_t* schedule) {
  const RankState& state = local_state(rank, "build");
  DeviceGuard guard(state.device);
  const auto p = make_params(shape_, options_, capacity_rows_, rank, schedule != nullptr ? schedule : state.schedule,
                             gather_.on(rank), state.epoch, state.status);
  const dim3 count_grid(static_cast<unsigned>(p.layout.num_chunks), static_cast<unsigned>(shape_.ep_size));
  const size_t histogram_bytes = size_t(shape_.local_experts()) * sizeof(int32_t);
  schedule::count_chunks_kernel<<<count_grid, 32, histogram_bytes, stream>>>(p);
  MOK_CHECK_CUDA(cudaGetLastError());

  schedule::scan_experts_kernel<<<1, schedule::ScanTraits::kThreads, 0, stream>>>(p);
  MOK_CHECK_CUDA(cudaGetLastError());

  constexpr int kThreads = schedule::PlaceTraits::kThreads;
  const int64_t work = std::max(shape_.total_routes(), capacity_rows_);
  const int64_t ctas = std::min<int64_t>((work + kThreads - 1) / kThreads, int64_t(state.num_sms) * 8);
  schedule::place_routes_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(p);
  MOK_CHECK_CUDA(cudaGetLastError());
}

void ScheduleWorkspace::reset_status(int rank, cudaStream_t stream) {
  const RankState& state = local_state(rank, "reset_status");
  DeviceGuard guard(state.device);
  // A kernel, not a copy from host memory: capturable into a CUDA graph like the rest of a step.
  reset_rank_kernel<<<1, 1, 0, stream>>>(state.status, initial_device_status(), state.epoch,
                                         schedule::GatherLayout::topk_arrived(gather_.on(rank)), shape_.ep_size);
  MOK_CHECK_CUDA(cudaGetLastError());
}

int64_t ScheduleWorkspace::schedule_elements() const {
  return schedule::ScheduleLayout::make(shape_.ep_size, shape_.local_experts(), shape_.routes_per_rank(),
                                        capacity_rows_)
      .total_elements;
}

DeviceStatus* ScheduleWorkspace::device_status(int rank) const { return local_state(rank, "device_status").status; }

ScheduleView ScheduleWorkspace::view(int rank, const int32_t* schedule) const {
  const int32_t* base = schedule != nullptr ? schedule : local_state(rank, "view").schedule;
  const auto l = schedule::ScheduleLayout::make(shape_.ep_size, shape_.local_experts(), shape_.routes_per_rank(),
                                                capacity_rows_);
  ScheduleView v;
  v.expert_counts = base + l.expert_counts;
  v.expert_src_counts = base + l.expert_src_counts;
  v.expert_row_offsets = base + l.expert_row_offsets;
  v.row_route = base + l.row_route;
  v.route_row = base + l.route_row;
  v.own_ids = base + l.own_ids;
  v.scheduled_rows = base + l.scheduled_rows;
  v.capacity_rows = capacity_rows_;
  return v;
}

StatusReport ScheduleWorkspace::read_status(int rank, cudaStream_t stream) const {
  const RankState& state = local_state(rank, "read_status");
  DeviceGuard guard(state.device);
  StatusReport report;
  MOK_CHECK_CUDA(cudaMemcpyAsync(&report.raw, state.status, sizeof(DeviceStatus), cudaMemcpyDeviceToHost, stream));
  MOK_CHECK_CUDA(cudaStreamSynchronize(stream));
  return report;
}

HostSchedule ScheduleWorkspace::download(int rank, cudaStream_t stream, const int32_t* schedule) const {
  const ScheduleView v = view(rank, schedule);
  DeviceGuard guard(local_state(rank, "download").device);
  const int local_experts = shape_.local_experts();
  HostSchedule out;
  out.expert_counts.resize(local_experts);
  out.expert_src_counts.resize(size_t(local_experts) * shape_.ep_size);
  out.expert_row_offsets.resize(local_experts + 1);
  out.row_route.resize(capacity_rows_);
  out.route_row.resize(size_t(shape_.ep_size) * shape_.routes_per_rank());
  out.own_ids.resize(shape_.routes_per_rank());
  auto copy = [stream](auto& dst, const int32_t* src) {
    MOK_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src, dst.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  };
  copy(out.expert_counts, v.expert_counts);
  copy(out.expert_src_counts, v.expert_src_counts);
  copy(out.expert_row_offsets, v.expert_row_offsets);
  copy(out.row_route, v.row_route);
  copy(out.route_row, v.route_row);
  copy(out.own_ids, v.own_ids);
  MOK_CHECK_CUDA(cudaMemcpyAsync(&out.scheduled_rows, v.scheduled_rows, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  out.status = read_status(rank, stream);  // synchronizes the stream
  return out;
}

}  // namespace mok
