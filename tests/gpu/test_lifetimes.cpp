// Lifetimes of the workspace's device state and the host synchronization of its calls (docs/design.md,
// "Lifetimes"), on one GPU with virtual ranks:
//   - a failure injected at every construction step of MoeWorkspace and its contexts in turn (a device
//     allocation, a symmetric allocation's copy, an event: src/host/failure_injection.h, test builds only)
//     frees everything made before it: the live device allocations and the free device memory
//     (cudaMemGetInfo) return to their starting values after each failure, until the construction succeeds
//   - close() frees the buffers, is idempotent, and every later call throws std::logic_error naming the call
//     and "closed"; destroying an unclosed in-process workspace (nothing collective to release) is silent
//   - make_context, forward, backward, build_schedule and recompute_forward_context return while another
//     stream of the device is held by a blocked host function: none of them waits for the device
//     (cudaDeviceSynchronize would wait for the blocker), and the results equal an unblocked run bitwise
//   - a context of a destroyed workspace is refused by the workspace built at its address
// NCCL's side (close deregisters, the destructor warns and leaks) is in tests/multigpu/test_moe_multigpu.cpp.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "src/host/check.h"
#include "src/host/failure_injection.h"
#include "tests/common/gpu_env.h"
#include "tests/common/moe_harness.h"

namespace mok {
namespace {

using testing::LayerData;
using testing::MoeHarness;
using testing::moe_shape;

// What the CUDA runtime may keep of freed memory (bench/soak.cpp allows the same for a freed workspace).
// Every buffer of the shapes below that is larger than this is caught by the free-memory check; the
// smaller ones by the count of live allocations.
constexpr int64_t kFreeSlackBytes = int64_t{2} << 20;

int64_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  MOK_CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(free_bytes);
}

// A workspace and a context per rank: what a layer builds before its first step.
void build_layer(const PeerGroup& group, const MoeShape& shape, const MoeOptions& options) {
  MoeWorkspace workspace(group, shape, options);
  std::vector<ForwardContext> contexts;
  for (int r : group.local_ranks()) contexts.push_back(workspace.make_context(r));
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
}

struct BuildCase {
  const char* name;
  MoeOptions options;
};

std::vector<BuildCase> build_cases() {
  MoeOptions fused;  // every per-rank buffer: the backward megakernel's counters, a timeline, kept g | u
  fused.fused.backward_megakernel = true;
  fused.fused.timeline_records = 16;
  MoeOptions unfused;  // the backward's recompute buffers instead of the kept g | u
  unfused.path = ForwardPath::kUnfused;
  unfused.keep_gate_up = false;
  MoeOptions inference;
  inference.backward = false;
  return {{"fused, backward megakernel, timeline", fused}, {"unfused, no kept g | u", unfused},
          {"inference only", inference}};
}

TEST(LifetimesTest, FailureAtEveryConstructionStepFreesEverything) {
  MOK_REQUIRE_GPUS(1);
  // x 2 MiB and the combine buffer 8 MiB per rank; the rank scratch, the backward scratch and each context
  // tens of MiB.
  const MoeShape shape = moe_shape(2, 1024, 4, 16, 1024, 512);
  const PeerGroup group = PeerGroup::virtual_ranks(2);
  for (const BuildCase& c : build_cases()) {
    // The first build loads the kernels' modules and fills the launch caches: memory that stays.
    build_layer(group, shape, c.options);
    const int64_t live_start = detail::live_device_allocations();
    const int64_t free_start = free_device_bytes();
    int failures = 0;
    for (int64_t n = 1;; ++n) {
      ASSERT_LT(n, 1000) << c.name << ": the construction never succeeded";
      detail::fail_construction_step_at(n);
      bool built = false;
      std::string error;
      try {
        build_layer(group, shape, c.options);
        built = true;
      } catch (const std::runtime_error& e) {
        error = e.what();
      }
      const int64_t steps = detail::construction_steps();
      detail::fail_construction_step_at(0);
      const std::string at = std::string(c.name) + ", failure at step " + std::to_string(n);
      if (!built) {
        ++failures;
        EXPECT_NE(error.find("injected failure at construction step " + std::to_string(n) + " "), std::string::npos)
            << at << ": threw something else: " << error;
      }
      EXPECT_EQ(detail::live_device_allocations(), live_start) << at << ": device allocations leaked";
      const int64_t free_now = free_device_bytes();
      EXPECT_GE(free_now + kFreeSlackBytes, free_start)
          << at << ": " << (free_start - free_now) << " bytes of device memory lost";
      if (built) {
        EXPECT_EQ(steps, n - 1) << c.name << ": the successful build took another number of steps";
        break;
      }
    }
    std::printf("%-40s %d construction steps, each failing once: nothing leaked\n", c.name, failures);
    EXPECT_GE(failures, 12) << c.name << ": fewer steps than the workspace has allocations";
  }
}

// `call` throws std::logic_error naming MoeWorkspace::<name> and saying the workspace is closed.
void expect_closed(const char* name, const std::function<void()>& call) {
  try {
    call();
    ADD_FAILURE() << name << ": accepted after close()";
  } catch (const std::logic_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(std::string("MoeWorkspace::") + name), std::string::npos) << what;
    EXPECT_NE(what.find("closed"), std::string::npos) << what;
  }
}

