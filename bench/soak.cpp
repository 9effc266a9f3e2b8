// mok_soak: many forward calls of one layer through the public C++ API, each with a fresh routing, to find
// what a short test does not: leaks, results that drift between calls, status errors that show only once in
// a thousand calls (issue 13).
//
//   mok_soak [--calls N] [--shape NAME | E,H,I,k] [--tokens T] [--ep R] [--seed S] [--check-every C]
//            [--leak-mib M]
//
// EP = R virtual ranks on GPU 0 (PeerGroup::virtual_ranks), the fused path with the worst-case capacity (load_factor =
// R), weights and x from the GPU hash filler (integers, exact in bf16). Call c routes with mode c % 3: balanced
// (uniform distinct experts, 1/64 of the routes masked), Zipf-skewed (expert popularity ~ 1 / rank over a seed-shuffled
// order) or one hot expert (every token's first slot). Every call: its status word must be ok. Every C-th call (and the
// last): its outputs (poisoned with one NaN pattern before) must equal, byte for byte, those of an immediate rerun of
// the same inputs (poisoned with another NaN pattern), with no NaN left. Device memory free (cudaMemGetInfo) after the
// warm-up and after the last call must not differ by more than M MiB (default 0), nor before the workspace exists and
// after it is freed by more than M + 2 MiB. Prints time per call (CUDA events: median, p99, max) and one verdict line.
// Exit 0 pass, 1 fail (mismatch, error status, leak, exception), 2 bad arguments, 77 no Hopper GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/moe.h"
#include "reference/routing_gen.h"
#include "src/host/check.h"
#include "tests/common/device_fill.h"
#include "tests/common/gpu_query.h"
#include "tests/common/moe_harness.h"

namespace {

struct Args {
  int calls = 1000;
  std::string shape = "soak";
  int tokens = 2048;
  int ep = 2;
  uint64_t seed = 1;
  int check_every = 100;
  double leak_mib = 0;  // the calls may lose no device memory; freeing the workspace 2 MiB more at most
};

// What the CUDA runtime may keep of a freed workspace (per-stream and per-context bookkeeping), beyond
// --leak-mib. The calls themselves get no such allowance.
constexpr double kLifetimeSlackMib = 2;

// The default: moderate, so 1000 calls take seconds on an H200, yet several experts per rank and CTA pairs.
const mok::reference::ModelShape kSoakShape{"soak", 64, 2048, 1024, 4};

void usage(FILE* to) {
  std::fprintf(to,
               "usage: mok_soak [--calls N] [--shape NAME | E,H,I,k] [--tokens T] [--ep R] [--seed S]\n"
               "                [--check-every C] [--leak-mib M]\n"
               "defaults: --calls 1000 --shape soak (E=64, H=2048, I=1024, k=4) --tokens 2048 --ep 2 --seed 1\n"
               "          --check-every 100 --leak-mib 0\nshapes: soak");
  for (const auto& m : mok::reference::model_shapes()) std::fprintf(to, " %s", m.name.c_str());
  std::fprintf(to, "\n");
}

[[noreturn]] void bad_arguments(const std::string& message) {
  std::fprintf(stderr, "mok_soak: %s\n", message.c_str());
  usage(stderr);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      usage(stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) bad_arguments(flag + " needs a value");
    const char* value = argv[++i];
    if (flag == "--calls") a.calls = std::atoi(value);
    else if (flag == "--shape") a.shape = value;
    else if (flag == "--tokens") a.tokens = std::atoi(value);
    else if (flag == "--ep") a.ep = std::atoi(value);
    else if (flag == "--seed") a.seed = std::strtoull(value, nullptr, 10);
    else if (flag == "--check-every") a.check_every = std::atoi(value);
    else if (flag == "--leak-mib") a.leak_mib = std::atof(value);
    else bad_arguments("unknown flag " + flag);
  }
  if (a.calls < 1 || a.tokens < 1 || a.ep < 1 || a.check_every < 1 || a.leak_mib < 0)
    bad_arguments("--calls, --tokens, --ep and --check-every must be positive, --leak-mib not negative");
  return a;
}

mok::reference::ModelShape find_shape(const std::string& name) {
  if (name == kSoakShape.name) return kSoakShape;
  try {
    return mok::reference::model_shape(name);
  } catch (const std::out_of_range&) {
  }
  mok::reference::ModelShape custom{name, 0, 0, 0, 0};
  if (std::sscanf(name.c_str(), "%d,%d,%d,%d", &custom.num_experts, &custom.hidden, &custom.intermediate,
                  &custom.top_k) == 4)
    return custom;
  bad_arguments("unknown shape " + name);
}

