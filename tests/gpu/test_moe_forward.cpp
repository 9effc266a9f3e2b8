// The MoE forward (include/mok/moe.h) on one GPU: virtual ranks for EP = 1, 2, 4, 8. The default path is
// the fused one (the megakernel); test_moe_fused.cpp holds it bitwise to the unfused path.
//   - scaled-down model shapes against the CPU reference (fp64 accumulation on the same bf16 values),
//     within the budget of compare_within_budget, both paths; full-size shapes against an fp32 GPU check
//   - provenance: outputs that encode source rank, token and expert exactly (misrouting is caught bitwise)
//   - reruns, tile heights and capacities bitwise equal; a captured CUDA graph replays to the same bits
//   - skewed routing, experts with no tokens, masked routes, int64 ids
//   - host validation names the argument; bad ids and capacity overflow reach the status word
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nccl.h>

#include "mok/moe.h"
#include "reference/moe_reference.h"
#include "reference/routing_gen.h"
#include "src/host/check.h"
#include "tests/common/bf16.h"
#include "tests/common/gpu_env.h"
#include "tests/common/moe_harness.h"

namespace mok {
namespace {

using testing::LayerData;
using testing::MoeHarness;
using testing::moe_shape;

using testing::scaled_model_shape;  // the model shapes with experts / 8, hidden 512, I scaled like I / H

// GPU output of every rank against the CPU reference; returns the worst budget ratio.
double check_against_reference(MoeHarness& harness, const LayerData& data, const std::string& label) {
  const reference::ForwardTrace<float> ref = reference::forward(data.shape, data.params, data.inputs);
  const int64_t per_rank = int64_t(data.shape.tokens_per_rank) * data.shape.hidden;
  // The GPU rounds the shared output and each expert output to bf16 before summing them in fp32: where
  // they cancel (|shared| ~ |y| >> |out|, seen with k = 1) that rounding is the error, 2^-9 of each; twice it.
  const int64_t h = data.shape.hidden, k = data.shape.top_k;
  std::vector<float> extra(ref.out.size());
  for (int64_t n = 0; n < int64_t(extra.size()); ++n) {
    const int64_t token = n / h, c = n % h;
    double sum = std::fabs(ref.shared_out[n]);
    for (int64_t j = 0; j < k; ++j)
      sum += std::fabs(data.inputs.router_weights[token * k + j] * ref.route_out[(token * k + j) * h + c]);
    extra[n] = static_cast<float>(std::ldexp(sum, -8));
  }
  double worst = 0;
  for (int r = 0; r < data.shape.num_ranks; ++r) {
    // An error (a capacity overflow above all) leaves `out` unspecified: fail on it, never compare it.
    const StatusReport report = harness.status(r);
    EXPECT_TRUE(report.ok()) << label << " rank " << r << ": "
                             << report.describe(data.shape.tokens_per_rank, data.shape.top_k, data.shape.num_experts);
    if (!report.ok()) return std::numeric_limits<double>::infinity();
    const auto out = harness.out_bits(r);
    const auto result =
        testing::compare_within_budget(out, ref.out.data() + r * per_rank, per_rank, extra.data() + r * per_rank);
    EXPECT_LE(result.worst_ratio, 1.0) << label << " rank " << r << ": " << result.describe(data.shape.hidden);
    worst = std::max(worst, result.worst_ratio);
  }
  return worst;
}

TEST(MoeForwardTest, ScaledModelShapesMatchCpuReference) {
  MOK_REQUIRE_GPUS(1);
  std::printf("shape            EP  tokens  path     worst error / budget\n");
  uint64_t seed = 1;
  for (const auto& m : reference::model_shapes()) {
    for (int ep : {1, 2, 4, 8}) {
      const MoeShape shape = scaled_model_shape(m, ep, 160);
      const LayerData data = testing::random_layer(shape, ++seed, 0, ep == 4 ? 0.05 : 0);
      for (ForwardPath path : {ForwardPath::kFused, ForwardPath::kUnfused}) {
        MoeOptions options;
        options.path = path;
        const char* path_name = path == ForwardPath::kFused ? "fused" : "unfused";
        MoeHarness harness(PeerGroup::virtual_ranks(ep), shape, options);
        harness.upload(data, ep == 2 ? DType::kInt64 : DType::kInt32);
        harness.forward();
        for (int r = 0; r < ep; ++r)
          ASSERT_TRUE(harness.status(r).ok()) << harness.status(r).describe(160, m.top_k, shape.num_experts);
        const std::string label = m.name + " EP=" + std::to_string(ep) + " " + path_name + " seed " + std::to_string(seed);
        const double worst = check_against_reference(harness, data, label);
        std::printf("%-16s %2d %7d  %-8s %.3f\n", m.name.c_str(), ep, shape.num_tokens, path_name, worst);
      }
    }
  }
}

// Skewed routings at EP 4 need more than the default capacity (twice the balanced rows) on a rank: they run
// with the worst case (ScheduleOptions::load_factor = ep_size). The default ring (the balanced share) is
// below their busiest rank's rows, so the fused forward reuses it (macrobatches).
TEST(MoeForwardTest, SkewedRoutingEmptyExpertsAndClampedSwiGLU) {
  MOK_REQUIRE_GPUS(1);
  MoeShape shape = moe_shape(4, 200, 6, 32, 256, 128);
  MoeOptions worst_case;
  worst_case.schedule.load_factor = shape.ep_size;
  {  // Zipf-skewed routing: several experts get no rows (the busiest rank: about 1.5x the balanced rows)
    MoeHarness harness(PeerGroup::virtual_ranks(4), shape, worst_case);
    const LayerData data = testing::random_layer(shape, 11, 3.0, 0.1);
    harness.upload(data);
    harness.forward();
    check_against_reference(harness, data, "skewed");
  }
  {  // every route to rank 0's experts: ranks 1..3 have no rows at all; rank 0 needs 4x the balanced rows
    MoeHarness harness(PeerGroup::virtual_ranks(4), shape, worst_case);
    LayerData data = testing::random_layer(shape, 12);
    for (size_t q = 0; q < data.inputs.topk_idx.size(); ++q)
      data.inputs.topk_idx[q] = static_cast<int32_t>(q % shape.top_k);  // experts 0..5 live on rank 0
    harness.upload(data);
    harness.forward();
    check_against_reference(harness, data, "all to rank 0");
  }
  {  // clamped SwiGLU without a shared expert, EP=2
    shape.shared_expert = false;
    shape.swiglu_limit = 0.5f;
    shape.ep_size = 2;
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
    const LayerData data = testing::random_layer(shape, 13);
    harness.upload(data);
    harness.forward();
    check_against_reference(harness, data, "clamped, no shared expert");
  }
}

// top_k up to E (every token routed to every expert) and one local expert per rank, both paths, against
// the CPU reference; H and I multiples of 64 only (partial GEMM tiles).
TEST(MoeForwardTest, TopKUpToExpertsAndOneLocalExpert) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<MoeShape> shapes = {
      moe_shape(8, 64, 8, 8, 256, 128),     // EP 8, E_local 1, k = E
      moe_shape(1, 100, 16, 16, 320, 192),  // EP 1, k = E, partial tiles
      moe_shape(4, 33, 1, 4, 192, 64),      // EP 4, E_local 1, k 1, the smallest tiles
      moe_shape(4, 33, 1, 4, 192, 128),
      moe_shape(4, 33, 1, 4, 256, 64),
      moe_shape(1, 33, 1, 1, 192, 64),
      moe_shape(4, 33, 1, 4, 192, 64, false),
      moe_shape(4, 33, 2, 8, 192, 64),
  };
  uint64_t seed = 90;
  for (const MoeShape& shape : shapes) {
    const LayerData data = testing::random_layer(shape, ++seed);
    for (ForwardPath path : {ForwardPath::kFused, ForwardPath::kUnfused}) {
      MoeOptions options;
      options.path = path;
      MoeHarness harness(PeerGroup::virtual_ranks(shape.ep_size), shape, options);
      harness.upload(data);
      harness.forward();
      for (int r = 0; r < shape.ep_size; ++r)
        ASSERT_TRUE(harness.status(r).ok()) << harness.status(r).describe(shape.num_tokens, shape.top_k, shape.num_experts);
      const std::string label = "EP " + std::to_string(shape.ep_size) + " E " + std::to_string(shape.num_experts) +
                                " k " + std::to_string(shape.top_k) + " H " + std::to_string(shape.hidden) + " I " +
                                std::to_string(shape.intermediate) + (path == ForwardPath::kFused ? " fused" : " unfused") +
                                " seed " + std::to_string(seed);
      std::printf("shape %s: worst error / budget %.3f\n", label.c_str(), check_against_reference(harness, data, label));
    }
  }
}

TEST(MoeForwardTest, ProvenanceEncodesRankTokenAndExpert) {
  MOK_REQUIRE_GPUS(1);
  for (int ep : {2, 8}) {
    const MoeShape shape = moe_shape(ep, 96, 4, 32, 256, 128);
    MoeHarness harness(PeerGroup::virtual_ranks(ep), shape);
    for (int hot = 0; hot < shape.top_k; ++hot) {
      const LayerData data = testing::provenance_layer(shape, 20 + hot, 0.1, hot);
      harness.upload(data);
      harness.forward();
      for (int r = 0; r < ep; ++r) {
        const std::string mismatch = testing::check_provenance(data, r, harness.out_bits(r));
        ASSERT_TRUE(mismatch.empty()) << "EP=" << ep << " hot slot " << hot << ": " << mismatch;
      }
    }
  }
}

std::vector<std::vector<uint16_t>> run_outputs(const PeerGroup& group, const MoeShape& shape, const MoeOptions& options,
                                               const LayerData& data, int runs = 1) {
  MoeHarness harness(group, shape, options);
  harness.upload(data);
  return harness.run_checked(runs);
}

// The base runs the default capacity (load factor 2: 5824 rows; the mildly skewed routing needs at most about
// 3100 on a rank) and the default ring (the balanced share).
TEST(MoeForwardTest, BitwiseEqualAcrossRerunsTileHeightsAndCapacities) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(4, 300, 8, 64, 512, 256);
  const LayerData data = testing::random_layer(shape, 31, 1.0, 0.02);
  const auto group = PeerGroup::virtual_ranks(4);
  const auto base = run_outputs(group, shape, {}, data, 3);
  for (int run = 1; run < 3; ++run)
    for (int r = 0; r < 4; ++r) ASSERT_EQ(base[run * 4 + r], base[r]) << "rerun " << run << " rank " << r;
  MoeOptions tall;
  tall.schedule.tile_m = 128;
  MoeOptions tight;
  tight.schedule.capacity_rows = 5120;  // below the default and half the worst case (10624 rows): enough here
  MoeOptions worst;
  worst.schedule.capacity_rows = worst_case_capacity_rows(shape.routing(), worst.schedule.tile_m);
  worst.fused.macrobatch_rows = int64_t{1} << 30;  // and the whole context: the ring is the capacity
  for (const MoeOptions& options : {tall, tight, worst}) {
    const auto other = run_outputs(group, shape, options, data);
    for (int r = 0; r < 4; ++r)
      ASSERT_EQ(other[r], base[r]) << "tile_m " << options.schedule.tile_m << ", capacity "
                                   << options.schedule.capacity_rows << ", rank " << r;
  }
}

