// The MoE layer's forward pass and its public C++ API. No host synchronization anywhere (the whole
// sequence can be captured in a CUDA graph); data-dependent errors go to the status word.
//
//   out[t] = shared(x[t]) + sum_j rw[t, j] * expert_{topk[t, j]}(x[t])       (docs/design.md)
//
//   PeerGroup group = PeerGroup::nccl({comm});                 // or device_peers / virtual_ranks
//   MoeWorkspace ws(group, shape);                              // symmetric buffers; reusable across layers
//   ForwardContext ctx = ws.make_context(rank, stream);         // one per layer: what backward needs
//   RankForward f{rank, x, topk_idx, router_weights, &weights, out, &ctx, stream};
//   ws.forward({&f, 1});                                        // asynchronous on f.stream
//   RankBackward b{rank, x, topk_idx, router_weights, &weights, &ctx, d_out, d_x, d_router_weights, &grads,
//                  stream};
//   ws.backward({&b, 1});                                       // gradients, asynchronous on b.stream
//   StatusReport r = ws.read_status(rank, stream);              // where the caller synchronizes anyway
//   if (!r.ok()) ws.reset_status(rank, stream);                 // the status word is sticky until reset
//   ws.close();                                                 // collective teardown: every rank, explicitly
//
// Steps on every rank (sync in docs/sync_protocol.md):
//   schedule   all-gather the top-k ids; count, prefix-sum and place routes into the context's schedule
//   publish    copy x into the rank's symmetric x buffer (not at EP = 1 without a shared expert: the kernels
//              read x in place); barrier arrive ("x is readable"); barrier wait
//   layer      ForwardPath::kFused (default): one persistent megakernel (src/device/megakernel) whose
//              communication CTAs pull rows and push outputs while its compute CTAs run the shared expert,
//              then the routed experts minibatch by minibatch.
//              ForwardPath::kUnfused: the same work as stage kernels one after another:
//     shared     shared expert on the rank's own tokens (two grouped-GEMM launches with one "expert")
//     dispatch   *pull* every scheduled row from its source rank's symmetric x
//     experts    gate/up GEMM with the SwiGLU epilogue -> hidden rows; down GEMM -> expert output rows
//     combine    *push* each output row into its unique (token, slot) row of the source rank's combine buffer
//              then barrier arrive ("your rows are written")
//   epilogue   barrier wait; out = shared + sum_j rw[t, j] * y[t, j] in fp32, j in ascending order, masked
//              routes skipped; rounded to bf16 once
// Bitwise deterministic: every row has one writer, every sum a fixed order; both paths give the same bits,
// whatever the fused path's communication CTAs, minibatch and macrobatch.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/device_buffer.h"
#include "mok/expert_gemm.h"
#include "mok/peer_group.h"
#include "mok/routing.h"
#include "mok/schedule.h"
#include "mok/status.h"
#include "mok/timeline.h"

namespace mok {

namespace detail {
struct MlpBackwardGemms;  // src/host/moe_fused_backward.h
struct MegakernelArgs;    // src/host/megakernel_args.h
}  // namespace detail
namespace backward {
struct GradPullSources;  // src/device/backward/grad_rows.cuh
}  // namespace backward

enum class DType : int32_t { kBFloat16 = 0, kFloat32 = 1, kInt32 = 2, kInt64 = 3, kFloat8E4M3 = 4 };

// A dense, row-major tensor in device memory, owned by the caller. Validation reads dtype and shape.
struct TensorRef {
  static constexpr int kMaxDims = 3;
  const void* data = nullptr;
  DType dtype = DType::kBFloat16;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};

  TensorRef() = default;
  TensorRef(const void* data, DType dtype, std::initializer_list<int64_t> shape);
  bool empty() const { return data == nullptr; }
  void* mutable_data() const { return const_cast<void*>(data); }
  std::string describe() const;  // "bf16 [8192, 7168]"
};

struct MoeShape {
  static constexpr int kMaxFeatures = 1 << 20;  // the most hidden and intermediate may be
  int ep_size = 1;
  int num_tokens = 0;    // the most tokens one call passes on a rank: each call may pass any T in
                         // [0, num_tokens] (x [T, H], ...), and the ranks of one call different ones
  int top_k = 0;
  int num_experts = 0;   // E, global; expert e lives on rank e / local_experts()
  int hidden = 0;        // H: a multiple of 64 up to kMaxFeatures (fastest as a multiple of 256, the down
                         // GEMM's output tile)
  int intermediate = 0;  // I: a multiple of 64 up to kMaxFeatures (fastest as a multiple of 128, the SwiGLU
                         // GEMM's output tile)
  bool shared_expert = true;
  float swiglu_limit = 0;  // > 0: clamped SwiGLU