TEST(LifetimesTest, CloseFreesIsIdempotentAndLaterCallsThrow) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 256, 4, 16, 256, 128);
  MoeOptions options;
  options.fused.timeline_records = 8;
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  const LayerData data = testing::random_layer(shape, 501);
  harness.upload(data);
  harness.upload_d_out(testing::random_d_out(shape, 502));
  harness.forward();
  harness.backward();
  harness.check_status();
  MoeWorkspace& ws = harness.workspace();
  const std::vector<RankForward> forward_args = harness.all_args();
  const std::vector<RankBackward> backward_args = harness.all_backward_args();
  const cudaStream_t stream = harness.stream(0);
  harness.synchronize();
  EXPECT_FALSE(ws.needs_close()) << "virtual ranks hold no NCCL windows";
  const int64_t free_before = free_device_bytes();
  ws.close();
  EXPECT_TRUE(ws.closed());
  // Two ranks' buffers: the backward's alone are backward_bytes() per rank (mostly one scratch allocation of
  // several MiB, which the driver returns whole; small ones it may keep in its pools).
  EXPECT_GE(free_device_bytes() - free_before, ws.backward_bytes()) << "close() freed too little";
  ws.close();  // idempotent
  EXPECT_TRUE(ws.closed());
  EXPECT_EQ(ws.shape().ep_size, 2);  // the accessors keep working
  EXPECT_GT(ws.capacity_rows(), 0);
  expect_closed("make_context", [&] { ws.make_context(0); });
  expect_closed("build_schedule", [&] { ws.build_schedule(forward_args); });
  expect_closed("forward_with_schedule", [&] { ws.forward_with_schedule(forward_args); });
  expect_closed("forward", [&] { ws.forward(forward_args); });
  expect_closed("backward", [&] { ws.backward(backward_args); });
  expect_closed("recompute_forward_context", [&] { ws.recompute_forward_context(forward_args); });
  expect_closed("read_status", [&] { ws.read_status(0, stream); });
  expect_closed("reset_status", [&] { ws.reset_status(0, stream); });
  expect_closed("read_timeline", [&] { ws.read_timeline(0, stream); });
}  // the harness's contexts outlive the closed workspace: their memory is their own

TEST(LifetimesTest, DestroyingAnUnclosedInProcessWorkspaceIsSilent) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 256, 4, 16, 256, 128);
  const int64_t live_start = detail::live_device_allocations();
  ::testing::internal::CaptureStderr();
  {
    MoeWorkspace ws(PeerGroup::virtual_ranks(2), shape);
    ForwardContext context = ws.make_context(1);
    EXPECT_FALSE(ws.needs_close());
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("without close"), std::string::npos) << err;
  EXPECT_EQ(err.find("teardown"), std::string::npos) << err;
  EXPECT_EQ(detail::live_device_allocations(), live_start) << "the destructor left allocations behind";
}