// Fused [E, 2I, H] gate/up weights give the same bits as separate ones; also top_k = 1.
TEST(MoeForwardTest, FusedGateUpWeightsMatchSeparateBitwise) {
  MOK_REQUIRE_GPUS(1);
  for (int top_k : {1, 6}) {
    const MoeShape shape = moe_shape(2, 200, top_k, 16, 512, 256);
    const LayerData data = testing::random_layer(shape, 45 + top_k);
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
    harness.upload(data);
    const auto separate = harness.run_checked(1);
    harness.use_fused_gate_up(data);
    const auto fused = harness.run_checked(1);
    for (int r = 0; r < 2; ++r) ASSERT_EQ(fused[r], separate[r]) << "top_k " << top_k << ", rank " << r;
    check_against_reference(harness, data, "fused, top_k " + std::to_string(top_k));
  }
}

// EP=1 through an NCCL communicator of one rank (windows of one) gives the virtual rank's bits.
TEST(MoeForwardTest, SingleRankNcclCommunicatorMatchesVirtualRank) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(1, 300, 8, 32, 512, 256);
  const LayerData data = testing::random_layer(shape, 47, 0, 0.05);
  MoeHarness virtual_rank(PeerGroup::virtual_ranks(1), shape);
  virtual_rank.upload(data);
  const auto want = virtual_rank.run_checked(1);
  ncclComm_t comm = nullptr;
  const int device = 0;
  ASSERT_EQ(ncclCommInitAll(&comm, 1, &device), ncclSuccess);
  {
    MoeHarness harness(PeerGroup::nccl({comm}), shape);
    harness.upload(data);
    const auto got = harness.run_checked(2);
    ASSERT_EQ(got[0], want[0]);
    ASSERT_EQ(got[1], want[0]);
  }
  ncclCommDestroy(comm);
}

