// MoeWorkspace: buffers and launches of the unfused forward (include/mok/moe.h). The stage kernels live in
// src/device/{dispatch,combine,common}; the GEMMs go through mok::expert_gemm. The backward and
// recompute_forward_context are in src/host/moe_backward.cu; the state both share in src/host/moe_state.h.
#include "mok/moe.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mok/expert_gemm.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/common/peer_barrier.cuh"
#include "src/device/kernels/row_kernels.cuh"
#include "src/device/megakernel/timeline_record.h"
#include "src/device/schedule/placement.h"
#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "src/host/moe_args.h"
#include "src/host/moe_fused.h"
#include "src/host/moe_fused_backward.h"
#include "src/host/moe_state.h"
#include "src/host/teardown.h"
#include "src/host/option_table.h"
#include "src/host/quantize_fp8.h"

namespace mok {
using detail::DeviceGuard;
using detail::kBf16Bytes;
using detail::require;
using detail::row_kernel_ctas;

namespace {

// The megakernels' persistent grid on the local ranks' devices (0 on the unfused path; the same GPU model on
// every rank): one grid for both megakernels (the timeline is sized by it). A backward cluster pair implies a
// forward one (its GEMMs' output tiles pair up only if the forward's do), so a multiple of the forward's
// cluster fits both. Also checks MoeOptions.fused.comm_ctas against it. Device queries only (it prepares the
// kernels on each device), nothing allocated.
int fused_grid(const PeerGroup& group, const MoeShape& shape, const MoeOptions& options) {
  if (options.path != ForwardPath::kFused) return 0;
  const bool fp8 = options.precision == Precision::kFP8;
  const int cluster_n = detail::fused_cluster_n(shape.hidden, shape.intermediate, options.precision);
  int grid = 0;
  for (int r : group.local_ranks()) {
    const int device = group.device(r);
    DeviceGuard guard(device);
    int ctas = fp8 ? detail::fused_fp8_grid_ctas(shape, detail::context_keeps_gate_up(options), device)
                   : detail::fused_grid_ctas(shape, options.keep_gate_up, device);
    if (options.fused.backward_megakernel)  // plan_workspace: only with the backward
      ctas = std::min(ctas, detail::fused_backward_grid_ctas(shape, options.precision, device)) / cluster_n *
             cluster_n;
    grid = grid == 0 ? ctas : std::min(grid, ctas);
  }
  const int comm_ctas = options.fused.comm_ctas;
  require(comm_ctas % cluster_n == 0 && comm_ctas <= grid - cluster_n,
          "MoeOptions.fused.comm_ctas must be a multiple of " + std::to_string(cluster_n) +
              " (CTAs per cluster for this shape) leaving at least one compute cluster of the " + std::to_string(grid) +
              " CTAs, got " + std::to_string(comm_ctas));
  return grid;
}

// Every rank must build the same workspace, and no rank may leave the others waiting in a collective. Before the
// first collective allocation each rank checks its shape and options (detail::plan_workspace) and its devices'
// grid (fused_grid); whether that passed and the agreed rows of the option table (src/host/option_table.h) are
// all-gathered over the group (PeerGroup::all_gather, a collective for NCCL groups). So a rank that rejects its
// arguments (its own error rethrown) or disagrees with a peer makes every rank throw, naming the field, with
// nothing allocated. Returns the grid; the plan's padded tokens and ring rows go to `padded_tokens`, `ring_rows`.
int agreed_grid(const PeerGroup& group, const MoeShape& shape, const MoeOptions& options, int64_t& padded_tokens,
                int64_t& ring_rows) {
  std::exception_ptr failure;
  int grid = 0;
  try {
    const detail::WorkspacePlan plan = detail::plan_workspace(shape, options);  // also the options no rank compares
    padded_tokens = plan.padded_tokens;
    ring_rows = plan.ring_rows;
    grid = fused_grid(group, shape, options);
  } catch (...) {
    failure = std::current_exception();
  }
  const detail::LayerOptions layer{shape, options};
  std::vector<int64_t> mine = {failure ? 0 : 1};  // "validation", then the agreed options
  const std::vector<int64_t> words = detail::agreement_words(layer);
  mine.insert(mine.end(), words.begin(), words.end());
  // Bounded by the option once the plan has checked it (a rank that rejected its arguments waits the default).
  const std::vector<int64_t> all = group.all_gather(mine, failure ? kDefaultSetupTimeoutS : options.setup_timeout_s);
  if (failure) std::rethrow_exception(failure);
  std::vector<int64_t> options_of_all;
  for (int r = 0; r < group.size(); ++r) {
    const int64_t* theirs = all.data() + r * mine.size();
    require(theirs[0] == 1, "MoeWorkspace: rank " + std::to_string(r) +
                                " rejected its MoeShape or MoeOptions (its own error names the field); every rank "
                                "must build the same workspace");
    options_of_all.insert(options_of_all.end(), theirs + 1, theirs + mine.size());
  }
  detail::check_agreement(options_of_all, group.size(), layer);
  return grid;
}

}  // namespace

ForwardContext::ForwardContext(ForwardContext&& other) noexcept { *this = std::move(other); }

ForwardContext& ForwardContext::operator=(ForwardContext&& other) noexcept {
  if (this != &other) {
    owner_ = std::exchange(other.owner_, 0);
    rank_ = std::exchange(other.rank_, -1);
    allocation_ = std::move(other.allocation_);
    num_tokens_ = std::exchange(other.num_tokens_, -1);
    layer_written_ = std::exchange(other.layer_written_, false);
    schedule_buffer_ = other.schedule_buffer_;
    schedule_ = other.schedule_;
    ring_rows_ = other.ring_rows_;
    expert_rows_ = other.expert_rows_;
    hidden_ = other.hidden_;
    shared_hidden_ = other.shared_hidden_;
    gate_up_ = other.gate_up_;
    shared_gate_up_ = other.shared_gate_up_;
    expert_row_scales_ = other.expert_row_scales_;
    hidden_fp8_ = other.hidden_fp8_;
    hidden_scales_ = other.hidden_scales_;
    shared_hidden_fp8_ = other.shared_hidden_fp8_;
    shared_hidden_scales_ = other.shared_hidden_scales_;
  }
  return *this;
}

MoeWorkspace::MoeWorkspace(const PeerGroup& group, const MoeShape& shape, const MoeOptions& options)
    : group_(group),
      shape_(shape),
      options_(options),
      // Every check before schedule_'s collective allocation; padded_tokens_ and ring_rows_ (declared before
      // grid_ctas_, so already initialized) receive the plan's.
      grid_ctas_(agreed_grid(group_, shape_, options_, padded_tokens_, ring_rows_)),
      schedule_(group_, shape.routing(), options.schedule) {
  static std::atomic<uint64_t> workspaces{0};
  id_ = ++workspaces;
  const FusedOptions& fused = options_.fused;
  const int64_t h = shape_.hidden;
  if (!reads_token_rows_in_place()) x_ = group_.allocate(padded_tokens_ * h * kBf16Bytes);
  combined_ = group_.allocate(int64_t(shape_.num_tokens) * shape_.top_k * h * kBf16Bytes);
  flags_ = group_.allocate(device::BarrierLayout::bytes());

  ranks_ = std::make_unique<RankState[]>(shape_.ep_size);
  for (int r : group_.local_ranks()) {
    RankState& s = ranks_[r];
    s.device = group_.device(r);
    DeviceGuard guard(s.device);
    MOK_CHECK_CUDA(cudaDeviceGetAttribute(&s.num_sms, cudaDevAttrMultiProcessorCount, s.device));
    const int64_t counter_words = detail::fused_counter_words(capacity_rows() / 64, padded_tokens_ / 64);
    const int64_t timeline_words =
        fused.timeline_records > 0 ? detail::fused_timeline_words(grid_ctas_, fused.timeline_records) : 0;
    const detail::RankScratchLayout layout =
        detail::rank_scratch_layout(shape_, ring_rows_, padded_tokens_, counter_words, timeline_words, fp8());
    s.allocation = DeviceBuffer(s.device, layout.buffers.total_bytes());
    void* base = s.allocation.get();
    s.y = layout.y.in(base);
    s.shared_out = layout.shared_out.in(base);
    s.tickets = layout.tickets.in<int32_t>(base);
    s.shared_schedule = layout.shared_schedule.in<detail::SharedSchedule>(base);
    s.fused_counters = layout.fused_counters.in<uint64_t>(base);
    s.timeline = layout.timeline.in<uint64_t>(base);
    s.x_scales = layout.x_scales.in<float>(base);
    const detail::SharedSchedule shared{{shape_.num_tokens},
                                        {0, static_cast<int32_t>(padded_tokens_)},
                                        {static_cast<int32_t>(padded_tokens_)}};
    MOK_CHECK_CUDA(cudaMemcpy(s.shared_schedule, &shared, sizeof(shared), cudaMemcpyHostToDevice));
    if (options_.scatter_rows) {  // every rank's combine buffer [T * k, H] as this rank addresses it
      std::vector<std::byte> maps(size_t(shape_.ep_size) * kRowScatterMapBytes);
      encode_row_scatter_maps(combined_.peers(r), shape_.ep_size, int64_t(shape_.num_tokens) * shape_.top_k,
                              static_cast<int>(shape_.hidden), maps.data());
      s.scatter_maps = DeviceBuffer(s.device, maps.size());
      MOK_CHECK_CUDA(cudaMemcpy(s.scatter_maps.get(), maps.data(), maps.size(), cudaMemcpyHostToDevice));
    }
    s.call_done = detail::CudaEvent(s.device);
  }
  if (options_.backward) allocate_backward();
  // The constructor synchronizes its devices (docs/design.md, "No host synchronization in a step": setup may). A
  // cudaMemcpy from pageable memory returns once its bytes are staged, before they land, and a cudaMemset is
  // asynchronous; both run on the legacy stream, which a non-blocking stream's first forward does not wait for.
  for (int r : group_.local_ranks()) {
    DeviceGuard guard(ranks_[r].device);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
  }
}

// Never a collective (docs/design.md, "Lifetimes"): the members free the local buffers; NCCL windows that
// close() did not release are leaked, with one warning.
MoeWorkspace::~MoeWorkspace() {
  if (!needs_close()) return;
  std::fprintf(stderr,
               "mok: MoeWorkspace destroyed without close(): its NCCL windows are leaked, not deregistered "
               "(deregistration is collective)\n");
  schedule_.leak_windows();
  for (SymmetricAllocation* a : {&x_, &combined_, &flags_, &d_out_, &rw_, &d_rw_}) a->leak_windows();
}

bool MoeWorkspace::needs_close() const {
  if (schedule_.needs_close()) return true;
  for (const SymmetricAllocation* a : {&x_, &combined_, &flags_, &d_out_, &rw_, &d_rw_})
    if (a->needs_close()) return true;
  return false;
}

// Every step is reached on every rank whatever fails before it (the peers wait in each collective); the
// first error is thrown at the end.
void MoeWorkspace::close() {
  if (closed_) return;
  closed_ = true;
  std::vector<int> devices;
  for (int r : group_.local_ranks()) devices.push_back(ranks_[r].device);
  std::string error = detail::synchronize_devices(devices);  // nothing may still read the buffers
  for (int r : group_.local_ranks()) {
    RankState& s = ranks_[r];
    s.call_done.reset();
    s.allocation.reset();
    s.backward.allocation.reset();
  }
  // The collective part, in the same order on every process: the schedule's gather buffers, then the
  // workspace's symmetric buffers in the order the constructor made them.
  auto step = [&error](auto&& close_one) {
    try {
      close_one();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  };
  step([this] { schedule_.close(); });
  for (SymmetricAllocation* a : {&x_, &combined_, &flags_, &d_out_, &rw_, &d_rw_}) step([a] { a->close(); });
  if (!error.empty()) throw std::runtime_error("MoeWorkspace::close: " + error);
}

void MoeWorkspace::require_open(const char* call) const {
  if (closed_)
    throw std::logic_error(std::string("MoeWorkspace::") + call +
                           ": the workspace is closed (close() was called); make a new workspace");
}

const MoeWorkspace::RankState& MoeWorkspace::state(int rank) const {
  require(group_.is_local(rank), "rank " + std::to_string(rank) + " is not a local rank of the workspace's group");
  return ranks_[rank];
}

bool MoeWorkspace::context_keeps_gate_up() const { return detail::context_keeps_gate_up(options_); }

int64_t MoeWorkspace::pulled_row_bytes() const {
  return fp8() ? detail::fp8_row_bytes(shape_.hidden) : 2 * int64_t(shape_.hidden);
}

WaitBound MoeWorkspace::wait_bound(int rank) const {
  return {schedule_.device_status(rank), options_.schedule.wait_timeout_s, rank};
}

// Stream-ordered (no host synchronization): the zero fill is a call of the workspace on `stream`, so a later
// call on another stream waits for it (begin_call / end_call).
ForwardContext MoeWorkspace::make_context(int rank, cudaStream_t stream) const {
  require_open("make_context");
  const RankState& s = state(rank);
  const detail::ContextLayout layout = detail::context_layout(
      shape_, context_keeps_gate_up(), schedule_.schedule_elements(), ring_rows_, padded_tokens_, fp8());
  ForwardContext ctx;
  ctx.allocation_ = DeviceBuffer(s.device, layout.buffers.total_bytes());
  ctx.owner_ = id_;
  ctx.rank_ = rank;
  ctx.ring_rows_ = ring_rows_;
  void* base = ctx.allocation_.get();
  ctx.schedule_buffer_ = layout.schedule.in<int32_t>(base);
  ctx.expert_rows_ = layout.expert_rows.in(base);
  ctx.hidden_ = layout.hidden.in(base);
  ctx.shared_hidden_ = layout.shared_hidden.in(base);
  ctx.gate_up_ = layout.gate_up.in(base);
  ctx.shared_gate_up_ = layout.shared_gate_up.in(base);
  ctx.expert_row_scales_ = layout.expert_row_scales.in<float>(base);
  ctx.hidden_fp8_ = layout.hidden_fp8.in(base);
  ctx.hidden_scales_ = layout.hidden_scales.in<float>(base);
  ctx.shared_hidden_fp8_ = layout.shared_hidden_fp8.in(base);
  ctx.shared_hidden_scales_ = layout.shared_hidden_scales.in<float>(base);
  ctx.schedule_ = schedule_.view(rank, ctx.schedule_buffer_);
  begin_call(rank, stream);
  DeviceGuard guard(s.device);
  // Zero once: padding rows of the shared expert's hidden tile and rows no schedule has written yet.
  MOK_CHECK_CUDA(cudaMemsetAsync(base, 0, ctx.allocation_.bytes(), stream));
  end_call(rank, stream);
  return ctx;
}

void MoeWorkspace::validate(const RankForward& f, bool needs_layer_inputs) const {
  const std::string where = "rank " + std::to_string(f.rank) + ": ";
  try {
    const RankState& s = state(f.rank);
    require(f.context != nullptr && f.context->owner_ == id_ && f.context->rank() == f.rank,
            "context: must be a ForwardContext made by this workspace's make_context(" + std::to_string(f.rank) + ")");
    detail::check_routing_inputs(f, shape_, s.device);
    if (needs_layer_inputs) detail::check_layer_inputs(f, shape_, s.device, options_.precision);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("MoeWorkspace: " + where + e.what());
  }
}

// Every public call validates all its arguments before it issues anything: a rejected call leaves no
// half-issued step behind (a lone rank's schedule would wait for peers that never come).
void MoeWorkspace::build_schedule(std::span<const RankForward> ranks) { issue_call(ranks, true, false); }

void MoeWorkspace::forward_with_schedule(std::span<const RankForward> ranks) { issue_call(ranks, false, true); }

void MoeWorkspace::forward(std::span<const RankForward> ranks) { issue_call(ranks, true, true); }

void MoeWorkspace::issue_call(std::span<const RankForward> ranks, bool schedule, bool layer) {
  const char* call = !layer ? "build_schedule" : schedule ? "forward" : "forward_with_schedule";
  require_open(call);
  detail::require_distinct_ranks(ranks, std::string("MoeWorkspace::") + call);
  for (const RankForward& f : ranks) validate(f, layer);
  if (!schedule) {  // the layer on a schedule built before: of the same tokens
    for (const RankForward& f : ranks)
      require(f.context->num_tokens_ == f.topk_idx.shape[0],
              "MoeWorkspace: rank " + std::to_string(f.rank) + ": topk_idx: " + std::to_string(f.topk_idx.shape[0]) +
                  " tokens, but the context's schedule was built for " + std::to_string(f.context->num_tokens_) +
                  " (build_schedule with this call's topk_idx first)");
  }
  for (const RankForward& f : ranks) begin_call(f.rank, f.stream);
  if (schedule) issue_schedule(ranks);
  if (layer) issue_layer(ranks, !schedule);
  for (const RankForward& f : ranks) end_call(f.rank, f.stream);
}

namespace {

// Whether `stream` is being captured into a CUDA graph. An error (e.g. the legacy stream queried during
// another stream's global-mode capture) counts as capturing: then the workspace adds no event work.
bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

namespace {

device::BarrierParams barrier_params(const SymmetricAllocation& flags, int rank, int ep_size, DeviceStatus* status,
                                     double timeout_s) {
  return {flags.peers(rank), rank, ep_size, status, static_cast<uint64_t>(timeout_s * 1e9)};
}

}  // namespace

void MoeWorkspace::barrier_arrive(int rank, cudaStream_t stream) const {
  DeviceGuard guard(state(rank).device);
  device::barrier_arrive_kernel<<<1, 32, 0, stream>>>(barrier_params(
      flags_, rank, shape_.ep_size, schedule_.device_status(rank), options_.schedule.wait_timeout_s));
  MOK_CHECK_CUDA(cudaGetLastError());
}

void MoeWorkspace::barrier_wait(int rank, cudaStream_t stream) const {
  DeviceGuard guard(state(rank).device);
  device::barrier_wait_kernel<<<1, 32, 0, stream>>>(barrier_params(
      flags_, rank, shape_.ep_size, schedule_.device_status(rank), options_.schedule.wait_timeout_s));
  MOK_CHECK_CUDA(cudaGetLastError());
}

PeerPointers MoeWorkspace::token_rows(const SymmetricAllocation& buffer, int rank, const void* call_rows) const {
  if (!reads_token_rows_in_place()) return buffer.peers(rank);
  PeerPointers in_place{};
  in_place.base[rank] = const_cast<void*>(call_rows);  // read only
  return in_place;
}

void MoeWorkspace::publish_token_rows(void* dst, const void* src, int64_t tokens, cudaStream_t stream) const {
  const int64_t row_bytes = int64_t(shape_.hidden) * kBf16Bytes;
  if (tokens > 0) MOK_CHECK_CUDA(cudaMemcpyAsync(dst, src, tokens * row_bytes, cudaMemcpyDeviceToDevice, stream));
  MOK_CHECK_CUDA(cudaMemsetAsync(static_cast<char*>(dst) + tokens * row_bytes, 0, (padded_tokens_ - tokens) * row_bytes,
                                 stream));
}

void MoeWorkspace::pull_rows(const RankForward& f, int64_t row_limit) const {
  const RankState& s = state(f.rank);
  DeviceGuard guard(s.device);
  const ScheduleView& v = f.context->schedule_;
  const kernels::PullParams pull{.x = token_rows(x_, f.rank, f.x.data),
                                 .dst = static_cast<uint4*>(f.context->expert_rows_),
                                 .row_route = v.row_route,
                                 .scheduled_rows = v.scheduled_rows,
                                 .row_limit = row_limit,
                                 .num_tokens = shape_.num_tokens,
                                 .top_k = shape_.top_k,
                                 .row_vectors = static_cast<int>(shape_.hidden * kBf16Bytes / 16),
                                 .copy_vectors = static_cast<int>(pulled_row_bytes() / 16)};
  kernels::pull_rows_kernel<<<row_kernel_ctas(row_limit, kernels::PullTraits::kWarps, s.num_sms),
                               kernels::PullTraits::kThreads, 0, f.stream>>>(pull);
  MOK_CHECK_CUDA(cudaGetLastError());
}

// Cross-stream order of the workspace's calls (include/mok/moe.h, "Streams"): outside a capture, a call
// on a stream other than the rank's previous call's waits (on the GPU) for that call's event.
void MoeWorkspace::begin_call(int rank, cudaStream_t stream) const {
  const RankState& s = state(rank);
  if (!s.has_call || s.call_stream == stream || is_capturing(stream)) return;
  DeviceGuard guard(s.device);
  MOK_CHECK_CUDA(cudaStreamWaitEvent(stream, s.call_done.get(), 0));
}

void MoeWorkspace::end_call(int rank, cudaStream_t stream) const {
  const RankState& s = state(rank);
  if (is_capturing(stream)) return;
  DeviceGuard guard(s.device);
  MOK_CHECK_CUDA(cudaEventRecord(s.call_done.get(), stream));
  s.call_stream = stream;
  s.has_call = true;
}

void MoeWorkspace::reset_status(int rank, cudaStream_t stream) {
  require_open("reset_status");
  const RankState& s = state(rank);
  begin_call(rank, stream);
  schedule_.reset_status(rank, stream);
  // A timed-out barrier leaves this rank's counters out of step with its peers' (it passed without their
  // arrivals): every rank starts again from zero.
  DeviceGuard guard(s.device);
  MOK_CHECK_CUDA(cudaMemsetAsync(flags_.on(rank), 0, device::BarrierLayout::bytes(), stream));
  end_call(rank, stream);
}

void MoeWorkspace::issue_schedule(std::span<const RankForward> ranks) {
  for (const RankForward& f : ranks) {
    const IndexType index = f.topk_idx.dtype == DType::kInt64 ? IndexType::kInt64 : IndexType::kInt32;
    schedule_.gather_topk(f.rank, f.topk_idx.data, index, f.stream, static_cast<int>(f.topk_idx.shape[0]));
  }
  for (const RankForward& f : ranks) {
    schedule_.build(f.rank, f.stream, f.context->schedule_buffer_);
    f.context->num_tokens_ = static_cast<int>(f.topk_idx.shape[0]);
    f.context->layer_written_ = false;  // until a forward or recompute_forward_context fills it
  }
}

void MoeWorkspace::issue_layer(std::span<const RankForward> ranks, bool check_ids) {
  for (const RankForward& f : ranks) publish(f);
  for (const RankForward& f : ranks) {
    if (options_.path == ForwardPath::kFused)
      compute_fused(f);
    else
      compute(f);
  }
  for (const RankForward& f : ranks) combine(f, check_ids);
  for (const RankForward& f : ranks) f.context->layer_written_ = true;
}

StatusReport MoeWorkspace::read_status(int rank, cudaStream_t stream) const {
  require_open("read_status");
  begin_call(rank, stream);
  return schedule_.read_status(rank, stream);
}

std::vector<TaskRecord> MoeWorkspace::read_timeline(int rank, cudaStream_t stream) const {
  require_open("read_timeline");
  const RankState& s = state(rank);
  require(s.timeline != nullptr, "read_timeline: the workspace records no timeline (MoeOptions.fused.timeline_records "
                                 "is 0, or the path is unfused)");
  DeviceGuard guard(s.device);
  const int capacity = options_.fused.timeline_records;
  std::vector<uint64_t> words(megakernel::timeline_words(grid_ctas_, capacity));
  MOK_CHECK_CUDA(cudaMemcpyAsync(words.data(), s.timeline, words.size() * 8, cudaMemcpyDeviceToHost, stream));
  MOK_CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<TaskRecord> records;
  for (int cta = 0; cta < grid_ctas_; ++cta) {
    for (int track = 0; track < megakernel::kTimelineTracks; ++track) {
      const uint64_t* base = words.data() + megakernel::timeline_block_offset(cta, track, capacity);
      const int64_t count = std::min<int64_t>(static_cast<int64_t>(base[0]), capacity);
      for (int64_t i = 0; i < count; ++i)
        records.push_back(megakernel::decode_task_record(base + megakernel::timeline_record_offset(i)));
    }
  }
  return records;
}

namespace {

// gate/up GEMM with the SwiGLU epilogue into `hidden`, then the down GEMM into `out`, over the rows of a
// schedule (the routed experts' or the shared expert's one-expert schedule).
struct MlpGemms {  // the two GEMM launches of an MLP over the rows of a schedule
  const void* rows;
  int64_t rows_allocated;
  const void* gate;
  const void* up;
  const void* down;
  int local_experts;
  const int32_t* expert_counts;
  const int32_t* expert_row_offsets;
  const int32_t* scheduled_rows;
  void* hidden;
  void* gate_up;     // optional: the raw g | u of every row (MoeOptions::keep_gate_up)
  void* out;
  int32_t* tickets;  // two: gate/up, down
  WaitBound waits;   // the rank's status word and timeout
  // MoeOptions::precision kFP8 only: rows are FP8 rows (src/host/quantize_fp8.h), row_bytes apart, with these A
  // scales; the weights' block scales; h written quantized by the gate/up GEMM into hidden_fp8 / hidden_scales
  // (hidden: the bf16 h beside g | u, with gate_up only).
  int64_t row_bytes = 0;
  const float* row_scales = nullptr;
  const float* gate_scales = nullptr;
  const float* up_scales = nullptr;
  const float* down_scales = nullptr;
  void* hidden_fp8 = nullptr;
  float* hidden_scales = nullptr;
};

// The two GEMMs of an MLP: gate/up with the SwiGLU epilogue, then down (tickets: m.tickets[0], [1]).
void mlp_args(const MoeShape& shape, const MoeOptions& options, const MlpGemms& m, ExpertGemmArgs& gate_up,
              ExpertGemmArgs& down) {
  gate_up = ExpertGemmArgs{};
  gate_up.epilogue = GemmEpilogue::kSwiGLU;
  gate_up.a = m.rows;
  gate_up.a_rows = m.rows_allocated;
  gate_up.k = shape.hidden;
  gate_up.b = m.gate;
  gate_up.b_up = m.up;  // null: gate is fused [E, 2I, H]
  gate_up.n = shape.intermediate;
  gate_up.local_experts = m.local_experts;
  gate_up.expert_counts = m.expert_counts;
  gate_up.expert_row_offsets = m.expert_row_offsets;
  gate_up.scheduled_rows = m.scheduled_rows;
  gate_up.tile_m = options.schedule.tile_m;
  gate_up.swiglu_limit = shape.swiglu_limit;
  gate_up.out = m.hidden;
  gate_up.gate_up_out = m.gate_up;
  gate_up.ticket = m.tickets;
  gate_up.waits = m.waits;

  down = gate_up;
  down.epilogue = GemmEpilogue::kStore;
  down.a = m.hidden;
  down.k = shape.intermediate;
  down.b = m.down;
  down.b_up = nullptr;
  down.n = shape.hidden;
  down.swiglu_limit = 0;
  down.out = m.out;
  down.gate_up_out = nullptr;
  down.ticket = m.tickets + 1;
  if (options.precision == Precision::kFP8) {
    gate_up.precision = down.precision = Precision::kFP8;
    gate_up.a_row_stride = m.row_bytes;
    gate_up.a_scales = m.row_scales;
    gate_up.b_scales = m.gate_scales;
    gate_up.b_up_scales = m.up != nullptr ? m.up_scales : nullptr;
    gate_up.out = m.hidden_fp8;  // h quantized per 1 x 128 by the SwiGLU epilogue: the down GEMM's A
    gate_up.out_scales = m.hidden_scales;
    gate_up.out_scales_power_of_two = options.fp8_power_of_two_scales;
    gate_up.hidden_out = m.gate_up != nullptr ? m.hidden : nullptr;  // a training context's bf16 h beside g | u
    down.a = m.hidden_fp8;
    down.a_scales = m.hidden_scales;
    down.b_scales = m.down_scales;
  }
}

// The two GEMMs of an MLP (mlp_args').
void run_mlp(const ExpertGemmArgs& gate_up, const ExpertGemmArgs& down, cudaStream_t stream) {
  expert_gemm(gate_up, stream);
  expert_gemm(down, stream);
}

}  // namespace

void MoeWorkspace::routed_gemms(const RankForward& f, ExpertGemmArgs& gate_up, ExpertGemmArgs& down) const {
  const RankState& s = state(f.rank);
  const ForwardContext& ctx = *f.context;
  const MoeWeights& w = *f.weights;
  mlp_args(shape_, options_,
           {.rows = ctx.expert_rows_,
            .rows_allocated = ring_rows_,
            .gate = w.expert_gate.data,
            .up = w.expert_up.data,  // null: gate and up fused in expert_gate
            .down = w.expert_down.data,
            .local_experts = shape_.local_experts(),
            .expert_counts = ctx.schedule_.expert_counts,
            .expert_row_offsets = ctx.schedule_.expert_row_offsets,
            .scheduled_rows = ctx.schedule_.scheduled_rows,
            .hidden = ctx.hidden_,
            .gate_up = ctx.gate_up_,
            .out = s.y,
            .tickets = s.tickets + detail::kExpertGateUp,
            .waits = wait_bound(f.rank),
            .row_bytes = pulled_row_bytes(),  // the context's packed rows
            .row_scales = ctx.expert_row_scales_,
            .gate_scales = static_cast<const float*>(w.expert_gate_scales.data),
            .up_scales = static_cast<const float*>(w.expert_up_scales.data),
            .down_scales = static_cast<const float*>(w.expert_down_scales.data),
            .hidden_fp8 = ctx.hidden_fp8_,
            .hidden_scales = ctx.hidden_scales_},
           gate_up, down);
}

void MoeWorkspace::shared_gemms(const RankForward& f, ExpertGemmArgs& gate_up, ExpertGemmArgs& down) const {
  const RankState& s = state(f.rank);
  const MoeWeights& w = *f.weights;
  mlp_args(shape_, options_,
           {.rows = x_.on(f.rank),
            .rows_allocated = padded_tokens_,
            .gate = w.shared_gate.data,
            .up = w.shared_up.data,
            .down = w.shared_down.data,
            .local_experts = 1,
            .expert_counts = s.shared_schedule->counts,
            .expert_row_offsets = s.shared_schedule->row_offsets,
            .scheduled_rows = s.shared_schedule->scheduled_rows,
            .hidden = f.context->shared_hidden_,
            .gate_up = f.context->shared_gate_up_,
            .out = s.shared_out,
            .tickets = s.tickets + detail::kSharedGateUp,
            .waits = wait_bound(f.rank),
            .row_bytes = 2 * int64_t(shape_.hidden),  // the symmetric x buffer's: an FP8 row in the bf16 row's bytes
            .row_scales = s.x_scales,
            .gate_scales = static_cast<const float*>(w.shared_gate_scales.data),
            .up_scales = static_cast<const float*>(w.shared_up_scales.data),
            .down_scales = static_cast<const float*>(w.shared_down_scales.data),
            .hidden_fp8 = f.context->shared_hidden_fp8_,
            .hidden_scales = f.context->shared_hidden_scales_},
           gate_up, down);
}

// x into the symmetric buffer (nothing where the kernels read it in place); FP8: the rank's rows quantized once,
// as every peer pulls them (src/host/quantize_fp8.h).
void MoeWorkspace::publish_x(const RankForward& f) {
  const RankState& s = state(f.rank);
  if (fp8())
    detail::publish_fp8_rows(f.x.data, f.x.shape[0], padded_tokens_, shape_.hidden, x_.on(f.rank), s.x_scales,
                             options_.fp8_power_of_two_scales, schedule_.device_status(f.rank), f.rank, f.stream);
  else if (!reads_token_rows_in_place())
    publish_token_rows(x_.on(f.rank), f.x.data, f.x.shape[0], f.stream);
}

// Phase 1: x into the symmetric buffer, "x is readable" to every peer, then the shared expert (local work
// that overlaps the peers catching up).
void MoeWorkspace::publish(const RankForward& f) {
  DeviceGuard guard(state(f.rank).device);
  publish_x(f);
  barrier_arrive(f.rank, f.stream);
  if (!shape_.shared_expert || options_.path == ForwardPath::kFused) return;  // the megakernel runs it
  ExpertGemmArgs gate_up, down;
  shared_gemms(f, gate_up, down);
  run_mlp(gate_up, down, f.stream);
}

// Phase 2: wait for every rank's x, pull the scheduled rows, the routed experts, push the outputs home,
// "your rows are written" to every peer.
void MoeWorkspace::compute(const RankForward& f) {
  const RankState& s = state(f.rank);
  DeviceGuard guard(s.device);
  const ScheduleView& v = f.context->schedule_;
  const int row_vectors = static_cast<int>(shape_.hidden * kBf16Bytes / 16);
  barrier_wait(f.rank, f.stream);
  // MoeOptions::gather_rows: the gate/up GEMM reads this rank's rows from x itself (src/device/gemm/row_gather.cuh).
  // The expert-major copy is still made where other ranks' rows need it (EP > 1) or the context keeps it for the
  // backward; the GEMM then reads the same values from either, so the same bits.
  const bool gather = options_.gather_rows;
  if (!gather || shape_.ep_size > 1 || options_.backward) pull_rows(f, capacity_rows());
  // FP8: the pulled rows are FP8 rows; their scales into the GEMM's A-scale layout.
  if (fp8())
    detail::unpack_fp8_row_scales(f.context->expert_rows_, v.scheduled_rows, capacity_rows(), shape_.hidden,
                                  f.context->expert_row_scales_, f.stream);

  ExpertGemmArgs gate_up, down;
  routed_gemms(f, gate_up, down);
  if (gather)
    gate_up.gather = {.x = token_rows(x_, f.rank, f.x.data).base[f.rank],
                      .row_route = v.row_route,
                      .num_tokens = shape_.num_tokens,
                      .top_k = shape_.top_k,
                      .rank = f.rank};
  // MoeOptions::scatter_rows: the down GEMM writes each row to its route's combine row itself
  // (src/device/gemm/row_scatter.cuh): no y, no push pass.
  const bool scatter = options_.scatter_rows;
  if (scatter) {
    down.out = nullptr;
    down.scatter = {.maps = s.scatter_maps.get(),
                    .row_route = v.row_route,
                    .num_tokens = shape_.num_tokens,
                    .top_k = shape_.top_k,
                    .ranks = shape_.ep_size};
  }
  run_mlp(gate_up, down, f.stream);

  if (!scatter && !combine_in_place()) {  // the combine reads y where it is
    const kernels::PushParams push{combined_.peers(f.rank), static_cast<const uint4*>(s.y), v.row_route,
                                   v.scheduled_rows, shape_.num_tokens, shape_.top_k, row_vectors};
    kernels::push_rows_kernel<<<row_kernel_ctas(capacity_rows(), kernels::PushTraits::kWarps, s.num_sms),
                                kernels::PushTraits::kThreads, 0, f.stream>>>(push);
    MOK_CHECK_CUDA(cudaGetLastError());
  }
  barrier_arrive(f.rank, f.stream);
}

// Phase 2, fused: wait for every rank's x, then the megakernel (shared expert, pulls, routed experts,
// pushes), then "your rows are written" to every peer.
void MoeWorkspace::compute_fused(const RankForward& f) {
  const RankState& s = state(f.rank);
  DeviceGuard guard(s.device);
  ForwardContext& ctx = *f.context;
  const ScheduleView& v = ctx.schedule_;
  barrier_wait(f.rank, f.stream);

  ExpertGemmArgs routed_gate_up, routed_down, shared_gate_up, shared_down;
  routed_gemms(f, routed_gate_up, routed_down);
  if (shape_.shared_expert)
    shared_gemms(f, shared_gate_up, shared_down);
  else  // never run (no shared tiles); the launch still builds descriptors from valid pointers
    shared_gate_up = routed_gate_up, shared_down = routed_down;
  detail::launch_fused_forward({.shared_gate_up = shared_gate_up,
                                .shared_down = shared_down,
                                .expert_gate_up = routed_gate_up,
                                .expert_down = routed_down,
                                .common = megakernel_args(f.rank, v, s.fused_counters, s.tickets),
                                .ring_rows = static_cast<int32_t>(ring_rows_),
                                .x = token_rows(x_, f.rank, f.x.data),
                                .combined = combined_.peers(f.rank),
                                .expert_rows = ctx.expert_rows_,
                                .expert_out = s.y,
                                .combine_in_place = combine_in_place(),
                                .expert_row_scales = ctx.expert_row_scales_,
                                .fp8_row_vectors = static_cast<int>(pulled_row_bytes() / 16)},
                               f.stream);
  barrier_arrive(f.rank, f.stream);
}

detail::MegakernelArgs MoeWorkspace::megakernel_args(int rank, const ScheduleView& v, uint64_t* counters,
                                                     int32_t* tickets) const {
  return {.expert_row_offsets = v.expert_row_offsets,
          .scheduled_rows = v.scheduled_rows,
          .row_route = v.row_route,
          .local_experts = shape_.local_experts(),
          .shared_rows = shape_.shared_expert ? static_cast<int32_t>(padded_tokens_) : 0,
          .capacity_rows = capacity_rows(),
          .minibatch_rows = options_.fused.minibatch_rows,
          .comm_ctas = options_.fused.comm_ctas,
          .grid_ctas = grid_ctas_,
          .num_tokens = shape_.num_tokens,
          .top_k = shape_.top_k,
          .hidden = shape_.hidden,
          .intermediate = shape_.intermediate,
          .counters = counters,
          .tickets = tickets,
          .rank = rank,
          .status = schedule_.device_status(rank),
          .timeout_ns = static_cast<uint64_t>(options_.schedule.wait_timeout_s * 1e9),
          .timeline = state(rank).timeline,
          .timeline_capacity = options_.fused.timeline_records};
}

// Phase 3: wait for every expert rank's rows, then out = shared + sum_j rw * y_j (at EP = 1 y_j read where the
// down GEMM or the megakernel wrote it: combine_in_place).
void MoeWorkspace::combine(const RankForward& f, bool check_ids) {
  const RankState& s = state(f.rank);
  DeviceGuard guard(s.device);
  barrier_wait(f.rank, f.stream);

  const bool local = combine_in_place();
  const combine::EpilogueParams p{
      .combined = static_cast<const uint4*>(combined_.on(f.rank)),
      .shared_out = shape_.shared_expert ? static_cast<const uint4*>(s.shared_out) : nullptr,
      .router_weights = static_cast<const float*>(f.router_weights.data),
      .topk_idx = f.topk_idx.data,
      .out = static_cast<uint4*>(f.out.mutable_data()),
      .route_values = nullptr,
      .route_out = nullptr,
      .num_tokens = static_cast<int>(f.topk_idx.shape[0]),  // the call's tokens
      .top_k = shape_.top_k,
      .num_experts = shape_.num_experts,
      .row_vectors = static_cast<int>(shape_.hidden / combine::EpilogueTraits::kColumns),
      .rows = local ? static_cast<const uint4*>(s.y) : nullptr,
      .route_row = local ? f.context->schedule_.route_row : nullptr,
      .schedule_ids = check_ids ? f.context->schedule_.own_ids : nullptr,
      .status = schedule_.device_status(f.rank)};
  detail::launch_combine_epilogue(p, f.topk_idx.dtype, s.num_sms, f.stream);
}

}  // namespace mok
