// Host side of the expert grouped GEMM: argument validation, TMA descriptors, tile-config dispatch and the
// launch of the persistent kernel in src/device/gemm/expert_gemm.cuh.
#include "mok/expert_gemm.h"

#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cutlass/cuda_host_adapter.hpp>

#include "src/device/gemm/gemm_kernel.cuh"
#include "src/host/check.h"
#include "src/host/gemm_params.h"
#include "src/host/launch_cache.h"
#include "src/host/persistent_launch.h"

namespace mok {
namespace {

void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument("expert_gemm: " + message);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

using detail::ExpertGemmTraits;
using detail::KMajorMainloop;
using detail::MNMajorMainloop;

// GEMM columns per output tile (256 accumulator columns; SwiGLU turns gate + up into half as many).
int output_tile_columns(GemmEpilogue epilogue) {
  switch (epilogue) {
    case GemmEpilogue::kStore: return detail::StoreTraits<1>::kOutCols;
    case GemmEpilogue::kSwiGLU: return detail::SwiGLUTraits<1>::kOutCols;
    case GemmEpilogue::kSwiGLUBackward:
      return ExpertGemmTraits<MNMajorMainloop, gemm::SwiGLUBackwardEpilogue, 1>::kOutCols;
  }
  throw std::invalid_argument("expert_gemm: epilogue must be kStore, kSwiGLU or kSwiGLUBackward, got " +
                              std::to_string(static_cast<int>(epilogue)));
}

template <class Traits, class Params>
void launch_params(const ExpertGemmArgs& args, Params p, cudaStream_t stream) {
  using T = Traits;
  p.ticket = args.ticket;
  p.trace = static_cast<uint64_t*>(args.trace);
  // Persistent: as many clusters as can be resident at once (SM pairs within a GPC), one CTA per SM; the
  // count and the kernel's shared-memory attribute are set up once per device (src/host/launch_cache.h).
  int device = 0;
  MOK_CHECK_CUDA(cudaGetDevice(&device));
  auto kernel = gemm::expert_gemm_kernel<T, decltype(p)>;
  const int max_clusters = detail::max_active_clusters(reinterpret_cast<const void*>(kernel), T::kThreads,
                                                       T::kSharedBytes, T::kClusterN, device, "expert_gemm");
  if (max_clusters < 1) throw std::runtime_error("expert_gemm: no cluster of the GEMM kernel fits on the device");
  detail::launch_standalone_gemm(kernel, max_clusters * T::kClusterN, T::kThreads, T::kSharedBytes, T::kClusterN,
                                 args.ticket, stream, p, detail::standalone_waits(args.waits, KernelId::kExpertGemm));
}

template <class Traits>
void launch(const ExpertGemmArgs& args, cudaStream_t stream) {
  if constexpr (gemm::BlockScaled<Traits>)
    launch_params<Traits>(args, detail::make_block_scaled_params<Traits>(args), stream);
  else
    launch_params<Traits>(args, detail::make_gemm_params<Traits>(args), stream);
}

// Output tiles along n of a GEMM of either precision.
int n_blocks(const ExpertGemmArgs& args) {
  if (args.precision != Precision::kFP8) return gemm_n_blocks(args.epilogue, args.n);
  const int columns = args.epilogue == GemmEpilogue::kStore ? fp8_store_block_n(args.block_n, args.n)
                      : args.epilogue == GemmEpilogue::kSwiGLUBackward
                          ? detail::Fp8GemmTraits<gemm::SwiGLUBackwardEpilogue, 1>::kOutCols
                      : args.out_scales != nullptr
                          ? detail::Fp8GemmTraits<gemm::SwiGLUQuantEpilogue<false>, 1>::kOutCols
                          : detail::Fp8GemmTraits<gemm::SwiGLUEpilogue<false>, 1>::kOutCols;
  return (args.n + columns - 1) / columns;
}

// Traits<1> or Traits<2>, by the call's cluster size.
template <template <int> class Traits>
void launch_clustered(const ExpertGemmArgs& args, int cluster_n, cudaStream_t stream) {
  if (cluster_n == 2)
    launch<Traits<2>>(args, stream);
  else
    launch<Traits<1>>(args, stream);
}

template <class Epilogue>
struct Fp8Tile {
  template <int kClusterN>
  using Traits = detail::Fp8GemmTraits<Epilogue, kClusterN>;
};

// Precision::kFP8: the epilogue, the tile's width and the cluster size become the kernel's policies.
template <class Epilogue>
void launch_fp8(const ExpertGemmArgs& args, int cluster_n, cudaStream_t stream) {
  if constexpr (std::is_same_v<Epilogue, gemm::StoreEpilogue>) {
    if (fp8_store_block_n(args.block_n, args.n) == 256)
      return launch_clustered<detail::Fp8WideStoreTraits>(args, cluster_n, stream);
  }
  if constexpr (std::is_same_v<Epilogue, gemm::SwiGLUQuantEpilogue<false>>) {
    if (fp8_gate_up_block_n(args.block_n) == 256)
      return launch_clustered<detail::Fp8WideGateUpTraits>(args, cluster_n, stream);
  }
  if constexpr (std::is_same_v<Epilogue, gemm::SwiGLUQuantEpilogue<true>>) {
    if (fp8_gate_up_block_n(args.block_n) == 256)
      return launch_clustered<detail::Fp8WideGateUpSideTraits>(args, cluster_n, stream);
  }
  launch_clustered<Fp8Tile<Epilogue>::template Traits>(args, cluster_n, stream);
}

// A GEMM with its A rows gathered by the producer warpgroup (src/device/gemm/row_gather.cuh): the forward's
// gate/up (K-major weights) or the backward's down dgrad (MN-major).
template <class Mainloop, class Epilogue>
void launch_gather(const ExpertGemmArgs& args, cudaStream_t stream) {
  using T = gemm::RowGatherTraits<ExpertGemmTraits<Mainloop, Epilogue, 1>>;
  auto base = detail::make_gemm_params<T>(args);
  gemm::RowGatherParams<decltype(base)> p{base, {}};
  using Element = typename T::Element;
  p.gather = {.x = static_cast<const Element*>(args.gather.x),
              .a = static_cast<const Element*>(args.a),
              .row_route = args.gather.row_route,
              .num_tokens = args.gather.num_tokens,
              .top_k = args.gather.top_k,
              .rank = args.gather.rank};
  launch_params<T>(args, p, stream);
}

// The store GEMM with its rows scattered to the combine buffers (src/device/gemm/row_scatter.cuh).
template <class Traits>
void launch_scatter(const ExpertGemmArgs& args, cudaStream_t stream) {
  auto base = detail::make_gemm_params<Traits>(args);
  gemm::RowScatterParams<decltype(base)> p{base, {}};
  p.scatter = {.maps = static_cast<const cute::TmaDescriptor*>(args.scatter.maps),
               .row_route = args.scatter.row_route,
               .num_tokens = args.scatter.num_tokens,
               .top_k = args.scatter.top_k};
  launch_params<Traits>(args, p, stream);
}

// The one place where the runtime choices become the kernel's policies (an instantiation per mainloop,
// epilogue and cluster size).
template <class Mainloop, class Epilogue>
void launch_policies(const ExpertGemmArgs& args, int cluster_n, cudaStream_t stream) {
  if constexpr (std::is_same_v<Epilogue, gemm::StoreEpilogue>) {
    if (args.scatter.row_route != nullptr) {
      if (cluster_n == 2)
        launch_scatter<ExpertGemmTraits<Mainloop, Epilogue, 2>>(args, stream);
      else
        launch_scatter<ExpertGemmTraits<Mainloop, Epilogue, 1>>(args, stream);
      return;
    }
  }
  if (cluster_n == 2)
    launch<ExpertGemmTraits<Mainloop, Epilogue, 2>>(args, stream);
  else
    launch<ExpertGemmTraits<Mainloop, Epilogue, 1>>(args, stream);
}

}  // namespace

void validate(const ExpertGemmArgs& args) {
  const GemmEpilogue epilogue = args.epilogue;
  const bool store = epilogue == GemmEpilogue::kStore, swiglu = epilogue == GemmEpilogue::kSwiGLU,
             backward = epilogue == GemmEpilogue::kSwiGLUBackward;
  const bool mn_major = args.b_major == OperandMajor::kMN;
  require(store || swiglu || backward, "epilogue must be kStore, kSwiGLU or kSwiGLUBackward, got " +
                                           std::to_string(static_cast<int>(epilogue)));
  require(mn_major || args.b_major == OperandMajor::kK,
          "b_major must be kK or kMN, got " + std::to_string(static_cast<int>(args.b_major)));
  const bool fp8 = args.precision == Precision::kFP8;
  require(fp8 || args.precision == Precision::kBF16,
          "precision must be kBF16 or kFP8, got " + std::to_string(static_cast<int>(args.precision)));
  require(args.a != nullptr && aligned16(args.a), "a must be a non-null, 16-byte aligned bf16 (kFP8: e4m3) buffer");
  require(args.b != nullptr && aligned16(args.b), "b must be a non-null, 16-byte aligned bf16 (kFP8: e4m3) buffer");
  if (fp8) {
    require(store || swiglu || backward, "kFP8 supports kStore, kSwiGLU and kSwiGLUBackward, got epilogue " +
                                             std::to_string(static_cast<int>(epilogue)));
    require(!mn_major, "kFP8 reads b K-major (FP8 wgmma takes both operands K-major): b_major must be kK");
    require(args.gather.x == nullptr, "kFP8 does not gather rows (gather.x must be null)");
    require(args.a_scales != nullptr && aligned16(args.a_scales),
            "kFP8 needs a_scales: a non-null, 16-byte aligned fp32 [ceil(k / 128), a_rows] buffer");
    require(args.b_scales != nullptr && reinterpret_cast<uintptr_t>(args.b_scales) % 4 == 0,
            "kFP8 needs b_scales: a non-null fp32 [local_experts, ceil(b rows per expert / 128), ceil(k / 128)] buffer");
    require((args.b_up == nullptr) == (args.b_up_scales == nullptr),
            "kFP8: b_up_scales must be given exactly when b_up is (b_up's block scales)");
    require(args.b_up_scales == nullptr || reinterpret_cast<uintptr_t>(args.b_up_scales) % 4 == 0,
            "b_up_scales must be a 4-byte aligned fp32 buffer");
    if (args.out_scales != nullptr) {
      require(swiglu || backward,
              "out_scales (h, or with kSwiGLUBackward d_g | d_u, written quantized) is only for kSwiGLU and "
              "kSwiGLUBackward");
      require(reinterpret_cast<uintptr_t>(args.out_scales) % 4 == 0,
              "out_scales must be a 4-byte aligned fp32 [ceil(n / 128), a_rows] (kSwiGLUBackward: [2n / 128, a_rows]) "
              "buffer");
      // A cluster's two CTAs run the same stages (A is multicast): both tasks need their two halves.
      require(args.cluster_n != 2 || args.n % 256 == 0,
              "cluster_n = 2 with out_scales needs n a multiple of 256, got " + std::to_string(args.n));
    }
    if (args.out_scales != nullptr && swiglu)
      require((args.gate_up_out == nullptr) == (args.hidden_out == nullptr),
              "out_scales: gate_up_out and hidden_out (the bf16 g | u and h beside the quantized h) go together");
    if (args.out_scales != nullptr && backward) {
      require(args.quantized_out != nullptr && aligned16(args.quantized_out),
              "kSwiGLUBackward with out_scales needs quantized_out: a non-null, 16-byte aligned e4m3 [a_rows, 2n] "
              "buffer");
      require(args.n % 128 == 0, "kSwiGLUBackward with out_scales quantizes whole 128-column blocks: n must be a "
                                 "multiple of 128, got " + std::to_string(args.n));
    }
  } else {
    require(args.a_scales == nullptr && args.b_scales == nullptr && args.b_up_scales == nullptr &&
                args.out_scales == nullptr,
            "a_scales, b_scales, b_up_scales and out_scales are only for precision kFP8");
  }
  require(args.b_up == nullptr || ((swiglu || (store && mn_major)) && aligned16(args.b_up)),
          "b_up is only for kSwiGLU (separate gate and up weights) or kStore with b_major kMN (K split over b "
          "and b_up), and must be 16-byte aligned");
  require(!swiglu || !mn_major, "kSwiGLU reads b K-major: b_major must be kK (kMN is for kStore and kSwiGLUBackward)");
  require(!backward || mn_major || fp8,
          "kSwiGLUBackward reads b = W_down [E, k, n] MN-major: b_major must be kMN (kFP8: its transpose, kK)");
  const bool scatter = args.scatter.row_route != nullptr;
  if (scatter) {
    require(store && !fp8, "scatter (rows to the combine buffers) is only for kStore in kBF16");
    require(args.out == nullptr, "out must be null with scatter (the rows go to scatter.combined)");
    require(args.scatter.ranks >= 1 && args.scatter.ranks <= kMaxEpSize,
            "scatter.ranks must be in [1, " + std::to_string(kMaxEpSize) + "], got " +
                std::to_string(args.scatter.ranks));
    require(args.scatter.maps != nullptr && reinterpret_cast<uintptr_t>(args.scatter.maps) % 64 == 0,
            "scatter.maps must be a non-null, 64-byte aligned device array of the ranks' tensor maps "
            "(encode_row_scatter_maps)");
    require(args.scatter.num_tokens > 0 && args.scatter.top_k > 0,
            "scatter needs num_tokens > 0 and top_k > 0, got " + std::to_string(args.scatter.num_tokens) + ", " +
                std::to_string(args.scatter.top_k));
  } else {
    require(args.out != nullptr && aligned16(args.out),
            "out must be a non-null, 16-byte aligned bf16 (with out_scales: e4m3) buffer");
  }
  require(args.k > 0 && args.k % 64 == 0, "k must be a positive multiple of 64, got " + std::to_string(args.k));
  require(args.a_row_stride == 0 ||
              (args.a_row_stride >= args.k && args.a_row_stride * (fp8 ? 1 : 2) % 16 == 0 && args.gather.x == nullptr),
          "a_row_stride must be 0 (k) or at least k with 16-byte aligned rows, and 0 with gather, got " +
              std::to_string(args.a_row_stride));
  require(!(mn_major && args.b_up != nullptr) || args.k % 128 == 0,
          "k must be a multiple of 128 when b and b_up each hold half of K (whole 64-row k-blocks), got " +
              std::to_string(args.k));
  // Whole 64-column store boxes; the last output tile may be partial.
  require(args.n > 0 && args.n % 64 == 0, "n must be a positive multiple of 64, got " + std::to_string(args.n));
  require(args.gate_up_out == nullptr || (swiglu && aligned16(args.gate_up_out)),
          "gate_up_out is only for kSwiGLU and must be 16-byte aligned");
  require(args.hidden_out == nullptr || (fp8 && swiglu && args.out_scales != nullptr && aligned16(args.hidden_out)),
          "hidden_out is only for kFP8 kSwiGLU with out_scales and must be 16-byte aligned");
  require(args.quantized_out == nullptr || (fp8 && backward && args.out_scales != nullptr),
          "quantized_out is only for kFP8 kSwiGLUBackward with out_scales");
  require(args.gate_up == nullptr || backward, "gate_up is only for kSwiGLUBackward");
  require(!backward || (args.gate_up != nullptr && aligned16(args.gate_up)),
          "kSwiGLUBackward needs gate_up: a non-null, 16-byte aligned bf16 [a_rows, 2n] buffer");
  require(args.row_partials == nullptr || backward, "row_partials is only for kSwiGLUBackward");
  require(!backward || (args.row_partials != nullptr && reinterpret_cast<uintptr_t>(args.row_partials) % 4 == 0),
          "kSwiGLUBackward needs row_partials: a non-null fp32 [a_rows, gemm_n_blocks] buffer");
  require(std::isfinite(args.swiglu_limit) && args.swiglu_limit >= 0,
          "swiglu_limit must be finite and >= 0 (0: plain SwiGLU), got " + std::to_string(args.swiglu_limit));
  require(args.cluster_n == 0 || args.cluster_n == 1 || args.cluster_n == 2,
          "cluster_n must be 0 (choose), 1 or 2, got " + std::to_string(args.cluster_n));
  const bool quantized_h = fp8 && swiglu && args.out_scales != nullptr;
  require(args.block_n == 0 || (((fp8 && store) || quantized_h) && (args.block_n == 128 || args.block_n == 256)),
          "block_n must be 0 (choose), or 128 or 256 for kFP8 kStore or kFP8 kSwiGLU writing h quantized, got " +
              std::to_string(args.block_n));
  require(args.cluster_n != 2 || n_blocks(args) % 2 == 0,
          "cluster_n = 2 pairs output tiles: n = " + std::to_string(args.n) + " gives an odd number (" +
              std::to_string(n_blocks(args)) + ") of output tiles");
  require(args.local_experts > 0, "local_experts must be positive");
  require(args.tile_m == 64 || args.tile_m == 128, "tile_m must be 64 or 128, got " + std::to_string(args.tile_m));
  require(args.a_rows > 0 && args.a_rows % args.tile_m == 0, "a_rows must be a positive multiple of tile_m");
  require(args.expert_counts != nullptr && args.expert_row_offsets != nullptr && args.scheduled_rows != nullptr,
          "schedule pointers (expert_counts, expert_row_offsets, scheduled_rows) must be set");
  require(args.first_row >= 0 && args.first_row % 128 == 0 && args.first_row <= args.a_rows,
          "first_row must be a multiple of 128 in [0, a_rows], got " + std::to_string(args.first_row));
  require(args.ticket != nullptr, "ticket must point to an int32 of device memory");
  if (args.gather.x != nullptr) {
    require((swiglu && !mn_major) || backward,
            "gather (A rows from x) is only for kSwiGLU with b_major kK (the forward's gate/up) or kSwiGLUBackward "
            "(the down dgrad, A rows from d_out)");
    require(aligned16(args.gather.x), "gather.x must be a 16-byte aligned bf16 [tokens, k] buffer");
    require(args.gather.row_route != nullptr, "gather.row_route must be set (the schedule's route per row)");
    require(args.gather.num_tokens > 0 && args.gather.top_k > 0 && args.gather.rank >= 0,
            "gather needs num_tokens > 0, top_k > 0 and rank >= 0, got " + std::to_string(args.gather.num_tokens) +
                ", " + std::to_string(args.gather.top_k) + ", " + std::to_string(args.gather.rank));
    require(args.cluster_n == 0 || args.cluster_n == 1,
            "gather runs in clusters of 1 (cp.async fills only its own CTA's stages), got cluster_n " +
                std::to_string(args.cluster_n));
  }
  validate(args.waits, "expert_gemm: ");
}

void encode_row_scatter_maps(const PeerPointers& combined, int ranks, int64_t rows, int n, void* host_maps) {
  static_assert(sizeof(cute::TmaDescriptor) == kRowScatterMapBytes, "one CUtensorMap per rank");
  require(ranks >= 1 && ranks <= kMaxEpSize,
          "encode_row_scatter_maps: ranks must be in [1, " + std::to_string(kMaxEpSize) + "], got " +
              std::to_string(ranks));
  require(rows > 0 && rows < (int64_t{1} << 31),
          "encode_row_scatter_maps: rows must be in [1, 2^31) (TMA row coordinates), got " + std::to_string(rows));
  require(n > 0 && n % 64 == 0, "encode_row_scatter_maps: n must be a positive multiple of 64, got " + std::to_string(n));
  require(host_maps != nullptr, "encode_row_scatter_maps: host_maps must be set");
  for (int r = 0; r < ranks; ++r)
    require(combined.base[r] != nullptr && aligned16(combined.base[r]),
            "encode_row_scatter_maps: combined.base[" + std::to_string(r) + "] must be a non-null, 16-byte aligned "
            "bf16 buffer");
  auto* maps = static_cast<cute::TmaDescriptor*>(host_maps);
  for (int r = 0; r < ranks; ++r) {
    // bf16 [rows, n] as (column, row) coordinates; a box is one row's 64 columns (128 bytes), swizzled as the
    // staged boxes are (src/device/gemm/row_scatter.cuh).
    const cuuint64_t dims[2] = {cuuint64_t(n), cuuint64_t(rows)};
    const cuuint64_t strides[1] = {cuuint64_t(n) * 2};
    const cuuint32_t box[2] = {64, 1};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult result = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        &maps[r], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, combined.base[r], dims, strides, box, element_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS)
      throw std::runtime_error("encode_row_scatter_maps: cuTensorMapEncodeTiled failed for rank " + std::to_string(r) +
                               " (CUresult " + std::to_string(int(result)) + ")");
  }
}

