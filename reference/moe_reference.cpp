// CPU reference of the MoE layer: formulas, layouts and numerics are in moe_reference.h.
//
// Work decomposition (the same for every thread count, so results never depend on it):
//   * routes are grouped by expert ("groups" 0..E-1, plus group E for the shared expert when present),
//     each group's routes in ascending (token, j) order;
//   * forward / backward activation work: units of up to kRoutesPerUnit routes of one group (the weight
//     rows stay in cache while the unit's tokens stream past them); each unit writes only its routes'
//     slots;
//   * d_x: one unit per token, summing the per-route partials in fixed order (shared, j = 0..k-1);
//   * weight gradients: one unit per (group, tensor, block of kRowsPerGradUnit rows), summing the
//     group's routes in order.
#include "reference/moe_reference.h"

#include "reference/fp8.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

namespace mok::reference {
namespace {

constexpr int kRoutesPerUnit = 16;
constexpr int kRowsPerGradUnit = 8;
constexpr int64_t kSerialWork = int64_t{1} << 18;  // below this many multiply-adds, one thread

// ---------------------------------------------------------------------------------------------------
// Small utilities

template <typename T>
double rounded(double value) {
  return static_cast<double>(static_cast<T>(value));
}

double sigmoid(double g) {
  if (g >= 0) return 1.0 / (1.0 + std::exp(-g));
  const double e = std::exp(g);
  return e / (1.0 + e);
}

int resolve_num_threads(int num_threads, int64_t num_items, int64_t total_work) {
  if (num_threads <= 0) {
    if (total_work < kSerialWork) return 1;
    num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  return static_cast<int>(std::clamp<int64_t>(num_items, 1, num_threads));
}

// Calls fn(i) for every i in [0, num_items) on num_threads threads (including the caller). fn must
// write disjoint outputs for different i.
template <typename Fn>
void parallel_for(int64_t num_items, int num_threads, const Fn& fn) {
  if (num_items <= 0) return;
  std::atomic<int64_t> next_item{0};
  auto worker = [&] {
    for (int64_t item_idx = next_item.fetch_add(1); item_idx < num_items; item_idx = next_item.fetch_add(1)) {
      fn(item_idx);
    }
  };
  std::vector<std::thread> threads;
  for (int thread_idx = 1; thread_idx < num_threads; ++thread_idx) threads.emplace_back(worker);
  worker();
  for (auto& thread : threads) thread.join();
}

// ---------------------------------------------------------------------------------------------------
// Dense kernels. All accumulate in double with the reduction index ascending.

// out[b * out_stride + r] = sum_c w[r * cols + c] * v[b * v_stride + c] for kRows rows, kVecs vectors.
template <typename T, int kRows, int kVecs>
void dot_block(const T* w, int64_t cols, const double* v, int64_t v_stride, double* out, int64_t out_stride) {
  double acc[kRows][kVecs] = {};
  for (int64_t c = 0; c < cols; ++c) {
    double w_c[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) w_c[r] = static_cast<double>(w[r * cols + c]);
#pragma GCC unroll 4
    for (int b = 0; b < kVecs; ++b) {
      const double v_c = v[b * v_stride + c];
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) acc[r][b] += w_c[r] * v_c;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kVecs; ++b) out[b * out_stride + r] = acc[r][b];
  }
}

template <typename T, int kRows>
void dot_rows_block(const T* w, int64_t cols, const double* v, int64_t v_stride, int num_vecs, double* out,
                    int64_t out_stride) {
  int b = 0;
  for (; b + 4 <= num_vecs; b += 4) {
    dot_block<T, kRows, 4>(w, cols, v + b * v_stride, v_stride, out + b * out_stride, out_stride);
  }
  const double* v_rest = v + b * v_stride;
  double* out_rest = out + b * out_stride;
  switch (num_vecs - b) {
    case 3: dot_block<T, kRows, 3>(w, cols, v_rest, v_stride, out_rest, out_stride); break;
    case 2: dot_block<T, kRows, 2>(w, cols, v_rest, v_stride, out_rest, out_stride); break;
    case 1: dot_block<T, kRows, 1>(w, cols, v_rest, v_stride, out_rest, out_stride); break;
    default: break;
  }
}

// out[b * rows + r] = sum_c w[r * cols + c] * v[b * cols + c]: the matrix [rows, cols] times num_vecs
// vectors of length cols.
template <typename T>
void matrix_times_vectors(const T* w, int64_t rows, int64_t cols, const double* v, int num_vecs, double* out) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) dot_rows_block<T, 2>(w + r * cols, cols, v, cols, num_vecs, out + r, rows);
  if (r < rows) dot_rows_block<T, 1>(w + r * cols, cols, v, cols, num_vecs, out + r, rows);
}

// out[c] += sum over calls of s * a[c] (one term per call, so the caller fixes the order).
template <typename A>
void add_scaled(double* out, const A* a, double s, int64_t count) {
  for (int64_t c = 0; c < count; ++c) out[c] += s * static_cast<double>(a[c]);
}

// out[c] += |s| * |a[c]|: the magnitude twin of add_scaled.
template <typename A>
void add_scaled_abs(double* out, const A* a, double s, int64_t count) {
  for (int64_t c = 0; c < count; ++c) out[c] += std::fabs(s * static_cast<double>(a[c]));
}

// out[b * cols + c] += sum_r w[r * cols + c] * s[b * rows + r], r ascending: the transposed matrix
// [cols, rows] times num_vecs vectors of length rows.
template <typename T>
void add_transposed_times_vectors(const T* w, int64_t rows, int64_t cols, const double* s, int num_vecs,
                                  double* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int b = 0; b < num_vecs; ++b) add_scaled(out + b * cols, w + r * cols, s[b * rows + r], cols);
  }
}

// ---------------------------------------------------------------------------------------------------
// Routing plan

struct Route {
  int64_t token_idx;
  int slot;  // j in [0, k), or -1 for the shared expert
};

