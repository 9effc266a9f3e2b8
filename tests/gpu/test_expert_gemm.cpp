// Expert grouped GEMM (src/device/gemm/expert_gemm.cuh) against the CPU: bitwise on integer-valued inputs
// (every fp32 partial sum is exact, both sides round once to bf16 with round-to-nearest-even), within a
// stated budget for random normal inputs and for SwiGLU (the GPU uses __expf). Outputs are poisoned with
// NaN first: padding rows must come back as zeros, rows past the schedule must stay untouched. Every call's
// waits report to the fixture's status word; StalledProducerTimesOutAndReports checks that they are bounded.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include "mok/expert_gemm.h"
#include "mok/schedule.h"
#include "reference/routing_gen.h"
#include "src/host/check.h"
#include "src/host/gemm_test_knobs.h"
#include "tests/common/device_fill.h"
#include "tests/common/device_status.h"
#include "tests/common/gpu_env.h"
#include "tests/common/bf16.h"
#include "tests/common/fp8.h"
#include "tests/common/schedule_harness.h"

namespace mok {
namespace {

using testing::hashed_int;

using testing::float_bits;
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
  testing::DeviceStatusWord status;
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
    g.waits = status.bound();
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

// fp32 outputs (the row partials) are poisoned with this NaN; untouched entries keep its bits.
constexpr uint32_t kFloatPoison = 0x7fc00badu;
constexpr uint8_t kBytePoison = 0xab;  // e4m3 outputs' poison

std::vector<float> float_poison(size_t count) {
  float f;
  std::memcpy(&f, &kFloatPoison, sizeof f);
  return std::vector<float>(count, f);
}

// CPU reference of an MN-major product: row `row` of A [., k] times column `col` of expert e's W [k, n]
// (W [E, k, n], n contiguous), in double.
double cpu_dot_mn(const std::vector<uint16_t>& a, int64_t row, const std::vector<uint16_t>& w, int e, int k, int n,
                  int col) {
  double sum = 0;
  for (int kk = 0; kk < k; ++kk)
    sum += double(from_bf16_bits(a[row * k + kk])) * from_bf16_bits(w[(int64_t(e) * k + kk) * n + col]);
  return sum;
}

double sigmoid(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }

TEST(ExpertGemmTest, StoreIsBitwiseExactForEdgeRowCountsAndFirstRow) {
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
    // first_row (the backward's recompute of the rows past a kept ring): rows below it stay untouched, the
    // others get the full run's bits, also where first_row cuts a segment (expert 4's 3000 rows).
    for (const int32_t first_row : {128, 1024, 3072}) {
      d_out.upload(std::vector<uint16_t>(d_out.count, kPoison));
      ExpertGemmArgs from = args;
      from.first_row = first_row;
      expert_gemm(from, nullptr);
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
      const auto part = d_out.download();
      for (int64_t idx = 0; idx < int64_t(part.size()); ++idx) {
        const uint16_t want = idx / n < first_row ? kPoison : out[idx];
        ASSERT_EQ(part[idx], want) << "first_row " << first_row << ": row " << idx / n << ", column " << idx % n
                                   << (idx / n < first_row ? " written below first_row" : " differs from the full run")
                                   << ", seed " << seed;
      }
    }
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

// B MN-major (b_major kMN: W [E, k, n], n contiguous: the dgrad's view of the forward's weights as they
// are), with K in one buffer or split over b (k-rows [0, k/2) of each expert) and b_up (the rest): the gate/up
// dgrad over [d_g, d_u] with fused or separate weights. Integer inputs: bitwise against the CPU, for 64- and
// 128-row padding with empty experts, partial last n-blocks (n a multiple of 64, not of 256), one k-block,
// row scales; pairs of CTAs, the split weights and reruns give the same bits as the first single-CTA run.
TEST(ExpertGemmTest, StoreWithMNMajorWeightsIsBitwiseExact) {
  MOK_REQUIRE_GPUS(1);
  struct Case {
    std::vector<int32_t> expert_counts;
    int k, n, tile_m;
    bool scaled;
  };
  const std::vector<Case> cases = {
      {{0, 1, 63, 129, 700, 0, 128, 7}, 256, 512, 64, false},  // two n-blocks: pairs
      {{0, 1, 63, 129, 700, 0, 128, 7}, 384, 512, 128, true},  // k / 2 = 192: three k-blocks per source
      {{65, 0, 130, 1}, 128, 320, 64, true},                   // the last n-block has 64 of 256 columns
      {{65, 0, 130, 1}, 192, 768, 128, false},                 // three n-blocks (single CTAs); K in one buffer
      {{33}, 64, 64, 64, false},                               // one k-block, one partial n-block
  };
  for (const Case& test_case : cases) {
    const std::vector<int32_t>& expert_counts = test_case.expert_counts;
    const int num_experts = static_cast<int>(expert_counts.size());
    const int k = test_case.k, n = test_case.n;
    const uint64_t seed = 500 + k + n + test_case.tile_m;
    const std::string shape = "k " + std::to_string(k) + " n " + std::to_string(n) + " tile_m " +
                              std::to_string(test_case.tile_m) + " seed " + std::to_string(seed);
    GemmFixture fx(expert_counts, 128, test_case.tile_m);  // spare rows past the schedule
    const auto a = hashed_bf16(size_t(fx.a_rows) * k, seed, -2, 2);
    const auto w = hashed_bf16(size_t(num_experts) * k * n, seed + 1, -2, 2);  // [E, k, n]
    std::vector<float> scale(fx.a_rows);
    for (int64_t r = 0; r < fx.a_rows; ++r) scale[r] = std::ldexp(1.0f, hashed_int(seed, r, -3, 3));
    // The split: b = k-rows [0, k/2) of each expert, b_up = [k/2, k).
    std::vector<uint16_t> w_low, w_high;
    for (int e = 0; e < num_experts; ++e) {
      const auto expert = w.begin() + size_t(e) * k * n;
      w_low.insert(w_low.end(), expert, expert + size_t(k / 2) * n);
      w_high.insert(w_high.end(), expert + size_t(k / 2) * n, expert + size_t(k) * n);
    }
    DeviceArray<uint16_t> d_a(a), d_w(w), d_low(w_low), d_high(w_high), d_out(size_t(fx.a_rows) * n);
    DeviceArray<float> d_scale(scale);
    const std::vector<uint16_t> poison(d_out.count, kPoison);
    ExpertGemmArgs args = fx.args(GemmEpilogue::kStore, d_a.ptr, k, d_w.ptr, n, d_out.ptr);
    args.b_major = OperandMajor::kMN;
    if (test_case.scaled) args.row_scale = d_scale.ptr;
    auto run = [&](const ExpertGemmArgs& run_args) {
      d_out.upload(poison);
      expert_gemm(run_args, nullptr);
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
      return d_out.download();
    };
    args.cluster_n = 1;
    const auto out = run(args);
    ASSERT_EQ(check_layout(out, fx.seg, fx.a_rows, n), "") << shape;
    for (int64_t row = 0; row < fx.seg.rows; ++row) {
      if (!fx.seg.is_real(row)) continue;
      const int e = fx.seg.expert_of(row);
      for (int c = 0; c < n; ++c) {
        const float want = static_cast<float>(cpu_dot_mn(a, row, w, e, k, n, c)) * (test_case.scaled ? scale[row] : 1.0f);
        ASSERT_EQ(out[row * n + c], to_bf16_bits(want))
            << where("kMN store", row, c, from_bf16_bits(out[row * n + c]), want) << " (expert " << e << ", " << shape << ")";
      }
    }
    if (choose_cluster_n(GemmEpilogue::kStore, n) == 2) {
      args.cluster_n = 2;
      ASSERT_EQ(run(args), out) << "cluster_n 2 differs from cluster_n 1, " << shape;
    }
    args.cluster_n = 0;
    for (int rerun = 0; rerun < 2; ++rerun) ASSERT_EQ(run(args), out) << "rerun " << rerun << " differs, " << shape;
    if (k % 128 == 0) {
      ExpertGemmArgs split = args;
      split.b = d_low.ptr;
      split.b_up = d_high.ptr;
      for (int cluster_n : {1, 2}) {
        if (cluster_n == 2 && choose_cluster_n(GemmEpilogue::kStore, n) != 2) continue;
        split.cluster_n = cluster_n;
        ASSERT_EQ(run(split), out) << "K split over b and b_up differs from one buffer, cluster_n " << cluster_n << ", "
                                   << shape;
      }
    }
  }
}

// kSwiGLU's optional side output: the raw g and u of every row (bf16, before the clamp and the row scale;
// padding rows zeros) in gate_up_out [a_rows, 2n]. Integer inputs make g and u exact integers in fp32, so
// their bits equal the CPU's rounding; h stays bitwise what a run without the side output writes. Fused and
// separate weights, plain and clamped (|g|, |u| reach past the clamp), a partial last n-block, pairs.
TEST(ExpertGemmTest, SwiGLUGateUpOutHoldsTheRawGateAndUp) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> expert_counts = {129, 0, 1, 255, 64};
  const int num_experts = static_cast<int>(expert_counts.size());
  const int k = 256, n = 192;  // two 128-column n-blocks, the second partial: pairs possible
  ASSERT_EQ(choose_cluster_n(GemmEpilogue::kSwiGLU, n), 2);
  for (float limit : {0.0f, 3.0f}) {
    for (bool fused : {true, false}) {
      const uint64_t seed = 600 + (limit > 0) + 2 * fused;
      const std::string shape = "limit " + std::to_string(limit) + " fused " + std::to_string(fused) + " seed " +
                                std::to_string(seed);
      GemmFixture fx(expert_counts, 128, limit > 0 ? 64 : 128);
      const auto a = hashed_bf16(size_t(fx.a_rows) * k, seed, -1, 1);
      const auto w_gate = hashed_bf16(size_t(num_experts) * n * k, seed + 1, -1, 1);
      const auto w_up = hashed_bf16(size_t(num_experts) * n * k, seed + 2, -1, 1);
      std::vector<uint16_t> w_fused;  // [E, 2n, k]
      for (int e = 0; e < num_experts; ++e) {
        w_fused.insert(w_fused.end(), w_gate.begin() + size_t(e) * n * k, w_gate.begin() + size_t(e + 1) * n * k);
        w_fused.insert(w_fused.end(), w_up.begin() + size_t(e) * n * k, w_up.begin() + size_t(e + 1) * n * k);
      }
      std::vector<float> scale(fx.a_rows);
      for (int64_t r = 0; r < fx.a_rows; ++r) scale[r] = std::ldexp(1.0f, hashed_int(seed, r, -2, 2));
      DeviceArray<uint16_t> d_a(a), d_gate(w_gate), d_up(w_up), d_fused(w_fused);
      DeviceArray<uint16_t> d_h(size_t(fx.a_rows) * n), d_gu(size_t(fx.a_rows) * 2 * n);
      DeviceArray<float> d_scale(scale);
      ExpertGemmArgs args = fx.args(GemmEpilogue::kSwiGLU, d_a.ptr, k, fused ? d_fused.ptr : d_gate.ptr, n, d_h.ptr);
      if (!fused) args.b_up = d_up.ptr;
      args.swiglu_limit = limit;
      args.row_scale = d_scale.ptr;
      auto run = [&](const ExpertGemmArgs& run_args) {
        d_h.upload(std::vector<uint16_t>(d_h.count, kPoison));
        d_gu.upload(std::vector<uint16_t>(d_gu.count, kPoison));
        expert_gemm(run_args, nullptr);
        MOK_CHECK_CUDA(cudaDeviceSynchronize());
      };
      run(args);  // without the side output
      const auto h_plain = d_h.download();
      ASSERT_EQ(d_gu.download(), std::vector<uint16_t>(d_gu.count, kPoison)) << "gate_up_out written while unset";
      args.gate_up_out = d_gu.ptr;
      args.cluster_n = 1;
      run(args);
      ASSERT_EQ(d_h.download(), h_plain) << "h changed with gate_up_out, " << shape;
      const auto gu = d_gu.download();
      ASSERT_EQ(check_layout(gu, fx.seg, fx.a_rows, 2 * n), "") << "gate_up_out, " << shape;
      for (int64_t row = 0; row < fx.seg.rows; ++row) {
        if (!fx.seg.is_real(row)) continue;
        const int e = fx.seg.expert_of(row);
        for (int c = 0; c < n; ++c) {
          const float g = static_cast<float>(cpu_dot(a, row, w_gate, int64_t(e) * n + c, k));
          const float u = static_cast<float>(cpu_dot(a, row, w_up, int64_t(e) * n + c, k));
          ASSERT_EQ(gu[row * 2 * n + c], to_bf16_bits(g)) << where("g", row, c, from_bf16_bits(gu[row * 2 * n + c]), g)
                                                           << ", " << shape;
          ASSERT_EQ(gu[row * 2 * n + n + c], to_bf16_bits(u))
              << where("u", row, c, from_bf16_bits(gu[row * 2 * n + n + c]), u) << ", " << shape;
        }
      }
      args.cluster_n = 2;
      run(args);
      ASSERT_EQ(d_h.download(), h_plain) << "h with gate_up_out in pairs, " << shape;
      ASSERT_EQ(d_gu.download(), gu) << "gate_up_out in pairs differs from single CTAs, " << shape;
    }
  }
}

// The down dgrad with the SwiGLU backward in its epilogue (kSwiGLUBackward): a = d_out rows [., H] (k = H),
// b = W_down [E, H, I] read MN-major (n = I), g and u from gate_up [a_rows, 2I]. Against a double CPU reference
// of the formulas in include/mok/expert_gemm.h (masks on the raw g, u, as reference/moe_reference.h).
// Integer d_out and W_down make d_hu exact; g, u are quarter steps in [-12, 12], which hit the clamp's edges
// exactly (g, u = +-L: the strict masks). Budget, per element (the GPU evaluates sigmoid with __expf, relative
// error below 2^-20 for |g| <= 12, in fp32): d_g within 2^-7 |want| + 2^-17 (1 + 3 |g_c|) |d_h u_c|; d_u
// within 2^-7 |want| + 2^-17 (1 + |g_c|) |d_h| (bf16 output rounding: up to 2^-8); row partials within 2^-16 of the
// sum of the terms' magnitudes (fp32 sums of <= 66 terms). Row scale null, set, or with exact zeros (then
// d_g = d_u = 0 and the partials, unscaled, are still checked). Pairs and reruns: the same bits.
// A kSwiGLUBackward call with its outputs poisoned first: d_g | d_u and the row partials.
std::pair<std::vector<uint16_t>, std::vector<float>> run_swiglu_backward(const ExpertGemmArgs& args,
                                                                          DeviceArray<uint16_t>& grad,
                                                                          DeviceArray<float>& partials) {
  grad.upload(std::vector<uint16_t>(grad.count, kPoison));
  partials.upload(float_poison(partials.count));
  expert_gemm(args, nullptr);
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
  return std::make_pair(grad.download(), partials.download());
}

TEST(ExpertGemmTest, SwiGLUBackwardWithinBudget) {
  MOK_REQUIRE_GPUS(1);
  enum class Scale { kNone, kSet, kWithZeros };
  struct Case {
    std::vector<int32_t> expert_counts;
    int k, n, tile_m;
    float limit;
    Scale scale;
  };
  const std::vector<Case> cases = {
      {{0, 1, 63, 129, 300, 0, 128, 7}, 256, 512, 64, 0.0f, Scale::kNone},  // two n-blocks: pairs
      {{0, 1, 63, 129, 300, 0, 128, 7}, 192, 512, 128, 7.0f, Scale::kSet},
      {{65, 0, 130, 1}, 128, 320, 64, 7.0f, Scale::kWithZeros},  // the last n-block: 64 of 256 columns
      {{65, 0, 130, 1}, 128, 192, 128, 0.0f, Scale::kWithZeros},  // one partial n-block
      {{33, 5}, 64, 768, 64, 3.0f, Scale::kSet},                   // three n-blocks: single CTAs
  };
  for (const Case& test_case : cases) {
    const std::vector<int32_t>& expert_counts = test_case.expert_counts;
    const int num_experts = static_cast<int>(expert_counts.size());
    const int k = test_case.k, n = test_case.n;
    const int n_blocks = gemm_n_blocks(GemmEpilogue::kSwiGLUBackward, n);
    constexpr int kTileCols = 256;  // the backward's output tile: row partial nb sums columns [256 nb, 256 nb + 256)
    ASSERT_EQ(n_blocks, (n + kTileCols - 1) / kTileCols);
    const double limit = test_case.limit;
    const uint64_t seed = 700 + k + n + test_case.tile_m;
    const std::string shape = "k " + std::to_string(k) + " n " + std::to_string(n) + " tile_m " +
                              std::to_string(test_case.tile_m) + " limit " + std::to_string(test_case.limit) +
                              " scale " + std::to_string(int(test_case.scale)) + " seed " + std::to_string(seed);
    GemmFixture fx(expert_counts, 128, test_case.tile_m);  // spare rows past the schedule
    const auto d_out = hashed_bf16(size_t(fx.a_rows) * k, seed, -2, 2);
    const auto w_down = hashed_bf16(size_t(num_experts) * k * n, seed + 1, -2, 2);  // [E, H, I]
    std::vector<uint16_t> gate_up(size_t(fx.a_rows) * 2 * n);
    for (size_t i = 0; i < gate_up.size(); ++i) gate_up[i] = to_bf16_bits(hashed_int(seed + 2, int64_t(i), -48, 48) / 4.0f);
    std::vector<float> scale(fx.a_rows, 1.0f);
    for (int64_t r = 0; r < fx.a_rows; ++r) {
      if (test_case.scale != Scale::kNone) scale[r] = hashed_int(seed + 3, r, 1, 8) / 4.0f;
      if (test_case.scale == Scale::kWithZeros && r % 3 == 0) scale[r] = 0.0f;
    }
    DeviceArray<uint16_t> d_a(d_out), d_w(w_down), d_gate_up(gate_up), d_grad(size_t(fx.a_rows) * 2 * n);
    DeviceArray<float> d_scale(scale), d_partials(size_t(fx.a_rows) * n_blocks);
    ExpertGemmArgs args = fx.args(GemmEpilogue::kSwiGLUBackward, d_a.ptr, k, d_w.ptr, n, d_grad.ptr);
    args.b_major = OperandMajor::kMN;
    args.gate_up = d_gate_up.ptr;
    args.row_partials = d_partials.ptr;
    args.swiglu_limit = test_case.limit;
    if (test_case.scale != Scale::kNone) args.row_scale = d_scale.ptr;
    auto run = [&](const ExpertGemmArgs& run_args) { return run_swiglu_backward(run_args, d_grad, d_partials); };
    args.cluster_n = 1;
    const auto [grad, partials] = run(args);
    ASSERT_EQ(check_layout(grad, fx.seg, fx.a_rows, 2 * n), "") << "d_g / d_u, " << shape;
    for (int64_t row = 0; row < fx.a_rows; ++row) {
      for (int nb = 0; nb < n_blocks; ++nb) {
        const uint32_t bits = float_bits(partials[row * n_blocks + nb]);
        const bool scheduled = row < fx.seg.rows;
        if (!scheduled) {
          ASSERT_EQ(bits, kFloatPoison) << "row partial past the schedule written: row " << row << " n-block " << nb;
        } else if (!fx.seg.is_real(row)) {
          ASSERT_EQ(bits, 0u) << "padding row partial not zero: row " << row << " n-block " << nb << ", " << shape;
        }
      }
    }
    std::vector<double> d_hu(n);
    for (int64_t row = 0; row < fx.seg.rows; ++row) {
      if (!fx.seg.is_real(row)) continue;
      const int e = fx.seg.expert_of(row);
      for (int c = 0; c < n; ++c) d_hu[c] = cpu_dot_mn(d_out, row, w_down, e, k, n, c);
      const double rw = test_case.scale == Scale::kNone ? 1.0 : scale[row];
      std::vector<double> partial_sum(n_blocks, 0.0), partial_magnitude(n_blocks, 0.0);
      for (int c = 0; c < n; ++c) {
        const double g = from_bf16_bits(gate_up[row * 2 * n + c]), u = from_bf16_bits(gate_up[row * 2 * n + n + c]);
        const bool gate_passes = !(limit > 0) || g < limit;
        const bool up_passes = !(limit > 0) || (-limit < u && u < limit);
        const double g_c = limit > 0 ? std::min(g, limit) : g;
        const double u_c = limit > 0 ? std::clamp(u, -limit, limit) : u;
        const double s = sigmoid(g_c), d_h = rw * d_hu[c];
        const double want_g = gate_passes ? d_h * u_c * (s * (1 + g_c * (1 - s))) : 0.0;
        const double want_u = up_passes ? d_h * g_c * s : 0.0;
        const float got_g = from_bf16_bits(grad[row * 2 * n + c]), got_u = from_bf16_bits(grad[row * 2 * n + n + c]);
        const double budget_g = std::abs(want_g) / 128 + std::ldexp(1.0, -17) * (1 + 3 * std::abs(g_c)) * std::abs(d_h * u_c);
        const double budget_u = std::abs(want_u) / 128 + std::ldexp(1.0, -17) * (1 + std::abs(g_c)) * std::abs(d_h);
        ASSERT_FALSE(std::isnan(got_g) || std::isnan(got_u)) << where("NaN", row, c, got_g, want_g) << ", " << shape;
        ASSERT_LE(std::abs(got_g - want_g), budget_g)
            << where("d_g", row, c, got_g, want_g) << " (g " << g << ", u " << u << ", rw " << rw << ", d_hu " << d_hu[c]
            << ", expert " << e << ", " << shape << ")";
        ASSERT_LE(std::abs(got_u - want_u), budget_u)
            << where("d_u", row, c, got_u, want_u) << " (g " << g << ", u " << u << ", rw " << rw << ", d_hu " << d_hu[c]
            << ", expert " << e << ", " << shape << ")";
        const double term = d_hu[c] * g_c * s * u_c;
        partial_sum[c / kTileCols] += term;
        partial_magnitude[c / kTileCols] += std::abs(term);
      }
      for (int nb = 0; nb < n_blocks; ++nb) {
        const float got = partials[row * n_blocks + nb];
        ASSERT_FALSE(std::isnan(got)) << "row partial NaN: row " << row << " n-block " << nb << ", " << shape;
        ASSERT_LE(std::abs(got - partial_sum[nb]), std::ldexp(partial_magnitude[nb], -16))
            << "row partial: row " << row << " n-block " << nb << ": got " << got << ", expected " << partial_sum[nb]
            << " (rw " << rw << ", expert " << e << ", " << shape << ")";
      }
    }
    if (choose_cluster_n(GemmEpilogue::kSwiGLUBackward, n) == 2) {
      args.cluster_n = 2;
      const auto [grad2, partials2] = run(args);
      ASSERT_EQ(grad2, grad) << "d_g / d_u in pairs differ from single CTAs, " << shape;
      ASSERT_TRUE(std::memcmp(partials2.data(), partials.data(), partials.size() * sizeof(float)) == 0)
          << "row partials in pairs differ from single CTAs, " << shape;
    }
    args.cluster_n = 0;
    for (int rerun = 0; rerun < 2; ++rerun) {
      const auto [grad_again, partials_again] = run(args);
      ASSERT_EQ(grad_again, grad) << "rerun " << rerun << " d_g / d_u differ, " << shape;
      ASSERT_TRUE(std::memcmp(partials_again.data(), partials.data(), partials.size() * sizeof(float)) == 0)
          << "rerun " << rerun << " row partials differ, " << shape;
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
  for (const int32_t first_row : {-128, 64, 256}) {  // negative, not a multiple of 128, past a_rows
    args.first_row = first_row;
    EXPECT_NE(message().find("first_row must be"), std::string::npos) << "first_row " << first_row;
  }
  args.first_row = 128;
  EXPECT_NE(message().find("ticket must"), std::string::npos);
  args.ticket = reinterpret_cast<int32_t*>(buffer);
  EXPECT_NE(message().find("expert_gemm: waits.status must"), std::string::npos);
  static DeviceStatus status;  // validation does not read it
  args.waits.status = &status;
  EXPECT_EQ(message(), "no throw");
  // Non-finite or absurd timeouts (the kernel counts integer nanoseconds): rejected, naming the field.
  for (const double timeout : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                               std::numeric_limits<double>::quiet_NaN(), 1e30, kMaxWaitTimeoutS + 1}) {
    args.waits.timeout_s = timeout;
    EXPECT_NE(message().find("expert_gemm: waits.timeout_s must be a finite number of seconds in (0, 86400]"),
              std::string::npos)
        << "timeout " << timeout << ": " << message();
  }
  args.waits.timeout_s = kMaxWaitTimeoutS;
  EXPECT_EQ(message(), "no throw");
  args.b = buffer + 1;
  EXPECT_NE(message().find("b must be"), std::string::npos);
}

// Every wait of the kernel is bounded: with a stalled producer (the test knob detail::set_stalled_producer: each
// CTA's producer arms its first stage and loads nothing) the consumers' wait for that stage times out within the
// hand-off bound (2 * timeout + 1 s), the status word names the kernel, the role and the counter, the abort word
// gets kAbortHandoff, and the call returns. With the abort still set the next call takes no tiles (the output
// stays poisoned); after a reset the next call gives a fresh call's bits. Both cluster sizes.
TEST(ExpertGemmTest, StalledProducerTimesOutAndReports) {
  MOK_REQUIRE_GPUS(1);
  const int k = 256, n = 512;
  GemmFixture fx({300, 0, 700}, 0);
  DeviceArray<uint16_t> d_a(size_t(fx.a_rows) * k), d_w(size_t(3) * n * k), d_out(size_t(fx.a_rows) * n);
  testing::fill_hashed_bf16(d_a.ptr, d_a.count, 3, -2, 2, nullptr);
  testing::fill_hashed_bf16(d_w.ptr, d_w.count, 4, -2, 2, nullptr);
  const std::vector<uint16_t> poison(d_out.count, kPoison);
  for (int cluster_n : {1, 2}) {
    ExpertGemmArgs args = fx.args(GemmEpilogue::kStore, d_a.ptr, k, d_w.ptr, n, d_out.ptr);
    args.cluster_n = cluster_n;
    args.waits.timeout_s = 0.05;
    auto run = [&] {
      d_out.upload(poison);
      expert_gemm(args, nullptr);
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
      return d_out.download();
    };
    const std::vector<uint16_t> fresh = run();
    ASSERT_TRUE(fx.status.read().ok()) << fx.status.read().describe(1, 1, 1);
    ASSERT_NE(fresh, poison);

    detail::set_stalled_producer(KernelId::kExpertGemm, true);
    const auto start = std::chrono::steady_clock::now();
    d_out.upload(poison);
    expert_gemm(args, nullptr);
    const cudaError_t error = cudaDeviceSynchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    detail::set_stalled_producer(KernelId::kExpertGemm, false);
    ASSERT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
    const StatusReport stalled = fx.status.read();
    const std::string text = stalled.describe(1, 1, 1);
    EXPECT_EQ(stalled.raw.error_bits, kStatusWaitTimeout) << text;
    EXPECT_EQ(stalled.raw.timeout_kernel, static_cast<int32_t>(KernelId::kExpertGemm)) << text;
    EXPECT_EQ(stalled.raw.timeout_role, static_cast<int32_t>(Role::kGemmConsumer)) << text;
    EXPECT_EQ(stalled.raw.timeout_counter, static_cast<int32_t>(CounterId::kPipelineFull)) << text;
    EXPECT_EQ(stalled.raw.timeout_index, 0) << text;  // the first stage
    EXPECT_NE(stalled.raw.abort & kAbortHandoff, 0u) << text;
    EXPECT_NE(text.find("kernel expert_gemm, role GEMM consumer, counter pipeline full[0]"), std::string::npos) << text;
    EXPECT_LT(seconds, 2 * 0.05 + 1 + 5) << "cluster_n " << cluster_n << ": " << text;

    // The abort word stays set: the next call takes no tiles and writes nothing.
    EXPECT_EQ(run(), poison) << "cluster_n " << cluster_n << ": a call after the timeout wrote output";
    fx.status.reset();
    EXPECT_EQ(run(), fresh) << "cluster_n " << cluster_n << ": the call after the reset differs from a fresh one";
    EXPECT_TRUE(fx.status.read().ok()) << fx.status.read().describe(1, 1, 1);
  }
}

// Output tiles per epilogue: 256 columns (kStore, kSwiGLUBackward), 128 (kSwiGLU); the last one partial.
TEST(ExpertGemmTest, NBlocksPerEpilogue) {
  EXPECT_EQ(gemm_n_blocks(GemmEpilogue::kStore, 512), 2);
  EXPECT_EQ(gemm_n_blocks(GemmEpilogue::kStore, 320), 2);
  EXPECT_EQ(gemm_n_blocks(GemmEpilogue::kSwiGLU, 192), 2);
  EXPECT_EQ(gemm_n_blocks(GemmEpilogue::kSwiGLU, 2880), 23);
  EXPECT_EQ(gemm_n_blocks(GemmEpilogue::kSwiGLUBackward, 64), 1);
  EXPECT_EQ(gemm_n_blocks(GemmEpilogue::kSwiGLUBackward, 768), 3);
  EXPECT_EQ(gemm_n_blocks(GemmEpilogue::kSwiGLUBackward, 2880), 12);
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kSwiGLUBackward, 2048), 2);
  EXPECT_EQ(choose_cluster_n(GemmEpilogue::kSwiGLUBackward, 768), 1);
  EXPECT_THROW(gemm_n_blocks(static_cast<GemmEpilogue>(7), 256), std::invalid_argument);
}

// The policies' combinations: each bad one is rejected with a message naming the field (no GPU needed).
TEST(ExpertGemmTest, ValidationRejectsBadCombinations) {
  alignas(16) static uint16_t buffer[64];
  alignas(16) static float partials[64];
  ExpertGemmArgs base;
  base.a = base.b = base.out = buffer;
  base.k = 256;
  base.n = 512;
  base.local_experts = 2;
  base.a_rows = 128;
  base.expert_counts = base.expert_row_offsets = base.scheduled_rows = reinterpret_cast<const int32_t*>(buffer);
  base.ticket = reinterpret_cast<int32_t*>(buffer);
  static DeviceStatus status;  // validation does not read it
  base.waits.status = &status;
  auto message = [](const ExpertGemmArgs& args) {
    try { validate(args); } catch (const std::invalid_argument& e) { return std::string(e.what()); }
    return std::string("no throw");
  };
  auto expect = [&](const ExpertGemmArgs& args, const std::string& text, const char* what) {
    EXPECT_NE(message(args).find(text), std::string::npos) << what << ": got \"" << message(args) << "\"";
  };
  expect(base, "no throw", "kStore, K-major");
  ExpertGemmArgs args = base;
  args.epilogue = static_cast<GemmEpilogue>(7);
  expect(args, "epilogue must be", "unknown epilogue");
  args = base;
  args.b_major = static_cast<OperandMajor>(5);
  expect(args, "b_major must be", "unknown b_major");
  args = base;
  args.b_up = buffer;
  expect(args, "b_up is only for", "kStore K-major with b_up");
  args.b_major = OperandMajor::kMN;
  expect(args, "no throw", "kStore MN-major, K split over b and b_up");
  args.k = 192;  // halves of 96 rows: not whole k-blocks
  expect(args, "k must be a multiple of 128", "K split with k = 3 x 64");
  args.b_up = buffer + 1;
  args.k = 256;
  expect(args, "b_up is only for", "misaligned b_up");
  args = base;
  args.epilogue = GemmEpilogue::kSwiGLU;
  args.b_major = OperandMajor::kMN;
  expect(args, "kSwiGLU reads b K-major", "kSwiGLU MN-major");
  args.b_up = buffer;
  expect(args, "kSwiGLU reads b K-major", "kSwiGLU MN-major with b_up");
  args = base;
  args.epilogue = GemmEpilogue::kSwiGLU;
  args.gate_up_out = buffer;
  expect(args, "no throw", "kSwiGLU with gate_up_out");
  args.gate_up_out = buffer + 1;
  expect(args, "gate_up_out is only for kSwiGLU and must be 16-byte aligned", "misaligned gate_up_out");
  args = base;
  args.gate_up_out = buffer;
  expect(args, "gate_up_out is only for kSwiGLU", "kStore with gate_up_out");
  args = base;
  args.gate_up = buffer;
  expect(args, "gate_up is only for kSwiGLUBackward", "kStore with gate_up");
  args = base;
  args.row_partials = partials;
  expect(args, "row_partials is only for kSwiGLUBackward", "kStore with row_partials");
  // kSwiGLUBackward: MN-major, gate_up and row_partials required, no b_up.
  args = base;
  args.epilogue = GemmEpilogue::kSwiGLUBackward;
  args.gate_up = buffer;
  args.row_partials = partials;
  expect(args, "kSwiGLUBackward reads b = W_down", "kSwiGLUBackward K-major");
  args.b_major = OperandMajor::kMN;
  expect(args, "no throw", "kSwiGLUBackward");
  ExpertGemmArgs backward = args;
  args.gate_up = nullptr;
  expect(args, "kSwiGLUBackward needs gate_up", "kSwiGLUBackward without gate_up");
  args.gate_up = buffer + 1;
  expect(args, "kSwiGLUBackward needs gate_up", "kSwiGLUBackward with misaligned gate_up");
  args = backward;
  args.row_partials = nullptr;
  expect(args, "kSwiGLUBackward needs row_partials", "kSwiGLUBackward without row_partials");
  args = backward;
  args.b_up = buffer;
  expect(args, "b_up is only for", "kSwiGLUBackward with b_up");
  args = backward;
  args.gate_up_out = buffer;
  expect(args, "gate_up_out is only for kSwiGLU", "kSwiGLUBackward with gate_up_out");
  args = backward;
  args.n = 256;  // one 256-column n-block
  args.cluster_n = 2;
  expect(args, "cluster_n = 2 pairs", "kSwiGLUBackward pairs over one n-block");
  args = backward;
  args.swiglu_limit = -1;
  expect(args, "swiglu_limit must be", "negative clamp");
  args.swiglu_limit = std::numeric_limits<float>::quiet_NaN();
  expect(args, "swiglu_limit must be", "NaN clamp");
}

}  // namespace