  RoutingShape routing() const { return {ep_size, num_tokens, top_k, num_experts}; }
  int local_experts() const { return num_experts / ep_size; }
  // Throws std::invalid_argument naming the field.
  void validate() const;
};

enum class ForwardPath : int32_t {
  kFused = 0,    // one persistent megakernel between the EP barriers (src/device/megakernel)
  kUnfused = 1,  // stage kernels one after another: the fused path's tested twin
};

// The megakernel's knobs. None of them changes a bit of the results (tests compare bitwise).
struct FusedOptions {
  static constexpr int kMaxTimelineRecords = 1 << 20;  // the most timeline_records may be
  int comm_ctas = 0;            // 0: every CTA computes and the three idle warps of each producer warpgroup
                                // copy the rows (faster on every model shape, docs/perf_notes.md round 6);
                                // > 0: this many CTAs only copy (a multiple of the cluster size, 2 for the
                                // model shapes)
  int minibatch_rows = 4096;    // rows whose gate/up tiles are ordered before their down tiles; multiple of 128,
                                // at most 2^30
  int64_t macrobatch_rows = 0;  // rows of the expert-side ring buffers (the context keeps the first
                                // macrobatch, the backward replays the others); multiple of 128, at most the
                                // capacity is used. 0: the balanced share of rows, within
                                // MoeOptions::context_budget_bytes (see there)
  int timeline_records = 0;     // > 0: record up to this many GEMM tiles and as many copies per CTA
                                // (MoeWorkspace::read_timeline), at most kMaxTimelineRecords
  bool backward_megakernel = false;  // the backward as one persistent launch per rank (backward_kernel.cuh),
                                     // bitwise the default's stage kernels; false because it is slower on
                                     // the H200 today (docs/perf_notes.md, rounds 9-10)
};

struct MoeOptions {
  ScheduleOptions schedule;  // row padding, capacity, spin-wait timeout
  ForwardPath path = ForwardPath::kFused;
  FusedOptions fused;
  bool backward = true;      // allocate the backward's buffers (false: an inference-only workspace, whose
                             // backward and recompute_forward_context throw)
  // The default ring (fused path, macrobatch_rows 0) keeps the balanced share of rows: the capacity at load
  // factor 1 (expected_load_capacity_rows(shape, tile_m, 1): T * k plus the worst padding) rounded down to a
  // multiple of 128 (at least 128; the whole capacity when that is within the share, as at EP = 1), whatever
  // the EP size and ScheduleOptions::load_factor; the rows imbalanced routing schedules past it are replayed
  // by the backward (recomputed from x). This budget then bounds it: device bytes one layer's ForwardContext
  // may hold on a rank; the ring is the largest multiple of 128 rows of the share whose context fits. 0: no
  // budget (the ring is the share). Too small for 128 rows: std::invalid_argument naming it. The unfused path
  // keeps every row of the capacity and ignores both.
  int64_t context_budget_bytes = int64_t{4} << 30;
  bool keep_gate_up = true;  // the forward keeps each row's raw g and u (bf16, 2I per row) in the context,
                             // so the backward needs no gate/up recompute when the context holds every row;
                             // false: the backward recomputes them from the kept x rows (docs/design.md,
                             // "Saved and recomputed", has the measured time and memory of both). FP8 with
                             // the backward: g | u and the bf16 h (3I bf16 per row) beside the quantized h;
                             // FP8 without it keeps neither
  bool gather_rows = false;  // unfused path: the routed gate/up GEMM reads the rows from this rank's tokens
                             // straight from x into its shared memory (docs/design.md, "Row gather in the
                             // gate/up producer"); the expert-major copy of x is then skipped at EP = 1 without
                             // backward (the context keeps it otherwise). The stage-kernel backward's down dgrad
                             // likewise reads this rank's d_out rows itself (pull_grad_rows copies only other
                             // ranks'). Same bits. The fused forward and the backward megakernel ignore it
  bool scatter_rows = false; // the routed store GEMMs write each row straight to its token's row of the combine
                             // buffer on the token's rank (docs/design.md, "Row scatter in the store epilogue"),
                             // with no expert-major output and no copy after them: the unfused forward's down
                             // GEMM and the stage-kernel backward's gate/up dgrad (d_rw is still pushed). Same
                             // bits. The forward and backward megakernels ignore it; precision kFP8 refuses it
  Precision precision = Precision::kBF16;  // kFP8 (docs/design.md, "FP8"): the routed and shared experts' GEMMs in
                             // e4m3 with DeepSeek-V3's block scales; x quantized per 1 x 128 once on its own rank
                             // (the rows it sends are FP8 with their scales), h per 1 x 128 before the down GEMM,
                             // the weights given quantized (MoeWeights' FP8 form, quantize_weights_fp8). Either
                             // forward path; the backward (docs/design.md, "FP8 backward") as stage kernels
                             // or the backward megakernel (its weight gradients after it), with I % 128 == 0 and
                             // a context that keeps every row (ring_rows() == capacity_rows()); no gather_rows,
                             // no scatter_rows
  bool fp8_power_of_two_scales = false;  // precision kFP8: the activations' scales (x's and h's, per 1 x 128)
                             // rounded up to powers of two (include/mok/fp8.h; the weights' are chosen when they
                             // are quantized: Fp8QuantizeArgs::power_of_two_scales)
  bool bf16_weight_gradients = false;  // precision kFP8: the four weight gradients' GEMMs in bf16 from bf16 rows;
                             // false (the default): in FP8 too, DeepSeek-V3's recipe (docs/design.md, "FP8 weight
                             // gradients": dy, h, d(g|u) and x transposed and quantized per column per 128 rows of
                             // an expert, then weight_grad_gemm's precision kFP8; docs/perf_notes.md, round 40, has
                             // both ways' speed, error and loss). Precision kBF16: bf16 either way
  bool fp8_weight_gradient_columns = false;  // precision kFP8 with FP8 weight gradients: their activation factors
                             // (x of the gate/up weight gradient, h of the down one) quantized per column per 128
                             // rows of an expert, DeepSeek-V3's recipe, as dy and d(g|u) are; false (the default):
                             // per 128 rows x 128 columns, so that the GEMM promotes each k-block with one
                             // multiply-add a value as the forward's tiles do (docs/design.md, "FP8 weight
                             // gradients"; docs/perf_notes.md, round 47: both ways' speed, error and loss)
  // How long setup waits for the other ranks (docs/design.md, "Setup waits"): the constructor's agreement (an
  // all-gather; NCCL groups), and the communicator the C API and Python create for the workspace. Past it, a
  // std::runtime_error (detail::SetupTimeout) says a rank never arrived. Finite, in (0, kMaxWaitTimeoutS]. Bounded
  // with a nonblocking communicator (ncclConfig_t::blocking = 0: the C API's and Python's); a blocking one may
  // wait inside NCCL's own calls first.
  double setup_timeout_s = kDefaultSetupTimeoutS;
};

