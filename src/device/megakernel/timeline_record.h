// The timeline's record format (FusedOptions::timeline_records): written by the megakernel's recorders
// (timeline.cuh), read back by MoeWorkspace::read_timeline. Host + device code: the one definition of it.
//
// The buffer: per CTA kTimelineTracks blocks of timeline_block_words(capacity) u64, one per recorder: track 0
// (kGemmTrack) the CTA's GEMM tiles, recorded by its first consumer thread, track 1 (kCopyTrack) its row
// copies, recorded by the copy group's leader. Word 0 of a block counts its recorder's records (only that
// thread stores it, so no atomic: a record costs the recorder no round trip; a count past the capacity
// means records were dropped), record i lies at words timeline_record_offset(i) .. + kTimelineRecordWords.
// A record:
//   word 0  start ns (GPU global timer)       word 1  end ns
//   word 2  kind | rows << 8 | SM << 16 | CTA << 32
//   word 3  first row | n-block << 32 | expert << 48
// Limits (a larger value is truncated, in the record only): kind and rows < 256, SM, n-block and expert
// < 65536, CTA and row < 2^31.
#pragma once

#include <cstdint>

#include "mok/timeline.h"
#include "src/device/common/host_device.h"

namespace mok::megakernel {

inline constexpr int kTimelineRecordWords = 4;

enum TimelineTrack : int { kGemmTrack = 0, kCopyTrack = 1, kTimelineTracks = 2 };

MOK_HOST_DEVICE int64_t timeline_block_words(int capacity) { return (int64_t(capacity) + 1) * kTimelineRecordWords; }
MOK_HOST_DEVICE int64_t timeline_block_offset(int64_t cta, int track, int capacity) {
  return (cta * kTimelineTracks + track) * timeline_block_words(capacity);
}
// The buffer's words for `ctas` CTAs.
MOK_HOST_DEVICE int64_t timeline_words(int64_t ctas, int capacity) { return timeline_block_offset(ctas, 0, capacity); }
MOK_HOST_DEVICE int64_t timeline_record_offset(int64_t index) { return (index + 1) * kTimelineRecordWords; }

MOK_HOST_DEVICE void encode_task_record(const TaskRecord& r, uint64_t* words) {
  words[0] = r.start_ns;
  words[1] = r.end_ns;
  words[2] = uint64_t(uint8_t(r.kind)) | (uint64_t(uint8_t(r.rows)) << 8) | (uint64_t(uint16_t(r.sm)) << 16) |
             (uint64_t(uint32_t(r.cta)) << 32);
  words[3] = uint64_t(uint32_t(r.row)) | (uint64_t(uint16_t(r.n_block)) << 32) | (uint64_t(uint16_t(r.expert)) << 48);
}

MOK_HOST_DEVICE TaskRecord decode_task_record(const uint64_t* words) {
  TaskRecord r;
  r.cta = static_cast<int32_t>(words[2] >> 32);
  r.sm = static_cast<int32_t>((words[2] >> 16) & 0xffff);
  r.kind = static_cast<TaskKind>(words[2] & 0xff);
  r.row = static_cast<int32_t>(words[3] & 0xffffffffu);
  r.rows = static_cast<int32_t>((words[2] >> 8) & 0xff);
  r.n_block = static_cast<int32_t>((words[3] >> 32) & 0xffff);
  r.expert = static_cast<int32_t>(words[3] >> 48);
  r.start_ns = words[0];
  r.end_ns = words[1];
  return r;
}

}  // namespace mok::megakernel
