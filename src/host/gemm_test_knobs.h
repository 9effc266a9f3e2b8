// Test entry (host-only, no CUTLASS): a stalled producer in the standalone GEMM kernels, for the tests of their
// bounded waits (tests/gpu/test_expert_gemm.cpp, test_weight_grad_gemm.cpp, test_bad_inputs.cpp). Honoured only
// by a libmok built with the tests (MOK_TEST_ENTRIES, src/CMakeLists.txt).
#pragma once

#include "mok/status.h"

namespace mok::detail {

// Until set back to false, every launch of the standalone GEMM `kernel` (KernelId::kExpertGemm or
// kWeightGradGemm; any thread, any device) runs with a stalled producer: each CTA's producer arms the first
// stage of its first tile and issues none of its loads. Its consumers' wait for that stage must time out
// (the status word names the kernel, role GEMM consumer, counter pipeline full), the kernel ends (kAbortHandoff)
// and the call returns. Throws std::logic_error in a build without the test entries.
void set_stalled_producer(KernelId kernel, bool stalled);
// Whether launches of `kernel` stall (always false without the test entries).
bool stalled_producer(KernelId kernel);

}  // namespace mok::detail