// One rank's weights: bf16, or with MoeOptions::precision kFP8 e4m3 (DType::kFloat8E4M3) of the same shapes,
// each with its fp32 block scales (include/mok/fp8.h, quantize_weights_fp8: per 128 x 128 block of each
// expert's matrix), [.., ceil(rows / 128), ceil(columns / 128)] for a weight [.., rows, columns].
struct MoeWeights {
  TensorRef expert_gate;  // [E_local, I, H]; or gate and up fused [E_local, 2I, H] when expert_up is empty
  TensorRef expert_up;    // [E_local, I, H]
  TensorRef expert_down;  // [E_local, H, I]
  TensorRef shared_gate;  // [I, H]   (the three shared tensors are empty without a shared expert)
  TensorRef shared_up;    // [I, H]
  TensorRef shared_down;  // [H, I]
  // kFP8 only (empty otherwise): the block scales of the six above, in their order.
  TensorRef expert_gate_scales;
  TensorRef expert_up_scales;
  TensorRef expert_down_scales;
  TensorRef shared_gate_scales;
  TensorRef shared_up_scales;
  TensorRef shared_down_scales;
  // kFP8's backward only (MoeWorkspace::backward; the forward ignores them): the transposed copies its dgrads read
  // K-major, with their block scales: quantize_weights_fp8's out_transposed / scales_transposed (the forward's
  // values exactly) of [W_gate; W_up] [.., 2I, H] and of W_down. Separate gate and up weights: the transpose of
  // their concatenation (at I % 128 == 0, which the FP8 backward needs, its 128 x 128 blocks are theirs).
  TensorRef expert_gate_up_t;         // e4m3 [E_local, H, 2I]
  TensorRef expert_down_t;            // e4m3 [E_local, I, H]
  TensorRef shared_gate_up_t;         // e4m3 [H, 2I]   (the shared ones are empty without a shared expert)
  TensorRef shared_down_t;            // e4m3 [I, H]
  TensorRef expert_gate_up_t_scales;  // fp32 [E_local, ceil(H/128), 2I/128]
  TensorRef expert_down_t_scales;     // fp32 [E_local, I/128, ceil(H/128)]
  TensorRef shared_gate_up_t_scales;  // fp32 [ceil(H/128), 2I/128]
  TensorRef shared_down_t_scales;     // fp32 [I/128, ceil(H/128)]
};

