// Validation and sizing of the routing problem (include/mok/routing.h).
#include "mok/routing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "src/device/schedule/placement.h"
#include "src/host/check.h"

namespace mok {
using detail::require;

void RoutingShape::validate() const {
  require(ep_size >= 1 && ep_size <= kMaxEpSize,
          "RoutingShape.ep_size must be in [1, " + std::to_string(kMaxEpSize) + "], got " + std::to_string(ep_size));
  require(num_tokens >= 1, "RoutingShape.num_tokens must be >= 1, got " + std::to_string(num_tokens));
  require(top_k >= 1, "RoutingShape.top_k must be >= 1, got " + std::to_string(top_k));
  require(num_experts >= 1, "RoutingShape.num_experts must be >= 1, got " + std::to_string(num_experts));
  // A token's k routes go to k distinct experts (the router's top-k).
  require(top_k <= num_experts, "RoutingShape.top_k must be at most num_experts (" + std::to_string(num_experts) +
                                    "), got " + std::to_string(top_k));
  require(num_experts % ep_size == 0, "RoutingShape.num_experts (" + std::to_string(num_experts) +
                                          ") must be a multiple of ep_size (" + std::to_string(ep_size) + ")");
  // Route ids and row indices are int32 on the device.
  require(total_routes() < std::numeric_limits<int32_t>::max() / 2,
          "RoutingShape: ep_size * num_tokens * top_k = " + std::to_string(total_routes()) + " exceeds 2^30");
  require(int64_t(local_experts()) * schedule::kChunkRoutes < std::numeric_limits<int32_t>::max(),
          "RoutingShape: too many local experts (" + std::to_string(local_experts()) + ")");
}

void ScheduleOptions::validate(const RoutingShape& shape) const {
  require(tile_m >= 1 && tile_m <= 1024, "ScheduleOptions.tile_m must be in [1, 1024], got " + std::to_string(tile_m));
  require(capacity_rows >= 0, "ScheduleOptions.capacity_rows must be >= 0, got " + std::to_string(capacity_rows));
  // Also rejects NaN. Checked before resolved_capacity_rows, which would throw with another function's name.
  require(load_factor >= 1, "ScheduleOptions.load_factor must be >= 1 (ep_size or more: the worst case), got " +
                                std::to_string(load_factor));
  const int64_t capacity = resolved_capacity_rows(shape, *this);
  require(capacity < std::numeric_limits<int32_t>::max() / 2,
          "ScheduleOptions.capacity_rows: the capacity " + std::to_string(capacity) + " rows (" +
              (capacity_rows > 0 ? std::string("as given")
                                 : "from load_factor " + std::to_string(load_factor) +
                                       ", the padding of each expert's rows to tile_m included") +
              ") is too large for int32 row indices (below 2^30): set capacity_rows or lower load_factor");
  detail::require_seconds(wait_timeout_s, "ScheduleOptions.wait_timeout_s");
}

namespace {

// The most padding `rows` routes can need: each local expert with a route pads to tile_m, and at most
// min(local experts, rows) of them have one (decode-sized steps: far fewer routes than experts).
int64_t worst_padding(const RoutingShape& shape, int tile_m, int64_t rows) {
  return std::min<int64_t>(shape.local_experts(), rows) * (tile_m - 1);
}

}  // namespace

int64_t worst_case_capacity_rows(const RoutingShape& shape, int tile_m) {
  return schedule::round_up(shape.total_routes() + worst_padding(shape, tile_m, shape.total_routes()), tile_m);
}

int64_t expected_load_capacity_rows(const RoutingShape& shape, int tile_m, double load_factor) {
  require(load_factor >= 1, "expected_load_capacity_rows: load_factor must be >= 1, got " + std::to_string(load_factor));
  if (load_factor >= shape.ep_size) return worst_case_capacity_rows(shape, tile_m);  // (also for an infinite one)
  const int64_t balanced = static_cast<int64_t>(std::ceil(double(shape.num_tokens) * shape.top_k * load_factor));
  const int64_t rows = balanced + worst_padding(shape, tile_m, balanced);
  return std::min(schedule::round_up(rows, tile_m), worst_case_capacity_rows(shape, tile_m));
}

int64_t resolved_capacity_rows(const RoutingShape& shape, const ScheduleOptions& options) {
  return options.capacity_rows > 0 ? options.capacity_rows
                                   : expected_load_capacity_rows(shape, options.tile_m, options.load_factor);
}

}  // namespace mok
