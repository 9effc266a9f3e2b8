// Expert grouped GEMM (src/device/gemm/expert_gemm.cuh) against the CPU: bitwise on integer-valued inputs
// (every fp32 partial sum is exact, both sides round once to bf16 with round-to-nearest-even), within a
// stated budget for random normal inputs and for SwiGLU (the GPU uses __expf). Outputs are poisoned with
// NaN first: padding rows must come back as zeros, rows past the schedule must stay untouched.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include "mok/expert_gemm.h"
#include "mok/schedule.h"
#include "reference/routing_gen.h"
#include "src/host/check.h"
#include "tests/common/device_fill.h"
#include "tests/common/gpu_env.h"
#include "tests/common/bf16.h"
#include "tests/common/schedule_harness.h"

namespace mok {
namespace {

using testing::hashed_int;

using testing::from_bf16_bits;
using testing::to_bf16_bits;
constexpr uint16_t kPoison = testing::kBf16Poison;

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceArray(size_t n) : count(n) { MOK_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T))); }
  DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  void upload(const std::vector<T>& host) {
    MOK_CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count);
    MOK_CHECK_CUDA(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

// Expert segments padded to tile_m rows, as the schedule lays them out.
struct Segments {
  std::vector<int32_t> counts, offsets;
  int32_t rows = 0;
  int tile_m;
  Segments(const std::vector<int32_t>& c, int tile) : counts(c), offsets(c.size() + 1, 0), tile_m(tile) {
    for (size_t e = 0; e < c.size(); ++e) offsets[e + 1] = offsets[e] + (c[e] + tile - 1) / tile * tile;
    rows = offsets.back();
  }
  int expert_of(int64_t row) const {
    return static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), row) - offsets.begin()) - 1;
  }
  bool is_real(int64_t row) const {
    const int e = expert_of(row);
    return row - offsets[e] < counts[e];
  }
};

// Everything one GEMM call needs on the device, with the schedule's three arrays.
struct GemmFixture {
  Segments seg;
  int64_t a_rows;
  DeviceArray<int32_t> counts, offsets, scheduled, ticket{1};
  GemmFixture(const std::vector<int32_t>& expert_counts, int64_t spare_rows, int tile_m = 128)
      : seg(expert_counts, tile_m), a_rows(seg.rows + spare_rows), counts(seg.counts), offsets(seg.offsets),
        scheduled(std::vector<int32_t>{seg.rows}) {}
  ExpertGemmArgs args(GemmEpilogue epilogue, const void* a, int k, const void* b, int n, void* out) const {
    ExpertGemmArgs g;
    g.epilogue = epilogue;
    g.a = a;
    g.a_rows = a_rows;
    g.k = k;
    g.b = b;
    g.n = n;
    g.local_experts = static_cast<int>(seg.counts.size());
    g.expert_counts = counts.ptr;
    g.expert_row_offsets = offsets.ptr;
    g.scheduled_rows = scheduled.ptr;
    g.tile_m = seg.tile_m;
    g.out = out;
    g.ticket = ticket.ptr;
    return g;
  }
};

std::vector<uint16_t> hashed_bf16(size_t count, uint64_t seed, int lo, int hi) {
  std::vector<uint16_t> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = to_bf16_bits(static_cast<float>(hashed_int(seed, int64_t(i), lo, hi)));
  return v;
}

// CPU reference of one output element: row `row` of A [., k] times row `w_row` of W [., k], in double.
double cpu_dot(const std::vector<uint16_t>& a, int64_t row, const std::vector<uint16_t>& w, int64_t w_row, int k) {
  double sum = 0;
  for (int kk = 0; kk < k; ++kk) sum += double(from_bf16_bits(a[row * k + kk])) * from_bf16_bits(w[w_row * k + kk]);
  return sum;
}

std::string where(const std::string& what, int64_t row, int64_t col, float got, double want) {
  return what + ": first mismatch at row " + std::to_string(row) + " col " + std::to_string(col) + ": got " +
         std::to_string(got) + ", expected " + std::to_string(want);
}

