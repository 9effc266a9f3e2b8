// The GEMMs' layouts, evaluated on the CPU with CuTe's own layout algebra (no GPU needed):
//   - the row gather's shared-memory addresses (src/device/gemm/row_gather.cuh): each producer thread computes its
//     first chunk's place in stage 0 from the stage layout, then adds constant offsets for its other rows (16
//     apart) and the other stages. Checked against the layout itself for every chunk of every stage: the same
//     element offsets (so the same bytes as the TMA box the consumers' wgmma reads), 8 contiguous elements per
//     chunk, and every element of a stage written by exactly one chunk; for the forward's gate/up (K-major
//     weights) and the backward's down dgrad (MN-major). Also: a gathering configuration's shared memory is the
//     default's size (its extra task state fits the default's rounding).
//   - the accumulator fragment as the epilogues and the block-scaled mainloop index it (gemm_epilogue.cuh,
//     mainloop.cuh): in every tile shape, value i of a consumer thread lies in 64-column group i / 32 (the FP8
//     promotion's B scale of a value, the staging pass of a value, the gate and up halves of a SwiGLU tile),
//     value i + 32 is value i's element 64 columns further in the same row (the rolled epilogues' window), and a
//     value's row is that of value (i / 2) % 2 * 2 (the two row scales a thread loads).
#include <string>
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
  using DownDgradBase = detail::ExpertGemmTraits<detail::MNMajorMainloop, gemm::SwiGLUBackwardEpilogue, 1>;
  using DownDgrad = gemm::RowGatherTraits<DownDgradBase>;
  check_addresses<Plain>("SwiGLU");
  check_addresses<SideOutput>("SwiGLU with g|u");
  check_addresses<DownDgrad>("SwiGLU backward (MN-major weights)");
  EXPECT_EQ(Plain::kSharedBytes, detail::SwiGLUTraits<1>::kSharedBytes);
  EXPECT_EQ(SideOutput::kSharedBytes, detail::SwiGLUTraits<1>::kSharedBytes);
  EXPECT_EQ(DownDgrad::kSharedBytes, DownDgradBase::kSharedBytes);
  // The gathering producer arms kStageBytesB for thread 0's B loads: the whole B stage, either major.
  EXPECT_EQ(DownDgrad::kStageBytesB, uint32_t(DownDgradBase::kBoxesB) * DownDgradBase::kBoxRowsB *
                                         DownDgradBase::kBlockK * sizeof(typename DownDgradBase::Element));
}

template <class T>
void check_fragment(const std::string& name) {
  using namespace cute;
  typename T::TiledMma mma;
  for (int t = 0; t < 128 * T::kConsumerWarpgroups; ++t) {
    const auto coords =
        mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
    constexpr int kValues = decltype(size(coords))::value;
    ASSERT_EQ(kValues, 32 * (T::kBlockN / 64)) << name << ": 32 values a 64-column group";
    for (int i = 0; i < kValues; ++i) {
      const int row = get<0>(coords(i)), col = get<1>(coords(i));
      const std::string at = name + ": thread " + std::to_string(t) + " value " + std::to_string(i);
      ASSERT_EQ(col / 64, i / 32) << at << " (column " << col << ")";
      ASSERT_EQ(row, get<0>(coords((i / 2) % 2 * 2))) << at;
      ASSERT_EQ(row / 64, t / 128) << at << ": the warpgroup's 64 rows";
      if (i >= 32) {
        ASSERT_EQ(col, get<1>(coords(i - 32)) + 64) << at;
        ASSERT_EQ(row, get<0>(coords(i - 32))) << at;
      }
    }
  }
}

TEST(FragmentLayoutTest, ValuesTileTheirSixtyFourColumnGroups) {
  check_fragment<detail::SwiGLUTraits<1>>("bf16 128 x 256 (SwiGLU)");
  check_fragment<detail::ExpertGemmTraits<detail::MNMajorMainloop, gemm::SwiGLUBackwardEpilogue, 1>>(
      "bf16 128 x 256 (SwiGLU backward)");
  check_fragment<detail::Fp8GemmTraits<gemm::StoreEpilogue, 1>>("FP8 128 x 128");
  check_fragment<detail::Fp8WideStoreTraits<1>>("FP8 128 x 256 (store)");
}

}  // namespace
}  // namespace mok
