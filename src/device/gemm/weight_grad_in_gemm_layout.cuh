// The weight-gradient GEMM's tiles (weight_grad_gemm.cuh) inside the expert GEMM's shared memory and
// pipeline (expert_gemm.cuh), for the backward megakernel, which runs both kinds of tile as tasks of one
// persistent pipeline; and the parameters of a weight-gradient GEMM whose output mode is a run-time value.
//
//   grad_e[i, j] = sum over the rows r of the task's segment of a[r, i] * b[r, j]   (weight_grad_gemm.cuh)
//
// Why one pipeline fits both: with kBlockM 128, kBlockN 256, kBlockK 64 a weight-gradient stage is byte for
// byte the expert GEMM's (A 128 x 64 bf16 = 16 KB, B 256 x 64 = 32 KB, 48 KB of transaction bytes); only
// the swizzled layouts inside a stage differ (MN-major boxes of 64 columns x 64 rows instead of K-major rows
// of 64 k), and each kind of tile reads the stage as it loaded it. The expert GEMM's 4 stages and its
// PipelineTmaAsync<4> serve both; a stage's full/empty phases do not care which kind of tile used it last.
// What does not fit is the standalone kernel's whole-tile staging (bf16 64 KB, fp32 128 KB): here the
// epilogue stages in passes through the expert GEMM's 16 KB per consumer warpgroup (2 boxes of 64 rows x
// 128 bytes): bf16 2 passes of 128 columns, fp32 (written or reduce-added) 4 passes of 64 columns; each
// pass first waits until the previous pass's stores have read the boxes (cp.async.bulk.wait_group.read 0).
//
// Shared memory, the expert GEMM's SharedStorage (same offsets and sizes, asserted where it is
// reinterpreted, shared_storage_as, and against detail::ExpertGemmTraits in src/host/weight_grad_params.h):
//   A stages 4 x 16 KB | B stages 4 x 32 KB | staging [2 warpgroups][2 boxes][8 KB] = 32 KB | pipeline
//   barriers (PipelineTmaAsync<4>) | task ring (each traits' own, last; the megakernel has its own ring).
// Named barriers: the epilogue syncs each consumer warpgroup w on CUTLASS NamedBarrier id
// WeightGradTraits::kStagingBarrier + w = 1 + w, the id the expert GEMM's epilogue (TileStager) uses for the
// same 128 threads; the barrier is free between tiles of either kind. The store leader is thread 0 of the
// warpgroup in both, and bulk async-groups are per thread: each kind's first wait before it writes the
// boxes covers the stores the other kind left in flight.
//
// Clusters. The megakernel may run in clusters of 2 (its expert GEMM tiles multicast A); its pipeline is
// then built for ClusterShape (2, 1, 1): a consumer warpgroup's release arrives on the stage's empty
// barrier in both CTAs, and a producer's acquire waits for the consumers of both. A weight-gradient task is
// given to both CTAs of the cluster with n-blocks 2g and 2g + 1 of one (expert, m-block)
// (GradTileTask::for_cta). Each CTA loads its own A and B without multicast into its own stage, on its
// own full barrier, with the same 48 KB of transaction bytes as a GEMM stage (which is half its A from
// each CTA plus its own B). This is correct: the release that reaches the partner's empty barrier says
// "done with stage s" for a stage whose bytes it never read, which is only conservative, and the arrival
// counts match because both CTAs consume the same stage sequence in lockstep: the same tasks in the same
// order, and the two tiles of a task run the same k-blocks (same expert, same rows). An n-block 2g + 1 past
// n (an odd number of n-blocks) still runs its k-blocks (load boxes clamped to the last in-bounds box) and
// stores nothing; a consumer warpgroup whose rows lie past m passes its stages back, in both CTAs alike.
// load_grad_tile / compute_grad_tile take only the pipeline object and its states (the type,
// PipelineTmaAsync<4>, does not depend on the cluster shape) and assume nothing about the cluster: TMA loads
// without multicast address the CTA's own shared memory and barrier, the stores write global memory.
//
// Determinism: as weight_grad_gemm.cuh; the passes change where values are staged, not what they are.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "mok/weight_grad_gemm.h"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/gemm/weight_grad_gemm.cuh"