// Checks rows past the schedule are untouched and padding rows are zero; returns "" or the first failure.
std::string check_layout(const std::vector<uint16_t>& out, const Segments& seg, int64_t a_rows, int n) {
  for (int64_t row = 0; row < a_rows; ++row) {
    const bool scheduled = row < seg.rows;
    const bool padding = scheduled && !seg.is_real(row);
    for (int c = 0; c < n; ++c) {
      const uint16_t bits = out[row * n + c];
      if (!scheduled && bits != kPoison) return where("row past the schedule was written", row, c, from_bf16_bits(bits), NAN);
      if (padding && bits != 0) return where("padding row not zero", row, c, from_bf16_bits(bits), 0);
    }
  }
  return {};
}

TEST(ExpertGemmTest, StoreIsBitwiseExactForEdgeRowCounts) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> expert_counts = {0, 1, 63, 129, 3000, 0, 128, 7};
  const int k = 512, n = 512;
  for (int tile_m : {128, 64}) for (bool scaled : {false, true}) {
    const uint64_t seed = (scaled ? 11 : 10) + tile_m;
    GemmFixture fx(expert_counts, 256, tile_m);
    const auto a = hashed_bf16(size_t(fx.a_rows) * k, seed, -2, 2);
    const auto w = hashed_bf16(expert_counts.size() * n * k, seed + 100, -2, 2);
    std::vector<float> scale(fx.a_rows);
    for (int64_t r = 0; r < fx.a_rows; ++r) scale[r] = std::ldexp(1.0f, hashed_int(seed, r, -3, 3));
    DeviceArray<uint16_t> d_a(a), d_w(w), d_out(size_t(fx.a_rows) * n);
    DeviceArray<float> d_scale(scale);
    MOK_CHECK_CUDA(cudaMemcpy(d_out.ptr, std::vector<uint16_t>(d_out.count, kPoison).data(), d_out.count * 2, cudaMemcpyHostToDevice));
    ExpertGemmArgs args = fx.args(GemmEpilogue::kStore, d_a.ptr, k, d_w.ptr, n, d_out.ptr);
    if (scaled) args.row_scale = d_scale.ptr;
    args.cluster_n = 1;
    expert_gemm(args, nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    const auto out = d_out.download();
    ASSERT_EQ(check_layout(out, fx.seg, fx.a_rows, n), "") << "seed " << seed;
    // Pairs of CTAs sharing the A tile must give the same bits (checked against the CPU through `out`).
    d_out.upload(std::vector<uint16_t>(d_out.count, kPoison));
    args.cluster_n = 2;
    expert_gemm(args, nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    ASSERT_EQ(d_out.download(), out) << "cluster_n 2 differs from cluster_n 1, seed " << seed;
    for (int64_t row = 0; row < fx.seg.rows; ++row) {
      if (!fx.seg.is_real(row)) continue;
      const int e = fx.seg.expert_of(row);
      for (int c = 0; c < n; ++c) {
        const double sum = cpu_dot(a, row, w, int64_t(e) * n + c, k);
        const float want = static_cast<float>(sum) * (scaled ? scale[row] : 1.0f);
        ASSERT_EQ(out[row * n + c], to_bf16_bits(want))
            << where("store", row, c, from_bf16_bits(out[row * n + c]), want) << " (expert " << e << ", seed " << seed
            << ", scaled " << scaled << ", tile_m " << tile_m << ")";
      }
    }
  }
}

// The task ticket and its rings: every slot is recorded in the per-tile trace by both CTAs of a cluster,
// with the tile the walker assigns to it (a lost slot leaves its tile unwritten, which this output check
// alone would not see: reruns are compared with the first run, not with the CPU). More slots than
// clusters, so clusters come back to the ticket. Reruns, in whatever order the clusters take the slots,
// give the same bits; the tiles' values are checked against the CPU in the tests above.
TEST(ExpertGemmTest, TicketHandsEveryTileToOneClusterOnce) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> expert_counts = {0, 1, 63, 129, 3000, 0, 128, 7, 700, 450};
  const int k = 256, n = 2048, cluster_n = 2, groups = n / 256 / cluster_n;
  GemmFixture fx(expert_counts, 0, 64);
  int64_t slots = 0;
  for (int32_t c : expert_counts) slots += (c + 127) / 128 * groups;
  const auto a = hashed_bf16(size_t(fx.a_rows) * k, 31, -2, 2);
  const auto w = hashed_bf16(expert_counts.size() * n * k, 32, -2, 2);
  DeviceArray<uint16_t> d_a(a), d_w(w), d_out(size_t(fx.a_rows) * n);
  DeviceArray<uint64_t> d_trace(size_t(slots) * cluster_n * 4);
  d_trace.upload(std::vector<uint64_t>(d_trace.count, 0));
  d_out.upload(std::vector<uint16_t>(d_out.count, kPoison));
  ExpertGemmArgs args = fx.args(GemmEpilogue::kStore, d_a.ptr, k, d_w.ptr, n, d_out.ptr);
  args.cluster_n = cluster_n;
  args.trace = d_trace.ptr;
  expert_gemm(args, nullptr);
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
  const auto first = d_out.download();
  ASSERT_EQ(check_layout(first, fx.seg, fx.a_rows, n), "");

  // Expected: slot by slot in the walker's order (expert, group, m-tile), each CTA rank once.
  const auto trace = d_trace.download();
  int64_t slot = 0;
  for (size_t e = 0; e < expert_counts.size(); ++e) {
    const int m_tiles = (expert_counts[e] + 127) / 128;
    for (int g = 0; g < groups; ++g) {
      for (int m = 0; m < m_tiles; ++m, ++slot) {
        for (int rank = 0; rank < cluster_n; ++rank) {
          const uint64_t* r = &trace[(size_t(slot) * cluster_n + rank) * 4];
          const std::string at = "slot " + std::to_string(slot) + " CTA " + std::to_string(rank);
          ASSERT_GT(r[1], 0u) << at << ": no tile recorded";
          EXPECT_LE(r[0], r[1]) << at;
          const uint64_t key = (uint64_t(e) << 48) | (uint64_t(g) << 32) | uint64_t(fx.seg.offsets[e] + 128 * m);
          EXPECT_EQ(r[3], key) << at << ": expected expert " << e << ", group " << g << ", m-tile " << m;
        }
      }
    }
  }
  ASSERT_EQ(slot, slots);

  d_out.upload(std::vector<uint16_t>(d_out.count, kPoison));
  args.trace = nullptr;
  for (int rerun = 0; rerun < 3; ++rerun) {
    expert_gemm(args, nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    ASSERT_EQ(d_out.download(), first) << "rerun " << rerun << " differs";
  }
}

TEST(ExpertGemmTest, SwiGLUFusedAndSeparateWeightsWithinBudget) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> expert_counts = {129, 0, 1, 255, 64};
  const int k = 256, n = 256;  // n = intermediate size
  const uint64_t seed = 21;
  for (float limit : {0.0f, 3.0f}) {
    GemmFixture fx(expert_counts, 128, limit > 0 ? 64 : 128);
    const int num_experts = static_cast<int>(expert_counts.size());
    const auto a = hashed_bf16(size_t(fx.a_rows) * k, seed, -1, 1);
    const auto w_gate = hashed_bf16(size_t(num_experts) * n * k, seed + 1, -1, 1);
    const auto w_up = hashed_bf16(size_t(num_experts) * n * k, seed + 2, -1, 1);
    std::vector<uint16_t> w_fused;  // [E, 2n, k]: gate rows then up rows per expert
    for (int e = 0; e < num_experts; ++e) {
      w_fused.insert(w_fused.end(), w_gate.begin() + size_t(e) * n * k, w_gate.begin() + size_t(e + 1) * n * k);
      w_fused.insert(w_fused.end(), w_up.begin() + size_t(e) * n * k, w_up.begin() + size_t(e + 1) * n * k);
    }
    DeviceArray<uint16_t> d_a(a), d_gate(w_gate), d_up(w_up), d_fused(w_fused);
    DeviceArray<uint16_t> out_fused(size_t(fx.a_rows) * n), out_separate(size_t(fx.a_rows) * n);
    const std::vector<uint16_t> poison(out_fused.count, kPoison);
    out_fused.upload(poison);
    out_separate.upload(poison);
    ExpertGemmArgs fused = fx.args(GemmEpilogue::kSwiGLU, d_a.ptr, k, d_fused.ptr, n, out_fused.ptr);
    fused.swiglu_limit = limit;
    ExpertGemmArgs separate = fx.args(GemmEpilogue::kSwiGLU, d_a.ptr, k, d_gate.ptr, n, out_separate.ptr);
    separate.b_up = d_up.ptr;
    separate.swiglu_limit = limit;
    separate.cluster_n = 1;  // fused: chosen (2 here), separate: single CTAs
    ASSERT_EQ(choose_cluster_n(GemmEpilogue::kSwiGLU, n), 2);
    expert_gemm(fused, nullptr);
    expert_gemm(separate, nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    const auto got = out_fused.download();
    ASSERT_EQ(got, out_separate.download()) << "fused weights in clusters of 2 and separate weights in single "
                                               "CTAs must give the same bits";
    ASSERT_EQ(check_layout(got, fx.seg, fx.a_rows, n), "");
    // Budget: bf16 output rounding (2^-9 relative) plus __expf (a few ulp): 1/128 relative + 1e-3 absolute.
    for (int64_t row = 0; row < fx.seg.rows; ++row) {
      if (!fx.seg.is_real(row)) continue;
      const int e = fx.seg.expert_of(row);
      for (int c = 0; c < n; ++c) {
        double g = cpu_dot(a, row, w_gate, int64_t(e) * n + c, k);
        double u = cpu_dot(a, row, w_up, int64_t(e) * n + c, k);
        if (limit > 0) { g = std::min<double>(g, limit); u = std::clamp<double>(u, -limit, limit); }
        const double want = g / (1 + std::exp(-g)) * u;
        const float value = from_bf16_bits(got[row * n + c]);
        ASSERT_FALSE(std::isnan(value)) << where("swiglu NaN", row, c, value, want);
        ASSERT_LE(std::abs(value - want), std::abs(want) / 128 + 1e-3)
            << where("swiglu", row, c, value, want) << " limit " << limit << " seed " << seed;
      }
    }
  }
}

TEST(ExpertGemmTest, RandomNormalInputsWithinBudget) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> expert_counts = {300, 17, 0, 520};
  const int k = 1024, n = 768;  // three output tiles: single CTAs (clusters need pairs)
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  GemmFixture fx(expert_counts, 0);
  std::vector<uint16_t> a(size_t(fx.a_rows) * k), w(expert_counts.size() * n * k);
  for (auto& v : a) v = to_bf16_bits(normal(rng));
  for (auto& v : w) v = to_bf16_bits(normal(rng) / 32.f);
  DeviceArray<uint16_t> d_a(a), d_w(w), d_out(size_t(fx.a_rows) * n);
  d_out.upload(std::vector<uint16_t>(d_out.count, kPoison));
  expert_gemm(fx.args(GemmEpilogue::kStore, d_a.ptr, k, d_w.ptr, n, d_out.ptr), nullptr);
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
  const auto out = d_out.download();
  ASSERT_EQ(check_layout(out, fx.seg, fx.a_rows, n), "");
  double err2 = 0, ref2 = 0, worst = 0;
  for (int64_t row = 0; row < fx.seg.rows; ++row) {
    if (!fx.seg.is_real(row)) continue;
    const int e = fx.seg.expert_of(row);
    for (int c = 0; c < n; ++c) {
      const double want = cpu_dot(a, row, w, int64_t(e) * n + c, k);
      const double got = from_bf16_bits(out[row * n + c]);
      ASSERT_FALSE(std::isnan(got)) << where("NaN", row, c, float(got), want);
      err2 += (got - want) * (got - want);
      ref2 += want * want;
      worst = std::max(worst, std::abs(got - want) / (std::abs(want) + 1e-2));
    }
  }
  // Budget: bf16 rounding of the output, 2^-9 relative per element; fp32 accumulation adds ~1e-6.
  EXPECT_LT(std::sqrt(err2 / ref2), 4e-3) << "relative L2 error, seed 5";
  EXPECT_LT(worst, 1.0 / 128) << "worst element error relative to |ref| + 0.01, seed 5";
}

