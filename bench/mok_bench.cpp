// mok_bench: the token schedule's benchmark. It builds the token schedule for a model shape on the local
// GPU(s), times it (CUDA events, median), and checks it exactly against the CPU twin. The MoE-layer
// benchmark is bench/layer_bench.py (protocol: docs/perf_notes.md).
//
//   mok_bench [--shape NAME] [--tokens T] [--skew S] [--iters N]
//
// Runs: EP = number of visible GPUs (one rank per GPU, capped at 8) and EP = 8 virtual ranks on GPU 0.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/schedule.h"
#include "reference/routing_gen.h"
#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "tests/common/schedule_harness.h"

namespace {

struct Args {
  std::string shape = "DeepSeek-V4-Pro";
  int tokens = 8192;
  double skew = 0.0;
  int iters = 20;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    if (flag == "--help") {
      std::printf("usage: mok_bench [--shape NAME] [--tokens T] [--skew S] [--iters N]\nshapes:");
      for (const auto& m : mok::reference::model_shapes()) std::printf(" %s", m.name.c_str());
      std::printf("\n");
      std::exit(0);
    }
    if (value == nullptr) { std::fprintf(stderr, "mok_bench: %s needs a value\n", flag.c_str()); std::exit(2); }
    if (flag == "--shape") a.shape = value;
    else if (flag == "--tokens") a.tokens = std::atoi(value);
    else if (flag == "--skew") a.skew = std::atof(value);
    else if (flag == "--iters") a.iters = std::atoi(value);
    else { std::fprintf(stderr, "mok_bench: unknown flag %s\n", flag.c_str()); std::exit(2); }
    ++i;
  }
  return a;
}

struct Result {
  double median_us = 0;
  bool exact = true;
  int64_t rows = 0;
};

// Times gather + build on every rank (slowest rank's stream, per iteration) and checks the last build.
Result run(mok::PeerGroup group, const mok::reference::ModelShape& model, const Args& args) {
  using namespace mok;
  const RoutingShape shape{group.size(), args.tokens, model.top_k, model.num_experts};
  ScheduleOptions options;
  options.load_factor = shape.ep_size;  // the worst case: every route placed whatever --skew (no overflow)
  testing::ScheduleHarness harness(std::move(group), shape, options);
  const auto ids =
      reference::random_topk_per_rank(shape.ep_size, shape.num_tokens, shape.top_k, shape.num_experts, args.skew, 42);
  harness.upload(ids, IndexType::kInt32);
  const int num_streams = harness.group().is_virtual() ? 1 : shape.ep_size;
  std::vector<cudaEvent_t> start(num_streams), stop(num_streams);
  for (int s = 0; s < num_streams; ++s) {
    detail::DeviceGuard guard(harness.group().device(s));
    MOK_CHECK_CUDA(cudaEventCreate(&start[s]));
    MOK_CHECK_CUDA(cudaEventCreate(&stop[s]));
  }
  for (int i = 0; i < 3; ++i) harness.launch();  // warm-up
  harness.synchronize();
  std::vector<double> times;
  for (int it = 0; it < args.iters; ++it) {
    for (int s = 0; s < num_streams; ++s) {
      detail::DeviceGuard guard(harness.group().device(s));
      MOK_CHECK_CUDA(cudaEventRecord(start[s], harness.stream(s)));
    }
    harness.launch();
    for (int s = 0; s < num_streams; ++s) {
      detail::DeviceGuard guard(harness.group().device(s));
      MOK_CHECK_CUDA(cudaEventRecord(stop[s], harness.stream(s)));
    }
    harness.synchronize();
    float slowest = 0;
    for (int s = 0; s < num_streams; ++s) {
      float ms = 0;
      MOK_CHECK_CUDA(cudaEventElapsedTime(&ms, start[s], stop[s]));
      slowest = std::max(slowest, ms);
    }
    times.push_back(slowest * 1e3);
  }
  std::sort(times.begin(), times.end());
  Result result;
  result.median_us = times[times.size() / 2];
  harness.poison();
  harness.launch();
  const auto gpu = harness.download();
  const auto gathered = testing::gather_on_host(ids);
  for (int r = 0; r < shape.ep_size; ++r) {
    const HostSchedule twin = build_schedule_host(shape, options, r, gathered);
    const std::string diff = testing::compare_schedules(twin, gpu[r]);
    if (!diff.empty()) {
      std::printf("MISMATCH rank %d: %s\n", r, diff.c_str());
      result.exact = false;
    }
    result.rows = std::max<int64_t>(result.rows, gpu[r].scheduled_rows);
  }
  for (int s = 0; s < num_streams; ++s) {
    cudaEventDestroy(start[s]);
    cudaEventDestroy(stop[s]);
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  const auto& shapes = mok::reference::model_shapes();
  const auto model = std::find_if(shapes.begin(), shapes.end(), [&](const auto& m) { return m.name == args.shape; });
  if (model == shapes.end()) { std::fprintf(stderr, "mok_bench: unknown shape %s\n", args.shape.c_str()); return 2; }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "mok_bench: no CUDA GPU visible; this program needs a Hopper GPU (see README)\n");
    return 2;
  }
  cudaDeviceProp prop;
  MOK_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("mok_bench: schedule build (all-gather of top-k ids + count + scan + place), checked against CPU\n");
  std::printf("device: %s x %d, shape %s (E=%d, k=%d), %d tokens/rank, skew %.2f, median of %d\n", prop.name, gpus,
              model->name.c_str(), model->num_experts, model->top_k, args.tokens, args.skew, args.iters);
  std::printf("%-20s %4s %12s %12s %8s\n", "ranks", "EP", "rows/rank", "time (us)", "check");
  bool all_exact = true;
  std::vector<int> devices;
  for (int d = 0; d < std::min(gpus, 8); ++d) devices.push_back(d);
  struct Case { std::string name; mok::PeerGroup group; };
  std::vector<Case> cases;
  cases.push_back({devices.size() > 1 ? "GPU peers" : "one GPU", devices.size() > 1 ? mok::PeerGroup::device_peers(devices)
                                                                                    : mok::PeerGroup::virtual_ranks(1)});
  cases.push_back({"virtual ranks, GPU 0", mok::PeerGroup::virtual_ranks(8)});
  for (auto& c : cases) {
    const int ep = c.group.size();
    const Result r = run(std::move(c.group), *model, args);
    all_exact = all_exact && r.exact;
    std::printf("%-20s %4d %12lld %12.1f %8s\n", c.name.c_str(), ep, static_cast<long long>(r.rows), r.median_us,
                r.exact ? "exact" : "WRONG");
  }
  return all_exact ? 0 : 1;
}