// Row gather (ExpertGemmArgs::gather, src/device/gemm/row_gather.cuh): the gate/up GEMM reads the rows of routes
// from `rank` straight from x, those of other ranks from a, zeros for padding; bitwise the GEMM over the copied
// rows (a as pull_rows leaves it: each row its token's row of its source's x, padding zero). The gathered run's a
// holds NaN in every row it must not read (local and padding rows), so a wrong source shows. Integer inputs: g
// and u (gate_up_out) exact against the CPU. Segments with 1, 64, 129, 255 rows and an empty expert; tile_m 64
// (64-row half tiles) and 128; fused and separate weights; every row local (EP = 1), and a mix of sources.
// The rows of a gathered GEMM test: each real schedule row gets a random route (source rank: 0, or any of `ranks`
// when mixed; token; slot); `copied` is A as the pull writes it (the source's token row of `rows_of_ranks`,
// [ranks, T, k]), `gathered_a` holds only the rows of other ranks' routes (what the gather reads from `a`), poison
// elsewhere.
struct GatheredRows {
  std::vector<int32_t> route;
  std::vector<uint16_t> copied, gathered_a;
};
GatheredRows gathered_rows(const GemmFixture& fx, const std::vector<uint16_t>& rows_of_ranks, int k, int num_tokens,
                           int top_k, int ranks, int rank, bool mixed, uint64_t seed) {
  GatheredRows g{std::vector<int32_t>(fx.a_rows, -1), std::vector<uint16_t>(size_t(fx.a_rows) * k, 0),
                 std::vector<uint16_t>(size_t(fx.a_rows) * k, kPoison)};
  for (int64_t row = 0; row < fx.seg.rows; ++row) {
    if (!fx.seg.is_real(row)) continue;
    const int src = mixed ? static_cast<int>(hashed_int(seed + 1, row, 0, ranks - 1)) : 0;
    const int token = static_cast<int>(hashed_int(seed + 2, row, 0, num_tokens - 1));
    const int slot = static_cast<int>(hashed_int(seed + 3, row, 0, top_k - 1));
    g.route[row] = (src * num_tokens + token) * top_k + slot;
    const auto from = rows_of_ranks.begin() + (int64_t(src) * num_tokens + token) * k;
    std::copy(from, from + k, g.copied.begin() + row * k);
    if (src != rank) std::copy(from, from + k, g.gathered_a.begin() + row * k);
  }
  return g;
}