struct WorkUnit {
  int group_idx;
  int64_t begin, end;  // routes [begin, end) of the group
};

struct RoutePlan {
  int num_groups = 0;                              // E, plus one for the shared expert (group E)
  std::vector<std::vector<Route>> group_routes;    // ascending (token, j)
  std::vector<WorkUnit> units;                     // kRoutesPerUnit routes at most
  int64_t num_routes = 0;                          // routes held by any group

  // Slot of a route in per-route storage: routed n*k + j, shared N*k + n.
  static int64_t storage_idx(const Route& route, const LayerShape& shape) {
    return route.slot >= 0 ? route.token_idx * shape.top_k + route.slot
                           : shape.num_tokens() * shape.top_k + route.token_idx;
  }
};

RoutePlan build_route_plan(const LayerShape& shape, const std::vector<int32_t>& topk_idx) {
  RoutePlan plan;
  const int64_t num_tokens = shape.num_tokens();
  plan.num_groups = shape.num_experts + (shape.shared_expert ? 1 : 0);
  plan.group_routes.resize(plan.num_groups);
  for (int64_t n = 0; n < num_tokens; ++n) {
    for (int j = 0; j < shape.top_k; ++j) {
      const int32_t expert_idx = topk_idx[n * shape.top_k + j];
      if (expert_idx >= 0) plan.group_routes[expert_idx].push_back({n, j});
    }
    if (shape.shared_expert) plan.group_routes[shape.num_experts].push_back({n, -1});
  }
  for (int group_idx = 0; group_idx < plan.num_groups; ++group_idx) {
    const int64_t count = static_cast<int64_t>(plan.group_routes[group_idx].size());
    plan.num_routes += count;
    for (int64_t begin = 0; begin < count; begin += kRoutesPerUnit) {
      plan.units.push_back({group_idx, begin, std::min(count, begin + kRoutesPerUnit)});
    }
  }
  return plan;
}

template <typename T>
struct ExpertWeights {
  const T* gate;  // [I, H]
  const T* up;    // [I, H]
  const T* down;  // [H, I]
};

template <typename T>
ExpertWeights<T> group_weights(const LayerShape& shape, const LayerParams<T>& params, int group_idx) {
  if (group_idx == shape.num_experts) {
    return {params.shared_gate.data(), params.shared_up.data(), params.shared_down.data()};
  }
  const int64_t offset = int64_t{group_idx} * shape.intermediate * shape.hidden;
  return {params.expert_gate.data() + offset, params.expert_up.data() + offset, params.expert_down.data() + offset};
}

template <typename T>
double route_weight(const LayerShape& shape, const LayerInputs<T>& inputs, const Route& route) {
  return route.slot >= 0 ? static_cast<double>(inputs.router_weights[route.token_idx * shape.top_k + route.slot])
                         : 1.0;
}

// Rows [rows.size() / cols, cols] as an FP8 GEMM reads them, quantized per 1 x 128 (every token's x or d_out).
template <typename T>
std::vector<double> quantized_rows(const std::vector<T>& rows, int64_t cols, bool power_of_two) {
  std::vector<double> out(rows.begin(), rows.end());
  for (size_t r = 0; r * cols < out.size(); ++r) quantize_row(out.data() + r * cols, cols, power_of_two);
  return out;
}

// The forward part of one work unit: x rows, g, u (unclamped), h = silu(g_c) * u_c, all T-rounded; with
// recipe.forward x and h as the FP8 GEMMs read them (quantized per 1 x 128).
struct UnitActivations {
  int num_routes = 0;
  std::vector<double> x;        // [num_routes, H]
  std::vector<double> gate;     // [num_routes, I]
  std::vector<double> up;       // [num_routes, I]
  std::vector<double> hidden;   // [num_routes, I] what the down GEMM reads
  std::vector<double> hidden_before_quantization;  // [num_routes, I] with recipe.forward, else empty
};

template <typename T>
UnitActivations compute_activations(const LayerShape& shape, const LayerInputs<T>& inputs,
                                    const ExpertWeights<T>& weights, const Route* routes, int num_routes,
                                    const Fp8Recipe& recipe) {
  const int64_t hidden_size = shape.hidden, inter_size = shape.intermediate;
  const double limit = shape.swiglu_limit;
  UnitActivations act;
  act.num_routes = num_routes;
  act.x.resize(num_routes * hidden_size);
  act.gate.resize(num_routes * inter_size);
  act.up.resize(num_routes * inter_size);
  act.hidden.resize(num_routes * inter_size);
  for (int b = 0; b < num_routes; ++b) {
    const T* x_row = inputs.x.data() + routes[b].token_idx * hidden_size;
    std::transform(x_row, x_row + hidden_size, act.x.begin() + b * hidden_size,
                   [](T value) { return static_cast<double>(value); });
    if (recipe.forward) quantize_row(act.x.data() + b * hidden_size, hidden_size, recipe.power_of_two_scales);
  }
  matrix_times_vectors(weights.gate, inter_size, hidden_size, act.x.data(), num_routes, act.gate.data());
  matrix_times_vectors(weights.up, inter_size, hidden_size, act.x.data(), num_routes, act.up.data());
  for (int64_t idx = 0; idx < num_routes * inter_size; ++idx) {
    const double g = rounded<T>(act.gate[idx]);
    const double u = rounded<T>(act.up[idx]);
    act.gate[idx] = g;
    act.up[idx] = u;
    const double g_c = limit > 0 ? std::min(g, limit) : g;
    const double u_c = limit > 0 ? std::clamp(u, -limit, limit) : u;
    act.hidden[idx] = rounded<T>(g_c * sigmoid(g_c) * u_c);
  }
  if (recipe.forward) {
    act.hidden_before_quantization = act.hidden;
    for (int b = 0; b < num_routes; ++b)
      quantize_row(act.hidden.data() + b * inter_size, inter_size, recipe.power_of_two_scales);
  }
  return act;
}

