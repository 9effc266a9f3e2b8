// Weight-gradient GEMM (src/device/gemm/weight_grad_gemm.cuh) against a CPU reference in double.
// Integer-valued bf16 inputs (|v| <= 3) make every fp32 partial sum exact, so fp32 outputs must equal the
// reference exactly and bf16 outputs its one round-to-nearest-even (compared as values: +0 == -0, NaN never
// passes); kAccumulateFloat32 starts from integer fp32 values and must give start + calls * grad exactly.
// Random normal inputs are checked within a stated budget. Every output buffer is NaN-poisoned before a
// run (accumulate: holds the start values) and followed by a guard region that must stay untouched; rows
// of a and b past the schedule are NaN, so reading one shows. Validation cases need no GPU.
// The backward megakernel's configuration of the tiles (WeightGradTraitsInGemmLayout, weight_grad_gemm.cuh),
// launched standalone through a test entry, must give the standalone configuration's bits.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "mok/routing.h"
#include "mok/weight_grad_gemm.h"
#include "src/host/check.h"
#include "src/host/gemm_test_knobs.h"
#include "src/host/quantize_fp8.h"
#include "src/host/weight_grad_in_gemm_layout.h"
#include "tests/common/bf16.h"
#include "tests/common/device_array.h"
#include "tests/common/device_status.h"
#include "tests/common/device_fill.h"
#include "tests/common/fp8.h"
#include "tests/common/gpu_env.h"

namespace mok {
namespace {

using testing::DeviceArray;
using testing::from_bf16_bits;
using testing::hashed_int;
using testing::round_to_bf16;
using testing::to_bf16_bits;

constexpr uint16_t kBf16NaN = testing::kBf16Poison;
constexpr uint32_t kFloatPoison = 0x7fc00001u;  // an fp32 NaN
constexpr uint8_t kGuardByte = 0x5a;            // the guard after each output buffer
constexpr size_t kGuardBytes = 4096;

const char* mode_name(GradOutput output) {
  switch (output) {
    case GradOutput::kBFloat16: return "kBFloat16";
    case GradOutput::kFloat32: return "kFloat32";
    case GradOutput::kAccumulateFloat32: return "kAccumulateFloat32";
  }
  return "?";
}

// A problem: expert row counts (segments padded to tile_m), gradient shape, input kind.
struct Case {
  std::vector<int32_t> counts;
  int m = 0, n = 0, tile_m = 64;
  int m_split = 0;                // > 0: rows [m_split, m) go to out_split
  int32_t scheduled_rows = -1;    // -1: every segment (offsets[E]); else the schedule's row count
  bool zero_padding_in_a = true;  // padding rows: zeros in a (b random), or zeros in b (a random)
  bool integer_values = true;     // false: random normal inputs, checked within a budget
  bool fp8 = false;               // a and b quantized by detail::quantize_columns_fp8, the FP8 GEMM
  bool fp8_pow2 = true;           // its scales powers of two (integer inputs in [-3, 3] then quantize exactly)
  bool fp8_b_blocks = false;      // b's scales per 128 rows x 128 columns (WeightGradArgs::b_block_scales)
  uint64_t seed = 1;

  std::string describe() const {
    std::string s = "E=" + std::to_string(counts.size()) + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                    " tile_m=" + std::to_string(tile_m) + " m_split=" + std::to_string(m_split) +
                    " scheduled_rows=" + std::to_string(scheduled_rows) + " padding zeros in " +
                    (zero_padding_in_a ? "a" : "b") + (fp8 ? (fp8_pow2 ? " fp8 pow2" : " fp8") : "") +
                    (fp8 && fp8_b_blocks ? " b blocks" : "") +
                    " seed=" + std::to_string(seed) + " counts={";
    for (size_t e = 0; e < counts.size(); ++e) s += (e ? "," : "") + std::to_string(counts[e]);
    return s + "}";
  }
};

struct Problem {
  Case c;
  int experts = 0;
  std::vector<int32_t> offsets;  // [E + 1]
  int32_t scheduled = 0;
  int64_t rows = 0;              // allocated: the segments and 2 * tile_m spare rows
  std::vector<uint16_t> a, b;    // bf16 bits, [rows, m] and [rows, n]