TEST(ExpertGemmTest, SwiGLUGatheredRowsEqualTheCopiedRowsBitwise) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> expert_counts = {129, 0, 1, 255, 64};
  const int num_experts = static_cast<int>(expert_counts.size());
  const int k = 320, n = 192;  // 5 k-blocks; two 128-column n-blocks, the second partial
  const int num_tokens = 300, top_k = 4, ranks = 3;
  for (int tile_m : {64, 128}) {
    for (bool mixed : {false, true}) {
      for (bool fused : {false, true}) {
        const uint64_t seed = 700 + tile_m + 2 * mixed + fused;
        const std::string label = "tile_m " + std::to_string(tile_m) + (mixed ? ", mixed sources" : ", all local") +
                                  (fused ? ", fused weights" : ", separate weights") + ", seed " +
                                  std::to_string(seed);
        GemmFixture fx(expert_counts, tile_m, tile_m);  // a_rows: a multiple of tile_m
        const int rank = mixed ? 1 : 0;
        // x of every source rank [ranks, T, k]; this rank's is what the gather reads.
        const auto x = hashed_bf16(size_t(ranks) * num_tokens * k, seed, -2, 2);
        const auto [route, copied, gathered_a] = gathered_rows(fx, x, k, num_tokens, top_k, ranks, rank, mixed, seed);
        const auto w_gate = hashed_bf16(size_t(num_experts) * n * k, seed + 4, -1, 1);
        const auto w_up = hashed_bf16(size_t(num_experts) * n * k, seed + 5, -1, 1);
        std::vector<uint16_t> w_fused;  // [E, 2n, k]
        for (int e = 0; e < num_experts; ++e) {
          w_fused.insert(w_fused.end(), w_gate.begin() + size_t(e) * n * k, w_gate.begin() + size_t(e + 1) * n * k);
          w_fused.insert(w_fused.end(), w_up.begin() + size_t(e) * n * k, w_up.begin() + size_t(e + 1) * n * k);
        }
        DeviceArray<uint16_t> d_x(std::vector<uint16_t>(x.begin() + int64_t(rank) * num_tokens * k,
                                                        x.begin() + int64_t(rank + 1) * num_tokens * k));
        DeviceArray<uint16_t> d_copied(copied), d_gathered_a(gathered_a), d_gate(w_gate), d_up(w_up), d_fused(w_fused);
        DeviceArray<int32_t> d_route(route);
        DeviceArray<uint16_t> d_h(size_t(fx.a_rows) * n), d_gu(size_t(fx.a_rows) * 2 * n);
        auto run = [&](ExpertGemmArgs run_args) {
          d_h.upload(std::vector<uint16_t>(d_h.count, kPoison));
          d_gu.upload(std::vector<uint16_t>(d_gu.count, kPoison));
          run_args.b_up = fused ? nullptr : d_up.ptr;
          run_args.gate_up_out = d_gu.ptr;
          expert_gemm(run_args, nullptr);
          MOK_CHECK_CUDA(cudaDeviceSynchronize());
          return std::make_pair(d_h.download(), d_gu.download());
        };
        ExpertGemmArgs copy_args = fx.args(GemmEpilogue::kSwiGLU, d_copied.ptr, k, fused ? d_fused.ptr : d_gate.ptr, n,
                                           d_h.ptr);
        copy_args.cluster_n = 1;
        const auto want = run(copy_args);
        ExpertGemmArgs gather_args = copy_args;
        gather_args.a = d_gathered_a.ptr;
        gather_args.gather = {.x = d_x.ptr, .row_route = d_route.ptr, .num_tokens = num_tokens, .top_k = top_k,
                              .rank = rank};
        const auto got = run(gather_args);
        ASSERT_EQ(check_layout(got.first, fx.seg, fx.a_rows, n), "") << "h, " << label;
        for (size_t i = 0; i < want.first.size(); ++i)
          ASSERT_EQ(got.first[i], want.first[i]) << "h differs from the copied rows' at row " << i / n << " col "
                                                 << i % n << ", " << label;
        ASSERT_EQ(got.second, want.second) << "gate_up_out differs from the copied rows', " << label;
        for (int64_t row = 0; row < fx.seg.rows; ++row) {
          if (!fx.seg.is_real(row)) continue;
          const int e = fx.seg.expert_of(row);
          for (int c = 0; c < n; c += 7) {
            const float g = static_cast<float>(cpu_dot(copied, row, w_gate, int64_t(e) * n + c, k));
            const float u = static_cast<float>(cpu_dot(copied, row, w_up, int64_t(e) * n + c, k));
            ASSERT_EQ(got.second[row * 2 * n + c], to_bf16_bits(g))
                << where("g", row, c, from_bf16_bits(got.second[row * 2 * n + c]), g) << ", " << label;
            ASSERT_EQ(got.second[row * 2 * n + n + c], to_bf16_bits(u))
                << where("u", row, c, from_bf16_bits(got.second[row * 2 * n + n + c]), u) << ", " << label;
          }
        }
        // Without the side output: the other gathered instantiation, the same h.
        gather_args.gate_up_out = nullptr;
        d_h.upload(std::vector<uint16_t>(d_h.count, kPoison));
        gather_args.b_up = fused ? nullptr : d_up.ptr;
        expert_gemm(gather_args, nullptr);
        MOK_CHECK_CUDA(cudaDeviceSynchronize());
        ASSERT_EQ(d_h.download(), want.first) << "h without gate_up_out, " << label;
        EXPECT_TRUE(fx.status.read().ok()) << label;
      }
    }
  }
}

