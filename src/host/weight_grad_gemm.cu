// Host side of the weight-gradient GEMM: argument validation, output-mode dispatch and the launch of the
// persistent kernel in src/device/gemm/weight_grad_gemm.cuh (parameters: src/host/weight_grad_params.h);
// with the tests also the megakernel's configuration run standalone (src/host/weight_grad_in_gemm_layout.h).
#include "mok/weight_grad_gemm.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "src/device/gemm/gemm_kernel.cuh"
#include "src/host/check.h"
#include "src/host/launch_cache.h"
#include "src/host/persistent_launch.h"
#include "src/host/weight_grad_in_gemm_layout.h"
#include "src/host/weight_grad_params.h"

namespace mok {
namespace {

void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument("weight_grad_gemm: " + message);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Output tiles of a call: every precision, output mode and configuration has the 128 x 256 tile.
int64_t num_tiles(const WeightGradArgs& args) {
  using Tile = detail::WeightGradConfig<GradOutput::kBFloat16>;
  static_assert(detail::Fp8WeightGradConfig<GradOutput::kFloat32>::kBlockN == Tile::kBlockN &&
                detail::Fp8WeightGradConfig<GradOutput::kFloat32>::kBlockM == Tile::kBlockM);
  return int64_t(args.local_experts) * ((args.m + Tile::kBlockM - 1) / Tile::kBlockM) *
         ((args.n + Tile::kBlockN - 1) / Tile::kBlockN);
}

// Launches `kernel` persistently: one CTA per SM (the shared memory allows no second one), no more CTAs than
// tiles, no cluster.
template <class Kernel, class Params>
void launch_persistent(Kernel kernel, const Params& p, int threads, int shared_bytes, int64_t tiles,
                       int32_t* ticket, const WaitBound& waits, cudaStream_t stream) {
  int device = 0;
  MOK_CHECK_CUDA(cudaGetDevice(&device));
  // The SM count and the kernel's shared-memory attribute: once per device (src/host/launch_cache.h).
  const int num_sms = detail::device_limits(device).num_sms;
  detail::prepare_kernel(reinterpret_cast<const void*>(kernel), shared_bytes, device, "weight_grad_gemm");
  detail::launch_standalone_gemm(kernel, static_cast<int>(std::min<int64_t>(num_sms, tiles)), threads, shared_bytes,
                                 0, ticket, stream, p, detail::standalone_waits(waits, KernelId::kWeightGradGemm));
}

template <class Traits>
void launch(const WeightGradArgs& args, cudaStream_t stream) {
  using T = Traits;
  auto p = detail::make_weight_grad_params<T>(args);
  p.ticket = args.ticket;
  launch_persistent(gemm::weight_grad_gemm_kernel<T, decltype(p)>, p, T::kThreads, T::kSharedBytes, p.num_tasks,
                    args.ticket, args.waits, stream);
}

// The launch of Config<args.output>: the output mode chooses the instantiation.
template <template <GradOutput> class Config>
void launch_for_output(const WeightGradArgs& args, cudaStream_t stream) {
  switch (args.output) {
    case GradOutput::kBFloat16:
      launch<Config<GradOutput::kBFloat16>>(args, stream);
      break;
    case GradOutput::kFloat32:
      launch<Config<GradOutput::kFloat32>>(args, stream);
      break;
    case GradOutput::kAccumulateFloat32:
      launch<Config<GradOutput::kAccumulateFloat32>>(args, stream);
      break;
  }
}

// Every field but the ticket and the waits (the megakernel has its own).
void validate_operands(const WeightGradArgs& args) {
  require(args.precision == Precision::kBF16 || args.precision == Precision::kFP8,
          "precision must be kBF16 or kFP8, got " + std::to_string(static_cast<int32_t>(args.precision)));
  const bool fp8 = args.precision == Precision::kFP8;
  const std::string element = fp8 ? "e4m3" : "bf16";
  require(args.a != nullptr && aligned16(args.a), "a must be a non-null, 16-byte aligned " + element + " buffer");
  require(args.b != nullptr && aligned16(args.b), "b must be a non-null, 16-byte aligned " + element + " buffer");
  if (fp8) {
    require(args.a_scales != nullptr && aligned16(args.a_scales) && args.b_scales != nullptr &&
                aligned16(args.b_scales),
            "precision kFP8 needs a_scales and b_scales (fp32 [rows_allocated / 128, m or n], 16-byte aligned)");
    require(args.tile_m == 128, "precision kFP8 needs segments of whole 128-row scale blocks (tile_m 128, "
                                "quantize_columns_fp8's offsets), got tile_m " + std::to_string(args.tile_m));
  } else {
    require(args.a_scales == nullptr && args.b_scales == nullptr && !args.b_block_scales,
            "a_scales, b_scales and b_block_scales are for precision kFP8");
  }
  require(args.tile_m == 64 || args.tile_m == 128, "tile_m must be 64 or 128, got " + std::to_string(args.tile_m));
  require(args.rows_allocated > 0 && args.rows_allocated % args.tile_m == 0 && args.rows_allocated <= INT32_MAX,
          "rows_allocated must be a positive multiple of tile_m (" + std::to_string(args.tile_m) +
              ") within int32, got " + std::to_string(args.rows_allocated));
  // Whole 64-column load and store boxes; the last tile along m or n may be partial.
  require(args.m > 0 && args.m % 64 == 0, "m must be a positive multiple of 64, got " + std::to_string(args.m));
  require(args.n > 0 && args.n % 64 == 0, "n must be a positive multiple of 64, got " + std::to_string(args.n));
  require(args.local_experts > 0, "local_experts must be positive, got " + std::to_string(args.local_experts));
  require(args.expert_row_offsets != nullptr, "expert_row_offsets must be set (the schedule's, in device memory)");
  require(args.scheduled_rows != nullptr, "scheduled_rows must be set (the schedule's, in device memory)");
  require(args.output == GradOutput::kBFloat16 || args.output == GradOutput::kFloat32 ||
              args.output == GradOutput::kAccumulateFloat32,
          "output must be kBFloat16, kFloat32 or kAccumulateFloat32, got " +
              std::to_string(static_cast<int32_t>(args.output)));
  require(args.out != nullptr && aligned16(args.out), "out must be a non-null, 16-byte aligned buffer");
  if (args.out_split != nullptr) {
    require(aligned16(args.out_split), "out_split must be 16-byte aligned");
    require(args.m_split > 0 && args.m_split < args.m && args.m_split % 64 == 0,
            "m_split must be a multiple of 64 in (0, m = " + std::to_string(args.m) + ") with out_split, got " +
                std::to_string(args.m_split));
  } else {
    require(args.m_split == 0, "m_split is only for out_split (null), got " + std::to_string(args.m_split));
  }
  // TMA coordinates and task slots are int32.
  require(int64_t(args.local_experts) * args.m <= INT32_MAX,
          "local_experts * m must fit int32 (output rows), got " + std::to_string(int64_t(args.local_experts) * args.m));
  const int64_t tasks = num_tiles(args);
  require(tasks <= (int64_t(1) << 30), "too many output tiles (local_experts * m-blocks * n-blocks): " + std::to_string(tasks));
}

}  // namespace

void detail::validate_weight_grad_operands(const WeightGradArgs& args) { validate_operands(args); }

void validate(const WeightGradArgs& args) {
  validate_operands(args);
  require(args.ticket != nullptr, "ticket must point to an int32 of device memory");
  validate(args.waits, "weight_grad_gemm: ");
}

void weight_grad_gemm(const WeightGradArgs& args, cudaStream_t stream) {
  validate(args);
  if (args.precision != Precision::kFP8)
    launch_for_output<detail::WeightGradConfig>(args, stream);
  else if (args.b_block_scales)
    launch_for_output<detail::Fp8BlockBWeightGradConfig>(args, stream);
  else
    launch_for_output<detail::Fp8WeightGradConfig>(args, stream);
}

#if defined(MOK_TEST_ENTRIES)
void detail::weight_grad_gemm_in_gemm_layout(const WeightGradArgs& args, cudaStream_t stream) {
  validate(args);
  using T = gemm::WeightGradTraitsInGemmLayout<GradOutput::kBFloat16>;  // every mode: the same threads and bytes
  const gemm::AnyWeightGradParams p = detail::make_any_weight_grad_params(args);
  launch_persistent(gemm::weight_grad_gemm_kernel<T, gemm::AnyWeightGradParams>, p, T::kThreads,
                    T::kSharedBytes, num_tiles(args), args.ticket, args.waits, stream);
}
#endif

}  // namespace mok
