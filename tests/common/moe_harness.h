// Drives the MoE layer for every local rank of a peer group from host data (tests and the main program):
// uploads each rank's slice of a global problem, runs MoeWorkspace::forward (and backward) and reads back.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/moe.h"
#include "reference/moe_reference.h"
#include "reference/routing_gen.h"
#include "tests/common/moe_check.h"

namespace mok::testing {

// One problem for all ranks, in the CPU reference's global layout; every value is exactly a bf16.
struct LayerData {
  reference::LayerShape shape;
  reference::LayerParams<float> params;
  reference::LayerInputs<float> inputs;
};

MoeShape moe_shape(int ep_size, int num_tokens, int top_k, int num_experts, int hidden, int intermediate,
                   bool shared_expert = true);
reference::LayerShape reference_shape(const MoeShape& shape);
// A model shape (reference/routing_gen.h) scaled down for the CPU reference: experts / 8, hidden 512 (576
// when the model's H is not a multiple of 256, keeping a partial last n-block) and intermediate scaled like
// the model's I / H (192 when the model's I is not a multiple of 128).
MoeShape scaled_model_shape(const reference::ModelShape& model, int ep_size, int num_tokens);

// x ~ N(0, 1); weights ~ N(0, 1 / fan_in); routing: softmax top-k of N(0, 1) logits, with a Zipf-like
// expert bias when skew > 0 (reference/routing_gen.h); a fraction of the routes masked with -1. Rounded
// to bf16.
LayerData random_layer(const MoeShape& shape, uint64_t seed, double skew = 0, double masked_fraction = 0);

// Provenance problem: every output value is an exact small integer that encodes where it came from.
//   x[src, t] = (1, src + 1, t % 64, t / 64, hashed in [-4, 4] ...)       (needs T <= 4096, H >= I + 3)
//   every expert e: g = 32 (silu(32) == 32 in fp32), u = x[:I], so h = 32 * x[:I]; y[:I] = x[:I],
//   y[I] = (e + 1) % 16, y[I + 1] = (e + 1) / 16; the shared expert: y[:I] = x[:I], y[I + 2] = 100.
//   router weight 1 on slot `hot_slot`, 0 elsewhere; a fraction of the routes masked.
// So out[t] = (2 x[:I] or x[:I] if the hot route is masked, the hot expert's id, 100, zeros).
LayerData provenance_layer(const MoeShape& shape, uint64_t seed, double masked_fraction, int hot_slot);
// Empty when rank `rank`'s output is exactly what provenance_layer encodes; else the first mismatch.
std::string check_provenance(const LayerData& data, int rank, const std::vector<uint16_t>& out);

// d_out of every global token [N, H]: N(0, 1) values rounded to bf16.
std::vector<float> random_d_out(const MoeShape& shape, uint64_t seed);

// The six weight gradients, in MoeWeightGrads order.
enum class GradTensor : int { kExpertGate = 0, kExpertUp, kExpertDown, kSharedGate, kSharedUp, kSharedDown };
inline constexpr int kNumGradTensors = 6;
const char* grad_tensor_name(GradTensor which);

// How the harness makes one weight gradient: its dtype (bf16 or fp32) and mode; `compute` false leaves it
// empty (not computed).
struct GradSetup {
  DType dtype = DType::kFloat32;
  GradMode mode = GradMode::kWrite;
  bool compute = true;
};
using GradSetups = std::array<GradSetup, kNumGradTensors>;
GradSetups all_grads(DType dtype, GradMode mode);

class MoeHarness {
 public:
  // Virtual ranks share one stream; other groups get a stream per local rank.
  MoeHarness(PeerGroup group, const MoeShape& shape, const MoeOptions& options = {});
  // Frees the buffers; closes the workspace when this process drives every rank of the group (no peer can be
  // left waiting in the collective), else only close() does (docs/design.md, "Lifetimes").
  ~MoeHarness();
  // Synchronizes the streams, then MoeWorkspace::close: collective, every process of an NCCL group calls it.
  void close();
  MoeHarness(const MoeHarness&) = delete;
  MoeHarness& operator=(const MoeHarness&) = delete;

