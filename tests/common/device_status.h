// A status word in device memory for the tests of the standalone kernels (mok::expert_gemm, weight_grad_gemm),
// whose waits report a timeout to it (ExpertGemmArgs::waits, WeightGradArgs::waits).
#pragma once

#include <vector>

#include "mok/status.h"
#include "tests/common/device_array.h"

namespace mok::testing {

struct DeviceStatusWord {
  DeviceArray<DeviceStatus> word{1};

  DeviceStatusWord() { reset(); }
  // initial_device_status(): what MoeWorkspace::reset_status writes.
  void reset() { word.upload(std::vector<DeviceStatus>{initial_device_status()}); }
  StatusReport read() const {
    StatusReport report;
    report.raw = word.download()[0];
    return report;
  }
  WaitBound bound(double timeout_s = 10) const { return {word.ptr, timeout_s, 0}; }
};

}  // namespace mok::testing