// How one weight gradient is produced.
enum class GradMode : int32_t {
  kWrite = 0,       // grad = this call's gradient, in grad's dtype (bf16 or fp32), rounded once
  kAccumulate = 1,  // grad (fp32) += this call's gradient (Megatron's main_grad over micro-batches)
};

struct WeightGrad {
  TensorRef grad;  // the parameter's shape, bf16 or fp32 (kAccumulate: fp32); empty: not computed
  GradMode mode = GradMode::kWrite;
};

// One rank's weight gradients, laid out as MoeWeights (fused gate/up weights: expert_gate [E_local, 2I, H]
// receives both, expert_up stays empty).
struct MoeWeightGrads {
  WeightGrad expert_gate;
  WeightGrad expert_up;
  WeightGrad expert_down;
  WeightGrad shared_gate;  // the three shared gradients are empty without a shared expert
  WeightGrad shared_up;
  WeightGrad shared_down;
};

// What one layer's forward leaves for its backward, on one rank: the schedule and the expert-side
// activations. Owns device memory on the rank's GPU (one DeviceBuffer, freed on destruction, never a
// collective: a context may outlive its workspace's close()); one per layer, reused step after step.
// Move-only; a moved-from context belongs to no workspace.
class ForwardContext {
 public:
  ForwardContext() = default;
  ForwardContext(ForwardContext&&) noexcept;
  ForwardContext& operator=(ForwardContext&&) noexcept;

  int rank() const { return rank_; }
  const ScheduleView& schedule() const { return schedule_; }
  // The expert-side rows of the first macrobatch: schedule rows [0, ring_rows) (MoeWorkspace::ring_rows():
  // all of them on the unfused path; on the fused path the balanced share or fused.macrobatch_rows; the
  // backward recomputes the others).
  int64_t ring_rows() const { return ring_rows_; }
  // bf16 [ring_rows, H]: x rows in expert-major order (FP8: x's FP8 rows, values and scales, 16-byte aligned)
  const void* expert_rows() const { return expert_rows_; }
  const void* hidden() const { return hidden_; }            // bf16 [ring_rows, I]: silu(gate) * up of each row
  const void* shared_hidden() const { return shared_hidden_; }  // bf16 [padded T, I]
  // MoeOptions::keep_gate_up (else null): the raw g (columns [0, I)) and u ([I, 2I)) of each kept row.
  const void* gate_up() const { return gate_up_; }                 // bf16 [ring_rows, 2I]
  const void* shared_gate_up() const { return shared_gate_up_; }   // bf16 [padded T, 2I]; null without shared
  // Device memory the context holds (schedule and activations): what one layer keeps for its backward.
  int64_t bytes() const { return static_cast<int64_t>(allocation_.bytes()); }
  // The token count T of the call that built its schedule (-1 before any); its backward must pass the same.
  int num_tokens() const { return num_tokens_; }

 private:
  friend class MoeWorkspace;
  uint64_t owner_ = 0;           // the id of the workspace that made it (its buffers are sized for that shape)
  int rank_ = -1;
  DeviceBuffer allocation_;      // detail::context_layout (src/host/moe_layouts.h)
  int num_tokens_ = -1;
  bool layer_written_ = false;   // a forward (or recompute_forward_context) filled it on its current schedule
  int32_t* schedule_buffer_ = nullptr;
  ScheduleView schedule_;
  int64_t ring_rows_ = 0;
  void* expert_rows_ = nullptr;
  void* hidden_ = nullptr;
  void* shared_hidden_ = nullptr;
  void* gate_up_ = nullptr;
  void* shared_gate_up_ = nullptr;
  // MoeOptions::precision kFP8 only: the A scales of the expert rows, h in e4m3 with its scales (routed, shared).
  float* expert_row_scales_ = nullptr;
  void* hidden_fp8_ = nullptr;
  float* hidden_scales_ = nullptr;
  void* shared_hidden_fp8_ = nullptr;
  float* shared_hidden_scales_ = nullptr;
};

