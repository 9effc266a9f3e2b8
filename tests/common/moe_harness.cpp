#include "tests/common/moe_harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>

#include "reference/routing_gen.h"
#include "src/host/check.h"
#include "src/host/device_guard.h"
#include "tests/common/bf16.h"
#include "tests/common/device_fill.h"

namespace mok::testing {
using detail::DeviceGuard;

MoeShape moe_shape(int ep_size, int num_tokens, int top_k, int num_experts, int hidden, int intermediate,
                   bool shared_expert) {
  return {.ep_size = ep_size, .num_tokens = num_tokens, .top_k = top_k, .num_experts = num_experts,
          .hidden = hidden, .intermediate = intermediate, .shared_expert = shared_expert};
}

reference::LayerShape reference_shape(const MoeShape& s) {
  reference::LayerShape r;
  r.num_ranks = s.ep_size;
  r.tokens_per_rank = s.num_tokens;
  r.hidden = s.hidden;
  r.intermediate = s.intermediate;
  r.num_experts = s.num_experts;
  r.top_k = s.top_k;
  r.shared_expert = s.shared_expert;
  r.swiglu_limit = s.swiglu_limit;
  return r;
}

MoeShape scaled_model_shape(const reference::ModelShape& m, int ep, int tokens) {
  const int hidden = m.hidden % 256 == 0 ? 512 : 576;
  const int intermediate = m.intermediate % 128 != 0 ? 192 : m.intermediate * 512 / m.hidden >= 256 ? 256 : 128;
  return moe_shape(ep, tokens, m.top_k, m.num_experts / 8, hidden, intermediate, m.shared_expert);
}

std::vector<float> random_d_out(const MoeShape& shape, uint64_t seed) {
  std::vector<float> d_out =
      reference::random_normal<float>(int64_t(shape.ep_size) * shape.num_tokens * shape.hidden, seed);
  for (float& v : d_out) v = round_to_bf16(v);
  return d_out;
}

const char* grad_tensor_name(GradTensor which) {
  switch (which) {
    case GradTensor::kExpertGate: return "weight_grads.expert_gate";
    case GradTensor::kExpertUp: return "weight_grads.expert_up";
    case GradTensor::kExpertDown: return "weight_grads.expert_down";
    case GradTensor::kSharedGate: return "weight_grads.shared_gate";
    case GradTensor::kSharedUp: return "weight_grads.shared_up";
    case GradTensor::kSharedDown: return "weight_grads.shared_down";
  }
  return "unknown gradient";
}

GradSetups all_grads(DType dtype, GradMode mode) {
  static_assert(kNumGradTensors == 6, "one entry per weight gradient");
  const GradSetup one{dtype, mode, true};
  return {one, one, one, one, one, one};
}

namespace {

void round_all(std::vector<float>& v) {
  for (float& x : v) x = round_to_bf16(x);
}

void scale_all(std::vector<float>& v, double scale) {
  for (float& x : v) x = static_cast<float>(x * scale);
}

}  // namespace

LayerData random_layer(const MoeShape& shape, uint64_t seed, double skew, double masked_fraction) {
  LayerData d;
  d.shape = reference_shape(shape);
  d.params = reference::random_params<float>(d.shape, seed, 1.0);
  scale_all(d.params.expert_gate, 1.0 / std::sqrt(shape.hidden));
  scale_all(d.params.expert_up, 1.0 / std::sqrt(shape.hidden));
  scale_all(d.params.expert_down, 1.0 / std::sqrt(shape.intermediate));
  scale_all(d.params.shared_gate, 1.0 / std::sqrt(shape.hidden));
  scale_all(d.params.shared_up, 1.0 / std::sqrt(shape.hidden));
  scale_all(d.params.shared_down, 1.0 / std::sqrt(shape.intermediate));
  for (auto* v : {&d.params.expert_gate, &d.params.expert_up, &d.params.expert_down, &d.params.shared_gate,
                  &d.params.shared_up, &d.params.shared_down})
    round_all(*v);
  d.inputs = reference::random_inputs<float>(d.shape, seed + 1);
  round_all(d.inputs.x);
  const int64_t routes = int64_t(shape.num_tokens) * shape.top_k;
  for (int r = 0; r < shape.ep_size; ++r) {
    const reference::Routing routing =
        reference::random_routing(shape.num_tokens, shape.top_k, shape.num_experts, skew, seed + 1000 + r);
    std::copy(routing.topk_idx.begin(), routing.topk_idx.end(), d.inputs.topk_idx.begin() + r * routes);
    std::copy(routing.router_weights.begin(), routing.router_weights.end(),
              d.inputs.router_weights.begin() + r * routes);
  }
  std::mt19937_64 gen(seed + 7);
  std::uniform_real_distribution<double> uniform(0, 1);
  for (int32_t& id : d.inputs.topk_idx)
    if (uniform(gen) < masked_fraction) id = -1;
  return d;
}

LayerData provenance_layer(const MoeShape& shape, uint64_t seed, double masked_fraction, int hot_slot) {
  if (shape.num_tokens > 4096 || shape.hidden < shape.intermediate + 3)
    throw std::invalid_argument("provenance_layer: needs num_tokens <= 4096 and hidden >= intermediate + 3");
  LayerData d = random_layer(shape, seed, 0, masked_fraction);
  const int64_t h = shape.hidden, i = shape.intermediate, n = int64_t(shape.ep_size) * shape.num_tokens;
  for (int64_t token = 0; token < n; ++token) {
    float* x = d.inputs.x.data() + token * h;
    const int64_t src = token / shape.num_tokens, t = token % shape.num_tokens;
    for (int64_t c = 0; c < h; ++c) x[c] = static_cast<float>(hashed_int(seed, token * h + c, -4, 4));
    x[0] = 1;
    x[1] = static_cast<float>(src + 1);
    x[2] = static_cast<float>(t % 64);
    x[3] = static_cast<float>(t / 64);
  }
  for (int64_t r = 0; r < int64_t(d.inputs.router_weights.size()); ++r)
    d.inputs.router_weights[r] = r % shape.top_k == hot_slot ? 1.f : 0.f;
  // One expert's weights: gate picks x[0] * 32, up is the identity on the first I columns, down the identity
  // back plus markers read off h[0] = 32.
  auto set_expert = [&](float* gate, float* up, float* down, const float* markers, const int64_t* marker_rows) {
    std::fill(gate, gate + i * h, 0.f);
    std::fill(up, up + i * h, 0.f);
    std::fill(down, down + h * i, 0.f);
    for (int64_t r = 0; r < i; ++r) {
      gate[r * h + 0] = 32;
      up[r * h + r] = 1;
      down[r * i + r] = 1.f / 32;
    }
    for (int m = 0; m < 2; ++m)
      if (marker_rows[m] >= 0) down[marker_rows[m] * i + 0] = markers[m] / 32;
  };
  for (int64_t e = 0; e < shape.num_experts; ++e) {
    const float markers[2] = {static_cast<float>((e + 1) % 16), static_cast<float>((e + 1) / 16)};
    const int64_t rows[2] = {i, i + 1};
    set_expert(d.params.expert_gate.data() + e * i * h, d.params.expert_up.data() + e * i * h,
               d.params.expert_down.data() + e * h * i, markers, rows);
  }
  if (shape.shared_expert) {
    const float markers[2] = {100, 0};
    const int64_t rows[2] = {i + 2, -1};
    set_expert(d.params.shared_gate.data(), d.params.shared_up.data(), d.params.shared_down.data(), markers, rows);
  }
  return d;
}

std::string check_provenance(const LayerData& data, int rank, const std::vector<uint16_t>& out) {
  const reference::LayerShape& s = data.shape;
  const int64_t h = s.hidden, i = s.intermediate, k = s.top_k;
  for (int64_t t = 0; t < s.tokens_per_rank; ++t) {
    const int64_t token = int64_t(rank) * s.tokens_per_rank + t;
    const float* x = data.inputs.x.data() + token * h;
    int32_t hot = -1;
    for (int64_t j = 0; j < k; ++j)
      if (data.inputs.router_weights[token * k + j] != 0) hot = data.inputs.topk_idx[token * k + j];
    const float copies = (s.shared_expert ? 1.f : 0.f) + (hot >= 0 ? 1.f : 0.f);
    for (int64_t c = 0; c < h; ++c) {
      float want = 0;
      if (c < i) want = copies * x[c];
      if (c == i && hot >= 0) want = static_cast<float>((hot + 1) % 16);
      if (c == i + 1 && hot >= 0) want = static_cast<float>((hot + 1) / 16);
      if (c == i + 2 && s.shared_expert) want = 100;
      const uint16_t got = out[t * h + c];
      if (got != to_bf16_bits(want)) {
        std::ostringstream m;
        m << "rank " << rank << " token " << t << " column " << c << ": got " << from_bf16_bits(got) << ", want "
          << want << " (hot expert " << hot << ", source rank encoded as x[1] = " << x[1] << ")";
        return m.str();
      }
    }
  }
  return "";
}

// Device buffers of one local rank: inputs, weights, output, and its forward context; the backward's
// d_out and gradients once used.
struct MoeHarness::RankBuffers {
  int device = 0;
  std::vector<void*> allocations;
  void *x = nullptr, *topk = nullptr, *rw = nullptr, *out = nullptr;
  void *expert_gate = nullptr, *expert_up = nullptr, *expert_down = nullptr;
  void *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
  MoeWeights weights;
  ForwardContext context;
  void *d_out = nullptr, *d_x = nullptr, *d_rw = nullptr;
  std::array<void*, kNumGradTensors> grads{};  // null: not computed
  MoeWeightGrads weight_grads;

