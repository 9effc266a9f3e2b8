// mok._mok: the C++ API of include/mok/moe.h for Python (nanobind): forward, backward, recompute.
//
// Tensors arrive as DLPack views of the caller's (torch) tensors: no copies, no ownership taken. Each call
// checks what it reads (CUDA device of the workspace, dtype, C-contiguity, 16-byte alignment) and names the
// argument; shapes are checked by MoeWorkspace itself (std::invalid_argument -> ValueError). Streams are
// raw cudaStream_t values (torch.cuda.current_stream().cuda_stream). The Python package (python/mok) is the
// user-facing API; this module is its private back end.
//
//   _mok.nccl_unique_id() -> bytes                      rank 0 makes it, the group broadcasts it
//   _mok.option_table() -> [dict]                       every option: name, path, kind, home, agreed, default, choices
//   ws = _mok.Workspace(device, rank, nccl_id or None, **options)
//                                                       the shape and options by name (src/host/option_table.h: the
//                                                       fields of Python LayerShape and Config); a name left out
//                                                       keeps the C++ default
//   ctx = ws.make_context(stream)                       zero-filled on `stream`, no host synchronization
//   ws.forward(x, topk_idx, router_weights, weights..., out, ctx, stream, schedule_ready)
//   ws.backward(d_out, x, topk_idx, router_weights, [6 weights], d_x, d_router_weights, [6 grads], accumulate,
//               ctx, stream)                          weights and grads in MoeWeights order, None where absent
//   ws.forward_fp8(x, topk_idx, router_weights, [6 e4m3 weights], [6 scales], out, ctx, stream)
//   ws.backward_fp8(d_out, x, topk_idx, router_weights, [6 e4m3 weights], [6 scales], [4 transposed], [4 scales],
//                   d_x, d_router_weights, [6 grads], accumulate, ctx, stream)
//                                                       FP8 workspaces; e4m3 as uint8 views
//   ws.recompute_forward_context(x, [6 weights], ctx, stream)
//   ws.recompute_forward_context_fp8(x, [6 e4m3 weights], [6 scales], ctx, stream)
//   ok, bits, message = ws.read_status(stream)
//   ws.close()                                          collective teardown (EP > 1: every rank); idempotent
#include <cstdint>
#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nccl.h>

#include "mok/fp8.h"
#include "mok/moe.h"
#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "src/host/moe_args.h"
#include "src/host/nccl_setup.h"
#include "src/host/option_table.h"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::device::cuda>;
using OptionalArray = std::optional<Array>;

using mok::detail::check_nccl;
using mok::detail::DeviceGuard;  // restores the caller's (PyTorch's) current device after each call

const char* dtype_name(nb::dlpack::dtype t) {
  if (t == nb::dtype<float>()) return "float32";
  if (t == nb::dtype<double>()) return "float64";
  if (t == nb::dtype<int32_t>()) return "int32";
  if (t == nb::dtype<int64_t>()) return "int64";
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return "bf16";
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) return "float16";
  return "an unsupported dtype";
}

bool is_c_contiguous(const Array& a) {
  for (size_t d = 0; d < a.ndim(); ++d)
    if (a.shape(d) == 0) return true;  // no elements (a call of 0 tokens): any strides, PyTorch's expanded zeros too
  int64_t expected = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(d));
  }
  return true;
}

