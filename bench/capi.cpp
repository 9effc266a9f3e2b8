// C entry points for the Python benchmarks (ctypes), so they can run our kernels on PyTorch's tensors in
// the same process as the PyTorch baselines. Not a public API: the Python package (nanobind) replaces it.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "mok/expert_gemm.h"
#include "mok/moe.h"
#include "mok/timeline.h"
#include "mok/weight_grad_gemm.h"
#include "src/host/check.h"
#include "src/host/moe_args.h"
#include "src/host/nccl_setup.h"
#include "src/host/option_table.h"
#include "src/host/quantize_fp8.h"

namespace {

using mok::detail::check_nccl;

int report(const std::exception& e, char* error, int error_len) {
  if (error != nullptr && error_len > 0) {
    std::strncpy(error, e.what(), error_len - 1);
    error[error_len - 1] = '\0';
  }
  return 1;
}

// One rank's layer: its NCCL communicator (EP > 1), the workspace and one forward context.
struct BenchLayer {
  ncclComm_t comm = nullptr;
  std::unique_ptr<mok::PeerGroup> group;
  std::unique_ptr<mok::MoeWorkspace> workspace;
  mok::ForwardContext context;
  int rank = 0;
  int device = 0;
  // mok_bench_layer_destroy, which every rank calls: the collective teardown (the workspace's windows, then the
  // communicator) is explicit there, not left to a destructor.
  void close() {
    context = mok::ForwardContext();
    if (workspace != nullptr) workspace->close();
    workspace.reset();
    if (comm != nullptr) ncclCommDestroy(comm);
    comm = nullptr;
  }
  // A create that threw holds no windows: every rank threw together (MoeWorkspace agrees on the shape first), or
  // this one gave up waiting for the others (setup_timeout_s) with an operation of the communicator still
  // pending. Either way abort it: local, it never waits for a peer (ncclCommDestroy would wait for that operation).
  ~BenchLayer() {
    if (workspace == nullptr && comm != nullptr) (void)ncclCommAbort(comm);
  }
};

// The layer behind a handle of mok_bench_layer_create; a null handle is an argument error, not a crash.
BenchLayer& layer_of(void* handle) {
  if (handle == nullptr) throw std::invalid_argument("handle: null (mok_bench_layer_create returned NULL?)");
  return *static_cast<BenchLayer*>(handle);
}

mok::DType index_dtype(int topk_dtype) {
  if (topk_dtype != 0 && topk_dtype != 1)
    throw std::invalid_argument("topk_dtype: must be 0 (int32) or 1 (int64), got " + std::to_string(topk_dtype));
  return topk_dtype == 1 ? mok::DType::kInt64 : mok::DType::kInt32;
}

// The layer's weights from the caller's pointers (separate gate and up; no shared tensors without a shared
// expert), as mok_bench_layer_forward builds them.
mok::MoeWeights layer_weights(const mok::MoeShape& s, const void* expert_gate, const void* expert_up,
                              const void* expert_down, const void* shared_gate, const void* shared_up,
                              const void* shared_down) {
  using mok::DType;
  using mok::TensorRef;
  const int64_t h = s.hidden, i = s.intermediate, e = s.local_experts();
  mok::MoeWeights w;
  w.expert_gate = TensorRef(expert_gate, DType::kBFloat16, {e, i, h});
  w.expert_up = TensorRef(expert_up, DType::kBFloat16, {e, i, h});
  w.expert_down = TensorRef(expert_down, DType::kBFloat16, {e, h, i});
  if (s.shared_expert) {
    w.shared_gate = TensorRef(shared_gate, DType::kBFloat16, {i, h});
    w.shared_up = TensorRef(shared_up, DType::kBFloat16, {i, h});
    w.shared_down = TensorRef(shared_down, DType::kBFloat16, {h, i});
  }
  return w;
}

// mok_bench_layer_backward's gradient arrays: kNumGrads entries in MoeWeightGrads' order.
constexpr int kNumGrads = 6;
constexpr const char* kGradNames[kNumGrads] = {"expert_gate", "expert_up", "expert_down",
                                               "shared_gate", "shared_up", "shared_down"};

// Checks the codes of every entry (dtype 0 bf16, 1 fp32; mode 0 GradMode::kWrite, 1 kAccumulate), so a bad one is
// rejected before anything else is looked at.
void check_grad_codes(void* const* grads, const int32_t* dtypes, const int32_t* modes) {
  if (grads == nullptr || dtypes == nullptr || modes == nullptr)
    throw std::invalid_argument("grads, grad_dtypes, grad_modes: must each point to " + std::to_string(kNumGrads) +
                                " entries");
  for (int n = 0; n < kNumGrads; ++n) {
    if (dtypes[n] != 0 && dtypes[n] != 1)
      throw std::invalid_argument(std::string(kGradNames[n]) + ": grad dtype must be 0 (bf16) or 1 (fp32), got " +
                                  std::to_string(dtypes[n]));
    if (modes[n] != 0 && modes[n] != 1)
      throw std::invalid_argument(std::string(kGradNames[n]) + ": grad mode must be 0 (write) or 1 (accumulate), got " +
                                  std::to_string(modes[n]));
  }
}

// Entry n of the checked arrays as a WeightGrad of `shape`; a null pointer leaves it empty (not computed).
mok::WeightGrad weight_grad(void* const* grads, const int32_t* dtypes, const int32_t* modes, int n,
                            std::initializer_list<int64_t> shape) {
  mok::WeightGrad g;
  if (grads[n] == nullptr) return g;
  g.grad = mok::TensorRef(grads[n], dtypes[n] == 1 ? mok::DType::kFloat32 : mok::DType::kBFloat16, shape);
  g.mode = modes[n] == 1 ? mok::GradMode::kAccumulate : mok::GradMode::kWrite;
  return g;
}

// MoeWeights' FP8 form from `weights`: 12 pointers (each weight of mok_bench_layer_forward, separate gate and up,
// e4m3, then its fp32 block scales), and with `transposed` 8 more: the FP8 backward's transposed copies, each then its
// scales (expert_gate_up_t [E, H, 2I], expert_down_t [E, I, H], shared_gate_up_t [H, 2I], shared_down_t [I, H]).
mok::MoeWeights fp8_weights(const mok::MoeShape& s, const void* const* weights, bool transposed) {
  if (weights == nullptr)
    throw std::invalid_argument(std::string("weights: must hold ") + (transposed ? "20" : "12") + " pointers");
  const int64_t h = s.hidden, i = s.intermediate, e = s.local_experts();
  const int64_t hb = (h + 127) / 128, ib = (i + 127) / 128, ib2 = (2 * i + 127) / 128;
  using mok::DType;
  using mok::TensorRef;
  const DType q = DType::kFloat8E4M3, f32 = DType::kFloat32;
  mok::MoeWeights w;
  w.expert_gate = TensorRef(weights[0], q, {e, i, h});
  w.expert_gate_scales = TensorRef(weights[1], f32, {e, ib, hb});
  w.expert_up = TensorRef(weights[2], q, {e, i, h});
  w.expert_up_scales = TensorRef(weights[3], f32, {e, ib, hb});
  w.expert_down = TensorRef(weights[4], q, {e, h, i});
  w.expert_down_scales = TensorRef(weights[5], f32, {e, hb, ib});
  if (s.shared_expert) {
    w.shared_gate = TensorRef(weights[6], q, {i, h});
    w.shared_gate_scales = TensorRef(weights[7], f32, {ib, hb});
    w.shared_up = TensorRef(weights[8], q, {i, h});
    w.shared_up_scales = TensorRef(weights[9], f32, {ib, hb});
    w.shared_down = TensorRef(weights[10], q, {h, i});
    w.shared_down_scales = TensorRef(weights[11], f32, {hb, ib});
  }
  if (!transposed) return w;
  w.expert_gate_up_t = TensorRef(weights[12], q, {e, h, 2 * i});
  w.expert_gate_up_t_scales = TensorRef(weights[13], f32, {e, hb, ib2});
  w.expert_down_t = TensorRef(weights[14], q, {e, i, h});
  w.expert_down_t_scales = TensorRef(weights[15], f32, {e, ib, hb});
  if (s.shared_expert) {
    w.shared_gate_up_t = TensorRef(weights[16], q, {h, 2 * i});
    w.shared_gate_up_t_scales = TensorRef(weights[17], f32, {hb, ib2});
    w.shared_down_t = TensorRef(weights[18], q, {i, h});
    w.shared_down_t_scales = TensorRef(weights[19], f32, {ib, hb});
  }
  return w;
}

// The layer's forward on `layer`'s rank with weights `w` (mok_bench_layer_forward's and _forward_fp8's).
void forward_with(BenchLayer& layer, const void* x, const void* topk_idx, int topk_dtype, const float* router_weights,
                  const mok::MoeWeights& w, void* out, void* stream) {
  using mok::DType;
  using mok::TensorRef;
  const mok::MoeShape& s = layer.workspace->shape();
  const int64_t t = s.num_tokens, k = s.top_k, h = s.hidden;
  mok::RankForward f;
  f.rank = layer.rank;
  f.x = TensorRef(x, DType::kBFloat16, {t, h});
  f.topk_idx = TensorRef(topk_idx, topk_dtype == 1 ? DType::kInt64 : DType::kInt32, {t, k});
  f.router_weights = TensorRef(router_weights, DType::kFloat32, {t, k});
  f.weights = &w;
  f.out = TensorRef(out, DType::kBFloat16, {t, h});
  f.context = &layer.context;
  f.stream = static_cast<cudaStream_t>(stream);
  layer.workspace->forward({&f, 1});
}

// The backward of `layer`'s last forward with weights `w` (mok_bench_layer_backward's and _backward_fp8's).
void backward_with(BenchLayer& layer, const void* x, const void* topk_idx, int topk_dtype, const float* router_weights,
                   const mok::MoeWeights& w, const void* d_out, void* d_x, float* d_router_weights,
                   void* const* grads, const int32_t* grad_dtypes, const int32_t* grad_modes, void* stream) {
  const mok::DType ids = index_dtype(topk_dtype);
  check_grad_codes(grads, grad_dtypes, grad_modes);
  const mok::MoeShape& s = layer.workspace->shape();
  const int64_t t = s.num_tokens, k = s.top_k, h = s.hidden, i = s.intermediate, e = s.local_experts();
  using mok::DType;
  using mok::TensorRef;
  mok::MoeWeightGrads g;
  g.expert_gate = weight_grad(grads, grad_dtypes, grad_modes, 0, {e, i, h});
  g.expert_up = weight_grad(grads, grad_dtypes, grad_modes, 1, {e, i, h});
  g.expert_down = weight_grad(grads, grad_dtypes, grad_modes, 2, {e, h, i});
  if (s.shared_expert) {
    g.shared_gate = weight_grad(grads, grad_dtypes, grad_modes, 3, {i, h});
    g.shared_up = weight_grad(grads, grad_dtypes, grad_modes, 4, {i, h});
    g.shared_down = weight_grad(grads, grad_dtypes, grad_modes, 5, {h, i});
  }
  mok::RankBackward b;
  b.rank = layer.rank;
  b.x = TensorRef(x, DType::kBFloat16, {t, h});
  b.topk_idx = TensorRef(topk_idx, ids, {t, k});
  b.router_weights = TensorRef(router_weights, DType::kFloat32, {t, k});
  b.weights = &w;
  b.context = &layer.context;
  b.d_out = TensorRef(d_out, DType::kBFloat16, {t, h});
  b.d_x = TensorRef(d_x, DType::kBFloat16, {t, h});
  b.d_router_weights = TensorRef(d_router_weights, DType::kFloat32, {t, k});
  b.weight_grads = &g;
  b.stream = static_cast<cudaStream_t>(stream);
  layer.workspace->backward({&b, 1});
}

// The weight-gradient entries' arguments (bf16 as given; the FP8 entry adds its precision and scales).
mok::WeightGradArgs weight_grad_args(const void* a, const void* b, int64_t rows_allocated, int m, int n,
                                     int local_experts, const int32_t* expert_row_offsets,
                                     const int32_t* scheduled_rows, int tile_m, int output, void* out, void* out_split,
                                     int m_split, int32_t* ticket, void* status, double wait_timeout_s) {
  mok::WeightGradArgs args;
  args.a = a;
  args.b = b;
  args.rows_allocated = rows_allocated;
  args.m = m;
  args.n = n;
  args.local_experts = local_experts;
  args.expert_row_offsets = expert_row_offsets;
  args.scheduled_rows = scheduled_rows;
  args.tile_m = tile_m;
  args.output = static_cast<mok::GradOutput>(output);
  args.out = out;
  args.out_split = out_split;
  args.m_split = m_split;
  args.ticket = ticket;
  args.waits = {static_cast<mok::DeviceStatus*>(status), wait_timeout_s, 0};
  return args;
}

}  // namespace