// One rank's arguments of a forward call. T, the call's token count on this rank, is topk_idx's first
// extent: any value in [0, MoeShape::num_tokens] (0: the rank sends no tokens, its experts still serve the
// peers'; x and out may then be empty tensors with a null pointer). Every tensor of the call agrees on it.
// The results of the T tokens are bitwise those of a workspace made for exactly T (EP = 1, or the same T
// on every rank); the workspace's buffers and the kernels' grids stay sized by num_tokens.
struct RankForward {
  int rank = 0;                // a local rank of the workspace's group
  TensorRef x;                 // bf16 [T, H]
  TensorRef topk_idx;          // int32 or int64 [T, k], global expert ids; -1 masks a route
  TensorRef router_weights;    // fp32 [T, k]
  const MoeWeights* weights = nullptr;
  TensorRef out;               // bf16 [T, H], written
  ForwardContext* context = nullptr;  // from make_context(rank)
  cudaStream_t stream = nullptr;
};

// One rank's arguments of a backward call: the forward's inputs and context (the forward's T tokens), the
// output's gradient, and where the gradients go. Every gradient is written (or accumulated) in full; masked routes get
// d_router_weights 0 and contribute nothing to d_x.
struct RankBackward {
  int rank = 0;
  TensorRef x;                        // bf16 [T, H], the forward's
  TensorRef topk_idx;                 // int32 or int64 [T, k], the forward's
  TensorRef router_weights;           // fp32 [T, k], the forward's
  const MoeWeights* weights = nullptr;
  const ForwardContext* context = nullptr;  // the forward's (or recompute_forward_context's)
  TensorRef d_out;                    // bf16 [T, H]
  TensorRef d_x;                      // bf16 [T, H], written
  TensorRef d_router_weights;         // fp32 [T, k], written
  const MoeWeightGrads* weight_grads = nullptr;  // required; a WeightGrad left empty is not computed.
                                      // Separate gate and up gradients (routed, or shared) come from one
                                      // GEMM: both or neither, of one dtype and mode
  cudaStream_t stream = nullptr;
};

class MoeWorkspace {
 public:
  // Allocates the symmetric buffers (collective for NCCL groups) and per-rank scratch. Synchronous. Every
  // rule of the shape and the options (and comm_ctas against the devices' grid) is checked on every rank, and
  // the outcome all-gathered, before the first collective allocation: a rejected argument makes every rank throw
  // with nothing allocated. Every allocation is owned (DeviceBuffer, SymmetricAllocation), so a throw at a later
  // step (a CUDA error) frees what was made (NCCL windows already registered excepted: leaked with a warning, see
  // close).
  MoeWorkspace(const PeerGroup& group, const MoeShape& shape, const MoeOptions& options = {});
  // Frees the local buffers and never calls a collective (docs/design.md, "Lifetimes"): if the workspace holds
  // NCCL windows (an nccl group, not closed) it prints one warning on stderr and leaks them.
  ~MoeWorkspace();
  MoeWorkspace(const MoeWorkspace&) = delete;
  MoeWorkspace& operator=(const MoeWorkspace&) = delete;

  // The collective teardown: every rank calls it (every process of an nccl group, once, in the same order
  // relative to its other workspaces' close and collective calls). Waits for the local ranks' devices,
  // deregisters the NCCL windows (one group call per symmetric buffer) and frees every buffer, symmetric and
  // local; contexts stay valid objects (their memory is their own). For the other groups it frees, without
  // anything collective. Idempotent; every call below afterwards throws std::logic_error naming the call and
  // saying the workspace is closed (the accessors shape(), capacity_rows(), ... keep working). An error
  // (a sticky CUDA error, an NCCL failure) is thrown after every collective step was reached.
  void close();
  bool closed() const { return closed_; }
  // Whether NCCL windows are still registered: what close() must release and the destructor cannot.
  bool needs_close() const;

  // A forward context for local rank `rank` (device memory, detail::context_layout). Its memory is zeroed
  // asynchronously on `stream` (the default: the legacy default stream), which counts as a call of the
  // workspace ("Streams" below): later calls on other streams are ordered after it. No host synchronization.
  // Not during a CUDA-graph capture (it allocates).
  ForwardContext make_context(int rank, cudaStream_t stream = nullptr) const;

  // The calls below take the local ranks this process drives (one per process with NCCL, all of them
  // with device peers or virtual ranks) and issue their kernels phase by phase: every rank's kernels of
  // one phase before any rank's next phase. That order is what virtual ranks need (their kernels share
  // one GPU and stream); other groups get each rank's work on its own stream, unsynchronized with the
  // host. Every call validates all arguments of all ranks before it issues anything
  // (std::invalid_argument naming the rank and the argument); a rank passed twice in one call is refused.