// The four model shapes at EP = 2 (rank 0's rows of an 8192-token-per-rank routing): gate/up with the
// SwiGLU epilogue (K = H, n = I, fused weights) and down (K = I, n = H), sampled rows checked on the CPU.
TEST(ExpertGemmTest, ModelShapesAtEp2RowCounts) {
  MOK_REQUIRE_GPUS(1);
  MOK_SKIP_IF_REDUCED();  // full-size expert weights (tens of GB to fill): far too slow under compute-sanitizer
  for (const auto& model : reference::model_shapes()) {
    const RoutingShape shape{2, 8192, model.top_k, model.num_experts};
    const auto ids = reference::random_topk_per_rank(2, 8192, model.top_k, model.num_experts, 0.0, 70);
    ScheduleOptions options;
    // 128-row padding for one shape keeps it covered at full size; the rest use the default (64).
    if (model.name == "Qwen3.5-397B") options.tile_m = 128;
    const HostSchedule schedule = build_schedule_host(shape, options, 0, testing::gather_on_host(ids));
    GemmFixture fx(schedule.expert_counts, 0, options.tile_m);
    const int num_experts = shape.local_experts(), h = model.hidden, inter = model.intermediate;
    const uint64_t seed = 300 + model.num_experts;
    DeviceArray<uint16_t> d_x(size_t(fx.a_rows) * h), d_w13(size_t(num_experts) * 2 * inter * h),
        d_w2(size_t(num_experts) * h * inter), d_hidden(size_t(fx.a_rows) * inter), d_y(size_t(fx.a_rows) * h);
    testing::fill_hashed_bf16(d_x.ptr, d_x.count, seed, -1, 1, nullptr);
    testing::fill_hashed_bf16(d_w13.ptr, d_w13.count, seed + 1, -1, 1, nullptr);
    testing::fill_hashed_bf16(d_w2.ptr, d_w2.count, seed + 2, -2, 2, nullptr);
    testing::fill_hashed_bf16(d_hidden.ptr, d_hidden.count, seed + 3, -2, 2, nullptr);  // down's input
    MOK_CHECK_CUDA(cudaMemset(d_y.ptr, 0xff, d_y.count * 2));
    expert_gemm(fx.args(GemmEpilogue::kSwiGLU, d_x.ptr, h, d_w13.ptr, inter, d_hidden.ptr), nullptr);
    // The down GEMM reads a separate integer buffer so its check stays bitwise.
    DeviceArray<uint16_t> d_down_in(size_t(fx.a_rows) * inter);
    testing::fill_hashed_bf16(d_down_in.ptr, d_down_in.count, seed + 3, -2, 2, nullptr);
    expert_gemm(fx.args(GemmEpilogue::kStore, d_down_in.ptr, inter, d_w2.ptr, h, d_y.ptr), nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    const auto hidden = d_hidden.download();
    const auto y = d_y.download();
    // Sample rows: first and last real row of a few experts spread over the range.
    std::vector<int64_t> rows;
    for (int e = 0; e < num_experts; e += std::max(1, num_experts / 6))
      if (fx.seg.counts[e] > 0) {
        rows.push_back(fx.seg.offsets[e]);
        rows.push_back(fx.seg.offsets[e] + fx.seg.counts[e] - 1);
      }
    for (int64_t row : rows) {
      const int e = fx.seg.expert_of(row);
      for (int c = 0; c < inter; ++c) {
        double g = 0, u = 0;
        for (int kk = 0; kk < h; ++kk) {
          const double x = hashed_int(seed, row * h + kk, -1, 1);
          g += x * hashed_int(seed + 1, (int64_t(e) * 2 * inter + c) * h + kk, -1, 1);
          u += x * hashed_int(seed + 1, (int64_t(e) * 2 * inter + inter + c) * h + kk, -1, 1);
        }
        const double want = g / (1 + std::exp(-g)) * u;
        const float got = from_bf16_bits(hidden[row * inter + c]);
        ASSERT_LE(std::abs(got - want), std::abs(want) / 128 + 1e-3)
            << model.name << " gate/up " << where("swiglu", row, c, got, want) << " seed " << seed;
      }
      for (int c = 0; c < h; ++c) {
        double sum = 0;
        for (int kk = 0; kk < inter; ++kk)
          sum += double(hashed_int(seed + 3, row * inter + kk, -2, 2)) *
                 hashed_int(seed + 2, (int64_t(e) * h + c) * inter + kk, -2, 2);
        ASSERT_EQ(y[row * h + c], to_bf16_bits(static_cast<float>(sum)))
            << model.name << " down " << where("store", row, c, from_bf16_bits(y[row * h + c]), sum) << " seed " << seed;
      }
    }
    // Every scheduled row of both outputs: no NaN; padding rows zero.
    for (int64_t row = 0; row < fx.seg.rows; ++row) {
      const bool real = fx.seg.is_real(row);
      for (int c = 0; c < h; ++c) {
        const uint16_t bits = y[row * h + c];
        ASSERT_TRUE(real ? !std::isnan(from_bf16_bits(bits)) : bits == 0)
            << model.name << " down row " << row << " col " << c << (real ? " is NaN" : " padding not zero");
      }
      for (int c = 0; c < inter; ++c) {
        const uint16_t bits = hidden[row * inter + c];
        ASSERT_TRUE(real ? !std::isnan(from_bf16_bits(bits)) : bits == 0)
            << model.name << " gate/up row " << row << " col " << c << (real ? " is NaN" : " padding not zero");
      }
    }
    std::printf("%-16s rows %6d (tile_m %d, %zu sampled) experts %d: gate/up and down checked\n",
                model.name.c_str(), fx.seg.rows, options.tile_m, rows.size(), num_experts);
  }
}

// n and k multiples of 64 but not of the tiles (gpt-oss: H = I = 2880): the last n-block is partial. Its B
// rows run into the next expert's (or past the last expert: TMA zero fill), its columns past n must not be
// stored. Integer inputs: the store is bitwise against the CPU, SwiGLU within its budget; every column of
// every row is checked (outputs poisoned), fused and separate gate/up weights, single CTAs and pairs.
TEST(ExpertGemmTest, PartialOutputTilesForMultiplesOf64) {
  MOK_REQUIRE_GPUS(1);
  struct Case {
    std::vector<int32_t> expert_counts;
    int k, n;
  };
  // k = 192: three K blocks, not a multiple of 128 either; k = 64: one K block. One expert of n = 64 rows:
  // fewer weight rows than the 128-row TMA box.
  std::vector<Case> cases;
  for (int n : {64, 320, 448, 2880}) cases.push_back({{65, 0, 130, 1}, 192, n});
  for (int n : {64, 192}) cases.push_back({{33}, 64, n});
  cases.push_back({{33, 5}, 64, 64});
  for (const Case& test_case : cases) {
    const std::vector<int32_t>& expert_counts = test_case.expert_counts;
    const int num_experts = static_cast<int>(expert_counts.size());
    const int k = test_case.k, n = test_case.n;
    const uint64_t seed = 40 + n + k;
    GemmFixture fx(expert_counts, 64, 64);
    const auto a = hashed_bf16(size_t(fx.a_rows) * k, seed, -2, 2);
    const auto w = hashed_bf16(size_t(num_experts) * 2 * n * k, seed + 1, -1, 1);  // store: first E*n rows
    DeviceArray<uint16_t> d_a(a), d_w(w), d_out(size_t(fx.a_rows) * n);
    const std::vector<uint16_t> poison(d_out.count, kPoison);
    // Store: every cluster size the tile count allows, bitwise equal to the CPU.
    for (int cluster_n : {1, 2}) {
      if (cluster_n == 2 && choose_cluster_n(GemmEpilogue::kStore, n) != 2) continue;
      d_out.upload(poison);
      ExpertGemmArgs args = fx.args(GemmEpilogue::kStore, d_a.ptr, k, d_w.ptr, n, d_out.ptr);
      args.cluster_n = cluster_n;
      expert_gemm(args, nullptr);
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
      const auto out = d_out.download();
      ASSERT_EQ(check_layout(out, fx.seg, fx.a_rows, n), "") << "store n " << n << " k " << k << " cluster " << cluster_n;
      for (int64_t row = 0; row < fx.seg.rows; ++row) {
        if (!fx.seg.is_real(row)) continue;
        const int e = fx.seg.expert_of(row);
        for (int c = 0; c < n; ++c) {
          const float want = static_cast<float>(cpu_dot(a, row, w, int64_t(e) * n + c, k));
          ASSERT_EQ(out[row * n + c], to_bf16_bits(want))
              << where("store", row, c, from_bf16_bits(out[row * n + c]), want) << " n " << n << " k " << k << " experts "
              << num_experts << " cluster "
              << cluster_n << " seed " << seed;
        }
      }
    }
    // SwiGLU with fused weights [E, 2n, k] and with separate ones (gate = the first E*n rows, up = the rest).
    DeviceArray<uint16_t> d_up(std::vector<uint16_t>(w.begin() + size_t(num_experts) * n * k, w.end()));
    for (bool fused : {true, false}) {
      for (int cluster_n : {1, 2}) {
        if (cluster_n == 2 && choose_cluster_n(GemmEpilogue::kSwiGLU, n) != 2) continue;
        d_out.upload(poison);
        ExpertGemmArgs args = fx.args(GemmEpilogue::kSwiGLU, d_a.ptr, k, d_w.ptr, n, d_out.ptr);
        if (!fused) args.b_up = d_up.ptr;
        args.cluster_n = cluster_n;
        expert_gemm(args, nullptr);
        MOK_CHECK_CUDA(cudaDeviceSynchronize());
        const auto out = d_out.download();
        ASSERT_EQ(check_layout(out, fx.seg, fx.a_rows, n), "") << "swiglu n " << n << " k " << k << " fused " << fused;
        for (int64_t row = 0; row < fx.seg.rows; ++row) {
          if (!fx.seg.is_real(row)) continue;
          const int e = fx.seg.expert_of(row);
          for (int c = 0; c < n; ++c) {
            const int64_t gate_row = fused ? int64_t(e) * 2 * n + c : int64_t(e) * n + c;
            const int64_t up_row = fused ? gate_row + n : int64_t(num_experts) * n + gate_row;
            const double g = cpu_dot(a, row, w, gate_row, k), u = cpu_dot(a, row, w, up_row, k);
            const double want = g / (1 + std::exp(-g)) * u;
            const float value = from_bf16_bits(out[row * n + c]);
            ASSERT_FALSE(std::isnan(value)) << where("swiglu NaN", row, c, value, want);
            ASSERT_LE(std::abs(value - want), std::abs(want) / 128 + 1e-3)
                << where("swiglu", row, c, value, want) << " n " << n << " k " << k << " experts " << num_experts
                << " fused " << fused << " cluster "
                << cluster_n << " seed " << seed;
          }
        }
      }
    }
  }
}

// After a capacity overflow the schedule reports 0 scheduled rows (its row offsets are then past the
// buffer): the GEMM must not touch the output.
TEST(ExpertGemmTest, OverflowedScheduleWritesNothing) {
  MOK_REQUIRE_GPUS(1);
  const int k = 128, n = 512;
  GemmFixture fx({300, 0, 700}, 0);
  fx.scheduled.upload({0});
  DeviceArray<uint16_t> d_a(size_t(fx.a_rows) * k), d_w(size_t(3) * n * k), d_out(size_t(fx.a_rows) * n);
  testing::fill_hashed_bf16(d_a.ptr, d_a.count, 1, -1, 1, nullptr);
  testing::fill_hashed_bf16(d_w.ptr, d_w.count, 2, -1, 1, nullptr);
  const std::vector<uint16_t> poison(d_out.count, kPoison);
  for (int cluster_n : {1, 2}) {
    d_out.upload(poison);
    ExpertGemmArgs args = fx.args(GemmEpilogue::kStore, d_a.ptr, k, d_w.ptr, n, d_out.ptr);
    args.cluster_n = cluster_n;
    expert_gemm(args, nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    ASSERT_EQ(d_out.download(), poison) << "cluster_n " << cluster_n;
  }
}

TEST(ExpertGemmTest, ClusterHeuristic) {
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kStore, 512), 2);
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kStore, 768), 1);  // three tiles of 256 do not pair
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kSwiGLU, 256), 2);
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kSwiGLU, 384), 1);
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kStore, 2880), 2);   // 12 tiles, the last one partial
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kSwiGLU, 2880), 1);  // 23 tiles
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kStore, 320), 2);
}

