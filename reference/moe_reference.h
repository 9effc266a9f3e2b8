// CPU reference of the whole mixture-of-experts layer (forward and backward), global view over all EP
// ranks. Used by the tests of every GPU stage and by the benchmark's correctness check.
//
// The layer (docs/design.md), for every global token n = rank * tokens_per_rank + t:
//
//   out[n]  = shared(x[n]) + sum_{j=0..k-1} rw[n,j] * expert_{e(n,j)}(x[n])     e(n,j) = -1: masked route
//   mlp(x)  = W_down · h,   h = silu(g_c) ⊙ u_c,   g = W_gate · x,   u = W_up · x
//   g_c     = min(g, L),  u_c = clamp(u, -L, L)    when swiglu_limit L > 0 (clamped SwiGLU)
//   g_c     = g,          u_c = u                  when L == 0 (plain SwiGLU)
//   silu(g) = g * sigmoid(g),  silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
//
// Backward, given d_out [N,H] (per route j; the shared expert is the same with rw = 1 and no d_rw):
//
//   dy       = rw * d_out                    d_W_down += dy ⊗ h              dh = W_down^T · dy
//   dg       = dh ⊙ u_c ⊙ silu'(g_c) ⊙ [g < L]                               (mask is 1 when L == 0)
//   du       = dh ⊙ silu(g_c) ⊙ [-L < u < L]
//   d_W_gate += dg ⊗ x      d_W_up += du ⊗ x      d_x += W_gate^T · dg + W_up^T · du
//   d_rw[n,j] = <d_out[n], y_j[n]>,  y_j = expert_{e(n,j)}(x[n])             (exact also for rw == 0)
//
// Numerics ("T storage, fp64 accumulation"): every dot product and every sum accumulates in double and
// is rounded to T once, where a GPU stage would store its result: g, u, h, y (route_out / shared_out),
// dy, dh, dg, du, each route's d_x partial (W_gate^T dg + W_up^T du), d_rw, and each weight gradient
// (summed over all routes of its expert before the single rounding). Dot products run their index in
// ascending order. The combine sums in fixed order: out = shared_out + rw_0*y_0 + rw_1*y_1 + ..., using
// the stored (T-rounded) y, so out is reproducible from the trace; d_x likewise sums the shared partial
// first, then the routes in j order. Weight gradients sum an expert's routes in ascending (token, j)
// order. For T = double none of the roundings change anything. With an Fp8Recipe, the FP8 layer's activation
// quantizations are applied on top (below, Fp8Recipe).
//
// Determinism: results are bitwise identical run to run and independent of num_threads (work is split
// into units that write disjoint outputs; every reduction has one fixed order inside a unit).
//
// Layouts are row-major; tokens are rank-major (rank r owns global tokens [r*T, (r+1)*T)); expert e
// lives on rank e / local_experts(). With shared_expert == false the shared weight vectors may be empty
// (or full size, ignored); the shared gradients are then zeros of the parameter shape.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mok::reference {

struct LayerShape {
  int num_ranks = 1;          // EP size
  int tokens_per_rank = 0;    // T (0 is allowed: an empty batch)
  int hidden = 0;             // H
  int intermediate = 0;      // I, routed experts and the shared expert alike
  int num_experts = 0;        // E, global
  int top_k = 0;              // k, 1 <= k <= E
  bool shared_expert = true;  // one shared expert of width I
  double swiglu_limit = 0;    // 0: plain SwiGLU; > 0: clamped

  int64_t num_tokens() const { return int64_t{num_ranks} * tokens_per_rank; }  // N
  int local_experts() const { return num_experts / num_ranks; }
  // Throws std::invalid_argument naming the bad field.
  void validate() const;
};

// "N=6 (2 ranks x 3) H=5 I=4 E=4 k=2 shared L=0": for failure messages.
std::string describe(const LayerShape& shape);

