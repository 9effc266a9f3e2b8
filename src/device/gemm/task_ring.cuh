// Task slots handed from a cluster's producer thread to its consumers and to the partner CTA (the GEMM's
// atomic-ticket task order; protocol table in docs/sync_protocol.md).
#pragma once

#include <cstdint>

#include "src/device/common/mbarrier.cuh"

namespace mok::gemm {

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
  __device__ int32_t take(int k, int cta_rank, int32_t* ticket) {
    const int q = k % kDepth;
    const uint32_t phase = (k / kDepth) & 1;
    int32_t s;
    if (cta_rank == 0) {
      s = atomicAdd(ticket, 1);
      if constexpr (kClusterN > 1) {
        device::mbarrier_wait_cluster(&mail_empty[q], phase ^ 1);
        device::store_cluster(&mail[q], 1, s);
        device::mbarrier_arrive_cluster(&mail_full[q], 1);
      }
    } else {
      device::mbarrier_wait_cluster(&mail_full[q], phase);
      s = mail[q];
      device::mbarrier_arrive_cluster(&mail_empty[q], 0);
    }
    return s;
  }

  // Producer thread: the k-th entry for the consumers.
  __device__ void publish(int k, const Payload& value) {
    const int q = k % kDepth;
    device::mbarrier_wait_cluster(&empty[q], ((k / kDepth) & 1) ^ 1);
    slot[q] = value;
    device::mbarrier_arrive(&full[q]);
  }

  // Producer thread: take, then publish the slot itself.
  __device__ int32_t produce(int k, int cta_rank, int32_t* ticket) {
    static_assert(sizeof(Payload) == sizeof(int32_t), "publishes the slot number");
    const int32_t s = take(k, cta_rank, ticket);
    publish(k, s);
    return s;
  }

  // Consumer threads (all of them): the k-th entry, warp-uniform.
  __device__ Payload consume(int k) {
    const int q = k % kDepth;
    device::mbarrier_wait_cluster(&full[q], (k / kDepth) & 1);
    // Why the shuffle: see compute_tile (ptxas must see branches around wgmma as warp-uniform).
    int32_t words[sizeof(Payload) / 4];
    const int32_t* entry = reinterpret_cast<const int32_t*>(&slot[q]);
#pragma unroll
    for (int w = 0; w < int(sizeof(Payload) / 4); ++w) words[w] = __shfl_sync(0xffffffff, entry[w], 0);
    __syncwarp();
    if (threadIdx.x % 32 == 0) device::mbarrier_arrive(&empty[q]);
    Payload value;
    memcpy(&value, words, sizeof(Payload));
    return value;
  }
};

}  // namespace mok::gemm