// y = W_down h for every route of the unit, T-rounded: [num_routes, H].
template <typename T>
std::vector<double> compute_outputs(const LayerShape& shape, const ExpertWeights<T>& weights,
                                    const UnitActivations& act) {
  std::vector<double> y(act.num_routes * int64_t{shape.hidden});
  matrix_times_vectors(weights.down, shape.hidden, shape.intermediate, act.hidden.data(), act.num_routes, y.data());
  for (double& value : y) value = rounded<T>(value);
  return y;
}

// ---------------------------------------------------------------------------------------------------
// Validation helpers

[[noreturn]] void throw_size(const char* name, size_t actual, const char* formula, int64_t expected) {
  std::ostringstream message;
  message << "mok::reference: " << name << " has " << actual << " elements, expected " << formula << " = "
          << expected;
  throw std::invalid_argument(message.str());
}

void check_size(const char* name, size_t actual, const char* formula, int64_t expected) {
  if (static_cast<int64_t>(actual) != expected) throw_size(name, actual, formula, expected);
}

void validate_recipe(const Fp8Recipe& recipe) {
  if (recipe.weight_gradients_from_quantized && !recipe.forward)
    throw std::invalid_argument(
        "mok::reference: Fp8Recipe::weight_gradients_from_quantized needs Fp8Recipe::forward (the quantized x and h "
        "are the FP8 forward's)");
  if (recipe.dy_from_quantized_d_out && !recipe.dgrads)
    throw std::invalid_argument(
        "mok::reference: Fp8Recipe::dy_from_quantized_d_out needs Fp8Recipe::dgrads (d_out_q is the FP8 dgrads')");
}

void check_optional_size(const char* name, size_t actual, const char* formula, int64_t expected) {
  if (actual != 0 && static_cast<int64_t>(actual) != expected) throw_size(name, actual, formula, expected);
}

// ---------------------------------------------------------------------------------------------------
// Deterministic random numbers: splitmix64 stream, Box-Muller normals.

class Random {
 public:
  Random(uint64_t seed, uint64_t stream) : state_(seed * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull) {
    next();
  }
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  int64_t below(int64_t bound) { return static_cast<int64_t>(next() % static_cast<uint64_t>(bound)); }

 private:
  uint64_t state_;
};

template <typename T>
std::vector<T> normal_vector(int64_t count, uint64_t seed, uint64_t stream, double scale) {
  Random random(seed, stream);
  std::vector<T> values(count);
  for (T& value : values) value = static_cast<T>(scale * random.normal());
  return values;
}

}  // namespace

// -----------------------------------------------------------------------------------------------------
// Shape

void LayerShape::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("mok::reference: LayerShape::" + what); };
  if (num_ranks <= 0) fail("num_ranks must be positive, got " + std::to_string(num_ranks));
  if (tokens_per_rank < 0) fail("tokens_per_rank must be non-negative, got " + std::to_string(tokens_per_rank));
  if (hidden <= 0) fail("hidden must be positive, got " + std::to_string(hidden));
  if (intermediate <= 0) fail("intermediate must be positive, got " + std::to_string(intermediate));
  if (num_experts <= 0) fail("num_experts must be positive, got " + std::to_string(num_experts));
  if (num_experts % num_ranks != 0) {
    fail("num_experts (" + std::to_string(num_experts) + ") must be a multiple of num_ranks (" +
         std::to_string(num_ranks) + ")");
  }
  if (top_k <= 0 || top_k > num_experts) {
    fail("top_k must be in [1, num_experts = " + std::to_string(num_experts) + "], got " + std::to_string(top_k));
  }
  if (!(swiglu_limit >= 0) || !std::isfinite(swiglu_limit)) {
    fail("swiglu_limit must be finite and >= 0, got " + std::to_string(swiglu_limit));
  }
}

std::string describe(const LayerShape& shape) {
  std::ostringstream text;
  text << "N=" << shape.num_tokens() << " (" << shape.num_ranks << " ranks x " << shape.tokens_per_rank
       << ") H=" << shape.hidden << " I=" << shape.intermediate << " E=" << shape.num_experts
       << " k=" << shape.top_k << (shape.shared_expert ? " shared" : " no-shared") << " L=" << shape.swiglu_limit;
  return text.str();
}

namespace {

template <typename T>
void validate_params(const LayerShape& shape, const LayerParams<T>& params) {
  shape.validate();
  const int64_t expert_size = int64_t{shape.intermediate} * shape.hidden;
  const int64_t all_experts_size = expert_size * shape.num_experts;
  if (shape.shared_expert) {
    check_size("LayerParams::shared_gate", params.shared_gate.size(), "I*H", expert_size);
    check_size("LayerParams::shared_up", params.shared_up.size(), "I*H", expert_size);
    check_size("LayerParams::shared_down", params.shared_down.size(), "H*I", expert_size);
  } else {
    check_optional_size("LayerParams::shared_gate", params.shared_gate.size(), "0 or I*H", expert_size);
    check_optional_size("LayerParams::shared_up", params.shared_up.size(), "0 or I*H", expert_size);
    check_optional_size("LayerParams::shared_down", params.shared_down.size(), "0 or H*I", expert_size);
  }
  check_size("LayerParams::expert_gate", params.expert_gate.size(), "E*I*H", all_experts_size);
  check_size("LayerParams::expert_up", params.expert_up.size(), "E*I*H", all_experts_size);
  check_size("LayerParams::expert_down", params.expert_down.size(), "E*H*I", all_experts_size);
}

}  // namespace

