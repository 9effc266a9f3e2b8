// Reproducible test data made on the GPU (for buffers too large to fill from the host) whose every value
// the host can recompute: value(seed, index) is an integer in [lo, hi], stored as bf16 (exact for |v| <= 256).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mok::testing {

inline constexpr uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline constexpr int hashed_int(uint64_t seed, int64_t index, int lo, int hi) {
  return lo + static_cast<int>(mix64(seed * 0x100000001b3ull ^ static_cast<uint64_t>(index)) % uint64_t(hi - lo + 1));
}

// dst[i] = bf16(scale * hashed_int(seed, i, lo, hi)) for i < count (exact for a power-of-two scale).
// Asynchronous.
void fill_hashed_bf16(void* dst, int64_t count, uint64_t seed, int lo, int hi, cudaStream_t stream, float scale = 1);

}  // namespace mok::testing