  void* alloc(int64_t bytes) {
    void* p = nullptr;
    MOK_CHECK_CUDA(cudaMalloc(&p, std::max<int64_t>(bytes, 16)));
    allocations.push_back(p);
    return p;
  }
  void free_grads() {
    for (void*& p : grads) {
      if (p != nullptr) cudaFree(p);
      p = nullptr;
    }
    weight_grads = MoeWeightGrads{};
  }
  WeightGrad& grad(GradTensor which) {
    switch (which) {
      case GradTensor::kExpertGate: return weight_grads.expert_gate;
      case GradTensor::kExpertUp: return weight_grads.expert_up;
      case GradTensor::kExpertDown: return weight_grads.expert_down;
      case GradTensor::kSharedGate: return weight_grads.shared_gate;
      case GradTensor::kSharedUp: return weight_grads.shared_up;
      case GradTensor::kSharedDown: break;
    }
    return weight_grads.shared_down;
  }
  ~RankBuffers() {
    DeviceGuard guard(device);
    context = ForwardContext();
    free_grads();
    for (void* p : allocations) cudaFree(p);
  }
};

MoeHarness::MoeHarness(PeerGroup group, const MoeShape& shape, const MoeOptions& options)
    : group_(std::move(group)), shape_(shape) {
  workspace_ = std::make_unique<MoeWorkspace>(group_, shape_, options);
  const std::vector<int> local = group_.local_ranks();
  streams_.assign(shape_.ep_size, nullptr);
  buffers_.resize(shape_.ep_size);
  const int64_t t = shape_.num_tokens, k = shape_.top_k, h = shape_.hidden, i = shape_.intermediate;
  const int64_t e = shape_.local_experts();
  for (int r : local) {
    DeviceGuard guard(group_.device(r));
    if (!group_.is_virtual() || r == local.front())
      MOK_CHECK_CUDA(cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking));
    else
      streams_[r] = streams_[local.front()];
    auto b = std::make_unique<RankBuffers>();
    b->device = group_.device(r);
    b->x = b->alloc(t * h * 2);
    b->topk = b->alloc(t * k * 8);
    b->rw = b->alloc(t * k * 4);
    b->out = b->alloc(t * h * 2);
    b->expert_gate = b->alloc(e * i * h * 2);
    b->expert_up = b->alloc(e * i * h * 2);
    b->expert_down = b->alloc(e * h * i * 2);
    if (shape_.shared_expert) {
      b->shared_gate = b->alloc(i * h * 2);
      b->shared_up = b->alloc(i * h * 2);
      b->shared_down = b->alloc(h * i * 2);
    }
    b->weights.expert_gate = TensorRef(b->expert_gate, DType::kBFloat16, {e, i, h});
    b->weights.expert_up = TensorRef(b->expert_up, DType::kBFloat16, {e, i, h});
    b->weights.expert_down = TensorRef(b->expert_down, DType::kBFloat16, {e, h, i});
    if (shape_.shared_expert) {
      b->weights.shared_gate = TensorRef(b->shared_gate, DType::kBFloat16, {i, h});
      b->weights.shared_up = TensorRef(b->shared_up, DType::kBFloat16, {i, h});
      b->weights.shared_down = TensorRef(b->shared_down, DType::kBFloat16, {h, i});
    }
    b->context = workspace_->make_context(r);
    RankForward f;
    f.rank = r;
    f.x = TensorRef(b->x, DType::kBFloat16, {t, h});
    f.topk_idx = TensorRef(b->topk, DType::kInt32, {t, k});
    f.router_weights = TensorRef(b->rw, DType::kFloat32, {t, k});
    f.weights = &b->weights;
    f.out = TensorRef(b->out, DType::kBFloat16, {t, h});
    f.context = &b->context;
    f.stream = streams_[r];
    args_.push_back(f);
    buffers_[r] = std::move(b);
  }
}