// A TensorRef on `a` after the checks the C++ API cannot make itself (it sees only a pointer).
// fp8: uint8 arrays are e4m3 (the Python side passes float8_e4m3fn tensors viewed as uint8: DLPack exports no
// float8 type through every PyTorch version this package supports).
mok::TensorRef tensor_ref(const Array& a, const char* name, int device, bool allow_int64 = false, bool fp8 = false) {
  const nb::dlpack::dtype t = a.dtype();
  mok::DType dtype;
  if (fp8 && t == nb::dtype<uint8_t>()) {
    dtype = mok::DType::kFloat8E4M3;
  } else if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16 && t.lanes == 1) {
    dtype = mok::DType::kBFloat16;
  } else if (t == nb::dtype<float>()) {
    dtype = mok::DType::kFloat32;
  } else if (t == nb::dtype<int32_t>()) {
    dtype = mok::DType::kInt32;
  } else if (t == nb::dtype<int64_t>() && allow_int64) {
    dtype = mok::DType::kInt64;
  } else {
    throw std::invalid_argument(std::string(name) + ": unsupported dtype " + dtype_name(t));
  }
  if (a.device_id() != device) {
    throw std::invalid_argument(std::string(name) + ": on cuda:" + std::to_string(a.device_id()) +
                                ", the workspace is on cuda:" + std::to_string(device));
  }
  if (a.ndim() < 1 || a.ndim() > static_cast<size_t>(mok::TensorRef::kMaxDims)) {
    throw std::invalid_argument(std::string(name) + ": " + std::to_string(a.ndim()) + " dimensions");
  }
  if (!is_c_contiguous(a)) throw std::invalid_argument(std::string(name) + ": not contiguous");
  if (reinterpret_cast<uintptr_t>(a.data()) % 16 != 0) {
    throw std::invalid_argument(std::string(name) + ": data pointer not 16-byte aligned");
  }
  mok::TensorRef ref;
  ref.data = a.data();
  ref.dtype = dtype;
  ref.ndim = static_cast<int>(a.ndim());
  for (size_t d = 0; d < a.ndim(); ++d) ref.shape[d] = static_cast<int64_t>(a.shape(d));
  return ref;
}

mok::TensorRef optional_ref(const OptionalArray& a, const char* name, int device) {
  return a ? tensor_ref(*a, name, device) : mok::TensorRef();
}

// The six weights (or their gradients) in MoeWeights order: expert_gate, expert_up, expert_down, shared_gate,
// shared_up, shared_down; None where absent (expert_up with fused gate/up weights, the shared ones without a
// shared expert, a gradient not asked for).
constexpr int kNumWeights = 6;
using WeightArrays = std::array<OptionalArray, kNumWeights>;
constexpr std::array<const char*, kNumWeights> kWeightNames = {"expert_gate", "expert_up",  "expert_down",
                                                               "shared_gate", "shared_up", "shared_down"};

// The FP8 backward's transposed weights (MoeWeights::expert_gate_up_t and the rest), in MoeWeights order.
constexpr int kNumTransposed = 4;
using TransposedArrays = std::array<OptionalArray, kNumTransposed>;
constexpr std::array<const char*, kNumTransposed> kTransposedNames = {"expert_gate_up_t", "expert_down_t",
                                                                      "shared_gate_up_t", "shared_down_t"};

// The FP8 form (MoeOptions::precision kFP8): the six weights as e4m3 (uint8 views) and their block scales.
mok::MoeWeights fp8_weights_of(const WeightArrays& values, const WeightArrays& scales, int device) {
  mok::MoeWeights w;
  mok::TensorRef* refs[kNumWeights] = {&w.expert_gate, &w.expert_up, &w.expert_down,
                                       &w.shared_gate, &w.shared_up, &w.shared_down};
  mok::TensorRef* scale_refs[kNumWeights] = {&w.expert_gate_scales, &w.expert_up_scales, &w.expert_down_scales,
                                             &w.shared_gate_scales, &w.shared_up_scales, &w.shared_down_scales};
  for (int i = 0; i < kNumWeights; ++i) {
    if (values[i]) *refs[i] = tensor_ref(*values[i], kWeightNames[i], device, false, /*fp8=*/true);
    *scale_refs[i] = optional_ref(scales[i], (std::string(kWeightNames[i]) + "_scales").c_str(), device);
  }
  return w;
}

mok::MoeWeights weights_of(const WeightArrays& a, int device) {
  mok::MoeWeights w;
  mok::TensorRef* refs[kNumWeights] = {&w.expert_gate, &w.expert_up, &w.expert_down,
                                       &w.shared_gate, &w.shared_up, &w.shared_down};
  for (int i = 0; i < kNumWeights; ++i) *refs[i] = optional_ref(a[i], kWeightNames[i], device);
  return w;
}