extern "C" {

int mok_bench_nccl_unique_id(void* out, char* error, int error_len) {
  try {
    static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES, "the Python side passes 128 bytes");
    ncclUniqueId id;
    if (out == nullptr) throw std::invalid_argument("out: must point to 128 bytes");
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::memcpy(out, &id, sizeof(id));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// Collective over the ranks for ep_size > 1 (NCCL communicator from the unique id, symmetric windows). The
// layer's shape and options by name: `num_options` pairs names[i] = values[i], as text, named as the rows of the
// option table (src/host/option_table.h: the fields of Python's LayerShape and Config, and timeline_records), e.g.
// "num_tokens" = "8192", "path" = "unfused", "backward_megakernel" = "true", "load_factor" = "2.5"; a name left
// out keeps the C++ default (ep_size 1). An unknown name, a value that does not parse or a name given twice:
// NULL, with the error naming it.
void* mok_bench_layer_create(const void* nccl_unique_id, int rank, int device, int num_options,
                             const char* const* names, const char* const* values, char* error, int error_len) {
  try {
    if (num_options < 0 || (num_options > 0 && (names == nullptr || values == nullptr)))
      throw std::invalid_argument("names, values: must each point to num_options = " + std::to_string(num_options) +
                                  " strings");
    mok::detail::LayerOptions options;
    std::set<std::string> given;
    for (int i = 0; i < num_options; ++i) {
      if (names[i] == nullptr || values[i] == nullptr)
        throw std::invalid_argument("option " + std::to_string(i) + ": a null name or value");
      if (!given.insert(names[i]).second) throw std::invalid_argument(std::string("option ") + names[i] + ": given twice");
      mok::detail::set_option_text(options, names[i], values[i]);
    }
    const int ep_size = options.shape.ep_size;
    auto layer = std::make_unique<BenchLayer>();
    layer->rank = rank;
    layer->device = device;
    if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
    if (ep_size > 1) {
      if (nccl_unique_id == nullptr)
        throw std::invalid_argument("nccl_unique_id: null, but ep_size = " + std::to_string(ep_size) +
                                    " needs the 128 bytes of mok_bench_nccl_unique_id");
      ncclUniqueId id;
      std::memcpy(&id, nccl_unique_id, sizeof(id));
      // Nonblocking, so that every setup wait is bounded by setup_timeout_s (src/host/nccl_setup.h).
      const double timeout_s = options.options.setup_timeout_s;
      mok::detail::validate_setup_timeout(timeout_s);
      layer->comm = mok::detail::init_nccl_comm(ep_size, id, rank, timeout_s);
      layer->group = std::make_unique<mok::PeerGroup>(mok::PeerGroup::nccl({layer->comm}, timeout_s));
    } else {
      layer->group = std::make_unique<mok::PeerGroup>(mok::PeerGroup::virtual_ranks(1, device));
    }
    layer->workspace = std::make_unique<mok::MoeWorkspace>(*layer->group, options.shape, options.options);
    layer->context = layer->workspace->make_context(rank);
    return layer.release();
  } catch (const std::exception& e) {
    report(e, error, error_len);
    return nullptr;
  }
}

// Asynchronous on `stream`; topk_dtype: 0 for int32 ids, 1 for int64 ids.
int mok_bench_layer_forward(void* handle, const void* x, const void* topk_idx, int topk_dtype,
                            const float* router_weights, const void* expert_gate, const void* expert_up,
                            const void* expert_down, const void* shared_gate, const void* shared_up,
                            const void* shared_down, void* out, void* stream, char* error, int error_len) {
  try {
    if (topk_dtype != 0 && topk_dtype != 1)
      throw std::invalid_argument("topk_dtype: must be 0 (int32) or 1 (int64), got " + std::to_string(topk_dtype));
    auto* layer = &layer_of(handle);
    const mok::MoeShape& s = layer->workspace->shape();
    const int64_t h = s.hidden, i = s.intermediate, e = s.local_experts();
    using mok::DType;
    using mok::TensorRef;
    mok::MoeWeights w;
    w.expert_gate = TensorRef(expert_gate, DType::kBFloat16, {e, i, h});
    w.expert_up = TensorRef(expert_up, DType::kBFloat16, {e, i, h});
    w.expert_down = TensorRef(expert_down, DType::kBFloat16, {e, h, i});
    if (s.shared_expert) {
      w.shared_gate = TensorRef(shared_gate, DType::kBFloat16, {i, h});
      w.shared_up = TensorRef(shared_up, DType::kBFloat16, {i, h});
      w.shared_down = TensorRef(shared_down, DType::kBFloat16, {h, i});
    }
    forward_with(*layer, x, topk_idx, topk_dtype, router_weights, w, out, stream);
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// The forward of a layer made with precision "fp8" (MoeOptions::precision kFP8): the weights as
// mok_bench_layer_forward's (separate gate and up), e4m3, each followed by its fp32 block scales (weights[2 n] the
// values, weights[2 n + 1] the scales, n in MoeWeights' order; include/mok/moe.h has the scales' shapes). The
// rest as mok_bench_layer_forward.
int mok_bench_layer_forward_fp8(void* handle, const void* x, const void* topk_idx, int topk_dtype,
                                const float* router_weights, const void* const* weights, void* out, void* stream,
                                char* error, int error_len) {
  try {
    if (topk_dtype != 0 && topk_dtype != 1)
      throw std::invalid_argument("topk_dtype: must be 0 (int32) or 1 (int64), got " + std::to_string(topk_dtype));
    auto* layer = &layer_of(handle);
    const mok::MoeWeights w = fp8_weights(layer->workspace->shape(), weights, false);
    forward_with(*layer, x, topk_idx, topk_dtype, router_weights, w, out, stream);
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// The backward of the layer's last forward (the context that forward filled), asynchronous on `stream`. The
// forward's arguments again (x, ids, router weights, weights as in mok_bench_layer_forward), d_out bf16 [T, H];
// writes d_x bf16 [T, H] and d_router_weights fp32 [T, k]. grads, grad_dtypes and grad_modes hold 6 entries
// each, in MoeWeightGrads' order (expert gate, up, down, shared gate, up, down; the shared three are ignored
// without a shared expert): a gradient of the weight's shape, null for not computed; dtype 0 bf16, 1 fp32;
// mode 0 GradMode::kWrite, 1 GradMode::kAccumulate (fp32 += this call's gradient).
int mok_bench_layer_backward(void* handle, const void* x, const void* topk_idx, int topk_dtype,
                             const float* router_weights, const void* expert_gate, const void* expert_up,
                             const void* expert_down, const void* shared_gate, const void* shared_up,
                             const void* shared_down, const void* d_out, void* d_x, float* d_router_weights,
                             void* const* grads, const int32_t* grad_dtypes, const int32_t* grad_modes, void* stream,
                             char* error, int error_len) {
  try {
    auto* layer = &layer_of(handle);
    const mok::MoeWeights w = layer_weights(layer->workspace->shape(), expert_gate, expert_up, expert_down,
                                            shared_gate, shared_up, shared_down);
    backward_with(*layer, x, topk_idx, topk_dtype, router_weights, w, d_out, d_x, d_router_weights, grads,
                  grad_dtypes, grad_modes, stream);
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// The backward of a layer made with precision "fp8" and backward (MoeOptions::precision kFP8; the stage kernels,
// docs/design.md "FP8 backward"): weights holds 20 pointers, mok_bench_layer_forward_fp8's 12 and the transposed
// copies with their scales (expert_gate_up_t, its scales, expert_down_t, its scales, then the shared ones; the
// shared four are ignored without a shared expert). The rest as mok_bench_layer_backward.
int mok_bench_layer_backward_fp8(void* handle, const void* x, const void* topk_idx, int topk_dtype,
                                 const float* router_weights, const void* const* weights, const void* d_out, void* d_x,
                                 float* d_router_weights, void* const* grads, const int32_t* grad_dtypes,
                                 const int32_t* grad_modes, void* stream, char* error, int error_len) {
  try {
    auto* layer = &layer_of(handle);
    const mok::MoeWeights w = fp8_weights(layer->workspace->shape(), weights, true);
    backward_with(*layer, x, topk_idx, topk_dtype, router_weights, w, d_out, d_x, d_router_weights, grads,
                  grad_dtypes, grad_modes, stream);
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// Device bytes of the layer's forward context (ForwardContext::bytes()): what a training step keeps per layer
// from its forward to its backward. -1 with the message in `error` on failure.
int64_t mok_bench_layer_context_bytes(void* handle, char* error, int error_len) {
  try {
    const auto* layer = &layer_of(handle);
    return layer->context.bytes();
  } catch (const std::exception& e) {
    report(e, error, error_len);
    return -1;
  }
}

// Clears the layer's status word (it stays set until this call). Asynchronous on `stream`.
int mok_bench_layer_reset_status(void* handle, void* stream, char* error, int error_len) {
  try {
    auto* layer = &layer_of(handle);
    layer->workspace->reset_status(layer->rank, static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// Synchronizes `stream`; 1 with the status report when the GPU recorded an error.
int mok_bench_layer_check_status(void* handle, void* stream, char* error, int error_len) {
  try {
    auto* layer = &layer_of(handle);
    const mok::MoeShape& s = layer->workspace->shape();
    const mok::StatusReport r = layer->workspace->read_status(layer->rank, static_cast<cudaStream_t>(stream));
    if (!r.ok()) throw std::runtime_error(r.describe(s.num_tokens, s.top_k, s.num_experts));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// Writes the task records of the layer's last forward as Chrome-trace JSON to `path`. Synchronizes `stream`.
int mok_bench_layer_write_timeline(void* handle, void* stream, const char* path, char* error, int error_len) {
  try {
    auto* layer = &layer_of(handle);
    if (path == nullptr) throw std::invalid_argument("path: must not be null");
    const auto records = layer->workspace->read_timeline(layer->rank, static_cast<cudaStream_t>(stream));
    const std::string json = mok::chrome_trace_json(records, layer->rank);
    FILE* file = std::fopen(path, "w");
    if (file == nullptr) throw std::runtime_error(std::string("cannot write ") + path);
    const bool written = std::fwrite(json.data(), 1, json.size(), file) == json.size();
    std::fclose(file);
    if (!written) throw std::runtime_error(std::string("short write to ") + path);
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// The communication CTAs the layer's fused path uses (its resolved default when created with 0); -1 for a null
// handle.
int mok_bench_layer_comm_ctas(void* handle) {
  return handle == nullptr ? -1 : static_cast<BenchLayer*>(handle)->workspace->comm_ctas();
}

// Collective with EP > 1 (every rank calls it): closes the workspace and destroys the communicator. A null handle:
// nothing.
void mok_bench_layer_destroy(void* handle) {
  if (handle == nullptr) return;
  auto* layer = static_cast<BenchLayer*>(handle);
  try {
    layer->close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mok_bench_layer_destroy: %s\n", e.what());
  }
  delete layer;
}

// A status word in device memory for the standalone GEMMs' waits (initial_device_status()): *out receives it.
int mok_bench_status_new(void** out, char* error, int error_len) {
  try {
    if (out == nullptr) throw std::invalid_argument("out: must not be null");
    mok::DeviceStatus* status = nullptr;
    MOK_CHECK_CUDA(cudaMalloc(&status, sizeof(mok::DeviceStatus)));
    const mok::DeviceStatus initial = mok::initial_device_status();
    MOK_CHECK_CUDA(cudaMemcpy(status, &initial, sizeof(initial), cudaMemcpyHostToDevice));
    *out = status;
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// Synchronizes `stream`; 1 with the report when the status word holds an error (a GEMM's wait timed out).
int mok_bench_status_check(void* status, void* stream, char* error, int error_len) {
  try {
    if (status == nullptr) throw std::invalid_argument("status: null (mok_bench_status_new's)");
    const auto s = static_cast<cudaStream_t>(stream);
    mok::StatusReport r;
    MOK_CHECK_CUDA(cudaMemcpyAsync(&r.raw, status, sizeof(r.raw), cudaMemcpyDeviceToHost, s));
    MOK_CHECK_CUDA(cudaStreamSynchronize(s));
    if (!r.ok()) throw std::runtime_error(r.describe(1, 1, 1));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

void mok_bench_status_free(void* status) { cudaFree(status); }

// Returns 0, or 1 with a message in `error` (NUL-terminated, at most error_len bytes). The kernel's waits report
// to `status` (mok_bench_status_new) and give up after 2 * wait_timeout_s + 1 s.
int mok_bench_expert_gemm(int epilogue, const void* a, int64_t a_rows, int k, const void* b, const void* b_up,
                          int b_major, int n, int local_experts, const int32_t* expert_counts,
                          const int32_t* expert_row_offsets, const int32_t* scheduled_rows, int tile_m,
                          const float* row_scale, float swiglu_limit, void* out, void* gate_up_out, const void* gate_up,
                          float* row_partials, int cluster_n, int32_t* ticket, void* trace, void* status,
                          double wait_timeout_s, void* stream, char* error, int error_len) {
  try {
    mok::ExpertGemmArgs args;
    args.epilogue = static_cast<mok::GemmEpilogue>(epilogue);
    args.a = a;
    args.a_rows = a_rows;
    args.k = k;
    args.b = b;
    args.b_up = b_up;
    args.b_major = static_cast<mok::OperandMajor>(b_major);
    args.n = n;
    args.local_experts = local_experts;
    args.expert_counts = expert_counts;
    args.expert_row_offsets = expert_row_offsets;
    args.scheduled_rows = scheduled_rows;
    args.tile_m = tile_m;
    args.row_scale = row_scale;
    args.swiglu_limit = swiglu_limit;
    args.out = out;
    args.gate_up_out = gate_up_out;
    args.gate_up = gate_up;
    args.row_partials = row_partials;
    args.cluster_n = cluster_n;
    args.trace = trace;
    args.ticket = ticket;
    args.waits = {static_cast<mok::DeviceStatus*>(status), wait_timeout_s, 0};
    mok::expert_gemm(args, static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// The expert GEMM in Precision::kFP8 (kStore: epilogue 0, kSwiGLU: 1; b K-major): a and b e4m3, their scales
// as include/mok/expert_gemm.h lays them out (b_up and b_up_scales: separate up weights, else null; out_scales:
// kSwiGLU writing h quantized, out e4m3, else null; gate_up_out and hidden_out: a training context's side outputs,
// else null; block_n: ExpertGemmArgs::block_n, 0 to choose). Waits and returns as mok_bench_expert_gemm's.
int mok_bench_expert_gemm_fp8(int epilogue, const void* a, const float* a_scales, int64_t a_rows, int k, const void* b,
                              const float* b_scales, const void* b_up, const float* b_up_scales, int n,
                              int local_experts, const int32_t* expert_counts, const int32_t* expert_row_offsets,
                              const int32_t* scheduled_rows, int tile_m, const float* row_scale, void* out,
                              float* out_scales, void* gate_up_out, void* hidden_out, int cluster_n, int block_n,
                              int32_t* ticket,
                              void* status,
                              double wait_timeout_s, void* stream, char* error, int error_len) {
  try {
    mok::ExpertGemmArgs args;
    args.epilogue = static_cast<mok::GemmEpilogue>(epilogue);
    args.precision = mok::Precision::kFP8;
    args.a = a;
    args.a_scales = a_scales;
    args.a_rows = a_rows;
    args.k = k;
    args.b = b;
    args.b_scales = b_scales;
    args.b_up = b_up;
    args.b_up_scales = b_up_scales;
    args.n = n;
    args.local_experts = local_experts;
    args.expert_counts = expert_counts;
    args.expert_row_offsets = expert_row_offsets;
    args.scheduled_rows = scheduled_rows;
    args.tile_m = tile_m;
    args.row_scale = row_scale;
    args.out = out;
    args.out_scales = out_scales;
    args.gate_up_out = gate_up_out;
    args.hidden_out = hidden_out;
    args.cluster_n = cluster_n;
    args.block_n = block_n;
    args.ticket = ticket;
    args.waits = {static_cast<mok::DeviceStatus*>(status), wait_timeout_s, 0};
    mok::expert_gemm(args, static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// The weight-gradient GEMM (include/mok/weight_grad_gemm.h); output: 0 kBFloat16, 1 kFloat32,
// 2 kAccumulateFloat32. out_split may be null (then m_split must be 0). Waits as mok_bench_expert_gemm's. Returns 0,
// or 1 with a message.
int mok_bench_weight_grad_gemm(const void* a, const void* b, int64_t rows_allocated, int m, int n, int local_experts,
                               const int32_t* expert_row_offsets, const int32_t* scheduled_rows, int tile_m,
                               int output, void* out, void* out_split, int m_split, int32_t* ticket, void* status,
                               double wait_timeout_s, void* stream, char* error, int error_len) {
  try {
    mok::weight_grad_gemm(weight_grad_args(a, b, rows_allocated, m, n, local_experts, expert_row_offsets,
                                           scheduled_rows, tile_m, output, out, out_split, m_split, ticket, status,
                                           wait_timeout_s),
                          static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// The FP8 weight gradient's operand: bf16 rows [rows_allocated, k] of a schedule transposed and quantized per column
// per 128 rows of an expert (detail::quantize_columns_fp8); out e4m3 [k, fp8_column_rows], scales fp32
// [fp8_column_rows / 128, k] (block_scales: [ceil(k / 128), fp8_column_rows / 128], one per 128 x 128 block),
// out_row_offsets [E + 1] written.
int64_t mok_bench_fp8_column_rows(int64_t rows_allocated, int local_experts) {
  return mok::detail::fp8_column_rows(rows_allocated, local_experts);
}

int mok_bench_quantize_columns_fp8(const void* in, int64_t rows_allocated, int k, int local_experts,
                                   const int32_t* expert_counts, const int32_t* expert_row_offsets,
                                   int32_t* out_row_offsets, void* out, float* scales, int power_of_two,
                                   int block_scales, void* stream, char* error, int error_len) {
  try {
    mok::detail::quantize_columns_fp8({.in = in,
                                       .rows_allocated = rows_allocated,
                                       .k = k,
                                       .local_experts = local_experts,
                                       .expert_counts = expert_counts,
                                       .expert_row_offsets = expert_row_offsets,
                                       .out_row_offsets = out_row_offsets,
                                       .out = out,
                                       .scales = scales,
                                       .power_of_two_scales = power_of_two != 0,
                                       .block_scales = block_scales != 0},
                                      static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

// mok_bench_weight_grad_gemm with precision kFP8: a, b e4m3 [m or n, rows_allocated] and their scales as
// mok_bench_quantize_columns_fp8 writes them; expert_row_offsets its out_row_offsets, scheduled_rows their last;
// b_block_scales: b's scales per 128 x 128 block (WeightGradArgs::b_block_scales).
int mok_bench_weight_grad_gemm_fp8(const void* a, const float* a_scales, const void* b, const float* b_scales,
                                   int64_t rows_allocated, int m, int n, int local_experts,
                                   const int32_t* expert_row_offsets, const int32_t* scheduled_rows, int output,
                                   void* out, void* out_split, int m_split, int b_block_scales, int32_t* ticket,
                                   void* status, double wait_timeout_s, void* stream, char* error, int error_len) {
  try {
    mok::WeightGradArgs args = weight_grad_args(a, b, rows_allocated, m, n, local_experts, expert_row_offsets,
                                                scheduled_rows, 128, output, out, out_split, m_split, ticket, status,
                                                wait_timeout_s);
    args.precision = mok::Precision::kFP8;
    args.a_scales = a_scales;
    args.b_scales = b_scales;
    args.b_block_scales = b_block_scales != 0;
    mok::weight_grad_gemm(args, static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

}  // extern "C"