// The backward's down dgrad (kSwiGLUBackward, MN-major weights) with its A rows, d_out's, gathered from the token
// rows: d_g | d_u and the row partials bitwise those of the copied rows, local and mixed sources, tile_m 64 and
// 128, a partial last n-block (n 320), row scales with zeros, a clamped SwiGLU; the copied run is itself checked
// against the CPU by SwiGLUBackwardWithinBudget.
TEST(ExpertGemmTest, SwiGLUBackwardGatheredRowsEqualTheCopiedRowsBitwise) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> expert_counts = {129, 0, 1, 255, 64};
  const int num_experts = static_cast<int>(expert_counts.size());
  const int k = 320, n = 320;  // k: the hidden width (5 k-blocks); n: I, two 256-column n-blocks, the second partial
  const int n_blocks = gemm_n_blocks(GemmEpilogue::kSwiGLUBackward, n);
  const int num_tokens = 300, top_k = 4, ranks = 3;
  for (int tile_m : {64, 128}) {
    for (bool mixed : {false, true}) {
      const uint64_t seed = 760 + tile_m + mixed;
      const std::string label = "tile_m " + std::to_string(tile_m) + (mixed ? ", mixed sources" : ", all local") +
                                ", seed " + std::to_string(seed);
      GemmFixture fx(expert_counts, tile_m, tile_m);
      const int rank = mixed ? 2 : 0;
      // d_out of every source rank [ranks, T, k]; this rank's is what the gather reads.
      const auto d_out = hashed_bf16(size_t(ranks) * num_tokens * k, seed, -2, 2);
      const auto [route, copied, gathered_a] =
          gathered_rows(fx, d_out, k, num_tokens, top_k, ranks, rank, mixed, seed);
      const auto w_down = hashed_bf16(size_t(num_experts) * k * n, seed + 4, -2, 2);  // [E, H, I]
      std::vector<uint16_t> gate_up(size_t(fx.a_rows) * 2 * n);
      for (size_t i = 0; i < gate_up.size(); ++i)
        gate_up[i] = to_bf16_bits(hashed_int(seed + 5, int64_t(i), -48, 48) / 4.0f);
      std::vector<float> scale(fx.a_rows);
      for (int64_t r = 0; r < fx.a_rows; ++r) scale[r] = r % 3 == 0 ? 0.0f : hashed_int(seed + 6, r, 1, 8) / 4.0f;
      DeviceArray<uint16_t> d_local(std::vector<uint16_t>(d_out.begin() + int64_t(rank) * num_tokens * k,
                                                          d_out.begin() + int64_t(rank + 1) * num_tokens * k));
      DeviceArray<uint16_t> d_copied(copied), d_gathered_a(gathered_a), d_w(w_down), d_gate_up(gate_up);
      DeviceArray<uint16_t> d_grad(size_t(fx.a_rows) * 2 * n);
      DeviceArray<float> d_scale(scale), d_partials(size_t(fx.a_rows) * n_blocks);
      DeviceArray<int32_t> d_route(route);
      auto run = [&](const ExpertGemmArgs& run_args) { return run_swiglu_backward(run_args, d_grad, d_partials); };
      ExpertGemmArgs copy_args = fx.args(GemmEpilogue::kSwiGLUBackward, d_copied.ptr, k, d_w.ptr, n, d_grad.ptr);
      copy_args.b_major = OperandMajor::kMN;
      copy_args.gate_up = d_gate_up.ptr;
      copy_args.row_partials = d_partials.ptr;
      copy_args.row_scale = d_scale.ptr;
      copy_args.swiglu_limit = 7.0f;
      copy_args.cluster_n = 1;
      const auto want = run(copy_args);
      ASSERT_EQ(check_layout(want.first, fx.seg, fx.a_rows, 2 * n), "") << "copied rows, " << label;
      ExpertGemmArgs gather_args = copy_args;
      gather_args.a = d_gathered_a.ptr;
      gather_args.gather = {.x = d_local.ptr, .row_route = d_route.ptr, .num_tokens = num_tokens, .top_k = top_k,
                            .rank = rank};
      const auto got = run(gather_args);
      for (size_t i = 0; i < want.first.size(); ++i)
        ASSERT_EQ(got.first[i], want.first[i]) << "d_g | d_u differs from the copied rows' at row " << i / (2 * n)
                                               << " col " << i % (2 * n) << ", " << label;
      for (size_t i = 0; i < want.second.size(); ++i)
        ASSERT_EQ(float_bits(got.second[i]), float_bits(want.second[i]))
            << "row partial differs at row " << i / n_blocks << " n-block " << i % n_blocks << ", " << label;
      EXPECT_TRUE(fx.status.read().ok()) << label;
    }
  }
}

// The gather's and the scatter's validation tests: a call that validate() accepts (it reads none of the buffers,
// so one small static buffer stands for all), and validate()'s message for a call ("no throw" when it accepts it).
alignas(16) uint16_t validation_buffer[64];
ExpertGemmArgs validation_args(GemmEpilogue epilogue) {
  static DeviceStatus status;  // validation does not read it
  ExpertGemmArgs args;
  args.epilogue = epilogue;
  args.a = args.b = args.out = validation_buffer;
  args.k = 256;
  args.n = 512;
  args.local_experts = 2;
  args.a_rows = 128;
  args.expert_counts = args.expert_row_offsets = args.scheduled_rows =
      reinterpret_cast<const int32_t*>(validation_buffer);
  args.ticket = reinterpret_cast<int32_t*>(validation_buffer);
  args.waits.status = &status;
  return args;
}
std::string message(const ExpertGemmArgs& args) {
  try { validate(args); } catch (const std::invalid_argument& e) { return std::string(e.what()); }
  return std::string("no throw");
}

TEST(ExpertGemmTest, GatherValidationNamesTheArgument) {
  uint16_t* buffer = validation_buffer;
  ExpertGemmArgs base = validation_args(GemmEpilogue::kSwiGLU);
  base.gather = {.x = buffer, .row_route = reinterpret_cast<const int32_t*>(buffer), .num_tokens = 8, .top_k = 2,
                 .rank = 0};
  EXPECT_EQ(message(base), "no throw");
  ExpertGemmArgs args = base;
  args.epilogue = GemmEpilogue::kStore;
  EXPECT_NE(message(args).find("gather (A rows from x) is only for kSwiGLU with b_major kK (the forward's gate/up) "
                               "or kSwiGLUBackward"),
            std::string::npos)
      << message(args);
  // The down dgrad gathers d_out's rows (MN-major weights, no second source).
  args = base;
  args.epilogue = GemmEpilogue::kSwiGLUBackward;
  args.b_major = OperandMajor::kMN;
  args.gate_up = buffer;
  args.row_partials = reinterpret_cast<float*>(buffer);
  EXPECT_EQ(message(args), "no throw");
  args = base;
  args.gather.x = buffer + 1;
  EXPECT_NE(message(args).find("gather.x must be a 16-byte aligned"), std::string::npos) << message(args);
  args = base;
  args.gather.row_route = nullptr;
  EXPECT_NE(message(args).find("gather.row_route must be set"), std::string::npos) << message(args);
  args = base;
  args.gather.top_k = 0;
  EXPECT_NE(message(args).find("gather needs num_tokens > 0, top_k > 0 and rank >= 0"), std::string::npos)
      << message(args);
  args = base;
  args.cluster_n = 2;
  EXPECT_NE(message(args).find("gather runs in clusters of 1"), std::string::npos) << message(args);
}

// ExpertGemmArgs::scatter (src/device/gemm/row_scatter.cuh): each real row's output lands in its route's row of
// its source rank's combine buffer, with the bits the plain store writes to `out`; no other row of any buffer is
// written (the buffers are poisoned first, and every destination not taken by a row must keep the poison).
// K-major and MN-major weights, tile_m 64 and 128, a partial last n-block (n 320), row scales, clusters of 1 and 2,
// reruns; the plain store's output is itself checked against the CPU on every 7th column.
TEST(ExpertGemmTest, StoreScatteredRowsLandInTheirRoutesRows) {
  MOK_REQUIRE_GPUS(1);
  const std::vector<int32_t> expert_counts = {129, 0, 1, 255, 64, 700};
  const int num_experts = static_cast<int>(expert_counts.size());
  const int k = 320, num_tokens = 200, top_k = 3, ranks = 3;
  for (const OperandMajor major : {OperandMajor::kK, OperandMajor::kMN}) {
    for (int n : {320, 512}) {
      for (int tile_m : {64, 128}) {
        const uint64_t seed = 800 + n + tile_m + 7 * int(major);
        const std::string label = std::string(major == OperandMajor::kK ? "K-major" : "MN-major") + " n " +
                                  std::to_string(n) + " tile_m " + std::to_string(tile_m) + " seed " +
                                  std::to_string(seed);
        GemmFixture fx(expert_counts, tile_m, tile_m);
        const auto a = hashed_bf16(size_t(fx.a_rows) * k, seed, -2, 2);
        const auto w = hashed_bf16(size_t(num_experts) * n * k, seed + 1, -2, 2);  // [E, n, k] or [E, k, n]
        std::vector<float> scale(fx.a_rows);
        for (int64_t r = 0; r < fx.a_rows; ++r) scale[r] = std::ldexp(1.0f, hashed_int(seed, r, -3, 3));
        // Every destination (src, token, slot) taken by at most one real row: a shuffled prefix of all of them.
        const int destinations = ranks * num_tokens * top_k;
        std::vector<int32_t> ids(destinations);
        for (int i = 0; i < destinations; ++i) ids[i] = i;
        std::mt19937 rng(static_cast<uint32_t>(seed));
        std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<int32_t> route(fx.a_rows, -1), row_of(destinations, -1);
        int taken = 0;
        for (int64_t row = 0; row < fx.seg.rows; ++row)
          if (fx.seg.is_real(row)) {
            route[row] = ids[taken++];
            row_of[route[row]] = static_cast<int32_t>(row);
          }
        ASSERT_LE(taken, destinations);
        DeviceArray<uint16_t> d_a(a), d_w(w), d_out(size_t(fx.a_rows) * n);
        DeviceArray<float> d_scale(scale);
        DeviceArray<int32_t> d_route(route);
        std::vector<std::unique_ptr<DeviceArray<uint16_t>>> combined;
        const size_t rank_elements = size_t(num_tokens) * top_k * n;
        for (int r = 0; r < ranks; ++r) combined.push_back(std::make_unique<DeviceArray<uint16_t>>(rank_elements));
        ExpertGemmArgs args = fx.args(GemmEpilogue::kStore, d_a.ptr, k, d_w.ptr, n, d_out.ptr);
        args.b_major = major;
        args.row_scale = d_scale.ptr;
        args.cluster_n = 1;
        d_out.upload(std::vector<uint16_t>(d_out.count, kPoison));
        expert_gemm(args, nullptr);
        MOK_CHECK_CUDA(cudaDeviceSynchronize());
        const auto out = d_out.download();
        ASSERT_EQ(check_layout(out, fx.seg, fx.a_rows, n), "") << label;
        for (int64_t row = 0; row < fx.seg.rows; ++row) {
          if (!fx.seg.is_real(row)) continue;
          const int e = fx.seg.expert_of(row);
          for (int c = 0; c < n; c += 7) {
            const double sum = major == OperandMajor::kK ? cpu_dot(a, row, w, int64_t(e) * n + c, k)
                                                         : cpu_dot_mn(a, row, w, e, k, n, c);
            const float want = static_cast<float>(sum) * scale[row];
            ASSERT_EQ(out[row * n + c], to_bf16_bits(want))
                << where("store", row, c, from_bf16_bits(out[row * n + c]), want) << ", " << label;
          }
        }
        PeerPointers bases{};
        for (int r = 0; r < ranks; ++r) bases.base[r] = combined[r]->ptr;
        std::vector<uint8_t> maps(size_t(ranks) * kRowScatterMapBytes);
        encode_row_scatter_maps(bases, ranks, int64_t(num_tokens) * top_k, n, maps.data());
        DeviceArray<uint8_t> d_maps(maps);
        ExpertGemmArgs scatter = args;
        scatter.out = nullptr;
        scatter.scatter.maps = d_maps.ptr;
        scatter.scatter.row_route = d_route.ptr;
        scatter.scatter.num_tokens = num_tokens;
        scatter.scatter.top_k = top_k;
        scatter.scatter.ranks = ranks;
        for (int cluster_n : {1, 2, 1}) {
          if (cluster_n == 2 && choose_cluster_n(GemmEpilogue::kStore, n) != 2) continue;
          scatter.cluster_n = cluster_n;
          for (auto& c : combined) c->upload(std::vector<uint16_t>(rank_elements, kPoison));
          expert_gemm(scatter, nullptr);
          MOK_CHECK_CUDA(cudaDeviceSynchronize());
          for (int r = 0; r < ranks; ++r) {
            const auto got = combined[r]->download();
            for (int64_t dest = 0; dest < int64_t(num_tokens) * top_k; ++dest) {
              const int32_t row = row_of[int64_t(r) * num_tokens * top_k + dest];
              for (int c = 0; c < n; ++c) {
                const uint16_t want = row >= 0 ? out[int64_t(row) * n + c] : kPoison;
                ASSERT_EQ(got[dest * n + c], want)
                    << "rank " << r << " combine row " << dest << " (token " << dest / top_k << ", slot "
                    << dest % top_k << ") col " << c
                    << (row >= 0 ? ": differs from the stored row " + std::to_string(row) : ": written, no row's route")
                    << ", cluster_n " << cluster_n << ", " << label;
              }
            }
          }
        }
        EXPECT_TRUE(fx.status.read().ok()) << label;
      }
    }
  }
}

