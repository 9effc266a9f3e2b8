// The megakernel's task recorders: one record per task into the CTA's block of the recorder's track (the
// format of timeline_record.h, read back by MoeWorkspace::read_timeline). A compute CTA's first consumer thread
// records its GEMM tiles, the copy group's leader its copies; each counts its own records.
#pragma once

#include <cstdint>

#include "mok/timeline.h"
#include "src/device/common/sync.cuh"
#include "src/device/megakernel/timeline_record.h"

namespace mok::megakernel {

struct Timeline {
  uint64_t* records;  // nullable: timeline_words(CTAs, capacity)
  int capacity;       // records per CTA and track

  // Whether records are kept: without, a recorder reads no clock either (two reads per task).
  __device__ __forceinline__ bool enabled() const { return records != nullptr; }

  // The recorder's count-th record (count: the recorder's own, held by it; incremented). The count is
  // published with a plain store, read after the launch.
  __device__ __forceinline__ void record(TimelineTrack track, int32_t& count, TaskKind kind, uint64_t start,
                                         uint64_t end, int32_t row, int32_t rows, int32_t n_block,
                                         int32_t expert) const {
    if (records == nullptr) return;
    uint64_t* block = records + timeline_block_offset(blockIdx.x, track, capacity);
    const int32_t index = count++;
    block[0] = static_cast<uint64_t>(count);
    if (index >= capacity) return;
    encode_task_record({.cta = static_cast<int32_t>(blockIdx.x),
                        .sm = device::sm_index(),
                        .kind = kind,
                        .row = row,
                        .rows = rows,
                        .n_block = n_block,
                        .expert = expert,
                        .start_ns = start,
                        .end_ns = end},
                       block + timeline_record_offset(index));
  }
};

}  // namespace mok::megakernel
