// MoeWorkspace's backward and recompute_forward_context (include/mok/moe.h; docs/design.md, "Backward"):
// stage kernels one after another (the unfused twin of a backward megakernel to come). The row kernels live
// in src/device/kernels/backward_row_kernels.cuh, the token-side epilogue is the forward's
// (src/device/combine/push_rows.cuh); the GEMMs go through mok::expert_gemm and mok::weight_grad_gemm.
//
// Phases over the ranks of a call (every rank's kernels of one phase before any rank's next one, the order
// virtual ranks need; sync in docs/sync_protocol.md, "Backward"):
//   publish   x, d_out, router weights -> symmetric buffers; barrier arrive; the shared expert's backward
//   experts   barrier wait; pull rows; g/u recompute (rows the context does not keep); down dgrad (+ SwiGLU
//             backward, d_rw partials); gate/up dgrad; push d_x_route rows and d_rw; barrier arrive; the
//             routed weight gradients
//   epilogue  barrier wait; d_x = shared dx + sum_j d_x_route_j; d_router_weights
#include "mok/moe.h"

#include <stdexcept>
#include <string>

#include "mok/expert_gemm.h"
#include "mok/fp8.h"
#include "mok/weight_grad_gemm.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/kernels/backward_row_kernels.cuh"
#include "src/device/schedule/placement.h"
#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "src/host/moe_args.h"
#include "src/host/moe_fused_backward.h"
#include "src/host/moe_state.h"
#include "src/host/quantize_fp8.h"

