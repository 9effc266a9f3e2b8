// Host-side argument types and validation of the MoE layer (include/mok/moe.h): every error names the
// argument and says what was expected and what was given.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "mok/moe.h"
#include "src/host/check.h"
#include "src/host/moe_args.h"
#include "src/host/nccl_setup.h"
#include "src/device/schedule/placement.h"
#include "src/host/moe_layouts.h"

namespace mok {
using detail::require;
namespace {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bf16";
    case DType::kFloat32: return "fp32";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat8E4M3: return "e4m3";
  }
  return "unknown dtype";
}

std::string shape_text(std::initializer_list<int64_t> shape) {
  std::string text = "[";
  for (int64_t d : shape) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

}  // namespace

TensorRef::TensorRef(const void* data_, DType dtype_, std::initializer_list<int64_t> shape_)
    : data(data_), dtype(dtype_), ndim(static_cast<int>(shape_.size())) {
  require(shape_.size() <= kMaxDims, "TensorRef: at most " + std::to_string(kMaxDims) + " dimensions");
  int d = 0;
  for (int64_t extent : shape_) shape[d++] = extent;
}

std::string TensorRef::describe() const {
  if (data == nullptr && ndim == 0) return "empty";
  std::string text = std::string(dtype_name(dtype)) + " [";
  for (int d = 0; d < ndim; ++d) text += (d ? ", " : "") + std::to_string(shape[d]);
  return text + "]";
}

void MoeShape::validate() const {
  routing().validate();
  // Multiples of 64: the GEMMs' K step and output store box (their last output tile may be partial). At most
  // kMaxFeatures: int32 sums such as 2 * intermediate stay far from overflowing, and it is beyond any model's.
  require(hidden > 0 && hidden % 64 == 0 && hidden <= kMaxFeatures,
          "MoeShape.hidden must be a positive multiple of 64 up to " + std::to_string(kMaxFeatures) + ", got " +
              std::to_string(hidden));
  require(intermediate > 0 && intermediate % 64 == 0 && intermediate <= kMaxFeatures,
          "MoeShape.intermediate must be a positive multiple of 64 up to " + std::to_string(kMaxFeatures) +
              ", got " + std::to_string(intermediate));
  // Also rejects NaN and infinity (no limit is 0, not infinity; the GEMMs refuse a non-finite one mid-call).
  require(std::isfinite(swiglu_limit) && swiglu_limit >= 0,
          "MoeShape.swiglu_limit must be a finite number >= 0 (0: plain SwiGLU), got " + std::to_string(swiglu_limit));
}