void MoeHarness::close() {
  synchronize();
  workspace_->close();
}

MoeHarness::~MoeHarness() {
  for (int r : group_.local_ranks()) {
    DeviceGuard guard(group_.device(r));
    cudaStreamSynchronize(streams_[r]);
  }
  if (group_.local_ranks().size() == static_cast<size_t>(group_.size())) {
    try {
      workspace_->close();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "MoeHarness: close failed: %s\n", e.what());
    }
  }
  buffers_.clear();
  for (int r : group_.local_ranks()) {
    if (group_.is_virtual() && r != group_.local_ranks().front()) continue;
    DeviceGuard guard(group_.device(r));
    cudaStreamDestroy(streams_[r]);
  }
  workspace_.reset();
}

RankForward& MoeHarness::args(int rank) {
  for (RankForward& f : args_)
    if (f.rank == rank) return f;
  throw std::invalid_argument("MoeHarness: rank " + std::to_string(rank) + " is not local");
}

cudaStream_t MoeHarness::stream(int rank) const { return streams_.at(rank); }

namespace {

void copy_bf16(void* dst, const float* src, int64_t count) {
  std::vector<uint16_t> bits(count);
  for (int64_t n = 0; n < count; ++n) bits[n] = to_bf16_bits(src[n]);
  MOK_CHECK_CUDA(cudaMemcpy(dst, bits.data(), count * 2, cudaMemcpyHostToDevice));
}

}  // namespace

void MoeHarness::upload(const LayerData& data, DType index_dtype) {
  const int64_t t = shape_.num_tokens, k = shape_.top_k, h = shape_.hidden, i = shape_.intermediate;
  const int64_t e = shape_.local_experts();
  for (RankForward& f : args_) {
    const int r = f.rank;
    RankBuffers& b = *buffers_[r];
    DeviceGuard guard(b.device);
    copy_bf16(b.x, data.inputs.x.data() + r * t * h, t * h);
    copy_bf16(b.expert_gate, data.params.expert_gate.data() + r * e * i * h, e * i * h);
    copy_bf16(b.expert_up, data.params.expert_up.data() + r * e * i * h, e * i * h);
    copy_bf16(b.expert_down, data.params.expert_down.data() + r * e * h * i, e * h * i);
    if (shape_.shared_expert) {
      copy_bf16(b.shared_gate, data.params.shared_gate.data(), i * h);
      copy_bf16(b.shared_up, data.params.shared_up.data(), i * h);
      copy_bf16(b.shared_down, data.params.shared_down.data(), h * i);
    }
    const int32_t* ids = data.inputs.topk_idx.data() + r * t * k;
    if (index_dtype == DType::kInt64) {
      std::vector<int64_t> wide(ids, ids + t * k);
      MOK_CHECK_CUDA(cudaMemcpy(b.topk, wide.data(), t * k * 8, cudaMemcpyHostToDevice));
    } else {
      MOK_CHECK_CUDA(cudaMemcpy(b.topk, ids, t * k * 4, cudaMemcpyHostToDevice));
    }
    f.topk_idx.dtype = index_dtype;
    MOK_CHECK_CUDA(cudaMemcpy(b.rw, data.inputs.router_weights.data() + r * t * k, t * k * 4, cudaMemcpyHostToDevice));
  }
  landed();
}

