// The forward megakernel: one persistent launch per rank that pulls token rows, runs the shared and the
// routed experts' SwiGLU MLPs and pushes the expert outputs to their tokens' ranks (ForwardPath::kFused in
// include/mok/moe.h). It replaces the unfused path's stages between its two EP barriers:
//
//   shared_hidden[t] = SwiGLU(x[t] · Wg^T, x[t] · Wu^T),     shared_out[t] = shared_hidden[t] · Wd^T
//   expert_rows[r]   = x_src[token]                          (dispatch: pull from the source rank)
//   hidden[r]        = SwiGLU(expert_rows[r] · Wg_e^T, ...),  y[r] = hidden[r] · Wd_e^T
//   combined_src[token * k + slot] = y[r]                    (combine: push to the source rank)
// x [padded T, H] (symmetric), expert_rows [ring, H], hidden [ring, I], y [ring, H] (rings of macrobatch rows,
// row r at r % ring), shared_hidden [padded T, I], shared_out [padded T, H], combined [T * k, H] (symmetric).
//
// Roles. One CTA per SM in clusters of kClusterN, every one computing (the default, comm_ctas == 0):
//   producer warpgroup   thread 0: takes compute slots (TaskRing: the cluster shares each slot), waits for the
//                        tile's input rows, issues the TMA loads (load_tile). Warps 1-3: the communication,
//                        taking dispatch and combine tasks from the comm ticket (forward_tasks.h) and copying
//                        rows with warp copies (communication_loop).
//   consumer warpgroups  wgmma + epilogue (compute_tile of the gate/up or the down GEMM), then count their
//                        64 rows as done for this n-block.
// With comm_ctas > 0 the first comm_ctas CTAs only communicate instead: lane 0 of each of their 12 warps
// bulk-copies rows through a shared-memory slot (BulkRowCopier), 12 slots in flight per CTA.
// Shared memory (ForwardSharedStorage): the expert GEMM's SharedStorage (gate/up and down traits share its
// layout), or for communication CTAs 12 row slots of 16 KB in the same bytes; a ring of decoded tasks.
// Sync: counters per 64-row unit in global memory, release-add / acquire-spin with timeouts reported through
// the status word (docs/sync_protocol.md, "forward megakernel"). Tasks are handed out in topological order,
// so spinning cannot deadlock.
// Determinism: every output element is one thread's fixed-order K reduction, whatever tile, CTA, minibatch
// or macrobatch it falls in; copies are copies. The results are bitwise those of the unfused path.
#pragma once

#include <cstdint>

#include "mok/peer_group.h"
#include "mok/status.h"
#include "src/device/combine/push_rows.cuh"
#include "src/device/common/sync.cuh"
#include "src/device/dispatch/pull_rows.cuh"
#include "src/device/gemm/expert_gemm.cuh"
#include "src/device/megakernel/forward_tasks.h"

namespace mok::megakernel {

// Counters of one forward (zeroed before the launch), one u64 per 64-row unit.
struct ForwardCounters {
  uint64_t* rows_arrived;         // [capacity / 64] dispatch tasks done (target 1)
  uint64_t* hidden_ready;         // [capacity / 64] gate/up n-blocks stored (target I / 128)
  uint64_t* output_ready;         // [capacity / 64] down n-blocks stored (target H / 256)
  uint64_t* rows_combined;        // [capacity / 64] combine tasks done (target 1)
  uint64_t* shared_hidden_ready;  // [padded T / 64] shared gate/up n-blocks stored (target I / 128)
};

// Per-CTA task records for the timeline: [CTAs][1 + capacity][4] u64; word 0 of a CTA counts its records
// (atomically: a compute CTA's first consumer thread and its copy warps' leader both record).
// A record: start ns, end ns, kind | rows << 8 | SM << 16 | CTA << 32, first row | n-block << 32 | expert << 48.
struct Timeline {
  uint64_t* records;  // nullable
  int capacity;       // records per CTA

