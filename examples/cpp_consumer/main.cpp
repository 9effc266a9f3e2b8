// One MoE layer forward through mok's C++ API on one Hopper GPU (EP = 1), checked against a float
// computation on the CPU for a few tokens. Without a Hopper GPU it prints why and exits with status 2.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/moe.h"

namespace {

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// A device copy of host data, freed at scope end.
struct DeviceBuffer {
  void* ptr = nullptr;
  template <class T>
  explicit DeviceBuffer(const std::vector<T>& host) {
    check(cudaMalloc(&ptr, host.size() * sizeof(T)), "cudaMalloc");
    check(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~DeviceBuffer() { cudaFree(ptr); }
};

}  // namespace

int main() {
  const int T = 256, H = 256, I = 128, E = 8, K = 2;
  mok::MoeShape shape{/*ep_size*/ 1, T, K, E, H, I, /*shared_expert*/ false};
  try {
    shape.validate();
    mok::PeerGroup group = mok::PeerGroup::virtual_ranks(1, /*device*/ 0);  // throws without a Hopper GPU
    mok::MoeWorkspace workspace(group, shape);
    mok::ForwardContext ctx = workspace.make_context(0, /*stream*/ nullptr);

    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    auto bf16_random = [&](size_t n, float scale) {
      std::vector<uint16_t> v(n);
      for (auto& e : v) e = to_bf16(normal(rng) * scale);
      return v;
    };
    const auto x = bf16_random(size_t(T) * H, 1.f);
    const auto gate = bf16_random(size_t(E) * I * H, 1.f / std::sqrt(float(H)));
    const auto up = bf16_random(size_t(E) * I * H, 1.f / std::sqrt(float(H)));
    const auto down = bf16_random(size_t(E) * H * I, 1.f / std::sqrt(float(I)));
    std::vector<int32_t> idx(size_t(T) * K);
    std::vector<float> rw(size_t(T) * K);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < K; ++j) {
        idx[t * K + j] = (t + j * 3) % E;  // two different experts per token
        rw[t * K + j] = 0.5f + 0.25f * j;
      }
    DeviceBuffer d_x(x), d_gate(gate), d_up(up), d_down(down), d_idx(idx), d_rw(rw),
        d_out(std::vector<uint16_t>(size_t(T) * H, 0xffff));  // NaN-poisoned output
    using mok::DType;
    mok::MoeWeights weights{.expert_gate = {d_gate.ptr, DType::kBFloat16, {E, I, H}},
                            .expert_up = {d_up.ptr, DType::kBFloat16, {E, I, H}},
                            .expert_down = {d_down.ptr, DType::kBFloat16, {E, H, I}}};
    mok::RankForward f{0, {d_x.ptr, DType::kBFloat16, {T, H}}, {d_idx.ptr, DType::kInt32, {T, K}},
                       {d_rw.ptr, DType::kFloat32, {T, K}}, &weights, {d_out.ptr, DType::kBFloat16, {T, H}},
                       &ctx, /*stream*/ nullptr};
    workspace.forward({&f, 1});
    const mok::StatusReport status = workspace.read_status(0, nullptr);
    if (!status.ok()) throw std::runtime_error("status: " + status.describe(T, K, E));
    std::vector<uint16_t> out(size_t(T) * H);
    check(cudaMemcpy(out.data(), d_out.ptr, out.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");

    // out[t] = sum_j rw[t, j] * down_e(silu(gate_e x) * up_e x), hidden rounded to bf16 as the GPU does.
    double err = 0, ref_norm = 0;
    for (int t = 0; t < T; t += 37) {
      std::vector<double> ref(H, 0.0);
      for (int j = 0; j < K; ++j) {
        const int e = idx[t * K + j];
        std::vector<float> h(I);
        for (int i = 0; i < I; ++i) {
          double g = 0, u = 0;
          for (int c = 0; c < H; ++c) {
            const double xv = from_bf16(x[size_t(t) * H + c]);
            g += xv * from_bf16(gate[(size_t(e) * I + i) * H + c]);
            u += xv * from_bf16(up[(size_t(e) * I + i) * H + c]);
          }
          h[i] = from_bf16(to_bf16(float(g / (1 + std::exp(-g)) * u)));
        }
        for (int c = 0; c < H; ++c) {
          double y = 0;
          for (int i = 0; i < I; ++i) y += double(h[i]) * from_bf16(down[(size_t(e) * H + c) * I + i]);
          ref[c] += rw[t * K + j] * double(from_bf16(to_bf16(float(y))));
        }
      }
      for (int c = 0; c < H; ++c) {
        const double got = from_bf16(out[size_t(t) * H + c]);
        if (!std::isfinite(got)) throw std::runtime_error("out has a non-finite value");
        err += (got - ref[c]) * (got - ref[c]);
        ref_norm += ref[c] * ref[c];
      }
    }
    workspace.close();  // the collective teardown (a no-op collective at EP = 1); the destructor calls none
    const double rel = std::sqrt(err / ref_norm);
    std::printf("mok_consumer: forward of T=%d H=%d I=%d E=%d k=%d on one GPU, relative error vs CPU %.2e\n", T, H,
                I, E, K, rel);
    return rel < 1e-2 ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("mok_consumer: %s\n", e.what());
    return std::strstr(e.what(), "mok needs an NVIDIA Hopper GPU") != nullptr ? 2 : 1;
  }
}