void MoeHarness::use_fused_gate_up(const LayerData& data) {
  const int64_t h = shape_.hidden, i = shape_.intermediate, e = shape_.local_experts();
  for (RankForward& f : args_) {
    RankBuffers& b = *buffers_[f.rank];
    DeviceGuard guard(b.device);
    void* fused = b.alloc(e * 2 * i * h * 2);
    for (int64_t expert = 0; expert < e; ++expert) {
      const int64_t global = f.rank * e + expert;
      char* dst = static_cast<char*>(fused) + expert * 2 * i * h * 2;
      copy_bf16(dst, data.params.expert_gate.data() + global * i * h, i * h);
      copy_bf16(dst + i * h * 2, data.params.expert_up.data() + global * i * h, i * h);
    }
    b.weights.expert_gate = TensorRef(fused, DType::kBFloat16, {e, 2 * i, h});
    b.weights.expert_up = TensorRef();
  }
  landed();
  if (!backward_args_.empty()) set_grads(grad_setups_);  // the gradients follow the weights' layout
}

void MoeHarness::fill_hashed(uint64_t seed, int range, float weight_scale, float x_scale) {
  const int64_t t = shape_.num_tokens, h = shape_.hidden, i = shape_.intermediate;
  const int64_t e = shape_.local_experts();
  for (RankForward& f : args_) {
    RankBuffers& b = *buffers_[f.rank];
    DeviceGuard guard(b.device);
    const uint64_t s = seed + 100 * uint64_t(f.rank);
    fill_hashed_bf16(b.x, t * h, s, -range, range, nullptr, x_scale);
    fill_hashed_bf16(b.expert_gate, e * i * h, s + 1, -range, range, nullptr, weight_scale);
    fill_hashed_bf16(b.expert_up, e * i * h, s + 2, -range, range, nullptr, weight_scale);
    fill_hashed_bf16(b.expert_down, e * h * i, s + 3, -range, range, nullptr, weight_scale);
    if (shape_.shared_expert) {  // the same shared expert on every rank
      fill_hashed_bf16(b.shared_gate, i * h, seed + 4, -range, range, nullptr, weight_scale);
      fill_hashed_bf16(b.shared_up, i * h, seed + 5, -range, range, nullptr, weight_scale);
      fill_hashed_bf16(b.shared_down, h * i, seed + 6, -range, range, nullptr, weight_scale);
    }
  }
  landed();
}

void MoeHarness::upload_routing(const std::vector<std::vector<int32_t>>& topk,
                                const std::vector<std::vector<float>>& weights) {
  const int64_t routes = int64_t(shape_.num_tokens) * shape_.top_k;
  for (RankForward& f : args_) {
    RankBuffers& b = *buffers_[f.rank];
    if (int64_t(topk.at(f.rank).size()) != routes || int64_t(weights.at(f.rank).size()) != routes)
      throw std::invalid_argument("upload_routing: wrong size");
    DeviceGuard guard(b.device);
    MOK_CHECK_CUDA(cudaMemcpy(b.topk, topk[f.rank].data(), routes * 4, cudaMemcpyHostToDevice));
    MOK_CHECK_CUDA(cudaMemcpy(b.rw, weights[f.rank].data(), routes * 4, cudaMemcpyHostToDevice));
    f.topk_idx.dtype = DType::kInt32;
  }
  landed();
}

RankForward& MoeHarness::local_args(int rank) {
  for (RankForward& f : args_)
    if (f.rank == rank) return f;
  throw std::invalid_argument("MoeHarness: rank " + std::to_string(rank) + " is not local");
}

void MoeHarness::set_call_tokens(int rank, int tokens) {
  if (tokens < 0 || tokens > shape_.num_tokens)
    throw std::invalid_argument("set_call_tokens: " + std::to_string(tokens) + " outside [0, num_tokens]");
  RankForward& f = local_args(rank);
  const RankBuffers& b = *buffers_.at(rank);
  const int64_t t = tokens, k = shape_.top_k, h = shape_.hidden;
  auto data = [&](void* p) { return tokens > 0 ? p : nullptr; };
  f.x = TensorRef(data(b.x), DType::kBFloat16, {t, h});
  f.topk_idx = TensorRef(data(b.topk), f.topk_idx.dtype, {t, k});
  f.router_weights = TensorRef(data(b.rw), DType::kFloat32, {t, k});
  f.out = TensorRef(data(b.out), DType::kBFloat16, {t, h});
}

void MoeHarness::poison_outputs() {
  synchronize();
  const int64_t count = int64_t(shape_.num_tokens) * shape_.hidden;
  const std::vector<uint16_t> poison(count, kBf16Poison);
  for (RankForward& f : args_) {
    DeviceGuard guard(buffers_[f.rank]->device);
    MOK_CHECK_CUDA(cudaMemcpy(buffers_[f.rank]->out, poison.data(), count * 2, cudaMemcpyHostToDevice));
  }
  // Without this the last rank's poison could land after the forward wrote its output (round 21: a test process
  // beside two others, their uploads keeping the copy engines busy, got rank 1's poison back unreported).
  landed();
}

