// What kernel launches need from the device and the kernel, queried once per device (and kernel) and cached
// for the process: the SM count, the shared-memory limit, the kernel's dynamic shared-memory attribute and
// its cluster occupancy. The GEMM launches (expert_gemm, weight_grad_gemm) run on every call of a training
// step, so they take these from here instead of asking the driver each time. Thread-safe (one mutex; each
// value is computed once, under it). A device reset (cudaDeviceReset) is not supported: the attributes set
// before it are not set again.
#pragma once

namespace mok::detail {

struct DeviceLimits {
  int num_sms = 0;
  int max_shared_bytes = 0;  // dynamic shared memory per CTA with the opt-in (cudaDevAttrMaxSharedMemoryPerBlockOptin)
};
const DeviceLimits& device_limits(int device);

// Sets `kernel`'s maximum dynamic shared memory to `smem_bytes` on `device`, once per device and kernel.
// Throws std::runtime_error "<name>: needs <smem_bytes> bytes of shared memory per CTA, the device allows ..."
// when the device has less.
void prepare_kernel(const void* kernel, int smem_bytes, int device, const char* name);

// prepare_kernel, then the number of clusters of `cluster_n` CTAs (`threads` threads, `smem_bytes` dynamic
// shared memory each) of `kernel` resident at once on `device` (cudaOccupancyMaxActiveClusters), once per
// device and kernel configuration.
int max_active_clusters(const void* kernel, int threads, int smem_bytes, int cluster_n, int device, const char* name);

}  // namespace mok::detail