template <typename T>
void validate_arguments(const LayerShape& shape, const LayerParams<T>& params, const LayerInputs<T>& inputs) {
  validate_params(shape, params);
  const int64_t num_tokens = shape.num_tokens();
  check_size("LayerInputs::x", inputs.x.size(), "N*H", num_tokens * shape.hidden);
  check_size("LayerInputs::topk_idx", inputs.topk_idx.size(), "N*k", num_tokens * shape.top_k);
  check_size("LayerInputs::router_weights", inputs.router_weights.size(), "N*k", num_tokens * shape.top_k);
  for (int64_t n = 0; n < num_tokens; ++n) {
    for (int j = 0; j < shape.top_k; ++j) {
      const int32_t expert_idx = inputs.topk_idx[n * shape.top_k + j];
      if (expert_idx < -1 || expert_idx >= shape.num_experts) {
        std::ostringstream message;
        message << "mok::reference: topk_idx[token " << n << ", slot " << j << "] = " << expert_idx
                << " is outside [-1, num_experts = " << shape.num_experts << ")";
        throw std::out_of_range(message.str());
      }
    }
  }
}

// -----------------------------------------------------------------------------------------------------
// Forward

template <typename T>
ForwardTrace<T> forward(const LayerShape& shape, const LayerParams<T>& params, const LayerInputs<T>& inputs,
                        int num_threads, const Fp8Recipe& recipe) {
  validate_arguments(shape, params, inputs);
  validate_recipe(recipe);
  const int64_t num_tokens = shape.num_tokens();
  const int64_t hidden_size = shape.hidden, top_k = shape.top_k;
  const RoutePlan plan = build_route_plan(shape, inputs.topk_idx);
  const int64_t route_work = 3 * hidden_size * shape.intermediate;

  ForwardTrace<T> trace;
  trace.shared_out.assign(num_tokens * hidden_size, T(0));
  trace.route_out.assign(num_tokens * top_k * hidden_size, T(0));
  trace.out.assign(num_tokens * hidden_size, T(0));

  const int64_t num_units = static_cast<int64_t>(plan.units.size());
  parallel_for(num_units, resolve_num_threads(num_threads, num_units, plan.num_routes * route_work),
               [&](int64_t unit_idx) {
                 const WorkUnit& unit = plan.units[unit_idx];
                 const Route* routes = plan.group_routes[unit.group_idx].data() + unit.begin;
                 const int num_routes = static_cast<int>(unit.end - unit.begin);
                 const ExpertWeights<T> weights = group_weights(shape, params, unit.group_idx);
                 const UnitActivations act = compute_activations(shape, inputs, weights, routes, num_routes, recipe);
                 const std::vector<double> y = compute_outputs(shape, weights, act);
                 for (int b = 0; b < num_routes; ++b) {
                   const Route& route = routes[b];
                   T* dst = route.slot >= 0
                                ? trace.route_out.data() + (route.token_idx * top_k + route.slot) * hidden_size
                                : trace.shared_out.data() + route.token_idx * hidden_size;
                   for (int64_t h = 0; h < hidden_size; ++h) dst[h] = static_cast<T>(y[b * hidden_size + h]);
                 }
               });

  // Combine on the token's own rank: out = shared + sum_j rw_j * y_j, fixed j order.
  parallel_for(num_tokens, resolve_num_threads(num_threads, num_tokens, num_tokens * hidden_size * top_k),
               [&](int64_t n) {
                 for (int64_t h = 0; h < hidden_size; ++h) {
                   double sum = static_cast<double>(trace.shared_out[n * hidden_size + h]);
                   for (int64_t j = 0; j < top_k; ++j) {
                     if (inputs.topk_idx[n * top_k + j] < 0) continue;
                     sum += static_cast<double>(inputs.router_weights[n * top_k + j]) *
                            static_cast<double>(trace.route_out[(n * top_k + j) * hidden_size + h]);
                   }
                   trace.out[n * hidden_size + h] = static_cast<T>(sum);
                 }
               });
  return trace;
}

// -----------------------------------------------------------------------------------------------------
// Backward

