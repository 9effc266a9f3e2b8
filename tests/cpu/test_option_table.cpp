// The option table (src/host/option_table.h) against the structs it describes: every field of MoeShape,
// ScheduleOptions, FusedOptions and MoeOptions has exactly one row (the fields are counted by aggregate
// initialization, so a field added to a struct without a row fails here), every row round-trips a distinctive
// value through its field and touches no other row's, names and paths agree, the checked setters and the text form
// reject what does not fit, and the cross-rank agreement check names the option that differs.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "mok/moe.h"
#include "src/host/option_table.h"

namespace mok::detail {
namespace {

// Converts to any field type: T{AnyField{}, ...} is well-formed for as many initializers as T has fields.
struct AnyField {
  template <class T>
  operator T&() const;  // never defined: unevaluated only
};

template <class T, class... Fields>
constexpr int count_fields() {
  if constexpr (requires { T{std::declval<Fields>()..., AnyField{}}; })
    return count_fields<T, Fields..., AnyField>();
  else
    return static_cast<int>(sizeof...(Fields));
}

// The leaf fields the table must hold: MoeShape's, and MoeOptions' with its two nested structs replaced by
// their fields.
constexpr int kShapeFields = count_fields<MoeShape>();
constexpr int kOptionFields =
    count_fields<MoeOptions>() - 2 + count_fields<ScheduleOptions>() + count_fields<FusedOptions>();
static_assert(count_fields<ScheduleOptions>() == 4 && count_fields<FusedOptions>() == 5 &&
                  count_fields<MoeOptions>() == 13 && kShapeFields == 8,
              "a field was added to or removed from MoeShape / MoeOptions: give it a row of kOptionTable "
              "(src/host/option_table.h), then update these counts");

int rows_of(OptionHome home) {
  int n = 0;
  for (const OptionDesc& o : kOptionTable) n += o.home == home;
  return n;
}

TEST(OptionTableTest, EveryFieldHasOneRow) {
  EXPECT_EQ(rows_of(OptionHome::kShape), kShapeFields);
  EXPECT_EQ(rows_of(OptionHome::kConfig) + rows_of(OptionHome::kCppOnly), kOptionFields);
  // Distinct fields (with the counts above: every field).
  LayerOptions o;
  std::set<void*> fields;
  for (const OptionDesc& option : kOptionTable) {
    void* field = option.field(o);
    EXPECT_TRUE(fields.insert(field).second) << option.name << " shares its field with another row";
    const bool in_shape = field >= static_cast<void*>(&o.shape) && field < static_cast<void*>(&o.shape + 1);
    const bool in_options = field >= static_cast<void*>(&o.options) && field < static_cast<void*>(&o.options + 1);
    EXPECT_EQ(in_shape, option.home == OptionHome::kShape) << option.name;
    EXPECT_EQ(in_options, option.home != OptionHome::kShape) << option.name;
  }
}

TEST(OptionTableTest, NamesAndPathsAgree) {
  std::set<std::string_view> names;
  for (const OptionDesc& o : kOptionTable) {
    EXPECT_TRUE(names.insert(o.name).second) << o.name;
    const std::string path(o.path);
    std::string tail = ".";
    tail += o.name;
    EXPECT_TRUE(path.size() > tail.size() && path.compare(path.size() - tail.size(), tail.size(), tail) == 0)
        << o.path << " does not end with " << tail;
    EXPECT_EQ(path.rfind(o.home == OptionHome::kShape ? "MoeShape." : "MoeOptions.", 0), 0u) << o.path;
    EXPECT_EQ(o.kind == OptionKind::kEnum, !o.choices.empty()) << o.name;
    EXPECT_EQ(find_option(o.name), &o);
  }
  EXPECT_EQ(find_option("no_such_option"), nullptr);
  // Only the two timeouts may differ between ranks (each rank's own waits).
  for (const OptionDesc& o : kOptionTable)
    EXPECT_EQ(o.agreed, o.name != "wait_timeout_s" && o.name != "setup_timeout_s") << o.name;
}

// Reads the field's bytes as the row's kind.
OptionValue field_value(const OptionDesc& option, LayerOptions& o) {
  const void* field = option.field(o);
  OptionValue v;
  switch (option.kind) {
    case OptionKind::kBool: {
      bool b;
      std::memcpy(&b, field, sizeof(b));
      v.integer = b;
      break;
    }
    case OptionKind::kInt32:
    case OptionKind::kEnum: {  // ForwardPath: int32_t
      int32_t i;
      std::memcpy(&i, field, sizeof(i));
      v.integer = i;
      break;
    }
    case OptionKind::kInt64:
      std::memcpy(&v.integer, field, sizeof(v.integer));
      break;
    case OptionKind::kFloat32: {
      float f;
      std::memcpy(&f, field, sizeof(f));
      v.real = f;
      break;
    }
    case OptionKind::kFloat64:
      std::memcpy(&v.real, field, sizeof(v.real));
      break;
  }
  return v;
}

// A value no default has, different for every row.
OptionValue distinctive(const OptionDesc& option, const LayerOptions& defaults, int row) {
  const OptionValue d = option.get(defaults);
  switch (option.kind) {
    case OptionKind::kBool: return {d.integer ? 0 : 1, 0};
    case OptionKind::kInt32: return {1000003 + 17 * row, 0};
    case OptionKind::kInt64: return {(int64_t{1} << 40) + 17 * row, 0};
    case OptionKind::kFloat32: return {0, 0.375 + row};
    case OptionKind::kFloat64: return {0, 1.0 / 3 + row};
    case OptionKind::kEnum: return {(d.integer + 1) % static_cast<int64_t>(option.choices.size()), 0};
  }
  return d;
}

bool same(const OptionDesc& option, OptionValue a, OptionValue b) {
  const bool real = option.kind == OptionKind::kFloat32 || option.kind == OptionKind::kFloat64;
  return real ? a.real == b.real : a.integer == b.integer;
}

TEST(OptionTableTest, EveryRowRoundTripsThroughItsField) {
  const LayerOptions defaults;
  for (int row = 0; row < static_cast<int>(std::size(kOptionTable)); ++row) {
    const OptionDesc& option = kOptionTable[row];
    LayerOptions o;
    const OptionValue value = distinctive(option, defaults, row);
    set_option(o, option, value);
    const OptionValue expected = option.kind == OptionKind::kFloat32
                                     ? OptionValue{0, static_cast<double>(static_cast<float>(value.real))}
                                     : value;
    EXPECT_TRUE(same(option, option.get(o), expected)) << option.name << ": get differs from what was set";
    EXPECT_TRUE(same(option, field_value(option, o), expected)) << option.name << ": the field holds another value";
    for (const OptionDesc& other : kOptionTable) {
      if (&other == &option) continue;
      EXPECT_TRUE(same(other, other.get(o), other.get(defaults))) << "setting " << option.name << " changed "
                                                                  << other.name;
    }
    // The text form reads back the same value.
    LayerOptions parsed;
    set_option_text(parsed, option.name, option_text(option, value));
    EXPECT_TRUE(same(option, option.get(parsed), expected)) << option.name << ": text " << option_text(option, value);
  }
}

TEST(OptionTableTest, DefaultsAreTheStructs) {
  const LayerOptions o;
  EXPECT_EQ(find_option("minibatch_rows")->get(o).integer, FusedOptions{}.minibatch_rows);
  EXPECT_EQ(find_option("context_budget_bytes")->get(o).integer, MoeOptions{}.context_budget_bytes);
  EXPECT_EQ(find_option("wait_timeout_s")->get(o).real, ScheduleOptions{}.wait_timeout_s);
  EXPECT_EQ(option_text(*find_option("path"), find_option("path")->get(o)), "fused");
  EXPECT_EQ(option_text(*find_option("shared_expert"), find_option("shared_expert")->get(o)), "true");
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

TEST(OptionTableTest, TextAndRangesAreChecked) {
  LayerOptions o;
  set_option_text(o, "path", "unfused");
  EXPECT_EQ(o.options.path, ForwardPath::kUnfused);
  set_option_text(o, "backward_megakernel", "true");
  EXPECT_TRUE(o.options.fused.backward_megakernel);
  set_option_text(o, "context_budget_bytes", "8589934592");
  EXPECT_EQ(o.options.context_budget_bytes, int64_t{8} << 30);
  set_option_text(o, "load_factor", "inf");  // parsed; MoeWorkspace's validation decides (here: the worst case)
  EXPECT_TRUE(std::isinf(o.options.schedule.load_factor));
  set_option_text(o, "wait_timeout_s", "0.25");
  EXPECT_EQ(o.options.schedule.wait_timeout_s, 0.25);
  EXPECT_EQ(error_of([&] { set_option_text(o, "tile", "64"); }).rfind("unknown option 'tile'; the options: ep_size,", 0), 0u);
  EXPECT_EQ(error_of([&] { set_option_text(o, "tile_m", "64x"); }),
            "option tile_m (MoeOptions.schedule.tile_m): expected an int32, got '64x'");
  EXPECT_EQ(error_of([&] { set_option_text(o, "tile_m", ""); }),
            "option tile_m (MoeOptions.schedule.tile_m): expected an int32, got ''");
  EXPECT_EQ(error_of([&] { set_option_text(o, "tile_m", "4294967296"); }),
            "option tile_m (MoeOptions.schedule.tile_m): expected an int32, got 4294967296");
  EXPECT_EQ(error_of([&] { set_option_text(o, "path", "megakernel"); }),
            "option path (MoeOptions.path): expected one of fused, unfused, got 'megakernel'");
  EXPECT_EQ(error_of([&] { set_option_text(o, "keep_gate_up", "yes"); }),
            "option keep_gate_up (MoeOptions.keep_gate_up): expected a bool (true, false, 1 or 0), got 'yes'");
  EXPECT_EQ(error_of([&] { set_option_text(o, "load_factor", "2.0.0"); }),
            "option load_factor (MoeOptions.schedule.load_factor): expected a number, got '2.0.0'");
  EXPECT_EQ(error_of([&] { set_option(o, *find_option("swiglu_limit"), {0, 1e300}); }),
            "option swiglu_limit (MoeShape.swiglu_limit): expected a float32, got 1.0000000000000001e+300");
  EXPECT_EQ(error_of([&] { set_option(o, *find_option("path"), {2, 0}); }),
            "option path (MoeOptions.path): expected one of fused, unfused, got code 2");
  EXPECT_EQ(error_of([&] { set_option(o, *find_option("backward"), {2, 0}); }),
            "option backward (MoeOptions.backward): expected a bool (0 or 1), got 2");
}

// The workspace's agreement check (MoeWorkspace's constructor gathers agreement_words over the group).
TEST(OptionTableTest, AgreementNamesTheOptionThatDiffers) {
  LayerOptions mine;
  mine.shape = {2, 96, 4, 16, 256, 128, true, 0};
  mine.options.fused.comm_ctas = 2;
  auto gathered = [&](const LayerOptions& other) {
    std::vector<int64_t> all = agreement_words(mine);
    const std::vector<int64_t> theirs = agreement_words(other);
    all.insert(all.end(), theirs.begin(), theirs.end());
    return all;
  };
  EXPECT_EQ(error_of([&] { check_agreement(gathered(mine), 2, mine); }), "no error");
  LayerOptions other = mine;
  other.options.schedule.wait_timeout_s = 3;  // each rank's own
  EXPECT_EQ(error_of([&] { check_agreement(gathered(other), 2, mine); }), "no error");
  other = mine;
  other.options.fused.comm_ctas = 0;
  EXPECT_EQ(error_of([&] { check_agreement(gathered(other), 2, mine); }),
            "MoeWorkspace: the ranks disagree on MoeOptions.fused.comm_ctas: 2 here, 0 on rank 1; every rank must "
            "build the same workspace");
  other = mine;
  other.shape.num_tokens = 97;
  EXPECT_EQ(error_of([&] { check_agreement(gathered(other), 2, mine); }).rfind(
                "MoeWorkspace: the ranks disagree on MoeShape.num_tokens: 96 here, 97 on rank 1", 0),
            0u);
  other = mine;
  other.options.schedule.load_factor = 2.5;
  EXPECT_EQ(error_of([&] { check_agreement(gathered(other), 2, mine); }).rfind(
                "MoeWorkspace: the ranks disagree on MoeOptions.schedule.load_factor: 2 here, 2.5 on rank 1", 0),
            0u);
  other = mine;
  other.shape.swiglu_limit = -0.0f;  // equal to 0 (plain SwiGLU): not a disagreement of bits
  EXPECT_EQ(error_of([&] { check_agreement(gathered(other), 2, mine); }), "no error");
  other = mine;
  other.options.setup_timeout_s = 5;  // each rank's own
  EXPECT_EQ(error_of([&] { check_agreement(gathered(other), 2, mine); }), "no error");
  other = mine;
  other.shape.swiglu_limit = 7;
  EXPECT_EQ(error_of([&] { check_agreement(gathered(other), 2, mine); }).rfind(
                "MoeWorkspace: the ranks disagree on MoeShape.swiglu_limit: 0 here, 7 on rank 1", 0),
            0u);
  other = mine;
  other.options.path = ForwardPath::kUnfused;
  EXPECT_EQ(error_of([&] { check_agreement(gathered(other), 2, mine); }).rfind(
                "MoeWorkspace: the ranks disagree on MoeOptions.path: fused here, unfused on rank 1", 0),
            0u);
}

}  // namespace
}  // namespace mok::detail