  int32_t begin(int e) const { return std::min(offsets[e], scheduled); }
  int32_t end(int e) const { return std::min(offsets[e + 1], scheduled); }
};

Problem make_problem(const Case& c) {
  Problem p;
  p.c = c;
  p.experts = static_cast<int>(c.counts.size());
  p.offsets.assign(p.experts + 1, 0);
  for (int e = 0; e < p.experts; ++e) p.offsets[e + 1] = p.offsets[e] + (c.counts[e] + c.tile_m - 1) / c.tile_m * c.tile_m;
  p.scheduled = c.scheduled_rows < 0 ? p.offsets.back() : c.scheduled_rows;
  p.rows = p.offsets.back() + 2 * c.tile_m;
  p.a.assign(size_t(p.rows) * c.m, 0);
  p.b.assign(size_t(p.rows) * c.n, 0);
  std::mt19937 rng(static_cast<uint32_t>(c.seed));
  std::normal_distribution<float> normal(0.f, 1.f);
  // FP8 with integer inputs: times a power of two per 128 rows of the expert (an FP8 k-block) and per 128 columns
  // (a's 1, 2; b's 1, 2, 4), so that scales differ between k-blocks and column blocks and a scale read from the wrong
  // block shows exactly (products and sums stay exact: |a| <= 6, |b| <= 12 are e4m3 values times powers of two).
  auto value = [&](uint64_t stream, int64_t index, int64_t k_block, int col) {
    if (!c.integer_values) return to_bf16_bits(normal(rng));
    const float x = float(hashed_int(c.seed * 2 + stream, index, -3, 3));
    const int shift = c.fp8 ? int((k_block + col / 128) % (stream == 0 ? 2 : 3)) : 0;
    return to_bf16_bits(std::ldexp(x, shift));
  };
  int e = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    while (e < p.experts && r >= p.offsets[e + 1]) ++e;
    uint16_t* a_row = &p.a[size_t(r) * c.m];
    uint16_t* b_row = &p.b[size_t(r) * c.n];
    if (r >= p.scheduled) {  // past the schedule: the kernel must not read it
      std::fill(a_row, a_row + c.m, kBf16NaN);
      std::fill(b_row, b_row + c.n, kBf16NaN);
      continue;
    }
    const bool real = r - p.offsets[e] < c.counts[e];
    const int64_t k_block = (r - p.offsets[e]) / 128;  // of the expert's FP8 segment (its rows re-padded to 128)
    for (int i = 0; i < c.m; ++i) a_row[i] = real || !c.zero_padding_in_a ? value(0, r * c.m + i, k_block, i) : 0;
    for (int j = 0; j < c.n; ++j) b_row[j] = real || c.zero_padding_in_a ? value(1, r * c.n + j, k_block, j) : 0;
  }
  return p;
}

// grad[e][i][j] in double; abs_sum = sum |a b| (the scale of the fp32 rounding error), when asked for.
struct Reference {
  std::vector<double> grad, abs_sum;
};

Reference reference(const Problem& p, bool with_abs_sum) {
  const int m = p.c.m, n = p.c.n;
  Reference ref;
  ref.grad.assign(size_t(p.experts) * m * n, 0.0);
  if (with_abs_sum) ref.abs_sum.assign(ref.grad.size(), 0.0);
  std::vector<double> b_row(n);
  for (int e = 0; e < p.experts; ++e) {
    for (int32_t r = p.begin(e); r < p.end(e); ++r) {  // rank-1 updates, ascending rows
      for (int j = 0; j < n; ++j) b_row[j] = from_bf16_bits(p.b[size_t(r) * n + j]);
      for (int i = 0; i < m; ++i) {
        const double a = from_bf16_bits(p.a[size_t(r) * m + i]);
        if (a == 0) continue;
        double* g = &ref.grad[(size_t(e) * m + i) * n];
        for (int j = 0; j < n; ++j) g[j] += a * b_row[j];
        if (with_abs_sum) {
          double* s = &ref.abs_sum[(size_t(e) * m + i) * n];
          for (int j = 0; j < n; ++j) s[j] += std::abs(a * b_row[j]);
        }
      }
    }
  }
  return ref;
}

// Where gradient element (e, i, j) lives: buffer 0 (out) or 1 (out_split), and its element index there.
struct Location {
  int buffer;
  size_t index;
};
Location locate(const Case& c, int e, int i, int j) {
  const int split = c.m_split > 0 ? c.m_split : c.m;
  if (i < split) return {0, (size_t(e) * split + i) * c.n + j};
  return {1, (size_t(e) * (c.m - split) + (i - split)) * c.n + j};
}

// The FP8 GEMM's operands as quantize_columns_fp8 wrote them (Case::fp8): e4m3 [m or n, rows] and scales
// [rows / 128, m or n] (b's [ceil(n / 128), rows / 128] with b_blocks), with the segments' offsets in those rows.
struct Fp8Operands {
  int64_t rows = 0;
  std::vector<int32_t> offsets;
  std::vector<uint8_t> a, b;
  std::vector<float> a_scales, b_scales;
  bool b_blocks = false;

