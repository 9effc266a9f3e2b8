// Failure injection and allocation counts (src/host/failure_injection.h): active in builds with the tests.
#include "src/host/failure_injection.h"

#if defined(MOK_TEST_ENTRIES)
#include <atomic>
#include <stdexcept>
#include <string>
#endif

namespace mok::detail {

#if defined(MOK_TEST_ENTRIES)
namespace {
std::atomic<int64_t> fail_at{0};
std::atomic<int64_t> steps{0};
std::atomic<int64_t> live{0};
}  // namespace

void construction_step(const char* what) {
  const int64_t step = ++steps;
  if (step == fail_at.load())
    throw std::runtime_error("mok: injected failure at construction step " + std::to_string(step) + " (" + what + ")");
}
void note_allocation() noexcept { ++live; }
void note_free() noexcept { --live; }

void fail_construction_step_at(int64_t n) {
  fail_at = n;
  steps = 0;
}
int64_t construction_steps() { return steps.load(); }
int64_t live_device_allocations() { return live.load(); }
#else
void construction_step(const char*) {}
void note_allocation() noexcept {}
void note_free() noexcept {}
#endif

}  // namespace mok::detail
