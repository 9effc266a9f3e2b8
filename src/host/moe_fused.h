// Launch of the forward megakernel (src/device/megakernel/forward_kernel.cuh) for one rank: descriptors,
// counters, grid. Called by MoeWorkspace (src/host/moe.cu) for ForwardPath::kFused.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "mok/expert_gemm.h"
#include "mok/moe.h"
#include "mok/peer_group.h"
#include "mok/status.h"
#include "src/host/megakernel_args.h"

namespace mok::detail {

struct FusedForwardArgs {
  // The four GEMMs as the unfused path would launch them (tickets and traces unused). Without a shared
  // expert (common.shared_rows == 0) the shared ones are never run and may repeat the routed ones.
  ExpertGemmArgs shared_gate_up, shared_down, expert_gate_up, expert_down;
  MegakernelArgs common;            // counters: fused_counter_words(...) u64; timeline: fused_timeline_words(...)
  int32_t ring_rows = 0;            // macrobatch rows
  PeerPointers x, combined;
  void* expert_rows = nullptr;      // ring [ring_rows, H]
  const void* expert_out = nullptr;  // ring [ring_rows, H]
  bool combine_in_place = false;     // the combine tasks copy nothing: the combine epilogue reads expert_out (the
                                     // whole capacity) in place (EP = 1, MoeWorkspace::local_combine)
  // Precision::kFP8 (the GEMMs' precision): expert_rows holds FP8 rows (src/host/quantize_fp8.h), x every rank's
  // published FP8 rows; the dispatch writes the ring rows' A scales [ceil(H / 128), ring_rows] here.
  float* expert_row_scales = nullptr;
  int fp8_row_vectors = 0;           // 16-byte vectors of an FP8 row (values and scales)
};

// CTAs sharing an A tile in the megakernel: 2 when both GEMMs' output tiles pair up, else 1.
int fused_cluster_n(int hidden, int intermediate);
// The same for a precision (kFP8: the FP8 megakernel's tiles).
int fused_cluster_n(int hidden, int intermediate, Precision precision);
// fused_grid_ctas for the FP8 forward megakernel (the FP8 backward runs as stage kernels).
int fused_fp8_grid_ctas(const MoeShape& shape, bool keep_gate_up, int device);
// CTAs of the persistent launch on `device`: as many clusters as fit at once, one CTA per SM. Also sets
// the kernel's shared-memory attribute on the device: call it for every device before launching there.
int fused_grid_ctas(const MoeShape& shape, bool keep_gate_up, int device);
int64_t fused_counter_words(int64_t capacity_units, int64_t shared_units);
int64_t fused_timeline_words(int grid_ctas, int capacity);

void launch_fused_forward(const FusedForwardArgs& args, cudaStream_t stream);

}  // namespace mok::detail