namespace detail {

// `name` must be a tensor of `dtype` and `shape` on device `device`, its data aligned to `alignment` bytes.
void check_tensor(const TensorRef& t, const char* name, DType dtype, std::initializer_list<int64_t> shape, int device,
                  size_t alignment) {
  const std::string expected = std::string(dtype_name(dtype)) + " " + shape_text(shape);
  int64_t elements = 1;
  for (int64_t extent : shape) elements *= extent;
  // A tensor without elements (a call of 0 tokens) may have any pointer, null included (PyTorch's).
  require(t.data != nullptr || (elements == 0 && t.ndim > 0),
          std::string(name) + ": expected " + expected + ", got an empty tensor");
  bool same = t.dtype == dtype && t.ndim == static_cast<int>(shape.size());
  int d = 0;
  for (int64_t extent : shape) same = same && t.shape[d++] == extent;
  require(same, std::string(name) + ": expected " + expected + ", got " + t.describe());
  if (elements == 0) return;  // nothing is read or written through it
  require(reinterpret_cast<uintptr_t>(t.data) % alignment == 0,
          std::string(name) + ": data must be " + std::to_string(alignment) + "-byte aligned");
  cudaPointerAttributes attributes{};
  const cudaError_t error = cudaPointerGetAttributes(&attributes, t.data);
  if (error != cudaSuccess) cudaGetLastError();
  require(error == cudaSuccess &&
              (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) &&
              attributes.device == device,
          std::string(name) + ": must be device memory of the rank's GPU " + std::to_string(device));
}

// The FP8 form of the weights (MoeOptions::precision kFP8): e4m3 of the bf16 shapes, with the block scales of each.
void check_fp8_weights(const MoeWeights& w, const MoeShape& s, int device) {
  const int64_t e = s.local_experts(), h = s.hidden, i = s.intermediate;
  const auto blocks = [](int64_t extent) { return (extent + 127) / 128; };
  const DType q = DType::kFloat8E4M3, f = DType::kFloat32;
  if (w.expert_up.empty()) {
    check_tensor(w.expert_gate, "weights.expert_gate (fused gate and up, FP8)", q, {e, 2 * i, h}, device, 16);
    check_tensor(w.expert_gate_scales, "weights.expert_gate_scales", f, {e, blocks(2 * i), blocks(h)}, device, 4);
    require(w.expert_up_scales.empty(), "weights.expert_up_scales: must be empty with fused gate and up weights");
  } else {
    check_tensor(w.expert_gate, "weights.expert_gate (FP8)", q, {e, i, h}, device, 16);
    check_tensor(w.expert_up, "weights.expert_up (FP8)", q, {e, i, h}, device, 16);
    check_tensor(w.expert_gate_scales, "weights.expert_gate_scales", f, {e, blocks(i), blocks(h)}, device, 4);
    check_tensor(w.expert_up_scales, "weights.expert_up_scales", f, {e, blocks(i), blocks(h)}, device, 4);
  }
  check_tensor(w.expert_down, "weights.expert_down (FP8)", q, {e, h, i}, device, 16);
  check_tensor(w.expert_down_scales, "weights.expert_down_scales", f, {e, blocks(h), blocks(i)}, device, 4);
  if (s.shared_expert) {
    check_tensor(w.shared_gate, "weights.shared_gate (FP8)", q, {i, h}, device, 16);
    check_tensor(w.shared_up, "weights.shared_up (FP8)", q, {i, h}, device, 16);
    check_tensor(w.shared_down, "weights.shared_down (FP8)", q, {h, i}, device, 16);
    check_tensor(w.shared_gate_scales, "weights.shared_gate_scales", f, {blocks(i), blocks(h)}, device, 4);
    check_tensor(w.shared_up_scales, "weights.shared_up_scales", f, {blocks(i), blocks(h)}, device, 4);
    check_tensor(w.shared_down_scales, "weights.shared_down_scales", f, {blocks(h), blocks(i)}, device, 4);
  }
}

// The transposed FP8 copies the FP8 backward's dgrads read (MoeWeights::expert_gate_up_t and the rest).
void check_fp8_transposed_weights(const MoeWeights& w, const MoeShape& s, int device) {
  const int64_t e = s.local_experts(), h = s.hidden, i = s.intermediate, hb = (h + 127) / 128, ib = i / 128;
  const DType q = DType::kFloat8E4M3, f = DType::kFloat32;
  const char* how = " (the FP8 backward's transposed weights: quantize_weights_fp8's out_transposed)";
  check_tensor(w.expert_gate_up_t, (std::string("weights.expert_gate_up_t") + how).c_str(), q, {e, h, 2 * i}, device,
               16);
  check_tensor(w.expert_down_t, (std::string("weights.expert_down_t") + how).c_str(), q, {e, i, h}, device, 16);
  check_tensor(w.expert_gate_up_t_scales, "weights.expert_gate_up_t_scales", f, {e, hb, 2 * ib}, device, 4);
  check_tensor(w.expert_down_t_scales, "weights.expert_down_t_scales", f, {e, ib, hb}, device, 4);
  if (s.shared_expert) {
    check_tensor(w.shared_gate_up_t, (std::string("weights.shared_gate_up_t") + how).c_str(), q, {h, 2 * i}, device,
                 16);
    check_tensor(w.shared_down_t, (std::string("weights.shared_down_t") + how).c_str(), q, {i, h}, device, 16);
    check_tensor(w.shared_gate_up_t_scales, "weights.shared_gate_up_t_scales", f, {hb, 2 * ib}, device, 4);
    check_tensor(w.shared_down_t_scales, "weights.shared_down_t_scales", f, {ib, hb}, device, 4);
  } else {
    for (const auto& [t, name] : {std::pair{&w.shared_gate_up_t, "weights.shared_gate_up_t"},
                                  std::pair{&w.shared_down_t, "weights.shared_down_t"},
                                  std::pair{&w.shared_gate_up_t_scales, "weights.shared_gate_up_t_scales"},
                                  std::pair{&w.shared_down_t_scales, "weights.shared_down_t_scales"}})
      require(t->empty(), std::string(name) + ": must be empty without a shared expert, got " + t->describe());
  }
}

void check_weights(const MoeWeights& w, const MoeShape& s, int device) {
  const int64_t e = s.local_experts(), h = s.hidden, i = s.intermediate;
  for (const TensorRef* scales : {&w.expert_gate_scales, &w.expert_up_scales, &w.expert_down_scales,
                                  &w.shared_gate_scales, &w.shared_up_scales, &w.shared_down_scales})
    require(scales->empty(), "weights: block scales are for MoeOptions::precision kFP8; this workspace is bf16");
  for (const TensorRef* t : {&w.expert_gate_up_t, &w.expert_down_t, &w.shared_gate_up_t, &w.shared_down_t,
                             &w.expert_gate_up_t_scales, &w.expert_down_t_scales, &w.shared_gate_up_t_scales,
                             &w.shared_down_t_scales})
    require(t->empty(), "weights: the transposed FP8 weights (expert_gate_up_t, ...) are for MoeOptions::precision "
                        "kFP8; this workspace is bf16");
  if (w.expert_up.empty()) {
    check_tensor(w.expert_gate, "weights.expert_gate (fused gate and up)", DType::kBFloat16, {e, 2 * i, h}, device, 16);
  } else {
    check_tensor(w.expert_gate, "weights.expert_gate", DType::kBFloat16, {e, i, h}, device, 16);
    check_tensor(w.expert_up, "weights.expert_up", DType::kBFloat16, {e, i, h}, device, 16);
  }
  check_tensor(w.expert_down, "weights.expert_down", DType::kBFloat16, {e, h, i}, device, 16);
  if (s.shared_expert) {
    check_tensor(w.shared_gate, "weights.shared_gate", DType::kBFloat16, {i, h}, device, 16);
    check_tensor(w.shared_up, "weights.shared_up", DType::kBFloat16, {i, h}, device, 16);
    check_tensor(w.shared_down, "weights.shared_down", DType::kBFloat16, {h, i}, device, 16);
  }
}

int call_tokens(const TensorRef& t, const char* name, const MoeShape& s) {
  require(t.ndim >= 1, std::string(name) + ": expected a tensor [T, ...] of the call's T tokens, got " + t.describe());
  const int64_t tokens = t.shape[0];
  require(tokens >= 0 && tokens <= s.num_tokens,
          std::string(name) + ": " + std::to_string(tokens) + " tokens, but the workspace takes at most " +
              "MoeShape.num_tokens = " + std::to_string(s.num_tokens) + " per call (got " + t.describe() + ")");
  return static_cast<int>(tokens);
}

void check_routing_inputs(const RankForward& f, const MoeShape& s, int device) {
  const int64_t t = call_tokens(f.topk_idx, "topk_idx", s), k = s.top_k;
  const DType index_dtype = f.topk_idx.dtype == DType::kInt64 ? DType::kInt64 : DType::kInt32;
  check_tensor(f.topk_idx, "topk_idx", index_dtype, {t, k}, device, index_dtype == DType::kInt64 ? 8 : 4);
}

void check_recompute_inputs(const RankForward& f, const MoeShape& s, int device, Precision precision) {
  check_tensor(f.x, "x", DType::kBFloat16, {call_tokens(f.x, "x", s), s.hidden}, device, 16);
  require(f.weights != nullptr, "weights: must not be null");
  if (precision == Precision::kFP8)
    check_fp8_weights(*f.weights, s, device);
  else
    check_weights(*f.weights, s, device);
}

namespace {

// An optional gradient: empty, or bf16 / fp32 of `shape` on `device`, 16-byte aligned (the weight-gradient
// GEMM's TMA stores); kAccumulate adds into fp32 only.
void check_weight_grad(const WeightGrad& g, const char* name, std::initializer_list<int64_t> shape, int device) {
  if (g.grad.empty()) return;
  require(g.mode == GradMode::kWrite || g.mode == GradMode::kAccumulate,
          std::string(name) + ": mode must be GradMode::kWrite or kAccumulate, got " +
              std::to_string(static_cast<int>(g.mode)));
  require(g.grad.dtype == DType::kBFloat16 || g.grad.dtype == DType::kFloat32,
          std::string(name) + ": expected a bf16 or fp32 gradient, got " + g.grad.describe());
  require(g.mode != GradMode::kAccumulate || g.grad.dtype == DType::kFloat32,
          std::string(name) + ": GradMode::kAccumulate needs an fp32 gradient (Megatron's main_grad), got " +
              g.grad.describe());
  check_tensor(g.grad, name, g.grad.dtype, shape, device, 16);
}

// Separate gate and up gradients come from one GEMM over [d_g, d_u] (its output split in two): both or
// neither, with one dtype and one mode.
void check_gate_up_pair(const WeightGrad& gate, const WeightGrad& up, const char* gate_name, const char* up_name) {
  require(gate.grad.empty() == up.grad.empty(),
          std::string(up_name) + ": must be given exactly when " + gate_name + " is (one GEMM computes both), got " +
              up.grad.describe() + " with " + gate.grad.describe());
  if (gate.grad.empty()) return;
  require(gate.grad.dtype == up.grad.dtype && gate.mode == up.mode,
          std::string(up_name) + ": must have " + gate_name + "'s dtype and mode (one GEMM computes both), got " +
              up.grad.describe() + (up.mode == GradMode::kAccumulate ? " accumulated" : " written") + " vs " +
              gate.grad.describe() + (gate.mode == GradMode::kAccumulate ? " accumulated" : " written"));
}

void check_weight_grads(const MoeWeightGrads& g, const MoeWeights& w, const MoeShape& s, int device) {
  const int64_t e = s.local_experts(), h = s.hidden, i = s.intermediate;
  if (w.expert_up.empty()) {
    check_weight_grad(g.expert_gate, "weight_grads.expert_gate (fused gate and up)", {e, 2 * i, h}, device);
    require(g.expert_up.grad.empty(), "weight_grads.expert_up: must be empty with fused gate/up weights (the "
                                      "gradient of weights.expert_gate [E_local, 2I, H] holds both), got " +
                                          g.expert_up.grad.describe());
  } else {
    check_weight_grad(g.expert_gate, "weight_grads.expert_gate", {e, i, h}, device);
    check_weight_grad(g.expert_up, "weight_grads.expert_up", {e, i, h}, device);
    check_gate_up_pair(g.expert_gate, g.expert_up, "weight_grads.expert_gate", "weight_grads.expert_up");
  }
  check_weight_grad(g.expert_down, "weight_grads.expert_down", {e, h, i}, device);
  if (s.shared_expert) {
    check_weight_grad(g.shared_gate, "weight_grads.shared_gate", {i, h}, device);
    check_weight_grad(g.shared_up, "weight_grads.shared_up", {i, h}, device);
    check_gate_up_pair(g.shared_gate, g.shared_up, "weight_grads.shared_gate", "weight_grads.shared_up");
    check_weight_grad(g.shared_down, "weight_grads.shared_down", {h, i}, device);
  } else {
    for (const auto& [grad, name] : {std::pair{&g.shared_gate, "weight_grads.shared_gate"},
                                     std::pair{&g.shared_up, "weight_grads.shared_up"},
                                     std::pair{&g.shared_down, "weight_grads.shared_down"}})
      require(grad->grad.empty(),
              std::string(name) + ": must be empty without a shared expert, got " + grad->grad.describe());
  }
}

}  // namespace

void check_backward_inputs(const RankBackward& b, const MoeShape& s, int device, Precision precision) {
  const int64_t t = call_tokens(b.topk_idx, "topk_idx", s), k = s.top_k, h = s.hidden;
  check_tensor(b.x, "x", DType::kBFloat16, {t, h}, device, 16);
  const DType index_dtype = b.topk_idx.dtype == DType::kInt64 ? DType::kInt64 : DType::kInt32;
  check_tensor(b.topk_idx, "topk_idx", index_dtype, {t, k}, device, index_dtype == DType::kInt64 ? 8 : 4);
  check_tensor(b.router_weights, "router_weights", DType::kFloat32, {t, k}, device, 4);
  require(b.weights != nullptr, "weights: must not be null");
  if (precision == Precision::kFP8) {
    check_fp8_weights(*b.weights, s, device);
    check_fp8_transposed_weights(*b.weights, s, device);
  } else {
    check_weights(*b.weights, s, device);
  }
  check_tensor(b.d_out, "d_out", DType::kBFloat16, {t, h}, device, 16);
  check_tensor(b.d_x, "d_x", DType::kBFloat16, {t, h}, device, 16);
  check_tensor(b.d_router_weights, "d_router_weights", DType::kFloat32, {t, k}, device, 4);
  require(b.weight_grads != nullptr, "weight_grads: must not be null (leave a WeightGrad empty to skip it)");
  check_weight_grads(*b.weight_grads, *b.weights, s, device);
}

void check_layer_inputs(const RankForward& f, const MoeShape& s, int device, Precision precision) {
  const int64_t t = call_tokens(f.topk_idx, "topk_idx", s), k = s.top_k, h = s.hidden;
  check_tensor(f.x, "x", DType::kBFloat16, {t, h}, device, 16);
  check_tensor(f.router_weights, "router_weights", DType::kFloat32, {t, k}, device, 4);
  check_tensor(f.out, "out", DType::kBFloat16, {t, h}, device, 16);
  require(f.weights != nullptr, "weights: must not be null");
  if (precision == Precision::kFP8)
    check_fp8_weights(*f.weights, s, device);
  else
    check_weights(*f.weights, s, device);
}

}  // namespace detail
namespace detail {

bool context_keeps_gate_up(const MoeOptions& options) {
  return options.keep_gate_up && (options.precision != Precision::kFP8 || options.backward);
}

int64_t context_bytes(const MoeShape& s, bool keep_gate_up, int64_t schedule_elements, int64_t ring_rows,
                      int64_t padded_tokens, bool fp8) {
  return context_layout(s, keep_gate_up, schedule_elements, ring_rows, padded_tokens, fp8).buffers.total_bytes();
}

int64_t choose_ring_rows(const MoeShape& s, const MoeOptions& options, int64_t capacity_rows,
                         int64_t schedule_elements, int64_t padded_tokens) {
  const int64_t budget = options.context_budget_bytes;
  require(budget >= 0, "MoeOptions.context_budget_bytes must be >= 0 (0: no budget), got " + std::to_string(budget));
  if (options.fused.macrobatch_rows > 0) return std::min<int64_t>(options.fused.macrobatch_rows, capacity_rows);
  if (options.path != ForwardPath::kFused) return capacity_rows;
  // The balanced share: the rows balanced routing brings a rank (load factor 1, with the worst padding),
  // rounded down to the megakernel's 128-row units. A capacity within it is kept whole (EP = 1: the default
  // capacity is the share); above it (EP > 1: the load factor's headroom for imbalance) the ring stops at the
  // share, and the rows an imbalanced step schedules past it are replayed by the backward.
  // The FP8 backward keeps g, u and h or recomputes them from the context's FP8 x rows: its ring is every row, the
  // capacity.
  const bool every_row = options.precision == Precision::kFP8 && options.backward;
  const int64_t balanced = expected_load_capacity_rows(s.routing(), options.schedule.tile_m, 1.0);
  const int64_t share = std::max<int64_t>(128, balanced / 128 * 128);
  const int64_t limit = every_row || balanced >= capacity_rows ? capacity_rows : std::min(capacity_rows, share);
  // The layout make_context allocates, FP8's included (its rows cost other bytes than bf16's).
  const auto bytes = [&](int64_t rows) {
    return context_bytes(s, context_keeps_gate_up(options), schedule_elements, rows, padded_tokens,
                         options.precision == Precision::kFP8);
  };
  if (budget == 0 || bytes(limit) <= budget) return limit;
  require(!every_row, "MoeOptions.context_budget_bytes " + std::to_string(budget) + " is below the " +
                          std::to_string(bytes(limit)) + " bytes of the context that MoeOptions.precision kFP8 with "
                          "MoeOptions.backward keeps (every one of the " + std::to_string(capacity_rows) +
                          " capacity rows): raise it, or 0 for no budget");
  const int64_t smallest = std::min<int64_t>(128, limit);  // the ring's unit; a smaller capacity is kept whole
  const int64_t per_128_rows = bytes(128) - bytes(0);      // the layout is linear in rows but for its rounding
  int64_t ring = std::min<int64_t>(std::max<int64_t>(budget - bytes(0), 0) / per_128_rows * 128, limit / 128 * 128);
  while (ring > 0 && bytes(ring) > budget) ring -= 128;  // the 256-byte rounding of each buffer
  require(ring >= smallest, "MoeOptions.context_budget_bytes " + std::to_string(budget) + " leaves no " +
                                std::to_string(smallest) + "-row ring: one needs " + std::to_string(bytes(smallest)) +
                                " bytes for this shape");
  return ring;
}

void validate_setup_timeout(double setup_timeout_s) {
  require_seconds(setup_timeout_s, "MoeOptions.setup_timeout_s");
}

WorkspacePlan plan_workspace(const MoeShape& shape, const MoeOptions& options) {
  shape.validate();
  options.schedule.validate(shape.routing());
  validate_setup_timeout(options.setup_timeout_s);
  const int tile_m = options.schedule.tile_m;
  require(tile_m == 64 || tile_m == 128, "MoeOptions.schedule.tile_m must be 64 or 128 (the GEMM's row tiles), got " +
                                             std::to_string(tile_m));
  WorkspacePlan plan;
  plan.capacity_rows = resolved_capacity_rows(shape.routing(), options.schedule);
  require(plan.capacity_rows % tile_m == 0, "MoeOptions.schedule.capacity_rows must be a multiple of tile_m (" +
                                                std::to_string(tile_m) + "), got " + std::to_string(plan.capacity_rows));
  plan.padded_tokens = schedule::round_up(shape.num_tokens, tile_m);
  const FusedOptions& fused = options.fused;
  require(fused.macrobatch_rows >= 0 && fused.macrobatch_rows % 128 == 0,
          "MoeOptions.fused.macrobatch_rows must be 0 (the capacity) or a positive multiple of 128, got " +
              std::to_string(fused.macrobatch_rows));
  // At most 2^30: the task order adds it to ring rows (< 2^30) in int32.
  require(fused.minibatch_rows > 0 && fused.minibatch_rows % 128 == 0 && fused.minibatch_rows <= (1 << 30),
          "MoeOptions.fused.minibatch_rows must be a positive multiple of 128 up to 2^30, got " +
              std::to_string(fused.minibatch_rows));
  // The upper bound needs the megakernel's grid: the constructor checks it with its device queries.
  require(fused.comm_ctas >= 0, "MoeOptions.fused.comm_ctas must be >= 0 (0: the producer warps copy), got " +
                                    std::to_string(fused.comm_ctas));
  require(fused.timeline_records >= 0 && fused.timeline_records <= FusedOptions::kMaxTimelineRecords,
          "MoeOptions.fused.timeline_records must be in [0, " + std::to_string(FusedOptions::kMaxTimelineRecords) +
              "] (records per CTA and track), got " + std::to_string(fused.timeline_records));
  require(!fused.backward_megakernel || (options.path == ForwardPath::kFused && options.backward),
          "MoeOptions.fused.backward_megakernel needs ForwardPath::kFused and MoeOptions.backward = true (it is the "
          "fused path's backward)");
  require(options.precision == Precision::kBF16 || options.precision == Precision::kFP8,
          "MoeOptions.precision must be kBF16 or kFP8, got " + std::to_string(static_cast<int>(options.precision)));
  if (options.precision == Precision::kFP8) {
    // The FP8 backward (docs/design.md, "FP8 backward"): [d_g, d_u] quantized per 1 x 128 as the gate/up dgrad's A
    // and [W_gate; W_up]^T as its B need I's 128-column blocks to be each half's own.
    require(!options.backward || shape.intermediate % 128 == 0,
            "MoeOptions.precision kFP8 with MoeOptions.backward needs MoeShape.intermediate a multiple of 128, got " +
                std::to_string(shape.intermediate) + " (or set MoeOptions.backward = false: the forward takes any I)");
    require(!options.gather_rows, "MoeOptions.precision kFP8 does not gather rows: set MoeOptions.gather_rows = false");
    require(!options.scatter_rows,
            "MoeOptions.precision kFP8 does not scatter rows: set MoeOptions.scatter_rows = false");
  }
  require(options.precision == Precision::kFP8 || !options.fp8_power_of_two_scales,
          "MoeOptions.fp8_power_of_two_scales is for precision kFP8 (the activations' scales), got precision kBF16");
  require(!options.fp8_weight_gradient_columns ||
              (options.precision == Precision::kFP8 && !options.bf16_weight_gradients),
          "MoeOptions.fp8_weight_gradient_columns is for FP8 weight gradients (precision kFP8, bf16_weight_gradients "
          "false), got precision " + std::string(options.precision == Precision::kFP8 ? "kFP8" : "kBF16") +
              ", bf16_weight_gradients " + (options.bf16_weight_gradients ? "true" : "false"));
  const int64_t slots = task_slot_bound(shape, plan.capacity_rows, plan.padded_tokens);
  require(slots < std::numeric_limits<int32_t>::max(),
          "MoeShape: its GEMMs could take up to " + std::to_string(slots) +
              " task slots, and slots are int32: fewer tokens, a smaller hidden or intermediate, or a smaller "
              "capacity (ScheduleOptions.load_factor, capacity_rows)");
  const RoutingShape routing = shape.routing();
  const int64_t schedule_elements = schedule::ScheduleLayout::make(routing.ep_size, routing.local_experts(),
                                                                   routing.routes_per_rank(), plan.capacity_rows)
                                        .total_elements;
  plan.ring_rows = choose_ring_rows(shape, options, plan.capacity_rows, schedule_elements, plan.padded_tokens);
  require(options.path == ForwardPath::kFused || plan.ring_rows == plan.capacity_rows,
          "MoeOptions.fused.macrobatch_rows below the capacity needs ForwardPath::kFused (the unfused path holds "
          "every row at once)");
  // The FP8 backward reads g, u and h from the context, or recomputes them from its FP8 x rows: every row (rows past
  // a ring would need the bf16 recompute's path, which FP8 does not have).
  require(options.precision != Precision::kFP8 || !options.backward || plan.ring_rows == plan.capacity_rows,
          "MoeOptions.precision kFP8 with MoeOptions.backward needs a context that keeps every row, but the ring is " +
              std::to_string(plan.ring_rows) + " of " + std::to_string(plan.capacity_rows) +
              " capacity rows: set MoeOptions.fused.macrobatch_rows to the capacity, context_budget_bytes to 0, or "
              "ForwardPath::kUnfused");
  return plan;
}

}  // namespace detail
}  // namespace mok
