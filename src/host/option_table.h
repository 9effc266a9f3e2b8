// Every option of a MoE layer, defined once: the MoeShape fields and the MoeOptions fields (ScheduleOptions,
// FusedOptions included), each with the name the bindings use, the C++ path errors name, its kind (from the
// field's type), where Python spells it and whether every rank must give the same value.
//
// Derived from the table:
//   the workspace's cross-rank agreement check     src/host/moe.cu (agreement_words, check_agreement below)
//   the Python extension's keyword arguments       python/src/mok_ext.cpp: _mok.Workspace(device, rank, nccl_id,
//                                                  **options) and _mok.option_table() (names, kinds, defaults)
//   the C API's options by name                    bench/capi.cpp: mok_bench_layer_create's name/value pairs
// Checked against it:
//   Python Config and LayerShape (names, defaults, kinds)    python/tests/test_cpu.py
//   the structs (every field in the table, every entry round-trips through its field)
//                                                            tests/cpu/test_option_table.cpp
// Adding an option: its field in include/mok/ (moe.h, routing.h), one row of kOptionTable, Python Config's field
// (the test above fails until it is there), docs/design.md's "Options" table.
#pragma once

#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "mok/moe.h"

namespace mok::detail {

// What the table reads and writes: a layer's shape and options.
struct LayerOptions {
  MoeShape shape;
  MoeOptions options;
};

enum class OptionKind : int32_t { kBool = 0, kInt32 = 1, kInt64 = 2, kFloat32 = 3, kFloat64 = 4, kEnum = 5 };

// Where Python spells an option: a field of LayerShape (MoeShape), of Config (MoeOptions), or nowhere (the
// C++ and C APIs only).
enum class OptionHome : int32_t { kShape = 0, kConfig = 1, kCppOnly = 2 };

// A value of any kind: bools, integers and enum codes in `integer`, floating point in `real`.
struct OptionValue {
  int64_t integer = 0;
  double real = 0;
};

struct OptionDesc {
  std::string_view name;  // the bindings' key: Python Config's or LayerShape's field, the C API's name
  std::string_view path;  // as C++ errors name it: "MoeOptions.fused.comm_ctas"
  OptionKind kind;        // from the field's type
  OptionHome home;
  bool agreed;            // every rank of the group must give the same value (MoeWorkspace's constructor)
  std::span<const std::string_view> choices;  // kEnum: the names of the codes 0, 1, ... (Python's spelling)
  OptionValue (*get)(const LayerOptions&);
  void (*set)(LayerOptions&, OptionValue);    // unchecked: set_option checks the value's range first
  void* (*field)(LayerOptions&);              // the field itself (tests: the table reaches every field once)
};

namespace option_table_impl {

// root.*kFirst.*kRest...: the field at the end of a path of member pointers.
template <auto kFirst, auto... kRest, class Root>
constexpr auto& field_at(Root& root) {
  if constexpr (sizeof...(kRest) == 0)
    return root.*kFirst;
  else
    return field_at<kRest...>(root.*kFirst);
}

template <class F>
constexpr OptionKind kind_of() {
  if constexpr (std::is_same_v<F, bool>) return OptionKind::kBool;
  else if constexpr (std::is_enum_v<F>) return OptionKind::kEnum;
  else if constexpr (std::is_same_v<F, int32_t>) return OptionKind::kInt32;
  else if constexpr (std::is_same_v<F, int64_t>) return OptionKind::kInt64;
  else if constexpr (std::is_same_v<F, float>) return OptionKind::kFloat32;
  else if constexpr (std::is_same_v<F, double>) return OptionKind::kFloat64;
  else static_assert(sizeof(F) == 0, "an option's field is a bool, an enum, int32, int64, float or double");
}

template <class F>
OptionValue to_value(F v) {
  if constexpr (std::is_floating_point_v<F>)
    return {0, static_cast<double>(v)};
  else
    return {static_cast<int64_t>(v), 0};
}

template <class F>
F from_value(OptionValue v) {
  if constexpr (std::is_same_v<F, bool>)
    return v.integer != 0;
  else if constexpr (std::is_floating_point_v<F>)
    return static_cast<F>(v.real);
  else
    return static_cast<F>(v.integer);
}

// The table row of the field at LayerOptions.*kPath...
template <auto... kPath>
constexpr OptionDesc option(std::string_view name, std::string_view path, OptionHome home, bool agreed,
                            std::span<const std::string_view> choices = {}) {
  using F = std::remove_cvref_t<decltype(field_at<kPath...>(std::declval<LayerOptions&>()))>;
  return {name,
          path,
          kind_of<F>(),
          home,
          agreed,
          choices,
          [](const LayerOptions& o) { return to_value(field_at<kPath...>(o)); },
          [](LayerOptions& o, OptionValue v) { field_at<kPath...>(o) = from_value<F>(v); },
          [](LayerOptions& o) -> void* { return &field_at<kPath...>(o); }};
}

inline constexpr std::string_view kForwardPathNames[] = {"fused", "unfused"};  // ForwardPath's codes 0, 1
inline constexpr std::string_view kPrecisionNames[] = {"bf16", "fp8"};          // Precision's codes 0, 1
static_assert(static_cast<int>(ForwardPath::kFused) == 0 && static_cast<int>(ForwardPath::kUnfused) == 1);
static_assert(static_cast<int>(Precision::kBF16) == 0 && static_cast<int>(Precision::kFP8) == 1);

using L = LayerOptions;  // the table's rows spelled short
using Shp = MoeShape;
using Opt = MoeOptions;
using Sch = ScheduleOptions;
using Fus = FusedOptions;
using H = OptionHome;

// The table. Python: LayerShape's fields are the kShape rows, Config's the kConfig rows (same names and defaults).
// Not agreed: wait_timeout_s (each rank's own spin-waits; the kernels' results do not depend on it) and
// setup_timeout_s (each rank's own wait for the others).
inline constexpr OptionDesc kOptionTable[] = {
    option<&L::shape, &Shp::ep_size>("ep_size", "MoeShape.ep_size", H::kShape, true),
    option<&L::shape, &Shp::num_tokens>("num_tokens", "MoeShape.num_tokens", H::kShape, true),
    option<&L::shape, &Shp::top_k>("top_k", "MoeShape.top_k", H::kShape, true),
    option<&L::shape, &Shp::num_experts>("num_experts", "MoeShape.num_experts", H::kShape, true),
    option<&L::shape, &Shp::hidden>("hidden", "MoeShape.hidden", H::kShape, true),
    option<&L::shape, &Shp::intermediate>("intermediate", "MoeShape.intermediate", H::kShape, true),
    option<&L::shape, &Shp::shared_expert>("shared_expert", "MoeShape.shared_expert", H::kShape, true),
    option<&L::shape, &Shp::swiglu_limit>("swiglu_limit", "MoeShape.swiglu_limit", H::kShape, true),
    option<&L::options, &Opt::schedule, &Sch::tile_m>("tile_m", "MoeOptions.schedule.tile_m", H::kConfig, true),
    option<&L::options, &Opt::schedule, &Sch::capacity_rows>("capacity_rows", "MoeOptions.schedule.capacity_rows",
                                                          H::kConfig, true),
    option<&L::options, &Opt::schedule, &Sch::load_factor>("load_factor", "MoeOptions.schedule.load_factor",
                                                        H::kConfig, true),
    option<&L::options, &Opt::schedule, &Sch::wait_timeout_s>("wait_timeout_s", "MoeOptions.schedule.wait_timeout_s",
                                                           H::kConfig, false),
    option<&L::options, &Opt::path>("path", "MoeOptions.path", H::kConfig, true, kForwardPathNames),
    option<&L::options, &Opt::fused, &Fus::comm_ctas>("comm_ctas", "MoeOptions.fused.comm_ctas", H::kConfig, true),
    option<&L::options, &Opt::fused, &Fus::minibatch_rows>("minibatch_rows", "MoeOptions.fused.minibatch_rows",
                                                      H::kConfig, true),
    option<&L::options, &Opt::fused, &Fus::macrobatch_rows>("macrobatch_rows", "MoeOptions.fused.macrobatch_rows",
                                                       H::kConfig, true),
    option<&L::options, &Opt::fused, &Fus::timeline_records>("timeline_records", "MoeOptions.fused.timeline_records",
                                                        H::kCppOnly, true),
    option<&L::options, &Opt::fused, &Fus::backward_megakernel>("backward_megakernel",
                                                           "MoeOptions.fused.backward_megakernel", H::kConfig, true),
    option<&L::options, &Opt::backward>("backward", "MoeOptions.backward", H::kConfig, true),
    option<&L::options, &Opt::context_budget_bytes>("context_budget_bytes", "MoeOptions.context_budget_bytes",
                                                 H::kConfig, true),
    option<&L::options, &Opt::keep_gate_up>("keep_gate_up", "MoeOptions.keep_gate_up", H::kConfig, true),
    option<&L::options, &Opt::gather_rows>("gather_rows", "MoeOptions.gather_rows", H::kConfig, true),
    option<&L::options, &Opt::scatter_rows>("scatter_rows", "MoeOptions.scatter_rows", H::kConfig, true),
    option<&L::options, &Opt::precision>("precision", "MoeOptions.precision", H::kConfig, true, kPrecisionNames),
    option<&L::options, &Opt::fp8_power_of_two_scales>("fp8_power_of_two_scales", "MoeOptions.fp8_power_of_two_scales",
                                                        H::kConfig, true),
    option<&L::options, &Opt::bf16_weight_gradients>("bf16_weight_gradients", "MoeOptions.bf16_weight_gradients",
                                                      H::kConfig, true),
    option<&L::options, &Opt::fp8_weight_gradient_columns>("fp8_weight_gradient_columns",
                                                            "MoeOptions.fp8_weight_gradient_columns", H::kConfig, true),
    option<&L::options, &Opt::setup_timeout_s>("setup_timeout_s", "MoeOptions.setup_timeout_s", H::kConfig, false),
};

constexpr bool names_are_unique() {
  for (size_t i = 0; i < std::size(kOptionTable); ++i)
    for (size_t j = i + 1; j < std::size(kOptionTable); ++j)
      if (kOptionTable[i].name == kOptionTable[j].name) return false;
  return true;
}
static_assert(names_are_unique(), "an option's name is its key in every binding");

}  // namespace option_table_impl

using option_table_impl::kOptionTable;

// The row named `name`, or null.
const OptionDesc* find_option(std::string_view name);
// Sets `o`'s field to `value` after checking that it fits the kind (int32 range, a float32 that is finite when the
// double is, a bool 0 / 1, an enum code with a name); else std::invalid_argument naming the option.
void set_option(LayerOptions& o, const OptionDesc& option, OptionValue value);
// Parses `text` as the option's kind ("true" / "false" / "1" / "0"; a decimal integer; a floating-point number;
// an enum's name) and sets it; an unknown name or text that does not parse: std::invalid_argument naming them.
void set_option_text(LayerOptions& o, std::string_view name, std::string_view text);
// The value as text, as set_option_text reads it back (a double with 17 significant digits).
std::string option_text(const OptionDesc& option, OptionValue value);
std::string_view kind_name(OptionKind kind);  // "bool", "int32", "int64", "float32", "float64", "enum"

// The agreed options of `o` as integer words, in table order (floating point by its bits): what each rank
// all-gathers before the workspace's collective allocations.
std::vector<int64_t> agreement_words(const LayerOptions& o);
// `all`: `ranks` ranks' agreement_words, one after another. Throws std::invalid_argument naming the first agreed
// option where a rank differs from `mine`, with both values ("MoeWorkspace: the ranks disagree on
// MoeOptions.fused.comm_ctas: 2 here, 0 on rank 1; every rank must build the same workspace").
void check_agreement(std::span<const int64_t> all, int ranks, const LayerOptions& mine);

}  // namespace mok::detail