  __device__ __forceinline__ void record(TaskKind kind, uint64_t start, uint64_t end, int32_t row, int32_t rows,
                                         int32_t n_block, int32_t expert) const {
    if (records == nullptr) return;
    uint64_t* cta = records + int64_t(blockIdx.x) * (capacity + 1) * 4;
    const uint64_t index = atomicAdd(reinterpret_cast<unsigned long long*>(cta), 1ull);  // two recorders a CTA
    if (index >= uint64_t(capacity)) return;
    uint64_t* r = cta + 4 + index * 4;
    r[0] = start;
    r[1] = end;
    r[2] = uint64_t(kind) | (uint64_t(uint8_t(rows)) << 8) | (uint64_t(uint16_t(device::sm_index())) << 16) |
           (uint64_t(blockIdx.x) << 32);
    r[3] = uint32_t(row) | (uint64_t(uint16_t(n_block)) << 32) | (uint64_t(uint16_t(expert)) << 48);
  }
};

template <class GemmParams>
struct ForwardParams {
  GemmParams shared_gate_up;  // A = x, out = shared_hidden
  GemmParams shared_down;     // A = shared_hidden, out = shared_out
  GemmParams expert_gate_up;  // A = expert_rows ring, out = hidden ring
  GemmParams expert_down;     // A = hidden ring, out = y ring
  TaskOrderShape order;
  const int32_t* scheduled_rows;  // read once by each walking thread
  const int32_t* row_route;   // [capacity]
  PeerPointers x;             // every rank's symmetric x, bf16 [padded T, H]
  PeerPointers combined;      // every rank's symmetric combine buffer, bf16 [T * k, H]
  uint4* expert_rows;         // bf16 ring [ring_rows, H]
  const uint4* expert_out;    // bf16 ring [ring_rows, H] (y)
  int num_tokens;
  int top_k;
  int row_vectors;            // H * 2 / 16
  int comm_ctas;
  int gate_up_n_blocks;       // I / 128
  int down_n_blocks;          // H / 256
  ForwardCounters counters;
  int32_t* compute_ticket;    // zeroed before the launch
  int32_t* comm_ticket;       // zeroed before the launch
  int rank;
  DeviceStatus* status;
  uint64_t timeout_ns;
  Timeline timeline;
};

enum class ForwardRole : int { kCommunication = 0, kProducer = 1, kConsumer = 2 };

// Communication CTAs: each warp's lane 0 copies rows with the bulk-copy engine through its own slot.
template <class T>
struct CommTraits {
  static constexpr int kWarps = T::kThreads / 32;
  static constexpr int kSlotBytes = 16384;  // a chunk in flight per warp; rows of H > 8192 go in chunks
};

// Compute CTAs use the GEMM's shared memory, communication CTAs the same bytes as row slots; plus a task
// ring that carries decoded tasks: the producer walks the task order once per slot and its consumers read
// the task (the GEMM's own slot ring stays unused).
template <class T>
struct ForwardSharedStorage {
  union {
    typename T::SharedStorage gemm;
    alignas(128) char comm_slots[CommTraits<T>::kWarps][CommTraits<T>::kSlotBytes];
  };
  gemm::TaskRing<T::kTaskDepth, 4 * T::kConsumerWarpgroups, T::kClusterN, ComputeTask> tasks;
  uint64_t comm_slot_loaded[CommTraits<T>::kWarps];  // mbarrier per slot (BulkRowCopier)
  int32_t comm_slot_word;                            // the communication group's task broadcast
};

template <class Params>
__device__ __forceinline__ const auto& gemm_of(const Params& p, TaskKind kind) {
  switch (kind) {
    case TaskKind::kSharedGateUp: return p.shared_gate_up;
    case TaskKind::kSharedDown: return p.shared_down;
    case TaskKind::kExpertGateUp: return p.expert_gate_up;
    default: return p.expert_down;
  }
}

template <int kClusterN>
__device__ __forceinline__ gemm::TileTask tile_of(const ComputeTask& t, int cta_rank) {
  return gemm::TileTask{t.row, t.buffer_row, t.rows, t.n_group, t.expert}.template for_cta<kClusterN>(cta_rank);
}

// Producer thread: waits until every 64-row unit of the tile's A rows is complete.
template <class Params>
__device__ __forceinline__ void wait_for_inputs(const Params& p, const ComputeTask& t) {
  const uint64_t* counters;
  uint64_t target;
  CounterId id;
  switch (t.kind) {
    case TaskKind::kSharedDown:
      counters = p.counters.shared_hidden_ready, target = p.gate_up_n_blocks, id = CounterId::kSharedHiddenReady;
      break;
    case TaskKind::kExpertGateUp:
      counters = p.counters.rows_arrived, target = 1, id = CounterId::kRowsArrived;
      break;
    case TaskKind::kExpertDown:
      counters = p.counters.hidden_ready, target = p.gate_up_n_blocks, id = CounterId::kHiddenReady;
      break;
    default: return;  // shared gate/up: x was complete before the launch
  }
  for (int32_t unit = t.row / kUnitRows; unit * kUnitRows < t.row + t.rows; ++unit)
    device::wait_at_least(counters + unit, target, {p.rank, Role::kGemmProducer, id, unit}, p.status, p.timeout_ns);
  // Why: the TMA loads that follow read, through the async proxy, rows the acquire above made visible.
  device::fence_proxy_async_global();
}

// Registers of the producer warpgroup after setmaxnreg: the GEMM's 48 leave too few for the task walker and
// four GEMMs' descriptors (ptxas spilled); the consumers keep theirs.
template <class T>
inline constexpr int kProducerRegisters = 56;

template <class T, class Params>
__device__ void run_producer(const Params& p, ForwardSharedStorage<T>& smem, typename T::Pipeline& pipeline,
                             int cta_rank) {
  static_assert(kProducerRegisters<T> * 128 + T::kConsumerRegisters * 128 * T::kConsumerWarpgroups <=
                    T::kLaunchRegisters * T::kThreads,
                "setmaxnreg redistributes the CTA's launch registers, no more");
  cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters<T>>();
  if (threadIdx.x >= 32) {  // warps 1-3 copy rows when no CTA is given to communication
    if (p.comm_ctas == 0) run_communication_warps<T>(p, smem);
    return;
  }
  if (threadIdx.x != 0) return;
  const device::HandoffBound bound{p.status, p.timeout_ns, p.rank};
  auto state = cutlass::make_producer_start_state<typename T::Pipeline>();
  ComputeWalker walker(p.order, *p.scheduled_rows);
  for (int k = 0;; ++k) {
    // After a timeout (abort set) rank 0 takes kStopSlot: both CTAs of the cluster stop at this slot.
    const int32_t slot = smem.tasks.take(k, cta_rank, p.compute_ticket, bound);
    ComputeTask task;
    if (slot == gemm::kStopSlot || !walker.task_at(slot, task)) task.kind = TaskKind::kNone;
    if (!smem.tasks.publish(k, task, bound)) break;  // hand-off gave up: stop issuing
    if (task.kind == TaskKind::kNone) break;
    // A failed input wait still issues the tile (in bounds, garbage): the partner CTA and both CTAs'
    // consumers already hold it, and every load issued is waited for before the CTAs exit.
    wait_for_inputs(p, task);
    if (!load_tile<T>(gemm_of(p, task.kind), tile_of<T::kClusterN>(task, cta_rank), cta_rank, smem.gemm, pipeline,
                      state, bound))
      break;
  }
  gemm::producer_tail_bounded(pipeline, state, bound);
}

template <class T, class TDown, class Params>
__device__ void run_consumer(const Params& p, ForwardSharedStorage<T>& smem, typename T::Pipeline& pipeline,
                             int cta_rank) {
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
  auto& down_smem = reinterpret_cast<typename TDown::SharedStorage&>(smem.gemm);
  const bool recorder = threadIdx.x == 128;
  gemm::RowsDoneSignal signal;  // this warpgroup's late completion count (used by its store leader)
  typename T::PipelineState state;
  const device::HandoffBound bound{p.status, p.timeout_ns, p.rank};
  // The consumer warpgroup's hardware barrier: the one compute_tile's epilogue syncs (NamedBarrier id
  // 1 + warpgroup), the same 128 threads.
  const int consumer_barrier = int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount) + 1 +
                               __shfl_sync(0xffffffff, (static_cast<int>(threadIdx.x) - 128) / 128, 0);
  for (int k = 0;; ++k) {
    ComputeTask task;
    const bool arrived = smem.tasks.consume(k, task, bound);  // warp-uniform (broadcast from lane 0)
    // Why: a hand-off that gave up leaves the warpgroup's four warps free to disagree; they must leave
    // together (the tile's wgmma and named barriers need all four).
    if (!device::named_barrier_all(arrived, consumer_barrier, 128)) break;
    const TaskKind kind = task.kind;
    if (kind == TaskKind::kNone) break;
    const uint64_t start = recorder ? device::global_timer_ns() : 0;
    const gemm::TileTask tile = tile_of<T::kClusterN>(task, cta_rank);
    // Why opaque: the fragment coordinates derived from the index are loop invariants; hoisted for both
    // GEMMs they outgrow the consumers' registers (ptxas spilled). Recomputing them per tile costs nothing.
    int consumer_idx;
    asm volatile("mov.u32 %0, %1;" : "=r"(consumer_idx) : "r"(static_cast<int>(threadIdx.x) - 128));
    const bool shared = kind == TaskKind::kSharedGateUp || kind == TaskKind::kSharedDown;
    // Two call sites, not four: each inlined compute_tile hoists its own loop invariants into registers.
    if (kind == TaskKind::kSharedGateUp || kind == TaskKind::kExpertGateUp)
      gemm::compute_tile<T>(shared ? p.shared_gate_up : p.expert_gate_up, tile, smem.gemm, pipeline, state, consumer_idx,
                            shared ? p.counters.shared_hidden_ready : p.counters.hidden_ready, &signal, bound);
    else
      gemm::compute_tile<TDown>(shared ? p.shared_down : p.expert_down, tile, down_smem, pipeline, state,
                                consumer_idx, shared ? nullptr : p.counters.output_ready, &signal, bound);
    if (recorder)
      p.timeline.record(task.kind, start, device::global_timer_ns(), tile.row, tile.rows, tile.n_block, task.expert);
  }
  if (threadIdx.x % 128 == 0) {
    signal.flush();
    // Why: the shared memory must outlive the last TMA stores' reads of it.
    cute::tma_store_wait<0>();
  }
}