template <typename T>
struct LayerParams {                      // row-major
  std::vector<T> shared_gate, shared_up;  // [I, H]
  std::vector<T> shared_down;             // [H, I]
  std::vector<T> expert_gate, expert_up;  // [E, I, H]
  std::vector<T> expert_down;             // [E, H, I]
};

template <typename T>
struct LayerInputs {
  std::vector<T> x;               // [N, H]
  std::vector<int32_t> topk_idx;  // [N, k] global expert ids, -1 = masked
  std::vector<T> router_weights;  // [N, k]
};

template <typename T>
struct ForwardTrace {          // intermediate results the GPU stages are checked against
  std::vector<T> shared_out;   // [N, H] shared(x), zeros without a shared expert
  std::vector<T> route_out;    // [N, k, H] expert_{e(n,j)}(x[n]) not scaled by rw, zeros for masked routes
  std::vector<T> out;          // [N, H]
};

template <typename T>
struct LayerGrads {
  std::vector<T> d_x;                                        // [N, H]
  std::vector<T> d_router_weights;                           // [N, k], 0 for masked routes
  std::vector<T> d_shared_gate, d_shared_up, d_shared_down;  // parameter shapes (zeros without shared)
  std::vector<T> d_expert_gate, d_expert_up, d_expert_down;  // parameter shapes
  // Not a gradient: each route's d_x partial W_gate^T dg + W_up^T du as stored (rounded to T), the terms of
  // d_x's sum (tests size their error budgets by them). [N * (k + 1), H]: routed route (n, j) at n * k + j,
  // the shared expert's of token n at N * k + n; zeros for masked routes and without a shared expert.
  std::vector<T> route_d_x;
  // Not gradients: the scale of each weight gradient element's rounding error where its terms cancel (tests
  // size their budgets by them): the sum over its terms of |dy| |h| (down), |x| |dh u_c| (|silu'(g_c)| +
  // |g_c silu''(g_c)|) (gate: dg's sensitivity to g rounded to bf16, since silu' crosses zero) and
  // |x| |dh| (|silu(g_c)| + |g_c silu'(g_c)|) (up). Parameter shapes like the gradients; filled only when
  // backward() is asked for them, else empty.
  std::vector<T> magnitude_shared_gate, magnitude_shared_up, magnitude_shared_down;
  std::vector<T> magnitude_expert_gate, magnitude_expert_up, magnitude_expert_down;

  // Every gradient with its name, in declaration order: tests compare gradients field by field with it.
  std::vector<std::pair<const char*, const std::vector<T>*>> named() const {
    return {{"d_x", &d_x},
            {"d_router_weights", &d_router_weights},
            {"d_shared_gate", &d_shared_gate},
            {"d_shared_up", &d_shared_up},
            {"d_shared_down", &d_shared_down},
            {"d_expert_gate", &d_expert_gate},
            {"d_expert_up", &d_expert_up},
            {"d_expert_down", &d_expert_down}};
  }
};

