// Memory-ordering and spin-wait primitives. Every cross-GPU or cross-CTA handshake in the project goes
// through these, so each ordering decision is made (and explained) once. Protocol: docs/sync_protocol.md.
#pragma once

#include <cstdint>

#include "mok/status.h"

namespace mok::device {

// Nanoseconds from the GPU's global timer (coarse, but monotonic and shared by all SMs).
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int32_t sm_index() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return static_cast<int32_t>(sm);
}

// Acquire load at system scope: a reader on another GPU's data sees everything the releasing writer
// (possibly on a peer GPU) wrote before its release.
__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* addr) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}

// Release add at system scope: makes this thread's earlier writes (and, through the fence each writer
// ran before the CTA barrier, its CTA's writes) visible to a peer GPU before the count moves.
__device__ __forceinline__ void add_release_sys(uint64_t* addr, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

// Full fence at system scope: orders this thread's prior writes (including stores to peer GPUs) before
// anything it or its CTA signals afterwards.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Release add at GPU scope, for counters between CTAs of one kernel: the caller's earlier writes (and,
// after a CTA barrier and fence_acq_rel_gpu, its CTA's) are visible to whoever acquires the new count.
__device__ __forceinline__ void add_release_gpu(uint64_t* addr, uint64_t value) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

// Full fence at GPU scope: with a CTA barrier before it, orders the CTA's writes before a release that
// one thread issues for all of them.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Waits until this thread's committed bulk (TMA) stores have *written* global memory (not only read their
// shared-memory source, which is all cute::tma_store_wait waits for), then orders those async-proxy writes
// before this thread's later generic operations, e.g. the release that tells a reader the rows are there.
__device__ __forceinline__ void bulk_stores_written() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// After an acquire, before TMA loads (async proxy) of data that generic stores or other CTAs' bulk stores
// wrote: orders the acquire before the async-proxy reads.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Where a wait happens, for the timeout report.
struct WaitSite {
  int32_t rank;
  Role role;
  CounterId counter;
  int32_t index;
};

// Spins until *counter >= target (acquire, system scope). Gives up after timeout_ns, records the first
// timeout in `status` (rank, SM, role, counter, awaited and seen values) and returns false. (No printf:
// it would give every waiting kernel a stack frame; the host prints the status word.)
// Callers skip their work after a false return: results are then garbage but nothing is written out of
// bounds, and the host learns why from the status word.
__device__ inline bool wait_at_least(const uint64_t* counter, uint64_t target, WaitSite site,
                                     DeviceStatus* status, uint64_t timeout_ns) {
  uint64_t seen = load_acquire_sys(counter);
  if (seen >= target) return true;
  const uint64_t start = global_timer_ns();
  while (true) {
    seen = load_acquire_sys(counter);
    if (seen >= target) return true;
    if (global_timer_ns() - start > timeout_ns) break;
    __nanosleep(64);
  }
  atomicOr(&status->error_bits, kStatusWaitTimeout);
  if (atomicCAS(&status->timeout_claimed, 0u, 1u) == 0u) {
    status->timeout_rank = site.rank;
    status->timeout_sm = sm_index();
    status->timeout_role = static_cast<int32_t>(site.role);
    status->timeout_counter = static_cast<int32_t>(site.counter);
    status->timeout_index = site.index;
    status->timeout_awaited = target;
    status->timeout_seen = seen;
  }
  return false;
}

}  // namespace mok::device