template <typename T>
LayerGrads<T> backward(const LayerShape& shape, const LayerParams<T>& params, const LayerInputs<T>& inputs,
                       const std::vector<T>& d_out, int num_threads, bool magnitudes, const Fp8Recipe& recipe) {
  validate_arguments(shape, params, inputs);
  validate_recipe(recipe);
  const int64_t num_tokens = shape.num_tokens();
  check_size("d_out", d_out.size(), "N*H", num_tokens * shape.hidden);
  const int64_t hidden_size = shape.hidden, inter_size = shape.intermediate, top_k = shape.top_k;
  const double limit = shape.swiglu_limit;
  const RoutePlan plan = build_route_plan(shape, inputs.topk_idx);
  const int64_t expert_size = inter_size * hidden_size;

  LayerGrads<T> grads;
  grads.d_x.assign(num_tokens * hidden_size, T(0));
  grads.d_router_weights.assign(num_tokens * top_k, T(0));
  grads.d_shared_gate.assign(expert_size, T(0));
  grads.d_shared_up.assign(expert_size, T(0));
  grads.d_shared_down.assign(expert_size, T(0));
  grads.d_expert_gate.assign(expert_size * shape.num_experts, T(0));
  grads.d_expert_up.assign(expert_size * shape.num_experts, T(0));
  grads.d_expert_down.assign(expert_size * shape.num_experts, T(0));
  if (magnitudes) {
    for (auto* m : {&grads.magnitude_shared_gate, &grads.magnitude_shared_up, &grads.magnitude_shared_down})
      m->assign(expert_size, T(0));
    for (auto* m : {&grads.magnitude_expert_gate, &grads.magnitude_expert_up, &grads.magnitude_expert_down})
      m->assign(expert_size * shape.num_experts, T(0));
  }

  // Per-route storage (slot RoutePlan::storage_idx), filled by phase 1, read by phases 2 and 3.
  const int64_t num_slots = num_tokens * (top_k + 1);
  std::vector<double> route_hidden(num_slots * inter_size);  // h
  std::vector<double> route_d_gate(num_slots * inter_size);  // dg
  std::vector<double> route_d_up(num_slots * inter_size);    // du
  // With magnitudes: the error scales of dg and du for the weight gradients' budgets. The GPU reads g and u
  // rounded to bf16, and silu' changes sign (g ~ -1.28), so dg's error scales with |dh u| (|silu'(g)| +
  // |g silu''(g)|), not with |dg|; du's with |dh| (|silu(g)| + |g silu'(g)|).
  std::vector<double> route_d_gate_scale(magnitudes ? num_slots * inter_size : 0);
  std::vector<double> route_d_up_scale(magnitudes ? num_slots * inter_size : 0);
  std::vector<T> route_d_x(num_slots * hidden_size);         // W_gate^T dg + W_up^T du
  // FP8: d_out as the down dgrad reads it, and x as the forward's GEMMs read it (the weight gradients' x when
  // recipe.weight_gradients_from_quantized); [N, H] each, else empty.
  const bool p2 = recipe.power_of_two_scales;
  const std::vector<double> d_out_quantized =
      recipe.dgrads ? quantized_rows(d_out, hidden_size, p2) : std::vector<double>{};
  const std::vector<double> x_quantized =
      recipe.weight_gradients_from_quantized ? quantized_rows(inputs.x, hidden_size, p2) : std::vector<double>{};
  // The weight gradients' dy of a route with router weight rw, element `index` of d_out: T(rw * d_out), d_out as
  // the FP8 down dgrad reads it with recipe.dy_from_quantized_d_out.
  const auto weight_grad_dy = [&](double rw, int64_t index) {
    const double value = recipe.dy_from_quantized_d_out ? d_out_quantized[index] : static_cast<double>(d_out[index]);
    return rounded<T>(rw * value);
  };

  // Phase 1: per route, recompute the forward, then d_rw, dh, dg, du and the d_x partial.
  const int64_t num_units = static_cast<int64_t>(plan.units.size());
  parallel_for(num_units, resolve_num_threads(num_threads, num_units, plan.num_routes * 6 * expert_size),
               [&](int64_t unit_idx) {
    const WorkUnit& unit = plan.units[unit_idx];
    const Route* routes = plan.group_routes[unit.group_idx].data() + unit.begin;
    const int num_routes = static_cast<int>(unit.end - unit.begin);
    const bool is_shared = unit.group_idx == shape.num_experts;
    const ExpertWeights<T> weights = group_weights(shape, params, unit.group_idx);
    const UnitActivations act = compute_activations(shape, inputs, weights, routes, num_routes, recipe);

    // d_rw = <d_out, y>, independent of rw (so also right for rw == 0). FP8 dgrads: below, from d_hu.
    if (!is_shared && !recipe.dgrads) {
      const std::vector<double> y = compute_outputs(shape, weights, act);
      for (int b = 0; b < num_routes; ++b) {
        const T* d_out_row = d_out.data() + routes[b].token_idx * hidden_size;
        double sum = 0;
        for (int64_t h = 0; h < hidden_size; ++h) sum += static_cast<double>(d_out_row[h]) * y[b * hidden_size + h];
        grads.d_router_weights[routes[b].token_idx * top_k + routes[b].slot] = static_cast<T>(sum);
      }
    }

    // bf16: dy = rw * d_out; dh = W_down^T dy. FP8 dgrads: d_hu = W_down^T d_out_q; d_rw = <d_hu, h> (h before
    // its quantization); dh = rw * d_hu.
    std::vector<double> d_y(num_routes * hidden_size);
    for (int b = 0; b < num_routes; ++b) {
      const double rw = route_weight(shape, inputs, routes[b]);
      const int64_t row = routes[b].token_idx * hidden_size;
      for (int64_t h = 0; h < hidden_size; ++h) {
        d_y[b * hidden_size + h] =
            recipe.dgrads ? d_out_quantized[row + h] : rounded<T>(rw * static_cast<double>(d_out[row + h]));
      }
    }
    std::vector<double> d_hidden(num_routes * inter_size, 0.0);
    add_transposed_times_vectors(weights.down, hidden_size, inter_size, d_y.data(), num_routes, d_hidden.data());
    if (recipe.dgrads) {
      for (int b = 0; b < num_routes; ++b) {
        const double rw = route_weight(shape, inputs, routes[b]);
        double* d_hu = d_hidden.data() + b * inter_size;
        if (!is_shared) {
          const std::vector<double>& h = recipe.forward ? act.hidden_before_quantization : act.hidden;
          const double d_rw = std::inner_product(d_hu, d_hu + inter_size, h.begin() + b * inter_size, 0.0);
          grads.d_router_weights[routes[b].token_idx * top_k + routes[b].slot] = static_cast<T>(d_rw);
        }
        for (int64_t i = 0; i < inter_size; ++i) d_hu[i] *= rw;
      }
    }

    // SwiGLU backward: dg = dh u_c silu'(g_c) [g < L], du = dh silu(g_c) [-L < u < L].
    std::vector<double> d_gate(num_routes * inter_size), d_up(num_routes * inter_size);
    for (int64_t idx = 0; idx < num_routes * inter_size; ++idx) {
      const double dh = rounded<T>(d_hidden[idx]);
      const double g = act.gate[idx], u = act.up[idx];
      const bool gate_passes = !(limit > 0) || g < limit;
      const bool up_passes = !(limit > 0) || (-limit < u && u < limit);
      const double g_c = gate_passes ? g : limit;
      const double u_c = up_passes ? u : std::clamp(u, -limit, limit);
      const double s = sigmoid(g_c);
      d_gate[idx] = gate_passes ? rounded<T>(dh * u_c * (s * (1.0 + g_c * (1.0 - s)))) : 0.0;
      d_up[idx] = up_passes ? rounded<T>(dh * (g_c * s)) : 0.0;
      if (magnitudes) {
        const double silu_1 = s * (1.0 + g_c * (1.0 - s));                  // silu'(g_c)
        const double silu_2 = s * (1.0 - s) * (2.0 + g_c * (1.0 - 2.0 * s));  // silu''(g_c)
        const int64_t slot = RoutePlan::storage_idx(routes[idx / inter_size], shape);
        const int64_t at = slot * inter_size + idx % inter_size;
        route_d_gate_scale[at] = std::fabs(dh * u_c) * (std::fabs(silu_1) + std::fabs(g_c * silu_2));
        route_d_up_scale[at] = std::fabs(dh) * (std::fabs(g_c * s) + std::fabs(g_c * silu_1));
      }
    }

    // d_x partial = W_gate^T dg + W_up^T du (one accumulator: gate rows, then up rows). FP8 dgrads: dg and du
    // quantized per route, each per 1 x 128.
    std::vector<double> d_gate_operand, d_up_operand;
    if (recipe.dgrads) {
      d_gate_operand = d_gate;
      d_up_operand = d_up;
      for (int b = 0; b < num_routes; ++b) {
        quantize_row(d_gate_operand.data() + b * inter_size, inter_size, p2);
        quantize_row(d_up_operand.data() + b * inter_size, inter_size, p2);
      }
    }
    const std::vector<double>& d_gate_in = recipe.dgrads ? d_gate_operand : d_gate;
    const std::vector<double>& d_up_in = recipe.dgrads ? d_up_operand : d_up;
    std::vector<double> d_x_part(num_routes * hidden_size, 0.0);
    add_transposed_times_vectors(weights.gate, inter_size, hidden_size, d_gate_in.data(), num_routes, d_x_part.data());
    add_transposed_times_vectors(weights.up, inter_size, hidden_size, d_up_in.data(), num_routes, d_x_part.data());
    // The weight gradients' h: what the down GEMM read, or (FP8 forward, bf16 activations) h before quantization.
    const std::vector<double>& hidden_for_grads =
        recipe.forward && !recipe.weight_gradients_from_quantized ? act.hidden_before_quantization : act.hidden;

    for (int b = 0; b < num_routes; ++b) {
      const int64_t slot = RoutePlan::storage_idx(routes[b], shape);
      std::copy_n(hidden_for_grads.begin() + b * inter_size, inter_size, route_hidden.begin() + slot * inter_size);
      std::copy_n(d_gate.begin() + b * inter_size, inter_size, route_d_gate.begin() + slot * inter_size);
      std::copy_n(d_up.begin() + b * inter_size, inter_size, route_d_up.begin() + slot * inter_size);
      for (int64_t h = 0; h < hidden_size; ++h) {
        route_d_x[slot * hidden_size + h] = static_cast<T>(d_x_part[b * hidden_size + h]);
      }
    }
  });

  // Phase 2: d_x[n] = shared partial + sum_j partial_j, fixed order.
  parallel_for(num_tokens, resolve_num_threads(num_threads, num_tokens, num_slots * hidden_size), [&](int64_t n) {
    std::vector<double> sum(hidden_size, 0.0);
    if (shape.shared_expert) {
      add_scaled(sum.data(), route_d_x.data() + (num_tokens * top_k + n) * hidden_size, 1.0, hidden_size);
    }
    for (int64_t j = 0; j < top_k; ++j) {
      if (inputs.topk_idx[n * top_k + j] < 0) continue;
      add_scaled(sum.data(), route_d_x.data() + (n * top_k + j) * hidden_size, 1.0, hidden_size);
    }
    for (int64_t h = 0; h < hidden_size; ++h) grads.d_x[n * hidden_size + h] = static_cast<T>(sum[h]);
  });

  // FP8 weight gradients: dy and x per route (what phase 3 reads otherwise), then every factor quantized along its
  // group's routes, per column and 128 routes.
  std::vector<double> fp8_dy, fp8_x;
  if (recipe.weight_gradients_fp8) {
    fp8_dy.resize(num_slots * hidden_size);
    fp8_x.resize(num_slots * hidden_size);
    for (int group_idx = 0; group_idx < plan.num_groups; ++group_idx) {
      for (const Route& route : plan.group_routes[group_idx]) {
        const int64_t slot = RoutePlan::storage_idx(route, shape), row = route.token_idx * hidden_size;
        const double rw = route_weight(shape, inputs, route);
        for (int64_t h = 0; h < hidden_size; ++h) {
          fp8_dy[slot * hidden_size + h] = weight_grad_dy(rw, row + h);
          fp8_x[slot * hidden_size + h] =
              recipe.weight_gradients_from_quantized ? x_quantized[row + h] : static_cast<double>(inputs.x[row + h]);
        }
      }
    }
    parallel_for(plan.num_groups, resolve_num_threads(num_threads, plan.num_groups, num_slots * hidden_size),
                 [&](int64_t group_idx) {
      const std::vector<Route>& routes = plan.group_routes[group_idx];
      std::vector<double> block;
      // Per `width` columns (1, or 128 for the activations with recipe.weight_gradient_activation_blocks).
      const auto along_routes = [&](std::vector<double>& values, int64_t cols, int64_t width) {
        for (size_t begin = 0; begin < routes.size(); begin += kFp8Block) {
          const size_t count = std::min<size_t>(kFp8Block, routes.size() - begin);
          const auto at = [&](size_t b, int64_t c) -> double& {
            return values[RoutePlan::storage_idx(routes[begin + b], shape) * cols + c];
          };
          for (int64_t c0 = 0; c0 < cols; c0 += width) {
            const int64_t w = std::min(width, cols - c0);
            block.resize(count * w);
            for (int64_t c = 0; c < w; ++c)
              for (size_t b = 0; b < count; ++b) block[c * count + b] = at(b, c0 + c);
            quantize_block(block.data(), static_cast<int64_t>(block.size()), 1, p2);
            for (int64_t c = 0; c < w; ++c)
              for (size_t b = 0; b < count; ++b) at(b, c0 + c) = block[c * count + b];
          }
        }
      };
      const int64_t activation_width = recipe.weight_gradient_activation_blocks ? kFp8Block : 1;
      along_routes(fp8_dy, hidden_size, 1);
      along_routes(fp8_x, hidden_size, activation_width);
      along_routes(route_hidden, inter_size, activation_width);
      along_routes(route_d_gate, inter_size, 1);
      along_routes(route_d_up, inter_size, 1);
    });
  }

  // Phase 3: weight gradients, each row summing its group's routes in (token, j) order.
  enum class Tensor { kGate, kUp, kDown };
  struct GradUnit {
    int group_idx;
    Tensor tensor;
    int64_t row_begin, row_end;
  };
  std::vector<GradUnit> grad_units;
  for (int group_idx = 0; group_idx < plan.num_groups; ++group_idx) {
    if (plan.group_routes[group_idx].empty()) continue;  // gradient stays exactly zero
    for (Tensor tensor : {Tensor::kGate, Tensor::kUp, Tensor::kDown}) {
      const int64_t rows = tensor == Tensor::kDown ? hidden_size : inter_size;
      for (int64_t row = 0; row < rows; row += kRowsPerGradUnit) {
        grad_units.push_back({group_idx, tensor, row, std::min(rows, row + kRowsPerGradUnit)});
      }
    }
  }
  const int64_t num_grad_units = static_cast<int64_t>(grad_units.size());
  parallel_for(num_grad_units, resolve_num_threads(num_threads, num_grad_units, plan.num_routes * 3 * expert_size),
               [&](int64_t unit_idx) {
    const GradUnit& unit = grad_units[unit_idx];
    const bool is_shared = unit.group_idx == shape.num_experts;
    const int64_t group_offset = is_shared ? 0 : unit.group_idx * expert_size;
    const int64_t cols = unit.tensor == Tensor::kDown ? inter_size : hidden_size;
    const int64_t num_rows = unit.row_end - unit.row_begin;
    std::vector<double> acc(num_rows * cols, 0.0);
    std::vector<double> acc_abs(magnitudes ? num_rows * cols : 0, 0.0);
    for (const Route& route : plan.group_routes[unit.group_idx]) {
      const int64_t slot = RoutePlan::storage_idx(route, shape);
      if (unit.tensor == Tensor::kDown) {
        // d_W_down[h, :] += dy[h] * h_route
        const double rw = route_weight(shape, inputs, route);
        const int64_t d_out_row = route.token_idx * hidden_size + unit.row_begin;
        const double* hidden_row = route_hidden.data() + slot * inter_size;
        for (int64_t r = 0; r < num_rows; ++r) {
          const double d_y = recipe.weight_gradients_fp8 ? fp8_dy[slot * hidden_size + unit.row_begin + r]
                                                         : weight_grad_dy(rw, d_out_row + r);
          add_scaled(acc.data() + r * cols, hidden_row, d_y, cols);
          if (magnitudes) add_scaled_abs(acc_abs.data() + r * cols, hidden_row, d_y, cols);
        }
      } else {
        // d_W_gate[i, :] += dg[i] * x_route (d_W_up alike with du)
        const double* d_act = (unit.tensor == Tensor::kGate ? route_d_gate : route_d_up).data() + slot * inter_size;
        const auto add_rows = [&](const auto* x_row) {
          for (int64_t r = 0; r < num_rows; ++r) {
            add_scaled(acc.data() + r * cols, x_row, d_act[unit.row_begin + r], cols);
            if (magnitudes) {
              const double* scale = (unit.tensor == Tensor::kGate ? route_d_gate_scale : route_d_up_scale).data() +
                                    slot * inter_size;
              add_scaled_abs(acc_abs.data() + r * cols, x_row, scale[unit.row_begin + r], cols);
            }
          }
        };
        if (recipe.weight_gradients_fp8)
          add_rows(fp8_x.data() + slot * hidden_size);
        else if (recipe.weight_gradients_from_quantized)
          add_rows(x_quantized.data() + route.token_idx * hidden_size);
        else
          add_rows(inputs.x.data() + route.token_idx * hidden_size);
      }
    }
    // The unit's rows of the gradient (and of its magnitudes) of the unit's tensor, shared or routed.
    const auto store = [&](bool magnitude, const std::vector<double>& values) {
      std::vector<T>* dst = nullptr;
      switch (unit.tensor) {
        case Tensor::kGate:
          dst = magnitude ? (is_shared ? &grads.magnitude_shared_gate : &grads.magnitude_expert_gate)
                          : (is_shared ? &grads.d_shared_gate : &grads.d_expert_gate);
          break;
        case Tensor::kUp:
          dst = magnitude ? (is_shared ? &grads.magnitude_shared_up : &grads.magnitude_expert_up)
                          : (is_shared ? &grads.d_shared_up : &grads.d_expert_up);
          break;
        case Tensor::kDown:
          dst = magnitude ? (is_shared ? &grads.magnitude_shared_down : &grads.magnitude_expert_down)
                          : (is_shared ? &grads.d_shared_down : &grads.d_expert_down);
          break;
      }
      T* rows = dst->data() + group_offset + unit.row_begin * cols;
      for (int64_t idx = 0; idx < num_rows * cols; ++idx) rows[idx] = static_cast<T>(values[idx]);
    };
    store(false, acc);
    if (magnitudes) store(true, acc_abs);
  });
  grads.route_d_x = std::move(route_d_x);
  return grads;
}