// The FP8 layer (docs/design.md, "FP8" and "FP8 backward"): where it quantizes activations to e4m3 with 1 x 128
// block scales (reference/fp8.h), the reference quantizes its own values the same way (rounded to float first),
// and nowhere else. The weights are the caller's: pass them as the FP8 layer multiplies them
// (quantize_weights below), the same values forward and backward (a 128 x 128 block's scale serves its
// transpose). A GPU result then differs from the reference by the summation order and by the few elements whose
// value before a quantization rounded differently (fp32 or bf16 there, fp64 here).
struct Fp8Recipe {
  // Forward (issue 27's layer): x per token, h per route (the down GEMM reads h quantized; y, out as before).
  bool forward = false;
  // dgrads (issue 28): d_out quantized per token; d_hu = W_down^T d_out_q unscaled; dh = T(rw * d_hu);
  // d_rw = <d_hu, h> with h before its quantization (what the SwiGLU-backward epilogue recomputes from g and u;
  // nearer the unquantized layer's d_rw than h_q: docs/design.md, "FP8 backward"); dg, du as in bf16 from dh; the
  // gate/up dgrad reads dg and du quantized per route, each per 1 x 128 (a down-dgrad tile's columns).
  bool dgrads = false;
  // Weight gradients from x and h as the forward's GEMMs read them (quantized: what an FP8 context keeps; needs
  // `forward`), else from the bf16 x and the h before its quantization. Their other factor is dy = T(rw * d_out)
  // with the bf16 d_out, and dg, du before their quantization.
  bool weight_gradients_from_quantized = false;
  // The down weight gradient's dy = T(rw * d_out_q), d_out as the FP8 down dgrad reads it (quantized per token per
  // 1 x 128; needs `dgrads`), else from the bf16 d_out: what pulling d_out only as FP8 rows would leave the bf16
  // weight gradient (issue 28 item 1 at EP > 1; docs/design.md, "FP8 backward").
  bool dy_from_quantized_d_out = false;
  // FP8 weight gradients (issue 28 item 2's second way, DeepSeek-V3's): both factors of every weight gradient (the
  // values above) quantized along the routes: per column, per 128 consecutive routes of the expert in (token, j)
  // order, which is the schedule's row order at EP = 1 (at EP > 1 the schedule interleaves the source ranks, so
  // the GPU's blocks group other routes). Otherwise the weight gradients are bf16 GEMMs of those values.
  bool weight_gradients_fp8 = false;
  // With weight_gradients_fp8: the activation factor of each weight gradient (x of gate/up's, h of down's) quantized
  // per 128 routes x 128 columns instead of per column (the layer's default; per column with
  // MoeOptions::fp8_weight_gradient_columns), the other per column.
  bool weight_gradient_activation_blocks = false;
  // quantize_weights: the gate and up weights of an expert as one [2I, H] matrix (MoeWeights' fused form), its
  // 128 x 128 blocks running over both (a block straddles them when I % 128 != 0); otherwise each has its own.
  bool gate_up_fused = false;
  bool power_of_two_scales = false;  // every activation scale rounded up to a power of two
};

// The weights as the FP8 layer multiplies them: each expert's (and the shared expert's) matrices quantized per
// 128 x 128 block (gate and up as one [2I, H] matrix per expert when recipe.gate_up_fused), as T.
template <typename T>
LayerParams<T> quantize_weights(const LayerShape& shape, const LayerParams<T>& params, const Fp8Recipe& recipe);

// Checks every vector size and expert id: std::invalid_argument for shapes/sizes, std::out_of_range
// (naming the token index, slot and id) for an id < -1 or >= E. forward/backward call it first.
template <typename T>
void validate_arguments(const LayerShape& shape, const LayerParams<T>& params, const LayerInputs<T>& inputs);

// num_threads: 0 = std::thread::hardware_concurrency(); results do not depend on it.
template <typename T>
ForwardTrace<T> forward(const LayerShape& shape, const LayerParams<T>& params, const LayerInputs<T>& inputs,
                        int num_threads = 0, const Fp8Recipe& recipe = {});

template <typename T>
LayerGrads<T> backward(const LayerShape& shape, const LayerParams<T>& params, const LayerInputs<T>& inputs,
                       const std::vector<T>& d_out /* [N, H] */, int num_threads = 0, bool magnitudes = false,
                       const Fp8Recipe& recipe = {});

// Deterministic random data (own generator: same values on every platform).
// Weights ~ normal(0, scale); shared weights are empty when shape.shared_expert is false.
template <typename T>
LayerParams<T> random_params(const LayerShape& shape, uint64_t seed, double scale);
// x ~ normal(0, 1); each token routes to k distinct experts drawn uniformly; router weights are the
// softmax over the k routes of normal(0, 1) logits (positive, sum to 1). No masked routes.
template <typename T>
LayerInputs<T> random_inputs(const LayerShape& shape, uint64_t seed);
// count values ~ normal(0, scale), e.g. a random d_out.
template <typename T>
std::vector<T> random_normal(int64_t count, uint64_t seed, double scale = 1.0);

}  // namespace mok::reference