// The communication loop of both placements: a group of threads takes 64-row dispatch and combine tasks
// from the comm ticket; its leader waits for the task's inputs; copy_unit(task) copies the rows (each thread
// ends with its copies written); the leader publishes them with one release.
//   sync(flag)  the group's barrier, returning whether any thread passed true: __syncthreads_or for a
//               communication CTA, bar.red.or on a named barrier for the producer warpgroup's copy warps
template <class Params, class Sync, class CopyUnit>
__device__ __forceinline__ void communication_loop(const Params& p, int32_t& slot_word, bool leader, Sync sync,
                                                   CopyUnit copy_unit) {
  const int32_t scheduled_rows = *p.scheduled_rows;
  while (true) {
    // After a timeout (abort set) the group takes no more tasks.
    if (leader) slot_word = device::abort_bits(p.status) != 0 ? gemm::kStopSlot : atomicAdd(p.comm_ticket, 1);
    sync(false);
    if (slot_word == gemm::kStopSlot) break;
    const CommTask task = comm_task_at(p.order, scheduled_rows, slot_word);
    if (task.kind == TaskKind::kNone) break;
    const uint64_t start = leader ? device::global_timer_ns() : 0;
    bool gave_up = false;
    if (leader) {
      bool ready = true;
      if (task.kind == TaskKind::kDispatch) {
        // The ring rows this unit overwrites held the unit one macrobatch later (walked earlier): its gate/up
        // tiles read them and its combine, which needed everything downstream, is done.
        const int32_t previous = task.unit + p.order.ring_rows / kUnitRows;
        if (previous * kUnitRows < scheduled_rows)
          ready = device::wait_at_least(p.counters.rows_combined + previous, 1,
                                        {p.rank, Role::kDispatch, CounterId::kRowsCombined, previous}, p.status,
                                        p.timeout_ns);
      } else {
        ready = device::wait_at_least(p.counters.output_ready + task.unit, p.down_n_blocks,
                                      {p.rank, Role::kCombine, CounterId::kOutputReady, task.unit}, p.status,
                                      p.timeout_ns);
      }
      gave_up = !ready;
    }
    // Why: the leader's acquire covers the group once it passes the barrier; the fence then orders it before
    // this thread's bulk loads (async proxy) of rows other CTAs wrote.
    // A wait that gave up: the group skips this unit's copy (its rows would be overwritten while read, or
    // are not written yet) and stops; the unit's counter never moves, so its dependents give up too.
    if (sync(gave_up)) break;
    device::fence_proxy_async_global();
    copy_unit(task);
    // Why: every thread's rows are written before the leader publishes them with one release.
    sync(false);
    if (leader) {
      device::fence_acq_rel_gpu();
      uint64_t* done = task.kind == TaskKind::kDispatch ? p.counters.rows_arrived : p.counters.rows_combined;
      device::add_release_gpu(done + task.unit, 1);
      p.timeline.record(task.kind, start, device::global_timer_ns(), task.unit * kUnitRows, kUnitRows, 0, 0);
    }
  }
  // Why: the barrier arrive after this kernel publishes the pushes to peers; order them at system scope.
  device::fence_acq_rel_sys();
}

