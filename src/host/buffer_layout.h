// One device allocation carved into named buffers. A layout is the single description of an allocation:
// its total_bytes() sizes the DeviceBuffer and its slots hand out the pointers into it, so size and carve
// cannot disagree. Host-only (tests/cpu/test_buffer_layouts.cpp checks every layout of the workspace).
//
//   BufferLayout layout;
//   const BufferSlot rows = layout.add("rows", n * 2);     // at the next multiple of 256 bytes
//   DeviceBuffer buffer(device, layout.total_bytes());
//   void* p = rows.in(buffer.get());                        // null for a 0-byte (absent) buffer
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mok::detail {

struct BufferSlot {
  const char* name = "";
  int64_t offset = 0;
  int64_t bytes = 0;  // 0: the buffer is absent (in() gives null)

  template <class T = void>
  T* in(void* base) const {
    return bytes == 0 ? nullptr : reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }
  int64_t end() const { return offset + bytes; }
};

class BufferLayout {
 public:
  static constexpr int64_t kAlignment = 256;  // every buffer starts at a multiple of it (TMA wants 128 or 16)

  // Appends a buffer of `bytes` (>= 0) at the next multiple of `alignment` (a power of two, >= kAlignment).
  BufferSlot add(const char* name, int64_t bytes, int64_t alignment = kAlignment) {
    if (bytes < 0) throw std::logic_error(std::string("BufferLayout: buffer ") + name + " has negative bytes");
    if (alignment < kAlignment || (alignment & (alignment - 1)) != 0)
      throw std::logic_error(std::string("BufferLayout: buffer ") + name + ": alignment must be a power of two >= 256");
    const BufferSlot slot{name, round_up(end_, alignment), bytes};
    if (bytes > 0) end_ = slot.end();
    slots_.push_back(slot);
    return slot;
  }
  // `count` elements of T.
  template <class T>
  BufferSlot add_array(const char* name, int64_t count) {
    return add(name, count * int64_t(sizeof(T)));
  }

  // The allocation's bytes: the end of the last buffer, rounded up to kAlignment (every buffer then owns
  // its bytes rounded up to 256, as the kernels' whole-vector accesses may assume).
  int64_t total_bytes() const { return round_up(end_, kAlignment); }
  const std::vector<BufferSlot>& slots() const { return slots_; }

  static int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

 private:
  int64_t end_ = 0;
  std::vector<BufferSlot> slots_;
};

}  // namespace mok::detail