  float b_scale(int64_t r, int j, int n) const {
    return b_blocks ? b_scales[size_t(j / 128) * (rows / 128) + r / 128] : b_scales[size_t(r / 128) * n + j];
  }
};

// The output buffers of one problem in one mode, each followed by kGuardBytes of guard.
struct Outputs {
  std::vector<float> values;       // [E, m, n], merged from out and out_split, as floats
  std::vector<uint8_t> raw[2];     // the two buffers' bytes (without guards), for bitwise comparisons
  std::string guard_error;         // "" when both guards are intact (and run_gpu's own status word is clean)
  Fp8Operands fp8;                 // Case::fp8: what the GEMM read
};

// A launch of the weight-gradient GEMM: mok::weight_grad_gemm (the standalone configuration) or
// detail::weight_grad_gemm_in_gemm_layout (the megakernel's, standalone).
using Launcher = void (*)(const WeightGradArgs&, cudaStream_t);

// Runs `launch` `calls` times on one pair of output buffers. Accumulate: they start as `start` ([E, m, n]);
// the write modes: NaN. The waits report to `status` (the caller reads it) with `timeout_s`; without one, to a
// word of run_gpu's own, whose report must be clean (else guard_error says what it holds).
Outputs run_gpu(const Problem& p, GradOutput output, int calls = 1, const std::vector<float>* start = nullptr,
                Launcher launch = weight_grad_gemm, const testing::DeviceStatusWord* status = nullptr,
                double timeout_s = 10) {
  const Case& c = p.c;
  const size_t elem = output == GradOutput::kBFloat16 ? 2 : 4;
  const int split = c.m_split > 0 ? c.m_split : c.m;
  const size_t count[2] = {size_t(p.experts) * split * c.n, size_t(p.experts) * (c.m - split) * c.n};
  std::vector<uint8_t> host[2];
  for (int k = 0; k < 2; ++k) {
    host[k].assign(count[k] * elem + kGuardBytes, kGuardByte);
    for (size_t x = 0; x < count[k]; ++x) {
      if (elem == 2) std::memcpy(&host[k][x * 2], &kBf16NaN, 2);
      else std::memcpy(&host[k][x * 4], &kFloatPoison, 4);
    }
  }
  if (start != nullptr) {
    for (int e = 0; e < p.experts; ++e)
      for (int i = 0; i < c.m; ++i)
        for (int j = 0; j < c.n; ++j) {
          const Location at = locate(c, e, i, j);
          std::memcpy(&host[at.buffer][at.index * 4], &(*start)[(size_t(e) * c.m + i) * c.n + j], 4);
        }
  }
  DeviceArray<uint16_t> d_a(p.a), d_b(p.b);
  DeviceArray<int32_t> d_offsets(p.offsets), d_scheduled(std::vector<int32_t>{p.scheduled}), d_ticket(1);
  DeviceArray<uint8_t> d_out(host[0]), d_split(host[1]);
  WeightGradArgs args;
  args.a = d_a.ptr;
  args.b = d_b.ptr;
  args.rows_allocated = p.rows;
  args.m = c.m;
  args.n = c.n;
  args.local_experts = p.experts;
  args.expert_row_offsets = d_offsets.ptr;
  args.scheduled_rows = d_scheduled.ptr;
  args.tile_m = c.tile_m;
  args.output = output;
  args.out = d_out.ptr;
  if (c.m_split > 0) {
    args.out_split = d_split.ptr;
    args.m_split = c.m_split;
  }
  args.ticket = d_ticket.ptr;
  // FP8: a and b transposed and quantized per column per 128 rows of an expert (segments re-padded to 128).
  const int64_t fp8_rows = detail::fp8_column_rows(p.rows, p.experts);
  DeviceArray<int32_t> d_counts(c.counts), d_fp8_offsets(p.experts + 1);
  DeviceArray<uint8_t> d_qa(c.fp8 ? size_t(c.m) * fp8_rows : 1), d_qb(c.fp8 ? size_t(c.n) * fp8_rows : 1);
  DeviceArray<float> d_sa(c.fp8 ? size_t(fp8_rows / 128) * c.m : 1),
      d_sb(c.fp8 ? size_t(fp8_rows / 128) * (c.fp8_b_blocks ? (c.n + 127) / 128 : c.n) : 1);
  if (c.fp8) {
    const auto quantize = [&](const void* in, int k, void* out, float* scales, bool blocks) {
      detail::quantize_columns_fp8({.in = in,
                                    .rows_allocated = p.rows,
                                    .k = k,
                                    .local_experts = p.experts,
                                    .expert_counts = d_counts.ptr,
                                    .expert_row_offsets = d_offsets.ptr,
                                    .out_row_offsets = d_fp8_offsets.ptr,
                                    .out = out,
                                    .scales = scales,
                                    .power_of_two_scales = c.fp8_pow2,
                                    .block_scales = blocks},
                                   nullptr);
    };
    quantize(d_a.ptr, c.m, d_qa.ptr, d_sa.ptr, false);
    quantize(d_b.ptr, c.n, d_qb.ptr, d_sb.ptr, c.fp8_b_blocks);
    args.b_block_scales = c.fp8_b_blocks;
    args.precision = Precision::kFP8;
    args.a = d_qa.ptr;
    args.b = d_qb.ptr;
    args.a_scales = d_sa.ptr;
    args.b_scales = d_sb.ptr;
    args.rows_allocated = fp8_rows;
    args.expert_row_offsets = d_fp8_offsets.ptr;
    args.scheduled_rows = d_fp8_offsets.ptr + p.experts;  // the last offset: every segment
    args.tile_m = 128;
  }
  const testing::DeviceStatusWord own_status;
  args.waits = (status != nullptr ? status : &own_status)->bound(timeout_s);
  for (int call = 0; call < calls; ++call) launch(args, nullptr);
  MOK_CHECK_CUDA(cudaDeviceSynchronize());

  Outputs result;
  if (status == nullptr && !own_status.read().ok()) result.guard_error = "status: " + own_status.read().describe(1, 1, 1);
  if (c.fp8)
    result.fp8 = {fp8_rows, d_fp8_offsets.download(), d_qa.download(), d_qb.download(), d_sa.download(),
                  d_sb.download(), c.fp8_b_blocks};
  const std::vector<uint8_t> got[2] = {d_out.download(), d_split.download()};
  for (int k = 0; k < 2; ++k) {
    for (size_t x = count[k] * elem; x < got[k].size(); ++x)
      if (got[k][x] != kGuardByte && result.guard_error.empty())
        result.guard_error = std::string(k ? "out_split" : "out") + "'s guard written at byte " +
                             std::to_string(x - count[k] * elem) + " past its end";
    result.raw[k].assign(got[k].begin(), got[k].begin() + count[k] * elem);
  }
  result.values.resize(size_t(p.experts) * c.m * c.n);
  for (int e = 0; e < p.experts; ++e)
    for (int i = 0; i < c.m; ++i)
      for (int j = 0; j < c.n; ++j) {
        const Location at = locate(c, e, i, j);
        float v;
        if (elem == 2) {
          uint16_t bits;
          std::memcpy(&bits, &result.raw[at.buffer][at.index * 2], 2);
          v = from_bf16_bits(bits);
        } else {
          std::memcpy(&v, &result.raw[at.buffer][at.index * 4], 4);
        }
        result.values[(size_t(e) * c.m + i) * c.n + j] = v;
      }
  return result;
}

// Start values for kAccumulateFloat32: integers (exact sums) or normals.
std::vector<float> start_values(const Problem& p) {
  std::vector<float> start(size_t(p.experts) * p.c.m * p.c.n);
  std::mt19937 rng(static_cast<uint32_t>(p.c.seed + 77));
  std::normal_distribution<float> normal(0.f, 4.f);
  for (size_t x = 0; x < start.size(); ++x)
    start[x] = p.c.integer_values ? float(hashed_int(p.c.seed + 99, int64_t(x), -100000, 100000)) : normal(rng);
  return start;
}

std::string mismatch(const Problem& p, GradOutput output, size_t x, float got, double want) {
  const int m = p.c.m, n = p.c.n;
  const int e = int(x / (size_t(m) * n)), i = int(x / n % m), j = int(x % n);
  return std::string(mode_name(output)) + ", " + p.c.describe() + ": first mismatch at expert " + std::to_string(e) +
         " row " + std::to_string(i) + " col " + std::to_string(j) + ": got " + std::to_string(got) + ", expected " +
         std::to_string(want);
}

// "" when the outputs are exactly the reference (integer inputs), else the first mismatch.
std::string check_exact(const Problem& p, const Reference& ref, GradOutput output, const Outputs& out, int calls = 1,
                        const std::vector<float>* start = nullptr) {
  if (!out.guard_error.empty()) return std::string(mode_name(output)) + ", " + p.c.describe() + ": " + out.guard_error;
  for (size_t x = 0; x < ref.grad.size(); ++x) {
    const float grad = static_cast<float>(ref.grad[x]);  // an integer below 2^24: exact
    float want = grad;
    if (output == GradOutput::kBFloat16) want = round_to_bf16(grad);
    if (output == GradOutput::kAccumulateFloat32) {
      want = (*start)[x];
      for (int call = 0; call < calls; ++call) want = want + grad;
    }
    if (!(out.values[x] == want)) return mismatch(p, output, x, out.values[x], want);
  }
  return {};
}

// "" when every element is within the budget (random normal inputs), else the first element outside it.
// Budget: products of bf16 values are exact in fp32; an IEEE fp32 accumulation over K rows errs by up to
// ~K * 2^-24 * sum |a b| (3e-5 * sum |a b| at K = 512) and typically by ~sqrt(K) * 2^-24 times that. The
// tensor cores' accumulation is not specified to be IEEE, so we allow 2^-15 * sum |a b| (the IEEE worst
// case at K = 512, 1.6x it at the largest K here, 320, and room for an accumulator a few bits short of
// IEEE), plus 2^-8 |grad| for the bf16 rounding (half an ulp is 2^-9) and, accumulating, 2^-22 |result|
// for the fp32 addition. A wrong row, column or expert
// moves an element by about |a b| ~ 1, far outside it (sum |a b| ~ 0.64 K: the budget is ~0.006 at K = 300).
std::string check_budget(const Problem& p, const Reference& ref, GradOutput output, const Outputs& out,
                         const std::vector<float>* start = nullptr) {
  if (!out.guard_error.empty()) return std::string(mode_name(output)) + ", " + p.c.describe() + ": " + out.guard_error;
  for (size_t x = 0; x < ref.grad.size(); ++x) {
    double want = ref.grad[x];
    double budget = std::ldexp(ref.abs_sum[x], -15) + 1e-30;
    if (output == GradOutput::kBFloat16) budget += std::ldexp(std::abs(want), -8);
    if (output == GradOutput::kAccumulateFloat32) {
      want += (*start)[x];
      budget += std::ldexp(std::abs(want), -22);
    }
    if (!(std::abs(out.values[x] - want) <= budget)) return mismatch(p, output, x, out.values[x], want);
  }
  return {};
}

// Every output mode on one problem, exact; accumulate once and twice.
void expect_exact_in_every_mode(const Case& c) {
  const Problem p = make_problem(c);
  const Reference ref = reference(p, false);
  for (GradOutput output : {GradOutput::kBFloat16, GradOutput::kFloat32})
    EXPECT_EQ(check_exact(p, ref, output, run_gpu(p, output)), "");
  const std::vector<float> start = start_values(p);
  for (int calls : {1, 2})
    EXPECT_EQ(check_exact(p, ref, GradOutput::kAccumulateFloat32,
                          run_gpu(p, GradOutput::kAccumulateFloat32, calls, &start), calls, &start),
              "")
        << calls << " accumulating call(s)";
}

const std::vector<int32_t> kSkewedCounts = {0, 1, 63, 64, 65, 200, 0, 129};

// m and n not multiples of the 128 x 256 tile: partial last m-blocks (one consumer warpgroup idle) and
// n-blocks (store boxes past n skipped, load boxes clamped); empty experts; both paddings.
TEST(WeightGradGemmTest, EveryOutputModeIsExact) {
  MOK_REQUIRE_GPUS(1);
  uint64_t seed = 1;
  for (int tile_m : {64, 128})
    for (auto [m, n] : {std::pair{192, 320}, std::pair{320, 576}, std::pair{64, 64}}) {
      Case c;
      c.counts = kSkewedCounts;
      c.m = m;
      c.n = n;
      c.tile_m = tile_m;
      c.seed = seed++;
      expect_exact_in_every_mode(c);
    }
}

TEST(WeightGradGemmTest, PaddingRowsMayBeZeroInEitherOperand) {
  MOK_REQUIRE_GPUS(1);
  for (bool zero_in_a : {true, false}) {
    Case c;
    c.counts = {5, 70, 0, 191};
    c.m = 256;
    c.n = 512;
    c.tile_m = 128;
    c.zero_padding_in_a = zero_in_a;
    c.seed = 31;
    expect_exact_in_every_mode(c);
  }
}

// m_split 192 splits the second m-block: its first warpgroup's rows go to out, the second's to out_split;
// m_split 128 falls on a tile boundary.
TEST(WeightGradGemmTest, OutSplitRoutesEachHalfOfATile) {
  MOK_REQUIRE_GPUS(1);
  for (int m_split : {192, 128, 64}) {
    Case c;
    c.counts = kSkewedCounts;
    c.m = 320;
    c.n = 320;
    c.m_split = m_split;
    c.seed = 40 + m_split;
    expect_exact_in_every_mode(c);
  }
}

// The K range stops at scheduled_rows: 0 (a capacity overflow: every expert empty, zeros written or
// nothing added) and a cut inside expert 2's segment (later experts empty). Rows past it are NaN.
TEST(WeightGradGemmTest, ScheduledRowsBoundTheSegments) {
  MOK_REQUIRE_GPUS(1);
  Case c;
  c.counts = {100, 64, 300, 20};
  c.m = 192;
  c.n = 256;
  c.seed = 50;
  for (int32_t scheduled : {0, 128 + 64 + 128}) {  // expert 2's segment starts at 192 (tile_m 64)
    c.scheduled_rows = scheduled;
    expect_exact_in_every_mode(c);
  }
}

// Random skewed schedules built on the host: expert count, row counts (some experts empty, one hot),
// tile_m, m, n and the split all drawn from the seed.
TEST(WeightGradGemmTest, RandomSchedulesAreExact) {
  MOK_REQUIRE_GPUS(1);
  const uint64_t seeds = testing::reduced_sizes() ? 2 : 6;  // fewer under compute-sanitizer
  for (uint64_t seed = 100; seed < 100 + seeds; ++seed) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    Case c;
    c.seed = seed;
    c.tile_m = uniform(0, 1) ? 128 : 64;
    c.m = 64 * uniform(1, 8);
    c.n = 64 * uniform(1, 8);
    if (c.m > 64 && uniform(0, 1)) c.m_split = 64 * uniform(1, c.m / 64 - 1);
    c.zero_padding_in_a = uniform(0, 1);
    c.counts.resize(uniform(1, 16));
    for (auto& count : c.counts) count = uniform(0, 3) == 0 ? 0 : uniform(1, 250);
    c.counts[uniform(0, int(c.counts.size()) - 1)] = uniform(300, 700);
    const GradOutput output = static_cast<GradOutput>(seed % 3);
    const Problem p = make_problem(c);
    const Reference ref = reference(p, false);
    const std::vector<float> start = start_values(p);
    const bool accumulate = output == GradOutput::kAccumulateFloat32;
    EXPECT_EQ(check_exact(p, ref, output, run_gpu(p, output, 1, accumulate ? &start : nullptr), 1, &start), "");
  }
}