// Where row r of a unit comes from and goes to: (source, destination); a null source means nothing to
// copy (a padding row: dispatch zeroes it, combine leaves it).
template <class Params>
__device__ __forceinline__ void unit_row_endpoints(const Params& p, const CommTask& task, int r, const uint4*& src,
                                                   uint4*& dst) {
  const int32_t row = task.unit * kUnitRows + r;
  const int32_t route = p.row_route[row];
  const int64_t ring_offset = int64_t(row % p.order.ring_rows) * p.row_vectors;
  if (task.kind == TaskKind::kDispatch) {
    dst = p.expert_rows + ring_offset;
    src = route < 0 ? nullptr : dispatch::source_row(p.x, route, p.num_tokens, p.top_k, p.row_vectors);
  } else {
    src = route < 0 ? nullptr : p.expert_out + ring_offset;
    dst = route < 0 ? nullptr : combine::destination_row(p.combined, route, p.num_tokens, p.top_k, p.row_vectors);
  }
}

// A communication CTA (FusedOptions::comm_ctas > 0): each warp's lane 0 bulk-copies its rows (warp w: rows w,
// w + 12, ...) through its 16 KB slot, as many whole rows at a time as fit (H <= 4096: two or more), so a CTA
// keeps 12 slots of rows in flight; padding rows are zeroed by the warp's stores.
template <class T, class Params>
__device__ void run_communication_cta(const Params& p, ForwardSharedStorage<T>& smem) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kWarps = CommTraits<T>::kWarps;
  const int row_bytes = p.row_vectors * 16;
  // Whole rows per slot when they fit more than one (H <= 4096), else one row (in chunks when H > 8192).
  const int rows_per_batch = row_bytes * 2 <= CommTraits<T>::kSlotBytes ? CommTraits<T>::kSlotBytes / row_bytes : 1;
  if (lane == 0) device::mbarrier_init(&smem.comm_slot_loaded[warp], 1);
  // Why: the barrier init must be visible to the async proxy (the bulk copies complete on it).
  cutlass::arch::fence_barrier_init();
  device::BulkRowCopier copier{smem.comm_slots[warp], &smem.comm_slot_loaded[warp], CommTraits<T>::kSlotBytes};
  auto copy_unit = [&](const CommTask& task) {
    if (task.kind == TaskKind::kDispatch) {
      for (int r = warp; r < kUnitRows; r += kWarps) {
        const uint4* src;
        uint4* dst;
        unit_row_endpoints(p, task, r, src, dst);
        if (src == nullptr) device::zero_row_warp(dst, p.row_vectors, lane);
      }
    }
    if (lane != 0) return;
    if (rows_per_batch == 1) {  // rows of 8 KB and more: one at a time, in slot-sized chunks
      for (int r = warp; r < kUnitRows; r += kWarps) {
        const uint4* src;
        uint4* dst;
        unit_row_endpoints(p, task, r, src, dst);
        if (src != nullptr) copier.copy(src, dst, row_bytes);
      }
    } else {  // smaller rows: a batch of whole rows fills the slot (loads, one wait, stores)
      for (int first = warp; first < kUnitRows; first += kWarps * rows_per_batch) {
        copier.begin();
        for (int b = 0, r = first; b < rows_per_batch && r < kUnitRows; ++b, r += kWarps) {
          const uint4* src;
          uint4* dst;
          unit_row_endpoints(p, task, r, src, dst);
          if (src != nullptr) copier.load(src, row_bytes, b * row_bytes);
        }
        copier.loaded();
        for (int b = 0, r = first; b < rows_per_batch && r < kUnitRows; ++b, r += kWarps) {
          const uint4* src;
          uint4* dst;
          unit_row_endpoints(p, task, r, src, dst);
          if (src != nullptr) copier.store(dst, row_bytes, b * row_bytes);
        }
      }
    }
    copier.finish();  // this warp's stores are written
  };
  communication_loop(p, smem.comm_slot_word, threadIdx.x == 0, [](bool flag) { return __syncthreads_or(flag) != 0; },
                     copy_unit);
}