// grads[i] (named "<prefix>.<weight>") as the i-th gradient, written or accumulated.
mok::MoeWeightGrads weight_grads_of(const WeightArrays& grads, bool accumulate, const char* prefix, int device) {
  mok::MoeWeightGrads g;
  mok::WeightGrad* refs[kNumWeights] = {&g.expert_gate, &g.expert_up, &g.expert_down,
                                        &g.shared_gate, &g.shared_up, &g.shared_down};
  for (int i = 0; i < kNumWeights; ++i) {
    const std::string name = std::string(prefix) + "." + kWeightNames[i];
    refs[i]->grad = optional_ref(grads[i], name.c_str(), device);
    refs[i]->mode = accumulate ? mok::GradMode::kAccumulate : mok::GradMode::kWrite;
  }
  return g;
}

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

class Context {
 public:
  explicit Context(mok::ForwardContext context) : context_(std::move(context)) {}
  mok::ForwardContext& get() { return context_; }
  const mok::ForwardContext& get() const { return context_; }
  int64_t ring_rows() const { return context_.ring_rows(); }

 private:
  mok::ForwardContext context_;
};

// One rank's layer as one process drives it: its communicator (EP > 1), peer group and workspace.
class Workspace {
 public:
  Workspace(int device, int rank, std::optional<nb::bytes> nccl_id, const mok::MoeShape& shape,
            const mok::MoeOptions& options)
      : device_(device), rank_(rank) {
    const int ep_size = shape.ep_size;
    if (rank < 0 || rank >= ep_size) {
      throw std::invalid_argument("rank " + std::to_string(rank) + " outside [0, " + std::to_string(ep_size) + ")");
    }
    ncclUniqueId id{};
    if (ep_size > 1) {
      if (!nccl_id || nccl_id->size() != sizeof(id)) {
        throw std::invalid_argument("nccl_id: EP > 1 needs the " + std::to_string(sizeof(id)) +
                                    "-byte ncclUniqueId of rank 0");
      }
      std::memcpy(&id, nccl_id->c_str(), sizeof(id));
    }
    mok::detail::validate_setup_timeout(options.setup_timeout_s);
    nb::gil_scoped_release release;  // collective: NCCL init and the symmetric allocations wait for peers
    DeviceGuard guard(device);
    // Nonblocking, so that every setup wait is bounded by setup_timeout_s (src/host/nccl_setup.h).
    if (ep_size > 1) comm_ = mok::detail::init_nccl_comm(ep_size, id, rank, options.setup_timeout_s);
    try {
      group_ = std::make_unique<mok::PeerGroup>(ep_size > 1 ? mok::PeerGroup::nccl({comm_}, options.setup_timeout_s)
                                                            : mok::PeerGroup::virtual_ranks(1, device));
      workspace_ = std::make_unique<mok::MoeWorkspace>(*group_, shape, options);
    } catch (...) {
      // A rejected shape (every rank throws together) or a rank that never came (setup_timeout_s, with an
      // operation of the communicator pending): the communicator must not outlive the failed constructor, and
      // aborting it is local (ncclCommDestroy would wait for that operation).
      if (comm_ != nullptr) (void)ncclCommAbort(comm_);
      comm_ = nullptr;
      throw;
    }
  }

  // Never a collective (docs/design.md, "Lifetimes"): without close(), an EP > 1 workspace's windows are
  // leaked with MoeWorkspace's warning, and so is the communicator (destroying it is not local either).
  ~Workspace() {
    mok::detail::TeardownDeviceGuard guard(device_);
    workspace_.reset();
    group_.reset();
  }

