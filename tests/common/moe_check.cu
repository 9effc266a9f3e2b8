#include "tests/common/moe_check.h"

#include <cuda_bf16.h>

#include "src/host/check.h"

namespace mok::testing {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxEp = 8;

struct CheckParams {
  CheckRank ranks[kMaxEp];
  CheckShared shared;
  int src;
  const int32_t* samples;  // [S]
  float* y;                // [S, k + 1, H]: routes 0..k-1, then the shared expert
  int num_tokens, top_k, num_experts, local_experts, hidden, intermediate;
  float swiglu_limit;
};

__device__ float warp_dot(const __nv_bfloat16* a, const __nv_bfloat16* b, int n, int lane) {
  float sum = 0;
  for (int i = lane; i < n; i += 32) sum += __bfloat162float(a[i]) * __bfloat162float(b[i]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

__device__ float warp_dot_f32(const __nv_bfloat16* a, const float* b, int n, int lane) {
  float sum = 0;
  for (int i = lane; i < n; i += 32) sum += __bfloat162float(a[i]) * b[i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

// Block (sample s, route j): y[s, j, :] = mlp_e(x[token]) in fp32; j == k is the shared expert.
__global__ void __launch_bounds__(kThreads) check_route_kernel(CheckParams p) {
  extern __shared__ float hidden[];  // [I]
  const int s = blockIdx.x, j = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int token = p.samples[s];
  const CheckRank& me = p.ranks[p.src];
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(me.x) + int64_t(token) * p.hidden;
  const __nv_bfloat16 *gate, *up, *down;
  float* y = p.y + (int64_t(s) * (p.top_k + 1) + j) * p.hidden;
  if (j < p.top_k) {
    const int32_t id = me.topk_idx[int64_t(token) * p.top_k + j];
    if (id < 0 || id >= p.num_experts) return;  // masked: never read
    const CheckRank& owner = p.ranks[id / p.local_experts];
    const int64_t e = id % p.local_experts;
    gate = static_cast<const __nv_bfloat16*>(owner.expert_gate) + e * p.intermediate * p.hidden;
    up = static_cast<const __nv_bfloat16*>(owner.expert_up) + e * p.intermediate * p.hidden;
    down = static_cast<const __nv_bfloat16*>(owner.expert_down) + e * p.hidden * p.intermediate;
  } else {
    if (p.shared.gate == nullptr) return;
    gate = static_cast<const __nv_bfloat16*>(p.shared.gate);
    up = static_cast<const __nv_bfloat16*>(p.shared.up);
    down = static_cast<const __nv_bfloat16*>(p.shared.down);
  }
  for (int i = warp; i < p.intermediate; i += kWarps) {
    float g = warp_dot(gate + int64_t(i) * p.hidden, x, p.hidden, lane);
    float u = warp_dot(up + int64_t(i) * p.hidden, x, p.hidden, lane);
    if (p.swiglu_limit > 0) {
      g = fminf(g, p.swiglu_limit);
      u = fminf(fmaxf(u, -p.swiglu_limit), p.swiglu_limit);
    }
    if (lane == 0) hidden[i] = g / (1.f + expf(-g)) * u;
  }
  __syncthreads();
  for (int c = warp; c < p.hidden; c += kWarps) {
    const float v = warp_dot_f32(down + int64_t(c) * p.intermediate, hidden, p.intermediate, lane);
    if (lane == 0) y[c] = v;
  }
}

// out[s, c] = y_shared + sum_j rw_j * y_j (valid routes).
__global__ void check_combine_kernel(CheckParams p, float* out, int num_samples) {
  const int64_t total = int64_t(num_samples) * p.hidden;
  const CheckRank& me = p.ranks[p.src];
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < total; n += int64_t(gridDim.x) * blockDim.x) {
    const int s = static_cast<int>(n / p.hidden), c = static_cast<int>(n % p.hidden);
    const int token = p.samples[s];
    const float* y = p.y + int64_t(s) * (p.top_k + 1) * p.hidden;
    float acc = p.shared.gate != nullptr ? y[int64_t(p.top_k) * p.hidden + c] : 0.f;
    for (int j = 0; j < p.top_k; ++j) {
      const int32_t id = me.topk_idx[int64_t(token) * p.top_k + j];
      if (id < 0 || id >= p.num_experts) continue;
      acc += me.router_weights[int64_t(token) * p.top_k + j] * y[int64_t(j) * p.hidden + c];
    }
    out[n] = acc;
  }
}

}  // namespace

std::vector<float> check_rows_fp32(const MoeShape& shape, const std::vector<CheckRank>& ranks, const CheckShared& shared,
                                   int src, const std::vector<int32_t>& samples) {
  if (shape.ep_size > kMaxEp || static_cast<int>(ranks.size()) != shape.ep_size)
    throw std::invalid_argument("check_rows_fp32: one CheckRank per rank, at most 8");
  CheckParams p{};
  for (int r = 0; r < shape.ep_size; ++r) p.ranks[r] = ranks[r];
  p.shared = shape.shared_expert ? shared : CheckShared{};
  p.src = src;
  p.num_tokens = shape.num_tokens;
  p.top_k = shape.top_k;
  p.num_experts = shape.num_experts;
  p.local_experts = shape.local_experts();
  p.hidden = shape.hidden;
  p.intermediate = shape.intermediate;
  p.swiglu_limit = shape.swiglu_limit;
  const int num_samples = static_cast<int>(samples.size());
  int32_t* samples_device = nullptr;
  float* y = nullptr;
  float* out = nullptr;
  MOK_CHECK_CUDA(cudaMalloc(&samples_device, samples.size() * sizeof(int32_t)));
  MOK_CHECK_CUDA(cudaMalloc(&y, size_t(num_samples) * (shape.top_k + 1) * shape.hidden * sizeof(float)));
  MOK_CHECK_CUDA(cudaMalloc(&out, size_t(num_samples) * shape.hidden * sizeof(float)));
  MOK_CHECK_CUDA(cudaMemcpy(samples_device, samples.data(), samples.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  p.samples = samples_device;
  p.y = y;
  const size_t smem = size_t(shape.intermediate) * sizeof(float);
  MOK_CHECK_CUDA(cudaFuncSetAttribute(check_route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  check_route_kernel<<<dim3(num_samples, shape.top_k + 1), kThreads, smem>>>(p);
  MOK_CHECK_CUDA(cudaGetLastError());
  check_combine_kernel<<<256, kThreads>>>(p, out, num_samples);
  MOK_CHECK_CUDA(cudaGetLastError());
  std::vector<float> host(size_t(num_samples) * shape.hidden);
  MOK_CHECK_CUDA(cudaMemcpy(host.data(), out, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(samples_device);
  cudaFree(y);
  cudaFree(out);
  return host;
}

}  // namespace mok::testing