  // Streams. Calls of one workspace share its buffers (symmetric x and combine buffers, scratch, counters,
  // tickets, the status word), so they must not overlap. Calls issued outside a CUDA-graph capture are
  // ordered by the workspace: a call on a stream other than the rank's previous call's waits (on the GPU,
  // cudaStreamWaitEvent) for an event recorded after that call, so two layers issued back to back on two
  // streams run one after the other with the results of one stream. Inside a capture the workspace adds
  // nothing (an event recorded outside the capture cannot be waited on in it): capture the calls of one
  // workspace on one stream, order other streams yourself, and do not launch such a graph concurrently
  // with other calls on the workspace (graph launches are not tracked).

  // All-gathers the top-k ids and builds each rank's schedule into its context. Uses rank, topk_idx,
  // context and stream.
  void build_schedule(std::span<const RankForward> ranks);
  // The layer on the schedules already in the contexts. Each rank's topk_idx must be the ids its context's
  // schedule was built from: a difference is reported in the status word (kStatusIdsMismatch, the first route),
  // and that call's out is unspecified.
  void forward_with_schedule(std::span<const RankForward> ranks);
  // build_schedule, then forward_with_schedule.
  void forward(std::span<const RankForward> ranks);

  // The backward of the forward that filled each rank's context (docs/design.md, "Backward"):
  //   d_hu = d_out_row · W_down (unscaled)   d_rw = <d_hu, h> (fp32)   d_h = rw * d_hu
  //   [d_g, d_u] = SwiGLU backward from the recomputed g, u      d_x_route = [d_g, d_u] · [W_gate; W_up]
  //   d_x[t] = shared dgrad + sum_j d_x_route[t, j] (fp32, j ascending, one rounding)
  //   dW_down_e = sum (rw * d_out)ᵀ h, dW_gate/up_e = sum d_{g,u}ᵀ x over the expert's rows (fixed order)
  // The expert's rank pulls d_out rows from the token's rank and pushes d_x_route rows and d_rw back into
  // the token's (token, slot) slots. Bitwise deterministic; asynchronous, no host synchronization. A context
  // whose schedule no forward (or recompute_forward_context) filled yet, a fresh one or one after a lone
  // build_schedule, is refused (std::invalid_argument). topk_idx must be the ids the context's schedule was
  // built from (the forward's): a difference is reported in the status word (kStatusIdsMismatch), and that
  // call's d_x and d_router_weights are unspecified.
  void backward(std::span<const RankBackward> ranks);
  // Rebuilds each rank's context (expert-major x rows, hidden rows, the shared expert's hidden rows) from x,
  // the weights and the schedule already in the context, without producing `out`: for activation
  // checkpointing (build_schedule first when the context's schedule is not the step's). Uses rank, x,
  // weights, context and stream of each RankForward; the bits equal the forward's. MoeOptions::precision kFP8:
  // the weights' FP8 form as the forward takes them (the transposed copies are not read).
  void recompute_forward_context(std::span<const RankForward> ranks);

  // The rank's status word: everything since the last reset_status (or the workspace's creation), over
  // every layer and step that ran on the workspace: bad expert ids, capacity overflow, spin-wait timeouts,
  // each field keeping its first event. After an error, every `out` since then is unspecified (no memory
  // outside the buffers is touched). After a timeout the rank's abort flag stays set: every later call's
  // waits give up at once (the step fails fast and the report keeps the first cause) until reset_status.
  // Synchronizes `stream` (after ordering it behind the rank's last call, see "Streams" below).
  StatusReport read_status(int rank, cudaStream_t stream) const;
  // Clears the rank's status word and abort flag, and zeroes its side of the cross-rank counters (EP
  // barrier, gather arrivals, epoch), which a timeout leaves out of step with the peers'. Calls issued after
  // it report afresh. Call it on every local rank of every process, and let every rank's reset finish
  // before any rank issues its next call (synchronize the streams; across processes, a host barrier): a
  // peer's next arrival must not land before the reset. Asynchronous on `stream` (a kernel and a memset,
  // CUDA-graph capturable).
  void reset_status(int rank, cudaStream_t stream);
  // The task records of the rank's last megakernel launch, forward or backward (MoeOptions::fused.
  // timeline_records > 0), in CTA order (per CTA its GEMM tiles, then its copies). Synchronizes `stream`.
  std::vector<TaskRecord> read_timeline(int rank, cudaStream_t stream) const;