TEST(ExpertGemmTest, ScatterValidationNamesTheArgument) {
  uint16_t* buffer = validation_buffer;
  ExpertGemmArgs base = validation_args(GemmEpilogue::kStore);
  base.out = nullptr;  // the rows go to the combine buffers
  base.scatter.row_route = reinterpret_cast<const int32_t*>(buffer);
  base.scatter.num_tokens = 8;
  base.scatter.top_k = 2;
  base.scatter.ranks = 2;
  alignas(64) static uint8_t maps[2 * kRowScatterMapBytes];
  base.scatter.maps = maps;
  EXPECT_EQ(message(base), "no throw");
  ExpertGemmArgs args = base;
  args.b_major = OperandMajor::kMN;
  EXPECT_EQ(message(args), "no throw");
  args = base;
  args.epilogue = GemmEpilogue::kSwiGLU;
  EXPECT_NE(message(args).find("scatter (rows to the combine buffers) is only for kStore in kBF16"), std::string::npos)
      << message(args);
  args = base;
  args.out = buffer;
  EXPECT_NE(message(args).find("out must be null with scatter"), std::string::npos) << message(args);
  args = base;
  args.scatter.ranks = 0;
  EXPECT_NE(message(args).find("scatter.ranks must be in [1, 72]"), std::string::npos) << message(args);
  args = base;
  args.scatter.maps = nullptr;
  EXPECT_NE(message(args).find("scatter.maps must be a non-null, 64-byte aligned"), std::string::npos)
      << message(args);
  args = base;
  args.scatter.maps = maps + 16;
  EXPECT_NE(message(args).find("scatter.maps must be a non-null, 64-byte aligned"), std::string::npos)
      << message(args);
  args = base;
  args.scatter.top_k = 0;
  EXPECT_NE(message(args).find("scatter needs num_tokens > 0 and top_k > 0"), std::string::npos) << message(args);
  args = base;
  args.scatter.row_route = nullptr;  // no scatter: then out is required
  EXPECT_NE(message(args).find("out must be a non-null"), std::string::npos) << message(args);
  // The tensor maps' encoder names its bad arguments too.
  PeerPointers bases{};
  bases.base[0] = buffer;
  const auto encode = [&](int ranks, int64_t rows, int n) {
    try { encode_row_scatter_maps(bases, ranks, rows, n, maps); } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  EXPECT_NE(encode(2, 16, 512).find("combined.base[1] must be a non-null, 16-byte aligned"), std::string::npos);
  EXPECT_NE(encode(0, 16, 512).find("ranks must be in [1, 72]"), std::string::npos);
  EXPECT_NE(encode(1, 0, 512).find("rows must be in [1, 2^31)"), std::string::npos);
  EXPECT_NE(encode(1, 16, 100).find("n must be a positive multiple of 64"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------------
// Precision::kFP8 (e4m3 with block scales, tests/common/fp8.h). Exact inputs: integer e4m3 values in [-4, 4]
// and power-of-two scales, so every k-block's partial sum is exact in the tensor cores and every promoted fp32
// sum is exact: the output is the CPU's double result rounded once to bf16, bitwise.

namespace fp8_tests {

using testing::Fp8Matrix;

// The FP8 fields of a call on the fixture's schedule.
ExpertGemmArgs fp8_args(const GemmFixture& fx, GemmEpilogue epilogue, const DeviceArray<uint8_t>& a,
                        const DeviceArray<float>& a_scales, int k, const DeviceArray<uint8_t>& b,
                        const DeviceArray<float>& b_scales, int n, void* out) {
  ExpertGemmArgs args = fx.args(epilogue, a.ptr, k, b.ptr, n, out);
  args.precision = Precision::kFP8;
  args.a_scales = a_scales.ptr;
  args.b_scales = b_scales.ptr;
  return args;
}

}  // namespace fp8_tests

TEST(ExpertGemmTest, Fp8StoreIsBitwiseExactOnExactInputs) {
  MOK_REQUIRE_GPUS(1);
  using testing::Fp8Matrix;
  const std::vector<int32_t> expert_counts = {0, 1, 63, 129, 300, 0, 128, 7};
  const int num_experts = static_cast<int>(expert_counts.size());
  struct Case { int tile_m, k, n; bool scaled; int cluster_n; int block_n = 0; };
  // k 320: a partial last k-block (64 columns); n 384: three 128-column tiles (clusters of 1), n 512: four
  // (clusters of 2 chosen), n 448: a partial last tile. block_n 256 (the wide tile, two 128-column halves promoted in
  // turn): n 512 two tiles (a pair), n 768 three (clusters of 1), n 448 a last tile of 192 columns, n 640 a last one
  // of 128 (its other groups' B scales past the expert's rows: the clamped block); tiles start at 128-row scale
  // blocks or 64 rows into one.
  for (const Case c : {Case{128, 512, 512, false, 0}, Case{64, 320, 384, true, 0}, Case{128, 320, 448, false, 1},
                       Case{64, 512, 512, true, 1}, Case{128, 320, 512, true, 0, 256},
                       Case{64, 512, 768, false, 0, 256}, Case{64, 320, 448, true, 1, 256},
                       Case{128, 512, 640, false, 1, 256}}) {
    const uint64_t seed = 900 + c.tile_m + c.k + c.n + c.scaled + c.block_n;
    const std::string label = "tile_m " + std::to_string(c.tile_m) + ", k " + std::to_string(c.k) + ", n " +
                              std::to_string(c.n) + (c.scaled ? ", row scales" : "") + ", cluster_n " +
                              std::to_string(c.cluster_n) + ", block_n " + std::to_string(c.block_n) + ", seed " +
                              std::to_string(seed);
    GemmFixture fx(expert_counts, 128, c.tile_m);
    const auto a = Fp8Matrix::exact(fx.a_rows, fx.a_rows, c.k, true, seed);
    const auto w = Fp8Matrix::exact(int64_t(num_experts) * c.n, c.n, c.k, false, seed + 2);
    std::vector<float> row_scale(fx.a_rows);
    for (int64_t r = 0; r < fx.a_rows; ++r) row_scale[r] = std::ldexp(1.0f, hashed_int(seed + 4, r, -1, 1));
    DeviceArray<uint8_t> d_a(a.bits), d_w(w.bits);
    DeviceArray<float> d_sa(a.scales), d_sw(w.scales), d_rs(row_scale);
    DeviceArray<uint16_t> d_out(size_t(fx.a_rows) * c.n);
    d_out.upload(std::vector<uint16_t>(d_out.count, kPoison));
    ExpertGemmArgs args = fp8_tests::fp8_args(fx, GemmEpilogue::kStore, d_a, d_sa, c.k, d_w, d_sw, c.n, d_out.ptr);
    args.row_scale = c.scaled ? d_rs.ptr : nullptr;
    args.cluster_n = c.cluster_n;
    args.block_n = c.block_n;
    expert_gemm(args, nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    ASSERT_TRUE(fx.status.read().ok()) << fx.status.read().describe(1, 1, 1) << ", " << label;
    const auto got = d_out.download();
    ASSERT_EQ(check_layout(got, fx.seg, fx.a_rows, c.n), "") << label;
    for (int64_t row = 0; row < fx.seg.rows; ++row) {
      if (!fx.seg.is_real(row)) continue;
      const int e = fx.seg.expert_of(row);
      for (int col = 0; col < c.n; ++col) {
        const double want = a.dot(row, w, int64_t(e) * c.n + col) * (c.scaled ? row_scale[row] : 1.0f);
        ASSERT_EQ(got[row * c.n + col], to_bf16_bits(static_cast<float>(want)))
            << where("fp8 store", row, col, from_bf16_bits(got[row * c.n + col]), want) << ", " << label;
      }
    }
  }
}

TEST(ExpertGemmTest, Fp8SwiGLUFusedAndSeparateWeights) {
  MOK_REQUIRE_GPUS(1);
  using testing::Fp8Matrix;
  const std::vector<int32_t> expert_counts = {129, 0, 1, 255, 64};
  const int num_experts = static_cast<int>(expert_counts.size());
  const int k = 384;
  for (const int n : {256, 192}) {  // 192: the up half of fused weights starts mid-block; 3 tiles of 64
    const uint64_t seed = 950 + n;
    const std::string label = "n " + std::to_string(n) + ", seed " + std::to_string(seed);
    GemmFixture fx(expert_counts, 128, 64);
    const auto a = Fp8Matrix::exact(fx.a_rows, fx.a_rows, k, true, seed);
    // Fused [E, 2n, k] (blocks over each expert's 2n rows) and the same values as separate gate and up
    // matrices (their own blocks): different scales, so each is checked against its own CPU result.
    const auto fused = Fp8Matrix::exact(int64_t(num_experts) * 2 * n, 2 * n, k, false, seed + 2);
    const auto gate = Fp8Matrix::exact(int64_t(num_experts) * n, n, k, false, seed + 4);
    const auto up = Fp8Matrix::exact(int64_t(num_experts) * n, n, k, false, seed + 6);
    DeviceArray<uint8_t> d_a(a.bits), d_fused(fused.bits), d_gate(gate.bits), d_up(up.bits);
    DeviceArray<float> d_sa(a.scales), d_sfused(fused.scales), d_sgate(gate.scales), d_sup(up.scales);
    DeviceArray<uint16_t> d_h(size_t(fx.a_rows) * n), d_gu(size_t(fx.a_rows) * 2 * n);
    for (const bool separate : {false, true}) {
      const std::string what = label + (separate ? ", separate weights" : ", fused weights");
      d_h.upload(std::vector<uint16_t>(d_h.count, kPoison));
      d_gu.upload(std::vector<uint16_t>(d_gu.count, kPoison));
      ExpertGemmArgs args = separate
          ? fp8_tests::fp8_args(fx, GemmEpilogue::kSwiGLU, d_a, d_sa, k, d_gate, d_sgate, n, d_h.ptr)
          : fp8_tests::fp8_args(fx, GemmEpilogue::kSwiGLU, d_a, d_sa, k, d_fused, d_sfused, n, d_h.ptr);
      if (separate) {
        args.b_up = d_up.ptr;
        args.b_up_scales = d_sup.ptr;
      }
      args.gate_up_out = d_gu.ptr;
      expert_gemm(args, nullptr);
      MOK_CHECK_CUDA(cudaDeviceSynchronize());
      ASSERT_TRUE(fx.status.read().ok()) << fx.status.read().describe(1, 1, 1) << ", " << what;
      const auto h = d_h.download(), gu = d_gu.download();
      ASSERT_EQ(check_layout(h, fx.seg, fx.a_rows, n), "") << what;
      ASSERT_EQ(check_layout(gu, fx.seg, fx.a_rows, 2 * n), "") << what;
      for (int64_t row = 0; row < fx.seg.rows; ++row) {
        if (!fx.seg.is_real(row)) continue;
        const int e = fx.seg.expert_of(row);
        for (int c = 0; c < n; ++c) {
          const double g = separate ? a.dot(row, gate, int64_t(e) * n + c) : a.dot(row, fused, int64_t(e) * 2 * n + c);
          const double u = separate ? a.dot(row, up, int64_t(e) * n + c) : a.dot(row, fused, int64_t(e) * 2 * n + n + c);
          // The raw g and u: exact sums rounded once, bitwise.
          ASSERT_EQ(gu[row * 2 * n + c], to_bf16_bits(static_cast<float>(g)))
              << where("g", row, c, from_bf16_bits(gu[row * 2 * n + c]), g) << ", " << what;
          ASSERT_EQ(gu[row * 2 * n + n + c], to_bf16_bits(static_cast<float>(u)))
              << where("u", row, c, from_bf16_bits(gu[row * 2 * n + n + c]), u) << ", " << what;
          // h: bf16 rounding and __expf, as the bf16 SwiGLU test's budget.
          const double want = g / (1 + std::exp(-g)) * u;
          const float value = from_bf16_bits(h[row * n + c]);
          ASSERT_FALSE(std::isnan(value)) << where("h NaN", row, c, value, want) << ", " << what;
          ASSERT_LE(std::abs(value - want), std::abs(want) / 128 + 1e-3) << where("h", row, c, value, want) << ", " << what;
        }
      }
    }
  }
}

// kSwiGLU with out_scales (h written quantized, SwiGLUQuantEpilogue) against the plain FP8 kSwiGLU's bf16 h
// quantized per 1 x 128 on the CPU (tests/common/fp8.h, the recipe's reference; the plain kSwiGLU is checked against
// the CPU above): e4m3 values and scales bitwise for every scheduled row (padding rows: zeros, scale 1); rows past
// the schedule untouched. n 256 (two-pass tasks, clusters of 1 and 2), 192 (a last task of one pass), fused and
// separate weights, row scales, the clamp, power-of-two scales, and a row whose A holds a NaN (its blocks' scales
// NaN, no other row touched). With gate_up_out and hidden_out (a training context's side outputs,
// SwiGLUQuantEpilogue<true>): the same e4m3 values and scales, and g | u and h bitwise the plain kSwiGLU's (its
// gate_up_out and out), poison past the schedule in both. The quantizing runs compared: block_n 128 (two 128 x 128
// passes a task) and the default (one 128 x 256 tile a task; at n 192 its last task computes 64 columns past n).
// The side outputs' runs: block_n 128 (two passes) and the default (one 128 x 256 tile, its g, u and h in two rounds
// of 64 columns; at n 192 the last task's second round stores nothing, which would be u's first box of gate_up_out).
TEST(ExpertGemmTest, Fp8SwiGLUQuantizedHIsTheRecipeOfTheBf16H) {
  MOK_REQUIRE_GPUS(1);
  using testing::Fp8Matrix;
  const std::vector<int32_t> expert_counts = {129, 0, 1, 255, 64};
  const int num_experts = static_cast<int>(expert_counts.size());
  const int k = 384 + 64;  // a partial last k-block
  struct Case { int n, tile_m, cluster_n; bool separate, scaled, pow2; float limit; };
  for (const Case c : {Case{256, 128, 1, false, false, false, 0.0f}, Case{256, 128, 2, true, true, true, 0.0f},
                       Case{192, 64, 1, false, true, false, 7.0f}, Case{192, 128, 1, true, false, true, 0.0f}}) {
    const uint64_t seed = 990 + c.n + c.tile_m + c.cluster_n + c.separate;
    const std::string label = "n " + std::to_string(c.n) + ", tile_m " + std::to_string(c.tile_m) + ", cluster_n " +
                              std::to_string(c.cluster_n) + (c.separate ? ", separate" : ", fused") + " weights" +
                              (c.scaled ? ", row scales" : "") + (c.pow2 ? ", power-of-two scales" : "") +
                              ", limit " + std::to_string(c.limit) + ", seed " + std::to_string(seed);
    GemmFixture fx(expert_counts, 128, c.tile_m);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> a_values(size_t(fx.a_rows) * k), gate_values(size_t(num_experts) * 2 * c.n * k);
    for (auto& v : a_values) v = normal(rng) * 2.0f;
    for (auto& v : gate_values) v = normal(rng) * 0.05f;
    auto a = Fp8Matrix::quantize(a_values, fx.a_rows, fx.a_rows, k, true);
    const int64_t nan_row = 100;  // a real row of expert 0: its A holds a NaN
    a.bits[nan_row * k + 5] = 0x7f;
    // Fused [E, 2n, k], or gate and up [E, n, k] each (the same values split by expert rows).
    std::vector<float> gate_only, up_only;
    for (int e = 0; e < num_experts; ++e) {
      const auto begin = gate_values.begin() + int64_t(e) * 2 * c.n * k;
      gate_only.insert(gate_only.end(), begin, begin + int64_t(c.n) * k);
      up_only.insert(up_only.end(), begin + int64_t(c.n) * k, begin + int64_t(2) * c.n * k);
    }
    const auto fused = Fp8Matrix::quantize(gate_values, int64_t(num_experts) * 2 * c.n, 2 * c.n, k, false);
    const auto gate = Fp8Matrix::quantize(gate_only, int64_t(num_experts) * c.n, c.n, k, false);
    const auto up = Fp8Matrix::quantize(up_only, int64_t(num_experts) * c.n, c.n, k, false);
    std::vector<float> row_scale(fx.a_rows);
    for (auto& v : row_scale) v = 0.25f + std::abs(normal(rng));
    DeviceArray<uint8_t> d_a(a.bits), d_fused(fused.bits), d_gate(gate.bits), d_up(up.bits);
    DeviceArray<float> d_sa(a.scales), d_sfused(fused.scales), d_sgate(gate.scales), d_sup(up.scales), d_rs(row_scale);
    const int blocks = (c.n + 127) / 128;
    DeviceArray<uint16_t> d_h(size_t(fx.a_rows) * c.n), d_gu(size_t(fx.a_rows) * 2 * c.n);
    DeviceArray<uint16_t> d_side_h(d_h.count), d_side_gu(d_gu.count), d_wside_h(d_h.count), d_wside_gu(d_gu.count);
    DeviceArray<uint8_t> d_q(size_t(fx.a_rows) * c.n), d_side_q(d_q.count), d_wide_q(d_q.count), d_wside_q(d_q.count);
    DeviceArray<float> d_s(size_t(blocks) * fx.a_rows), d_side_s(d_s.count), d_wide_s(d_s.count), d_wside_s(d_s.count);
    for (auto* d : {&d_h, &d_gu, &d_side_h, &d_side_gu, &d_wside_h, &d_wside_gu})
      d->upload(std::vector<uint16_t>(d->count, kPoison));
    for (auto* d : {&d_q, &d_side_q, &d_wide_q, &d_wside_q}) d->upload(std::vector<uint8_t>(d->count, kBytePoison));
    for (auto* d : {&d_s, &d_side_s, &d_wide_s, &d_wside_s}) d->upload(float_poison(d->count));
    auto args_for = [&](void* out) {
      ExpertGemmArgs args =
          c.separate ? fp8_tests::fp8_args(fx, GemmEpilogue::kSwiGLU, d_a, d_sa, k, d_gate, d_sgate, c.n, out)
                     : fp8_tests::fp8_args(fx, GemmEpilogue::kSwiGLU, d_a, d_sa, k, d_fused, d_sfused, c.n, out);
      if (c.separate) {
        args.b_up = d_up.ptr;
        args.b_up_scales = d_sup.ptr;
      }
      args.row_scale = c.scaled ? d_rs.ptr : nullptr;
      args.swiglu_limit = c.limit;
      return args;
    };
    ExpertGemmArgs plain = args_for(d_h.ptr);
    plain.gate_up_out = d_gu.ptr;
    expert_gemm(plain, nullptr);
    ExpertGemmArgs quantized = args_for(d_q.ptr);
    quantized.out_scales = d_s.ptr;
    quantized.out_scales_power_of_two = c.pow2;
    quantized.cluster_n = c.cluster_n;
    quantized.block_n = 128;
    expert_gemm(quantized, nullptr);
    ExpertGemmArgs side = quantized;
    side.block_n = 128;
    side.out = d_side_q.ptr;
    side.out_scales = d_side_s.ptr;
    side.gate_up_out = d_side_gu.ptr;
    side.hidden_out = d_side_h.ptr;
    expert_gemm(side, nullptr);
    ExpertGemmArgs wide = quantized;
    wide.out = d_wide_q.ptr;
    wide.out_scales = d_wide_s.ptr;
    wide.block_n = 0;
    expert_gemm(wide, nullptr);
    ExpertGemmArgs wide_side = side;
    wide_side.out = d_wside_q.ptr;
    wide_side.out_scales = d_wside_s.ptr;
    wide_side.gate_up_out = d_wside_gu.ptr;
    wide_side.hidden_out = d_wside_h.ptr;
    wide_side.block_n = 0;
    expert_gemm(wide_side, nullptr);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
    // The NaN row's h blocks are reported (without the clamp; with it fminf / fmaxf return the other operand, as
    // in bf16, and h stays finite); nothing else is.
    const StatusReport report = fx.status.read();
    if (c.limit == 0.0f) {
      ASSERT_EQ(report.raw.error_bits, uint32_t(kStatusNonFinite)) << report.describe(1, 1, 1) << ", " << label;
      EXPECT_EQ(report.nonfinite_where(), NonFiniteWhere::kHidden) << label;
      EXPECT_EQ(report.nonfinite_row(), nan_row) << label;
      fx.status.reset();
    } else {
      ASSERT_TRUE(report.ok()) << report.describe(1, 1, 1) << ", " << label;
    }
    const auto h = d_h.download();
    const auto q = d_q.download();
    const auto s = d_s.download();
    // The CPU's quantization of the GPU's bf16 h, scheduled rows only (the rest of h is poison).
    std::vector<float> h_values(size_t(fx.seg.rows) * c.n);
    for (size_t i = 0; i < h_values.size(); ++i) h_values[i] = from_bf16_bits(h[i]);
    const auto want = Fp8Matrix::quantize(h_values, fx.seg.rows, fx.seg.rows, c.n, true, c.pow2);
    for (int64_t row = 0; row < fx.a_rows; ++row) {
      const bool scheduled = row < fx.seg.rows;
      for (int col = 0; col < c.n; ++col) {
        const uint8_t got = q[row * c.n + col];
        const uint8_t expected = scheduled ? want.bits[row * c.n + col] : kBytePoison;
        ASSERT_EQ(got, expected) << "h row " << row << " col " << col << (scheduled ? "" : " (past the schedule)")
                                 << ", h bf16 " << (scheduled ? h_values[row * c.n + col] : 0.0f) << ", " << label;
      }
      for (int b = 0; b < blocks; ++b) {
        const float got = s[int64_t(b) * fx.a_rows + row];
        const uint32_t expected = scheduled ? float_bits(want.scales[int64_t(b) * fx.seg.rows + row]) : kFloatPoison;
        ASSERT_EQ(float_bits(got), expected) << "scale of row " << row << " block " << b << ": got " << got
                                             << (scheduled ? "" : " (past the schedule)") << ", " << label;
      }
    }
    if (c.limit == 0.0f) {
      ASSERT_TRUE(std::isnan(s[nan_row])) << "the NaN row's first block, " << label;
    }
    ASSERT_FALSE(std::isnan(s[nan_row + 1])) << "the row after the NaN row, " << label;
    // The side outputs' run (its NaN row reported again, as above): bitwise the runs without them.
    ASSERT_EQ(d_side_q.download(), q) << "e4m3 h with the side outputs, " << label;
    const auto side_s = d_side_s.download();
    for (size_t i = 0; i < s.size(); ++i)
      ASSERT_EQ(float_bits(side_s[i]), float_bits(s[i])) << "scale " << i << " with the side outputs, " << label;
    ASSERT_EQ(d_side_h.download(), h) << "hidden_out against the plain kSwiGLU's h, " << label;
    ASSERT_EQ(d_wide_q.download(), q) << "e4m3 h of the 128 x 256 tile (block_n 0), " << label;
    const auto wide_s = d_wide_s.download();
    for (size_t i = 0; i < s.size(); ++i)
      ASSERT_EQ(float_bits(wide_s[i]), float_bits(s[i])) << "scale " << i << " of the 128 x 256 tile, " << label;
    ASSERT_EQ(d_side_gu.download(), d_gu.download()) << "gate_up_out against the plain kSwiGLU's, " << label;
    ASSERT_EQ(d_wside_q.download(), q) << "e4m3 h of the 128 x 256 tile with the side outputs, " << label;
    const auto wside_s = d_wside_s.download();
    for (size_t i = 0; i < s.size(); ++i)
      ASSERT_EQ(float_bits(wside_s[i]), float_bits(s[i])) << "scale " << i << " of the 128 x 256 tile with the side "
                                                          << "outputs, " << label;
    ASSERT_EQ(d_wside_h.download(), h) << "hidden_out of the 128 x 256 tile, " << label;
    ASSERT_EQ(d_wside_gu.download(), d_gu.download()) << "gate_up_out of the 128 x 256 tile, " << label;
  }
}

// Values of a normal distribution quantized by the recipe (tests/common/fp8.h, Fp8Matrix::quantize), against the
// CPU's double product of the same quantized values. Budget: the bf16 output rounding (2^-9 relative) and the
// tensor cores' accumulation of a k-block (fewer bits than fp32, DeepGEMM's reason for promoting every 128):
// 2^-8 of |want| plus 2^-11 of the sum of |terms|.
TEST(ExpertGemmTest, Fp8QuantizedNormalInputsWithinBudget) {
  MOK_REQUIRE_GPUS(1);
  using testing::Fp8Matrix;
  const std::vector<int32_t> expert_counts = {300, 17, 0, 520};
  const int num_experts = static_cast<int>(expert_counts.size());
  const int k = 1024 + 64, n = 640;
  const uint64_t seed = 977;
  GemmFixture fx(expert_counts, 128, 128);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a_values(size_t(fx.a_rows) * k), w_values(size_t(num_experts) * n * k);
  for (auto& v : a_values) v = normal(rng) * 3.0f;
  for (auto& v : w_values) v = normal(rng) * 0.02f;
  const auto a = Fp8Matrix::quantize(a_values, fx.a_rows, fx.a_rows, k, true);
  const auto w = Fp8Matrix::quantize(w_values, int64_t(num_experts) * n, n, k, false);
  DeviceArray<uint8_t> d_a(a.bits), d_w(w.bits);
  DeviceArray<float> d_sa(a.scales), d_sw(w.scales);
  DeviceArray<uint16_t> d_out(size_t(fx.a_rows) * n), d_again(size_t(fx.a_rows) * n);
  DeviceArray<uint16_t> d_wide(size_t(fx.a_rows) * n);
  for (auto* buffer : {&d_out, &d_again, &d_wide})
    buffer->upload(std::vector<uint16_t>(buffer->count, kPoison));
  expert_gemm(fp8_tests::fp8_args(fx, GemmEpilogue::kStore, d_a, d_sa, k, d_w, d_sw, n, d_out.ptr), nullptr);
  ExpertGemmArgs single = fp8_tests::fp8_args(fx, GemmEpilogue::kStore, d_a, d_sa, k, d_w, d_sw, n, d_again.ptr);
  single.cluster_n = 1;
  expert_gemm(single, nullptr);
  // The wide tile (256 columns: n 640 is two full tiles and one of 128, an odd count, so alone): each output element
  // is the same k-block sums promoted in the same order, so the same bits.
  ExpertGemmArgs wide = fp8_tests::fp8_args(fx, GemmEpilogue::kStore, d_a, d_sa, k, d_w, d_sw, n, d_wide.ptr);
  wide.block_n = 256;
  expert_gemm(wide, nullptr);
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
  ASSERT_TRUE(fx.status.read().ok()) << fx.status.read().describe(1, 1, 1);
  const auto got = d_out.download();
  ASSERT_EQ(got, d_again.download()) << "clusters of 2 and of 1 must give the same bits";
  ASSERT_EQ(got, d_wide.download()) << "the 256-column tile must give the 128-column tile's bits";
  ASSERT_EQ(check_layout(got, fx.seg, fx.a_rows, n), "");
  for (int64_t row = 0; row < fx.seg.rows; ++row) {
    if (!fx.seg.is_real(row)) continue;
    const int e = fx.seg.expert_of(row);
    for (int col = 0; col < n; ++col) {
      double want = 0, magnitude = 0;
      for (int c = 0; c < k; ++c) {
        const double term = a.value(row, c) * w.value(int64_t(e) * n + col, c);
        want += term;
        magnitude += std::abs(term);
      }
      const float value = from_bf16_bits(got[row * n + col]);
      ASSERT_FALSE(std::isnan(value)) << where("fp8 NaN", row, col, value, want);
      ASSERT_LE(std::abs(value - want), std::ldexp(std::abs(want), -8) + std::ldexp(magnitude, -11))
          << where("fp8 store", row, col, value, want) << " seed " << seed;
    }
  }
}

// The FP8 down dgrad (kFP8 kSwiGLUBackward; docs/design.md, "FP8 backward"): a = d_out rows in e4m3 with 1 x 128
// scales, b = W_down transposed [E, n = I, k = H] K-major with 128 x 128 scales, bf16's epilogue over 128-column
// tiles. Exact inputs (integer e4m3, power-of-two scales) make d_hu exact, as the FP8 store test's; g, u, the row
// scales and the budgets are SwiGLUBackwardWithinBudget's. k 320: a partial last k-block; n 448: a partial last
// tile (64 of 128 columns) and four tiles (pairs); n 384: three (single CTAs). Pairs and reruns: the same bits.
// Where n % 128 == 0, again with d_g | d_u written quantized (quantized_out, out_scales; power-of-two scales at
// tile_m 128): the bf16 outputs and partials the same bits, the e4m3 values and scales the CPU recipe's of those
// bf16 values (quantize_rows_fp8's arithmetic), nothing past the schedule written; with limit 0, a NaN in one
// row's g reported (kDGateUp, that row) and kept in that row's blocks.
TEST(ExpertGemmTest, Fp8SwiGLUBackwardWithinBudget) {
  MOK_REQUIRE_GPUS(1);
  using testing::Fp8Matrix;
  enum class Scale { kNone, kSet, kWithZeros };
  struct Case { std::vector<int32_t> expert_counts; int k, n, tile_m; float limit; Scale scale; };
  const std::vector<Case> cases = {
      {{0, 1, 63, 129, 300, 0, 128, 7}, 320, 448, 64, 0.0f, Scale::kNone},
      {{0, 1, 63, 129, 300, 0, 128, 7}, 256, 512, 128, 7.0f, Scale::kSet},
      {{65, 0, 130, 1}, 512, 384, 64, 7.0f, Scale::kWithZeros},
      {{33, 5}, 128, 64, 128, 3.0f, Scale::kSet},  // one tile of 64 columns
      {{200, 0, 57}, 384, 256, 64, 0.0f, Scale::kSet},
  };
  constexpr int kTileCols = 128;
  for (const Case& c : cases) {
    const int num_experts = static_cast<int>(c.expert_counts.size());
    const uint64_t seed = 1900 + c.k + c.n + c.tile_m;
    const std::string label = "k " + std::to_string(c.k) + " n " + std::to_string(c.n) + " tile_m " +
                              std::to_string(c.tile_m) + " limit " + std::to_string(c.limit) + " scale " +
                              std::to_string(int(c.scale)) + " seed " + std::to_string(seed);
    GemmFixture fx(c.expert_counts, 128, c.tile_m);
    const auto d_out = Fp8Matrix::exact(fx.a_rows, fx.a_rows, c.k, true, seed);
    const auto w_t = Fp8Matrix::exact(int64_t(num_experts) * c.n, c.n, c.k, false, seed + 1);  // W_down^T [E, I, H]
    std::vector<uint16_t> gate_up(size_t(fx.a_rows) * 2 * c.n);
    for (size_t i = 0; i < gate_up.size(); ++i) gate_up[i] = to_bf16_bits(hashed_int(seed + 2, int64_t(i), -48, 48) / 4.0f);
    std::vector<float> scale(fx.a_rows, 1.0f);
    for (int64_t r = 0; r < fx.a_rows; ++r) {
      if (c.scale != Scale::kNone) scale[r] = hashed_int(seed + 3, r, 1, 8) / 4.0f;
      if (c.scale == Scale::kWithZeros && r % 3 == 0) scale[r] = 0.0f;
    }
    DeviceArray<uint8_t> d_a(d_out.bits), d_w(w_t.bits);
    DeviceArray<float> d_sa(d_out.scales), d_sw(w_t.scales), d_scale(scale);
    DeviceArray<uint16_t> d_gate_up(gate_up), d_grad(size_t(fx.a_rows) * 2 * c.n);
    ExpertGemmArgs args = fp8_tests::fp8_args(fx, GemmEpilogue::kSwiGLUBackward, d_a, d_sa, c.k, d_w, d_sw, c.n,
                                              d_grad.ptr);
    const int n_blocks = gemm_n_blocks(args);
    ASSERT_EQ(n_blocks, (c.n + kTileCols - 1) / kTileCols) << label;
    DeviceArray<float> d_partials(size_t(fx.a_rows) * n_blocks);
    args.gate_up = d_gate_up.ptr;
    args.row_partials = d_partials.ptr;
    args.swiglu_limit = c.limit;
    if (c.scale != Scale::kNone) args.row_scale = d_scale.ptr;
    auto run = [&](const ExpertGemmArgs& run_args) { return run_swiglu_backward(run_args, d_grad, d_partials); };
    args.cluster_n = 1;
    const auto [grad, partials] = run(args);
    ASSERT_TRUE(fx.status.read().ok()) << fx.status.read().describe(1, 1, 1) << ", " << label;
    ASSERT_EQ(check_layout(grad, fx.seg, fx.a_rows, 2 * c.n), "") << "d_g / d_u, " << label;
    const double limit = c.limit;
    for (int64_t row = 0; row < fx.a_rows; ++row) {
      for (int nb = 0; nb < n_blocks; ++nb) {
        const uint32_t bits = float_bits(partials[row * n_blocks + nb]);
        if (row >= fx.seg.rows) {
          ASSERT_EQ(bits, kFloatPoison) << "row partial past the schedule written: row " << row << ", " << label;
        } else if (!fx.seg.is_real(row)) {
          ASSERT_EQ(bits, 0u) << "padding row partial not zero: row " << row << ", " << label;
        }
      }
      if (row >= fx.seg.rows || !fx.seg.is_real(row)) continue;
      const int e = fx.seg.expert_of(row);
      const double rw = c.scale == Scale::kNone ? 1.0 : scale[row];
      std::vector<double> partial_sum(n_blocks, 0.0), partial_magnitude(n_blocks, 0.0);
      for (int col = 0; col < c.n; ++col) {
        const double d_hu = d_out.dot(row, w_t, int64_t(e) * c.n + col);
        const double g = from_bf16_bits(gate_up[row * 2 * c.n + col]), u = from_bf16_bits(gate_up[row * 2 * c.n + c.n + col]);
        const bool gate_passes = !(limit > 0) || g < limit, up_passes = !(limit > 0) || (-limit < u && u < limit);
        const double g_c = limit > 0 ? std::min(g, limit) : g, u_c = limit > 0 ? std::clamp(u, -limit, limit) : u;
        const double s = sigmoid(g_c), d_h = rw * d_hu;
        const double want_g = gate_passes ? d_h * u_c * (s * (1 + g_c * (1 - s))) : 0.0;
        const double want_u = up_passes ? d_h * g_c * s : 0.0;
        const float got_g = from_bf16_bits(grad[row * 2 * c.n + col]), got_u = from_bf16_bits(grad[row * 2 * c.n + c.n + col]);
        const double budget_g = std::abs(want_g) / 128 + std::ldexp(1.0, -17) * (1 + 3 * std::abs(g_c)) * std::abs(d_h * u_c);
        const double budget_u = std::abs(want_u) / 128 + std::ldexp(1.0, -17) * (1 + std::abs(g_c)) * std::abs(d_h);
        ASSERT_FALSE(std::isnan(got_g) || std::isnan(got_u)) << where("NaN", row, col, got_g, want_g) << ", " << label;
        ASSERT_LE(std::abs(got_g - want_g), budget_g) << where("d_g", row, col, got_g, want_g) << ", " << label;
        ASSERT_LE(std::abs(got_u - want_u), budget_u) << where("d_u", row, col, got_u, want_u) << ", " << label;
        const double term = d_hu * g_c * s * u_c;
        partial_sum[col / kTileCols] += term;
        partial_magnitude[col / kTileCols] += std::abs(term);
      }
      for (int nb = 0; nb < n_blocks; ++nb) {
        const float got = partials[row * n_blocks + nb];
        ASSERT_FALSE(std::isnan(got)) << "row partial NaN: row " << row << " n-block " << nb << ", " << label;
        ASSERT_LE(std::abs(got - partial_sum[nb]), std::ldexp(partial_magnitude[nb], -16))
            << "row partial: row " << row << " n-block " << nb << ": got " << got << ", expected " << partial_sum[nb]
            << ", " << label;
      }
    }
    if (n_blocks % 2 == 0) {
      args.cluster_n = 2;
      const auto [grad2, partials2] = run(args);
      ASSERT_EQ(grad2, grad) << "d_g / d_u in pairs differ from single CTAs, " << label;
      ASSERT_TRUE(std::memcmp(partials2.data(), partials.data(), partials.size() * sizeof(float)) == 0)
          << "row partials in pairs differ from single CTAs, " << label;
    }
    args.cluster_n = 0;
    const auto [grad_again, partials_again] = run(args);
    ASSERT_EQ(grad_again, grad) << "rerun d_g / d_u differ, " << label;
    ASSERT_TRUE(std::memcmp(partials_again.data(), partials.data(), partials.size() * sizeof(float)) == 0)
        << "rerun row partials differ, " << label;
    if (c.n % kTileCols != 0) continue;

    const bool pow2 = c.tile_m == 128;
    const int blocks = 2 * c.n / kTileCols;
    DeviceArray<uint8_t> d_q(size_t(fx.a_rows) * 2 * c.n);
    DeviceArray<float> d_qs(size_t(blocks) * fx.a_rows);
    ExpertGemmArgs quantizing = args;
    quantizing.quantized_out = d_q.ptr;
    quantizing.out_scales = d_qs.ptr;
    quantizing.out_scales_power_of_two = pow2;
    const auto run_quantizing = [&] {
      d_q.upload(std::vector<uint8_t>(d_q.count, kBytePoison));
      d_qs.upload(float_poison(d_qs.count));
      return run(quantizing);
    };
    const auto [grad_q, partials_q] = run_quantizing();
    ASSERT_TRUE(fx.status.read().ok()) << fx.status.read().describe(1, 1, 1) << ", quantizing, " << label;
    ASSERT_EQ(grad_q, grad) << "d_g / d_u with quantized_out differ, " << label;
    ASSERT_TRUE(std::memcmp(partials_q.data(), partials.data(), partials.size() * sizeof(float)) == 0)
        << "row partials with quantized_out differ, " << label;
    const auto check_quantized = [&](const std::vector<uint16_t>& bf16, const std::string& what) {
      const auto q = d_q.download();
      const auto qs = d_qs.download();
      std::vector<float> values(size_t(fx.seg.rows) * 2 * c.n);
      for (size_t i = 0; i < values.size(); ++i) values[i] = from_bf16_bits(bf16[i]);
      const auto want = Fp8Matrix::quantize(values, fx.seg.rows, fx.seg.rows, 2 * c.n, true, pow2);
      for (int64_t row = 0; row < fx.a_rows; ++row) {
        const bool scheduled = row < fx.seg.rows;
        for (int col = 0; col < 2 * c.n; ++col) {
          const uint8_t expected = scheduled ? want.bits[row * 2 * c.n + col] : kBytePoison;
          ASSERT_EQ(q[row * 2 * c.n + col], expected)
              << what << ": e4m3 d_g | d_u row " << row << " col " << col << (scheduled ? "" : " (past the schedule)")
              << ", bf16 " << (scheduled ? values[row * 2 * c.n + col] : 0.0f) << ", " << label;
        }
        for (int b = 0; b < blocks; ++b) {
          const float got = qs[int64_t(b) * fx.a_rows + row];
          const uint32_t expected = scheduled ? float_bits(want.scales[int64_t(b) * fx.seg.rows + row]) : kFloatPoison;
          ASSERT_EQ(float_bits(got), expected) << what << ": scale of row " << row << " block " << b << ": got " << got
                                               << (scheduled ? "" : " (past the schedule)") << ", " << label;
        }
      }
    };
    check_quantized(grad, "quantized");
    if (c.limit != 0.0f) continue;  // the clamp's fminf would turn a NaN g into the limit

    int64_t nan_row = 0;
    while (!fx.seg.is_real(nan_row)) ++nan_row;
    std::vector<uint16_t> poisoned = gate_up;
    poisoned[nan_row * 2 * c.n + 5] = 0x7fc0;  // g = NaN: d_g and d_u of the row are NaN
    d_gate_up.upload(poisoned);
    const auto [grad_nan, partials_nan] = run_quantizing();
    d_gate_up.upload(gate_up);
    const StatusReport report = fx.status.read();
    ASSERT_EQ(report.raw.error_bits, uint32_t(kStatusNonFinite)) << report.describe(1, 1, 1) << ", " << label;
    EXPECT_EQ(report.nonfinite_where(), NonFiniteWhere::kDGateUp) << label;
    EXPECT_EQ(report.nonfinite_row(), nan_row) << label;
    fx.status.reset();
    check_quantized(grad_nan, "NaN in one row's g");
    const auto qs = d_qs.download();
    ASSERT_TRUE(std::isnan(qs[nan_row])) << "the NaN row's d_g block 0 scale, " << label;
    ASSERT_TRUE(std::isnan(qs[int64_t(blocks / 2) * fx.a_rows + nan_row])) << "the NaN row's d_u block 0 scale, " << label;
    ASSERT_FALSE(std::isnan(qs[nan_row + 1])) << "the row after the NaN row, " << label;
  }
}

TEST(ExpertGemmTest, Fp8ValidationNamesTheArgument) {
  alignas(16) static uint16_t buffer[64];
  alignas(16) static float scales[64];
  static DeviceStatus status;  // validation does not read it
  ExpertGemmArgs base;
  base.precision = Precision::kFP8;
  base.epilogue = GemmEpilogue::kStore;
  base.a = base.b = base.out = buffer;
  base.a_scales = base.b_scales = scales;
  base.k = 256;
  base.n = 256;
  base.local_experts = 1;
  base.a_rows = 128;
  base.expert_counts = base.expert_row_offsets = base.scheduled_rows = reinterpret_cast<const int32_t*>(buffer);
  base.ticket = reinterpret_cast<int32_t*>(buffer);
  base.waits.status = &status;
  auto message = [](const ExpertGemmArgs& args) {
    try { validate(args); } catch (const std::invalid_argument& e) { return std::string(e.what()); }
    return std::string("no throw");
  };
  ASSERT_EQ(message(base), "no throw");
  struct Bad { const char* name; std::function<void(ExpertGemmArgs&)> edit; const char* expected; };
  // The down dgrad (kSwiGLUBackward with its side inputs), which the quantized d_g | d_u cases edit further.
  const auto dgrad = [](ExpertGemmArgs& a) {
    a.epilogue = GemmEpilogue::kSwiGLUBackward;
    a.gate_up = buffer;
    a.row_partials = scales;
  };
  const std::vector<Bad> bad = {
      {"no a_scales", [](ExpertGemmArgs& a) { a.a_scales = nullptr; }, "kFP8 needs a_scales"},
      {"misaligned a_scales", [](ExpertGemmArgs& a) { a.a_scales = scales + 1; }, "kFP8 needs a_scales"},
      {"no b_scales", [](ExpertGemmArgs& a) { a.b_scales = nullptr; }, "kFP8 needs b_scales"},
      {"b_up without scales", [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.b_up = buffer; },
       "b_up_scales must be given exactly when b_up is"},
      {"scales without b_up", [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.b_up_scales = scales; },
       "b_up_scales must be given exactly when b_up is"},
      {"MN-major b", [](ExpertGemmArgs& a) { a.b_major = OperandMajor::kMN; }, "kFP8 reads b K-major"},
      {"SwiGLU backward MN-major", [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLUBackward; a.b_major = OperandMajor::kMN; },
       "kFP8 reads b K-major"},
      {"SwiGLU backward without gate_up", [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLUBackward; },
       "kSwiGLUBackward needs gate_up"},
      {"unknown precision", [](ExpertGemmArgs& a) { a.precision = static_cast<Precision>(7); }, "precision must be"},
      {"bf16 with scales", [](ExpertGemmArgs& a) { a.precision = Precision::kBF16; },
       "only for precision kFP8"},
      {"odd tiles paired", [](ExpertGemmArgs& a) { a.n = 384; a.cluster_n = 2; }, "cluster_n = 2 pairs"},
      {"odd wide tiles paired", [](ExpertGemmArgs& a) { a.n = 768; a.block_n = 256; a.cluster_n = 2; },
       "cluster_n = 2 pairs"},
      {"block_n 192", [](ExpertGemmArgs& a) { a.block_n = 192; }, "block_n must be 0 (choose), or 128 or 256"},
      {"block_n for kSwiGLU", [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.block_n = 192; },
       "block_n must be 0 (choose), or 128 or 256 for kFP8 kStore"},
      {"block_n 256 for the bf16-h SwiGLU",
       [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.block_n = 256; },
       "or 128 or 256 for kFP8 kStore or kFP8 kSwiGLU writing h quantized"},
      {"block_n 192 for the quantized h",
       [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.out_scales = scales; a.block_n = 192; },
       "or 128 or 256 for kFP8 kStore or kFP8 kSwiGLU writing h quantized"},
      {"block_n in bf16",
       [](ExpertGemmArgs& a) { a.precision = Precision::kBF16; a.a_scales = a.b_scales = nullptr; a.block_n = 128; },
       "block_n must be 0 (choose), or 128 or 256 for kFP8 kStore"},
      {"quantized h from kStore", [](ExpertGemmArgs& a) { a.out_scales = scales; },
       "out_scales (h, or with kSwiGLUBackward d_g | d_u, written quantized) is only for kSwiGLU and kSwiGLUBackward"},
      {"quantized d_g | d_u without quantized_out", [&](ExpertGemmArgs& a) { dgrad(a); a.out_scales = scales; },
       "kSwiGLUBackward with out_scales needs quantized_out"},
      {"misaligned quantized_out",
       [&](ExpertGemmArgs& a) { dgrad(a); a.out_scales = scales; a.quantized_out = buffer + 1; },
       "kSwiGLUBackward with out_scales needs quantized_out"},
      {"quantized d_g | d_u, n % 128 != 0",
       [&](ExpertGemmArgs& a) { dgrad(a); a.out_scales = scales; a.quantized_out = buffer; a.n = 448; },
       "n must be a multiple of 128"},
      {"quantized_out without out_scales", [&](ExpertGemmArgs& a) { dgrad(a); a.quantized_out = buffer; },
       "quantized_out is only for kFP8 kSwiGLUBackward with out_scales"},
      {"quantized_out from kSwiGLU",
       [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.out_scales = scales; a.quantized_out = buffer; },
       "quantized_out is only for kFP8 kSwiGLUBackward with out_scales"},
      {"quantized h with gate_up_out, no hidden_out",
       [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.out_scales = scales; a.gate_up_out = buffer; },
       "gate_up_out and hidden_out (the bf16 g | u and h beside the quantized h) go together"},
      {"quantized h with hidden_out, no gate_up_out",
       [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.out_scales = scales; a.hidden_out = buffer; },
       "gate_up_out and hidden_out (the bf16 g | u and h beside the quantized h) go together"},
      {"hidden_out without out_scales",
       [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.gate_up_out = a.hidden_out = buffer; },
       "hidden_out is only for kFP8 kSwiGLU with out_scales"},
      {"misaligned hidden_out",
       [](ExpertGemmArgs& a) {
         a.epilogue = GemmEpilogue::kSwiGLU;
         a.out_scales = scales;
         a.gate_up_out = buffer;
         a.hidden_out = buffer + 1;
       },
       "hidden_out is only for kFP8 kSwiGLU with out_scales and must be 16-byte aligned"},
      {"misaligned out_scales",
       [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.out_scales = reinterpret_cast<float*>(reinterpret_cast<char*>(scales) + 2); },
       "out_scales must be a 4-byte aligned"},
      {"quantized h paired, n % 256 != 0",
       [](ExpertGemmArgs& a) { a.epilogue = GemmEpilogue::kSwiGLU; a.out_scales = scales; a.n = 128; a.cluster_n = 2; },
       "cluster_n = 2 with out_scales needs n a multiple of 256"},
      {"bf16 with out_scales",
       [](ExpertGemmArgs& a) { a.precision = Precision::kBF16; a.a_scales = a.b_scales = nullptr; a.out_scales = scales; },
       "only for precision kFP8"},
  };
  for (const auto& b : bad) {
    ExpertGemmArgs args = base;
    b.edit(args);
    EXPECT_NE(message(args).find(b.expected), std::string::npos) << b.name << ": " << message(args);
  }
  ExpertGemmArgs wide_gate_up = base;  // h written quantized by one 128 x 256 tile a task
  wide_gate_up.epilogue = GemmEpilogue::kSwiGLU;
  wide_gate_up.out_scales = scales;
  wide_gate_up.block_n = 256;
  EXPECT_EQ(message(wide_gate_up), "no throw");
  EXPECT_EQ(gemm_n_blocks(wide_gate_up), 2);
  ExpertGemmArgs two_pass = wide_gate_up;  // two 128 x 128 passes a task, with or without g | u
  two_pass.block_n = 128;
  EXPECT_EQ(message(two_pass), "no throw");
  EXPECT_EQ(gemm_n_blocks(two_pass), 2);
  two_pass.gate_up_out = two_pass.hidden_out = buffer;
  EXPECT_EQ(message(two_pass), "no throw");
  ExpertGemmArgs wide_side = two_pass;  // one 128 x 256 tile a task beside the side outputs
  wide_side.block_n = 256;
  EXPECT_EQ(message(wide_side), "no throw");
  ExpertGemmArgs down_dgrad = base;  // the FP8 down dgrad: K-major b (W_down transposed), 128-column tiles
  down_dgrad.epilogue = GemmEpilogue::kSwiGLUBackward;
  down_dgrad.gate_up = buffer;
  down_dgrad.row_partials = scales;
  down_dgrad.n = 448;
  EXPECT_EQ(message(down_dgrad), "no throw");
  EXPECT_EQ(gemm_n_blocks(down_dgrad), 4);
  ExpertGemmArgs quantizing = down_dgrad;  // d_g | d_u also written quantized
  quantizing.n = 512;
  quantizing.out_scales = scales;
  quantizing.quantized_out = buffer;
  EXPECT_EQ(message(quantizing), "no throw");
  down_dgrad.precision = Precision::kBF16;
  EXPECT_EQ(gemm_n_blocks(down_dgrad), gemm_n_blocks(GemmEpilogue::kSwiGLUBackward, 448)) << "bf16: 256 columns";
  ExpertGemmArgs wide = base;
  wide.n = 384;
  wide.block_n = 256;
  wide.cluster_n = 2;  // two wide tiles pair up (three 128-column ones would not)
  EXPECT_EQ(message(wide), "no throw");
}

// The FP8 store GEMM's tile width when block_n is 0: the 256-column tile from n = 4096 on (where round 37 measured
// it faster than 192 and 128), the 128-column one below; a given width is kept.
TEST(ExpertGemmTest, Fp8StoreTileWidthChoice) {
  EXPECT_EQ(fp8_store_block_n(0, 4096), 256);
  EXPECT_EQ(fp8_store_block_n(0, 7168), 256);
  EXPECT_EQ(fp8_store_block_n(0, 4032), 128);
  EXPECT_EQ(fp8_store_block_n(0, 2880), 128);
  EXPECT_EQ(fp8_store_block_n(128, 7168), 128);
  EXPECT_EQ(fp8_store_block_n(256, 384), 256);
}

// The FP8 gate/up GEMM writing h quantized, block_n 0: the 128 x 256 tile, with or without the side outputs
// (g | u and the bf16 h; perf_notes rounds 34-35 measured it 9-13 % faster); a given width is kept.
TEST(ExpertGemmTest, Fp8GateUpTileWidthChoice) {
  EXPECT_EQ(fp8_gate_up_block_n(0), 256);
  EXPECT_EQ(fp8_gate_up_block_n(128), 128);
  EXPECT_EQ(fp8_gate_up_block_n(256), 256);
}

}  // namespace mok
