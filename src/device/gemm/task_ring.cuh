// Task slots handed from a cluster's producer thread to its consumers and to the partner CTA (the GEMM's
// atomic-ticket task order; protocol table in docs/sync_protocol.md).
#pragma once

#include <cstdint>

#include "src/device/common/mbarrier.cuh"
#include "src/device/common/sync.cuh"

namespace mok::gemm {

// A slot past every task: what take() hands out once the status word's abort is set (the cluster stops at
// the same slot in both CTAs) or when its mail hand-off gave up. Every walker maps it to "no task".
inline constexpr int32_t kStopSlot = 0x7fffffff;

// Hand-off of task slots. The cluster's rank-0 producer takes each slot from the global ticket and mails
// it to the rank-1 producer; each producer publishes it, or what it decoded from it (Payload: a few 32-bit
// words), to its own consumer warps. Entry q of each ring is reused every kDepth slots (phase parity
// (k / kDepth) & 1 for the k-th slot).
template <int kDepth, int kConsumerWarps, int kClusterN, class Payload = int32_t>
struct TaskRing {
  static_assert(sizeof(Payload) % 4 == 0, "the payload is broadcast as 32-bit words");
  uint64_t full[kDepth];        // producer -> own consumers (1 arrival)
  uint64_t empty[kDepth];       // own consumer warps -> producer (one arrival per warp)
  uint64_t mail_full[kDepth];   // on rank 1: rank 0's producer -> rank 1's producer (1 remote arrival)
  uint64_t mail_empty[kDepth];  // on rank 0: rank 1's producer -> rank 0's producer (1 remote arrival)
  Payload slot[kDepth];
  int32_t mail[kDepth];

  __device__ void init() {  // one thread, before the cluster-wide barrier that follows barrier init
    for (int q = 0; q < kDepth; ++q) {
      device::mbarrier_init(&full[q], 1);
      device::mbarrier_init(&empty[q], kConsumerWarps);
      device::mbarrier_init(&mail_full[q], 1);
      device::mbarrier_init(&mail_empty[q], 1);
    }
  }

  // Producer thread: the cluster's k-th slot (rank 0 takes it from `ticket`, rank 1 from rank 0's mail).
  // Rank 0 hands out kStopSlot instead once the abort word is set, and either rank returns kStopSlot when its
  // mail hand-off gave up.
  __device__ int32_t take(int k, int cta_rank, int32_t* ticket, const device::HandoffBound& bound) {
    return share(k, cta_rank, cta_rank == 0 ? claim(ticket, bound) : 0, bound);
  }

  // take() in two steps, so that rank 0 can claim the next slot early (its atomic's latency then hides behind
  // the current task's loads, as the standalone weight-gradient GEMM does) and share it when it gets there.
  // claim: rank 0's slot from the ticket, or kStopSlot once the abort word is set.
  __device__ int32_t claim(int32_t* ticket, const device::HandoffBound& bound) {
    // Why both reads at once: neither depends on the other, so the abort word adds no latency to the atomic
    // (between two tiles of a standalone GEMM the claim is on the producer's path). A slot taken after an abort
    // is thrown away; the ticket is zeroed before every launch.
    const uint32_t aborted = device::abort_bits(bound.status);
    const int32_t slot = atomicAdd(ticket, 1);
    return aborted != 0 ? kStopSlot : slot;
  }
  // share: the cluster's k-th slot: rank 0 mails `claimed` to rank 1 and returns it; rank 1 returns the mail.
  __device__ int32_t share(int k, int cta_rank, int32_t claimed, const device::HandoffBound& bound) {
    const int q = k % kDepth;
    const uint32_t phase = (k / kDepth) & 1;
    int32_t s;
    if (cta_rank == 0) {
      s = claimed;
      if constexpr (kClusterN > 1) {
        if (!device::mbarrier_wait_bounded(&mail_empty[q], phase ^ 1, bound, Role::kGemmProducer, CounterId::kTaskMail, q))
          return kStopSlot;
        device::store_cluster(&mail[q], 1, s);
        device::mbarrier_arrive_cluster(&mail_full[q], 1);
      }
    } else {
      if (!device::mbarrier_wait_bounded(&mail_full[q], phase, bound, Role::kGemmProducer, CounterId::kTaskMail, q))
        return kStopSlot;
      s = mail[q];
      device::mbarrier_arrive_cluster(&mail_empty[q], 0);
    }
    return s;
  }

  // Producer thread: the k-th entry for the consumers; false (nothing published) when the wait for the
  // entry to be free gave up.
  __device__ bool publish(int k, const Payload& value, const device::HandoffBound& bound) {
    const int q = k % kDepth;
    if (!device::mbarrier_wait_bounded<device::HandoffScope::kCta>(&empty[q], ((k / kDepth) & 1) ^ 1, bound,
                                                                   Role::kGemmProducer, CounterId::kTaskRing, q))
      return false;
    slot[q] = value;
    device::mbarrier_arrive(&full[q]);
    return true;
  }

  // Consumer threads (all of them): the k-th entry, warp-uniform; false (warp-uniform; `value` is then
  // garbage) when the wait gave up. The warps of a warpgroup may disagree: a caller that runs warpgroup-wide
  // work on the entry must agree first.
  __device__ bool consume(int k, Payload& value, const device::HandoffBound& bound) {
    const int q = k % kDepth;
    // CTA scope: the entry was stored by this CTA's producer thread (publish), not the partner's.
    const bool arrived = device::mbarrier_wait_bounded<device::HandoffScope::kCta>(
        &full[q], (k / kDepth) & 1, bound, Role::kGemmConsumer, CounterId::kTaskRing, q);
    // Why the shuffle: see compute_tile (ptxas must see branches around wgmma as warp-uniform).
    int32_t words[sizeof(Payload) / 4];
    const int32_t* entry = reinterpret_cast<const int32_t*>(&slot[q]);
#pragma unroll
    for (int w = 0; w < int(sizeof(Payload) / 4); ++w) words[w] = __shfl_sync(0xffffffff, entry[w], 0);
    const bool ok = __shfl_sync(0xffffffff, __all_sync(0xffffffff, arrived) ? 1 : 0, 0) != 0;
    __syncwarp();
    if (threadIdx.x % 32 == 0) device::mbarrier_arrive(&empty[q]);
    memcpy(&value, words, sizeof(Payload));
    return ok;
  }
};

}  // namespace mok::gemm
