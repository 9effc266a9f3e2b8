// Placement of routed rows into the expert-major buffer: the arithmetic shared, line for line, by the GPU
// schedule kernels (schedule_kernels.cuh) and their CPU twin (src/host/schedule_host.cpp).
//
// Vocabulary
//   route        one (src rank s, token t, slot j) with topk[s][t][j] = global expert id; its global route
//                id is g = s*T*k + t*k + j, which is also what a scheduled row stores.
//   chunk        kChunkRoutes consecutive routes of one source rank (flattened q = t*k + j); the unit one
//                warp counts. Routes are ranked inside a (chunk, expert) by q: positions come from counts and
//                prefix sums only, never from atomic slot grabbing, so the schedule is deterministic.
//   segment      expert e's rows: [row_offsets[e], row_offsets[e] + counts[e]) real rows, padded up to
//                row_offsets[e+1] (a multiple of tile_m). Inside a segment the source ranks are interleaved
//                round-robin: row 0 from the first source with routes, row 1 from the next, ...; a source
//                that runs out drops out of the rotation. Each dispatch tile thus pulls from all peers.
//
// Buffers of one rank's schedule (int32 unless noted; E = local experts, R = ep_size, C = chunks per source):
//   chunk_counts       [R][C][E]  routes per (source, chunk, expert); turned into exclusive prefixes in place
//   route_slot         [R][T*k]   e * kChunkRoutes + rank inside (chunk, e), or -1 when not a local route
//   expert_src_counts  [E][R]     routes per (expert, source)
//   expert_counts      [E]        real rows per expert
//   expert_row_offsets [E+1]      padded segment starts; [E] = rows needed
//   row_route          [capacity] global route id of each row, -1 for padding and unused rows
//   route_row          [R][T*k]   row_route's inverse: the row of each route to a local expert, -1 for every other
//                                 route (and for all of them when nothing is placed)
//   own_ids            [T*k]      this rank's own ids as the schedule read them (saturate_id; -1 past the call's
//                                 tokens): the combine checks a later call's topk_idx against them
//   scheduled_rows     [1]        rows needed when they fit the capacity, else 0 (nothing is placed)
#pragma once

#include <cstdint>

#include "src/device/common/host_device.h"

namespace mok::schedule {

// Routes per chunk: 32 warp steps of 32 lanes.
inline constexpr int kChunkRoutes = 1024;
static_assert(kChunkRoutes % 32 == 0, "a chunk is a whole number of warp steps");

inline constexpr int32_t kNoRoute = -1;

MOK_HOST_DEVICE int64_t chunks_per_source(int64_t routes_per_rank) {
  return (routes_per_rank + kChunkRoutes - 1) / kChunkRoutes;
}

MOK_HOST_DEVICE int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Local expert of a global id on `rank`, or -1 when the id is masked, invalid or owned by another rank.
MOK_HOST_DEVICE int32_t local_expert_of(int32_t expert_id, int rank, int local_experts, int num_experts) {
  if (expert_id < 0 || expert_id >= num_experts) return -1;
  const int32_t owner = expert_id / local_experts;
  return owner == rank ? expert_id - owner * local_experts : -1;
}

MOK_HOST_DEVICE bool is_valid_expert_id(int32_t expert_id, int num_experts) {
  return expert_id >= -1 && expert_id < num_experts;
}

// A caller's id (int32 or int64) as the schedule stores it: saturated into int32 (anything outside [-1, E) is
// reported by the count kernel, so the saturation never hides an error).
MOK_HOST_DEVICE int32_t saturate_id(int64_t id) {
  return static_cast<int32_t>(id < INT32_MIN ? INT32_MIN : (id > INT32_MAX ? INT32_MAX : id));
}

// route_slot packs the local expert and the rank inside (chunk, expert).
MOK_HOST_DEVICE int32_t pack_route_slot(int32_t local_expert, int32_t rank_in_chunk) {
  return local_expert * kChunkRoutes + rank_in_chunk;
}
MOK_HOST_DEVICE int32_t slot_expert(int32_t route_slot) { return route_slot / kChunkRoutes; }
MOK_HOST_DEVICE int32_t slot_rank(int32_t route_slot) { return route_slot % kChunkRoutes; }

// Offset of row `index` (0-based, among the routes from `src`) inside an expert segment whose per-source
// counts are src_counts[0..ep_size): all rows of earlier rotations, then the earlier sources still in this one.
MOK_HOST_DEVICE int64_t interleaved_offset(const int32_t* src_counts, int ep_size, int src, int64_t index) {
  int64_t offset = 0;
  for (int peer = 0; peer < ep_size; ++peer) {
    const int64_t count = src_counts[peer];
    offset += count < index ? count : index;
    if (peer < src && count > index) ++offset;
  }
  return offset;
}

// Global route id <-> (source rank, token, slot).
MOK_HOST_DEVICE int32_t route_id(int src, int token, int slot, int num_tokens, int top_k) {
  return (src * num_tokens + token) * top_k + slot;
}
struct RouteCoords {
  int32_t src;
  int32_t token;
  int32_t slot;
};
MOK_HOST_DEVICE RouteCoords route_coords(int32_t route, int num_tokens, int top_k) {
  const int32_t token_global = route / top_k;
  return {token_global / num_tokens, token_global % num_tokens, route % top_k};
}

// Local expert whose padded segment holds `row`, given row_offsets[0..local_experts] (binary search).
MOK_HOST_DEVICE int32_t expert_of_row(const int32_t* row_offsets, int local_experts, int64_t row) {
  int32_t lo = 0, hi = local_experts;  // invariant: row_offsets[lo] <= row < row_offsets[hi]
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (row_offsets[mid] <= row) lo = mid; else hi = mid;
  }
  return lo;
}

// Byte layout of the schedule buffers of one rank (one allocation); host and device agree on it.
struct ScheduleLayout {
  int ep_size;
  int local_experts;
  int64_t routes_per_rank;
  int64_t num_chunks;  // per source
  int64_t capacity_rows;
  // Offsets in int32 elements from the base.
  int64_t chunk_counts, route_slot, expert_src_counts, expert_counts, expert_row_offsets, row_route, route_row,
      own_ids, scheduled_rows, total_elements;

  MOK_HOST_DEVICE static ScheduleLayout make(int ep_size, int local_experts, int64_t routes_per_rank,
                                             int64_t capacity_rows) {
    ScheduleLayout l{};
    l.ep_size = ep_size;
    l.local_experts = local_experts;
    l.routes_per_rank = routes_per_rank;
    l.num_chunks = chunks_per_source(routes_per_rank);
    l.capacity_rows = capacity_rows;
    int64_t at = 0;
    auto take = [&at](int64_t elements) { const int64_t start = at; at += round_up(elements, 4); return start; };
    l.chunk_counts = take(int64_t(ep_size) * l.num_chunks * local_experts);
    l.route_slot = take(int64_t(ep_size) * routes_per_rank);
    l.expert_src_counts = take(int64_t(local_experts) * ep_size);
    l.expert_counts = take(local_experts);
    l.expert_row_offsets = take(local_experts + 1);
    l.row_route = take(capacity_rows);
    l.route_row = take(int64_t(ep_size) * routes_per_rank);
    l.own_ids = take(routes_per_rank);
    l.scheduled_rows = take(1);
    l.total_elements = at;
    return l;
  }
};

}  // namespace mok::schedule