namespace mok::gemm {

constexpr int grad_output_bytes(GradOutput output) { return output == GradOutput::kBFloat16 ? 2 : 4; }

// The megakernel's configuration: kBlockK 64, 4 stages, staging passes of 2 boxes of 128 bytes a row.
inline constexpr int kGemmLayoutStagingBoxes = 2;  // the expert GEMM's GemmTraits::kStagingBoxes
template <GradOutput kOutput>
using WeightGradTraitsInGemmLayout =
    WeightGradTraits<kOutput, 256, 64, 4, kGemmLayoutStagingBoxes * 128 / grad_output_bytes(kOutput)>;

// True when traits A's tiles can run in traits B's shared memory and pipeline: the same pipeline type,
// stage transaction bytes and consumer warpgroups, the stages, staging and pipeline barriers at the same
// offsets with the same sizes, and A's storage no larger than B's (A's task ring, last, may differ).
template <class A, class B>
constexpr bool same_stage_layout() {
  using SA = typename A::SharedStorage;
  using SB = typename B::SharedStorage;
  return std::is_same_v<typename A::Pipeline, typename B::Pipeline> &&
         A::kStageTransactionBytes == B::kStageTransactionBytes &&
         A::kConsumerWarpgroups == B::kConsumerWarpgroups && A::kThreads == B::kThreads &&
         offsetof(SA, a) == offsetof(SB, a) && sizeof(SA::a) == sizeof(SB::a) &&
         offsetof(SA, b) == offsetof(SB, b) && sizeof(SA::b) == sizeof(SB::b) &&
         offsetof(SA, staging) == offsetof(SB, staging) && sizeof(SA::staging) == sizeof(SB::staging) &&
         offsetof(SA, pipeline) == offsetof(SB, pipeline) && sizeof(SA::pipeline) == sizeof(SB::pipeline) &&
         sizeof(SA) <= sizeof(SB) && alignof(SA) <= alignof(SB);
}

// Traits' SharedStorage over the bytes of `storage`, OtherTraits' (the expert GEMM's, or another output
// mode's): checked here, where the bytes are reinterpreted.
template <class Traits, class OtherTraits>
__device__ __forceinline__ typename Traits::SharedStorage& shared_storage_as(
    typename OtherTraits::SharedStorage& storage) {
  static_assert(same_stage_layout<Traits, OtherTraits>(), "the tiles share the stages, staging and barriers");
  static_assert(Traits::kStagingBarrier == 1, "the expert GEMM's epilogue syncs warpgroup w on id 1 + w too");
  return reinterpret_cast<typename Traits::SharedStorage&>(storage);
}

// A megakernel task as the tile of (expert, m_block, n_block) over `rows` rows of the expert's segment from
// row `row_begin` of a and b (a multiple of 64, the segment padding: whole k-blocks). With a cluster,
// n_block is the cluster's group; then take .for_cta<kClusterN>(cta_rank).
template <class Traits>
__device__ __forceinline__ GradTileTask grad_tile_task(int32_t expert, int32_t m_block, int32_t n_block,
                                                       int32_t row_begin, int32_t rows) {
  static_assert(64 % Traits::kBlockK == 0, "segments of 64-row multiples are whole k-blocks");
  return GradTileTask{expert, m_block, n_block, row_begin, rows / Traits::kBlockK};
}

template <class Traits>
struct TraitsTag {
  using type = Traits;
};

// One weight-gradient GEMM's kernel parameters in the megakernel's configuration, its output mode a run-time
// value: the mode's WeightGradParams in `storage`. Built on the host by detail::make_any_weight_grad_params
// (src/host/weight_grad_params.h); read in a kernel through visit_weight_grad. A kernel parameter: the TMA
// descriptors need 64-byte alignment in parameter space (CUtensorMap declares 128 with CUDA 13), hence the
// storage's alignment, the largest of the three.
struct AnyWeightGradParams {
  template <GradOutput kOutput>
  using ParamsOf = typename WeightGradTraitsInGemmLayout<kOutput>::Params;
  static constexpr size_t kStorageBytes =
      std::max({sizeof(ParamsOf<GradOutput::kBFloat16>), sizeof(ParamsOf<GradOutput::kFloat32>),
                sizeof(ParamsOf<GradOutput::kAccumulateFloat32>)});
  static constexpr size_t kStorageAlignment =
      std::max({alignof(ParamsOf<GradOutput::kBFloat16>), alignof(ParamsOf<GradOutput::kFloat32>),
                alignof(ParamsOf<GradOutput::kAccumulateFloat32>), size_t(64)});

