// Shapes and options of the token schedule: which routed row goes where on which rank.
#pragma once

#include <cstdint>

namespace mok {

// Largest expert-parallel group one NVLink domain holds (GB200 NVL72); kernels take peer tables of this size.
inline constexpr int kMaxEpSize = 72;

enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };

// The routing problem every rank agrees on.
struct RoutingShape {
  int ep_size = 1;      // ranks in the expert-parallel group
  int num_tokens = 0;   // T: tokens per rank (the same on every rank)
  int top_k = 0;        // k: routes per token; id -1 masks a route
  int num_experts = 0;  // E: global experts; expert e lives on rank e / local_experts()

  int local_experts() const { return num_experts / ep_size; }
  int64_t routes_per_rank() const { return int64_t(num_tokens) * top_k; }
  int64_t total_routes() const { return routes_per_rank() * ep_size; }
  // Throws std::invalid_argument naming the offending field.
  void validate() const;
};

// The longest spin-wait timeout (a day): the kernels count it in integer nanoseconds.
inline constexpr double kMaxWaitTimeoutS = 24 * 3600;
// How long setup (creating a communicator and a workspace) waits for the other ranks by default: 10 minutes, as
// torch.distributed's default timeout (MoeOptions::setup_timeout_s, PeerGroup::nccl).
inline constexpr double kDefaultSetupTimeoutS = 600;

struct ScheduleOptions {
  int tile_m = 64;            // each expert's rows are padded up to a multiple of this. The GEMM takes 64 or
                              // 128; 64 never costs it more work (docs/perf_notes.md, round 3)
  // Expert-major rows a rank can hold (its context, backward scratch and megakernel counters are sized by
  // them). 0 selects expected_load_capacity_rows(shape, tile_m, load_factor); > 0 overrides load_factor (which
  // must still be valid, >= 1).
  int64_t capacity_rows = 0;
  // Headroom of the default capacity over the rows balanced routing brings a rank (T * k), >= 1. A step whose
  // routing needs more rows on a rank reports kStatusCapacityOverflow (rows needed and held) in that rank's
  // status word and schedules no rows there (the step's outputs are unspecified; after reset_status the next
  // step runs normally). load_factor >= ep_size gives the worst case (worst_case_capacity_rows: never
  // overflows); at EP <= 2 the default 2 is the worst case already.
  double load_factor = 2.0;
  // Spin-waits give up after this long and report through the status word: finite, in (0, kMaxWaitTimeoutS].
  double wait_timeout_s = 10;
  // Throws std::invalid_argument naming the offending field.
  void validate(const RoutingShape& shape) const;
};

// Rows needed when every route of every rank lands on one rank, plus the worst padding (tile_m - 1 rows for each
// local expert that can get a route: min(local experts, routes) of them): never overflows.
int64_t worst_case_capacity_rows(const RoutingShape& shape, int tile_m);

// A capacity sized by the expected load instead of the worst case: the rows a rank receives when the routing
// is balanced (T * k: each of the EP ranks sends T * k routes, spread over all of them) times load_factor
// (>= 1: headroom for imbalance), plus the worst padding, rounded up to tile_m and capped at the worst case.
// The default capacity (ScheduleOptions::capacity_rows 0); a step whose routing needs more rows reports
// kStatusCapacityOverflow in the status word (its outputs are then unspecified). load_factor >= ep_size: the
// worst case. Throws std::invalid_argument for load_factor < 1.
int64_t expected_load_capacity_rows(const RoutingShape& shape, int tile_m, double load_factor);

// Capacity actually used by a schedule for these options: capacity_rows when > 0, else
// expected_load_capacity_rows(shape, tile_m, load_factor).
int64_t resolved_capacity_rows(const RoutingShape& shape, const ScheduleOptions& options);

}  // namespace mok