TEST(ExpertGemmTest, ValidationNamesTheArgument) {
  ExpertGemmArgs args;
  auto message = [&] {
    try { validate(args); } catch (const std::invalid_argument& e) { return std::string(e.what()); }
    return std::string("no throw");
  };
  EXPECT_NE(message().find("a must be"), std::string::npos);
  alignas(16) static uint16_t buffer[64];
  args.a = args.b = args.out = buffer;
  args.k = 100;
  EXPECT_NE(message().find("k must be"), std::string::npos);
  args.k = 128;
  args.n = 200;  // not a multiple of 64
  EXPECT_NE(message().find("n must be"), std::string::npos);
  args.n = 256;
  args.cluster_n = 3;
  EXPECT_NE(message().find("cluster_n must be"), std::string::npos);
  args.cluster_n = 2;
  EXPECT_NE(message().find("cluster_n = 2 pairs"), std::string::npos);
  args.cluster_n = 0;
  args.local_experts = 2;
  args.a_rows = 128;
  EXPECT_NE(message().find("schedule pointers"), std::string::npos);
  args.expert_counts = args.expert_row_offsets = args.scheduled_rows = reinterpret_cast<const int32_t*>(buffer);
  EXPECT_NE(message().find("ticket must"), std::string::npos);
  args.b = buffer + 1;
  EXPECT_NE(message().find("b must be"), std::string::npos);
}

}  // namespace
}  // namespace mok
