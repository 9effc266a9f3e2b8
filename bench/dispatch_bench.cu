// dispatch_bench: the communication of the forward alone, on two GPUs over NVLink, in both directions.
// Which side should drive the copies? Pull (the reader sits on the destination) or push (the writer sits
// on the source)? The answer depends on the link, so this measures it on the rows of a real schedule:
//
//   dispatch  pull: rank d copies x_src[token] -> its expert-major row r, for every scheduled row r
//             push: rank s copies its x[token] -> expert_rows_d[r], for every row r any rank d scheduled from s
//   combine   push: rank d copies y_d[r] -> combined_src[token * k + slot], for every routed row r
//             pull: rank s copies y_d[r] -> its combined[token * k + slot], for every row r routed from s
// The schedules are the CPU twin's for a random top-k routing of a model shape; each GPU gets the list of
// (source, destination) row pairs its mode copies (not timed). Both GPUs copy at once, as in training, with
// the megakernel's copy engines: `bulk` (lane 0 of each of 12 warps per CTA copies whole rows with the TMA's
// bulk copies through a 16 KB shared-memory slot, several rows at a time when they fit:
// src/device/common/row_copy.cuh BulkRowCopier) and `warp`
// (copy_row_warp: 32 lanes, 16-byte vectors), on a given number of CTAs (the megakernel's communication CTAs).
// Time: CUDA events on each GPU around one launch, the slower GPU's, median of --iters.
//
//   dispatch_bench [--shape NAME] [--tokens T] [--iters N] [--ctas 4,8,16,32]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "mok/schedule.h"
#include "reference/moe_reference.h"
#include "reference/routing_gen.h"
#include "src/device/common/row_copy.cuh"
#include "src/device/schedule/placement.h"
#include "src/host/check.h"
#include "src/host/device_guard.h"