// A cheap generator (splitmix64): the routing of one call is T * k draws per rank, made while the GPU runs.
struct Generator {
  uint64_t state;
  uint64_t next() { return state = mok::testing::mix64(state); }
  int below(int n) { return static_cast<int>(next() % uint64_t(n)); }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
};

enum class RoutingMode { kBalanced = 0, kSkewed = 1, kOneHot = 2 };
constexpr int kNumModes = 3;
RoutingMode mode_of(int call) { return static_cast<RoutingMode>(((call % kNumModes) + kNumModes) % kNumModes); }
const char* mode_name(RoutingMode m) {
  return m == RoutingMode::kBalanced ? "balanced" : m == RoutingMode::kSkewed ? "skewed" : "one-hot";
}

// One rank's top-k ids for one call: distinct experts per token (a taken expert moves to the next free one,
// which keeps the mode's skew), a masked route (-1) now and then in balanced mode. The popular experts (the
// hot one among them) come from `call_seed`, so they are the same on every rank, as a trained router's.
std::vector<int32_t> make_topk(RoutingMode mode, int num_tokens, int top_k, int num_experts, uint64_t call_seed,
                               int rank) {
  Generator gen{call_seed};
  std::vector<double> zipf_cdf;
  std::vector<int32_t> popular(num_experts);  // popularity rank -> expert, shuffled per call
  for (int e = 0; e < num_experts; ++e) popular[e] = e;
  for (int e = num_experts - 1; e > 0; --e) std::swap(popular[e], popular[gen.below(e + 1)]);
  gen.state = mok::testing::mix64(call_seed + 1 + uint64_t(rank));
  if (mode == RoutingMode::kSkewed) {
    double sum = 0;
    for (int e = 0; e < num_experts; ++e) zipf_cdf.push_back(sum += 1.0 / (e + 1));
    for (double& c : zipf_cdf) c /= sum;
  }
  const int hot = popular[0];
  std::vector<int32_t> ids(size_t(num_tokens) * top_k);
  std::vector<char> taken(num_experts, 0);
  for (int t = 0; t < num_tokens; ++t) {
    int32_t* row = ids.data() + size_t(t) * top_k;
    for (int j = 0; j < top_k; ++j) {
      int e = gen.below(num_experts);
      if (mode == RoutingMode::kSkewed)
        e = popular[std::lower_bound(zipf_cdf.begin(), zipf_cdf.end() - 1, gen.uniform()) - zipf_cdf.begin()];
      if (mode == RoutingMode::kOneHot && j == 0) e = hot;
      while (taken[e]) e = (e + 1) % num_experts;
      taken[e] = 1;
      row[j] = e;
    }
    for (int j = 0; j < top_k; ++j) taken[row[j]] = 0;
    if (mode == RoutingMode::kBalanced)
      for (int j = 0; j < top_k; ++j)
        if (gen.below(64) == 0) row[j] = -1;
  }
  return ids;
}

int64_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  MOK_CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(free_bytes);
}

double mib(int64_t bytes) { return double(bytes) / (1 << 20); }

double percentile(std::vector<float> sorted_ms, double p) {
  std::sort(sorted_ms.begin(), sorted_ms.end());
  const size_t i = std::min(sorted_ms.size() - 1, static_cast<size_t>(std::ceil(p * sorted_ms.size())) - 1);
  return sorted_ms[i];
}

bool is_bf16_nan(uint16_t bits) { return (bits & 0x7f80) == 0x7f80 && (bits & 0x007f) != 0; }

struct Soak {
  const Args& args;
  mok::MoeShape shape;
  mok::testing::MoeHarness& harness;
  std::vector<std::vector<float>> router_weights;  // the same every call: the routing is what varies
  int64_t outputs = 0;                             // bf16 elements of one rank's out

  // Every local rank's status word must be ok; reading it synchronizes the stream.
  bool status_ok(int call, const char* what) {
    bool ok = true;
    for (const mok::RankForward& f : harness.all_args()) {
      const mok::StatusReport report = harness.workspace().read_status(f.rank, f.stream);
      if (!report.ok()) {
        std::printf("FAIL call %d (%s), rank %d: status: %s\n", call, what, f.rank,
                    report.describe(shape.num_tokens, shape.top_k, shape.num_experts).c_str());
        ok = false;
      }
    }
    // No reset between calls: the status word is sticky, so each read sees every call since the workspace
    // was made, and the soak stops at the first error.
    return ok;
  }