// More tiles than SMs (CTAs come back to the ticket); reruns, whichever CTA takes which tile, give the
// same bits (checked against the CPU once).
TEST(WeightGradGemmTest, ManyTilesRerunBitwise) {
  MOK_REQUIRE_GPUS(1);
  Case c;
  c.m = 512;
  c.n = 512;  // 4 x 2 tiles per expert, 24 experts: 192 tiles
  c.seed = 60;
  std::mt19937 rng(60);
  for (int e = 0; e < 24; ++e) c.counts.push_back(e % 5 == 0 ? 0 : std::uniform_int_distribution<int>(1, 200)(rng));
  const Problem p = make_problem(c);
  const Reference ref = reference(p, false);
  const std::vector<float> start = start_values(p);
  for (GradOutput output : {GradOutput::kBFloat16, GradOutput::kFloat32, GradOutput::kAccumulateFloat32}) {
    const std::vector<float>* s = output == GradOutput::kAccumulateFloat32 ? &start : nullptr;
    const Outputs first = run_gpu(p, output, 1, s);
    ASSERT_EQ(check_exact(p, ref, output, first, 1, &start), "");
    for (int rerun = 0; rerun < (testing::reduced_sizes() ? 1 : 3); ++rerun) {
      const Outputs again = run_gpu(p, output, 1, s);
      ASSERT_TRUE(again.raw[0] == first.raw[0] && again.raw[1] == first.raw[1])
          << mode_name(output) << ", " << c.describe() << ": rerun " << rerun << " differs bitwise";
    }
  }
}

