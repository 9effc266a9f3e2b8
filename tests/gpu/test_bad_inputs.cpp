// The bad-input matrix of docs/bad_inputs.md through the C++ API, for the fused path (default) and the unfused
// path. Each path keeps ONE workspace (EP=2 virtual ranks, T=100, k=4, E=16, H=256, I=128) for every row that
// does not need its own shape or options: the bad call, then a check of the documented outcome (a clear error
// naming the argument, a status report, or a defined result), then the next good call on the same workspace,
// compared bitwise with a fresh workspace's result. Outputs are poisoned with a bf16 NaN (0x7fc1) before every
// run, so an unwritten output never passes. Rows with their own shape or options (T edge cases, a capacity too
// small, zero tokens) get their own workspace and the same "bad call, next good call" sequence.
// The status word is sticky until reset_status: every expected error is followed by a reset of every rank.
// The backward's rows (BackwardBadInputs) follow the same pattern on the gradients.
// At the end each test prints one line per row ("case | path | expected | observed | next call") and fails on
// any row whose outcome or next call differs from the table.
// MOK_TEST_WAIT_TIMEOUT_S overrides the spin-wait timeout of the shared workspace (default 0.5 s; raise it under
// compute-sanitizer, whose slow kernels could otherwise time out spuriously inside the megakernel).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "reference/moe_reference.h"
#include "src/host/check.h"
#include "src/host/gemm_test_knobs.h"
#include "tests/common/bf16.h"
#include "tests/common/gpu_env.h"
#include "tests/common/moe_harness.h"

namespace mok {
namespace {

using testing::kBf16Poison;
using testing::LayerData;
using testing::MoeHarness;
using testing::moe_shape;

using Outputs = std::vector<std::vector<uint16_t>>;  // [rank][T * H] bf16 bits

constexpr uint16_t kBf16NaN = 0x7fc0;
constexpr uint16_t kBf16Inf = 0x7f80;
constexpr float kFloatNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kFloatInf = std::numeric_limits<float>::infinity();

bool is_nonfinite(uint16_t bits) { return (bits & 0x7f80) == 0x7f80; }

double wait_timeout_s() {
  const char* text = std::getenv("MOK_TEST_WAIT_TIMEOUT_S");
  return text != nullptr && std::atof(text) > 0 ? std::atof(text) : 0.5;
}

const char* path_name(ForwardPath path) { return path == ForwardPath::kFused ? "fused" : "unfused"; }

// "" when equal, else the first differing (rank, token, column).
std::string first_difference(const Outputs& got, const Outputs& want, int hidden) {
  for (size_t r = 0; r < want.size(); ++r) {
    if (got.at(r).size() != want[r].size()) return "rank " + std::to_string(r) + ": sizes differ";
    for (size_t n = 0; n < want[r].size(); ++n) {
      if (got[r][n] != want[r][n]) {
        char text[160];
        std::snprintf(text, sizeof(text), "rank %zu token %zu column %zu: got 0x%04x, want 0x%04x", r, n / hidden,
                      n % hidden, got[r][n], want[r][n]);
        return text;
      }
    }
  }
  return "";
}

// Every value for which `affected(rank, token, column)` holds must be non-finite (and not the poison: it was
// computed), every other value bitwise equal to `clean`. "" on success.
std::string check_propagation(const Outputs& got, const Outputs& clean, int hidden,
                              const std::function<bool(int, int64_t, int64_t)>& affected, int64_t* num_affected) {
  *num_affected = 0;
  for (size_t r = 0; r < clean.size(); ++r) {
    for (size_t n = 0; n < clean[r].size(); ++n) {
      const int64_t token = n / hidden, column = n % hidden;
      const uint16_t bits = got[r][n];
      char text[200];
      if (affected(static_cast<int>(r), token, column)) {
        ++*num_affected;
        if (!is_nonfinite(bits) || bits == kBf16Poison) {
          std::snprintf(text, sizeof(text), "rank %zu token %lld column %lld: affected but got 0x%04x", r,
                        static_cast<long long>(token), static_cast<long long>(column), bits);
          return text;
        }
      } else if (bits != clean[r][n]) {
        std::snprintf(text, sizeof(text), "rank %zu token %lld column %lld: unaffected but got 0x%04x, clean 0x%04x",
                      r, static_cast<long long>(token), static_cast<long long>(column), bits, clean[r][n]);
        return text;
      }
    }
  }
  return *num_affected > 0 ? "" : "no value was affected (the case tests nothing)";
}

// GPU output of every rank against the CPU reference (fp64 on the same bf16 values, invalid ids masked).
std::string compare_with_reference(const Outputs& got, const LayerData& data) {
  LayerData masked = data;
  for (int32_t& id : masked.inputs.topk_idx)
    if (id < -1 || id >= data.shape.num_experts) id = -1;
  const reference::ForwardTrace<float> ref = reference::forward(masked.shape, masked.params, masked.inputs);
  const int64_t per_rank = int64_t(data.shape.tokens_per_rank) * data.shape.hidden;
  for (int r = 0; r < data.shape.num_ranks; ++r) {
    const auto result = testing::compare_within_budget(got.at(r), ref.out.data() + r * per_rank, per_rank);
    if (!(result.worst_ratio <= 1.0)) return "rank " + std::to_string(r) + ": " + result.describe(data.shape.hidden);
  }
  return "";
}

struct Row {
  std::string name, path, expected, observed, next;
  bool pass;
};

// One element of a device tensor, after every call issued before it and landed on return: the copy runs on the
// legacy stream, which the harness's non-blocking streams neither wait for nor order behind their own kernels
// (a kernel still reading the element could see the new value), and a copy from pageable memory may still be in
// flight when cudaMemcpy returns (perf_notes round 21).
template <typename Index>
void write_element(const void* base, int64_t index, Index value) {
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
  MOK_CHECK_CUDA(cudaMemcpy(static_cast<char*>(const_cast<void*>(base)) + index * int64_t(sizeof(Index)), &value,
                            sizeof(Index), cudaMemcpyHostToDevice));
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
}

// Rank 1's route (token 5, slot 2; k = 4 in every workspace of this file) given another valid expert than
// `data`'s: the id a call differing from its schedule's ids carries there.
constexpr int64_t kChangedRoute = 5 * 4 + 2;
int32_t changed_id(const LayerData& data) {
  const int32_t id = data.inputs.topk_idx[int64_t(data.shape.tokens_per_rank) * data.shape.top_k + kChangedRoute];
  return id < 0 ? 0 : (id + 1) % data.shape.num_experts;
}

// Rank 1 reports kStatusIdsMismatch at kChangedRoute with `id`, rank 0 nothing. "" on success, else what it saw.
std::string expect_ids_mismatch(const std::vector<StatusReport>& reports, int32_t id, const MoeShape& shape) {
  std::string observed;
  bool ok = reports.size() == 2 && reports[0].ok();
  for (size_t r = 0; r < reports.size(); ++r)
    observed += "rank " + std::to_string(r) + ": " +
                reports[r].describe(shape.num_tokens, shape.top_k, shape.num_experts) + "; ";
  if (reports.size() == 2) {
    const StatusReport& s = reports[1];
    ok = ok && s.raw.error_bits == kStatusIdsMismatch && s.ids_mismatch_route() == kChangedRoute &&
         s.ids_mismatch_id() == id &&
         s.describe(shape.num_tokens, shape.top_k, shape.num_experts).find("token 5, slot 2") != std::string::npos;
  }
  return ok ? "" : "FAIL " + observed;
}

// Runs `call`; returns the std::invalid_argument's message, or a description of what happened instead.
std::pair<bool, std::string> expect_invalid_argument(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    return {what.find(needle) != std::string::npos, "invalid_argument: " + what};
  } catch (const std::exception& e) {
    return {false, std::string("other exception: ") + e.what()};
  }
  return {false, "no error"};
}

class BadInputMatrix {
 public:
  explicit BadInputMatrix(ForwardPath path)
      : path_(path), shape_(moe_shape(2, 100, 4, 16, 256, 128)), good_(testing::random_layer(shape_, 7, 0, 0.05)) {
    options_.path = path;
    options_.schedule.wait_timeout_s = wait_timeout_s();
    fresh_good_ = fresh_outputs(shape_, options_, good_);
    ws_ = std::make_unique<MoeHarness>(PeerGroup::virtual_ranks(2), shape_, options_);
    ws_->upload(good_);
  }