void MoeHarness::forward() {
  poison_outputs();
  workspace_->forward(args_);
}

void MoeHarness::landed() {
  for (const RankForward& f : args_) {
    DeviceGuard guard(buffers_[f.rank]->device);
    MOK_CHECK_CUDA(cudaDeviceSynchronize());
  }
}

void MoeHarness::synchronize() {
  for (const RankForward& f : args_) {
    DeviceGuard guard(buffers_[f.rank]->device);
    MOK_CHECK_CUDA(cudaStreamSynchronize(f.stream));
  }
}

std::vector<uint16_t> MoeHarness::out_bits(int rank) {
  synchronize();
  std::vector<uint16_t> bits(int64_t(shape_.num_tokens) * shape_.hidden);
  DeviceGuard guard(buffers_.at(rank)->device);
  MOK_CHECK_CUDA(cudaMemcpy(bits.data(), buffers_[rank]->out, bits.size() * 2, cudaMemcpyDeviceToHost));
  return bits;
}

CheckRank MoeHarness::check_rank(int rank) const {
  const RankBuffers& b = *buffers_.at(rank);
  return {b.x, static_cast<const int32_t*>(b.topk), static_cast<const float*>(b.rw), b.expert_gate, b.expert_up,
          b.expert_down};
}

CheckShared MoeHarness::check_shared(int rank) const {
  const RankBuffers& b = *buffers_.at(rank);
  return {b.shared_gate, b.shared_up, b.shared_down};
}

std::vector<std::vector<uint16_t>> MoeHarness::run_checked(int runs) {
  std::vector<std::vector<uint16_t>> outs;
  for (int run = 0; run < runs; ++run) {
    forward();
    for (const RankForward& f : args_) {
      const StatusReport report = status(f.rank);
      if (!report.ok())
        throw std::runtime_error("rank " + std::to_string(f.rank) + ": " +
                                 report.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts));
      outs.push_back(out_bits(f.rank));
    }
  }
  return outs;
}

StatusReport MoeHarness::status(int rank) { return workspace_->read_status(rank, stream(rank)); }

void MoeHarness::reset_status() {
  for (const RankForward& f : args_) workspace_->reset_status(f.rank, f.stream);
  synchronize();
}

void MoeHarness::check_status() {
  for (const RankForward& f : args_) {
    const StatusReport report = status(f.rank);
    if (!report.ok())
      throw std::runtime_error("rank " + std::to_string(f.rank) + ": " +
                               report.describe(shape_.num_tokens, shape_.top_k, shape_.num_experts));
  }
}

namespace {

int64_t tensor_bytes(const TensorRef& t) {
  int64_t count = 1;
  for (int d = 0; d < t.ndim; ++d) count *= t.shape[d];
  return count * (t.dtype == DType::kFloat32 || t.dtype == DType::kInt32 ? 4 : t.dtype == DType::kInt64 ? 8 : 2);
}

}  // namespace

void MoeHarness::ensure_backward() {
  if (!backward_args_.empty()) return;
  const int64_t t = shape_.num_tokens, k = shape_.top_k, h = shape_.hidden;
  for (const RankForward& f : args_) {
    RankBuffers& b = *buffers_[f.rank];
    DeviceGuard guard(b.device);
    b.d_out = b.alloc(t * h * 2);
    b.d_x = b.alloc(t * h * 2);
    b.d_rw = b.alloc(t * k * 4);
    MOK_CHECK_CUDA(cudaMemset(b.d_out, 0, t * h * 2));
    RankBackward a;
    a.rank = f.rank;
    a.d_out = TensorRef(b.d_out, DType::kBFloat16, {t, h});
    a.d_x = TensorRef(b.d_x, DType::kBFloat16, {t, h});
    a.d_router_weights = TensorRef(b.d_rw, DType::kFloat32, {t, k});
    a.weight_grads = &b.weight_grads;
    backward_args_.push_back(a);
  }
  set_grads(grad_setups_);
}

void MoeHarness::upload_d_out(const std::vector<float>& d_out) {
  ensure_backward();
  const int64_t t = shape_.num_tokens, h = shape_.hidden;
  if (int64_t(d_out.size()) != int64_t(shape_.ep_size) * t * h)
    throw std::invalid_argument("upload_d_out: expected ep_size * T * H values");
  for (const RankForward& f : args_) {
    DeviceGuard guard(buffers_[f.rank]->device);
    copy_bf16(buffers_[f.rank]->d_out, d_out.data() + f.rank * t * h, t * h);
  }
  landed();
}