// -----------------------------------------------------------------------------------------------------
// FP8 weights

template <typename T>
LayerParams<T> quantize_weights(const LayerShape& shape, const LayerParams<T>& params, const Fp8Recipe& recipe) {
  validate_params(shape, params);
  const int64_t inter_size = shape.intermediate, hidden_size = shape.hidden, expert_size = inter_size * hidden_size;
  LayerParams<T> q = params;
  // The matrices [rows, cols] at `parts`, quantized as one [parts * rows, cols] matrix, in place.
  std::vector<double> matrix;
  const auto quantize = [&](std::vector<T*> parts, int64_t rows, int64_t cols) {
    matrix.resize(parts.size() * rows * cols);
    for (size_t p = 0; p < parts.size(); ++p) std::copy_n(parts[p], rows * cols, matrix.begin() + p * rows * cols);
    quantize_matrix(matrix.data(), static_cast<int64_t>(parts.size()) * rows, cols, recipe.power_of_two_scales);
    for (size_t p = 0; p < parts.size(); ++p)
      std::transform(matrix.begin() + p * rows * cols, matrix.begin() + (p + 1) * rows * cols, parts[p],
                     [](double v) { return static_cast<T>(v); });
  };
  for (int e = 0; e < shape.num_experts; ++e) {
    T* gate = q.expert_gate.data() + e * expert_size;
    T* up = q.expert_up.data() + e * expert_size;
    if (recipe.gate_up_fused) {
      quantize({gate, up}, inter_size, hidden_size);
    } else {
      quantize({gate}, inter_size, hidden_size);
      quantize({up}, inter_size, hidden_size);
    }
    quantize({q.expert_down.data() + e * expert_size}, hidden_size, inter_size);
  }
  if (shape.shared_expert) {  // MoeWeights' shared gate and up are never fused
    quantize({q.shared_gate.data()}, inter_size, hidden_size);
    quantize({q.shared_up.data()}, inter_size, hidden_size);
    quantize({q.shared_down.data()}, hidden_size, inter_size);
  }
  return q;
}