  void upload_routing(int call) {
    const RoutingMode mode = mode_of(call);
    std::vector<std::vector<int32_t>> topk(shape.ep_size);
    for (int r = 0; r < shape.ep_size; ++r)
      topk[r] = make_topk(mode, shape.num_tokens, shape.top_k, shape.num_experts,
                          mok::testing::mix64(args.seed * 0x9e3779b97f4a7c15ull + uint64_t(call) * 131), r);
    harness.synchronize();  // the previous call has read its ids (upload_routing copies synchronously)
    harness.upload_routing(topk, router_weights);
  }

  void poison(uint16_t pattern) {
    const std::vector<uint16_t> bits(outputs, pattern);
    for (const mok::RankForward& f : harness.all_args())
      MOK_CHECK_CUDA(cudaMemcpy(f.out.mutable_data(), bits.data(), outputs * 2, cudaMemcpyHostToDevice));
  }

  // The call's outputs against a rerun of the same inputs, byte for byte; the two runs start from
  // different NaN patterns, so an output element that neither writes differs too.
  bool rerun_matches(int call) {
    std::vector<std::vector<uint16_t>> first;
    for (const mok::RankForward& f : harness.all_args()) first.push_back(harness.out_bits(f.rank));
    poison(0xffa5);
    harness.workspace().forward(harness.all_args());
    if (!status_ok(call, "rerun")) return false;
    bool equal = true;
    for (size_t n = 0; n < first.size(); ++n) {
      const int rank = harness.all_args()[n].rank;
      const std::vector<uint16_t> second = harness.out_bits(rank);
      if (std::memcmp(first[n].data(), second.data(), outputs * 2) != 0) {
        const auto diff = std::mismatch(first[n].begin(), first[n].end(), second.begin());
        const int64_t index = diff.first - first[n].begin();
        std::printf("FAIL call %d (%s), rank %d: rerun differs at token %lld, column %lld (0x%04x, rerun 0x%04x); "
                    "seed %llu\n", call, mode_name(mode_of(call)), rank,
                    static_cast<long long>(index / shape.hidden), static_cast<long long>(index % shape.hidden),
                    *diff.first, *diff.second, static_cast<unsigned long long>(args.seed));
        equal = false;
      }
      const int64_t nans = std::count_if(second.begin(), second.end(), is_bf16_nan);
      if (nans > 0) {
        std::printf("FAIL call %d, rank %d: %lld NaN outputs (unwritten rows?)\n", call, rank,
                    static_cast<long long>(nans));
        equal = false;
      }
    }
    return equal;
  }
};

mok::MoeShape layer_shape(const Args& args, const mok::reference::ModelShape& model) {
  const mok::MoeShape shape = mok::testing::moe_shape(args.ep, args.tokens, model.top_k, model.num_experts,
                                                      model.hidden, model.intermediate, model.shared_expert);
  try {
    shape.validate();
  } catch (const std::invalid_argument& e) {
    bad_arguments(std::string("shape: ") + e.what());
  }
  return shape;
}

