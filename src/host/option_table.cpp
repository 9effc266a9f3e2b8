// The option table's lookups, checked setters, text form and cross-rank agreement (src/host/option_table.h).
#include "src/host/option_table.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace mok::detail {
namespace {

std::string quoted(std::string_view name) { return "'" + std::string(name) + "'"; }

// "option tile_m (MoeOptions.schedule.tile_m): "
std::string where(const OptionDesc& option) {
  return "option " + std::string(option.name) + " (" + std::string(option.path) + "): ";
}

std::string names_of(std::span<const std::string_view> names) {
  std::string text;
  for (std::string_view n : names) text += (text.empty() ? "" : ", ") + std::string(n);
  return text;
}

std::string all_names() {
  std::string text;
  for (const OptionDesc& o : kOptionTable) text += (text.empty() ? "" : ", ") + std::string(o.name);
  return text;
}

// An option's value as one integer word: the integer, or the floating-point value's bits.
int64_t word_of(const OptionDesc& option, OptionValue v) {
  int64_t word = v.integer;
  // By bits, with -0 as 0: ranks that give equal values agree (swiglu_limit -0.0 and 0.0 are both "plain SwiGLU").
  if (v.real == 0) v.real = 0;
  if (option.kind == OptionKind::kFloat64) {
    std::memcpy(&word, &v.real, sizeof(word));
  } else if (option.kind == OptionKind::kFloat32) {
    const float f = static_cast<float>(v.real);
    int32_t bits = 0;
    std::memcpy(&bits, &f, sizeof(bits));
    word = bits;
  }
  return word;
}

OptionValue value_of(const OptionDesc& option, int64_t word) {
  OptionValue v;
  if (option.kind == OptionKind::kFloat64) {
    std::memcpy(&v.real, &word, sizeof(word));
  } else if (option.kind == OptionKind::kFloat32) {
    const int32_t bits = static_cast<int32_t>(word);
    float f = 0;
    std::memcpy(&f, &bits, sizeof(f));
    v.real = f;
  } else {
    v.integer = word;
  }
  return v;
}

}  // namespace

std::string_view kind_name(OptionKind kind) {
  switch (kind) {
    case OptionKind::kBool: return "bool";
    case OptionKind::kInt32: return "int32";
    case OptionKind::kInt64: return "int64";
    case OptionKind::kFloat32: return "float32";
    case OptionKind::kFloat64: return "float64";
    case OptionKind::kEnum: return "enum";
  }
  return "unknown";
}

const OptionDesc* find_option(std::string_view name) {
  for (const OptionDesc& o : kOptionTable)
    if (o.name == name) return &o;
  return nullptr;
}

void set_option(LayerOptions& o, const OptionDesc& option, OptionValue value) {
  const auto fail = [&](const std::string& expected) {
    throw std::invalid_argument(where(option) + "expected " + expected + ", got " + option_text(option, value));
  };
  switch (option.kind) {
    case OptionKind::kBool:
      if (value.integer != 0 && value.integer != 1) fail("a bool (0 or 1)");
      break;
    case OptionKind::kInt32:
      if (value.integer < std::numeric_limits<int32_t>::min() || value.integer > std::numeric_limits<int32_t>::max())
        fail("an int32");
      break;
    case OptionKind::kInt64:
      break;
    case OptionKind::kFloat32:
      // A double past float's range would become an infinity (the validation then names it as such).
      if (std::isfinite(value.real) && std::abs(value.real) > std::numeric_limits<float>::max()) fail("a float32");
      break;
    case OptionKind::kFloat64:
      break;
    case OptionKind::kEnum:
      if (value.integer < 0 || value.integer >= static_cast<int64_t>(option.choices.size()))
        fail("one of " + names_of(option.choices));
      break;
  }
  option.set(o, value);
}

void set_option_text(LayerOptions& o, std::string_view name, std::string_view text) {
  const OptionDesc* option = find_option(name);
  if (option == nullptr)
    throw std::invalid_argument("unknown option " + quoted(name) + "; the options: " + all_names());
  const auto fail = [&](const std::string& expected) {
    throw std::invalid_argument(where(*option) + "expected " + expected + ", got " + quoted(text));
  };
  OptionValue value;
  switch (option->kind) {
    case OptionKind::kBool:
      if (text == "true" || text == "1")
        value.integer = 1;
      else if (text == "false" || text == "0")
        value.integer = 0;
      else
        fail("a bool (true, false, 1 or 0)");
      break;
    case OptionKind::kInt32:
    case OptionKind::kInt64: {
      const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value.integer);
      if (error != std::errc() || end != text.data() + text.size() || text.empty())
        fail(std::string("an ") + std::string(kind_name(option->kind)));
      break;
    }
    case OptionKind::kFloat32:
    case OptionKind::kFloat64: {
      const std::string copy(text);  // strtod needs a terminated string; it reads "inf" and "nan" too
      char* end = nullptr;
      value.real = std::strtod(copy.c_str(), &end);
      if (copy.empty() || end != copy.c_str() + copy.size()) fail("a number");
      break;
    }
    case OptionKind::kEnum: {
      int64_t code = -1;
      for (size_t c = 0; c < option->choices.size(); ++c)
        if (option->choices[c] == text) code = static_cast<int64_t>(c);
      if (code < 0) fail("one of " + names_of(option->choices));
      value.integer = code;
      break;
    }
  }
  set_option(o, *option, value);
}

std::string option_text(const OptionDesc& option, OptionValue value) {
  switch (option.kind) {
    case OptionKind::kBool:
      return value.integer == 0 ? "false" : value.integer == 1 ? "true" : std::to_string(value.integer);
    case OptionKind::kInt32:
    case OptionKind::kInt64:
      return std::to_string(value.integer);
    case OptionKind::kFloat32:
    case OptionKind::kFloat64: {
      char text[40];
      std::snprintf(text, sizeof(text), "%.17g", value.real);
      return text;
    }
    case OptionKind::kEnum:
      return value.integer >= 0 && value.integer < static_cast<int64_t>(option.choices.size())
                 ? std::string(option.choices[value.integer])
                 : "code " + std::to_string(value.integer);
  }
  return "?";
}

std::vector<int64_t> agreement_words(const LayerOptions& o) {
  std::vector<int64_t> words;
  for (const OptionDesc& option : kOptionTable)
    if (option.agreed) words.push_back(word_of(option, option.get(o)));
  return words;
}

void check_agreement(std::span<const int64_t> all, int ranks, const LayerOptions& mine) {
  const std::vector<int64_t> own = agreement_words(mine);
  if (all.size() != own.size() * static_cast<size_t>(ranks))
    throw std::logic_error("check_agreement: " + std::to_string(all.size()) + " words for " + std::to_string(ranks) +
                           " ranks of " + std::to_string(own.size()));
  for (int r = 0; r < ranks; ++r) {
    size_t w = 0;
    for (const OptionDesc& option : kOptionTable) {
      if (!option.agreed) continue;
      const int64_t theirs = all[r * own.size() + w];
      if (theirs != own[w])
        throw std::invalid_argument("MoeWorkspace: the ranks disagree on " + std::string(option.path) + ": " +
                                    option_text(option, value_of(option, own[w])) + " here, " +
                                    option_text(option, value_of(option, theirs)) + " on rank " + std::to_string(r) +
                                    "; every rank must build the same workspace");
      ++w;
    }
  }
}

}  // namespace mok::detail