namespace {

using mok::detail::DeviceGuard;

constexpr int kThreads = 384;  // the megakernel's CTA
constexpr int kWarps = kThreads / 32;
constexpr int kSlotBytes = 16384;

struct RowCopy {
  const uint4* src;
  uint4* dst;
};

// Copies list[i].src -> list[i].dst (row_bytes each); warps of the grid take rows in turn.
// The bulk copies' waits report to `status` (a timeout fails the run: main checks it at the end).
template <bool kBulk>
__global__ void __launch_bounds__(kThreads, 1) copy_rows_kernel(const RowCopy* list, int64_t rows, int row_bytes,
                                                                 mok::DeviceStatus* status) {
  extern __shared__ __align__(128) char slots[];  // kWarps slots, then kWarps mbarriers (bulk only)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t first = int64_t(blockIdx.x) * kWarps + warp, stride = int64_t(gridDim.x) * kWarps;
  if constexpr (kBulk) {
    auto* loaded = reinterpret_cast<uint64_t*>(slots + kWarps * kSlotBytes);
    if (lane == 0) mok::device::mbarrier_init(&loaded[warp], 1);
    // Why: the bulk copies (async proxy) complete on these barriers.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    if (lane != 0) return;
    mok::device::BulkRowCopier copier{slots + warp * kSlotBytes, &loaded[warp], kSlotBytes,
                                      {status, 10'000'000'000ull, 0, mok::KernelId::kUnknown}, warp};
    // As the megakernel: whole rows batched into the slot when two or more fit, else one row in chunks.
    const int batch = row_bytes * 2 <= kSlotBytes ? kSlotBytes / row_bytes : 1;
    if (batch == 1) {
      for (int64_t i = first; i < rows; i += stride) copier.copy(list[i].src, list[i].dst, row_bytes, mok::Role::kDispatch);
    } else {
      for (int64_t i = first; i < rows; i += stride * batch) {
        copier.begin();
        for (int b = 0; b < batch && i + b * stride < rows; ++b) copier.load(list[i + b * stride].src, row_bytes, b * row_bytes);
        copier.loaded(mok::Role::kDispatch);
        for (int b = 0; b < batch && i + b * stride < rows; ++b) copier.store(list[i + b * stride].dst, row_bytes, b * row_bytes);
      }
    }
    copier.finish();
  } else {
    for (int64_t i = first; i < rows; i += stride) mok::device::copy_row_warp(list[i].src, list[i].dst, row_bytes / 16, lane);
  }
}

struct Args {
  std::string shape = "Kimi-K2.7";
  int tokens = 8192;
  int iters = 10;
  std::vector<int> ctas = {4, 8, 16, 32};
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--shape") a.shape = value;
    else if (flag == "--tokens") a.tokens = std::atoi(value.c_str());
    else if (flag == "--iters") a.iters = std::atoi(value.c_str());
    else if (flag == "--ctas") {
      a.ctas.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) a.ctas.push_back(std::atoi(item.c_str()));
    } else {
      std::fprintf(stderr, "dispatch_bench: unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    std::printf("dispatch_bench: needs two GPUs with NVLink (found %d); nothing measured\n", gpus);
    return 0;
  }
  const mok::reference::ModelShape* model = nullptr;
  for (const auto& m : mok::reference::model_shapes())
    if (m.name == args.shape) model = &m;
  if (model == nullptr) {
    std::fprintf(stderr, "dispatch_bench: unknown shape %s\n", args.shape.c_str());
    return 2;
  }
  constexpr int kEp = 2;
  const mok::RoutingShape routing{kEp, args.tokens, model->top_k, model->num_experts};
  const mok::ScheduleOptions options;
  const int64_t routes = routing.routes_per_rank();
  const auto topk = mok::reference::random_topk_per_rank(kEp, args.tokens, model->top_k, model->num_experts, 0, 7);
  std::vector<int32_t> gathered;
  for (const auto& rank_topk : topk) gathered.insert(gathered.end(), rank_topk.begin(), rank_topk.end());
  std::vector<mok::HostSchedule> schedules;
  for (int r = 0; r < kEp; ++r) schedules.push_back(mok::build_schedule_host(routing, options, r, gathered));

  // Buffers on each GPU: x [T, H], expert rows and y [rows, H], combined [T * k, H]; peers can reach them.
  const int row_bytes = model->hidden * 2, row_vectors = row_bytes / 16;
  struct Buffers {
    uint4 *x, *expert_rows, *y, *combined;
    RowCopy* list;
    mok::DeviceStatus* status;
    cudaStream_t stream;
    cudaEvent_t start, stop;
  } buf[kEp];
  for (int d = 0; d < kEp; ++d) {
    DeviceGuard guard(d);
    cudaDeviceEnablePeerAccess(1 - d, 0);
    cudaGetLastError();  // already enabled is fine
    const int64_t rows = schedules[d].scheduled_rows;
    MOK_CHECK_CUDA(cudaMalloc(&buf[d].x, int64_t(args.tokens) * row_bytes));
    MOK_CHECK_CUDA(cudaMalloc(&buf[d].expert_rows, rows * row_bytes));
    MOK_CHECK_CUDA(cudaMalloc(&buf[d].y, rows * row_bytes));
    MOK_CHECK_CUDA(cudaMalloc(&buf[d].combined, routes * row_bytes));
    MOK_CHECK_CUDA(cudaMalloc(&buf[d].list, 2 * routes * kEp * sizeof(RowCopy)));
    MOK_CHECK_CUDA(cudaMalloc(&buf[d].status, sizeof(mok::DeviceStatus)));
    const mok::DeviceStatus initial = mok::initial_device_status();
    MOK_CHECK_CUDA(cudaMemcpy(buf[d].status, &initial, sizeof(initial), cudaMemcpyHostToDevice));
    MOK_CHECK_CUDA(cudaMemset(buf[d].x, 1, int64_t(args.tokens) * row_bytes));
    MOK_CHECK_CUDA(cudaMemset(buf[d].y, 2, rows * row_bytes));
    MOK_CHECK_CUDA(cudaStreamCreateWithFlags(&buf[d].stream, cudaStreamNonBlocking));
    MOK_CHECK_CUDA(cudaEventCreate(&buf[d].start));
    MOK_CHECK_CUDA(cudaEventCreate(&buf[d].stop));
    MOK_CHECK_CUDA(cudaFuncSetAttribute(copy_rows_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kWarps * (kSlotBytes + 8)));
  }

  // The (source, destination) pairs one GPU copies in a phase and direction.
  enum Phase { kDispatch, kCombine };
  auto list_for = [&](int gpu, Phase phase, bool pull, int64_t& remote_rows) {
    std::vector<RowCopy> list;
    for (int d = 0; d < kEp; ++d) {  // d: the rank holding the experts (schedule owner)
      for (int64_t r = 0; r < schedules[d].scheduled_rows; ++r) {
        const int32_t route = schedules[d].row_route[r];
        if (route < 0) continue;
        const auto c = mok::schedule::route_coords(route, args.tokens, model->top_k);
        // dispatch: pulled by d, pushed by the source; combine: pushed by d, pulled by the source
        const int driver = (phase == kDispatch) == pull ? d : c.src;
        if (driver != gpu) continue;
        remote_rows += c.src != d;
        if (phase == kDispatch)
          list.push_back({buf[c.src].x + int64_t(c.token) * row_vectors, buf[d].expert_rows + r * row_vectors});
        else
          list.push_back({buf[d].y + r * row_vectors,
                          buf[c.src].combined + (int64_t(c.token) * model->top_k + c.slot) * row_vectors});
      }
    }
    return list;
  };

  std::printf("dispatch_bench: %s, EP=2 on 2 GPUs, %d tokens/rank, rows per rank %d / %d, %d-byte rows, median of %d\n",
              model->name.c_str(), args.tokens, schedules[0].scheduled_rows, schedules[1].scheduled_rows, row_bytes,
              args.iters);
  // all: every row either GPU copied, local ones included; remote: the rows that crossed NVLink, both ways.
  std::printf("%-9s %-5s %-5s %5s %9s %11s %12s\n", "phase", "dir", "copy", "CTAs", "ms", "all GB/s", "remote GB/s");
  for (Phase phase : {kDispatch, kCombine}) {
    for (bool pull : {true, false}) {
      int64_t rows[kEp], remote_rows = 0;
      for (int g = 0; g < kEp; ++g) {
        const std::vector<RowCopy> list = list_for(g, phase, pull, remote_rows);
        rows[g] = int64_t(list.size());
        DeviceGuard guard(g);
        MOK_CHECK_CUDA(cudaMemcpy(buf[g].list, list.data(), list.size() * sizeof(RowCopy), cudaMemcpyHostToDevice));
      }
      for (bool bulk : {true, false}) {
        for (int ctas : args.ctas) {
          std::vector<double> times;
          for (int it = 0; it < args.iters + 2; ++it) {  // two warm-up launches
            for (int g = 0; g < kEp; ++g) {
              DeviceGuard guard(g);
              MOK_CHECK_CUDA(cudaEventRecord(buf[g].start, buf[g].stream));
              if (bulk)
                copy_rows_kernel<true><<<ctas, kThreads, kWarps * (kSlotBytes + 8), buf[g].stream>>>(
                    buf[g].list, rows[g], row_bytes, buf[g].status);
              else
                copy_rows_kernel<false><<<ctas, kThreads, 0, buf[g].stream>>>(buf[g].list, rows[g], row_bytes,
                                                                              buf[g].status);
              MOK_CHECK_CUDA(cudaGetLastError());
              MOK_CHECK_CUDA(cudaEventRecord(buf[g].stop, buf[g].stream));
            }
            double slowest = 0;
            for (int g = 0; g < kEp; ++g) {
              MOK_CHECK_CUDA(cudaEventSynchronize(buf[g].stop));
              float ms = 0;
              MOK_CHECK_CUDA(cudaEventElapsedTime(&ms, buf[g].start, buf[g].stop));
              slowest = std::max(slowest, double(ms));
            }
            if (it >= 2) times.push_back(slowest);
          }
          std::sort(times.begin(), times.end());
          const double ms = times[times.size() / 2];
          const double all_bytes = double(rows[0] + rows[1]) * row_bytes, remote_bytes = double(remote_rows) * row_bytes;
          std::printf("%-9s %-5s %-5s %5d %9.3f %11.0f %12.0f\n", phase == kDispatch ? "dispatch" : "combine",
                      pull ? "pull" : "push", bulk ? "bulk" : "warp", ctas, ms, all_bytes / ms / 1e6,
                      remote_bytes / ms / 1e6);
        }
      }
    }
  }
  for (int g = 0; g < kEp; ++g) {
    mok::StatusReport report;
    MOK_CHECK_CUDA(cudaMemcpy(&report.raw, buf[g].status, sizeof(report.raw), cudaMemcpyDeviceToHost));
    if (!report.ok()) {
      std::fprintf(stderr, "dispatch_bench: GPU %d: %s\n", g, report.describe(args.tokens, model->top_k, 1).c_str());
      return 1;
    }
  }
  return 0;
}