// -----------------------------------------------------------------------------------------------------
// Random data

template <typename T>
std::vector<T> random_normal(int64_t count, uint64_t seed, double scale) {
  return normal_vector<T>(count, seed, 100, scale);
}

template <typename T>
LayerParams<T> random_params(const LayerShape& shape, uint64_t seed, double scale) {
  shape.validate();
  const int64_t expert_size = int64_t{shape.intermediate} * shape.hidden;
  LayerParams<T> params;
  // One stream per tensor, so the routed experts do not change when the shared expert is switched off.
  if (shape.shared_expert) {
    params.shared_gate = normal_vector<T>(expert_size, seed, 1, scale);
    params.shared_up = normal_vector<T>(expert_size, seed, 2, scale);
    params.shared_down = normal_vector<T>(expert_size, seed, 3, scale);
  }
  params.expert_gate = normal_vector<T>(expert_size * shape.num_experts, seed, 4, scale);
  params.expert_up = normal_vector<T>(expert_size * shape.num_experts, seed, 5, scale);
  params.expert_down = normal_vector<T>(expert_size * shape.num_experts, seed, 6, scale);
  return params;
}

template <typename T>
LayerInputs<T> random_inputs(const LayerShape& shape, uint64_t seed) {
  shape.validate();
  const int64_t num_tokens = shape.num_tokens();
  LayerInputs<T> inputs;
  inputs.x = normal_vector<T>(num_tokens * shape.hidden, seed, 7, 1.0);
  inputs.topk_idx.resize(num_tokens * shape.top_k);
  inputs.router_weights.resize(num_tokens * shape.top_k);
  Random route_random(seed, 8), logit_random(seed, 9);
  std::vector<int32_t> experts(shape.num_experts);
  std::vector<double> logits(shape.top_k);
  for (int64_t n = 0; n < num_tokens; ++n) {
    // k distinct experts: the first k steps of a Fisher-Yates shuffle.
    for (int e = 0; e < shape.num_experts; ++e) experts[e] = e;
    for (int j = 0; j < shape.top_k; ++j) {
      std::swap(experts[j], experts[j + route_random.below(shape.num_experts - j)]);
      inputs.topk_idx[n * shape.top_k + j] = experts[j];
    }
    double max_logit = -std::numeric_limits<double>::infinity(), sum = 0;
    for (double& logit : logits) max_logit = std::max(max_logit, logit = logit_random.normal());
    for (double& logit : logits) sum += (logit = std::exp(logit - max_logit));
    for (int j = 0; j < shape.top_k; ++j) inputs.router_weights[n * shape.top_k + j] = static_cast<T>(logits[j] / sum);
  }
  return inputs;
}