namespace mok {
using detail::DeviceGuard;
using detail::kBf16Bytes;
using detail::kFloatBytes;
using detail::require;
using detail::row_kernel_ctas;

namespace {

// The rows one MLP's backward GEMMs run over: the routed experts' schedule (capacity rows) or the shared
// expert's one-expert schedule (the rank's padded tokens).
struct GemmRows {
  int local_experts;
  const int32_t* expert_counts;
  const int32_t* expert_row_offsets;
  const int32_t* scheduled_rows;
  int64_t rows_allocated;
};

// One MLP's backward over `rows` (all buffers [rows_allocated, ...], bf16 unless noted):
//   recompute    g | u -> gate_up and h -> hidden from x                      (kSwiGLU + gate_up_out)
//   down dgrad   d_hu = d_out · W_down, d_h = row_weight * d_hu; d_g | d_u -> d_gate_up; d_rw partials
//   gate/up      d_x = [d_g, d_u] · [W_gate; W_up]                           (kStore, B read MN-major)
//   wgrad down   dW_down_e = sum dyᵀ h                                        (weight_grad_gemm)
//   wgrad g/u    dW_gate/up_e = sum d_{g,u}ᵀ x
struct MlpBackward {
  GemmRows rows;
  const void* x;              // [rows, H]
  const void* d_out;          // [rows, H]: the down dgrad's A, unscaled
  const void* dy;             // [rows, H]: the down weight gradient's A (row_weight * d_out, rounded)
  const float* row_weight;    // fp32 [rows], or null: 1 (the shared expert)
  const void* gate;           // [E, I, H], or gate and up fused [E, 2I, H] when `up` is null
  const void* up;             // [E, I, H] or null
  const void* down;           // [E, H, I]
  int32_t recompute_from;     // first recomputed row (a multiple of 128): the rows below it were copied from
                              // the context's kept g | u and h
  void* hidden;               // [rows, I]
  void* gate_up;              // [rows, 2I]
  void* d_gate_up;            // [rows, 2I]
  float* row_partials;        // fp32 [rows, n_blocks]
  void* d_x;                  // [rows, H]
  const WeightGrad* grad_gate;  // grad_up null or empty: fused (gate holds both), or none wanted
  const WeightGrad* grad_up;
  const WeightGrad* grad_down;
  WaitBound waits;            // the rank's status word and timeout
  // MoeOptions::precision kFP8 (docs/design.md, "FP8 backward"); the three GEMMs above in e4m3 from these A
  // operands (e4m3 with scales [ceil(k/128), rows]) and the weights' FP8 forms; x, hidden, gate_up, d_gate_up
  // and the weight gradients stay bf16.
  struct Fp8 {
    bool on = false;
    const void* x = nullptr;            // the recompute's A: FP8 rows (src/host/quantize_fp8.h), x_row_bytes apart
    int64_t x_row_bytes = 0;
    const float* x_scales = nullptr;
    const float* gate_scales = nullptr;  // the forward weights' block scales (up: null with fused weights)
    const float* up_scales = nullptr;
    void* d_out = nullptr;              // the down dgrad's A, quantized from `d_out` (quantize_d_out)
    float* d_out_scales = nullptr;
    const void* down_t = nullptr;       // W_down^T [E, I, H] and its scales
    const float* down_t_scales = nullptr;
    void* d_gate_up = nullptr;          // the gate/up dgrad's A, written quantized by the down dgrad's epilogue
    float* d_gate_up_scales = nullptr;
    const void* gate_up_t = nullptr;    // [W_gate; W_up]^T [E, H, 2I] and its scales
    const float* gate_up_t_scales = nullptr;
    const int32_t* rows_used = nullptr;  // the routed rows' count (scheduled_rows); null: every row (shared)
    bool power_of_two = false;
    // MoeWorkspace::fp8_weight_gradients(): both weight gradients in FP8 from these buffers (BackwardScratch's
    // wgrad_*), each operand transposed and quantized per column per 128 rows of an expert before its GEMM.
    bool weight_gradients = false;
    // x and h (each GEMM's b) per 128 rows x 128 columns (unless MoeOptions::fp8_weight_gradient_columns).
    bool activation_blocks = false;
    int32_t* wgrad_offsets = nullptr;
    void* wgrad_a = nullptr;
    float* wgrad_a_scales = nullptr;
    void* wgrad_b = nullptr;
    float* wgrad_b_scales = nullptr;
    // The routed MLP's dy and x, already quantized that way by route (quantize_pulled_columns); null: quantized from
    // the materialized rows (m.dy, m.x) before their GEMMs, into wgrad_a and wgrad_b (the shared expert's).
    const void* wgrad_dy = nullptr;
    const float* wgrad_dy_scales = nullptr;
    const void* wgrad_x = nullptr;
    const float* wgrad_x_scales = nullptr;
  } fp8;
};

ExpertGemmArgs gemm_over(const GemmRows& rows, const MoeOptions& options, const WaitBound& waits) {
  ExpertGemmArgs a;
  a.waits = waits;
  a.a_rows = rows.rows_allocated;
  a.local_experts = rows.local_experts;
  a.expert_counts = rows.expert_counts;
  a.expert_row_offsets = rows.expert_row_offsets;
  a.scheduled_rows = rows.scheduled_rows;
  a.tile_m = options.schedule.tile_m;
  return a;
}

GradOutput grad_output(const WeightGrad& g) {
  if (g.mode == GradMode::kAccumulate) return GradOutput::kAccumulateFloat32;
  return g.grad.dtype == DType::kFloat32 ? GradOutput::kFloat32 : GradOutput::kBFloat16;
}

// out_e [m, n] = sum_r a[r, m] b[r, n] over each expert's rows; rows [m_split, m) into `split` when set
// (validated: same dtype and mode as `out`). `out` null when the gradient is empty (not wanted).
WeightGradArgs weight_grad_args(const GemmRows& rows, const MoeOptions& options, const WaitBound& waits, const void* a,
                                int m, const void* b, int n, const WeightGrad& out, const WeightGrad* split,
                                int m_split) {
  WeightGradArgs w;
  w.waits = waits;
  w.a = a;
  w.b = b;
  w.rows_allocated = rows.rows_allocated;
  w.m = m;
  w.n = n;
  w.local_experts = rows.local_experts;
  w.expert_row_offsets = rows.expert_row_offsets;
  w.scheduled_rows = rows.scheduled_rows;
  w.tile_m = options.schedule.tile_m;
  w.output = grad_output(out);
  if (out.grad.empty()) return w;
  w.out = out.grad.mutable_data();
  if (split != nullptr && !split->grad.empty()) {
    w.out_split = split->grad.mutable_data();
    w.m_split = m_split;
  }
  return w;
}

// One MLP's five backward GEMMs, tickets left empty: the unfused path launches them one by one (issue_dgrads,
// issue_weight_grads), the fused path as one kernel. The recompute is run only when the MLP recomputes.
detail::MlpBackwardGemms backward_gemms(const MoeShape& shape, const MoeOptions& options, const MlpBackward& m) {
  detail::MlpBackwardGemms g;
  g.recompute = gemm_over(m.rows, options, m.waits);
  g.recompute.epilogue = GemmEpilogue::kSwiGLU;
  g.recompute.a = m.x;
  g.recompute.k = shape.hidden;
  g.recompute.b = m.gate;
  g.recompute.b_up = m.up;
  g.recompute.n = shape.intermediate;
  g.recompute.swiglu_limit = shape.swiglu_limit;
  g.recompute.out = m.hidden;
  g.recompute.gate_up_out = m.gate_up;
  g.recompute.first_row = m.recompute_from;

  g.down_dgrad = gemm_over(m.rows, options, m.waits);
  g.down_dgrad.epilogue = GemmEpilogue::kSwiGLUBackward;
  g.down_dgrad.a = m.d_out;
  g.down_dgrad.k = shape.hidden;
  g.down_dgrad.b = m.down;  // [E, H, I] = [E, k, n]: n contiguous
  g.down_dgrad.b_major = OperandMajor::kMN;
  g.down_dgrad.n = shape.intermediate;
  g.down_dgrad.row_scale = m.row_weight;
  g.down_dgrad.swiglu_limit = shape.swiglu_limit;
  g.down_dgrad.gate_up = m.gate_up;
  g.down_dgrad.out = m.d_gate_up;
  g.down_dgrad.row_partials = m.row_partials;

  g.gate_up_dgrad = gemm_over(m.rows, options, m.waits);
  g.gate_up_dgrad.epilogue = GemmEpilogue::kStore;
  g.gate_up_dgrad.a = m.d_gate_up;
  g.gate_up_dgrad.k = 2 * shape.intermediate;
  g.gate_up_dgrad.b = m.gate;  // fused [E, 2I, H] = [E, k, n]; separate: K = gate [E, I, H] then up
  g.gate_up_dgrad.b_up = m.up;
  g.gate_up_dgrad.b_major = OperandMajor::kMN;
  g.gate_up_dgrad.n = shape.hidden;
  g.gate_up_dgrad.out = m.d_x;

  if (m.fp8.on) {  // the same GEMMs on e4m3 operands, B read K-major (the transposed weights for the dgrads)
    g.recompute.precision = g.down_dgrad.precision = g.gate_up_dgrad.precision = Precision::kFP8;
    g.recompute.a = m.fp8.x;
    g.recompute.a_row_stride = m.fp8.x_row_bytes;
    g.recompute.a_scales = m.fp8.x_scales;
    g.recompute.b_scales = m.fp8.gate_scales;
    g.recompute.b_up_scales = m.up != nullptr ? m.fp8.up_scales : nullptr;
    g.down_dgrad.a = m.fp8.d_out;
    g.down_dgrad.a_scales = m.fp8.d_out_scales;
    g.down_dgrad.b = m.fp8.down_t;  // [E, I, H] = [E, n, k]
    g.down_dgrad.b_major = OperandMajor::kK;
    g.down_dgrad.b_scales = m.fp8.down_t_scales;
    g.down_dgrad.quantized_out = m.fp8.d_gate_up;  // d_g | d_u also quantized per 1 x 128 by its epilogue
    g.down_dgrad.out_scales = m.fp8.d_gate_up_scales;
    g.down_dgrad.out_scales_power_of_two = m.fp8.power_of_two;
    g.gate_up_dgrad.a = m.fp8.d_gate_up;
    g.gate_up_dgrad.a_scales = m.fp8.d_gate_up_scales;
    g.gate_up_dgrad.b = m.fp8.gate_up_t;  // [E, H, 2I] = [E, n, k]
    g.gate_up_dgrad.b_up = nullptr;
    g.gate_up_dgrad.b_major = OperandMajor::kK;
    g.gate_up_dgrad.b_scales = m.fp8.gate_up_t_scales;
    const auto quantize = [&](const void* in, int k, void* out, float* scales) {
      return Fp8QuantizeArgs{.in = in,
                             .rows = m.rows.rows_allocated,
                             .k = k,
                             .out = out,
                             .scales = scales,
                             .power_of_two_scales = m.fp8.power_of_two,
                             .rows_used = m.fp8.rows_used};
    };
    g.quantize_d_out = quantize(m.d_out, shape.hidden, m.fp8.d_out, m.fp8.d_out_scales);
  }

  const int h = shape.hidden, i = shape.intermediate;
  g.down_wgrad = weight_grad_args(m.rows, options, m.waits, m.dy, h, m.hidden, i, *m.grad_down, nullptr, 0);
  g.gate_up_wgrad =
      weight_grad_args(m.rows, options, m.waits, m.d_gate_up, 2 * i, m.x, h, *m.grad_gate, m.grad_up, i);
  if (m.fp8.on && m.fp8.weight_gradients) {  // each weight gradient's operands quantized along the rows, then FP8
    const auto columns = [&](const void* in, int k, void* out, float* scales, bool blocks) {
      return detail::Fp8ColumnQuantizeArgs{.in = in,
                                           .rows_allocated = m.rows.rows_allocated,
                                           .k = k,
                                           .local_experts = m.rows.local_experts,
                                           .expert_counts = m.rows.expert_counts,
                                           .expert_row_offsets = m.rows.expert_row_offsets,
                                           .scheduled_rows = m.rows.scheduled_rows,
                                           .out_row_offsets = m.fp8.wgrad_offsets,
                                           .out = out,
                                           .scales = scales,
                                           .power_of_two_scales = m.fp8.power_of_two,
                                           .block_scales = blocks};
    };
    const auto fp8_operands = [&](WeightGradArgs& w) {
      w.precision = Precision::kFP8;
      w.a = m.fp8.wgrad_a;
      w.a_scales = m.fp8.wgrad_a_scales;
      w.b = m.fp8.wgrad_b;
      w.b_scales = m.fp8.wgrad_b_scales;
      w.b_block_scales = m.fp8.activation_blocks;
      // quantize_columns_fp8's rows for these rows and experts: the column stride of a and b (the buffers hold
      // the routed and the shared expert's, whichever is more).
      w.rows_allocated = detail::fp8_column_rows(m.rows.rows_allocated, m.rows.local_experts);
      w.expert_row_offsets = m.fp8.wgrad_offsets;
      w.scheduled_rows = m.fp8.wgrad_offsets + m.rows.local_experts;  // the last offset: every segment
      w.tile_m = 128;
    };
    fp8_operands(g.down_wgrad);
    fp8_operands(g.gate_up_wgrad);
    if (m.fp8.wgrad_dy != nullptr) {  // routed: dy and x quantized as they were pulled
      g.down_wgrad.a = m.fp8.wgrad_dy;
      g.down_wgrad.a_scales = m.fp8.wgrad_dy_scales;
      g.gate_up_wgrad.b = m.fp8.wgrad_x;
      g.gate_up_wgrad.b_scales = m.fp8.wgrad_x_scales;
    } else {
      g.quantize_down_wgrad[0] = columns(m.dy, h, m.fp8.wgrad_a, m.fp8.wgrad_a_scales, false);
      g.quantize_gate_up_wgrad[1] = columns(m.x, h, m.fp8.wgrad_b, m.fp8.wgrad_b_scales, m.fp8.activation_blocks);
    }
    g.quantize_down_wgrad[1] = columns(m.hidden, i, m.fp8.wgrad_b, m.fp8.wgrad_b_scales, m.fp8.activation_blocks);
    g.quantize_gate_up_wgrad[0] = columns(m.d_gate_up, 2 * i, m.fp8.wgrad_a, m.fp8.wgrad_a_scales, false);
  }
  return g;
}

// The unfused path: the recompute (unless the forward kept g | u) and the two dgrads, in stream order; FP8
// quantizes the down dgrad's A (d_out's rows) before it, unless the pull did (the down dgrad's epilogue quantizes
// the gate/up dgrad's). tickets: five, detail::BackwardStep order.
void issue_dgrads(detail::MlpBackwardGemms g, bool recompute, int32_t* tickets, cudaStream_t stream) {
  if (recompute) {
    g.recompute.ticket = tickets + detail::kRecompute;
    expert_gemm(g.recompute, stream);
  }
  // A non-finite block of either A is reported to the rank's status word (kStatusNonFinite), with its row.
  const WaitBound& waits = g.down_dgrad.waits;
  if (g.quantize_d_out.in != nullptr)
    detail::quantize_rows_fp8(g.quantize_d_out, waits.status, NonFiniteWhere::kDOut, waits.rank, stream);
  g.down_dgrad.ticket = tickets + detail::kDownDgrad;
  expert_gemm(g.down_dgrad, stream);
  g.gate_up_dgrad.ticket = tickets + detail::kGateUpDgrad;
  expert_gemm(g.gate_up_dgrad, stream);
}

// The unfused path: the wanted weight gradients.
// FP8 weight gradients: each GEMM's two operands quantized along the rows first (into buffers the two GEMMs
// share in turn: stream order).
void issue_weight_grads(detail::MlpBackwardGemms g, int32_t* tickets, cudaStream_t stream) {
  const auto quantize = [&](const detail::Fp8ColumnQuantizeArgs (&operands)[2]) {
    for (const detail::Fp8ColumnQuantizeArgs& q : operands)
      if (q.in != nullptr) detail::quantize_columns_fp8(q, stream);
  };
  if (g.down_wgrad.out != nullptr) {
    quantize(g.quantize_down_wgrad);
    g.down_wgrad.ticket = tickets + detail::kDownWgrad;
    weight_grad_gemm(g.down_wgrad, stream);
  }
  if (g.gate_up_wgrad.out != nullptr) {
    quantize(g.quantize_gate_up_wgrad);
    g.gate_up_wgrad.ticket = tickets + detail::kGateUpWgrad;
    weight_grad_gemm(g.gate_up_wgrad, stream);
  }
}

}  // namespace

// Buffers (docs/design.md, "Backward"): symmetric d_out, router weights and d_rw, and per rank one
// allocation of scratch (MoeWorkspace::BackwardScratch, laid out by detail::backward_scratch_layout).
void MoeWorkspace::allocate_backward() {
  const int64_t t = shape_.num_tokens, k = shape_.top_k, h = shape_.hidden;
  const int64_t pt = padded_tokens_, cap = capacity_rows();
  // Rows past a call's tokens are zeroed by every publish (publish_token_rows), so the shared expert's GEMMs,
  // which read whole padded tiles and sum its weight gradients over them, see zeros there (x_ likewise).
  if (!reads_token_rows_in_place()) {
    d_out_ = group_.allocate(pt * h * kBf16Bytes);
    rw_ = group_.allocate(t * k * kFloatBytes);
  }
  d_rw_ = group_.allocate(t * k * kFloatBytes);
  ExpertGemmArgs down_dgrad;  // the down dgrad's tiles along I: its d_rw partials per row
  down_dgrad.epilogue = GemmEpilogue::kSwiGLUBackward;
  down_dgrad.precision = options_.precision;
  down_dgrad.n = static_cast<int>(shape_.intermediate);
  const int n_blocks = gemm_n_blocks(down_dgrad);
  const detail::BackwardScratchLayout layout = detail::backward_scratch_layout(
      shape_, {.capacity_rows = cap,
               .padded_tokens = pt,
               .n_blocks = n_blocks,
               // the context keeps only rows [0, ring), or (FP8) x's FP8 rows: the weight gradients read bf16 x
               .copies_x = ring_rows_ < cap || fp8(),
               .recomputes = recomputes_gate_up(),
               .shared_recomputes = !context_keeps_gate_up(),
               .counter_words = backward_megakernel() ? detail::fused_backward_counter_words(cap / 64, pt / 64) : 0,
               .fp8 = fp8(),
               .fp8_weight_gradients = fp8_weight_gradients()});
  const int64_t bytes = layout.buffers.total_bytes();
  backward_bytes_ = int64_t(d_out_.bytes()) + int64_t(rw_.bytes()) + int64_t(d_rw_.bytes()) + bytes;
  for (int r : group_.local_ranks()) {
    BackwardScratch& w = ranks_[r].backward;
    w.allocation = DeviceBuffer(ranks_[r].device, bytes);
    DeviceGuard guard(ranks_[r].device);
    // Zero once: rows no GEMM writes yet are finite (the weight-gradient GEMMs sum whole padded segments).
    MOK_CHECK_CUDA(cudaMemset(w.allocation.get(), 0, bytes));
    void* base = w.allocation.get();
    w.n_blocks = n_blocks;
    w.x_rows = layout.x_rows.in(base);
    w.d_out_rows = layout.d_out_rows.in(base);
    w.dy_rows = layout.dy_rows.in(base);
    w.row_weight = layout.row_weight.in<float>(base);
    w.hidden = layout.hidden.in(base);
    w.gate_up = layout.gate_up.in(base);
    w.d_gate_up = layout.d_gate_up.in(base);
    w.row_partials = layout.row_partials.in<float>(base);
    w.kept_rows = layout.kept_rows.in<int32_t>(base);
    w.counters = layout.counters.in<uint64_t>(base);
    w.shared_gate_up = layout.shared_gate_up.in(base);
    w.shared_hidden = layout.shared_hidden.in(base);
    w.shared_d_gate_up = layout.shared_d_gate_up.in(base);
    w.shared_dx = layout.shared_dx.in(base);
    w.shared_row_partials = layout.shared_row_partials.in<float>(base);
    w.d_out_fp8 = layout.d_out_fp8.in(base);
    w.d_out_scales = layout.d_out_scales.in<float>(base);
    w.d_gate_up_fp8 = layout.d_gate_up_fp8.in(base);
    w.d_gate_up_scales = layout.d_gate_up_scales.in<float>(base);
    w.shared_x_fp8 = layout.shared_x_fp8.in(base);
    w.shared_d_out_fp8 = layout.shared_d_out_fp8.in(base);
    w.shared_d_out_scales = layout.shared_d_out_scales.in<float>(base);
    w.shared_d_gate_up_fp8 = layout.shared_d_gate_up_fp8.in(base);
    w.shared_d_gate_up_scales = layout.shared_d_gate_up_scales.in<float>(base);
    w.wgrad_a_fp8 = layout.wgrad_a_fp8.in(base);
    w.wgrad_a_scales = layout.wgrad_a_scales.in<float>(base);
    w.wgrad_b_fp8 = layout.wgrad_b_fp8.in(base);
    w.wgrad_b_scales = layout.wgrad_b_scales.in<float>(base);
    w.wgrad_offsets = layout.wgrad_offsets.in<int32_t>(base);
    w.shared_wgrad_offsets = layout.shared_wgrad_offsets.in<int32_t>(base);
    w.wgrad_dy_fp8 = layout.wgrad_dy_fp8.in(base);
    w.wgrad_dy_scales = layout.wgrad_dy_scales.in<float>(base);
    w.wgrad_x_fp8 = layout.wgrad_x_fp8.in(base);
    w.wgrad_x_scales = layout.wgrad_x_scales.in<float>(base);
  }  // the constructor synchronizes the devices after this
}

void MoeWorkspace::validate_backward(const RankBackward& b) const {
  const std::string where = "rank " + std::to_string(b.rank) + ": ";
  try {
    require(options_.backward, "the workspace was built with MoeOptions.backward = false (an inference-only "
                               "workspace has no backward buffers)");
    const RankState& s = state(b.rank);
    require(b.context != nullptr && b.context->owner_ == id_ && b.context->rank() == b.rank,
            "context: must be a ForwardContext made by this workspace's make_context(" + std::to_string(b.rank) +
                ") and filled by its forward (or recompute_forward_context)");
    require(b.context->layer_written_,
            "context: holds no forward of its schedule (a fresh context, or build_schedule without "
            "forward_with_schedule or recompute_forward_context after it): the backward needs that forward's "
            "activations");
    detail::check_backward_inputs(b, shape_, s.device, options_.precision);
    require(b.context->num_tokens() == b.topk_idx.shape[0],
            "topk_idx: " + std::to_string(b.topk_idx.shape[0]) + " tokens, but the context holds a forward of " +
                std::to_string(b.context->num_tokens()) + " (the backward takes its forward's tokens)");
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("MoeWorkspace::backward: " + where + e.what());
  }
}

void MoeWorkspace::validate_recompute(const RankForward& f) const {
  const std::string where = "rank " + std::to_string(f.rank) + ": ";
  try {
    require(options_.backward, "the workspace was built with MoeOptions.backward = false (an inference-only "
                               "workspace has no backward buffers)");
    const RankState& s = state(f.rank);
    require(f.context != nullptr && f.context->owner_ == id_ && f.context->rank() == f.rank,
            "context: must be a ForwardContext made by this workspace's make_context(" + std::to_string(f.rank) + ")");
    detail::check_recompute_inputs(f, shape_, s.device, options_.precision);
    require(f.context->num_tokens() == f.x.shape[0],
            "x: " + std::to_string(f.x.shape[0]) + " tokens, but the context's schedule was built for " +
                std::to_string(f.context->num_tokens()) + " (build_schedule with this call's topk_idx first)");
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("MoeWorkspace::recompute_forward_context: " + where + e.what());
  }
}

// Every argument of every rank is checked before anything is issued (see issue_call).
void MoeWorkspace::backward(std::span<const RankBackward> ranks) {
  require_open("backward");
  detail::require_distinct_ranks(ranks, "MoeWorkspace::backward");
  for (const RankBackward& b : ranks) validate_backward(b);
  for (const RankBackward& b : ranks) begin_call(b.rank, b.stream);
  for (const RankBackward& b : ranks) backward_publish(b);
  for (const RankBackward& b : ranks) backward_experts(b);
  for (const RankBackward& b : ranks) backward_epilogue(b);
  for (const RankBackward& b : ranks) end_call(b.rank, b.stream);
}

// Phase 1: x, d_out and the router weights into the symmetric buffers, "they are readable" to every peer,
// then the shared expert's backward (local work while the peers catch up).
void MoeWorkspace::backward_publish(const RankBackward& b) {
  const RankState& s = state(b.rank);
  DeviceGuard guard(s.device);
  const int64_t t = b.topk_idx.shape[0], k = shape_.top_k;  // the call's tokens
  if (!reads_token_rows_in_place()) {
    publish_token_rows(x_.on(b.rank), b.x.data, t, b.stream);
    publish_token_rows(d_out_.on(b.rank), b.d_out.data, t, b.stream);
    if (t > 0)  // read only at the call's routes
      MOK_CHECK_CUDA(cudaMemcpyAsync(rw_.on(b.rank), b.router_weights.data, t * k * kFloatBytes,
                                     cudaMemcpyDeviceToDevice, b.stream));
  }
  barrier_arrive(b.rank, b.stream);
  if (shape_.shared_expert && !backward_megakernel()) shared_backward(b);
}

// The shared expert on the rank's own tokens: one expert over the padded tokens, row weight 1, so its
// down weight gradient's A is d_out itself; its d_x partial stays here for the epilogue. The routed experts
// over the schedule's rows, their x rows read from the context or (ring < capacity) gathered into the scratch.
detail::MlpBackwardGemms MoeWorkspace::mlp_backward_gemms(const RankBackward& b, bool shared) const {
  const RankState& s = state(b.rank);
  const BackwardScratch& w = s.backward;
  const MoeWeights& weights = *b.weights;
  const MoeWeightGrads& grads = *b.weight_grads;
  const ForwardContext& ctx = *b.context;
  if (shared) {
    const bool kept = context_keeps_gate_up();
    MlpBackward m{.rows = {.local_experts = 1,
                                 .expert_counts = s.shared_schedule->counts,
                                 .expert_row_offsets = s.shared_schedule->row_offsets,
                                 .scheduled_rows = s.shared_schedule->scheduled_rows,
                                 .rows_allocated = padded_tokens_},
                        .x = x_.on(b.rank),
                        .d_out = d_out_.on(b.rank),
                        .dy = d_out_.on(b.rank),
                        .row_weight = nullptr,
                        .gate = weights.shared_gate.data,
                        .up = weights.shared_up.data,
                        .down = weights.shared_down.data,
                        .recompute_from = 0,
                        .hidden = kept ? ctx.shared_hidden_ : w.shared_hidden,
                        .gate_up = kept ? ctx.shared_gate_up_ : w.shared_gate_up,
                        .d_gate_up = w.shared_d_gate_up,
                        .row_partials = w.shared_row_partials,
                        .d_x = w.shared_dx,
                        .grad_gate = &grads.shared_gate,
                        .grad_up = &grads.shared_up,
                        .grad_down = &grads.shared_down,
                        .waits = wait_bound(b.rank)};
    if (fp8())
      m.fp8 = {.on = true,
               .x = w.shared_x_fp8,
               .x_row_bytes = 2 * int64_t(shape_.hidden),  // publish_fp8_rows': an FP8 row in the bf16 row's bytes
               .x_scales = s.x_scales,
               .gate_scales = static_cast<const float*>(weights.shared_gate_scales.data),
               .up_scales = static_cast<const float*>(weights.shared_up_scales.data),
               .d_out = w.shared_d_out_fp8,
               .d_out_scales = w.shared_d_out_scales,
               .down_t = weights.shared_down_t.data,
               .down_t_scales = static_cast<const float*>(weights.shared_down_t_scales.data),
               .d_gate_up = w.shared_d_gate_up_fp8,
               .d_gate_up_scales = w.shared_d_gate_up_scales,
               .gate_up_t = weights.shared_gate_up_t.data,
               .gate_up_t_scales = static_cast<const float*>(weights.shared_gate_up_t_scales.data),
               .rows_used = nullptr,
               .power_of_two = options_.fp8_power_of_two_scales,
               .weight_gradients = fp8_weight_gradients(),
               .activation_blocks = fp8_activation_blocks(),
               .wgrad_offsets = w.shared_wgrad_offsets,
               .wgrad_a = w.wgrad_a_fp8,
               .wgrad_a_scales = w.wgrad_a_scales,
               .wgrad_b = w.wgrad_b_fp8,
               .wgrad_b_scales = w.wgrad_b_scales};
    return backward_gemms(shape_, options_, m);
  }
  const ScheduleView& v = ctx.schedule_;
  const bool recompute = recomputes_gate_up();
  MlpBackward m{.rows = {.local_experts = shape_.local_experts(),
                               .expert_counts = v.expert_counts,
                               .expert_row_offsets = v.expert_row_offsets,
                               .scheduled_rows = v.scheduled_rows,
                               .rows_allocated = capacity_rows()},
                      .x = w.x_rows != nullptr ? w.x_rows : ctx.expert_rows_,
                      .d_out = w.d_out_rows,
                      .dy = w.dy_rows,
                      .row_weight = w.row_weight,
                      .gate = weights.expert_gate.data,
                      .up = weights.expert_up.data,  // null: gate and up fused in expert_gate
                      .down = weights.expert_down.data,
                      .recompute_from = kept_gate_up_rows(),
                      .hidden = recompute ? w.hidden : ctx.hidden_,
                      .gate_up = recompute ? w.gate_up : ctx.gate_up_,
                      .d_gate_up = w.d_gate_up,
                      .row_partials = w.row_partials,
                      .d_x = w.d_x_rows(),
                      .grad_gate = &grads.expert_gate,
                      .grad_up = &grads.expert_up,
                      .grad_down = &grads.expert_down,
                      .waits = wait_bound(b.rank)};
  if (fp8())  // a recompute reads the context's FP8 rows (every row: the FP8 backward's ring is the capacity)
    m.fp8 = {.on = true,
             .x = ctx.expert_rows_,
             .x_row_bytes = pulled_row_bytes(),  // the context's packed rows
             .x_scales = ctx.expert_row_scales_,
             .gate_scales = static_cast<const float*>(weights.expert_gate_scales.data),
             .up_scales = static_cast<const float*>(weights.expert_up_scales.data),
             .d_out = w.d_out_fp8,
             .d_out_scales = w.d_out_scales,
             .down_t = weights.expert_down_t.data,
             .down_t_scales = static_cast<const float*>(weights.expert_down_t_scales.data),
             .d_gate_up = w.d_gate_up_fp8,
             .d_gate_up_scales = w.d_gate_up_scales,
             .gate_up_t = weights.expert_gate_up_t.data,
             .gate_up_t_scales = static_cast<const float*>(weights.expert_gate_up_t_scales.data),
             .rows_used = v.scheduled_rows,
             .power_of_two = options_.fp8_power_of_two_scales,
             .weight_gradients = fp8_weight_gradients(),
             .activation_blocks = fp8_activation_blocks(),
             .wgrad_offsets = w.wgrad_offsets,
             .wgrad_a = w.wgrad_a_fp8,
             .wgrad_a_scales = w.wgrad_a_scales,
             .wgrad_b = w.wgrad_b_fp8,
             .wgrad_b_scales = w.wgrad_b_scales,
             .wgrad_dy = w.wgrad_dy_fp8,
             .wgrad_dy_scales = w.wgrad_dy_scales,
             .wgrad_x = w.wgrad_x_fp8,
             .wgrad_x_scales = w.wgrad_x_scales};
  return backward_gemms(shape_, options_, m);
}

// The routed rows whose g | u and h the backward copies from the context instead of recomputing: a fused
// forward's small ring kept rows [0, ring) (the same bits: row r of a GEMM depends on row r alone).
int32_t MoeWorkspace::kept_gate_up_rows() const {
  return recomputes_gate_up() && context_keeps_gate_up() ? static_cast<int32_t>(ring_rows_) : 0;
}

void MoeWorkspace::copy_kept_gate_up(const RankBackward& b) const {
  if (kept_gate_up_rows() == 0) return;
  const BackwardScratch& w = state(b.rank).backward;
  const int64_t i = shape_.intermediate, rows = kept_gate_up_rows();
  MOK_CHECK_CUDA(cudaMemcpyAsync(w.gate_up, b.context->gate_up_, rows * 2 * i * kBf16Bytes, cudaMemcpyDeviceToDevice,
                                 b.stream));
  MOK_CHECK_CUDA(cudaMemcpyAsync(w.hidden, b.context->hidden_, rows * i * kBf16Bytes, cudaMemcpyDeviceToDevice, b.stream));
}

void MoeWorkspace::shared_backward(const RankBackward& b) {
  const RankState& s = state(b.rank);
  int32_t* tickets = s.tickets + detail::kBackwardShared;
  if (fp8() && !context_keeps_gate_up())  // the recompute's A: x quantized again as the forward published it (the
                                          // same bits), its scales
    detail::publish_fp8_rows(b.x.data, b.x.shape[0], padded_tokens_, shape_.hidden, s.backward.shared_x_fp8,
                             s.x_scales, options_.fp8_power_of_two_scales, schedule_.device_status(b.rank), b.rank,
                             b.stream);
  const detail::MlpBackwardGemms g = mlp_backward_gemms(b, true);
  issue_dgrads(g, !context_keeps_gate_up(), tickets, b.stream);
  issue_weight_grads(g, tickets, b.stream);
}

// Phase 2: wait for every rank's published tensors, pull the scheduled rows, the routed experts' dgrads,
// push d_x_route rows and d_rw home, "your rows are written" to every peer; then the routed weight
// gradients (local, after the arrive: peers need not wait for them).
void MoeWorkspace::backward_experts(const RankBackward& b) {
  if (backward_megakernel()) return backward_fused(b);
  const RankState& s = state(b.rank);
  const BackwardScratch& w = s.backward;
  DeviceGuard guard(s.device);
  const ForwardContext& ctx = *b.context;
  const ScheduleView& v = ctx.schedule_;
  const int row_vectors = static_cast<int>(shape_.hidden * kBf16Bytes / 16);
  barrier_wait(b.rank, b.stream);

  // A context that keeps every row (ring = capacity) is read in place; otherwise the x rows are gathered:
  // the kept ones from the context, the others pulled again from their source ranks. MoeOptions::gather_rows:
  // this rank's own routes get no d_out row (the down dgrad's producer reads them from d_out).
  const bool gather = options_.gather_rows;
  backward::GradPullSources sources = grad_pull_sources(b);
  if (gather) sources.gathered_rank = b.rank;
  const kernels::GradPullParams pull{
      .src = sources,
      .x_rows = static_cast<uint4*>(w.x_rows),
      .d_out_rows = static_cast<uint4*>(w.d_out_rows),
      .dy_rows = static_cast<uint4*>(w.dy_rows),
      .row_weight = w.row_weight,
      .row_route = v.row_route,
      .scheduled_rows = v.scheduled_rows,
      .num_tokens = shape_.num_tokens,
      .top_k = shape_.top_k,
      .row_vectors = row_vectors,
      // FP8: the down dgrad's A quantized by the pull (quantize_rows_fp8's bits), not a bf16 copy quantized after
      .fp8 = {.d_out = fp8() ? static_cast<uint8_t*>(w.d_out_fp8) : nullptr,
              .d_out_scales = w.d_out_scales,
              .rows = capacity_rows(),
              .power_of_two = options_.fp8_power_of_two_scales,
              .status = schedule_.device_status(b.rank),
              .rank = b.rank}};
  kernels::pull_grad_rows_kernel<<<row_kernel_ctas(capacity_rows(), kernels::GradRowTraits::kWarps, s.num_sms),
                                   kernels::GradRowTraits::kThreads, 0, b.stream>>>(pull);
  MOK_CHECK_CUDA(cudaGetLastError());
  if (w.wgrad_dy_fp8 != nullptr) quantize_pulled_columns(b, sources);

  copy_kept_gate_up(b);  // only the rows past them are recomputed
  detail::MlpBackwardGemms g = mlp_backward_gemms(b, false);
  g.quantize_d_out.in = nullptr;  // FP8: the pull quantized d_out's rows
  if (gather)  // the down dgrad's A rows: d_out's token rows for this rank's routes, the pulled rows for others'
    g.down_dgrad.gather = {.x = token_rows(d_out_, b.rank, b.d_out.data).base[b.rank],
                           .row_route = v.row_route,
                           .num_tokens = shape_.num_tokens,
                           .top_k = shape_.top_k,
                           .rank = b.rank};
  // MoeOptions::scatter_rows: the gate/up dgrad writes each d_x_route row to its route's combine row itself
  // (src/device/gemm/row_scatter.cuh); the push below then moves only d_rw.
  const bool scatter = options_.scatter_rows;
  if (scatter) {
    g.gate_up_dgrad.out = nullptr;
    g.gate_up_dgrad.scatter = {.maps = s.scatter_maps.get(),
                               .row_route = v.row_route,
                               .num_tokens = shape_.num_tokens,
                               .top_k = shape_.top_k,
                               .ranks = shape_.ep_size};
  }
  int32_t* tickets = s.tickets + detail::kBackwardExpert;
  issue_dgrads(g, recomputes_gate_up(), tickets, b.stream);

  // local_combine: the epilogue reads the d_x_route rows where the dgrad wrote them; only d_rw is pushed.
  const bool keep_rows = scatter || local_combine();
  const kernels::GradPushParams push{.dst = {.combined = combined_.peers(b.rank), .d_rw = d_rw_.peers(b.rank)},
                                     .d_x_rows = keep_rows ? nullptr : static_cast<const uint4*>(w.d_x_rows()),
                                     .row_partials = w.row_partials,
                                     .n_blocks = w.n_blocks,
                                     .row_route = v.row_route,
                                     .scheduled_rows = v.scheduled_rows,
                                     .num_tokens = shape_.num_tokens,
                                     .top_k = shape_.top_k,
                                     .row_vectors = row_vectors};
  kernels::push_grad_rows_kernel<<<row_kernel_ctas(capacity_rows(), kernels::GradRowTraits::kWarps, s.num_sms),
                                   kernels::GradRowTraits::kThreads, 0, b.stream>>>(push);
  MOK_CHECK_CUDA(cudaGetLastError());
  barrier_arrive(b.rank, b.stream);

  issue_weight_grads(g, tickets, b.stream);
}

// MoeWorkspace::fp8_weight_gradients(): the routed weight gradients' dy and x, transposed and quantized per column per
// 128 rows of an expert (quantize_columns_fp8), each row read where the pull reads it: d_out's token row times its
// router weight, rounded to bf16 (the pull's dy bits), and x's token row; no bf16 copy written and read again. Here,
// after the pull and before this rank's barrier arrive: the peers' rows are published until every rank arrived.
void MoeWorkspace::quantize_pulled_columns(const RankBackward& b, const backward::GradPullSources& sources) const {
  const BackwardScratch& w = state(b.rank).backward;
  const ScheduleView& v = b.context->schedule_;
  detail::Fp8ColumnQuantizeArgs q{.rows_allocated = capacity_rows(),
                                  .k = static_cast<int>(shape_.hidden),
                                  .local_experts = shape_.local_experts(),
                                  .expert_counts = v.expert_counts,
                                  .expert_row_offsets = v.expert_row_offsets,
                                  .scheduled_rows = v.scheduled_rows,
                                  .out_row_offsets = w.wgrad_offsets,
                                  .out = w.wgrad_dy_fp8,
                                  .scales = w.wgrad_dy_scales,
                                  .power_of_two_scales = options_.fp8_power_of_two_scales,
                                  .pulled_rows = sources.d_out,
                                  .pulled_weights = sources.router_weights,
                                  .weighted = true,
                                  .row_route = v.row_route,
                                  .num_tokens = static_cast<int>(shape_.num_tokens),
                                  .top_k = static_cast<int>(shape_.top_k)};
  detail::quantize_columns_fp8(q, b.stream);
  q.out = w.wgrad_x_fp8;
  q.scales = w.wgrad_x_scales;
  q.pulled_rows = sources.x;
  q.weighted = false;
  q.block_scales = fp8_activation_blocks();  // x is the gate/up weight gradient's b
  detail::quantize_columns_fp8(q, b.stream);
}

backward::GradPullSources MoeWorkspace::grad_pull_sources(const RankBackward& b) const {
  return {.x = token_rows(x_, b.rank, b.x.data),
          .d_out = token_rows(d_out_, b.rank, b.d_out.data),
          .router_weights = token_rows(rw_, b.rank, b.router_weights.data),
          .kept_x_rows = static_cast<const uint4*>(b.context->expert_rows_),
          .kept_rows = fp8() ? 0 : b.context->ring_rows_};  // FP8's context rows are FP8: pull bf16 x again
}

// Phase 2 of the fused path: the whole backward of both MLPs between the barriers as one persistent launch
// (src/device/megakernel/backward_kernel.cuh); bitwise the unfused phases' results.
// FP8: the megakernel's row GEMMs in e4m3 and its pull quantizing d_out's rows; the shared expert's A operands are
// quantized before it (local rows, as shared_backward does), and every weight gradient runs after it as the stage
// kernels run them (their operands quantized along the rows first; dy's and x's by route before the barrier arrive,
// while the peers' rows are published): the same kernels in the same order per GEMM, so the same bits.
void MoeWorkspace::backward_fused(const RankBackward& b) {
  const RankState& s = state(b.rank);
  const BackwardScratch& w = s.backward;
  DeviceGuard guard(s.device);
  const ScheduleView& v = b.context->schedule_;
  const detail::MlpBackwardGemms shared =
      shape_.shared_expert ? mlp_backward_gemms(b, true) : detail::MlpBackwardGemms{};
  if (fp8() && shape_.shared_expert) {
    if (!context_keeps_gate_up())  // the recompute's A: x quantized again as the forward published it
      detail::publish_fp8_rows(b.x.data, b.x.shape[0], padded_tokens_, shape_.hidden, w.shared_x_fp8, s.x_scales,
                               options_.fp8_power_of_two_scales, schedule_.device_status(b.rank), b.rank, b.stream);
    const WaitBound& waits = shared.down_dgrad.waits;  // issue_dgrads' report
    detail::quantize_rows_fp8(shared.quantize_d_out, waits.status, NonFiniteWhere::kDOut, waits.rank, b.stream);
  }
  barrier_wait(b.rank, b.stream);
  copy_kept_gate_up(b);
  const detail::MlpBackwardGemms routed = mlp_backward_gemms(b, false);
  const backward::GradPullSources sources = grad_pull_sources(b);
  detail::FusedBackwardArgs a{
      .shared = shape_.shared_expert ? shared : routed,  // no shared phases without one
      .routed = routed,
      .common = megakernel_args(b.rank, v, w.counters, s.tickets + detail::kBackwardExpert),
      .shared_recompute = shape_.shared_expert && !context_keeps_gate_up(),
      .routed_recompute = recomputes_gate_up(),
      .recompute_from = kept_gate_up_rows(),
      .pull = sources,
      .pull_fp8 = {.d_out = fp8() ? static_cast<uint8_t*>(w.d_out_fp8) : nullptr,
                   .d_out_scales = w.d_out_scales,
                   .rows = capacity_rows(),
                   .power_of_two = options_.fp8_power_of_two_scales,
                   .status = schedule_.device_status(b.rank),
                   .rank = b.rank},
      .x_rows = w.x_rows,
      .d_out_rows = w.d_out_rows,
      .dy_rows = w.dy_rows,
      .row_weight = w.row_weight,
      .push = {.combined = combined_.peers(b.rank), .d_rw = d_rw_.peers(b.rank)},
      .row_partials = w.row_partials,
      .n_blocks = w.n_blocks};
  detail::launch_fused_backward(a, b.stream);
  if (w.wgrad_dy_fp8 != nullptr) quantize_pulled_columns(b, sources);
  barrier_arrive(b.rank, b.stream);
  if (!fp8()) return;  // bf16's weight gradients were tiles of the megakernel
  issue_weight_grads(routed, s.tickets + detail::kBackwardExpert, b.stream);
  if (shape_.shared_expert) issue_weight_grads(shared, s.tickets + detail::kBackwardShared, b.stream);
}

// Phase 3: wait for every expert rank's rows, then d_x = shared dx + sum_j d_x_route_j (fp32, j ascending,
// one rounding) and d_router_weights = the pushed d_rw (0 at masked and invalid routes). The stage kernels at
// EP = 1 (local_combine): d_x_route_j read where the gate/up dgrad wrote it.
void MoeWorkspace::backward_epilogue(const RankBackward& b) {
  const RankState& s = state(b.rank);
  DeviceGuard guard(s.device);
  barrier_wait(b.rank, b.stream);
  const bool local = !backward_megakernel() && local_combine();
  const combine::EpilogueParams p{
      .combined = static_cast<const uint4*>(combined_.on(b.rank)),
      .shared_out = shape_.shared_expert ? static_cast<const uint4*>(s.backward.shared_dx) : nullptr,
      .router_weights = nullptr,  // the d_x_route rows carry rw already (d_h = rw * d_hu)
      .topk_idx = b.topk_idx.data,
      .out = static_cast<uint4*>(b.d_x.mutable_data()),
      .route_values = static_cast<const float*>(d_rw_.on(b.rank)),
      .route_out = static_cast<float*>(b.d_router_weights.mutable_data()),
      .num_tokens = static_cast<int>(b.topk_idx.shape[0]),  // the call's tokens
      .top_k = shape_.top_k,
      .num_experts = shape_.num_experts,
      .row_vectors = static_cast<int>(shape_.hidden / combine::EpilogueTraits::kColumns),
      .rows = local ? static_cast<const uint4*>(s.backward.d_x_rows()) : nullptr,
      .route_row = local ? b.context->schedule_.route_row : nullptr,
      .schedule_ids = b.context->schedule_.own_ids,  // the call's topk_idx against the forward's
      .status = schedule_.device_status(b.rank)};
  detail::launch_combine_epilogue(p, b.topk_idx.dtype, s.num_sms, b.stream);
}

// recompute_forward_context: the forward's publish, dispatch and gate/up GEMMs into the context, without
// the down GEMMs and the combine. Two barriers like every call: the second says "done pulling your x".
void MoeWorkspace::recompute_forward_context(std::span<const RankForward> ranks) {
  require_open("recompute_forward_context");
  detail::require_distinct_ranks(ranks, "MoeWorkspace::recompute_forward_context");
  for (const RankForward& f : ranks) validate_recompute(f);
  for (const RankForward& f : ranks) begin_call(f.rank, f.stream);
  for (const RankForward& f : ranks) recompute_publish(f);
  for (const RankForward& f : ranks) recompute_rows(f);
  for (const RankForward& f : ranks) recompute_finish(f);
  for (const RankForward& f : ranks) f.context->layer_written_ = true;
  for (const RankForward& f : ranks) end_call(f.rank, f.stream);
}

// x into the symmetric buffer as the forward publishes it, barrier arrive, the shared expert's hidden rows
// into the context.
void MoeWorkspace::recompute_publish(const RankForward& f) {
  const RankState& s = state(f.rank);
  DeviceGuard guard(s.device);
  publish_x(f);
  barrier_arrive(f.rank, f.stream);
  if (!shape_.shared_expert) return;
  ExpertGemmArgs gate_up, down;  // the forward's shared gate/up GEMM: the same bits in shared_hidden
  shared_gemms(f, gate_up, down);
  expert_gemm(gate_up, f.stream);
}

// Barrier wait, pull the rows the context keeps (schedule rows [0, ring)), barrier arrive, then their
// hidden rows by the forward's gate/up GEMM (row r's value does not depend on the rows around it). FP8: the
// pulled rows are the forward's FP8 rows (its ring is the capacity), their scales unpacked as it does.
void MoeWorkspace::recompute_rows(const RankForward& f) {
  const RankState& s = state(f.rank);
  DeviceGuard guard(s.device);
  const ScheduleView& v = f.context->schedule_;
  barrier_wait(f.rank, f.stream);
  pull_rows(f, ring_rows_);
  barrier_arrive(f.rank, f.stream);
  if (fp8())
    detail::unpack_fp8_row_scales(f.context->expert_rows_, v.scheduled_rows, capacity_rows(), shape_.hidden,
                                  f.context->expert_row_scales_, f.stream);

  ExpertGemmArgs gate_up, down;
  routed_gemms(f, gate_up, down);  // A = the context's rows [ring, H], out = its hidden rows
  if (ring_rows_ < capacity_rows()) {
    // The GEMM's tasks end at its row count: the kept rows (ring is a multiple of 128, so of any tile).
    kernels::kept_rows_kernel<<<1, 32, 0, f.stream>>>(v.scheduled_rows, static_cast<int32_t>(ring_rows_),
                                                      s.backward.kept_rows);
    MOK_CHECK_CUDA(cudaGetLastError());
    gate_up.scheduled_rows = s.backward.kept_rows;
  }
  expert_gemm(gate_up, f.stream);
}

void MoeWorkspace::recompute_finish(const RankForward& f) { barrier_wait(f.rank, f.stream); }

}  // namespace mok
