// Test entry (host-only, no CUTLASS): the backward megakernel's configuration of the weight-gradient GEMM
// (src/device/gemm/weight_grad_gemm.cuh, WeightGradTraitsInGemmLayout: the expert GEMM's stages and 16 KB of staging per
// warpgroup in passes, the output mode chosen at run time through AnyWeightGradParams) launched standalone,
// so tests compare it bitwise with mok::weight_grad_gemm. Built into libmok with the tests
// (MOK_TEST_ENTRIES, src/CMakeLists.txt).
#pragma once

#include <cuda_runtime_api.h>

#include "mok/weight_grad_gemm.h"

namespace mok::detail {

// As weight_grad_gemm(args, stream): validates, zeroes the ticket on `stream`, runs every tile once.
void weight_grad_gemm_in_gemm_layout(const WeightGradArgs& args, cudaStream_t stream);

}  // namespace mok::detail
