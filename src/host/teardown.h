// Errors in teardown (destructors, reset, leaked NCCL windows): destructors never throw and never drop an
// error silently. The first teardown error of the process is printed on stderr with a note that later ones
// are not (a sticky CUDA error after a fault would otherwise print one line per buffer); a CUDA runtime that
// is already unloading at process exit is not an error (the memory goes with the context).
#pragma once

#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace mok::detail {

// Prints "mok: <call> failed in teardown: <what>" on stderr if it is the process's first teardown error.
void report_teardown_error(const char* call, const char* what) noexcept;

// report_teardown_error for a failed CUDA call (clearing the error it leaves), except at process exit
// (cudaErrorCudartUnloading, cudaErrorContextIsDestroyed). Returns whether `error` was cudaSuccess.
bool check_teardown(cudaError_t error, const char* call) noexcept;

// For close(), which must reach its collective on every rank even after an error here: cudaDeviceSynchronize
// on each device (the caller's device restored); the first failure as "<call>: <error>", empty if none.
std::string synchronize_devices(const std::vector<int>& devices) noexcept;

}  // namespace mok::detail
