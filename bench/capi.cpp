// C entry points for the Python benchmarks (ctypes), so they can run our kernels on PyTorch's tensors in
// the same process as the PyTorch baselines. Not a public API: the Python package (nanobind) replaces it.
#include <cstdint>
#include <cstring>
#include <exception>

#include "mok/expert_gemm.h"

extern "C" {

// Returns 0, or 1 with a message in `error` (NUL-terminated, at most error_len bytes).
int mok_bench_expert_gemm(int epilogue, const void* a, int64_t a_rows, int k, const void* b, const void* b_up, int n,
                          int local_experts, const int32_t* expert_counts, const int32_t* expert_row_offsets,
                          const int32_t* scheduled_rows, int tile_m, const float* row_scale, float swiglu_limit, void* out,
                          int cluster_n, int32_t* ticket, void* trace, void* stream, char* error, int error_len) {
  try {
    mok::ExpertGemmArgs args;
    args.epilogue = static_cast<mok::GemmEpilogue>(epilogue);
    args.a = a;
    args.a_rows = a_rows;
    args.k = k;
    args.b = b;
    args.b_up = b_up;
    args.n = n;
    args.local_experts = local_experts;
    args.expert_counts = expert_counts;
    args.expert_row_offsets = expert_row_offsets;
    args.scheduled_rows = scheduled_rows;
    args.tile_m = tile_m;
    args.row_scale = row_scale;
    args.swiglu_limit = swiglu_limit;
    args.out = out;
    args.cluster_n = cluster_n;
    args.trace = trace;
    args.ticket = ticket;
    mok::expert_gemm(args, static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    if (error != nullptr && error_len > 0) {
      std::strncpy(error, e.what(), error_len - 1);
      error[error_len - 1] = '\0';
    }
    return 1;
  }
}

}  // extern "C"