// gpt-oss-like columns (2880 = 22.5 tiles of 128) and a partial n-block (704 = 2.75 tiles of 256), random
// normal inputs, within the budget of check_budget; the bf16 and fp32 results agree with one rounding.
TEST(WeightGradGemmTest, RandomNormalInputsWithinBudget) {
  MOK_REQUIRE_GPUS(1);
  MOK_SKIP_IF_REDUCED();
  Case c;
  c.counts = {256, 0, 300, 17, 200};
  c.m = 2880;
  c.n = 704;
  c.m_split = 1408;
  c.integer_values = false;
  c.seed = 70;
  const Problem p = make_problem(c);
  const Reference ref = reference(p, true);
  const Outputs f32 = run_gpu(p, GradOutput::kFloat32);
  EXPECT_EQ(check_budget(p, ref, GradOutput::kFloat32, f32), "");
  const Outputs bf16 = run_gpu(p, GradOutput::kBFloat16);
  EXPECT_EQ(check_budget(p, ref, GradOutput::kBFloat16, bf16), "");
  for (size_t x = 0; x < f32.values.size(); ++x)
    ASSERT_EQ(bf16.values[x], round_to_bf16(f32.values[x])) << mismatch(p, GradOutput::kBFloat16, x, bf16.values[x], f32.values[x])
                                                             << " (bf16 must be the fp32 result rounded once)";
  const std::vector<float> start = start_values(p);
  EXPECT_EQ(check_budget(p, ref, GradOutput::kAccumulateFloat32, run_gpu(p, GradOutput::kAccumulateFloat32, 1, &start),
                         &start),
            "");
}

// FP8 (Case::fp8): the GEMM's result in double from the operands it read, the e4m3 values times their scales
// (the recipe's own rounding is then not part of the comparison), and sum |a b| for the budget.
Reference fp8_reference(const Problem& p, const Fp8Operands& q) {
  const int m = p.c.m, n = p.c.n;
  Reference ref;
  ref.grad.assign(size_t(p.experts) * m * n, 0.0);
  ref.abs_sum.assign(ref.grad.size(), 0.0);
  std::vector<double> a_col(q.rows), b_col(q.rows);
  for (int e = 0; e < p.experts; ++e)
    for (int i = 0; i < m; ++i) {
      for (int32_t r = q.offsets[e]; r < q.offsets[e + 1]; ++r)
        a_col[r] = double(testing::from_e4m3_bits(q.a[size_t(i) * q.rows + r])) * q.a_scales[size_t(r / 128) * m + i];
      for (int j = 0; j < n; ++j) {
        double sum = 0, abs_sum = 0;
        for (int32_t r = q.offsets[e]; r < q.offsets[e + 1]; ++r) {
          const double b_value = double(testing::from_e4m3_bits(q.b[size_t(j) * q.rows + r]));
          const double prod = a_col[r] * b_value * q.b_scale(r, j, n);
          sum += prod;
          abs_sum += std::abs(prod);
        }
        ref.grad[(size_t(e) * m + i) * n + j] = sum;
        ref.abs_sum[(size_t(e) * m + i) * n + j] = abs_sum;
      }
    }
  return ref;
}

// Element x's sum per k-block of its expert, from the operands the GEMM read, and each k-block's scales: printed
// with the worst element and with a budget miss (where the tensor cores' accumulation lost the most; perf_notes 47).
std::string fp8_contributions(const Problem& p, const Fp8Operands& q, size_t x) {
  const int m = p.c.m, n = p.c.n;
  const int e = int(x / (size_t(m) * n)), i = int(x / n % m), j = int(x % n);
  std::string out;
  for (int32_t k0 = q.offsets[e]; k0 < q.offsets[e + 1]; k0 += 128) {
    double sum = 0;
    for (int32_t r = k0; r < k0 + 128; ++r)
      sum += double(testing::from_e4m3_bits(q.a[size_t(i) * q.rows + r])) * q.a_scales[size_t(r / 128) * m + i] *
             double(testing::from_e4m3_bits(q.b[size_t(j) * q.rows + r])) * q.b_scale(r, j, n);
    out += "; k-block " + std::to_string(k0 / 128) + ": " + std::to_string(sum) + " (a scale " +
           std::to_string(q.a_scales[size_t(k0 / 128) * m + i]) + ", b scale " + std::to_string(q.b_scale(k0, j, n)) +
           ")";
  }
  return out;
}

// FP8 weight gradients (precision kFP8: a and b transposed and quantized per column per 128 rows of an expert by
// detail::quantize_columns_fp8, the k-grouped GEMM on e4m3 with both operands' scales applied per k-block).
// Integer inputs in [-3, 3], times powers of two per k-block and 128-column block (make_problem: so that a scale read
// from the wrong block shows), with power-of-two scales quantize exactly and every product and k-block sum is exact:
// every output mode must be the bf16 reference exactly (the same check_exact as bf16's), with skewed counts (an
// expert with 0 rows, others of 1, 63, 64, 65, 129, 200: segments re-padded from 64 to 128), partial m- and
// n-blocks (a 128-column box past m or n read as zeros) and out_split through a tile. Also with b's scales per 128
// rows x 128 columns (WeightGradArgs::b_block_scales: the block-scaled promotion).
TEST(WeightGradGemmFp8Test, EveryOutputModeIsExactOnExactInputs) {
  MOK_REQUIRE_GPUS(1);
  uint64_t seed = 900;
  for (const bool b_blocks : {false, true})
    for (auto [m, n, m_split] : {std::tuple{192, 320, 0}, std::tuple{384, 192, 192}, std::tuple{64, 64, 0}}) {
      Case c;
      c.counts = kSkewedCounts;
      c.m = m;
      c.n = n;
      c.m_split = m_split;
      c.fp8 = true;
      c.fp8_b_blocks = b_blocks;
      c.seed = seed++;
      expect_exact_in_every_mode(c);
    }
}