  const MoeShape& shape() const { return shape_; }
  const PeerGroup& group() const { return group_; }
  int64_t capacity_rows() const { return schedule_.capacity_rows(); }
  int64_t padded_tokens() const { return padded_tokens_; }
  int64_t ring_rows() const { return ring_rows_; }
  int comm_ctas() const { return options_.fused.comm_ctas; }  // the fused path's dedicated communication CTAs
  // Device memory per rank that the backward's buffers take (symmetric d_out and router weights -- none at EP = 1
  // without a shared expert --, d_rw, and the per-rank scratch; docs/design.md, "Backward"); 0 without
  // MoeOptions::backward.
  int64_t backward_bytes() const { return backward_bytes_; }
  // Whether the backward recomputes routed rows' g, u and h: all rows without MoeOptions::keep_gate_up (FP8: from
  // the context's FP8 x rows); with it, the rows past a fused forward's ring when the ring is below the capacity
  // (the kept ones are copied).
  bool recomputes_gate_up() const { return !context_keeps_gate_up() || ring_rows_ < capacity_rows(); }

 private:
  struct RankState;
  struct BackwardScratch;
  void validate(const RankForward& f, bool needs_layer_inputs) const;
  void validate_backward(const RankBackward& b) const;
  void validate_recompute(const RankForward& f) const;
  // The public calls' one sequence: validate every rank (the layer's inputs too when `layer`), order behind
  // the rank's previous call, issue the schedule and/or the layer, record the call's event.
  void issue_call(std::span<const RankForward> ranks, bool schedule, bool layer);
  void issue_schedule(std::span<const RankForward> ranks);
  // check_ids: the call did not build its schedule (forward_with_schedule), so the combine checks its topk_idx
  // against the ids the schedule was built from.
  void issue_layer(std::span<const RankForward> ranks, bool check_ids);
  void publish(const RankForward& f);
  void publish_x(const RankForward& f);  // publish's and recompute_publish's first step
  void compute(const RankForward& f);
  void compute_fused(const RankForward& f);
  // What both megakernel launches (forward, backward) take for the rank's schedule, besides their GEMMs and
  // buffers; counters and tickets: the pass's.
  detail::MegakernelArgs megakernel_args(int rank, const ScheduleView& schedule, uint64_t* counters,
                                         int32_t* tickets) const;
  // The two GEMMs (gate/up with SwiGLU, down) of the rank's routed experts or of its shared expert, as both
  // paths run them (the fused one inside its kernel).
  void routed_gemms(const RankForward& f, ExpertGemmArgs& gate_up, ExpertGemmArgs& down) const;
  void shared_gemms(const RankForward& f, ExpertGemmArgs& gate_up, ExpertGemmArgs& down) const;
  void combine(const RankForward& f, bool check_ids);
  // The backward's phases (src/host/moe_backward.cu): publish x, d_out and router weights, then the
  // shared expert's backward; pull rows, the routed experts' dgrads, push d_x rows and d_rw, then their
  // weight gradients; the token-side epilogue.
  void allocate_backward();
  void backward_publish(const RankBackward& b);
  void shared_backward(const RankBackward& b);
  void backward_experts(const RankBackward& b);
  void backward_fused(const RankBackward& b);  // FusedOptions::backward_megakernel: both MLPs in one launch
  bool backward_megakernel() const {
    return options_.backward && options_.path == ForwardPath::kFused && options_.fused.backward_megakernel;
  }
  bool fp8() const { return options_.precision == Precision::kFP8; }
  // The weight gradients' GEMMs in FP8 (precision kFP8 without MoeOptions::bf16_weight_gradients).
  bool fp8_weight_gradients() const { return fp8() && !options_.bf16_weight_gradients; }
  // Their activation factors (x, h: each GEMM's b) quantized per 128 rows x 128 columns, the quantization's scales and
  // the GEMM's promotion alike (unless MoeOptions::fp8_weight_gradient_columns).
  bool fp8_activation_blocks() const { return fp8_weight_gradients() && !options_.fp8_weight_gradient_columns; }
  // The forward's context holds each row's g | u and h (MoeOptions::keep_gate_up; in FP8 only with the backward,
  // bf16 g | u and h beside the quantized h: detail::context_keeps_gate_up).
  bool context_keeps_gate_up() const;
  // The local combine (docs/design.md, "The combine at EP = 1"): with one rank every expert row is this rank's,
  // so the combine reads the expert-major rows through the schedule's route_row and nothing is pushed: the
  // stage-kernel backward's d_x rows; not with scatter_rows (the rows are in the combine buffer then).
  bool local_combine() const { return shape_.ep_size == 1 && !options_.scatter_rows; }
  // The forward's: y must hold every row (the unfused path's does; the fused path's ring, the whole capacity).
  bool combine_in_place() const { return local_combine() && ring_rows_ == capacity_rows(); }
  // Bytes of a pulled x row, the context's row stride: bf16 2H; FP8, the e4m3 values and their scales, rounded up
  // to 16 (detail::fp8_row_bytes, src/host/quantize_fp8.h).
  int64_t pulled_row_bytes() const;
  void backward_epilogue(const RankBackward& b);
  // The shared (or routed) MLP's five backward GEMMs as both paths run them; the routed rows whose g | u
  // are copied from the context (a small ring's) and that copy; where the pull reads rows from.
  detail::MlpBackwardGemms mlp_backward_gemms(const RankBackward& b, bool shared) const;
  int32_t kept_gate_up_rows() const;
  void copy_kept_gate_up(const RankBackward& b) const;
  backward::GradPullSources grad_pull_sources(const RankBackward& b) const;
  // FP8 weight gradients: the routed dy and x quantized along the rows as the pull reads them.
  void quantize_pulled_columns(const RankBackward& b, const backward::GradPullSources& sources) const;
  // recompute_forward_context's phases: publish x (and the shared expert's hidden rows); pull the kept
  // rows and recompute their hidden rows; the closing barrier.
  void recompute_publish(const RankForward& f);
  void recompute_rows(const RankForward& f);
  void recompute_finish(const RankForward& f);
  // The EP barrier's halves and the dispatch pull, issued by the forward, the backward and the recompute
  // (src/host/moe.cu holds their kernels' one home).
  void barrier_arrive(int rank, cudaStream_t stream) const;
  void barrier_wait(int rank, cudaStream_t stream) const;
  // Pulls schedule rows [0, min(scheduled rows, row_limit)) of f's context from their source ranks' x.
  void pull_rows(const RankForward& f, int64_t row_limit) const;
  // Token rows read in place (docs/design.md, "Token rows at EP = 1"): with one rank, no shared expert and bf16
  // rows, no peer reads a call's x, d_out or router weights and no kernel reads past its tokens, so the kernels
  // read the caller's tensors, nothing is published, and x_, d_out_ and rw_ are not allocated.
  bool reads_token_rows_in_place() const { return shape_.ep_size == 1 && !shape_.shared_expert && !fp8(); }
  // What the kernels read a call's token rows (or router weights) from: `buffer`'s copies, or the call's own
  // tensor `call_rows` when they are read in place.
  PeerPointers token_rows(const SymmetricAllocation& buffer, int rank, const void* call_rows) const;
  // Copies a call's `tokens` rows [tokens, H] (bf16) into the rank's symmetric `dst` [padded T, H] and zeroes
  // rows [tokens, padded T): rows past a call's tokens read as zeros (the shared expert's GEMMs read whole
  // padded tiles, and its weight gradients sum over them). Asynchronous on `stream`. Not called when the rows
  // are read in place.
  void publish_token_rows(void* dst, const void* src, int64_t tokens, cudaStream_t stream) const;
  const RankState& state(int rank) const;
  void require_open(const char* call) const;  // std::logic_error "MoeWorkspace::<call>: ... closed" after close
  // Where the rank's standalone GEMMs' waits report (its status word) and their timeout.
  WaitBound wait_bound(int rank) const;
  void begin_call(int rank, cudaStream_t stream) const;  // waits for the rank's previous call (other stream)
  void end_call(int rank, cudaStream_t stream) const;    // records this call's event

