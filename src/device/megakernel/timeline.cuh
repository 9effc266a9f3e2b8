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
    // Why opaque: blockIdx.x read once at the kernel's entry stays live into every role's loop (ptxas spilled it
    // at the producer's 56 registers); read again here instead.
    int32_t cta;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(cta));
    uint64_t* block = records + timeline_block_offset(cta, track, capacity);
    const int32_t index = count++;
    block[0] = static_cast<uint64_t>(count);
    if (index >= capacity) return;
    encode_task_record({.cta = cta,
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