// -----------------------------------------------------------------------------------------------------
// Explicit instantiations

template void validate_arguments<float>(const LayerShape&, const LayerParams<float>&, const LayerInputs<float>&);
template ForwardTrace<float> forward<float>(const LayerShape&, const LayerParams<float>&, const LayerInputs<float>&,
                                         int, const Fp8Recipe&);
template LayerGrads<float> backward<float>(const LayerShape&, const LayerParams<float>&, const LayerInputs<float>&,
                                       const std::vector<float>&, int, bool, const Fp8Recipe&);
template LayerParams<float> quantize_weights<float>(const LayerShape&, const LayerParams<float>&, const Fp8Recipe&);
template LayerParams<float> random_params<float>(const LayerShape&, uint64_t, double);
template LayerInputs<float> random_inputs<float>(const LayerShape&, uint64_t);
template std::vector<float> random_normal<float>(int64_t, uint64_t, double);

template void validate_arguments<double>(const LayerShape&, const LayerParams<double>&, const LayerInputs<double>&);
template ForwardTrace<double> forward<double>(const LayerShape&, const LayerParams<double>&, const LayerInputs<double>&,
                                         int, const Fp8Recipe&);
template LayerGrads<double> backward<double>(const LayerShape&, const LayerParams<double>&, const LayerInputs<double>&,
                                       const std::vector<double>&, int, bool, const Fp8Recipe&);
template LayerParams<double> quantize_weights<double>(const LayerShape&, const LayerParams<double>&, const Fp8Recipe&);
template LayerParams<double> random_params<double>(const LayerShape&, uint64_t, double);
template LayerInputs<double> random_inputs<double>(const LayerShape&, uint64_t);
template std::vector<double> random_normal<double>(int64_t, uint64_t, double);

}  // namespace mok::reference