  const std::vector<Row>& rows() const { return rows_; }

  void run() {
    bad_ids_int32();
    bad_ids_int64();
    nonfinite_inputs();
    routing_edges();
    ids_differ_from_the_schedules();
    host_validation();
    if (path_ == ForwardPath::kUnfused) stalled_gemm_producer();  // the fused path has no standalone GEMM
    peers_that_never_arrive();  // last on the shared workspace: a late peer must bring the counters back in step
    token_counts();
    capacity_too_small();
  }

 private:
  static Outputs fresh_outputs(const MoeShape& shape, const MoeOptions& options, const LayerData& data,
                               DType index_dtype = DType::kInt32) {
    MoeHarness fresh(PeerGroup::virtual_ranks(shape.ep_size), shape, options);
    fresh.upload(data, index_dtype);
    return fresh.run_checked(1);  // throws on a status error
  }

  Outputs outputs(MoeHarness& h) {
    Outputs out;
    for (const RankForward& f : h.all_args()) out.push_back(h.out_bits(f.rank));
    return out;
  }

  std::string status_errors(MoeHarness& h) {
    std::string text;
    for (const RankForward& f : h.all_args()) {
      const StatusReport r = h.status(f.rank);
      if (!r.ok())
        text += "rank " + std::to_string(f.rank) + ": " +
                r.describe(h.workspace().shape().num_tokens, shape_.top_k, shape_.num_experts) + "; ";
    }
    return text;
  }

  void reset_status(MoeHarness& h) {
    for (const RankForward& f : h.all_args()) h.workspace().reset_status(f.rank, f.stream);
    h.synchronize();
  }

  bool outputs_untouched(MoeHarness& h) {
    for (const auto& out : outputs(h))
      for (uint16_t bits : out)
        if (bits != kBf16Poison) return false;
    return true;
  }

  // The next good call on `h` with `data`, bitwise against `fresh`.
  std::string good_call(MoeHarness& h, const LayerData& data, const Outputs& fresh) {
    h.upload(data);
    h.forward();
    const std::string errors = status_errors(h);
    if (!errors.empty()) return "FAIL status: " + errors;
    const std::string diff = first_difference(outputs(h), fresh, h.workspace().shape().hidden);
    return diff.empty() ? "bitwise == fresh" : "FAIL " + diff;
  }

  void record(const std::string& name, const std::string& expected, bool outcome_ok, const std::string& observed,
              const std::string& next) {
    const bool next_ok = next.rfind("bitwise ==", 0) == 0 || next == "-";
    rows_.push_back({name, path_name(path_), expected, observed, next, outcome_ok && next_ok});
  }
  // The shared workspace's next good call, after the status words were reset.
  void record_shared(const std::string& name, const std::string& expected, bool outcome_ok,
                     const std::string& observed) {
    reset_status(*ws_);
    record(name, expected, outcome_ok, observed, good_call(*ws_, good_, fresh_good_));
  }

  // Two bad routes: the first by route id (rank 0, token 60, slot 1 = route 241) carries `value`, a later one
  // (rank 1, token 5, slot 2 = route 422) carries E + 5. The report must name the first; both contribute nothing.
  static constexpr int64_t kFirstBad = 60 * 4 + 1, kSecondBad = (100 + 5) * 4 + 2;

  LayerData masked_bad_routes() const {
    LayerData d = good_;
    d.inputs.topk_idx[kFirstBad] = -1;
    d.inputs.topk_idx[kSecondBad] = -1;
    return d;
  }

  // Status names the first bad route and the (int32-saturated) id; out bitwise equals the same call with
  // both routes masked.
  template <typename Index>
  void bad_id_case(const std::string& name, Index value, int32_t reported, const Outputs& masked_out) {
    const DType dtype = sizeof(Index) == 8 ? DType::kInt64 : DType::kInt32;
    ws_->upload(masked_bad_routes(), dtype);
    write_element<Index>(ws_->args(0).topk_idx.data, kFirstBad, value);
    write_element<Index>(ws_->args(1).topk_idx.data, kSecondBad - 400, static_cast<Index>(shape_.num_experts + 5));
    ws_->forward();
    // Each rank counts every rank's ids, so both report the same first route.
    std::string observed;
    bool ok = true;
    for (int r = 0; r < 2; ++r) {
      const StatusReport s = ws_->status(r);
      const std::string text = s.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts);
      const bool rank_ok = s.raw.error_bits == kStatusBadExpertId && s.bad_route() == kFirstBad &&
                           s.bad_expert_id() == reported && text.find("src rank 0, token 60, slot 1") != std::string::npos;
      if (r == 0 || !rank_ok) observed += (r == 0 ? "" : "; rank 1: ") + text;
      ok = ok && rank_ok;
    }
    const std::string diff = first_difference(outputs(*ws_), masked_out, shape_.hidden);
    if (!diff.empty()) observed += "; out differs from the masked call: " + diff;
    record_shared(name, "status kStatusBadExpertId at route 241 (src rank 0, token 60, slot 1), id " +
                            std::to_string(reported) + "; out == both routes masked",
                  ok && diff.empty(), observed + (diff.empty() ? "; out == masked" : ""));
  }

  void bad_ids_int32() {
    const Outputs masked_out = fresh_outputs(shape_, options_, masked_bad_routes());
    const std::string ref = compare_with_reference(masked_out, masked_bad_routes());
    record("masked routes (the bad ids' defined result) vs CPU reference", "within budget", ref.empty(),
           ref.empty() ? "within budget" : ref, "-");
    const int32_t e = shape_.num_experts;
    for (int32_t v : {e, e + 1, -2, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()})
      bad_id_case<int32_t>("expert id " + std::to_string(v) + " (int32)", v, v, masked_out);
  }

  void bad_ids_int64() {
    const Outputs masked_out = fresh_outputs(shape_, options_, masked_bad_routes(), DType::kInt64);
    constexpr int32_t kMax = std::numeric_limits<int32_t>::max(), kMin = std::numeric_limits<int32_t>::min();
    const int64_t e = shape_.num_experts;
    const std::vector<std::pair<int64_t, int32_t>> cases = {
        {e, int32_t(e)},
        {-2, -2},
        {int64_t(1) << 31, kMax},
        {(int64_t(1) << 32) + 3, kMax},  // must not wrap to expert 3
        {-(int64_t(1) << 40), kMin},
        {std::numeric_limits<int64_t>::min(), kMin},
        {std::numeric_limits<int64_t>::max(), kMax}};
    for (const auto& [value, reported] : cases)
      bad_id_case<int64_t>("expert id " + std::to_string(value) + " (int64)", value, reported, masked_out);
  }