TEST(MoeForwardTest, CudaGraphReplayMatchesEager) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 256, 4, 16, 256, 128);
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
  const LayerData data = testing::random_layer(shape, 41);
  harness.upload(data);
  harness.forward();
  const auto eager0 = harness.out_bits(0), eager1 = harness.out_bits(1);

  const LayerData other = testing::random_layer(shape, 42);
  cudaStream_t stream = harness.stream(0);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOK_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  harness.workspace().forward(harness.all_args());
  MOK_CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  MOK_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    // Alternate inputs between replays: the graph must read the buffers, not replay old results.
    harness.upload(replay % 2 == 0 ? data : other);
    harness.poison_outputs();
    MOK_CHECK_CUDA(cudaGraphLaunch(exec, stream));
    const auto out0 = harness.out_bits(0), out1 = harness.out_bits(1);
    if (replay % 2 == 0) {
      ASSERT_EQ(out0, eager0) << "replay " << replay;
      ASSERT_EQ(out1, eager1) << "replay " << replay;
    } else {
      ASSERT_NE(out0, eager0) << "replay " << replay << " ignored its new inputs";
    }
    ASSERT_TRUE(harness.status(0).ok());
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(MoeForwardTest, ValidationNamesTheArgument) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 64, 2, 8, 256, 128);
  auto expect_error = [](const std::function<void()>& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { auto s = shape; s.hidden = 200; s.validate(); }, "MoeShape.hidden");
  expect_error([&] { auto s = shape; s.intermediate = 100; s.validate(); }, "MoeShape.intermediate");
  expect_error([&] { auto s = shape; s.num_experts = 7; s.validate(); }, "num_experts");
  expect_error([&] { MoeWorkspace ws(PeerGroup::virtual_ranks(4), shape); }, "ep_size");
  // A legal shape whose GEMMs could take more task slots than int32 holds (detail::task_slot_bound): refused by
  // the constructor, naming the bound, before its large buffers are allocated.
  expect_error([&] { MoeWorkspace ws(PeerGroup::virtual_ranks(1), moe_shape(1, 1 << 20, 16, 64, 16384, 1 << 20)); },
               "task slots, and slots are int32");

  MoeOptions options;
  options.schedule.wait_timeout_s = 0.5;  // a half-issued forward would time out (and fail below) quickly
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(testing::random_layer(shape, 51));
  auto with = [&](const std::function<void(RankForward&, MoeWeights&)>& edit) {
    return [&, edit] {
      RankForward f = harness.args(1);
      MoeWeights w = *f.weights;
      edit(f, w);
      f.weights = &w;
      harness.workspace().forward({&f, 1});
    };
  };
  expect_error(with([](RankForward& f, MoeWeights&) { f.x.shape[1] = 128; }), "x: expected bf16 [64, 256]");
  expect_error(with([](RankForward& f, MoeWeights&) { f.router_weights.dtype = DType::kBFloat16; }), "router_weights");
  expect_error(with([](RankForward& f, MoeWeights&) { f.topk_idx.dtype = DType::kFloat32; }), "topk_idx");
  expect_error(with([](RankForward& f, MoeWeights&) { f.out.data = static_cast<const char*>(f.out.data) + 2; }),
               "out: data must be 16-byte aligned");
  expect_error(with([](RankForward&, MoeWeights& w) { w.expert_down.shape[0] = 8; }), "weights.expert_down");
  expect_error(with([](RankForward&, MoeWeights& w) { w.shared_up = TensorRef(); }), "weights.shared_up");
  expect_error(with([](RankForward& f, MoeWeights&) { f.context = nullptr; }), "context");
  ForwardContext rank0_context = harness.workspace().make_context(0);
  expect_error(with([&](RankForward& f, MoeWeights&) { f.context = &rank0_context; }), "context");
  expect_error(with([](RankForward& f, MoeWeights&) { f.rank = 5; }), "rank 5");
  std::vector<uint16_t> host(64 * 256);
  expect_error(with([&](RankForward& f, MoeWeights&) { f.x.data = host.data(); }), "x: must be device memory");
  // A rejected call issues nothing: had one built rank 1's schedule alone, it would have waited for rank 0's
  // ids and timed out.
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(harness.status(r).ok()) << harness.status(r).describe(64, 2, 8);
}