void MoeHarness::set_grads(const GradSetups& setups) {
  ensure_backward();  // (re-enters here once, with the defaults)
  synchronize();
  grad_setups_ = setups;
  const int64_t e = shape_.local_experts(), h = shape_.hidden, i = shape_.intermediate;
  for (const RankForward& f : args_) {
    RankBuffers& b = *buffers_[f.rank];
    DeviceGuard guard(b.device);
    b.free_grads();
    const bool fused = b.weights.expert_up.empty();
    for (int n = 0; n < kNumGradTensors; ++n) {
      const GradTensor which = static_cast<GradTensor>(n);
      const bool shared = which >= GradTensor::kSharedGate;
      if (!setups[n].compute || (shared && !shape_.shared_expert) || (fused && which == GradTensor::kExpertUp))
        continue;
      const DType dtype = setups[n].dtype;
      TensorRef ref;  // the parameter's shape
      switch (which) {
        case GradTensor::kExpertGate: ref = TensorRef(nullptr, dtype, {e, fused ? 2 * i : i, h}); break;
        case GradTensor::kExpertUp: ref = TensorRef(nullptr, dtype, {e, i, h}); break;
        case GradTensor::kExpertDown: ref = TensorRef(nullptr, dtype, {e, h, i}); break;
        case GradTensor::kSharedGate:
        case GradTensor::kSharedUp: ref = TensorRef(nullptr, dtype, {i, h}); break;
        case GradTensor::kSharedDown: ref = TensorRef(nullptr, dtype, {h, i}); break;
      }
      const int64_t bytes = tensor_bytes(ref);
      MOK_CHECK_CUDA(cudaMalloc(&b.grads[n], bytes));
      MOK_CHECK_CUDA(cudaMemset(b.grads[n], 0, bytes));
      ref.data = b.grads[n];
      b.grad(which) = WeightGrad{ref, setups[n].mode};
    }
  }
  landed();
}

void MoeHarness::poison_grads() {
  ensure_backward();
  synchronize();
  for (const RankBackward& a : backward_args_) {
    RankBuffers& b = *buffers_[a.rank];
    DeviceGuard guard(b.device);
    MOK_CHECK_CUDA(cudaMemset(b.d_x, 0xff, int64_t(shape_.num_tokens) * shape_.hidden * 2));
    MOK_CHECK_CUDA(cudaMemset(b.d_rw, 0xff, int64_t(shape_.num_tokens) * shape_.top_k * 4));
    for (int n = 0; n < kNumGradTensors; ++n) {
      const WeightGrad& g = b.grad(static_cast<GradTensor>(n));
      if (!g.grad.empty() && g.mode == GradMode::kWrite)
        MOK_CHECK_CUDA(cudaMemset(g.grad.mutable_data(), 0xff, tensor_bytes(g.grad)));
    }
  }
  landed();
}

void MoeHarness::zero_weight_grads() {
  ensure_backward();
  synchronize();
  for (const RankBackward& a : backward_args_) {
    RankBuffers& b = *buffers_[a.rank];
    DeviceGuard guard(b.device);
    for (int n = 0; n < kNumGradTensors; ++n) {
      const WeightGrad& g = b.grad(static_cast<GradTensor>(n));
      if (!g.grad.empty()) MOK_CHECK_CUDA(cudaMemset(g.grad.mutable_data(), 0, tensor_bytes(g.grad)));
    }
  }
  landed();
}

const std::vector<RankBackward>& MoeHarness::all_backward_args() {
  ensure_backward();
  for (size_t n = 0; n < args_.size(); ++n) {
    const RankForward& f = args_[n];
    RankBackward& a = backward_args_[n];
    a.x = f.x;
    a.topk_idx = f.topk_idx;
    a.router_weights = f.router_weights;
    a.weights = f.weights;
    a.context = f.context;
    a.stream = f.stream;
    // The forward's tokens (set_call_tokens).
    const RankBuffers& b = *buffers_[f.rank];
    const int64_t t = f.topk_idx.shape[0], k = shape_.top_k, h = shape_.hidden;
    a.d_out = TensorRef(t > 0 ? b.d_out : nullptr, DType::kBFloat16, {t, h});
    a.d_x = TensorRef(t > 0 ? b.d_x : nullptr, DType::kBFloat16, {t, h});
    a.d_router_weights = TensorRef(t > 0 ? b.d_rw : nullptr, DType::kFloat32, {t, k});
  }
  return backward_args_;
}

void MoeHarness::backward() {
  const std::vector<RankBackward>& args = all_backward_args();
  poison_grads();
  workspace_->backward(args);
}

std::vector<uint16_t> MoeHarness::d_x_bits(int rank) {
  ensure_backward();
  synchronize();
  std::vector<uint16_t> bits(int64_t(shape_.num_tokens) * shape_.hidden);
  DeviceGuard guard(buffers_.at(rank)->device);
  MOK_CHECK_CUDA(cudaMemcpy(bits.data(), buffers_[rank]->d_x, bits.size() * 2, cudaMemcpyDeviceToHost));
  return bits;
}

std::vector<float> MoeHarness::d_router_weights(int rank) {
  ensure_backward();
  synchronize();
  std::vector<float> values(int64_t(shape_.num_tokens) * shape_.top_k);
  DeviceGuard guard(buffers_.at(rank)->device);
  MOK_CHECK_CUDA(cudaMemcpy(values.data(), buffers_[rank]->d_rw, values.size() * 4, cudaMemcpyDeviceToHost));
  return values;
}