  GradOutput output = GradOutput::kBFloat16;
  alignas(kStorageAlignment) unsigned char storage[kStorageBytes] = {};

  template <GradOutput kOutput>
  CUTE_HOST_DEVICE const ParamsOf<kOutput>& params() const {
    static_assert(std::is_trivially_copyable_v<ParamsOf<kOutput>>, "copied into the storage as bytes");
    return *reinterpret_cast<const ParamsOf<kOutput>*>(storage);
  }
};
static_assert(std::is_trivially_copyable_v<AnyWeightGradParams>, "a kernel parameter");

// f(TraitsTag<T>{}, params) for the stored output mode, T = WeightGradTraitsInGemmLayout<mode> and params
// its WeightGradParams; returns what f returns (the same type for every mode). For consumers the mode must
// be warp-uniform (it is when `p` is a kernel parameter indexed by a warp-uniform value): the branch
// surrounds the tile's wgmma (see compute_grad_tile).
template <class F>
__device__ __forceinline__ decltype(auto) visit_weight_grad(const AnyWeightGradParams& p, F&& f) {
  switch (p.output) {
    case GradOutput::kBFloat16:
      return f(TraitsTag<WeightGradTraitsInGemmLayout<GradOutput::kBFloat16>>{},
               p.params<GradOutput::kBFloat16>());
    case GradOutput::kFloat32:
      return f(TraitsTag<WeightGradTraitsInGemmLayout<GradOutput::kFloat32>>{}, p.params<GradOutput::kFloat32>());
    default:  // kAccumulateFloat32: make_any_weight_grad_params admits no other mode
      return f(TraitsTag<WeightGradTraitsInGemmLayout<GradOutput::kAccumulateFloat32>>{},
               p.params<GradOutput::kAccumulateFloat32>());
  }
}

// weight_grad_gemm_kernel's persistent loop over AnyWeightGradParams: the megakernel's configuration and
// output-mode dispatch, run standalone (tests compare it bitwise with the standalone configuration; the
// host entry is src/host/weight_grad_gemm.cu's). Every mode has the same threads, shared memory and pipeline.
template <class AnyParams>
__global__ void __launch_bounds__(WeightGradTraitsInGemmLayout<GradOutput::kBFloat16>::kThreads, 1)
    any_mode_weight_grad_gemm_kernel(const __grid_constant__ AnyParams p, const __grid_constant__ StandaloneWaits waits) {
  using T0 = WeightGradTraitsInGemmLayout<GradOutput::kBFloat16>;
  extern __shared__ __align__(1024) char shared_raw[];
  auto& smem = *reinterpret_cast<typename T0::SharedStorage*>(shared_raw);
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);  // uniform: see compute_grad_tile
  const WeightGradRole role = warpgroup == 0 ? WeightGradRole::kProducer : WeightGradRole::kConsumer;
  typename T0::Pipeline pipeline = start_pipeline<T0>(smem, smem.tasks, role == WeightGradRole::kConsumer);
  switch (role) {
    case WeightGradRole::kProducer:
      cutlass::arch::warpgroup_reg_dealloc<T0::kProducerRegisters>();
      if (threadIdx.x == 0)
        visit_weight_grad(p, [&](auto traits, const auto& params) {
          using T = typename decltype(traits)::type;
          static_assert(offsetof(typename T::SharedStorage, tasks) == offsetof(typename T0::SharedStorage, tasks),
                        "start_pipeline initialized T0's task ring");
          run_grad_producer<T>(params, waits, shared_storage_as<T, T0>(smem), pipeline);
        });
      break;
    case WeightGradRole::kConsumer:
      cutlass::arch::warpgroup_reg_alloc<T0::kConsumerRegisters>();
      visit_weight_grad(p, [&](auto traits, const auto& params) {
        using T = typename decltype(traits)::type;
        run_grad_consumers<T>(params, waits.bound, shared_storage_as<T, T0>(smem), pipeline,
                              static_cast<int>(threadIdx.x) - 128);
      });
      break;
  }
}

}  // namespace mok::gemm
