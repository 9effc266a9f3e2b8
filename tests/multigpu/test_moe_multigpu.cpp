// The MoE forward (the default, fused path) on two GPUs: device peers (CUDA peer access) and NCCL symmetric
// windows (two communicators in this process, ncclCommInitAll), each bitwise against the same ranks run as
// virtual ranks on one GPU; provenance through NCCL's LSA pointers, in one process and in one process per
// GPU (the way a training job uses it); reruns bitwise; one full-size shape against the unfused path; the
// explicit collective teardown (close() deregisters the windows, the destructor never calls a collective).
#include <spawn.h>
#include <sys/wait.h>

#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nccl.h>

#include "mok/moe.h"
#include "reference/routing_gen.h"
#include "tests/common/gpu_env.h"
#include "tests/common/moe_harness.h"

namespace mok {
namespace {

using testing::LayerData;
using testing::MoeHarness;

MoeShape make_shape(int tokens, int top_k, int experts, int hidden, int intermediate) {
  return testing::moe_shape(2, tokens, top_k, experts, hidden, intermediate);
}

// Two NCCL communicators over GPUs 0 and 1, owned by this process.
struct NcclPair {
  ncclComm_t comms[2] = {nullptr, nullptr};
  NcclPair() {
    const int devices[2] = {0, 1};
    const ncclResult_t result = ncclCommInitAll(comms, 2, devices);
    if (result != ncclSuccess) throw std::runtime_error(std::string("ncclCommInitAll: ") + ncclGetErrorString(result));
  }
  ~NcclPair() {
    for (ncclComm_t c : comms)
      if (c != nullptr) ncclCommDestroy(c);
  }
  PeerGroup group() const { return PeerGroup::nccl({comms[0], comms[1]}); }
};

TEST(MoeMultiGpuTest, DevicePeersAndNcclMatchVirtualRanksBitwise) {
  MOK_REQUIRE_GPUS(2);
  const MoeShape shape = make_shape(512, 8, 64, 512, 256);
  const LayerData data = testing::random_layer(shape, 101, 0.5, 0.02);
  MoeHarness virtual_ranks(PeerGroup::virtual_ranks(2), shape);
  virtual_ranks.upload(data);
  const auto want = virtual_ranks.run_checked(1);
  NcclPair nccl;
  for (bool use_nccl : {false, true}) {
    MoeHarness harness(use_nccl ? nccl.group() : PeerGroup::device_peers({0, 1}), shape);
    harness.upload(data);
    const auto got = harness.run_checked(3);
    for (size_t n = 0; n < got.size(); ++n)
      ASSERT_EQ(got[n], want[n % 2]) << (use_nccl ? "nccl" : "device peers") << ", run " << n / 2 << ", rank " << n % 2;
    std::printf("%-12s EP=2 on 2 GPUs: 3 runs bitwise equal to virtual ranks\n", use_nccl ? "nccl" : "device peers");
  }
}

TEST(MoeMultiGpuTest, ProvenanceThroughNcclWindows) {
  MOK_REQUIRE_GPUS(2);
  const MoeShape shape = make_shape(96, 4, 32, 256, 128);
  NcclPair nccl;
  MoeHarness harness(nccl.group(), shape);
  for (int hot = 0; hot < shape.top_k; ++hot) {
    const LayerData data = testing::provenance_layer(shape, 120 + hot, 0.1, hot);
    harness.upload(data);
    harness.forward();
    for (int r = 0; r < 2; ++r) {
      const std::string mismatch = testing::check_provenance(data, r, harness.out_bits(r));
      ASSERT_TRUE(mismatch.empty()) << "hot slot " << hot << ": " << mismatch;
    }
  }
}

// Each rank's forward captured into a CUDA graph on its own stream and GPU; the two graphs replayed
// together (their barriers wait on each other across GPUs inside the graphs) give the eager bits.
TEST(MoeMultiGpuTest, PerRankCudaGraphsReplayAcrossGpus) {
  MOK_REQUIRE_GPUS(2);
  const MoeShape shape = make_shape(256, 4, 16, 256, 128);
  const LayerData data = testing::random_layer(shape, 140);
  NcclPair nccl;
  MoeHarness harness(nccl.group(), shape);
  harness.upload(data);
  const auto eager = harness.run_checked(1);
  cudaGraphExec_t exec[2] = {nullptr, nullptr};
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(harness.stream(r), cudaStreamCaptureModeThreadLocal), cudaSuccess);
    harness.workspace().forward({&harness.args(r), 1});
    ASSERT_EQ(cudaStreamEndCapture(harness.stream(r), &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec[r], graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
  }
  for (int replay = 0; replay < 3; ++replay) {
    harness.poison_outputs();
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec[r], harness.stream(r)), cudaSuccess);
    }
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(harness.status(r).ok()) << harness.status(r).describe(256, 4, 16);
      ASSERT_EQ(harness.out_bits(r), eager[r]) << "replay " << replay << ", rank " << r;
    }
  }
  for (cudaGraphExec_t e : exec) cudaGraphExecDestroy(e);
}

