// Failure injection for the tests of the lifetimes (tests/gpu/test_lifetimes.cpp): every step that makes
// device state which must be undone when a later step throws (a device allocation, a symmetric allocation's
// copy on one rank, an event) first calls construction_step. In builds with the tests (MOK_TEST_ENTRIES,
// src/CMakeLists.txt) a test can make the n-th such step throw, and count the device allocations alive, to
// check that a constructor failing at any step frees everything it made. Elsewhere both are no-ops.
#pragma once

#include <cstdint>

namespace mok::detail {

// Called before each step; throws std::runtime_error("mok: injected failure at construction step <n> (<what>)")
// at the step fail_construction_step_at chose (test builds only).
void construction_step(const char* what);
// A device allocation made (note_allocation) or freed (note_free): DeviceBuffer and SymmetricAllocation's
// copies. Counted in test builds only.
void note_allocation() noexcept;
void note_free() noexcept;

// Test entries, defined only with MOK_TEST_ENTRIES:
// The n-th construction_step from now throws (n >= 1); 0: none. Resets the step count.
void fail_construction_step_at(int64_t n);
// construction_step calls since the last fail_construction_step_at.
int64_t construction_steps();
// Device allocations alive (made and not freed) in the process.
int64_t live_device_allocations();

}  // namespace mok::detail