// Random normal inputs with amax / 448 scales, three seeds, both recipes: within a budget of the result computed in
// double from the e4m3 values and scales the GEMM read. Budget: 2^-11 * sum |a b| (a k-block's e4m3 products are
// exact; the tensor cores' FP8 accumulation keeps fewer bits than fp32's, which is why the partials are promoted every
// 128 rows), the FP8 expert GEMM test's. Measured (H100, perf_notes round 47): the worst element of each seed and
// recipe at 2^-11.90 to 2^-12.32 of its sum |a b|, always in a k-block whose sum is a large part of sum |a b| (the
// accumulator's own bits are what is truncated), one element in 860,160 past 2^-12 for each recipe over the three
// seeds. A wrong row, column, expert or scale moves an element by about |a b| ~ 1, far outside it (sum |a b| is
// about 80 here, the budget about 0.04). bf16 is the fp32 result rounded once; reruns are bitwise.
TEST(WeightGradGemmFp8Test, RandomNormalInputsWithinBudgetAndBitwiseOnRerun) {
  MOK_REQUIRE_GPUS(1);
  for (const uint64_t seed : {910, 911, 912})
    for (const bool b_blocks : {false, true}) {
      Case c;
      c.counts = {256, 0, 300, 17, 200, 129};
      c.m = 448;
      c.n = 320;
      c.m_split = 192;
      c.integer_values = false;
      c.fp8 = true;
      c.fp8_pow2 = false;
      c.seed = seed;
      c.fp8_b_blocks = b_blocks;
      const Problem p = make_problem(c);
      const Outputs f32 = run_gpu(p, GradOutput::kFloat32);
      ASSERT_EQ(f32.guard_error, "");
      const Reference ref = fp8_reference(p, f32.fp8);
      const std::vector<float> start = start_values(p);
      const Outputs bf16 = run_gpu(p, GradOutput::kBFloat16);
      const Outputs acc = run_gpu(p, GradOutput::kAccumulateFloat32, 1, &start);
      // The error's distribution in units of sum |a b| (printed before the check: the budget's margin), with the
      // worst element's |sum| / sum |a b| and its sums per k-block.
      double worst = 0;
      size_t worst_x = 0, over_12 = 0;
      for (size_t x = 0; x < ref.grad.size(); ++x) {
        const double ratio = std::abs(f32.values[x] - ref.grad[x]) / (ref.abs_sum[x] + 1e-30);
        if (ratio > std::ldexp(1.0, -12)) ++over_12;
        if (!(ratio <= worst)) worst = ratio, worst_x = x;
      }
      std::printf("FP8 weight gradient%s, seed %d: worst |error| / sum |a b| = 2^%.2f at element %zu (|sum| / sum |a b| "
                  "%.3f%s), %zu of %zu over 2^-12\n",
                  b_blocks ? " (b blocks)" : "", int(seed), std::log2(worst), worst_x,
                  std::abs(ref.grad[worst_x]) / ref.abs_sum[worst_x], fp8_contributions(p, f32.fp8, worst_x).c_str(),
                  over_12, ref.grad.size());
      for (size_t x = 0; x < ref.grad.size(); ++x) {
        const double budget = std::ldexp(ref.abs_sum[x], -11) + 1e-30;
        EXPECT_LE(std::abs(f32.values[x] - ref.grad[x]), budget)
            << mismatch(p, GradOutput::kFloat32, x, f32.values[x], ref.grad[x]) << "; budget " << budget
            << fp8_contributions(p, f32.fp8, x);
        if (std::abs(f32.values[x] - ref.grad[x]) > budget) break;
        ASSERT_EQ(bf16.values[x], round_to_bf16(f32.values[x]))
            << mismatch(p, GradOutput::kBFloat16, x, bf16.values[x], f32.values[x]) << " (the fp32 result rounded once)";
        ASSERT_EQ(acc.values[x], start[x] + f32.values[x])
            << mismatch(p, GradOutput::kAccumulateFloat32, x, acc.values[x], start[x] + f32.values[x]);
      }
      const Outputs again = run_gpu(p, GradOutput::kFloat32);
      ASSERT_TRUE(again.raw[0] == f32.raw[0] && again.raw[1] == f32.raw[1])
          << c.describe() << ": a rerun differs bitwise";
      // How far the recipe's quantization moves the gradient from the bf16 inputs' (reported, not a criterion).
      const Reference exact = reference(p, false);
      double diff = 0, norm = 0;
      for (size_t x = 0; x < exact.grad.size(); ++x) {
        diff += (f32.values[x] - exact.grad[x]) * (f32.values[x] - exact.grad[x]);
        norm += exact.grad[x] * exact.grad[x];
      }
      std::printf("FP8 weight gradient%s vs the bf16 inputs' (normwise): %.4f\n", b_blocks ? " (b blocks)" : "",
                  std::sqrt(diff / norm));
    }
}

// "" when `got` holds exactly the bits of `want` (both runs of one problem and mode) and no NaN, else the
// first differing (or NaN) element. bf16 values are compared as the floats they convert to exactly, so equal
// floats mean equal bf16 bits.
std::string check_bitwise(const Problem& p, GradOutput output, const Outputs& got, const Outputs& want) {
  const std::string where = std::string(mode_name(output)) + ", " + p.c.describe();
  if (!got.guard_error.empty()) return where + ": megakernel configuration: " + got.guard_error;
  if (!want.guard_error.empty()) return where + ": standalone configuration: " + want.guard_error;
  for (size_t x = 0; x < want.values.size(); ++x) {
    uint32_t got_bits, want_bits;
    std::memcpy(&got_bits, &got.values[x], 4);
    std::memcpy(&want_bits, &want.values[x], 4);
    if (got_bits != want_bits || std::isnan(got.values[x]))
      return mismatch(p, output, x, got.values[x], want.values[x]) + " (megakernel configuration vs standalone)";
  }
  return {};
}

// Both configurations on one problem, every mode (accumulate once and twice from the same start): the
// megakernel's bitwise the standalone's and, on integer inputs, exactly the reference.
void expect_gemm_layout_bitwise(const Case& c) {
  const Problem p = make_problem(c);
  const Reference ref = c.integer_values ? reference(p, false) : Reference{};
  const std::vector<float> start = start_values(p);
  for (GradOutput output : {GradOutput::kBFloat16, GradOutput::kFloat32, GradOutput::kAccumulateFloat32}) {
    const bool accumulate = output == GradOutput::kAccumulateFloat32;
    for (int calls = 1; calls <= (accumulate ? 2 : 1); ++calls) {
      const std::vector<float>* s = accumulate ? &start : nullptr;
      const Outputs standalone = run_gpu(p, output, calls, s, weight_grad_gemm);
      const Outputs in_layout = run_gpu(p, output, calls, s, detail::weight_grad_gemm_in_gemm_layout);
      EXPECT_EQ(check_bitwise(p, output, in_layout, standalone), "") << calls << " call(s)";
      if (c.integer_values) {
        EXPECT_EQ(check_exact(p, ref, output, in_layout, calls, &start), "") << calls << " call(s)";
      }
    }
  }
}