  // One non-finite value in an input: it reaches exactly the affected outputs; everything else is bitwise the
  // clean result; no status error.
  void propagation_case(const std::string& name, const std::string& expected, const std::function<void()>& poison,
                        const std::function<bool(int, int64_t, int64_t)>& affected) {
    ws_->upload(good_);
    poison();
    ws_->forward();
    const std::string errors = status_errors(*ws_);
    int64_t count = 0;
    const std::string check = check_propagation(outputs(*ws_), fresh_good_, shape_.hidden, affected, &count);
    const bool ok = errors.empty() && check.empty();
    record_shared(name, expected, ok,
                  !errors.empty() ? "status: " + errors
                                  : (check.empty() ? std::to_string(count) + " values non-finite, rest == clean" : check));
  }

  // (rank, token) of the first route of `slot_valid` kind.
  std::pair<int, int> find_route(bool valid, int* slot) const {
    for (int64_t g = 0; g < int64_t(good_.inputs.topk_idx.size()); ++g) {
      if ((good_.inputs.topk_idx[g] >= 0) == valid) {
        *slot = static_cast<int>(g % shape_.top_k);
        const int64_t token = g / shape_.top_k;
        return {static_cast<int>(token / shape_.num_tokens), static_cast<int>(token % shape_.num_tokens)};
      }
    }
    throw std::logic_error("no such route");
  }

  bool routes_to(int rank, int64_t token, int32_t expert) const {
    for (int j = 0; j < shape_.top_k; ++j)
      if (good_.inputs.topk_idx[(int64_t(rank) * shape_.num_tokens + token) * shape_.top_k + j] == expert) return true;
    return false;
  }

  void nonfinite_inputs() {
    const int64_t h = shape_.hidden, k = shape_.top_k;
    propagation_case("NaN and +Inf in x", "defined: rows of exactly the affected tokens non-finite, no error",
                     [&] {
                       write_element<uint16_t>(ws_->args(0).x.data, 7 * h + 3, kBf16NaN);
                       write_element<uint16_t>(ws_->args(1).x.data, 50 * h + 0, kBf16Inf);
                     },
                     [](int r, int64_t t, int64_t) { return (r == 0 && t == 7) || (r == 1 && t == 50); });
    int slot_a = 0, slot_b = 0, slot_m = 0;
    const auto a = find_route(true, &slot_a);
    auto b = a;
    slot_b = slot_a;
    for (int64_t g = 400; g < 800; ++g)  // a valid route on rank 1
      if (good_.inputs.topk_idx[g] >= 0) {
        b = {1, static_cast<int>((g - 400) / k)};
        slot_b = static_cast<int>(g % k);
        break;
      }
    const auto m = find_route(false, &slot_m);
    propagation_case("NaN / Inf router weight (valid route), NaN on a masked route",
                     "defined: the valid routes' tokens non-finite; the masked route's NaN is never read",
                     [&] {
                       write_element<float>(ws_->args(a.first).router_weights.data, a.second * k + slot_a, kFloatNaN);
                       write_element<float>(ws_->args(b.first).router_weights.data, b.second * k + slot_b, kFloatInf);
                       if (m != a && m != b)
                         write_element<float>(ws_->args(m.first).router_weights.data, m.second * k + slot_m, kFloatNaN);
                     },
                     [&](int r, int64_t t, int64_t) {
                       return (r == a.first && t == a.second) || (r == b.first && t == b.second);
                     });
    // Rank 1's local expert 2 is global expert 10: a NaN in its gate weights reaches every token routed to it
    // (even with router weight 0: 0 * NaN = NaN), from both ranks.
    propagation_case("NaN in weights.expert_gate (expert 10)",
                     "defined: exactly the tokens routed to expert 10 non-finite",
                     [&] { write_element<uint16_t>(ws_->args(1).weights->expert_gate.data, 2 * shape_.intermediate * h + 5 * h + 7, kBf16NaN); },
                     [&](int r, int64_t t, int64_t) { return routes_to(r, t, 10); });
    // shared_down[5, 0] on rank 0: column 5 of rank 0's shared output, so of every rank 0 token.
    propagation_case("NaN in weights.shared_down (rank 0, row 5)",
                     "defined: column 5 of every rank 0 token non-finite, rank 1 untouched",
                     [&] { write_element<uint16_t>(ws_->args(0).weights->shared_down.data, 5 * shape_.intermediate + 0, kBf16NaN); },
                     [](int r, int64_t, int64_t c) { return r == 0 && c == 5; });
  }

  // A good call with edited data on the shared workspace: out against the CPU reference; `also` may compare
  // more.
  void reference_case(const std::string& name, const std::string& expected, const LayerData& data,
                      const std::function<std::string(const Outputs&)>& also = nullptr) {
    ws_->upload(data);
    ws_->forward();
    const std::string errors = status_errors(*ws_);
    const Outputs out = outputs(*ws_);
    std::string check = errors.empty() ? compare_with_reference(out, data) : "status: " + errors;
    if (check.empty() && also) check = also(out);
    record_shared(name, expected, check.empty(), check.empty() ? "matches" : check);
  }

  void routing_edges() {
    LayerData masked = good_;
    for (int32_t& id : masked.inputs.topk_idx) id = -1;
    Outputs all_masked;
    reference_case("all routes masked", "defined: out = shared expert only (CPU reference)", masked,
                   [&](const Outputs& out) {
                     all_masked = out;
                     return std::string();
                   });
    LayerData zero_weights = good_;
    for (float& w : zero_weights.inputs.router_weights) w = 0;
    reference_case("all router weights 0", "defined: out = shared expert only, bitwise == all routes masked",
                   zero_weights, [&](const Outputs& out) {
                     const std::string diff = first_difference(out, all_masked, shape_.hidden);
                     return diff.empty() ? diff : "differs from all-masked: " + diff;
                   });
    LayerData one_expert = good_;
    for (int32_t& id : one_expert.inputs.topk_idx) id = 3;
    reference_case("every route to expert 3 (rank 1 receives nothing)", "defined: correct (CPU reference)", one_expert);
    LayerData to_rank1 = good_;
    for (size_t q = 0; q < to_rank1.inputs.topk_idx.size(); ++q)
      to_rank1.inputs.topk_idx[q] = static_cast<int32_t>(8 + q % shape_.top_k);
    reference_case("every route to rank 1's experts (rank 0 receives nothing)", "defined: correct (CPU reference)",
                   to_rank1);
  }

  // forward_with_schedule on a schedule built from other ids (rank 1's route kChangedRoute changed after
  // build_schedule): a status report naming the route and the call's id; out unspecified.
  void ids_differ_from_the_schedules() {
    ws_->upload(good_);
    ws_->poison_outputs();
    std::vector<RankForward> args = ws_->all_args();
    ws_->workspace().build_schedule(args);
    const int32_t id = changed_id(good_);
    write_element<int32_t>(args[1].topk_idx.data, kChangedRoute, id);
    ws_->workspace().forward_with_schedule(args);
    std::vector<StatusReport> reports;
    for (const RankForward& f : args) reports.push_back(ws_->status(f.rank));
    const std::string check = expect_ids_mismatch(reports, id, shape_);
    record_shared("forward_with_schedule: topk_idx differ from the schedule's (rank 1, token 5, slot 2)",
                  "status kStatusIdsMismatch on rank 1 naming token 5, slot 2 and the call's id; out unspecified",
                  check.empty(), check.empty() ? "reported on rank 1 only" : check);
  }

