// mbarrier primitives with explicit memory-ordering scope, for hand-offs between the threads of a CTA and
// between the CTAs of a cluster (CUTLASS's ClusterBarrier uses the default .cta scope throughout; a
// value stored into a partner CTA's shared memory needs release/acquire at cluster scope).
#pragma once

#include <cstdint>

namespace mok::device {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The same shared-memory variable in CTA `cta` of this cluster, as a shared::cluster address.
__device__ __forceinline__ uint32_t cluster_address(const void* p, int cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_address(p)), "r"(cta));
  return remote;
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}

// True once the phase of parity `parity` has completed (the hardware may suspend the thread a while
// before it answers false). Acquire at cluster scope, so it also orders stores a partner CTA made into this
// CTA's shared memory before its release-arrive.
__device__ __forceinline__ bool mbarrier_try_wait_cluster(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(done)
      : "r"(smem_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// The same with acquire at CTA scope, for hand-offs between the threads of one CTA: a cluster-scope acquire
// also invalidates the SM's L1 (CCTL.IVALL) at every successful wait, which the task ring's per-task
// hand-offs do not need (docs/perf_notes.md, round 10).
__device__ __forceinline__ bool mbarrier_try_wait_cta(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(done)
      : "r"(smem_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Arrives on a barrier of this CTA and raises the bytes its current phase waits for (the transaction
// count that bulk copies completing on it pay off).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)),
               "r"(bytes)
               : "memory");
}

// Raises the bytes the barrier's current phase waits for, without arriving.
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// Arrives on a barrier of this CTA; release at CTA scope.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

// Arrives on the barrier `bar` of CTA `cta` of this cluster; release at cluster scope.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, int cta) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_address(bar, cta))
               : "memory");
}

// Stores into the variable `p` of CTA `cta` of this cluster (made visible by a later release-arrive).
__device__ __forceinline__ void store_cluster(int32_t* p, int cta, int32_t value) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(cluster_address(p, cta)), "r"(value) : "memory");
}

}  // namespace mok::device