// The megakernel's configuration: kBlockK 64 and 4 stages (the expert GEMM's), 16 KB of staging per consumer
// warpgroup in passes (bf16: 2 of 128 columns, fp32: 4 of 64), the output mode read at run time from
// AnyWeightGradParams. Bitwise, not within a budget: both configurations run each tile as the same sequence
// of wgmma 64x256x16 over the segment's rows in ascending 16-row steps into accumulators that start at zero
// (the stage depth, 32 or 64 rows, only groups those instructions into batches); the passes only change
// where a value is staged; each value is rounded (or added) once either way.
// n covers every partial last n-block: 64 columns (576; fp32 skips 3 passes, bf16 stores 1 box of its first
// pass), 128 (384), 192 (448; bf16's second pass stores 1 box), none (512); m 320 a partial last m-block
// (the second warpgroup idle); empty experts; out_split through a tile (192) and on a boundary (256); a
// schedule cut to nothing (scheduled_rows 0: zeros written, nothing added).
TEST(WeightGradGemmTest, GemmLayoutConfigurationIsBitwiseTheStandalone) {
  MOK_REQUIRE_GPUS(1);
  struct Shape {
    int m, n, m_split, tile_m;
    int32_t scheduled_rows;
  };
  uint64_t seed = 200;
  for (const Shape& s : {Shape{320, 576, 0, 64, -1}, Shape{320, 384, 192, 128, -1}, Shape{192, 448, 0, 128, -1},
                         Shape{512, 512, 256, 64, -1}, Shape{64, 64, 0, 64, -1}, Shape{192, 448, 64, 64, 0}}) {
    Case c;
    c.counts = kSkewedCounts;
    c.m = s.m;
    c.n = s.n;
    c.m_split = s.m_split;
    c.tile_m = s.tile_m;
    c.scheduled_rows = s.scheduled_rows;
    c.seed = seed++;
    expect_gemm_layout_bitwise(c);
  }
}

// Random normal inputs (every bit of the accumulation matters) and more tiles than SMs (CTAs come back to
// the ticket, so the pipeline state and the staging waits carry across tiles of both kinds of pass).
TEST(WeightGradGemmTest, GemmLayoutConfigurationIsBitwiseOnRandomInputs) {
  MOK_REQUIRE_GPUS(1);
  Case c;
  c.m = 576;  // 4.5 m-blocks
  c.n = 704;  // 2.75 n-blocks: 3 x 5 tiles an expert, 24 experts: 360 tiles
  c.m_split = 320;
  c.integer_values = false;
  c.seed = 210;
  std::mt19937 rng(210);
  const int experts = testing::reduced_sizes() ? 6 : 24;  // fewer under compute-sanitizer
  for (int e = 0; e < experts; ++e) c.counts.push_back(e % 7 == 3 ? 0 : std::uniform_int_distribution<int>(1, 300)(rng));
  expect_gemm_layout_bitwise(c);
  // And within the budget of the reference (the standalone configuration's own check, for the record).
  const Problem p = make_problem(c);
  const Reference ref = reference(p, true);
  EXPECT_EQ(check_budget(p, ref, GradOutput::kFloat32,
                         run_gpu(p, GradOutput::kFloat32, 1, nullptr, detail::weight_grad_gemm_in_gemm_layout)),
            "");
}

