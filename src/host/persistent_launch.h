// The launch of a persistent kernel: the megakernels' (the forward's, src/host/moe_fused.cu; the backward's,
// src/host/moe_fused_backward.cu), one CTA per SM in clusters of cluster_n, as many as fit at once; and the
// standalone GEMMs' (src/host/expert_gemm.cu, src/host/weight_grad_gemm.cu). Include from .cu files only.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "src/host/check.h"
#include "src/host/launch_cache.h"

namespace mok::detail {

// The launch configuration of `grid_ctas` CTAs of `threads` threads and `smem_bytes` of dynamic shared memory in
// clusters of cluster_n along x; `cluster_attr` holds the cluster attribute the configuration points to.
inline cudaLaunchConfig_t persistent_launch_config(int grid_ctas, int threads, int smem_bytes, int cluster_n,
                                                   cudaStream_t stream, cudaLaunchAttribute* cluster_attr) {
  cluster_attr->id = cudaLaunchAttributeClusterDimension;
  cluster_attr->val.clusterDim.x = cluster_n;
  cluster_attr->val.clusterDim.y = 1;
  cluster_attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid_ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = cluster_attr;
  config.numAttrs = 1;
  return config;
}

// CTAs of the persistent launch of `kernel` on `device`: as many clusters as fit at once (at least two),
// times cluster_n. Sets the kernel's shared-memory attribute on the device (call it before launching there).
// Queried once per device and kernel (src/host/launch_cache.h). `name` names the kernel in the errors.
template <class Kernel>
int persistent_grid_ctas(Kernel kernel, int threads, int smem_bytes, int cluster_n, int device, const char* name) {
  const int max_clusters =
      max_active_clusters(reinterpret_cast<const void*>(kernel), threads, smem_bytes, cluster_n, device, name);
  if (max_clusters < 2) throw std::runtime_error(std::string(name) + ": fewer than two clusters fit on the device");
  return max_clusters * cluster_n;
}

// A standalone GEMM's launch: zeroes its task ticket on `stream`, then `grid_ctas` CTAs of `kernel(args...)`, in
// clusters of cluster_n (0: launched without a cluster attribute).
template <class Kernel, class... Args>
void launch_standalone_gemm(Kernel kernel, int grid_ctas, int threads, int smem_bytes, int cluster_n, int32_t* ticket,
                            cudaStream_t stream, const Args&... args) {
  MOK_CHECK_CUDA(cudaMemsetAsync(ticket, 0, sizeof(int32_t), stream));
  cudaLaunchAttribute cluster_attr;
  cudaLaunchConfig_t config =
      persistent_launch_config(grid_ctas, threads, smem_bytes, cluster_n > 0 ? cluster_n : 1, stream, &cluster_attr);
  if (cluster_n == 0) config.numAttrs = 0;
  MOK_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, args...));
}

}  // namespace mok::detail