TEST(MoeForwardTest, BadExpertIdAndCapacityOverflowReachTheStatusWord) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 128, 4, 16, 256, 128);
  {
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
    LayerData data = testing::random_layer(shape, 61);
    data.inputs.topk_idx[(128 + 5) * 4 + 2] = 16;  // rank 1, token 5, slot 2
    harness.upload(data);
    harness.forward();
    for (int r = 0; r < 2; ++r) {
      const StatusReport report = harness.status(r);
      ASSERT_TRUE(report.raw.error_bits & kStatusBadExpertId) << "rank " << r << ": " << report.describe(128, 4, 16);
      EXPECT_EQ(report.bad_route(), (128 + 5) * 4 + 2);
    }
  }
  {
    MoeOptions options;
    options.schedule.capacity_rows = 128;  // far too small
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
    harness.upload(testing::random_layer(shape, 62));
    harness.forward();
    const StatusReport report = harness.status(0);
    ASSERT_TRUE(report.raw.error_bits & kStatusCapacityOverflow) << report.describe(128, 4, 16);
    std::printf("overflow report: %s\n", report.describe(128, 4, 16).c_str());
  }
}

// A default workspace at EP 4 (capacity from the expected load: twice the balanced T * k rows plus padding)
// with every route on rank 0's experts, which needs 4x: rank 0 reports the overflow (rows needed > rows held,
// the message says to raise ScheduleOptions.load_factor or capacity_rows), no rank hangs or reports anything
// else, and after reset_status a balanced routing on the same workspace matches the CPU reference. Both paths.
TEST(MoeForwardTest, DefaultCapacityOverflowsOnSkewAndRecovers) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(4, 128, 4, 16, 256, 128);
  for (ForwardPath path : {ForwardPath::kFused, ForwardPath::kUnfused}) {
    const std::string name = path == ForwardPath::kFused ? "fused" : "unfused";
    MoeOptions options;  // capacity_rows 0, load_factor 2
    options.path = path;
    MoeHarness harness(PeerGroup::virtual_ranks(4), shape, options);
    const int64_t capacity = harness.workspace().capacity_rows();
    ASSERT_EQ(capacity, expected_load_capacity_rows(shape.routing(), 64, 2.0)) << name;
    ASSERT_LT(capacity, worst_case_capacity_rows(shape.routing(), 64)) << name;
    LayerData skewed = testing::random_layer(shape, 63);
    for (size_t q = 0; q < skewed.inputs.topk_idx.size(); ++q)
      skewed.inputs.topk_idx[q] = static_cast<int32_t>(q % shape.top_k);  // experts 0..3, all on rank 0
    harness.upload(skewed);
    harness.forward();
    const StatusReport report = harness.status(0);
    const std::string text = report.describe(128, 4, 16);
    std::printf("%s, default capacity %lld rows, all routes to rank 0: %s\n", name.c_str(),
                static_cast<long long>(capacity), text.c_str());
    ASSERT_EQ(report.raw.error_bits, kStatusCapacityOverflow) << name << ": " << text;
    EXPECT_EQ(report.raw.rows_capacity, capacity) << name;
    EXPECT_EQ(report.raw.rows_needed, 4 * 128 * 4) << name;  // 4 experts of 512 rows (multiples of 64)
    EXPECT_GT(report.raw.rows_needed, report.raw.rows_capacity) << name;
    EXPECT_NE(text.find("ScheduleOptions.load_factor"), std::string::npos) << name << ": " << text;
    EXPECT_NE(text.find("capacity_rows >= 2048"), std::string::npos) << name << ": " << text;
    for (int r = 1; r < 4; ++r)  // no rows there: nothing to overflow, nothing to wait for in vain
      EXPECT_TRUE(harness.status(r).ok()) << name << " rank " << r << ": " << harness.status(r).describe(128, 4, 16);

    harness.reset_status();
    const LayerData balanced = testing::random_layer(shape, 64, 0, 0.05);
    harness.upload(balanced);
    harness.forward();
    check_against_reference(harness, balanced, name + ", balanced routing after the overflow and a reset, seed 64");
  }
}

