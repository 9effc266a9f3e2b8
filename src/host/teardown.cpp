// Teardown errors (src/host/teardown.h).
#include "src/host/teardown.h"

#include <atomic>
#include <cstdio>

namespace mok::detail {

void report_teardown_error(const char* call, const char* what) noexcept {
  static std::atomic<bool> reported{false};
  if (reported.exchange(true)) return;
  std::fprintf(stderr, "mok: %s failed in teardown: %s (later teardown errors of this process are not printed)\n",
               call, what);
}

bool check_teardown(cudaError_t error, const char* call) noexcept {
  if (error == cudaSuccess) return true;
  (void)cudaGetLastError();
  if (error == cudaErrorCudartUnloading || error == cudaErrorContextIsDestroyed) return false;
  report_teardown_error(call, cudaGetErrorString(error));
  return false;
}

std::string synchronize_devices(const std::vector<int>& devices) noexcept {
  std::string error;
  auto note = [&error](cudaError_t e, const char* call) {
    if (e == cudaSuccess) return true;
    (void)cudaGetLastError();
    if (error.empty()) error = std::string(call) + ": " + cudaGetErrorString(e);
    return false;
  };
  int previous = 0;
  if (!note(cudaGetDevice(&previous), "cudaGetDevice")) return error;
  for (int device : devices)
    if (note(cudaSetDevice(device), "cudaSetDevice")) note(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  note(cudaSetDevice(previous), "cudaSetDevice");
  return error;
}

}  // namespace mok::detail