  PeerGroup group_;
  MoeShape shape_;
  MoeOptions options_;
  int64_t padded_tokens_ = 0;   // T rounded up to the GEMM row tile
  int64_t ring_rows_ = 0;       // expert-side rows held at once (the fused path's macrobatch)
  int grid_ctas_ = 0;           // the megakernel's persistent grid (the same GPU model on every rank)
  ScheduleWorkspace schedule_;
  SymmetricAllocation x_;       // bf16 [padded T, H] per rank: the rows peers pull (none when read in place)
  SymmetricAllocation combined_;  // bf16 [T * k, H] per rank: expert outputs pushed by the experts' ranks
  SymmetricAllocation flags_;   // barrier counters, see src/device/common/peer_barrier.cuh
  // The backward's (MoeOptions::backward): d_out and the router weights published for the experts' ranks
  // to pull, and d_rw pushed back into (token, slot); the combine buffer takes the d_x_route rows.
  SymmetricAllocation d_out_;   // bf16 [padded T, H] per rank (padding rows stay zero; none when read in place)
  SymmetricAllocation rw_;      // fp32 [T * k] (none when read in place)
  SymmetricAllocation d_rw_;    // fp32 [T * k]
  int64_t backward_bytes_ = 0;
  bool closed_ = false;
  uint64_t id_ = 0;             // unique in the process: what a context names its workspace by (an address of a
                                // destroyed workspace may come back as a new one's)
  std::unique_ptr<RankState[]> ranks_;
};

}  // namespace mok