int fp8_store_block_n(int block_n, int n) { return block_n != 0 ? block_n : n >= 4096 ? 256 : 128; }

int fp8_gate_up_block_n(int block_n) { return block_n != 0 ? block_n : 256; }

void expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream) {
  validate(args);
  if (args.precision == Precision::kFP8) {
    const bool pairs = n_blocks(args) % 2 == 0 && (args.out_scales == nullptr || args.n % 256 == 0);
    const int cluster_n = args.cluster_n != 0 ? args.cluster_n : (pairs ? 2 : 1);
    if (args.epilogue == GemmEpilogue::kStore)
      launch_fp8<gemm::StoreEpilogue>(args, cluster_n, stream);
    else if (args.epilogue == GemmEpilogue::kSwiGLUBackward)
      launch_fp8<gemm::SwiGLUBackwardEpilogue>(args, cluster_n, stream);
    else if (args.out_scales != nullptr && args.gate_up_out != nullptr)
      launch_fp8<gemm::SwiGLUQuantEpilogue<true>>(args, cluster_n, stream);
    else if (args.out_scales != nullptr)
      launch_fp8<gemm::SwiGLUQuantEpilogue<false>>(args, cluster_n, stream);
    else if (args.gate_up_out != nullptr)
      launch_fp8<gemm::SwiGLUEpilogue<true>>(args, cluster_n, stream);
    else
      launch_fp8<gemm::SwiGLUEpilogue<false>>(args, cluster_n, stream);
    return;
  }
  const int cluster_n = args.cluster_n != 0 ? args.cluster_n : choose_cluster_n(args.epilogue, args.n);
  switch (args.epilogue) {
    case GemmEpilogue::kStore:
      if (args.b_major == OperandMajor::kMN)
        launch_policies<MNMajorMainloop, gemm::StoreEpilogue>(args, cluster_n, stream);
      else
        launch_policies<KMajorMainloop, gemm::StoreEpilogue>(args, cluster_n, stream);
      break;
    case GemmEpilogue::kSwiGLU:
      if (args.gather.x != nullptr) {
        if (args.gate_up_out != nullptr)
          launch_gather<KMajorMainloop, gemm::SwiGLUEpilogue<true>>(args, stream);
        else
          launch_gather<KMajorMainloop, gemm::SwiGLUEpilogue<false>>(args, stream);
      } else if (args.gate_up_out != nullptr)
        launch_policies<KMajorMainloop, gemm::SwiGLUEpilogue<true>>(args, cluster_n, stream);
      else
        launch_policies<KMajorMainloop, gemm::SwiGLUEpilogue<false>>(args, cluster_n, stream);
      break;
    case GemmEpilogue::kSwiGLUBackward:
      if (args.gather.x != nullptr)
        launch_gather<MNMajorMainloop, gemm::SwiGLUBackwardEpilogue>(args, stream);
      else
        launch_policies<MNMajorMainloop, gemm::SwiGLUBackwardEpilogue>(args, cluster_n, stream);
      break;
  }
}

