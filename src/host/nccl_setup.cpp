#include "src/host/nccl_setup.h"

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "src/host/check.h"
#include "src/host/device_guard.h"

namespace mok::detail {
namespace {

using Clock = SetupClock;

Clock::time_point deadline_after(Clock::time_point since, double timeout_s) {
  return since + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
}

std::string seconds(double timeout_s) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", timeout_s);
  return text;
}

// Polls without burning a core: setup waits are seconds long, a millisecond of latency is nothing.
void pause() { std::this_thread::sleep_for(std::chrono::milliseconds(1)); }

}  // namespace

void finish_nccl(std::span<const ncclComm_t> comms, ncclResult_t result, const char* call, double timeout_s,
                 Clock::time_point since) {
  if (result == ncclSuccess) return;
  if (result != ncclInProgress) check_nccl(result, call);
  const Clock::time_point deadline = deadline_after(since, timeout_s);
  for (ncclComm_t comm : comms) {
    ncclResult_t state = ncclInProgress;
    while (true) {
      check_nccl(ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError");
      if (state != ncclInProgress) break;
      if (Clock::now() > deadline)
        throw SetupTimeout(std::string(call) + ": the other ranks did not all arrive within " + seconds(timeout_s) +
                           " s (setup_timeout_s): a rank that never made its communicator or workspace; the "
                           "communicator is unusable (abort it)");
      pause();
    }
    check_nccl(state, call);
  }
}

ncclComm_t init_nccl_comm(int nranks, const ncclUniqueId& id, int rank, double timeout_s) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t result = ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
  try {
    finish_nccl({&comm, 1}, result, "ncclCommInitRankConfig", timeout_s);
  } catch (...) {
    if (comm != nullptr) (void)ncclCommAbort(comm);  // local; cancels the pending init
    throw;
  }
  return comm;
}

void wait_streams(std::span<const int> devices, std::span<const cudaStream_t> streams, double timeout_s,
                  const std::string& what, Clock::time_point since) {
  const Clock::time_point deadline = deadline_after(since, timeout_s);
  for (size_t n = 0; n < streams.size(); ++n) {
    DeviceGuard guard(devices[n]);
    while (true) {
      const cudaError_t query = cudaStreamQuery(streams[n]);
      if (query != cudaErrorNotReady) {
        MOK_CHECK_CUDA(query);
        break;
      }
      if (Clock::now() > deadline)
        throw SetupTimeout(what + ": the other ranks did not all arrive within " + seconds(timeout_s) +
                           " s (setup_timeout_s): a rank that never made its workspace; the communicator's "
                           "collective is still pending, so the communicator is unusable (abort it)");
      pause();
    }
  }
}

NcclGroup::NcclGroup() { check_nccl(ncclGroupStart(), "ncclGroupStart"); }

NcclGroup::~NcclGroup() {
  if (open_) (void)ncclGroupEnd();
}

ncclResult_t NcclGroup::end() {
  open_ = false;
  return ncclGroupEnd();
}

}  // namespace mok::detail
