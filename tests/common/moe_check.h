// An independent fp32 check of the MoE forward on the GPU, for problems too large for the CPU reference:
// for sampled tokens, out = shared(x) + sum_j rw_j * expert_j(x), every dot product in fp32 from the bf16
// inputs and weights, nothing rounded to bf16 on the way (so it differs from the layer by its bf16
// roundings only; tests compare with compare_within_budget). Straightforward kernels: a warp per dot
// product, no tensor cores, nothing shared with the code under test.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/moe.h"

namespace mok::testing {

// One rank's tensors (device memory of the current GPU).
struct CheckRank {
  const void* x;            // bf16 [T, H]
  const int32_t* topk_idx;  // [T, k]
  const float* router_weights;
  const void* expert_gate;  // bf16 [E_local, I, H]
  const void* expert_up;
  const void* expert_down;  // bf16 [E_local, H, I]
};

struct CheckShared {
  const void* gate;  // bf16 [I, H], or null without a shared expert
  const void* up;
  const void* down;  // bf16 [H, I]
};

// Reference rows for tokens `samples` of rank `src` (token indices), all ranks' tensors on one GPU.
// Returns [samples, H] fp32 on the host. Synchronous.
std::vector<float> check_rows_fp32(const MoeShape& shape, const std::vector<CheckRank>& ranks, const CheckShared& shared,
                                   int src, const std::vector<int32_t>& samples);

}  // namespace mok::testing