  // A call with one edited argument of rank 1: std::invalid_argument naming it, nothing issued (outputs still
  // poisoned, status clean), then the next good call.
  void rejected_case(const std::string& name, const std::string& needle,
                     const std::function<void(RankForward&, MoeWeights&)>& edit) {
    ws_->upload(good_);
    ws_->poison_outputs();
    std::vector<RankForward> args = ws_->all_args();
    MoeWeights w = *args[1].weights;
    edit(args[1], w);
    args[1].weights = &w;
    auto [ok, observed] = expect_invalid_argument([&] { ws_->workspace().forward(args); }, needle);
    const std::string errors = status_errors(*ws_);
    if (!errors.empty()) ok = false, observed += "; status: " + errors;
    if (!outputs_untouched(*ws_)) ok = false, observed += "; an output was written";
    record_shared(name, "std::invalid_argument naming " + needle + "; nothing issued", ok, observed);
  }

  void host_validation() {
    const int64_t t = shape_.num_tokens, h = shape_.hidden;
    rejected_case("x [0, H] (zero tokens) on a T=100 workspace", "x: expected bf16 [100, 256]",
                  [](RankForward& f, MoeWeights&) { f.x.shape[0] = 0; });
    rejected_case("topk_idx fp32", "topk_idx: expected int32", [](RankForward& f, MoeWeights&) { f.topk_idx.dtype = DType::kFloat32; });
    rejected_case("router_weights [T, k + 1]", "router_weights: expected fp32 [100, 4]",
                  [](RankForward& f, MoeWeights&) { f.router_weights.shape[1] = 5; });
    std::vector<uint16_t> pageable(t * h);
    rejected_case("x in pageable host memory", "x: must be device memory",
                  [&](RankForward& f, MoeWeights&) { f.x.data = pageable.data(); });
    // Pinned host memory, the one-GPU stand-in for "a tensor on another GPU" (the multigpu test has the real one).
    void* pinned = nullptr;
    MOK_CHECK_CUDA(cudaMallocHost(&pinned, e_bytes()));
    rejected_case("x in pinned host memory", "x: must be device memory",
                  [&](RankForward& f, MoeWeights&) { f.x.data = pinned; });
    rejected_case("topk_idx in pinned host memory", "topk_idx: must be device memory",
                  [&](RankForward& f, MoeWeights&) { f.topk_idx.data = pinned; });
    rejected_case("router_weights in pinned host memory", "router_weights: must be device memory",
                  [&](RankForward& f, MoeWeights&) { f.router_weights.data = pinned; });
    rejected_case("out in pinned host memory", "out: must be device memory",
                  [&](RankForward& f, MoeWeights&) { f.out.data = pinned; });
    rejected_case("weights.expert_down in pinned host memory", "weights.expert_down: must be device memory",
                  [&](RankForward&, MoeWeights& w) { w.expert_down.data = pinned; });
    MOK_CHECK_CUDA(cudaFreeHost(pinned));
    auto offset = [](const void* p, int bytes) { return static_cast<const char*>(p) + bytes; };
    rejected_case("x + 2 bytes", "x: data must be 16-byte aligned",
                  [&](RankForward& f, MoeWeights&) { f.x.data = offset(f.x.data, 2); });
    rejected_case("topk_idx + 2 bytes (int32)", "topk_idx: data must be 4-byte aligned",
                  [&](RankForward& f, MoeWeights&) { f.topk_idx.data = offset(f.topk_idx.data, 2); });
    rejected_case("topk_idx + 4 bytes (int64)", "topk_idx: data must be 8-byte aligned",
                  [&](RankForward& f, MoeWeights&) {
                    f.topk_idx.dtype = DType::kInt64;
                    f.topk_idx.data = offset(f.topk_idx.data, 4);
                  });
    rejected_case("router_weights + 2 bytes", "router_weights: data must be 4-byte aligned",
                  [&](RankForward& f, MoeWeights&) { f.router_weights.data = offset(f.router_weights.data, 2); });
    rejected_case("weights.expert_gate + 2 bytes", "weights.expert_gate: data must be 16-byte aligned",
                  [&](RankForward&, MoeWeights& w) { w.expert_gate.data = offset(w.expert_gate.data, 2); });
    rejected_case("weights.shared_down + 8 bytes", "weights.shared_down: data must be 16-byte aligned",
                  [&](RankForward&, MoeWeights& w) { w.shared_down.data = offset(w.shared_down.data, 8); });
    rejected_case("out + 2 bytes", "out: data must be 16-byte aligned",
                  [&](RankForward& f, MoeWeights&) { f.out.data = offset(f.out.data, 2); });
    rejected_case("rank 0 passed twice (rank 1's arguments as rank 0's)",
                  "MoeWorkspace::forward: rank 0 is passed twice",
                  [](RankForward& f, MoeWeights&) { f.rank = 0; });
  }

  int64_t e_bytes() const {  // the largest tensor a pinned stand-in replaces
    const int64_t e = shape_.local_experts(), h = shape_.hidden, i = shape_.intermediate;
    return std::max<int64_t>(e * h * i, int64_t(shape_.num_tokens) * h) * 2;
  }

