// GoogleTest's side of tests/common/gpu_query.h: skip a test without the GPUs it needs, or a full-size
// case when the suite asks for reduced sizes (MOK_TEST_REDUCED, under compute-sanitizer).
#pragma once

#include <string>

#include <gtest/gtest.h>

#include "tests/common/gpu_query.h"

// Skips the current test unless `n` Hopper GPUs are visible.
#define MOK_REQUIRE_GPUS(n)                                                         \
  do {                                                                              \
    std::string mok_skip_reason_;                                                   \
    if (::mok::testing::hopper_gpus((n), &mok_skip_reason_) < (n)) GTEST_SKIP() << mok_skip_reason_; \
  } while (0)

// Skips the current test (a full-size case) when MOK_TEST_REDUCED asks for reduced sizes.
#define MOK_SKIP_IF_REDUCED()                                                                      \
  do {                                                                                             \
    if (::mok::testing::reduced_sizes())                                                           \
      GTEST_SKIP() << "full-size case skipped: MOK_TEST_REDUCED is set (reduced sizes, e.g. under " \
                      "compute-sanitizer)";                                                        \
  } while (0)