// A rank whose peer never arrives reports the barrier (rank, role, counter, values) instead of hanging.
TEST(MoeForwardTest, BarrierTimeoutIsReportedNotHung) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 64, 2, 8, 256, 128);
  MoeOptions options;
  options.schedule.wait_timeout_s = 0.2;
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
  harness.upload(testing::random_layer(shape, 65));
  harness.workspace().build_schedule(harness.all_args());
  harness.workspace().forward_with_schedule({&harness.args(0), 1});  // rank 1 never publishes its x
  const StatusReport report = harness.status(0);
  ASSERT_TRUE(report.raw.error_bits & kStatusWaitTimeout) << report.describe(64, 2, 8);
  EXPECT_EQ(report.raw.timeout_rank, 0);
  EXPECT_EQ(report.raw.timeout_role, static_cast<int32_t>(Role::kBarrier));
  EXPECT_EQ(report.raw.timeout_counter, static_cast<int32_t>(CounterId::kBarrierArrived));
  EXPECT_EQ(report.raw.timeout_index, 1);
  std::printf("timeout report: %s\n", report.describe(64, 2, 8).c_str());
}

// Empty when a == b bitwise, else the first differing element (token, column, both values).
std::string first_mismatch(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int hidden) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  for (size_t n = 0; n < a.size(); ++n)
    if (a[n] != b[n])
      return "token " + std::to_string(n / hidden) + ", column " + std::to_string(n % hidden) + ": " +
             std::to_string(a[n]) + " vs " + std::to_string(b[n]);
  return {};
}

