// The row gather's shared-memory addresses (src/device/gemm/row_gather.cuh), on the CPU: each producer thread
// computes its first chunk's place in stage 0 from the stage layout, then adds constant offsets for its other
// rows (16 apart) and the other stages. Checked here against the layout itself for every chunk of every stage:
// the same element offsets (so the same bytes as the TMA box the consumers' wgmma reads), 8 contiguous elements
// per chunk, and every element of a stage written by exactly one chunk. Also: the gathering configuration's shared
// memory is the default's size (its extra task state fits the default's rounding).
#include <vector>

#include <gtest/gtest.h>

#include "src/device/gemm/row_gather.cuh"
#include "src/host/gemm_params.h"

namespace mok {
namespace {

template <class T>
void check_addresses(const char* name) {
  const auto layout = typename T::SmemLayoutA{};
  constexpr int kStageElements = T::kBlockM * T::kBlockK;
  std::vector<int> writes(size_t(kStageElements) * T::kStages, 0);
  for (int t = 0; t < T::kGatherThreads; ++t) {
    const int chunk = t % T::kChunksPerRow, first_row = t / T::kChunksPerRow;
    const int base = layout(first_row, chunk * T::kChunkElements, 0);
    for (int s = 0; s < T::kStages; ++s)
      for (int i = 0; i < T::kRowsPerThread; ++i) {
        const int row = first_row + i * T::kRowsPerPass;
        const int got = base + s * kStageElements + i * T::kRowsPerPass * T::kBlockK;  // gather_tile's, in elements
        for (int e = 0; e < T::kChunkElements; ++e) {
          const int want = layout(row, chunk * T::kChunkElements + e, s);
          ASSERT_EQ(got + e, want) << name << ": thread " << t << " row " << row << " element " << e << " stage " << s;
          ++writes[want];
        }
      }
  }
  for (size_t n = 0; n < writes.size(); ++n) ASSERT_EQ(writes[n], 1) << name << ": element " << n;
}

TEST(RowGatherLayoutTest, ChunkAddressesAreTheStageLayouts) {
  using Plain = gemm::RowGatherTraits<detail::SwiGLUTraits<1>>;
  using SideOutput = gemm::RowGatherTraits<detail::ExpertGemmTraits<detail::KMajorMainloop, gemm::SwiGLUEpilogue<true>, 1>>;
  check_addresses<Plain>("SwiGLU");
  check_addresses<SideOutput>("SwiGLU with g|u");
  EXPECT_EQ(Plain::kSharedBytes, detail::SwiGLUTraits<1>::kSharedBytes);
  EXPECT_EQ(SideOutput::kSharedBytes, detail::SwiGLUTraits<1>::kSharedBytes);
}

}  // namespace
}  // namespace mok