// Starts moe_nccl_rank on two GPUs with a fresh unique id (extra: its optional last argument) and expects
// both processes to exit with status 0.
void run_two_rank_processes(const std::string& extra) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::string hex;
  for (char byte : id.internal) {
    char digits[3];
    std::snprintf(digits, sizeof(digits), "%02x", static_cast<unsigned char>(byte));
    hex += digits;
  }
  std::vector<pid_t> children;
  for (int rank = 0; rank < 2; ++rank) {
    std::string rank_text = std::to_string(rank), size_text = "2", path = MOK_NCCL_RANK_PROGRAM;
    std::string extra_text = extra;
    char* argv[] = {path.data(), rank_text.data(), size_text.data(), hex.data(), extra.empty() ? nullptr : extra_text.data(),
                    nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, path.c_str(), nullptr, nullptr, argv, environ), 0) << "cannot start " << path;
    children.push_back(pid);
  }
  for (size_t rank = 0; rank < children.size(); ++rank) {
    int status = 0;
    ASSERT_EQ(waitpid(children[rank], &status, 0), children[rank]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " process failed (its stderr is above), status " << status;
  }
}

// Two processes, one GPU each, the communicator built from a unique id (tests/multigpu/moe_nccl_rank.cpp).
TEST(MoeMultiGpuTest, NcclAcrossProcesses) {
  MOK_REQUIRE_GPUS(2);
  run_two_rank_processes("");
}

// The ranks build workspaces of different token counts: every rank gets an error naming the field (the
// shapes are all-gathered before any collective allocation), no rank hangs.
// Lifetimes (docs/design.md): close() is the collective teardown (this process drives both communicators, so
// one group call per buffer deregisters both ranks' windows), idempotent, and later calls throw; a workspace
// destroyed without close() prints one warning and leaks its windows instead of calling the collective.
TEST(MoeMultiGpuTest, NcclCloseIsExplicitAndTheDestructorCallsNoCollective) {
  MOK_REQUIRE_GPUS(2);
  const MoeShape shape = make_shape(96, 4, 32, 256, 128);
  const std::string warning =
      "mok: MoeWorkspace destroyed without close(): its NCCL windows are leaked, not deregistered "
      "(deregistration is collective)";
  NcclPair nccl;
  {
    MoeHarness harness(nccl.group(), shape);
    harness.upload(testing::random_layer(shape, 150));
    harness.forward();
    harness.check_status();
    MoeWorkspace& ws = harness.workspace();
    EXPECT_TRUE(ws.needs_close());
    harness.close();
    EXPECT_TRUE(ws.closed());
    EXPECT_FALSE(ws.needs_close());
    ws.close();  // idempotent: no second deregistration
    EXPECT_THROW(ws.make_context(0), std::logic_error);
    EXPECT_THROW(ws.forward(harness.all_args()), std::logic_error);
    ::testing::internal::CaptureStderr();
  }  // closed: destroyed without a word
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("without close"), std::string::npos) << err;
  auto unclosed = std::make_unique<MoeWorkspace>(nccl.group(), shape);
  EXPECT_TRUE(unclosed->needs_close());
  ::testing::internal::CaptureStderr();
  unclosed.reset();  // frees the local buffers only: no deregistration (a collective)
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(warning), std::string::npos) << err;
  EXPECT_EQ(err.find(warning), err.rfind(warning)) << "one warning per workspace: " << err;
}

TEST(MoeMultiGpuTest, NcclMismatchedShapesRejectedOnEveryRank) {
  MOK_REQUIRE_GPUS(2);
  run_two_rank_processes("mismatch");
}

// The fused path on two GPUs through NCCL windows against the unfused path on virtual ranks, full size.
TEST(MoeMultiGpuTest, FullSizeDeepSeekFusedMatchesUnfusedVirtualRanksBitwise) {
  MOK_REQUIRE_GPUS(2);
  MOK_SKIP_IF_REDUCED();  // full-size DeepSeek-V4-Pro weights: far too slow under compute-sanitizer
  const auto& m = reference::model_shape("DeepSeek-V4-Pro");  // the largest weights
  const MoeShape shape = make_shape(8192, m.top_k, m.num_experts, m.hidden, m.intermediate);
  const auto topk = reference::random_topk_per_rank(2, shape.num_tokens, m.top_k, m.num_experts, 0, 130);
  std::vector<std::vector<float>> weights;
  for (int r = 0; r < 2; ++r)
    weights.push_back(reference::random_routing(shape.num_tokens, m.top_k, m.num_experts, 0, 130 + r).router_weights);
  std::vector<std::vector<uint16_t>> want;
  {
    MoeOptions unfused;
    unfused.path = ForwardPath::kUnfused;
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape, unfused);
    harness.fill_hashed(131, 2, 1.f / 64, 0.5f);
    harness.upload_routing(topk, weights);
    want = harness.run_checked(1);
  }
  NcclPair nccl;
  MoeHarness harness(nccl.group(), shape);
  harness.fill_hashed(131, 2, 1.f / 64, 0.5f);
  harness.upload_routing(topk, weights);
  const auto got = harness.run_checked(2);
  for (size_t n = 0; n < got.size(); ++n) ASSERT_EQ(got[n], want[n % 2]) << m.name << " run " << n / 2 << " rank " << n % 2;
  std::printf("%s EP=2 full size, fused on 2 GPUs (nccl): 2 runs bitwise equal to unfused virtual ranks\n",
              m.name.c_str());
}

}  // namespace
}  // namespace mok