  // The collective teardown (MoeWorkspace::close), then the communicator, which NCCL destroys after the
  // windows it holds. Idempotent. The first error is thrown after every step was reached.
  void close() {
    if (closed_) return;
    closed_ = true;
    nb::gil_scoped_release release;  // collective: waits for the peers
    DeviceGuard guard(device_);
    std::string error;
    try {
      workspace_->close();
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (comm_ != nullptr && !workspace_->needs_close()) {
      const ncclResult_t result = ncclCommDestroy(comm_);
      comm_ = nullptr;
      // ncclInProgress: a nonblocking communicator finishes its teardown in the background.
      if (result != ncclSuccess && result != ncclInProgress && error.empty())
        error = std::string("ncclCommDestroy: ") + ncclGetErrorString(result);
    }
    if (!error.empty()) throw std::runtime_error(error);
  }
  bool closed() const { return closed_; }

  // Zero-filled asynchronously on `stream` (no host synchronization).
  Context make_context(uintptr_t stream) const {
    DeviceGuard guard(device_);
    return Context(workspace_->make_context(rank_, as_stream(stream)));
  }

  void build_schedule(const Array& topk_idx, Context& context, uintptr_t stream) {
    DeviceGuard guard(device_);
    mok::RankForward f;
    f.rank = rank_;
    f.topk_idx = tensor_ref(topk_idx, "topk_idx", device_, /*allow_int64=*/true);
    f.context = &context.get();
    f.stream = as_stream(stream);
    workspace_->build_schedule({&f, 1});
  }

  void forward(const Array& x, const Array& topk_idx, const Array& router_weights, const Array& expert_gate,
               const OptionalArray& expert_up, const Array& expert_down, const OptionalArray& shared_gate,
               const OptionalArray& shared_up, const OptionalArray& shared_down, const Array& out,
               Context& context, uintptr_t stream, bool schedule_ready) {
    DeviceGuard guard(device_);
    run_forward(weights_of({expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down}, device_), x,
                topk_idx, router_weights, out, context, stream, schedule_ready);
  }

  // The forward of an FP8 workspace (precision "fp8"): the weights as e4m3 (uint8 views) with their block scales,
  // in MoeWeights order (None where absent).
  void forward_fp8(const Array& x, const Array& topk_idx, const Array& router_weights, const WeightArrays& weights,
                   const WeightArrays& scales, const Array& out, Context& context, uintptr_t stream) {
    DeviceGuard guard(device_);
    run_forward(fp8_weights_of(weights, scales, device_), x, topk_idx, router_weights, out, context, stream, false);
  }

  // MoeWorkspace::forward (or forward_with_schedule) of this rank with weights `w`.
  void run_forward(const mok::MoeWeights& w, const Array& x, const Array& topk_idx, const Array& router_weights,
                   const Array& out, Context& context, uintptr_t stream, bool schedule_ready) {
    mok::RankForward f;
    f.rank = rank_;
    f.x = tensor_ref(x, "x", device_);
    f.topk_idx = tensor_ref(topk_idx, "topk_idx", device_, /*allow_int64=*/true);
    f.router_weights = tensor_ref(router_weights, "router_weights", device_);
    f.weights = &w;
    f.out = tensor_ref(out, "out", device_);
    f.context = &context.get();
    f.stream = as_stream(stream);
    if (schedule_ready) {
      workspace_->forward_with_schedule({&f, 1});
    } else {
      workspace_->forward({&f, 1});
    }
  }

  // d_x, d_router_weights and the weight gradients of the forward that filled `context` (MoeWorkspace::backward).
  // grads[i] None: that gradient is not computed; accumulate: every given gradient is fp32 and added to
  // (GradMode::kAccumulate), else written in its dtype (bf16 or fp32).
  void backward(const Array& d_out, const Array& x, const Array& topk_idx, const Array& router_weights,
                const WeightArrays& weights, const Array& d_x, const Array& d_router_weights, const WeightArrays& grads,
                bool accumulate, const Context& context, uintptr_t stream) {
    DeviceGuard guard(device_);
    run_backward(weights_of(weights, device_), d_out, x, topk_idx, router_weights, d_x, d_router_weights, grads,
                 accumulate, context, stream);
  }

  // The backward of an FP8 workspace: the forward's FP8 weights and scales, and the transposed copies the dgrads
  // read (expert_gate_up_t, expert_down_t, shared_gate_up_t, shared_down_t, then their scales; None where absent).
  void backward_fp8(const Array& d_out, const Array& x, const Array& topk_idx, const Array& router_weights,
                    const WeightArrays& weights, const WeightArrays& scales, const TransposedArrays& transposed,
                    const TransposedArrays& transposed_scales, const Array& d_x, const Array& d_router_weights,
                    const WeightArrays& grads, bool accumulate, const Context& context, uintptr_t stream) {
    DeviceGuard guard(device_);
    mok::MoeWeights w = fp8_weights_of(weights, scales, device_);
    mok::TensorRef* refs[kNumTransposed] = {&w.expert_gate_up_t, &w.expert_down_t, &w.shared_gate_up_t,
                                            &w.shared_down_t};
    mok::TensorRef* scale_refs[kNumTransposed] = {&w.expert_gate_up_t_scales, &w.expert_down_t_scales,
                                                  &w.shared_gate_up_t_scales, &w.shared_down_t_scales};
    for (int i = 0; i < kNumTransposed; ++i) {
      const std::string name = kTransposedNames[i];
      if (transposed[i]) *refs[i] = tensor_ref(*transposed[i], name.c_str(), device_, false, /*fp8=*/true);
      *scale_refs[i] = optional_ref(transposed_scales[i], (name + "_scales").c_str(), device_);
    }
    run_backward(w, d_out, x, topk_idx, router_weights, d_x, d_router_weights, grads, accumulate, context, stream);
  }

  // MoeWorkspace::backward of this rank with weights `w`.
  void run_backward(const mok::MoeWeights& w, const Array& d_out, const Array& x, const Array& topk_idx,
                    const Array& router_weights, const Array& d_x, const Array& d_router_weights,
                    const WeightArrays& grads, bool accumulate, const Context& context, uintptr_t stream) {
    const mok::MoeWeightGrads g = weight_grads_of(grads, accumulate, accumulate ? "main_grads" : "grads", device_);
    mok::RankBackward b;
    b.rank = rank_;
    b.x = tensor_ref(x, "x", device_);
    b.topk_idx = tensor_ref(topk_idx, "topk_idx", device_, /*allow_int64=*/true);
    b.router_weights = tensor_ref(router_weights, "router_weights", device_);
    b.weights = &w;
    b.context = &context.get();
    b.d_out = tensor_ref(d_out, "d_out", device_);
    b.d_x = tensor_ref(d_x, "d_x", device_);
    b.d_router_weights = tensor_ref(d_router_weights, "d_router_weights", device_);
    b.weight_grads = &g;
    b.stream = as_stream(stream);
    workspace_->backward({&b, 1});
  }

  // Rebuilds the context's activations from x and the weights on the schedule already in it.
  void recompute_forward_context(const Array& x, const WeightArrays& weights, Context& context, uintptr_t stream) {
    DeviceGuard guard(device_);
    run_recompute(weights_of(weights, device_), x, context, stream);
  }

  // recompute_forward_context of an FP8 workspace: the weights as forward_fp8 takes them.
  void recompute_forward_context_fp8(const Array& x, const WeightArrays& weights, const WeightArrays& scales,
                                     Context& context, uintptr_t stream) {
    DeviceGuard guard(device_);
    run_recompute(fp8_weights_of(weights, scales, device_), x, context, stream);
  }

  void run_recompute(const mok::MoeWeights& w, const Array& x, Context& context, uintptr_t stream) {
    mok::RankForward f;
    f.rank = rank_;
    f.x = tensor_ref(x, "x", device_);
    f.weights = &w;
    f.context = &context.get();
    f.stream = as_stream(stream);
    workspace_->recompute_forward_context({&f, 1});
  }

  // (ok, error bits, one line per error). Synchronizes `stream`.
  std::tuple<bool, uint32_t, std::string> read_status(uintptr_t stream) const {
    DeviceGuard guard(device_);
    const mok::StatusReport r = workspace_->read_status(rank_, as_stream(stream));
    const mok::MoeShape& s = workspace_->shape();
    return {r.ok(), r.raw.error_bits, r.ok() ? std::string() : r.describe(s.num_tokens, s.top_k, s.num_experts)};
  }

  void reset_status(uintptr_t stream) {
    DeviceGuard guard(device_);
    workspace_->reset_status(rank_, as_stream(stream));
  }

  int rank() const { return rank_; }
  int device() const { return device_; }
  int64_t capacity_rows() const { return workspace_->capacity_rows(); }
  int64_t ring_rows() const { return workspace_->ring_rows(); }
  int64_t padded_tokens() const { return workspace_->padded_tokens(); }
  int comm_ctas() const { return workspace_->comm_ctas(); }

 private:
  int device_ = 0;
  int rank_ = 0;
  bool closed_ = false;
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<mok::PeerGroup> group_;
  std::unique_ptr<mok::MoeWorkspace> workspace_;
};

nb::bytes nccl_unique_id() {
  static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return nb::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
}

// (the NCCL version this module was compiled against, the one loaded in the process), as NCCL_VERSION_CODE.
std::tuple<int, int> nccl_versions() {
  int loaded = 0;
  check_nccl(ncclGetVersion(&loaded), "ncclGetVersion");
  return {NCCL_VERSION_CODE, loaded};
}

// A Python value as option `o`'s value: a bool for kBool (an int is refused, as Config refuses it), an integral
// number (not a bool) for the integer kinds, a real number for the floating-point kinds, a choice's name for kEnum.
// The range is checked by set_option (ValueError). TypeError / ValueError name the option.
mok::detail::OptionValue option_value(const mok::detail::OptionDesc& o, nb::handle value) {
  using mok::detail::OptionKind;
  const std::string name(o.name);
  const auto type_error = [&](const char* expected) {
    return nb::type_error(("option " + name + ": expected " + expected + ", got " +
                           nb::cast<std::string>(nb::str(value.type().attr("__name__"))))
                              .c_str());
  };
  mok::detail::OptionValue v;
  const bool is_bool = nb::isinstance<nb::bool_>(value);
  switch (o.kind) {
    case OptionKind::kBool:
      if (!is_bool) throw type_error("a bool");
      v.integer = nb::cast<bool>(value) ? 1 : 0;
      break;
    case OptionKind::kInt32:
    case OptionKind::kInt64:  // an int, or an integral number such as numpy's (__index__), as Config admits
      if (is_bool || !nb::hasattr(value, "__index__")) throw type_error("an int");
      try {
        v.integer = nb::cast<int64_t>(nb::int_(value));
      } catch (const nb::cast_error&) {
        throw nb::value_error(("option " + name + ": " + nb::cast<std::string>(nb::str(value)) + " is out of range")
                                  .c_str());
      }
      break;
    case OptionKind::kFloat32:
    case OptionKind::kFloat64:  // a real number (float, int, numpy's)
      if (is_bool || nb::isinstance<nb::str>(value) || !nb::hasattr(value, "__float__")) throw type_error("a number");
      v.real = nb::cast<double>(nb::float_(value));
      break;
    case OptionKind::kEnum: {
      if (!nb::isinstance<nb::str>(value)) throw type_error("a str");
      const std::string text = nb::cast<std::string>(value);
      v.integer = -1;
      for (size_t c = 0; c < o.choices.size(); ++c)
        if (o.choices[c] == text) v.integer = static_cast<int64_t>(c);
      if (v.integer < 0) {
        std::string choices;
        for (std::string_view c : o.choices) choices += (choices.empty() ? "" : ", ") + std::string(c);
        throw nb::value_error(("option " + name + ": expected one of " + choices + ", got '" + text + "'").c_str());
      }
      break;
    }
  }
  return v;
}

// The layer's shape and options from keyword arguments named as the option table's rows.
mok::detail::LayerOptions layer_options(const nb::kwargs& options) {
  mok::detail::LayerOptions layer;
  for (auto [key, value] : options) {
    const std::string name = nb::cast<std::string>(key);
    const mok::detail::OptionDesc* o = mok::detail::find_option(name);
    if (o == nullptr) throw nb::type_error(("Workspace: unknown option '" + name + "'").c_str());
    mok::detail::set_option(layer, *o, option_value(*o, value));
  }
  return layer;
}

// A row's value as Python sees it (bool, int, float, or the choice's name).
nb::object python_value(const mok::detail::OptionDesc& o, mok::detail::OptionValue v) {
  using mok::detail::OptionKind;
  switch (o.kind) {
    case OptionKind::kBool: return nb::bool_(v.integer != 0);
    case OptionKind::kInt32:
    case OptionKind::kInt64: return nb::int_(v.integer);
    case OptionKind::kFloat32:
    case OptionKind::kFloat64: return nb::float_(v.real);
    case OptionKind::kEnum: return nb::str(std::string(o.choices[v.integer]).c_str());
  }
  return nb::none();
}

// quantize_weights_fp8 (include/mok/fp8.h) on arrays: weights bf16 [experts, rows, k] or [rows, k]; out uint8 of
// the same shape (e4m3 bits); scales fp32 [.., ceil(rows/128), ceil(k/128)]; optionally the transposed pair.
void quantize_weights_fp8(const Array& weights, const Array& out, const Array& scales,
                          const OptionalArray& out_transposed, const OptionalArray& scales_transposed,
                          bool power_of_two_scales, uintptr_t stream) {
  const int device = weights.device_id();
  DeviceGuard guard(device);
  const mok::TensorRef w = tensor_ref(weights, "weights", device);
  if (w.dtype != mok::DType::kBFloat16 || (w.ndim != 2 && w.ndim != 3))
    throw std::invalid_argument("quantize_weights_fp8: weights must be bf16 [experts, rows, k] or [rows, k], got " +
                                w.describe());
  const bool three = w.ndim == 3;
  const int64_t experts = three ? w.shape[0] : 1, rows = w.shape[three ? 1 : 0], k = w.shape[three ? 2 : 1];
  const mok::TensorRef q = tensor_ref(out, "out", device, false, /*fp8=*/true);
  const mok::TensorRef s = tensor_ref(scales, "scales", device);
  const int64_t blocks = experts * ((rows + 127) / 128) * ((k + 127) / 128);
  auto elements = [](const mok::TensorRef& t) {
    int64_t n = 1;
    for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
    return n;
  };
  if (q.dtype != mok::DType::kFloat8E4M3 || elements(q) != experts * rows * k)
    throw std::invalid_argument("quantize_weights_fp8: out must be uint8 (e4m3 bits) with the weights' elements, got " +
                                q.describe());
  if (s.dtype != mok::DType::kFloat32 || elements(s) != blocks)
    throw std::invalid_argument("quantize_weights_fp8: scales must be fp32 with " + std::to_string(blocks) +
                                " elements (one per 128 x 128 block), got " + s.describe());
  mok::Fp8QuantizeArgs args{.in = w.data, .experts = static_cast<int>(experts), .rows = rows,
                            .k = static_cast<int>(k), .out = q.mutable_data(),
                            .scales = static_cast<float*>(s.mutable_data()),
                            .power_of_two_scales = power_of_two_scales};
  if (out_transposed || scales_transposed) {
    if (!out_transposed || !scales_transposed)
      throw std::invalid_argument("quantize_weights_fp8: out_transposed and scales_transposed go together");
    const mok::TensorRef qt = tensor_ref(*out_transposed, "out_transposed", device, false, /*fp8=*/true);
    const mok::TensorRef st = tensor_ref(*scales_transposed, "scales_transposed", device);
    if (qt.dtype != mok::DType::kFloat8E4M3 || elements(qt) != experts * rows * k || st.dtype != mok::DType::kFloat32 ||
        elements(st) != blocks)
      throw std::invalid_argument("quantize_weights_fp8: the transposed pair must match out and scales, got " +
                                  qt.describe() + " and " + st.describe());
    args.out_transposed = qt.mutable_data();
    args.scales_transposed = static_cast<float*>(st.mutable_data());
  }
  mok::quantize_weights_fp8(args, as_stream(stream));
}

// Every option: name, path (C++), kind, home ("shape": a LayerShape field, "config": a Config field, "cpp": the
// C++ and C APIs only), agreed (equal on every rank), default (the C++ default, as Python spells it), choices.
nb::list option_table() {
  const mok::detail::LayerOptions defaults;
  nb::list rows;
  for (const mok::detail::OptionDesc& o : mok::detail::kOptionTable) {
    nb::dict row;
    row["name"] = std::string(o.name);
    row["path"] = std::string(o.path);
    row["kind"] = std::string(mok::detail::kind_name(o.kind));
    using mok::detail::OptionHome;
    row["home"] = o.home == OptionHome::kShape ? "shape" : o.home == OptionHome::kConfig ? "config" : "cpp";
    row["agreed"] = o.agreed;
    row["default"] = python_value(o, o.get(defaults));
    nb::list choices;
    for (std::string_view c : o.choices) choices.append(std::string(c));
    row["choices"] = choices;
    rows.append(row);
  }
  return rows;
}

}  // namespace