// The producer warpgroup's three warps besides the TMA issuer (FusedOptions::comm_ctas == 0: no CTA is
// given to communication): warp copies (copy_row_warp), warp w of 3 taking rows w, w + 3, ... of a unit.
template <class T, class Params>
__device__ void run_communication_warps(const Params& p, ForwardSharedStorage<T>& smem) {
  // Hardware barrier 8: CUTLASS NamedBarrier ids 1 and 2 of the consumer warpgroups are hardware 9 and 10.
  // (Through NamedBarrier::sync, id 8 was hardware 16, which the SASS showed wrapped to barrier 0.)
  constexpr int kCopyWarps = 3, kBarrierId = 8;
  const int warp = static_cast<int>(threadIdx.x) / 32 - 1, lane = static_cast<int>(threadIdx.x) % 32;
  auto copy_unit = [&](const CommTask& task) {
    for (int r = warp; r < kUnitRows; r += kCopyWarps) {
      const uint4* src;
      uint4* dst;
      unit_row_endpoints(p, task, r, src, dst);
      if (src != nullptr)
        device::copy_row_warp(src, dst, p.row_vectors, lane);
      else if (task.kind == TaskKind::kDispatch)
        device::zero_row_warp(dst, p.row_vectors, lane);
    }
  };
  communication_loop(p, smem.comm_slot_word, threadIdx.x == 32,
                     [](bool flag) { return device::named_barrier_any(flag, kBarrierId, 32 * kCopyWarps); }, copy_unit);
}