// The status word is sticky: layer 1's bad id survives a good layer 2 on the same workspace, until
// reset_status; the next good call then reads ok and gives the bits of a fresh workspace.
TEST(MoeForwardTest, StatusIsStickyUntilReset) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 128, 4, 16, 256, 128);
  const uint64_t seed = 66;
  const LayerData good = testing::random_layer(shape, seed);
  std::vector<std::vector<uint16_t>> fresh;
  {
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
    harness.upload(good);
    fresh = harness.run_checked(1);
  }
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
  LayerData bad = testing::random_layer(shape, seed + 1);
  bad.inputs.topk_idx[(128 + 7) * 4 + 1] = 99;  // layer 1: rank 1, token 7, slot 1
  harness.upload(bad);
  harness.forward();
  harness.upload(good);  // layer 2: good ids
  harness.forward();
  for (int r = 0; r < 2; ++r) {
    const StatusReport report = harness.status(r);
    ASSERT_TRUE(report.raw.error_bits & kStatusBadExpertId) << "seed " << seed << " rank " << r << ": "
                                                            << report.describe(128, 4, 16);
    EXPECT_EQ(report.bad_route(), (128 + 7) * 4 + 1) << report.describe(128, 4, 16);
    EXPECT_EQ(report.bad_expert_id(), 99);
  }
  harness.reset_status();
  harness.forward();
  for (int r = 0; r < 2; ++r) {
    const StatusReport report = harness.status(r);
    ASSERT_TRUE(report.ok()) << "rank " << r << ": " << report.describe(128, 4, 16);
    EXPECT_EQ(first_mismatch(harness.out_bits(r), fresh[r], shape.hidden), "")
        << "shape T=128 k=4 E=16 H=256 I=128 EP=2, seed " << seed << ", rank " << r;
  }
}

// A rank whose peer never arrives: the first barrier wait times out, sets the abort word, and every later
// wait of the step gives up at once, so the failing forward costs about one timeout (the second barrier
// would have cost another). Then reset_status and a good forward on the same workspace give the bits of a
// good forward.
TEST(MoeForwardTest, TimeoutAbortsTheStepAndResetRecovers) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 64, 2, 8, 256, 128);
  for (ForwardPath path : {ForwardPath::kFused, ForwardPath::kUnfused}) {
    SCOPED_TRACE(path == ForwardPath::kFused ? "fused" : "unfused");
    MoeOptions options;
    options.path = path;
    const double timeout_s = 0.5;
    options.schedule.wait_timeout_s = timeout_s;
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape, options);
    harness.upload(testing::random_layer(shape, 67));
    const std::vector<std::vector<uint16_t>> good = harness.run_checked(1);  // also loads every kernel

    harness.poison_outputs();
    const auto start = std::chrono::steady_clock::now();
    harness.workspace().build_schedule(harness.all_args());
    harness.workspace().forward_with_schedule({&harness.args(0), 1});  // rank 1 never publishes its x
    harness.synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const StatusReport report = harness.status(0);
    std::printf("failing forward: %.3f s with a %.1f s timeout; %s\n", seconds, timeout_s,
                report.describe(64, 2, 8).c_str());
    ASSERT_TRUE(report.raw.error_bits & kStatusWaitTimeout) << report.describe(64, 2, 8);
    EXPECT_EQ(report.raw.timeout_role, static_cast<int32_t>(Role::kBarrier)) << report.describe(64, 2, 8);
    EXPECT_EQ(report.raw.timeout_index, 1);
    EXPECT_NE(report.raw.abort, 0u);
    EXPECT_GE(report.raw.abandoned_waits, 1u) << "the second barrier should have given up at once";
    EXPECT_LT(seconds, 1.5 * timeout_s) << "more than one timeout spent";

    // A later call fails fast while the abort is set, and the report keeps the first cause.
    harness.forward();
    harness.synchronize();
    const StatusReport again = harness.status(0);
    EXPECT_EQ(again.raw.timeout_role, static_cast<int32_t>(Role::kBarrier)) << again.describe(64, 2, 8);
    EXPECT_EQ(again.raw.timeout_index, 1);

    harness.reset_status();
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(harness.status(r).ok()) << harness.status(r).describe(64, 2, 8);
    const std::vector<std::vector<uint16_t>> after = harness.run_checked(1);
    for (int r = 0; r < 2; ++r)
      EXPECT_EQ(first_mismatch(after[r], good[r], shape.hidden), "")
          << "T=64 k=2 E=8 H=256 I=128 EP=2 seed 67 rank " << r;
  }
}