  // Rank 1 never issues (its kernels are issued after the timeout instead: a late peer); rank 0 reports the
  // wait it gave up on, in bounded time. The late calls bring the counters back in step.
  void peer_case(const std::string& name, bool schedule_too, Role role, CounterId counter) {
    ws_->upload(good_);
    ws_->poison_outputs();
    std::vector<RankForward> args = ws_->all_args();
    const auto start = std::chrono::steady_clock::now();
    if (schedule_too) {
      ws_->workspace().forward({&args[0], 1});
    } else {
      ws_->workspace().build_schedule(args);
      ws_->workspace().forward_with_schedule({&args[0], 1});
    }
    const StatusReport s = ws_->status(0);  // synchronizes
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double bound = 10 * options_.schedule.wait_timeout_s + 10;
    // After the timeout the rank fails fast: its GEMMs (the megakernel's or the standalone ones) take no tiles,
    // so no in-kernel hand-off times out (abort stays kAbortWait), and its later barrier waits give up at once.
    const KernelId kernel = role == Role::kBarrier ? KernelId::kBarrier : KernelId::kSchedule;
    const bool ok = (s.raw.error_bits & kStatusWaitTimeout) && s.raw.timeout_rank == 0 &&
                    s.raw.timeout_role == static_cast<int32_t>(role) &&
                    s.raw.timeout_counter == static_cast<int32_t>(counter) && s.raw.timeout_index == 1 &&
                    s.raw.timeout_kernel == static_cast<int32_t>(kernel) && s.raw.abort == kAbortWait &&
                    s.raw.abandoned_waits > 0 && seconds < bound;
    char observed[400];
    std::snprintf(observed, sizeof(observed), "%s (%.2f s)",
                  s.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts).c_str(), seconds);
    // The late peer: rank 1's calls, after rank 0 gave up.
    if (schedule_too)
      ws_->workspace().forward({&args[1], 1});
    else
      ws_->workspace().forward_with_schedule({&args[1], 1});
    ws_->synchronize();
    record_shared(name, "status kStatusWaitTimeout on rank 0 naming the wait (rank 0, " +
                            std::string(role == Role::kBarrier ? "barrier_wait_kernel, EP barrier, barrier arrived[1]" :
                                                                 "count_chunks_kernel, schedule count, topk_arrived[1]") +
                            "), abort kAbortWait only, later waits abandoned; bounded time; out unspecified",
                  ok, observed);
  }

  // The unfused path's standalone GEMMs with a stalled producer (the test knob detail::set_stalled_producer:
  // each CTA's producer arms its first stage and loads nothing): on each rank the first GEMM's consumers time
  // out within the hand-off bound (2 * wait_timeout_s + 1 s) and report it (kernel expert_gemm, role GEMM
  // consumer, counter pipeline full), the rank's later GEMMs take no tiles, the call returns; reset, then the
  // next good call gives a fresh workspace's bits.
  void stalled_gemm_producer() {
    ws_->upload(good_);
    ws_->poison_outputs();
    detail::set_stalled_producer(KernelId::kExpertGemm, true);
    const auto start = std::chrono::steady_clock::now();
    try {
      ws_->forward();
      ws_->synchronize();
    } catch (...) {
      detail::set_stalled_producer(KernelId::kExpertGemm, false);
      throw;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    detail::set_stalled_producer(KernelId::kExpertGemm, false);
    bool ok = seconds < 2 * (2 * options_.schedule.wait_timeout_s + 1) + 10;
    std::string observed;
    for (int r = 0; r < 2; ++r) {
      const StatusReport s = ws_->status(r);
      ok = ok && s.raw.error_bits == kStatusWaitTimeout && s.raw.timeout_rank == r &&
           s.raw.timeout_kernel == static_cast<int32_t>(KernelId::kExpertGemm) &&
           s.raw.timeout_role == static_cast<int32_t>(Role::kGemmConsumer) &&
           s.raw.timeout_counter == static_cast<int32_t>(CounterId::kPipelineFull) && (s.raw.abort & kAbortHandoff);
      observed += "rank " + std::to_string(r) + ": " + s.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts) + "; ";
    }
    char seconds_text[32];
    std::snprintf(seconds_text, sizeof(seconds_text), "(%.2f s)", seconds);
    record_shared("a stalled expert GEMM producer (test knob)",
                  "status kStatusWaitTimeout on each rank naming kernel expert_gemm, GEMM consumer, pipeline full; "
                  "abort kAbortHandoff; bounded time; out unspecified",
                  ok, observed + seconds_text);
  }

  void peers_that_never_arrive() {
    peer_case("a peer that never publishes x (schedule built by both)", false, Role::kBarrier, CounterId::kBarrierArrived);
    peer_case("a peer that never arrives (no ids, no x)", true, Role::kScheduleCount, CounterId::kTopkArrived);
  }

  // T edge cases, each on its own workspace: correct against the CPU reference, and the second call on the
  // workspace bitwise equal to the first.
  void token_counts() {
    {
      MoeShape zero = shape_;
      zero.num_tokens = 0;
      auto [ok, observed] = expect_invalid_argument(
          [&] { MoeWorkspace ws(PeerGroup::virtual_ranks(2), zero, options_); }, "num_tokens must be >= 1");
      record("MoeShape.num_tokens = 0", "std::invalid_argument naming num_tokens", ok, observed, "-");
    }
    for (int tokens : {1, 63, 65, 127, 129, 1000}) {
      const MoeShape shape = moe_shape(2, tokens, 4, 16, 256, 128);
      const LayerData data = testing::random_layer(shape, 100 + tokens, 0, 0.05);
      MoeHarness h(PeerGroup::virtual_ranks(2), shape, options_);
      h.upload(data);
      h.forward();
      const std::string errors = status_errors(h);
      const Outputs first = outputs(h);
      std::string check = errors.empty() ? compare_with_reference(first, data) : "status: " + errors;
      h.forward();
      const std::string again = status_errors(h);
      const std::string diff = again.empty() ? first_difference(outputs(h), first, shape.hidden) : again;
      record("T = " + std::to_string(tokens), "defined: correct (CPU reference)", check.empty(),
             check.empty() ? "matches" : check, diff.empty() ? "bitwise == first call" : "FAIL " + diff);
    }
  }

  // Capacity 128 rows per rank: the schedule needs far more. Status names both counts; nothing is written out of
  // bounds (memcheck); a routing that fits then runs correctly on the same workspace.
  void capacity_too_small() {
    MoeOptions tight = options_;
    tight.schedule.capacity_rows = 128;
    MoeHarness h(PeerGroup::virtual_ranks(2), shape_, tight);
    h.upload(good_);
    h.forward();
    bool ok = true;
    std::string observed;
    for (int r = 0; r < 2; ++r) {
      const StatusReport s = h.status(r);
      ok = ok && s.raw.error_bits == kStatusCapacityOverflow && s.raw.rows_capacity == 128 && s.raw.rows_needed > 128;
      if (r == 0) observed = s.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts);
    }
    reset_status(h);
    // Fits: tokens 0..31 send slot 0 to expert 0 or 8 (32 rows per expert from both ranks, one 64-row tile).
    LayerData fits = good_;
    for (int64_t g = 0; g < int64_t(fits.inputs.topk_idx.size()); ++g) {
      const int64_t token = (g / shape_.top_k) % shape_.num_tokens;
      fits.inputs.topk_idx[g] = g % shape_.top_k == 0 && token < 32 ? (token % 2 == 0 ? 0 : 8) : -1;
    }
    const Outputs fresh = fresh_outputs(shape_, tight, fits);
    record("capacity too small (capacity_rows 128)", "status kStatusCapacityOverflow with rows needed and capacity; "
           "out unspecified; no write out of bounds (memcheck)", ok, observed, good_call(h, fits, fresh));
  }

  ForwardPath path_;
  MoeShape shape_;
  MoeOptions options_;
  LayerData good_;
  Outputs fresh_good_;
  std::unique_ptr<MoeHarness> ws_;
  std::vector<Row> rows_;
};

// The backward's rows (docs/bad_inputs.md, "Backward"). One workspace (EP=2 virtual ranks, T=100, k=4, E=16,
// H=256, I=128, fp32 written weight gradients) holds a good forward's contexts; each rejected call is a backward
// with one edited argument of rank 1: it must throw naming the argument, leave every gradient output poisoned
// (NaN bits) and the status clean, and the next good backward must give a fresh workspace's bits. Rows with
// their own options (an inference-only workspace, a capacity too small) get their own workspace.
class BackwardBadInputs {
 public:
  using Grads = std::vector<std::vector<std::pair<std::string, std::vector<uint8_t>>>>;  // [rank][tensor]

  // megakernel: a fused workspace whose backward is the backward megakernel (FusedOptions::backward_megakernel).
  explicit BackwardBadInputs(bool megakernel)
      : shape_(moe_shape(2, 100, 4, 16, 256, 128)),
        good_(testing::random_layer(shape_, 8, 0, 0.05)),
        d_out_(testing::random_d_out(shape_, 9)),
        path_(megakernel ? "backward megakernel" : "backward") {
    options_.schedule.wait_timeout_s = wait_timeout_s();
    options_.fused.backward_megakernel = megakernel;
    fresh_ = fresh_grads(options_, good_);
    ws_ = std::make_unique<MoeHarness>(PeerGroup::virtual_ranks(2), shape_, options_);
    ws_->upload(good_);
    ws_->upload_d_out(d_out_);
    ws_->forward();
    ws_->synchronize();
  }

  const std::vector<Row>& rows() const { return rows_; }

  void run() {
    rejected_calls();
    ids_differ_from_the_forwards();
    if (path_ == "backward") {  // the stage kernels' standalone GEMMs (the megakernel has none)
      stalled_gemm_producer(KernelId::kExpertGemm);
      stalled_gemm_producer(KernelId::kWeightGradGemm);
    }
    peer_that_never_calls_recompute();
    peer_that_never_arrives();  // last on the shared workspace: a late peer brings the counters back in step
    inference_only_workspace();
    capacity_too_small();
  }

 private:
  Grads grads(MoeHarness& h) {
    Grads all;
    for (const RankForward& f : h.all_args()) all.push_back(h.raw_grads(f.rank));
    return all;
  }