template <class T, class TDown, class Params>
__global__ void __launch_bounds__(T::kThreads, 1) forward_kernel(const __grid_constant__ Params p) {
  static_assert(sizeof(typename T::SharedStorage) == sizeof(typename TDown::SharedStorage) &&
                    T::kStages == TDown::kStages && T::kBlockM == TDown::kBlockM && T::kBlockN == TDown::kBlockN &&
                    T::kClusterN == TDown::kClusterN,
                "the gate/up and down GEMMs share one shared-memory layout, pipeline and cluster");
  static_assert(T::kBlockM == kTileRows, "the task order's tiles are the GEMM's m-tiles");
  extern __shared__ __align__(1024) char shared_raw[];
  auto& smem = *reinterpret_cast<ForwardSharedStorage<T>*>(shared_raw);
  const int warpgroup = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);  // uniform: see compute_tile
  const ForwardRole role = static_cast<int>(blockIdx.x) < p.comm_ctas ? ForwardRole::kCommunication
                           : warpgroup == 0                            ? ForwardRole::kProducer
                                                                       : ForwardRole::kConsumer;

  // Communication CTAs build the pipeline too (unused): every CTA of the cluster takes part in its barrier.
  typename T::Pipeline pipeline = gemm::start_pipeline<T>(smem.gemm, smem.tasks, role == ForwardRole::kConsumer);
  const int cta_rank = static_cast<int>(cute::block_rank_in_cluster());
  switch (role) {
    case ForwardRole::kCommunication: run_communication_cta<T>(p, smem); break;
    case ForwardRole::kProducer: run_producer<T>(p, smem, pipeline, cta_rank); break;
    case ForwardRole::kConsumer: run_consumer<T, TDown>(p, smem, pipeline, cta_rank); break;
  }
  // Why: neither CTA may exit while its partner can still multicast into it or arrive on its barriers.
  if constexpr (T::kClusterN > 1) cute::cluster_sync();
}

}  // namespace mok::megakernel