// Two layers sharing a workspace, issued back to back on two streams: the workspace orders the second
// behind the first, so the results are bitwise those of the same layers on one stream.
TEST(MoeForwardTest, TwoStreamsAreSerializedByTheWorkspace) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(1, 2048, 4, 16, 512, 256);
  MoeHarness harness(PeerGroup::virtual_ranks(1), shape);
  harness.upload(testing::random_layer(shape, 71));
  const LayerData second = testing::random_layer(shape, 72);
  const int64_t t = shape.num_tokens, k = shape.top_k, h = shape.hidden;
  std::vector<void*> buffers;
  auto device_copy = [&](const void* src, int64_t bytes) {
    void* p = nullptr;
    MOK_CHECK_CUDA(cudaMalloc(&p, bytes));
    if (src != nullptr) MOK_CHECK_CUDA(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
    buffers.push_back(p);
    return p;
  };
  std::vector<uint16_t> x_bits(t * h);
  for (int64_t n = 0; n < t * h; ++n) x_bits[n] = testing::to_bf16_bits(second.inputs.x[n]);
  RankForward layer_a = harness.args(0);
  RankForward layer_b = layer_a;
  ForwardContext context_b = harness.workspace().make_context(0);
  layer_b.x = TensorRef(device_copy(x_bits.data(), t * h * 2), DType::kBFloat16, {t, h});
  layer_b.topk_idx = TensorRef(device_copy(second.inputs.topk_idx.data(), t * k * 4), DType::kInt32, {t, k});
  layer_b.router_weights =
      TensorRef(device_copy(second.inputs.router_weights.data(), t * k * 4), DType::kFloat32, {t, k});
  layer_b.out = TensorRef(device_copy(nullptr, t * h * 2), DType::kBFloat16, {t, h});
  layer_b.context = &context_b;
  cudaStream_t other = nullptr;
  MOK_CHECK_CUDA(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  auto out_b_bits = [&] {
    std::vector<uint16_t> bits(t * h);
    MOK_CHECK_CUDA(cudaMemcpy(bits.data(), layer_b.out.data, t * h * 2, cudaMemcpyDeviceToHost));
    return bits;
  };
  auto run = [&](cudaStream_t stream_b) {
    harness.poison_outputs();
    const std::vector<uint16_t> poison(t * h, testing::kBf16Poison);
    MOK_CHECK_CUDA(cudaMemcpy(layer_b.out.mutable_data(), poison.data(), t * h * 2, cudaMemcpyHostToDevice));
    MOK_CHECK_CUDA(cudaDeviceSynchronize());  // the poison has landed before a non-blocking stream reads it
    layer_b.stream = stream_b;
    for (int rep = 0; rep < 3; ++rep) {  // a few rounds: overlap, had it been possible, shows in one of them
      harness.workspace().forward({&layer_a, 1});
      harness.workspace().forward({&layer_b, 1});
    }
    MOK_CHECK_CUDA(cudaStreamSynchronize(layer_a.stream));
    MOK_CHECK_CUDA(cudaStreamSynchronize(other));
    const StatusReport report = harness.workspace().read_status(0, layer_a.stream);
    EXPECT_TRUE(report.ok()) << report.describe(int(t), int(k), shape.num_experts);
    return std::pair{harness.out_bits(0), out_b_bits()};
  };
  const auto one_stream = run(layer_a.stream);
  const auto two_streams = run(other);
  EXPECT_EQ(first_mismatch(two_streams.first, one_stream.first, int(h)), "") << "layer a, T=2048 H=512 seeds 71/72";
  EXPECT_EQ(first_mismatch(two_streams.second, one_stream.second, int(h)), "") << "layer b, T=2048 H=512 seeds 71/72";
  EXPECT_NE(first_mismatch(one_stream.first, one_stream.second, int(h)), "") << "the two layers' inputs differ";
  MOK_CHECK_CUDA(cudaStreamDestroy(other));
  for (void* p : buffers) MOK_CHECK_CUDA(cudaFree(p));
}

// Full-size shapes at EP=2 (both ranks on this GPU), 8192 tokens per rank, against the fp32 GPU check on
// sampled tokens. Hashed integer data (exact in bf16) keeps the fill on the GPU.
TEST(MoeForwardTest, FullSizeShapesAgainstFp32Check) {
  MOK_REQUIRE_GPUS(1);
  MOK_SKIP_IF_REDUCED();  // tens of GB of weights per shape: far too slow under compute-sanitizer
  std::printf("full size: shape            rank  sampled  worst error / budget\n");
  for (const auto& m : reference::model_shapes()) {
    const MoeShape shape = moe_shape(2, 8192, m.top_k, m.num_experts, m.hidden, m.intermediate, m.shared_expert);
    MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
    // x in [-2, 2] / 2, weights in [-2, 2] / 64: the hidden and output values stay of order one.
    harness.fill_hashed(71, 2, 1.f / 64, 0.5f);
    const auto topk = reference::random_topk_per_rank(2, shape.num_tokens, m.top_k, m.num_experts, 0, 72);
    std::vector<std::vector<float>> weights;
    for (int r = 0; r < 2; ++r)
      weights.push_back(reference::random_routing(shape.num_tokens, m.top_k, m.num_experts, 0, 72 + r).router_weights);
    harness.upload_routing(topk, weights);
    harness.forward();
    std::vector<int32_t> samples;
    for (int t = 0; t < shape.num_tokens; t += 61) samples.push_back(t);
    samples.push_back(shape.num_tokens - 1);
    const std::vector<testing::CheckRank> ranks{harness.check_rank(0), harness.check_rank(1)};
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(harness.status(r).ok()) << harness.status(r).describe(shape.num_tokens, m.top_k, m.num_experts);
      const auto out = harness.out_bits(r);
      const auto ref = testing::check_rows_fp32(shape, ranks, harness.check_shared(r), r, samples);
      std::vector<uint16_t> got;
      for (int32_t t : samples) got.insert(got.end(), out.begin() + int64_t(t) * m.hidden, out.begin() + int64_t(t + 1) * m.hidden);
      const auto result = testing::compare_within_budget(got, ref.data(), int64_t(got.size()));
      EXPECT_LE(result.worst_ratio, 1.0) << m.name << " rank " << r << ": " << result.describe(m.hidden);
      std::printf("full size: %-16s %4d %8zu  %.3f\n", m.name.c_str(), r, samples.size(), result.worst_ratio);
    }
  }
}