// A context names its workspace by a process-unique id, not by address: a workspace built where a destroyed one
// stood (the same object storage, so the same `this`) refuses the old workspace's context, whose buffers are sized
// for another shape, in every call that takes one.
TEST(LifetimesTest, AContextOfADestroyedWorkspaceIsRefusedAtTheSameAddress) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape small = moe_shape(1, 64, 2, 8, 128, 64), large = moe_shape(1, 256, 4, 16, 256, 128);
  std::optional<MoeWorkspace> ws;
  ws.emplace(PeerGroup::virtual_ranks(1), small);
  const MoeWorkspace* first = &*ws;
  ForwardContext stale = ws->make_context(0);
  ws.reset();
  ws.emplace(PeerGroup::virtual_ranks(1), large);
  ASSERT_EQ(&*ws, first) << "std::optional keeps its storage";
  RankForward f;  // the context is checked before any tensor
  f.rank = 0;
  f.context = &stale;
  const std::string refused = "context: must be a ForwardContext made by this workspace's make_context(0)";
  for (const auto& [name, call] : std::vector<std::pair<const char*, std::function<void()>>>{
           {"forward", [&] { ws->forward({&f, 1}); }},
           {"build_schedule", [&] { ws->build_schedule({&f, 1}); }},
           {"recompute_forward_context", [&] { ws->recompute_forward_context({&f, 1}); }}}) {
    try {
      call();
      ADD_FAILURE() << name << ": the stale context passed";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(refused), std::string::npos) << name << ": " << e.what();
    }
  }
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
}

// A non-blocking stream held by a host function until release (or 20 s, so that a call which waits for the
// device fails the test instead of hanging it); released and destroyed on scope exit.
class BlockedStream {
 public:
  BlockedStream() {
    MOK_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MOK_CHECK_CUDA(cudaLaunchHostFunc(stream_, hold, this));
  }
  ~BlockedStream() {
    release();
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  BlockedStream(const BlockedStream&) = delete;
  BlockedStream& operator=(const BlockedStream&) = delete;
  void release() { released_ = true; }
  // Whether the host function has returned: after release(), or after the timeout.
  bool finished() const { return finished_; }

 private:
  static void CUDART_CB hold(void* self) {
    auto* b = static_cast<BlockedStream*>(self);
    const auto start = std::chrono::steady_clock::now();
    while (!b->released_ && std::chrono::steady_clock::now() - start < std::chrono::seconds(20))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    b->finished_ = true;
  }
  cudaStream_t stream_ = nullptr;
  std::atomic<bool> released_{false};
  std::atomic<bool> finished_{false};
};

TEST(LifetimesTest, StepCallsReturnWhileTheDeviceIsBusy) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 256, 4, 16, 256, 128);
  for (const ForwardPath path : {ForwardPath::kFused, ForwardPath::kUnfused}) {
    const char* name = path == ForwardPath::kFused ? "fused" : "unfused";
    MoeOptions options;
    options.path = path;
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
    harness.upload(testing::random_layer(shape, 511));
    harness.upload_d_out(testing::random_d_out(shape, 512));
    // An unblocked step first: the kernels' modules are loaded and the launch caches filled.
    harness.forward();
    harness.backward();
    harness.check_status();
    std::vector<std::vector<uint16_t>> want_out, want_d_x;
    for (int r = 0; r < 2; ++r) {
      want_out.push_back(harness.out_bits(r));
      want_d_x.push_back(harness.d_x_bits(r));
    }
    harness.poison_outputs();  // synchronous: before the device is held
    harness.poison_grads();
    MoeWorkspace& ws = harness.workspace();
    std::vector<ForwardContext> fresh;
    {
      BlockedStream blocker;
      for (int r = 0; r < 2; ++r) fresh.push_back(ws.make_context(r, harness.stream(r)));
      EXPECT_FALSE(blocker.finished()) << name << ": make_context waited for the device";
      for (int r = 0; r < 2; ++r) harness.args(r).context = &fresh[r];  // the backward follows (all_backward_args)
      ws.forward(harness.all_args());
      EXPECT_FALSE(blocker.finished()) << name << ": forward waited for the device";
      ws.backward(harness.all_backward_args());
      EXPECT_FALSE(blocker.finished()) << name << ": backward waited for the device";
      ws.build_schedule(harness.all_args());  // the same ids: the same schedule and, recomputed, the same context
      EXPECT_FALSE(blocker.finished()) << name << ": build_schedule waited for the device";
      ws.recompute_forward_context(harness.all_args());
      EXPECT_FALSE(blocker.finished()) << name << ": recompute_forward_context waited for the device";
      blocker.release();
    }
    harness.check_status();
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(harness.out_bits(r), want_out[r]) << name << ": rank " << r << " out, fresh stream-ordered context";
      EXPECT_EQ(harness.d_x_bits(r), want_d_x[r]) << name << ": rank " << r << " d_x, fresh stream-ordered context";
    }
    for (int r = 0; r < 2; ++r) harness.args(r).context = nullptr;  // `fresh` goes first
  }
}

}  // namespace
}  // namespace mok