NB_MODULE(_mok, m) {
  m.doc() = "MoK for Hopper: the C++ API, forward and backward (private back end of the mok package)";
  m.def("nccl_unique_id", &nccl_unique_id, "A new ncclUniqueId (128 bytes) for rank 0 to broadcast");
  m.def("nccl_versions", &nccl_versions, "(compiled NCCL_VERSION_CODE, ncclGetVersion of the loaded library)");
  m.def("option_table", &option_table,
        "Every option of the layer (src/host/option_table.h): dicts of name, path, kind, home, agreed, default, "
        "choices");

  m.def("quantize_weights_fp8", &quantize_weights_fp8, nb::arg("weights"), nb::arg("out"), nb::arg("scales"),
        nb::arg("out_transposed").none(), nb::arg("scales_transposed").none(), nb::arg("power_of_two_scales"),
        nb::arg("stream"),
        "include/mok/fp8.h: bf16 weights [experts, rows, k] (or [rows, k]) -> e4m3 (uint8 view) and fp32 block "
        "scales, optionally also transposed");

  nb::class_<Context>(m, "Context").def_prop_ro("ring_rows", &Context::ring_rows);

  nb::class_<Workspace>(m, "Workspace")
      .def(
          "__init__",
          [](Workspace* self, int device, int rank, std::optional<nb::bytes> nccl_id, const nb::kwargs& options) {
            const mok::detail::LayerOptions layer = layer_options(options);
            new (self) Workspace(device, rank, std::move(nccl_id), layer.shape, layer.options);
          },
          nb::arg("device"), nb::arg("rank"), nb::arg("nccl_id").none(), nb::arg("options"),
          "The layer's shape and options as keywords named as option_table()'s rows (LayerShape's and Config's "
          "fields); one left out keeps the C++ default")
      .def("make_context", &Workspace::make_context, nb::arg("stream") = 0, nb::keep_alive<0, 1>())
      .def("close", &Workspace::close)
      .def_prop_ro("closed", &Workspace::closed)
      .def("build_schedule", &Workspace::build_schedule, nb::arg("topk_idx"), nb::arg("context"), nb::arg("stream"))
      .def("forward", &Workspace::forward, nb::arg("x"), nb::arg("topk_idx"), nb::arg("router_weights"),
           nb::arg("expert_gate"), nb::arg("expert_up").none(), nb::arg("expert_down"), nb::arg("shared_gate").none(),
           nb::arg("shared_up").none(), nb::arg("shared_down").none(), nb::arg("out"), nb::arg("context"),
           nb::arg("stream"), nb::arg("schedule_ready"))
      .def("forward_fp8", &Workspace::forward_fp8, nb::arg("x"), nb::arg("topk_idx"), nb::arg("router_weights"),
           nb::arg("weights"), nb::arg("scales"), nb::arg("out"), nb::arg("context"), nb::arg("stream"))
      .def("backward", &Workspace::backward, nb::arg("d_out"), nb::arg("x"), nb::arg("topk_idx"),
           nb::arg("router_weights"), nb::arg("weights"), nb::arg("d_x"), nb::arg("d_router_weights"), nb::arg("grads"),
           nb::arg("accumulate"), nb::arg("context"), nb::arg("stream"))
      .def("backward_fp8", &Workspace::backward_fp8, nb::arg("d_out"), nb::arg("x"), nb::arg("topk_idx"),
           nb::arg("router_weights"), nb::arg("weights"), nb::arg("scales"), nb::arg("transposed"),
           nb::arg("transposed_scales"), nb::arg("d_x"), nb::arg("d_router_weights"), nb::arg("grads"),
           nb::arg("accumulate"), nb::arg("context"), nb::arg("stream"))
      .def("recompute_forward_context", &Workspace::recompute_forward_context, nb::arg("x"), nb::arg("weights"),
           nb::arg("context"), nb::arg("stream"))
      .def("recompute_forward_context_fp8", &Workspace::recompute_forward_context_fp8, nb::arg("x"),
           nb::arg("weights"), nb::arg("scales"), nb::arg("context"), nb::arg("stream"))
      .def("read_status", &Workspace::read_status, nb::arg("stream"))
      .def("reset_status", &Workspace::reset_status, nb::arg("stream"))
      .def_prop_ro("rank", &Workspace::rank)
      .def_prop_ro("device", &Workspace::device)
      .def_prop_ro("capacity_rows", &Workspace::capacity_rows)
      .def_prop_ro("ring_rows", &Workspace::ring_rows)
      .def_prop_ro("padded_tokens", &Workspace::padded_tokens)
      .def_prop_ro("comm_ctas", &Workspace::comm_ctas);
}