// The fp32 GPU check itself, against the CPU reference on a small problem.
TEST(MoeForwardTest, Fp32CheckAgreesWithCpuReference) {
  MOK_REQUIRE_GPUS(1);
  const MoeShape shape = moe_shape(2, 64, 4, 16, 256, 128);
  MoeHarness harness(PeerGroup::virtual_ranks(2), shape);
  const LayerData data = testing::random_layer(shape, 81, 0, 0.1);
  harness.upload(data);
  const reference::ForwardTrace<float> ref = reference::forward(data.shape, data.params, data.inputs);
  std::vector<int32_t> samples;
  for (int t = 0; t < 64; ++t) samples.push_back(t);
  const std::vector<testing::CheckRank> ranks{harness.check_rank(0), harness.check_rank(1)};
  for (int r = 0; r < 2; ++r) {
    const auto check = testing::check_rows_fp32(shape, ranks, harness.check_shared(r), r, samples);
    double worst = 0;
    for (size_t n = 0; n < check.size(); ++n) {
      const double want = ref.out[r * check.size() + n];
      worst = std::max(worst, std::fabs(check[n] - want) / (1e-4 + 1e-4 * std::fabs(want)));
    }
    EXPECT_LE(worst, 1.0) << "rank " << r << ": fp32 check differs from the CPU reference";
  }
}

}  // namespace
}  // namespace mok
