// Per-device launch properties, computed once (src/host/launch_cache.h).
#include "src/host/launch_cache.h"

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include <cuda_runtime_api.h>

#include "src/host/check.h"
#include "src/host/device_guard.h"

namespace mok::detail {
namespace {

std::mutex cache_mutex;
std::map<int, DeviceLimits> limits_by_device;                                  // device
std::map<std::tuple<int, const void*, int>, bool> prepared_kernels;            // device, kernel, smem bytes
std::map<std::tuple<int, const void*, int, int, int>, int> clusters_by_kernel;  // + threads, cluster_n

const DeviceLimits& device_limits_locked(int device) {
  auto it = limits_by_device.find(device);
  if (it != limits_by_device.end()) return it->second;
  DeviceLimits limits;
  MOK_CHECK_CUDA(cudaDeviceGetAttribute(&limits.num_sms, cudaDevAttrMultiProcessorCount, device));
  MOK_CHECK_CUDA(cudaDeviceGetAttribute(&limits.max_shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return limits_by_device.emplace(device, limits).first->second;
}

void prepare_kernel_locked(const void* kernel, int smem_bytes, int device, const char* name) {
  const auto key = std::make_tuple(device, kernel, smem_bytes);
  if (prepared_kernels.count(key) != 0) return;
  const DeviceLimits& limits = device_limits_locked(device);
  if (smem_bytes > limits.max_shared_bytes)
    throw std::runtime_error(std::string(name) + ": needs " + std::to_string(smem_bytes) +
                             " bytes of shared memory per CTA, the device allows " +
                             std::to_string(limits.max_shared_bytes));
  DeviceGuard guard(device);  // the attribute is set on the current device
  MOK_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  prepared_kernels.emplace(key, true);
}

}  // namespace

const DeviceLimits& device_limits(int device) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  return device_limits_locked(device);  // std::map nodes stay put: the reference outlives the lock
}

void prepare_kernel(const void* kernel, int smem_bytes, int device, const char* name) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  prepare_kernel_locked(kernel, smem_bytes, device, name);
}

int max_active_clusters(const void* kernel, int threads, int smem_bytes, int cluster_n, int device, const char* name) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  const auto key = std::make_tuple(device, kernel, smem_bytes, threads, cluster_n);
  auto it = clusters_by_kernel.find(key);
  if (it != clusters_by_kernel.end()) return it->second;
  prepare_kernel_locked(kernel, smem_bytes, device, name);
  const int num_sms = device_limits_locked(device).num_sms;
  cudaLaunchAttribute cluster_attr;
  cluster_attr.id = cudaLaunchAttributeClusterDimension;
  cluster_attr.val.clusterDim.x = cluster_n;
  cluster_attr.val.clusterDim.y = 1;
  cluster_attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(num_sms - num_sms % cluster_n);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.attrs = &cluster_attr;
  config.numAttrs = 1;
  DeviceGuard guard(device);
  int clusters = 0;
  MOK_CHECK_CUDA(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  clusters_by_kernel.emplace(key, clusters);
  return clusters;
}

}  // namespace mok::detail
