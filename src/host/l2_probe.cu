// Experiment: L2 latency probe per SM (see probe_l2 in mok/expert_gemm.h).
#include <cstdint>
#include <vector>

#include "mok/expert_gemm.h"
#include "src/host/check.h"

namespace mok {
namespace {

__device__ __forceinline__ uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ uint32_t load_cg(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Cycle counter read after `v` is available (the fake input orders it behind the load that produced v).
__device__ __forceinline__ int64_t clock_after(uint32_t v) {
  int64_t t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) : "r"(v) : "memory");
  return t;
}

// buf holds zeros, so every loaded value is 0 and adding it to the next address only orders the loads.
__device__ void time_lines(const uint32_t* buf, int64_t buf_lines, int set, int lines, int64_t* out) {
  uint32_t v = 0;
  int64_t t = clock_after(v);
  for (int i = 0; i < lines; ++i) {
    const int64_t word = int64_t(mix(uint64_t(set) * lines + i) % uint64_t(buf_lines)) * 32;
    v = load_cg(buf + word + v);
    const int64_t t1 = clock_after(v);
    out[i] = t1 - t;
    t = clock_after(v);
  }
}

__global__ void l2_probe_kernel(const uint32_t* buf, int64_t buf_lines, int lines, int64_t* out, int32_t* sm_out,
                                int32_t* flags) {
  if (threadIdx.x != 0) return;
  const int b = blockIdx.x;
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  sm_out[b] = static_cast<int32_t>(sm);
  volatile int32_t* vflags = flags;
  if (b == 0) {
    uint32_t acc = 0;
    for (int set = 0; set < gridDim.x; ++set)
      for (int i = 0; i < lines; ++i)
        acc += load_cg(buf + int64_t(mix(uint64_t(set) * lines + i) % uint64_t(buf_lines)) * 32);
    for (int set = 0; set < gridDim.x; ++set) time_lines(buf, buf_lines, set, lines, out + (int64_t(set) * 2) * lines + acc);
    __threadfence();
    atomicExch(&flags[1], 0);
    atomicExch(&flags[0], 1);
    return;
  }
  const int64_t deadline = clock64() + (int64_t(1) << 33);
  while (vflags[0] == 0 || vflags[1] != b - 1) {
    if (clock64() > deadline) return;
  }
  time_lines(buf, buf_lines, b, lines, out + (int64_t(b) * 2 + 1) * lines);
  __threadfence();
  atomicExch(&flags[1], b);
}

}  // namespace

void probe_l2(int lines, int64_t* out_host, int32_t* sm_host, int* num_sms_out) {
  int device = 0, num_sms = 0, max_smem = 0;
  MOK_CHECK_CUDA(cudaGetDevice(&device));
  MOK_CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  MOK_CHECK_CUDA(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t buf_lines = (int64_t(64) << 20) / 128;
  uint32_t* buf = nullptr;
  int64_t* out = nullptr;
  int32_t *sm = nullptr, *flags = nullptr;
  MOK_CHECK_CUDA(cudaMalloc(&buf, buf_lines * 128));
  MOK_CHECK_CUDA(cudaMemset(buf, 0, buf_lines * 128));
  MOK_CHECK_CUDA(cudaMalloc(&out, sizeof(int64_t) * num_sms * 2 * lines));
  MOK_CHECK_CUDA(cudaMemset(out, 0, sizeof(int64_t) * num_sms * 2 * lines));
  MOK_CHECK_CUDA(cudaMalloc(&sm, sizeof(int32_t) * num_sms));
  MOK_CHECK_CUDA(cudaMalloc(&flags, sizeof(int32_t) * 2));
  MOK_CHECK_CUDA(cudaMemset(flags, 0, sizeof(int32_t) * 2));
  // Evict the buffer from L2 first: touch 256 MB of other data.
  void* flush = nullptr;
  MOK_CHECK_CUDA(cudaMalloc(&flush, size_t(256) << 20));
  MOK_CHECK_CUDA(cudaMemset(flush, 1, size_t(256) << 20));
  MOK_CHECK_CUDA(cudaFuncSetAttribute(l2_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
  l2_probe_kernel<<<num_sms, 32, max_smem>>>(buf, buf_lines, lines, out, sm, flags);
  MOK_CHECK_CUDA(cudaGetLastError());
  MOK_CHECK_CUDA(cudaDeviceSynchronize());
  MOK_CHECK_CUDA(cudaMemcpy(out_host, out, sizeof(int64_t) * num_sms * 2 * lines, cudaMemcpyDeviceToHost));
  MOK_CHECK_CUDA(cudaMemcpy(sm_host, sm, sizeof(int32_t) * num_sms, cudaMemcpyDeviceToHost));
  *num_sms_out = num_sms;
  cudaFree(buf);
  cudaFree(out);
  cudaFree(sm);
  cudaFree(flags);
  cudaFree(flush);
}

}  // namespace mok
