// The megakernel's task recorder: one record per task into the CTA's block of the timeline buffer, in the
// format of timeline_record.h (read back by MoeWorkspace::read_timeline). A compute CTA's first consumer
// thread and its copy warps' leader both record, so the CTA's record count is taken atomically.
#pragma once

#include <cstdint>

#include "mok/timeline.h"
#include "src/device/common/sync.cuh"
#include "src/device/megakernel/timeline_record.h"

namespace mok::megakernel {

struct Timeline {
  uint64_t* records;  // nullable: [CTAs][timeline_cta_words(capacity)]
  int capacity;       // records per CTA

  __device__ __forceinline__ void record(TaskKind kind, uint64_t start, uint64_t end, int32_t row, int32_t rows,
                                         int32_t n_block, int32_t expert) const {
    if (records == nullptr) return;
    uint64_t* cta = records + int64_t(blockIdx.x) * timeline_cta_words(capacity);
    const uint64_t index = atomicAdd(reinterpret_cast<unsigned long long*>(cta), 1ull);  // two recorders a CTA
    if (index >= uint64_t(capacity)) return;
    encode_task_record({.cta = static_cast<int32_t>(blockIdx.x),
                        .sm = device::sm_index(),
                        .kind = kind,
                        .row = row,
                        .rows = rows,
                        .n_block = n_block,
                        .expert = expert,
                        .start_ns = start,
                        .end_ns = end},
                       cta + timeline_record_offset(int64_t(index)));
  }
};

}  // namespace mok::megakernel
