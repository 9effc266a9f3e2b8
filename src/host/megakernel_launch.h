// The launch of a megakernel (src/device/megakernel/megakernel.cuh), written once for the forward
// (src/host/moe_fused.cu) and the backward (src/host/moe_fused_backward.cu): the common parameters, the grid
// query, and the launch that zeroes the pass's counters, its tickets and the timeline before the kernel.
// Include from .cu files only.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "src/device/megakernel/megakernel.cuh"
#include "src/device/megakernel/task_tables.h"
#include "src/device/megakernel/timeline_record.h"
#include "src/host/check.h"
#include "src/host/megakernel_args.h"
#include "src/host/persistent_launch.h"

namespace mok::detail {

// The parameters every megakernel reads, for a pass with counter table `counters` and task order `order`;
// gemm_n_blocks[g]: the pass's GEMM g's n-blocks (the targets of the counters its tiles complete).
template <int N>
megakernel::MegakernelParams megakernel_params(const MegakernelArgs& a, const megakernel::TaskOrderShape& order,
                                               const megakernel::CounterDesc (&counters)[N],
                                               const int32_t* gemm_n_blocks) {
  return {.order = order,
          .scheduled_rows = a.scheduled_rows,
          .row_route = a.row_route,
          .num_tokens = a.num_tokens,
          .top_k = a.top_k,
          .row_vectors = a.hidden * 2 / 16,
          .comm_ctas = a.comm_ctas,
          .counters = megakernel::resolve_counters(counters, a.counters, a.capacity_rows / 64, a.shared_rows / 64,
                                                   gemm_n_blocks),
          .compute_ticket = a.tickets,
          .comm_ticket = a.tickets + 1,
          .rank = a.rank,
          .status = a.status,
          .timeout_ns = a.timeout_ns,
          .timeline = {a.timeline, a.timeline_capacity}};
}

// Dynamic shared memory of a megakernel whose tiles run on traits T.
template <class T>
constexpr int megakernel_shared_bytes() {
  return static_cast<int>(sizeof(megakernel::MegakernelSharedStorage<T>));
}

// CTAs of the persistent launch of `kernel` (tiles on traits T) on `device`; sets its shared-memory attribute
// there (persistent_grid_ctas).
template <class T, class Kernel>
int megakernel_grid_ctas(Kernel kernel, int device, const char* name) {
  return persistent_grid_ctas(kernel, T::kThreads, megakernel_shared_bytes<T>(), T::kClusterN, device, name);
}

// Zeroes the pass's counters (its table `counters` over the capacity and shared rows), the two tickets and the
// timeline on `stream`, then launches a.grid_ctas CTAs of kernel(p) in clusters of T::kClusterN.
template <class T, int N, class Kernel, class Params>
void launch_megakernel(Kernel kernel, const Params& p, const MegakernelArgs& a,
                       const megakernel::CounterDesc (&counters)[N], cudaStream_t stream) {
  const int64_t counter_words = megakernel::counter_words(counters, a.capacity_rows / 64, a.shared_rows / 64);
  MOK_CHECK_CUDA(cudaMemsetAsync(a.counters, 0, counter_words * 8, stream));
  MOK_CHECK_CUDA(cudaMemsetAsync(a.tickets, 0, 2 * sizeof(int32_t), stream));
  if (a.timeline != nullptr)
    MOK_CHECK_CUDA(
        cudaMemsetAsync(a.timeline, 0, megakernel::timeline_words(a.grid_ctas, a.timeline_capacity) * 8, stream));
  cudaLaunchAttribute cluster_attr;
  const cudaLaunchConfig_t config = persistent_launch_config(a.grid_ctas, T::kThreads, megakernel_shared_bytes<T>(),
                                                             T::kClusterN, stream, &cluster_attr);
  MOK_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, p));
}

}  // namespace mok::detail