  // A fresh workspace's forward and backward of `data`.
  Grads fresh_grads(const MoeOptions& options, const LayerData& data) {
    MoeHarness fresh(PeerGroup::virtual_ranks(2), shape_, options);
    fresh.upload(data);
    fresh.upload_d_out(d_out_);
    fresh.forward();
    fresh.backward();
    fresh.check_status();  // throws on a status error
    return grads(fresh);
  }

  static std::string difference(const Grads& got, const Grads& want) {
    for (size_t r = 0; r < want.size(); ++r)
      for (size_t n = 0; n < want[r].size(); ++n)
        if (got.at(r).at(n).second != want[r][n].second)
          return "rank " + std::to_string(r) + " " + want[r][n].first + " differs";
    return "";
  }

  std::string status_errors(MoeHarness& h) {
    std::string text;
    for (const RankForward& f : h.all_args()) {
      const StatusReport r = h.status(f.rank);
      if (!r.ok()) text += "rank " + std::to_string(f.rank) + ": " + r.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts) + "; ";
    }
    return text;
  }

  void reset_status(MoeHarness& h) {
    for (const RankForward& f : h.all_args()) h.workspace().reset_status(f.rank, f.stream);
    h.synchronize();
  }

  // Every gradient output still holds the poison (every byte 0xff: no accumulated gradient here).
  bool grads_untouched(MoeHarness& h) {
    for (const auto& rank : grads(h))
      for (const auto& tensor : rank)
        for (uint8_t byte : tensor.second)
          if (byte != 0xff) return false;
    return true;
  }

  // The next good backward on `h` (its contexts hold a good forward), bitwise against `fresh`.
  std::string good_backward(MoeHarness& h, const Grads& fresh) {
    h.backward();
    const std::string errors = status_errors(h);
    if (!errors.empty()) return "FAIL status: " + errors;
    const std::string diff = difference(grads(h), fresh);
    return diff.empty() ? "bitwise == fresh" : "FAIL " + diff;
  }

  void record(const std::string& name, const std::string& expected, bool outcome_ok, const std::string& observed,
              const std::string& next) {
    const bool next_ok = next.rfind("bitwise ==", 0) == 0 || next == "-";
    rows_.push_back({name, path_, expected, observed, next, outcome_ok && next_ok});
  }

  using Edit = std::function<void(RankBackward&, MoeWeights&, MoeWeightGrads&)>;

  // A backward with one edited argument of rank 1: std::invalid_argument naming it, nothing issued (gradients
  // still poisoned, status clean), then the next good backward.
  void rejected_case(const std::string& name, const std::string& needle, const Edit& edit) {
    ws_->poison_grads();
    std::vector<RankBackward> args = ws_->all_backward_args();
    MoeWeights w = *args[1].weights;
    MoeWeightGrads g = *args[1].weight_grads;
    edit(args[1], w, g);
    args[1].weights = &w;
    if (args[1].weight_grads != nullptr) args[1].weight_grads = &g;
    auto [ok, observed] = expect_invalid_argument([&] { ws_->workspace().backward(args); }, needle);
    const std::string errors = status_errors(*ws_);
    if (!errors.empty()) ok = false, observed += "; status: " + errors;
    if (!grads_untouched(*ws_)) ok = false, observed += "; a gradient was written";
    reset_status(*ws_);
    record(name, "std::invalid_argument naming " + needle + "; nothing issued", ok, observed,
           good_backward(*ws_, fresh_));
  }

  // A backward whose topk_idx differ from the forward's (rank 1's route kChangedRoute): a status report naming
  // the route and the call's id; its gradients unspecified. The ids restored, the next backward is fresh's.
  void ids_differ_from_the_forwards() {
    const int32_t id = changed_id(good_);
    const void* topk = ws_->all_backward_args()[1].topk_idx.data;
    write_element<int32_t>(topk, kChangedRoute, id);
    ws_->backward();
    std::vector<StatusReport> reports;
    for (const RankForward& f : ws_->all_args()) reports.push_back(ws_->status(f.rank));
    const std::string check = expect_ids_mismatch(reports, id, shape_);
    write_element<int32_t>(topk, kChangedRoute,
                           good_.inputs.topk_idx[int64_t(shape_.num_tokens) * shape_.top_k + kChangedRoute]);
    reset_status(*ws_);
    record("backward: topk_idx differ from the forward's (rank 1, token 5, slot 2)",
           "status kStatusIdsMismatch on rank 1 naming token 5, slot 2 and the call's id; gradients unspecified",
           check.empty(), check.empty() ? "reported on rank 1 only" : check, good_backward(*ws_, fresh_));
  }

  void rejected_calls() {
    const int64_t t = shape_.num_tokens, h = shape_.hidden, i = shape_.intermediate, e = shape_.local_experts();
    auto offset = [](const void* p, int bytes) { return static_cast<const char*>(p) + bytes; };
    rejected_case("d_out [T, H + 64]", "MoeWorkspace::backward: rank 1: d_out: expected bf16 [100, 256]",
                  [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.d_out.shape[1] = 320; });
    rejected_case("d_out fp32", "d_out: expected bf16 [100, 256], got fp32 [100, 256]",
                  [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.d_out.dtype = DType::kFloat32; });
    rejected_case("d_out + 2 bytes", "d_out: data must be 16-byte aligned",
                  [&](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.d_out.data = offset(b.d_out.data, 2); });
    rejected_case("d_x [T - 1, H]", "d_x: expected bf16 [100, 256]",
                  [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.d_x.shape[0] = 99; });
    rejected_case("d_router_weights bf16", "d_router_weights: expected fp32 [100, 4]",
                  [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.d_router_weights.dtype = DType::kBFloat16; });
    rejected_case("x [T, H / 2] (the forward's input)", "x: expected bf16 [100, 256]",
                  [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.x.shape[1] = 128; });
    rejected_case("weights.expert_down [E, I, H]", "weights.expert_down: expected bf16 [8, 256, 128]",
                  [&](RankBackward&, MoeWeights& w, MoeWeightGrads&) { w.expert_down.shape[1] = i, w.expert_down.shape[2] = h; });
    void* pinned = nullptr;
    MOK_CHECK_CUDA(cudaMallocHost(&pinned, e * h * i * 4));
    rejected_case("d_router_weights in pinned host memory", "d_router_weights: must be device memory",
                  [&](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.d_router_weights.data = pinned; });
    rejected_case("weight_grads.expert_down in pinned host memory", "weight_grads.expert_down: must be device memory",
                  [&](RankBackward&, MoeWeights&, MoeWeightGrads& g) { g.expert_down.grad.data = pinned; });
    rejected_case("context null", "context: must be a ForwardContext made by this workspace's make_context(1)",
                  [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.context = nullptr; });
    rejected_case("rank 0's context for rank 1", "context: must be a ForwardContext made by this workspace's make_context(1)",
                  [&](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.context = ws_->args(0).context; });
    {
      MoeHarness other(PeerGroup::virtual_ranks(2), shape_, options_);  // same shape, another workspace
      rejected_case("a context of another workspace (same shape)",
                    "context: must be a ForwardContext made by this workspace's make_context(1)",
                    [&](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.context = other.args(1).context; });
      MoeOptions inference = options_;
      inference.backward = false;
      inference.fused.backward_megakernel = false;  // the backward megakernel needs the backward (refused otherwise)
      MoeHarness plain(PeerGroup::virtual_ranks(2), shape_, inference);
      rejected_case("a context of a workspace built with backward = false",
                    "context: must be a ForwardContext made by this workspace's make_context(1)",
                    [&](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.context = plain.args(1).context; });
    }
    {
      // Contexts holding no forward: fresh ones, then the same after a build_schedule of this call's ids.
      std::vector<ForwardContext> fresh;
      for (int r = 0; r < 2; ++r) fresh.push_back(ws_->workspace().make_context(r));
      const auto fresh_context = [&](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.context = &fresh[1]; };
      rejected_case("a fresh context (make_context, no forward)", "context: holds no forward of its schedule",
                    fresh_context);
      std::vector<RankForward> scheduled = ws_->all_args();
      for (int r = 0; r < 2; ++r) scheduled[r].context = &fresh[r];
      ws_->workspace().build_schedule(scheduled);
      rejected_case("a context holding a schedule and no forward (build_schedule alone)",
                    "context: holds no forward of its schedule", fresh_context);
    }
    rejected_case("rank 0 passed twice (rank 1's arguments as rank 0's)",
                  "MoeWorkspace::backward: rank 0 is passed twice",
                  [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.rank = 0; });
    rejected_case("rank 5", "rank 5", [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.rank = 5; });
    rejected_case("weight_grads null", "weight_grads: must not be null",
                  [](RankBackward& b, MoeWeights&, MoeWeightGrads&) { b.weight_grads = nullptr; });
    rejected_case("weight_grads.expert_down [E, I, H]", "weight_grads.expert_down: expected fp32 [8, 256, 128]",
                  [&](RankBackward&, MoeWeights&, MoeWeightGrads& g) { g.expert_down.grad.shape[1] = i, g.expert_down.grad.shape[2] = h; });
    rejected_case("weight_grads.shared_down int32", "weight_grads.shared_down: expected a bf16 or fp32 gradient",
                  [](RankBackward&, MoeWeights&, MoeWeightGrads& g) { g.shared_down.grad.dtype = DType::kInt32; });
    rejected_case("weight_grads.expert_gate accumulated into bf16",
                  "weight_grads.expert_gate: GradMode::kAccumulate needs an fp32 gradient",
                  [](RankBackward&, MoeWeights&, MoeWeightGrads& g) {
                    for (WeightGrad* x : {&g.expert_gate, &g.expert_up}) x->grad.dtype = DType::kBFloat16, x->mode = GradMode::kAccumulate;
                  });
    rejected_case("weight_grads.shared_down mode 7", "weight_grads.shared_down: mode must be",
                  [](RankBackward&, MoeWeights&, MoeWeightGrads& g) { g.shared_down.mode = static_cast<GradMode>(7); });
    rejected_case("weight_grads.expert_up empty, expert_gate given (separate weights)",
                  "weight_grads.expert_up: must be given exactly when weight_grads.expert_gate is",
                  [](RankBackward&, MoeWeights&, MoeWeightGrads& g) { g.expert_up = WeightGrad{}; });
    rejected_case("weight_grads.shared_up accumulated, shared_gate written",
                  "weight_grads.shared_up: must have weight_grads.shared_gate's dtype and mode",
                  [](RankBackward&, MoeWeights&, MoeWeightGrads& g) { g.shared_up.mode = GradMode::kAccumulate; });
    rejected_case("fused [E, 2I, H] gate/up weights, separate gradients",
                  "weight_grads.expert_gate (fused gate and up): expected fp32 [8, 256, 256]",
                  [&](RankBackward&, MoeWeights& w, MoeWeightGrads&) {
                    w.expert_gate.shape[1] = 2 * i;  // a [E, 2I, H] view (validation reads the shape only)
                    w.expert_up = TensorRef();
                  });
    rejected_case("weight_grads.shared_gate + 4 bytes", "weight_grads.shared_gate: data must be 16-byte aligned",
                  [&](RankBackward&, MoeWeights&, MoeWeightGrads& g) { g.shared_gate.grad.data = offset(g.shared_gate.grad.data, 4); });
    MOK_CHECK_CUDA(cudaFreeHost(pinned));
    (void)t;

    // recompute_forward_context validates like the backward: x's token count is the schedule's.
    std::vector<RankForward> args = ws_->all_args();
    args[1].x.shape[0] = 0;
    auto [ok, observed] = expect_invalid_argument(
        [&] { ws_->workspace().recompute_forward_context(args); },
        "MoeWorkspace::recompute_forward_context: rank 1: x: 0 tokens, but the context's schedule was built for 100");
    const std::string errors = status_errors(*ws_);
    if (!errors.empty()) ok = false, observed += "; status: " + errors;
    reset_status(*ws_);
    record("recompute_forward_context with x [0, H]",
           "std::invalid_argument naming x (0 tokens; the context's schedule has 100); nothing issued", ok, observed,
           good_backward(*ws_, fresh_));
  }

  // Rank 1 never calls backward (its calls come after the timeout: a late peer); rank 0 reports the barrier it
  // gave up on, in bounded time; reset, then the next good backward.
  void peer_that_never_arrives() {
    ws_->poison_grads();
    std::vector<RankBackward> args = ws_->all_backward_args();
    const auto start = std::chrono::steady_clock::now();
    ws_->workspace().backward({&args[0], 1});
    const StatusReport s = ws_->status(0);  // synchronizes
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // After the timeout the rank fails fast: the GEMMs (stage kernels' or megakernel's) take no tiles, so no
    // in-kernel hand-off times out (abort stays kAbortWait), and the second barrier's wait gives up at once.
    const bool ok = (s.raw.error_bits & kStatusWaitTimeout) && s.raw.timeout_rank == 0 &&
                    s.raw.timeout_role == static_cast<int32_t>(Role::kBarrier) &&
                    s.raw.timeout_counter == static_cast<int32_t>(CounterId::kBarrierArrived) &&
                    s.raw.timeout_index == 1 && s.raw.timeout_kernel == static_cast<int32_t>(KernelId::kBarrier) &&
                    s.raw.abort == kAbortWait && s.raw.abandoned_waits > 0 &&
                    seconds < 10 * options_.schedule.wait_timeout_s + 10;
    char observed[400];
    std::snprintf(observed, sizeof(observed), "%s (%.2f s)",
                  s.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts).c_str(), seconds);
    ws_->workspace().backward({&args[1], 1});  // the late peer
    ws_->synchronize();
    reset_status(*ws_);
    record("a peer that never calls backward", "status kStatusWaitTimeout on rank 0 naming the wait (rank 0, "
           "barrier_wait_kernel, EP barrier, barrier arrived[1]), abort kAbortWait only, later waits abandoned; "
           "bounded time; gradients unspecified", ok, observed, good_backward(*ws_, fresh_));
  }

  // The same for recompute_forward_context (its pull and gate/up GEMM): rank 0 alone reports its first barrier
  // and fails fast; the late peer's call, reset, a good forward (the contexts again) and the next good backward.
  void peer_that_never_calls_recompute() {
    std::vector<RankForward> args = ws_->all_args();
    const auto start = std::chrono::steady_clock::now();
    ws_->workspace().recompute_forward_context({&args[0], 1});
    const StatusReport s = ws_->status(0);  // synchronizes
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const bool ok = (s.raw.error_bits & kStatusWaitTimeout) && s.raw.timeout_rank == 0 &&
                    s.raw.timeout_role == static_cast<int32_t>(Role::kBarrier) &&
                    s.raw.timeout_counter == static_cast<int32_t>(CounterId::kBarrierArrived) &&
                    s.raw.timeout_index == 1 && s.raw.timeout_kernel == static_cast<int32_t>(KernelId::kBarrier) &&
                    s.raw.abort == kAbortWait && s.raw.abandoned_waits > 0 &&
                    seconds < 10 * options_.schedule.wait_timeout_s + 10;
    char observed[400];
    std::snprintf(observed, sizeof(observed), "%s (%.2f s)",
                  s.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts).c_str(), seconds);
    ws_->workspace().recompute_forward_context({&args[1], 1});  // the late peer
    ws_->synchronize();
    reset_status(*ws_);
    ws_->forward();  // the contexts of a good forward again
    record("a peer that never calls recompute_forward_context", "status kStatusWaitTimeout on rank 0 naming the "
           "wait (barrier_wait_kernel, barrier arrived[1]), abort kAbortWait only, later waits abandoned; bounded "
           "time", ok, observed, good_backward(*ws_, fresh_));
  }

  // The stage kernels' standalone GEMMs of one kind (kernel: KernelId::kExpertGemm or kWeightGradGemm) with a
  // stalled producer (the test knob detail::set_stalled_producer): on each rank the first such GEMM's consumers
  // time out within the hand-off bound (2 * wait_timeout_s + 1 s) and report it (the kernel, role GEMM consumer,
  // counter pipeline full), the rank's later GEMMs take no tiles and its barrier waits give up at once (abort),
  // the call returns; reset, then the next good backward gives a fresh workspace's bits.
  void stalled_gemm_producer(KernelId kernel) {
    ws_->poison_grads();
    detail::set_stalled_producer(kernel, true);
    const auto start = std::chrono::steady_clock::now();
    try {
      ws_->backward();
      ws_->synchronize();
    } catch (...) {
      detail::set_stalled_producer(kernel, false);
      throw;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    detail::set_stalled_producer(kernel, false);
    bool ok = seconds < 2 * (2 * options_.schedule.wait_timeout_s + 1) + 10;
    std::string observed;
    for (int r = 0; r < 2; ++r) {
      const StatusReport s = ws_->status(r);
      ok = ok && s.raw.error_bits == kStatusWaitTimeout && s.raw.timeout_rank == r &&
           s.raw.timeout_kernel == static_cast<int32_t>(kernel) &&
           s.raw.timeout_role == static_cast<int32_t>(Role::kGemmConsumer) &&
           s.raw.timeout_counter == static_cast<int32_t>(CounterId::kPipelineFull) && (s.raw.abort & kAbortHandoff);
      observed += "rank " + std::to_string(r) + ": " + s.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts) + "; ";
    }
    char seconds_text[32];
    std::snprintf(seconds_text, sizeof(seconds_text), "(%.2f s)", seconds);
    const std::string name = kernel == KernelId::kExpertGemm ? "expert_gemm" : "weight_grad_gemm";
    reset_status(*ws_);
    record("a stalled " + name + " producer (test knob)",
           "status kStatusWaitTimeout on each rank naming kernel " + name + ", GEMM consumer, pipeline full; abort "
           "kAbortHandoff; bounded time; gradients unspecified",
           ok, observed + seconds_text, good_backward(*ws_, fresh_));
  }

  // MoeOptions::backward = false: backward and recompute_forward_context throw naming the option; the forward is
  // unchanged (bitwise the backward workspace's out).
  void inference_only_workspace() {
    MoeOptions inference = options_;
    inference.backward = false;
    inference.fused.backward_megakernel = false;  // the backward megakernel needs the backward (refused otherwise)
    MoeHarness plain(PeerGroup::virtual_ranks(2), shape_, inference);
    plain.upload(good_);
    plain.upload_d_out(d_out_);
    plain.forward();
    bool ok = plain.workspace().backward_bytes() == 0;
    std::string observed;
    {
      auto [thrown, text] = expect_invalid_argument([&] { plain.workspace().backward(plain.all_backward_args()); },
                                                    "MoeOptions.backward = false");
      ok = ok && thrown;
      observed = text;
    }
    {
      auto [thrown, text] = expect_invalid_argument(
          [&] { plain.workspace().recompute_forward_context(plain.all_args()); }, "MoeOptions.backward = false");
      ok = ok && thrown;
      observed += "; " + text;
    }
    const std::string errors = status_errors(plain);
    if (!errors.empty()) ok = false, observed += "; status: " + errors;
    std::string next = "bitwise == backward workspace's out";
    plain.forward();
    ws_->upload(good_);
    ws_->forward();
    for (int r = 0; r < 2; ++r)
      if (plain.out_bits(r) != ws_->out_bits(r)) next = "FAIL rank " + std::to_string(r) + " out differs";
    record("backward / recompute on a workspace built with MoeOptions.backward = false",
           "std::invalid_argument naming MoeOptions.backward; nothing issued; forward unchanged", ok, observed, next);
  }

  // Capacity 128 rows: the forward's and backward's schedule is empty (0 rows); the backward issues normally,
  // its barriers stay in step (no timeout), nothing is written out of bounds (memcheck); gradients unspecified.
  // Then a routing that fits gives a fresh workspace's bits.
  void capacity_too_small() {
    MoeOptions tight = options_;
    tight.schedule.capacity_rows = 128;
    MoeHarness h(PeerGroup::virtual_ranks(2), shape_, tight);
    h.upload(good_);
    h.upload_d_out(d_out_);
    h.forward();
    h.backward();
    bool ok = true;
    std::string observed;
    for (int r = 0; r < 2; ++r) {
      const StatusReport s = h.status(r);
      ok = ok && s.raw.error_bits == kStatusCapacityOverflow;
      if (r == 0) observed = s.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts);
    }
    reset_status(h);
    LayerData fits = good_;  // as the forward's row: 32 rows per expert of experts 0 and 8
    for (int64_t g = 0; g < int64_t(fits.inputs.topk_idx.size()); ++g) {
      const int64_t token = (g / shape_.top_k) % shape_.num_tokens;
      fits.inputs.topk_idx[g] = g % shape_.top_k == 0 && token < 32 ? (token % 2 == 0 ? 0 : 8) : -1;
    }
    const Grads fresh = fresh_grads(tight, fits);
    h.upload(fits);
    h.forward();
    record("capacity too small (capacity_rows 128), forward + backward",
           "status kStatusCapacityOverflow only (the backward's barriers stay in step); no write out of bounds "
           "(memcheck); gradients unspecified",
           ok, observed, good_backward(h, fresh));
  }

  MoeShape shape_;
  MoeOptions options_;
  LayerData good_;
  std::vector<float> d_out_;
  std::string path_;  // the table's path column
  Grads fresh_;
  std::unique_ptr<MoeHarness> ws_;
  std::vector<Row> rows_;
};