namespace {
std::atomic<uint32_t> stalled_producers{0};  // bit k: KernelId k (detail::set_stalled_producer)
}  // namespace

void detail::set_stalled_producer(KernelId kernel, bool stalled) {
#if defined(MOK_TEST_ENTRIES)
  const uint32_t bit = 1u << static_cast<int32_t>(kernel);
  if (stalled)
    stalled_producers.fetch_or(bit);
  else
    stalled_producers.fetch_and(~bit);
#else
  (void)kernel, (void)stalled;
  throw std::logic_error("detail::set_stalled_producer: a test entry, in builds with MOK_TEST_ENTRIES only");
#endif
}

bool detail::stalled_producer(KernelId kernel) {
  return (stalled_producers.load(std::memory_order_relaxed) >> static_cast<int32_t>(kernel)) & 1u;
}

int gemm_n_blocks(GemmEpilogue epilogue, int n) {
  const int columns = output_tile_columns(epilogue);
  return n > 0 ? (n + columns - 1) / columns : 0;
}

int gemm_n_blocks(const ExpertGemmArgs& args) { return args.n > 0 ? n_blocks(args) : 0; }

int choose_cluster_n(GemmEpilogue epilogue, int n) {
  // Pairs of CTAs sharing A need an even number of output tiles.
  return gemm_n_blocks(epilogue, n) % 2 == 0 ? 2 : 1;
}

}  // namespace mok