  // Copies each local rank's slice of `data` to its GPU; ids as int32 or int64. Like every call below that
  // writes device buffers from the host (fills, routing, poison, d_out), it returns when the bytes have landed.
  void upload(const LayerData& data, DType index_dtype = DType::kInt32);
  // Switches every rank's routed weights to one fused [E_local, 2I, H] tensor (each expert's gate rows, then
  // its up rows) holding `data`'s values; expert_up becomes empty. Call after upload.
  void use_fused_gate_up(const LayerData& data);
  // Large problems without host copies: weights and x from device_fill's hash (integers in [-range, range]
  // times `scale`, exact in bf16), routing from the host.
  void fill_hashed(uint64_t seed, int range, float weight_scale, float x_scale);
  void upload_routing(const std::vector<std::vector<int32_t>>& topk, const std::vector<std::vector<float>>& weights);

  // From now on rank `rank`'s calls pass only its first `tokens` tokens (in [0, num_tokens]; the uploaded
  // rows past them stay in the buffers, unused): the first extent of x, topk_idx, router_weights and out,
  // and of the backward's d_out, d_x and d_router_weights; their pointers null at 0 tokens. Call it after
  // upload (which passes every token again).
  void set_call_tokens(int rank, int tokens);
  // Fills every local rank's `out` with a bf16 NaN (synchronous).
  void poison_outputs();
  // poison_outputs, then issues the forward of all local ranks. Asynchronous.
  void forward();
  void synchronize();
  std::vector<uint16_t> out_bits(int rank);  // synchronizes
  // `runs` forwards; after each, every local rank's output (rank order). Throws std::runtime_error with the
  // report when a status word records an error.
  std::vector<std::vector<uint16_t>> run_checked(int runs);
  StatusReport status(int rank);            // synchronizes
  // MoeWorkspace::reset_status on every local rank, then waits for the resets (the cross-rank counters they
  // zero must be zero everywhere before the next call).
  void reset_status();

  // The rank's device tensors, for check_rows_fp32.
  CheckRank check_rank(int rank) const;
  CheckShared check_shared(int rank) const;

  // Backward (MoeOptions::backward, the default). Gradient buffers are allocated on first use.
  // Copies each local rank's slice of the global d_out [N, H] (values exactly bf16) to its GPU.
  void upload_d_out(const std::vector<float>& d_out);
  // (Re)allocates every rank's weight gradients as `setups` says, laid out as the current weights (fused
  // gate/up after use_fused_gate_up: expert_gate's gradient [E_local, 2I, H], expert_up's empty), zero-
  // filled. Until called: all fp32, written.
  void set_grads(const GradSetups& setups);
  // Fills every gradient the next backward writes (d_x, d_router_weights, written weight gradients) with
  // NaN bits (0xff bytes; d_x and d_router_weights whole, also the rows past a call's tokens); accumulated
  // ones keep their values. Synchronous.
  void poison_grads();
  void zero_weight_grads();  // synchronous
  // poison_grads, then MoeWorkspace::backward of every local rank (with the forward's arguments of
  // all_args(), so a context swapped there is the one used). Asynchronous.
  void backward();
  // Every local rank's backward arguments as backward() passes them (rank order).
  const std::vector<RankBackward>& all_backward_args();
  std::vector<uint16_t> d_x_bits(int rank);          // synchronizes
  std::vector<float> d_router_weights(int rank);     // synchronizes
  // The rank's gradient of `which` as fp32 values in the reference's layout (gate and up apart even when
  // fused); empty when not computed. Synchronizes.
  std::vector<float> weight_grad(int rank, GradTensor which);
  // The rank's gradient outputs as raw bytes by name (d_x, d_router_weights, then each computed weight
  // gradient), for bitwise comparisons. Synchronizes.
  std::vector<std::pair<std::string, std::vector<uint8_t>>> raw_grads(int rank);
  // What a context keeps, as bf16 bits: expert rows [ring, H], hidden [ring, I], shared hidden [padded T, I].
  std::vector<uint16_t> context_bits(const ForwardContext& context);  // synchronizes
  // Throws std::runtime_error with the report when a local rank's status word records an error.
  void check_status();

