// Memory-ordering and spin-wait primitives. Every cross-GPU or cross-CTA handshake in the project goes
// through these, so each ordering decision is made (and explained) once. Protocol: docs/sync_protocol.md.
#pragma once

#include <cstdint>

#include "mok/status.h"
#include "src/device/common/mbarrier.cuh"

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
  KernelId kernel;
};

// The abort word (DeviceStatus::abort): a relaxed volatile read, cheap enough for every slow-path poll.
// GPU scope is enough: the word is per rank and only this GPU's kernels read and write it (peers learn of
// a failure by timing out themselves).
__device__ __forceinline__ uint32_t abort_bits(const DeviceStatus* status) {
  return *static_cast<const volatile uint32_t*>(&status->abort);
}

// The first timeout claims the report (rank, SM, role, counter, index, awaited, seen) and sets `abort`;
// later ones only add their error bit. Why release at GPU scope on the abort word: a waiter that sees it
// set may read the report afterwards (the host reads it after the stream anyway).
__device__ __forceinline__ void record_timeout(DeviceStatus* status, WaitSite site, uint64_t awaited, uint64_t seen,
                                               uint32_t abort_bit) {
  atomicOr(&status->error_bits, kStatusWaitTimeout);
  if (atomicCAS(&status->timeout_claimed, 0u, 1u) == 0u) {
    status->timeout_rank = site.rank;
    status->timeout_sm = sm_index();
    status->timeout_role = static_cast<int32_t>(site.role);
    status->timeout_counter = static_cast<int32_t>(site.counter);
    status->timeout_index = site.index;
    status->timeout_awaited = awaited;
    status->timeout_seen = seen;
    status->timeout_kernel = static_cast<int32_t>(site.kernel);
  }
  __threadfence();
  atomicOr(&status->abort, abort_bit);
}

// A wait that gave up at once because an earlier one timed out.
__device__ __forceinline__ void record_abandoned(DeviceStatus* status) { atomicAdd(&status->abandoned_waits, 1u); }

// Spins until *counter >= target (acquire, system scope). Gives up after timeout_ns, records the first
// timeout in `status` (rank, SM, role, counter, awaited and seen values), sets the abort word and returns
// false; gives up at once (false, counted in abandoned_waits) while the abort word is set, so after one
// timeout the rest of the step fails fast. The fast path (counter already there) reads nothing else.
// (No printf: it would give every waiting kernel a stack frame; the host prints the status word.)
// Callers skip the dependent work after a false return (docs/sync_protocol.md says what each skips):
// results are then garbage but nothing is written out of bounds, and the host learns why from the status.
__device__ inline bool wait_at_least(const uint64_t* counter, uint64_t target, WaitSite site,
                                     DeviceStatus* status, uint64_t timeout_ns) {
  uint64_t seen = load_acquire_sys(counter);
  if (seen >= target) return true;
  if (abort_bits(status) != 0) {
    record_abandoned(status);
    return false;
  }
  const uint64_t start = global_timer_ns();
  while (true) {
    seen = load_acquire_sys(counter);
    if (seen >= target) return true;
    if (abort_bits(status) != 0) {
      record_abandoned(status);
      return false;
    }
    if (global_timer_ns() - start > timeout_ns) break;
    __nanosleep(64);
  }
  record_timeout(status, site, target, seen, kAbortWait);
  return false;
}