std::vector<float> MoeHarness::weight_grad(int rank, GradTensor which) {
  ensure_backward();
  synchronize();
  RankBuffers& b = *buffers_.at(rank);
  const bool fused = b.weights.expert_up.empty();
  const bool from_fused = fused && (which == GradTensor::kExpertGate || which == GradTensor::kExpertUp);
  const WeightGrad& g = b.grad(from_fused ? GradTensor::kExpertGate : which);
  if (g.grad.empty()) return {};
  const int64_t bytes = tensor_bytes(g.grad);
  std::vector<uint8_t> raw(bytes);
  DeviceGuard guard(b.device);
  MOK_CHECK_CUDA(cudaMemcpy(raw.data(), g.grad.data, bytes, cudaMemcpyDeviceToHost));
  const bool fp32 = g.grad.dtype == DType::kFloat32;
  const int64_t count = bytes / (fp32 ? 4 : 2);
  auto value = [&](int64_t n) {
    if (fp32) {
      float v;
      std::memcpy(&v, raw.data() + n * 4, 4);
      return v;
    }
    uint16_t bits;
    std::memcpy(&bits, raw.data() + n * 2, 2);
    return from_bf16_bits(bits);
  };
  std::vector<float> values;
  if (!from_fused) {
    values.resize(count);
    for (int64_t n = 0; n < count; ++n) values[n] = value(n);
    return values;
  }
  // [E, 2I, H]: each expert's gate rows, then its up rows.
  const int64_t e = shape_.local_experts(), expert = int64_t(shape_.intermediate) * shape_.hidden;
  const int64_t half = which == GradTensor::kExpertGate ? 0 : expert;
  values.resize(e * expert);
  for (int64_t x = 0; x < e; ++x)
    for (int64_t n = 0; n < expert; ++n) values[x * expert + n] = value(x * 2 * expert + half + n);
  return values;
}

std::vector<std::pair<std::string, std::vector<uint8_t>>> MoeHarness::raw_grads(int rank) {
  ensure_backward();
  synchronize();
  RankBuffers& b = *buffers_.at(rank);
  DeviceGuard guard(b.device);
  std::vector<std::pair<std::string, std::vector<uint8_t>>> out;
  auto add = [&](const std::string& name, const TensorRef& t) {
    std::vector<uint8_t> bytes(tensor_bytes(t));
    MOK_CHECK_CUDA(cudaMemcpy(bytes.data(), t.data, bytes.size(), cudaMemcpyDeviceToHost));
    out.emplace_back(name, std::move(bytes));
  };
  const RankBackward& a = backward_args_.at(std::find_if(args_.begin(), args_.end(),
                                                         [&](const RankForward& f) { return f.rank == rank; }) -
                                            args_.begin());
  add("d_x", a.d_x);
  add("d_router_weights", a.d_router_weights);
  for (int n = 0; n < kNumGradTensors; ++n) {
    const WeightGrad& g = b.grad(static_cast<GradTensor>(n));
    if (!g.grad.empty()) add(grad_tensor_name(static_cast<GradTensor>(n)), g.grad);
  }
  return out;
}

std::vector<uint16_t> MoeHarness::context_bits(const ForwardContext& ctx) {
  synchronize();
  DeviceGuard guard(group_.device(ctx.rank()));
  const int64_t ring = ctx.ring_rows(), h = shape_.hidden, i = shape_.intermediate;
  const int64_t pt = workspace_->padded_tokens();
  const int64_t kept = ctx.gate_up() != nullptr ? ring * 2 * i : 0;
  const int64_t shared_kept = ctx.shared_gate_up() != nullptr ? pt * 2 * i : 0;
  std::vector<uint16_t> bits(ring * h + ring * i + pt * i + kept + shared_kept);
  uint16_t* at = bits.data();
  auto copy = [&](const void* src, int64_t count) {
    MOK_CHECK_CUDA(cudaMemcpy(at, src, count * 2, cudaMemcpyDeviceToHost));
    at += count;
  };
  copy(ctx.expert_rows(), ring * h);
  copy(ctx.hidden(), ring * i);
  copy(ctx.shared_hidden(), pt * i);
  if (kept > 0) copy(ctx.gate_up(), kept);
  if (shared_kept > 0) copy(ctx.shared_gate_up(), shared_kept);
  return bits;
}

std::string BudgetResult::describe(int hidden) const {
  std::ostringstream s;
  s << "worst |gpu - ref| / budget = " << worst_ratio;
  if (worst_index >= 0)
    s << " at token " << worst_index / hidden << ", column " << worst_index % hidden << " (gpu " << got << ", ref "
      << want << ")";
  return s.str();
}

BudgetResult compare_within_budget(const std::vector<uint16_t>& gpu, const float* ref, int64_t count,
                                   const float* extra) {
  double sum_squares = 0;
  for (int64_t n = 0; n < count; ++n) sum_squares += double(ref[n]) * ref[n];
  const double rms = std::sqrt(sum_squares / std::max<int64_t>(count, 1));
  BudgetResult result;
  for (int64_t n = 0; n < count; ++n) {
    const float got = from_bf16_bits(gpu[n]);
    const double budget = std::ldexp(std::fabs(ref[n]) + rms, -6) + (extra != nullptr ? extra[n] : 0.0);
    const double ratio = std::isfinite(got) ? std::fabs(got - ref[n]) / budget : std::numeric_limits<double>::infinity();
    if (!(ratio <= result.worst_ratio)) {
      result.worst_ratio = ratio;
      result.worst_index = n;
      result.got = got;
      result.want = ref[n];
    }
  }
  return result;
}

reference::LayerGrads<float> shared_reference(const LayerData& data, const reference::LayerParams<float>& params,
                                              const std::vector<float>& d_out, int rank, bool magnitudes,
                                              const reference::Fp8Recipe& recipe) {
  const reference::LayerShape& g = data.shape;
  const int64_t t = g.tokens_per_rank, h = g.hidden, k = g.top_k;
  reference::LayerShape one = g;
  one.num_ranks = 1;
  reference::LayerInputs<float> inputs;
  inputs.x.assign(data.inputs.x.begin() + rank * t * h, data.inputs.x.begin() + (rank + 1) * t * h);
  inputs.topk_idx.assign(t * k, -1);
  inputs.router_weights.assign(t * k, 0.f);
  const std::vector<float> rank_d_out(d_out.begin() + rank * t * h, d_out.begin() + (rank + 1) * t * h);
  return reference::backward(one, params, inputs, rank_d_out, 0, magnitudes, recipe);
}