void print_rows(const std::vector<Row>& rows) {
  std::printf("case | path | expected | observed | next call\n");
  for (const Row& row : rows) {
    std::printf("%s | %s | %s | %s | %s%s\n", row.name.c_str(), row.path.c_str(), row.expected.c_str(),
                row.observed.c_str(), row.next.c_str(), row.pass ? "" : "   <-- MISMATCH");
    EXPECT_TRUE(row.pass) << row.name << " (" << row.path << "): expected " << row.expected << "; observed "
                          << row.observed << "; next call: " << row.next;
  }
}

void run_matrix(ForwardPath path) {
  BadInputMatrix matrix(path);
  matrix.run();
  print_rows(matrix.rows());
}

TEST(BadInputsTest, FusedPath) {
  MOK_REQUIRE_GPUS(1);
  run_matrix(ForwardPath::kFused);
}

TEST(BadInputsTest, UnfusedPath) {
  MOK_REQUIRE_GPUS(1);
  run_matrix(ForwardPath::kUnfused);
}

TEST(BadInputsTest, Backward) {
  MOK_REQUIRE_GPUS(1);
  for (const bool megakernel : {false, true}) {
    BackwardBadInputs matrix(megakernel);
    matrix.run();
    print_rows(matrix.rows());
  }
}

}  // namespace
}  // namespace mok