// Hardware named barrier `barrier_id` (0-15, no CUTLASS offset: cutlass::arch::NamedBarrier adds
// ReservedNamedBarrierCount to its ids) over `threads` threads that also reduces a flag: whether every thread
// (kAll) or any thread passed true. Broadcast from lane 0, so ptxas sees the result warp-uniform.
template <bool kAll>
__device__ __forceinline__ bool named_barrier_reduce(bool value, int barrier_id, int threads) {
  uint32_t result;
  if constexpr (kAll)
    asm volatile("{ .reg .pred p, q; setp.ne.u32 q, %1, 0; bar.red.and.pred p, %2, %3, q; selp.u32 %0, 1, 0, p; }"
                 : "=r"(result)
                 : "r"(value ? 1u : 0u), "r"(barrier_id), "r"(threads)
                 : "memory");
  else
    asm volatile("{ .reg .pred p, q; setp.ne.u32 q, %1, 0; bar.red.or.pred p, %2, %3, q; selp.u32 %0, 1, 0, p; }"
                 : "=r"(result)
                 : "r"(value ? 1u : 0u), "r"(barrier_id), "r"(threads)
                 : "memory");
  return __shfl_sync(0xffffffff, result, 0) != 0;
}
__device__ __forceinline__ bool named_barrier_all(bool value, int barrier_id, int threads) {
  return named_barrier_reduce<true>(value, barrier_id, threads);
}
__device__ __forceinline__ bool named_barrier_any(bool value, int barrier_id, int threads) {
  return named_barrier_reduce<false>(value, barrier_id, threads);
}

// Bound of the in-kernel mbarrier hand-offs (task ring, GEMM pipeline, bulk-copy slots), in every kernel that
// has them (the megakernels and the standalone GEMMs): where they report and how long they may take. Their
// partners are threads (or the copy engine) of the same launch, which make progress as long as the counter
// waits above are bounded, so a legitimate hand-off lasts at most about one counter timeout (a megakernel
// producer waiting for its inputs) plus some tiles: the bound is twice the counter timeout plus one second
// (a standalone GEMM has no counter waits; it uses the same rule with its own timeout), and expiring it means
// a protocol bug or a stalled role. They do not give up on kAbortWait (a counter timeout): the roles then
// finish the tiles they hold, keeping every TMA load waited for; only kAbortHandoff makes them give up at once.
// `status` must not be null.
struct HandoffBound {
  DeviceStatus* status = nullptr;
  uint64_t counter_timeout_ns = 0;
  int32_t rank = 0;
  KernelId kernel = KernelId::kUnknown;

  __device__ __forceinline__ uint64_t timeout_ns() const { return 2 * counter_timeout_ns + 1000000000ull; }
};

// Failed polls of a hand-off between two looks at the abort word and the clock: the fast path stays a plain
// try_wait loop (each failed try_wait already suspends the thread a while), and a waiter notices its phase
// complete without a global load in between.
inline constexpr uint32_t kPollsPerCheck = 8;

// The slow path of an mbarrier wait: polls try_wait() (true once the phase completed) until it succeeds,
// the bound expires (recorded, kAbortHandoff) or another hand-off timed out; false when it gave up.
template <class TryWait>
__device__ __forceinline__ bool handoff_wait_slow(TryWait try_wait, const HandoffBound& bound, Role role,
                                                  CounterId counter, int32_t index) {
  const uint64_t start = global_timer_ns();
  for (uint32_t polls = 1;; ++polls) {
    if (try_wait()) return true;
    if (polls % kPollsPerCheck != 0) continue;
    if (abort_bits(bound.status) & kAbortHandoff) {
      record_abandoned(bound.status);
      return false;
    }
    if (global_timer_ns() - start > bound.timeout_ns()) {
      record_timeout(bound.status, {bound.rank, role, counter, index, bound.kernel}, 1, 0, kAbortHandoff);
      return false;
    }
  }
}

// Which threads' stores a hand-off's acquire must order: those of this CTA, or of the cluster's CTAs too
// (a value a partner CTA stored into this CTA's shared memory before its release-arrive).
enum class HandoffScope { kCta, kCluster };

// A bounded mbarrier hand-off: the fast path is one try_wait; false when it gave up (see handoff_wait_slow).
template <HandoffScope kScope = HandoffScope::kCluster>
__device__ __forceinline__ bool mbarrier_wait_bounded(uint64_t* bar, uint32_t parity, const HandoffBound& bound,
                                                      Role role, CounterId counter, int32_t index) {
  const auto try_wait = [&] {
    return kScope == HandoffScope::kCta ? mbarrier_try_wait_cta(bar, parity) : mbarrier_try_wait_cluster(bar, parity);
  };
  if (try_wait()) return true;
  return handoff_wait_slow(try_wait, bound, role, counter, index);
}

}  // namespace mok::device