  MoeWorkspace& workspace() { return *workspace_; }
  const PeerGroup& group() const { return group_; }
  RankForward& args(int rank);
  cudaStream_t stream(int rank) const;
  // All local ranks' arguments, in rank order (what MoeWorkspace's calls take).
  const std::vector<RankForward>& all_args() const { return args_; }

 private:
  struct RankBuffers;
  PeerGroup group_;
  MoeShape shape_;
  std::unique_ptr<MoeWorkspace> workspace_;
  std::vector<cudaStream_t> streams_;
  void ensure_backward();
  // Waits until every host copy and memset issued to the local ranks' devices has landed. The harness's streams
  // are non-blocking: they do not wait for the legacy stream, where cudaMemcpy from pageable memory returns
  // once its bytes are staged (before they land) and cudaMemset returns at once. Every call that writes device
  // buffers from the host ends with it.
  void landed();
  std::vector<std::unique_ptr<RankBuffers>> buffers_;  // [ep_size], null for non-local ranks
  std::vector<RankForward> args_;                      // local ranks
  std::vector<RankBackward> backward_args_;            // local ranks, once ensure_backward ran
  RankForward& local_args(int rank);
  GradSetups grad_setups_ = all_grads(DType::kFloat32, GradMode::kWrite);
};

// The shared expert's gradients of rank `rank`'s tokens alone (each rank's shared weights see its own tokens; the
// caller all-reduces them): reference::backward on that rank's slice with every route masked, on `params` (the data's,
// or their FP8 form) with `recipe`; magnitudes as reference::backward's.
reference::LayerGrads<float> shared_reference(const LayerData& data, const reference::LayerParams<float>& params,
                                              const std::vector<float>& d_out, int rank, bool magnitudes,
                                              const reference::Fp8Recipe& recipe = {});

// The problem of exactly `tokens` tokens per rank, and its d_out: each rank's first `tokens` of `data` and `d_out`
// (a workspace made for that T runs it).
std::pair<LayerData, std::vector<float>> exactly_tokens(const LayerData& data, const std::vector<float>& d_out,
                                                        int tokens);

// Every local rank's raw_grads (rank order), and the first difference between two of them ("" when bitwise equal,
// else the first differing tensor, rank and byte).
using RawGrads = std::vector<std::vector<std::pair<std::string, std::vector<uint8_t>>>>;  // [rank][tensor]
RawGrads raw_grads(MoeHarness& harness);
std::string first_difference(const RawGrads& got, const RawGrads& want);
// Every local rank's six weight gradients (MoeHarness::weight_grad) at [local rank index * kNumGradTensors + tensor],
// and every local rank's token-side gradients as bytes (d_x, then d_router_weights; rank order).
using WeightGrads = std::vector<std::vector<float>>;
WeightGrads all_weight_grads(MoeHarness& harness);
std::vector<std::vector<uint8_t>> token_grads(MoeHarness& harness);
// GradMode's bitwise rules over all_weight_grads: "" when every element of `got` is `written` rounded to bf16 (a bf16
// write), or (0 + first) + second in fp32 (two micro-batches accumulated onto zeros, in the GPU's order); else the
// first differing tensor and element.
std::string bf16_write_difference(const WeightGrads& got, const WeightGrads& written);
std::string accumulation_difference(const WeightGrads& got, const WeightGrads& first, const WeightGrads& second);
// bf16 bits as float values.
std::vector<float> bf16_values(const std::vector<uint16_t>& bits);

// Largest |gpu - ref| / (2^-6 * (|ref| + rms(ref)) + extra[n]) over a rank's output, and where it is; NaN
// counts as infinitely far. The budget covers the bf16 roundings of hidden, expert and shared outputs and of
// out, while those partial outputs do not cancel; `extra` (optional, per element) adds what rounding them
// costs when they do (check_against_reference: 2^-8 * (|shared| + sum_j |rw_j * y_j|)).
struct BudgetResult {
  double worst_ratio = 0;
  int64_t worst_index = -1;
  float got = 0;
  double want = 0;
  std::string describe(int hidden) const;
};
BudgetResult compare_within_budget(const std::vector<uint16_t>& gpu, const float* ref, int64_t count,
                                   const float* extra = nullptr);

}  // namespace mok::testing
