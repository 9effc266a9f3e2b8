#include "tests/common/device_fill.h"

#include <cuda_bf16.h>

#include "src/host/check.h"

namespace mok::testing {
namespace {

__global__ void fill_hashed_bf16_kernel(__nv_bfloat16* dst, int64_t count, uint64_t seed, int lo, int hi, float scale) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(scale * static_cast<float>(hashed_int(seed, i, lo, hi)));
}

}  // namespace

void fill_hashed_bf16(void* dst, int64_t count, uint64_t seed, int lo, int hi, cudaStream_t stream, float scale) {
  fill_hashed_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), count, seed, lo, hi, scale);
  MOK_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mok::testing