std::pair<LayerData, std::vector<float>> exactly_tokens(const LayerData& data, const std::vector<float>& d_out,
                                                        int tokens) {
  LayerData exact = data;
  const int64_t t = data.shape.tokens_per_rank, h = data.shape.hidden, k = data.shape.top_k;
  exact.shape.tokens_per_rank = tokens;
  exact.inputs.x.clear(), exact.inputs.topk_idx.clear(), exact.inputs.router_weights.clear();
  std::vector<float> exact_d_out;
  for (int r = 0; r < data.shape.num_ranks; ++r) {
    const int64_t first = r * t;
    exact.inputs.x.insert(exact.inputs.x.end(), data.inputs.x.begin() + first * h,
                          data.inputs.x.begin() + (first + tokens) * h);
    exact_d_out.insert(exact_d_out.end(), d_out.begin() + first * h, d_out.begin() + (first + tokens) * h);
    exact.inputs.topk_idx.insert(exact.inputs.topk_idx.end(), data.inputs.topk_idx.begin() + first * k,
                                 data.inputs.topk_idx.begin() + (first + tokens) * k);
    exact.inputs.router_weights.insert(exact.inputs.router_weights.end(),
                                       data.inputs.router_weights.begin() + first * k,
                                       data.inputs.router_weights.begin() + (first + tokens) * k);
  }
  return {exact, exact_d_out};
}

RawGrads raw_grads(MoeHarness& harness) {
  RawGrads all;
  for (const RankForward& f : harness.all_args()) all.push_back(harness.raw_grads(f.rank));
  return all;
}

std::string first_difference(const RawGrads& got, const RawGrads& want) {
  if (got.size() != want.size()) return "different rank counts";
  for (size_t r = 0; r < want.size(); ++r) {
    if (got[r].size() != want[r].size()) return "rank " + std::to_string(r) + ": different gradient sets";
    for (size_t n = 0; n < want[r].size(); ++n) {
      const auto& [name, bytes] = want[r][n];
      if (got[r][n].first != name || got[r][n].second.size() != bytes.size())
        return "rank " + std::to_string(r) + ": " + name + " differs in shape";
      for (size_t b = 0; b < bytes.size(); ++b)
        if (got[r][n].second[b] != bytes[b])
          return "rank " + std::to_string(r) + " " + name + ": byte " + std::to_string(b) + " differs";
    }
  }
  return "";
}

WeightGrads all_weight_grads(MoeHarness& harness) {
  WeightGrads g;
  for (const RankForward& f : harness.all_args())
    for (int n = 0; n < kNumGradTensors; ++n) g.push_back(harness.weight_grad(f.rank, GradTensor(n)));
  return g;
}

std::vector<std::vector<uint8_t>> token_grads(MoeHarness& harness) {
  std::vector<std::vector<uint8_t>> t;
  for (const RankForward& f : harness.all_args()) {
    auto raw = harness.raw_grads(f.rank);
    t.push_back(raw[0].second);
    t.push_back(raw[1].second);
  }
  return t;
}

namespace {
// The first element n of tensor `index` where bits(got) != bits(want(n)), described; "" when none.
template <class Want>
std::string first_bits_difference(const WeightGrads& got, size_t tensors, const char* what, Want want) {
  if (got.size() != tensors) return std::string(what) + ": different tensor counts";
  for (size_t index = 0; index < tensors; ++index) {
    const std::string tensor = std::string(what) + ", rank index " + std::to_string(index / kNumGradTensors) + " " +
                               grad_tensor_name(GradTensor(index % kNumGradTensors));
    for (size_t n = 0; n < got[index].size(); ++n) {
      const float expected = want(index, n);
      if (float_bits(got[index][n]) != float_bits(expected))
        return tensor + " element " + std::to_string(n) + ": " + std::to_string(got[index][n]) + " vs " +
               std::to_string(expected);
    }
  }
  return "";
}
}  // namespace

std::string bf16_write_difference(const WeightGrads& got, const WeightGrads& written) {
  for (size_t index = 0; index < std::min(got.size(), written.size()); ++index)
    if (got[index].size() != written[index].size()) return "bf16 write: tensor " + std::to_string(index) + "'s size";
  return first_bits_difference(got, written.size(), "bf16 write",
                               [&](size_t index, size_t n) { return round_to_bf16(written[index][n]); });
}

std::string accumulation_difference(const WeightGrads& got, const WeightGrads& first, const WeightGrads& second) {
  for (size_t index = 0; index < std::min(got.size(), first.size()); ++index)
    if (got[index].size() != first[index].size() || second[index].size() != first[index].size())
      return "accumulate: tensor " + std::to_string(index) + "'s size";
  return first_bits_difference(got, first.size(), "accumulate", [&](size_t index, size_t n) {
    volatile float sum = 0.f + first[index][n];  // the GPU's two fp32 additions, in its order
    sum = sum + second[index][n];
    return static_cast<float>(sum);
  });
}

std::vector<float> bf16_values(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t n = 0; n < bits.size(); ++n) v[n] = from_bf16_bits(bits[n]);
  return v;
}

}  // namespace mok::testing
