// CPU twin of the GPU schedule (src/device/schedule/schedule_kernels.cuh): the same chunked counting,
// prefix sums and placement, run sequentially with the shared functions of placement.h. Tests compare the
// GPU schedule with it exactly; an independent oracle in tests/cpu checks it in turn.
#include <limits>
#include <stdexcept>
#include <string>

#include "mok/schedule.h"
#include "src/device/schedule/placement.h"

namespace mok {

HostSchedule build_schedule_host(const RoutingShape& shape, const ScheduleOptions& options, int rank,
                                 const std::vector<int32_t>& gathered_topk) {
  using namespace schedule;
  shape.validate();
  options.validate(shape);
  if (rank < 0 || rank >= shape.ep_size) throw std::invalid_argument("build_schedule_host: bad rank " + std::to_string(rank));
  if (static_cast<int64_t>(gathered_topk.size()) != shape.total_routes())
    throw std::invalid_argument("build_schedule_host: gathered_topk has " + std::to_string(gathered_topk.size()) +
                                " ids, expected ep_size * num_tokens * top_k = " + std::to_string(shape.total_routes()));

  const int ep = shape.ep_size;
  const int local_experts = shape.local_experts();
  const int64_t routes = shape.routes_per_rank();
  const int64_t chunks = chunks_per_source(routes);
  const int64_t capacity = resolved_capacity_rows(shape, options);

  HostSchedule out;
  out.status.raw = initial_device_status();
  out.own_ids.assign(gathered_topk.begin() + int64_t(rank) * routes, gathered_topk.begin() + int64_t(rank + 1) * routes);
  std::vector<int32_t> chunk_counts(size_t(ep) * chunks * local_experts, 0);
  std::vector<int32_t> route_slot(size_t(ep) * routes, kNoRoute);

  // Count: routes ranked inside (chunk, expert) in route order.
  for (int src = 0; src < ep; ++src) {
    for (int64_t q = 0; q < routes; ++q) {
      const int64_t g = int64_t(src) * routes + q;
      const int32_t id = gathered_topk[g];
      if (!is_valid_expert_id(id, shape.num_experts)) {
        out.status.raw.error_bits |= kStatusBadExpertId;
        const uint64_t key = (uint64_t(g) << 32) | uint32_t(id);
        if (key < out.status.raw.bad_route_key) out.status.raw.bad_route_key = key;
      }
      const int32_t local = local_expert_of(id, rank, local_experts, shape.num_experts);
      if (local < 0) continue;
      int32_t& count = chunk_counts[(size_t(src) * chunks + q / kChunkRoutes) * local_experts + local];
      route_slot[g] = pack_route_slot(local, count);
      ++count;
    }
  }

  // Scan: exclusive prefixes over chunks, per-source totals, padded segment offsets.
  out.expert_src_counts.assign(size_t(local_experts) * ep, 0);
  out.expert_counts.assign(local_experts, 0);
  out.expert_row_offsets.assign(local_experts + 1, 0);
  int64_t rows = 0;
  for (int e = 0; e < local_experts; ++e) {
    int64_t total = 0;
    for (int src = 0; src < ep; ++src) {
      int32_t running = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        int32_t& cell = chunk_counts[(size_t(src) * chunks + c) * local_experts + e];
        const int32_t count = cell;
        cell = running;
        running += count;
      }
      out.expert_src_counts[size_t(e) * ep + src] = running;
      total += running;
    }
    out.expert_counts[e] = static_cast<int32_t>(total);
    out.expert_row_offsets[e] = static_cast<int32_t>(rows);
    rows += round_up(total, options.tile_m);
  }
  out.expert_row_offsets[local_experts] = static_cast<int32_t>(rows);
  const bool fits = rows <= capacity;
  out.scheduled_rows = fits ? static_cast<int32_t>(rows) : 0;
  if (!fits) {
    out.status.raw.error_bits |= kStatusCapacityOverflow;
    out.status.raw.rows_needed = rows;
    out.status.raw.rows_capacity = capacity;
  }

  // Place.
  out.row_route.assign(capacity, kNoRoute);
  out.route_row.assign(size_t(ep) * routes, kNoRoute);
  if (fits) {
    for (int64_t g = 0; g < int64_t(ep) * routes; ++g) {
      const int32_t slot = route_slot[g];
      if (slot == kNoRoute) continue;
      const int src = static_cast<int>(g / routes);
      const int64_t chunk = (g % routes) / kChunkRoutes;
      const int32_t e = slot_expert(slot);
      const int64_t index = chunk_counts[(size_t(src) * chunks + chunk) * local_experts + e] + slot_rank(slot);
      const int64_t row = out.expert_row_offsets[e] +
                          interleaved_offset(out.expert_src_counts.data() + size_t(e) * ep, ep, src, index);
      out.row_route[row] = static_cast<int32_t>(g);
      out.route_row[g] = static_cast<int32_t>(row);
    }
  }
  return out;
}

}  // namespace mok