// Every wait of the kernel is bounded, in both configurations (the standalone one and the megakernel's, launched
// standalone): with a stalled producer (detail::set_stalled_producer: each CTA's producer arms its first stage and
// loads nothing) the consumers' wait for that stage times out within the hand-off bound (2 * timeout + 1 s), the
// status word names the kernel, the role and the counter, the abort word gets kAbortHandoff, the call returns
// and nothing is written out of bounds. With the abort still set the next call takes no tiles (the outputs stay
// poisoned); after a reset the next call gives a fresh call's bits. Every expert has rows, so every task waits
// for its first stage.
TEST(WeightGradGemmTest, StalledProducerTimesOutAndReports) {
  MOK_REQUIRE_GPUS(1);
  Case c;
  c.counts = {64, 200, 129, 70};
  c.m = 192;
  c.n = 320;
  c.seed = 41;
  const Problem p = make_problem(c);
  for (const Launcher launch : {Launcher(weight_grad_gemm), Launcher(detail::weight_grad_gemm_in_gemm_layout)}) {
    const char* name = launch == Launcher(weight_grad_gemm) ? "standalone configuration" : "megakernel configuration";
    testing::DeviceStatusWord status;
    const Outputs fresh = run_gpu(p, GradOutput::kFloat32, 1, nullptr, launch, &status, 0.05);
    ASSERT_TRUE(status.read().ok()) << name << ": " << status.read().describe(1, 1, 1);
    const Outputs poisoned = run_gpu(p, GradOutput::kFloat32, 0, nullptr, launch, &status, 0.05);  // no call

    detail::set_stalled_producer(KernelId::kWeightGradGemm, true);
    const auto start = std::chrono::steady_clock::now();
    Outputs stalled_out;
    try {
      stalled_out = run_gpu(p, GradOutput::kFloat32, 1, nullptr, launch, &status, 0.05);
    } catch (...) {
      detail::set_stalled_producer(KernelId::kWeightGradGemm, false);
      throw;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    detail::set_stalled_producer(KernelId::kWeightGradGemm, false);
    const StatusReport stalled = status.read();
    const std::string text = stalled.describe(1, 1, 1);
    EXPECT_EQ(stalled.raw.error_bits, kStatusWaitTimeout) << name << ": " << text;
    EXPECT_EQ(stalled.raw.timeout_kernel, static_cast<int32_t>(KernelId::kWeightGradGemm)) << name << ": " << text;
    EXPECT_EQ(stalled.raw.timeout_role, static_cast<int32_t>(Role::kGemmConsumer)) << name << ": " << text;
    EXPECT_EQ(stalled.raw.timeout_counter, static_cast<int32_t>(CounterId::kPipelineFull)) << name << ": " << text;
    EXPECT_EQ(stalled.raw.timeout_index, 0) << name << ": " << text;
    EXPECT_NE(stalled.raw.abort & kAbortHandoff, 0u) << name << ": " << text;
    EXPECT_NE(text.find("kernel weight_grad_gemm, role GEMM consumer, counter pipeline full[0]"), std::string::npos)
        << name << ": " << text;
    EXPECT_LT(seconds, 2 * 0.05 + 1 + 5) << name << ": " << text;
    EXPECT_EQ(stalled_out.guard_error, "") << name;

    // The abort word stays set: the next call takes no tiles and writes nothing.
    const Outputs after = run_gpu(p, GradOutput::kFloat32, 1, nullptr, launch, &status, 0.05);
    EXPECT_TRUE(after.raw[0] == poisoned.raw[0] && after.raw[1] == poisoned.raw[1])
        << name << ": a call after the timeout wrote output";
    status.reset();
    const Outputs again = run_gpu(p, GradOutput::kFloat32, 1, nullptr, launch, &status, 0.05);
    EXPECT_TRUE(again.raw[0] == fresh.raw[0] && again.raw[1] == fresh.raw[1])
        << name << ": the call after the reset differs from a fresh one";
    EXPECT_TRUE(status.read().ok()) << name << ": " << status.read().describe(1, 1, 1);
  }
}

// validate() names the offending field; weight_grad_gemm() (and the megakernel configuration's test entry)
// validates before touching the GPU.
TEST(WeightGradValidationTest, NamesTheOffendingField) {
  alignas(16) static uint16_t buffer[64];
  static int32_t device_ints[4];
  const auto valid = [] {
    WeightGradArgs g;
    g.a = g.b = buffer;
    g.out = buffer;
    g.rows_allocated = 256;
    g.m = 128;
    g.n = 256;
    g.local_experts = 2;
    g.expert_row_offsets = g.scheduled_rows = device_ints;
    g.tile_m = 128;
    g.ticket = device_ints;
    static DeviceStatus status;  // validation does not read it
    g.waits.status = &status;
    return g;
  };
  EXPECT_NO_THROW(validate(valid()));
  struct Bad {
    const char* field;
    std::function<void(WeightGradArgs&)> spoil;
  };
  const std::vector<Bad> cases = {
      {"a must", [](WeightGradArgs& g) { g.a = nullptr; }},
      {"a must", [](WeightGradArgs& g) { g.a = buffer + 1; }},
      {"b must", [](WeightGradArgs& g) { g.b = nullptr; }},
      {"b must", [](WeightGradArgs& g) { g.b = buffer + 3; }},
      {"tile_m must", [](WeightGradArgs& g) { g.tile_m = 96; }},
      {"rows_allocated must", [](WeightGradArgs& g) { g.rows_allocated = 0; }},
      {"rows_allocated must", [](WeightGradArgs& g) { g.rows_allocated = 192; }},  // not a multiple of 128
      {"rows_allocated must", [](WeightGradArgs& g) { g.rows_allocated = int64_t(1) << 32; }},
      {"m must", [](WeightGradArgs& g) { g.m = 96; }},
      {"m must", [](WeightGradArgs& g) { g.m = 0; }},
      {"n must", [](WeightGradArgs& g) { g.n = 100; }},
      {"n must", [](WeightGradArgs& g) { g.n = -64; }},
      {"local_experts must", [](WeightGradArgs& g) { g.local_experts = 0; }},
      {"expert_row_offsets must", [](WeightGradArgs& g) { g.expert_row_offsets = nullptr; }},
      {"scheduled_rows must", [](WeightGradArgs& g) { g.scheduled_rows = nullptr; }},
      {"output must", [](WeightGradArgs& g) { g.output = static_cast<GradOutput>(3); }},
      {"out must", [](WeightGradArgs& g) { g.out = nullptr; }},
      {"out must", [](WeightGradArgs& g) { g.out = buffer + 2; }},
      {"out_split must", [](WeightGradArgs& g) { g.out_split = buffer + 4; g.m_split = 64; }},
      {"m_split must", [](WeightGradArgs& g) { g.out_split = buffer; g.m_split = 0; }},
      {"m_split must", [](WeightGradArgs& g) { g.out_split = buffer; g.m_split = 128; }},  // = m
      {"m_split must", [](WeightGradArgs& g) { g.out_split = buffer; g.m_split = 32; }},
      {"m_split is only", [](WeightGradArgs& g) { g.m_split = 64; }},
      {"local_experts * m", [](WeightGradArgs& g) { g.local_experts = 1 << 20; g.m = 1 << 12; }},
      {"too many output tiles", [](WeightGradArgs& g) { g.local_experts = 1 << 16; g.n = 1 << 24; }},
      {"ticket must", [](WeightGradArgs& g) { g.ticket = nullptr; }},
      {"waits.status must", [](WeightGradArgs& g) { g.waits.status = nullptr; }},
      // Non-finite or absurd timeouts (the kernel counts integer nanoseconds).
      {"waits.timeout_s must", [](WeightGradArgs& g) { g.waits.timeout_s = 0; }},
      {"waits.timeout_s must", [](WeightGradArgs& g) { g.waits.timeout_s = -1; }},
      {"waits.timeout_s must", [](WeightGradArgs& g) { g.waits.timeout_s = std::numeric_limits<double>::infinity(); }},
      {"waits.timeout_s must", [](WeightGradArgs& g) { g.waits.timeout_s = std::numeric_limits<double>::quiet_NaN(); }},
      {"waits.timeout_s must", [](WeightGradArgs& g) { g.waits.timeout_s = 1e300; }},
      {"waits.timeout_s must", [](WeightGradArgs& g) { g.waits.timeout_s = kMaxWaitTimeoutS * 2; }},
      {"precision must", [](WeightGradArgs& g) { g.precision = static_cast<Precision>(7); }},
      {"a_scales and b_scales are for", [](WeightGradArgs& g) { g.a_scales = reinterpret_cast<float*>(buffer); }},
      {"precision kFP8 needs a_scales", [](WeightGradArgs& g) { g.precision = Precision::kFP8; }},
      {"precision kFP8 needs a_scales", [](WeightGradArgs& g) {
         g.precision = Precision::kFP8;
         g.a_scales = g.b_scales = reinterpret_cast<float*>(buffer + 2);  // not 16-byte aligned
       }},
      {"precision kFP8 needs segments", [](WeightGradArgs& g) {
         g.precision = Precision::kFP8;
         g.a_scales = g.b_scales = reinterpret_cast<float*>(buffer);
         g.tile_m = 64;
       }},
  };
  for (const Bad& bad : cases) {
    WeightGradArgs args = valid();
    bad.spoil(args);
    const std::string expected = std::string("weight_grad_gemm: ") + bad.field;
    std::string message = "no throw";
    try {
      validate(args);
    } catch (const std::invalid_argument& e) {
      message = e.what();
    }
    EXPECT_EQ(message.rfind(expected, 0), 0u) << "expected \"" << expected << "...\", got \"" << message << "\"";
    EXPECT_THROW(weight_grad_gemm(args, nullptr), std::invalid_argument) << bad.field;
    EXPECT_THROW(detail::weight_grad_gemm_in_gemm_layout(args, nullptr), std::invalid_argument) << bad.field;
  }
  // A valid FP8 call, but the megakernel's configuration has bf16 tiles only.
  WeightGradArgs fp8 = valid();
  fp8.precision = Precision::kFP8;
  fp8.a_scales = fp8.b_scales = reinterpret_cast<float*>(buffer);
  EXPECT_NO_THROW(validate(fp8));
  std::string message = "no throw";
  try {
    detail::weight_grad_gemm_in_gemm_layout(fp8, nullptr);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("megakernel's weight gradients are bf16"), std::string::npos) << message;
}

}  // namespace
}  // namespace mok