int run(const Args& args, const mok::reference::ModelShape& model, const mok::MoeShape& shape) {
  cudaDeviceProp prop;
  MOK_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("mok_soak: %d forward calls (fused), %s x1, shape %s (E=%d, H=%d, I=%d, k=%d), %d tokens/rank, "
              "EP=%d virtual ranks, seed %llu, rerun check every %d calls\n",
              args.calls, prop.name, model.name.c_str(), model.num_experts, model.hidden, model.intermediate,
              model.top_k, args.tokens, args.ep, static_cast<unsigned long long>(args.seed), args.check_every);

  MOK_CHECK_CUDA(cudaFree(nullptr));  // the context, before the first measurement
  const int64_t free_at_start = free_device_bytes();
  int64_t free_before = 0, free_after = 0;
  std::vector<float> times_ms;
  int failures = 0, checks = 0, calls_done = 0;
  {
    // The worst-case capacity (load_factor = EP): one-hot calls send every token's first slot to one expert,
    // more than the default's twice the balanced rows on its rank at EP > 2.
    mok::MoeOptions options;
    options.schedule.load_factor = args.ep;
    mok::testing::MoeHarness harness(mok::PeerGroup::virtual_ranks(args.ep), shape, options);
    // x in [-2, 2] / 2, weights in [-2, 2] / 64 (as the full-size tests): outputs of order one, no overflow.
    harness.fill_hashed(args.seed * 1000 + 7, 2, 1.f / 64, 0.5f);
    Soak soak{args, shape, harness, {}, int64_t(args.tokens) * model.hidden};
    for (int r = 0; r < args.ep; ++r)
      soak.router_weights.push_back(
          mok::reference::random_routing(args.tokens, model.top_k, model.num_experts, 0, args.seed + r).router_weights);
    const cudaStream_t stream = harness.all_args().front().stream;  // virtual ranks: one stream for all
    cudaEvent_t start, stop;
    MOK_CHECK_CUDA(cudaEventCreate(&start));
    MOK_CHECK_CUDA(cudaEventCreate(&stop));

    // Warm-up, not counted: one call per routing mode, the last one checked (calls -2, -1, 0).
    for (int call = 1 - kNumModes; call <= 0; ++call) {
      soak.upload_routing(call);
      soak.poison(0x7fc1);
      harness.workspace().forward(harness.all_args());
      if (!soak.status_ok(call, "warm-up")) return 1;
    }
    if (!soak.rerun_matches(0)) return 1;
    harness.synchronize();
    free_before = free_device_bytes();

    for (int call = 1; call <= args.calls && failures == 0; ++call) {
      const bool checked = call % args.check_every == 0 || call == args.calls;
      soak.upload_routing(call);
      if (checked) soak.poison(0x7fc1);
      MOK_CHECK_CUDA(cudaEventRecord(start, stream));
      harness.workspace().forward(harness.all_args());
      MOK_CHECK_CUDA(cudaEventRecord(stop, stream));
      if (!soak.status_ok(call, mode_name(mode_of(call)))) ++failures;
      float ms = 0;
      MOK_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      times_ms.push_back(ms);
      ++calls_done;
      if (checked && failures == 0) {
        ++checks;
        if (!soak.rerun_matches(call)) ++failures;
        else
          std::printf("call %5d: %-8s rerun bitwise equal, status ok, %.3f ms\n", call,
                      mode_name(mode_of(call)), ms);
      }
    }
    harness.synchronize();
    free_after = free_device_bytes();
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
  const int64_t free_at_end = free_device_bytes();

  const double median = percentile(times_ms, 0.5), p99 = percentile(times_ms, 0.99);
  const double worst = *std::max_element(times_ms.begin(), times_ms.end());
  std::printf("time per call (ms, %d calls): median %.3f, p99 %.3f, max %.3f\n", calls_done, median, p99, worst);
  const int64_t steady_drop = free_before - free_after, lifetime_drop = free_at_start - free_at_end;
  std::printf("device memory free: %.1f MiB before the calls, %.1f after (dropped %.3f MiB); %.1f before the "
              "workspace, %.1f after freeing it (dropped %.3f MiB); tolerance %.3f / %.3f MiB\n",
              mib(free_before), mib(free_after), mib(steady_drop), mib(free_at_start), mib(free_at_end),
              mib(lifetime_drop), args.leak_mib, args.leak_mib + kLifetimeSlackMib);
  const bool leak = mib(steady_drop) > args.leak_mib || mib(lifetime_drop) > args.leak_mib + kLifetimeSlackMib;
  if (leak) std::printf("FAIL: device memory leaked\n");
  const bool pass = failures == 0 && !leak && calls_done == args.calls;
  std::printf("mok_soak: %s: %d/%d calls, %d rerun checks%s, status %s, memory %s, median %.3f ms per call\n",
              pass ? "PASS" : "FAIL", calls_done, args.calls, checks, failures == 0 ? " bitwise equal" : "",
              failures == 0 ? "ok" : "ERRORS", leak ? "LEAKED" : "steady", median);
  return pass ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines reach a log as they happen
  const Args args = parse(argc, argv);
  const mok::reference::ModelShape model = find_shape(args.shape);
  const mok::MoeShape shape = layer_shape(args, model);
  // Every kernel loaded when the context is made, so module loading does not look like a leak.
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  std::string reason;
  if (mok::testing::hopper_gpus(1, &reason) < 1) {
    std::printf("mok_soak: SKIPPED: %s; this program needs a Hopper GPU\n", reason.c_str());
    return 77;
  }
  try {
    return run(args, model, shape);
  } catch (const std::exception& e) {
    std::printf("mok_soak: FAIL: %s\n", e.what());
    return 1;
  }
}
