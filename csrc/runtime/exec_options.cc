// Executor options and their debug overrides (contract in tide/exec_options.h). This file is the
// only place TIDE's executors read the environment.
#include "tide/exec_options.h"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "tide/errors.h"
#include "tide/plan.h"  // kMaxCtas: cast_ctas and zero_ctas share the planner's SUM/LAND CTA ceiling

namespace tide {

const char* cta_split_name(CtaSplit s) {
  return s == CtaSplit::kTiles ? "tiles" : s == CtaSplit::kRanges ? "ranges" : "auto";
}
const char* full_grid_name(FullGrid g) { return g == FullGrid::kWave ? "wave" : "tiles"; }
const char* copy_2d_name(Copy2D c) { return c == Copy2D::kPerCopy ? "per_copy" : "batch"; }
const char* copies_on_name(CopiesOn c) {
  return c == CopiesOn::kCopyEngines ? "copy_engines" : c == CopiesOn::kSms ? "sms" : "auto";
}

namespace {
// The other integer fields' ranges (tide/exec_options.h lists them; docs/options.md's table too).
constexpr int kMaxCopyLanes = 8;
constexpr int kMaxWorkers = 1024;
constexpr int kMaxRailCtas = 64;
constexpr int kMaxRailChannels = 32;
}  // namespace

void validate(const ExecutorOptions& o) {
  TIDE_PLAN_CHECK(std::isfinite(o.timeout_s) && o.timeout_s > 0 && o.timeout_s <= 1e6,
                  "ExecutorOptions.timeout_s: expected a finite number of seconds in (0, 1e6], got ", o.timeout_s);
  TIDE_PLAN_CHECK(o.cast_ctas >= 1 && o.cast_ctas <= kMaxCtas, "ExecutorOptions.cast_ctas: expected 1..", kMaxCtas, ", got ",
                  o.cast_ctas);
  TIDE_PLAN_CHECK(o.zero_ctas >= 1 && o.zero_ctas <= kMaxCtas, "ExecutorOptions.zero_ctas: expected 1..", kMaxCtas, ", got ",
                  o.zero_ctas);
  TIDE_PLAN_CHECK(o.copy_lanes >= 1 && o.copy_lanes <= kMaxCopyLanes, "ExecutorOptions.copy_lanes: expected 1..", kMaxCopyLanes, ", got ",
                  o.copy_lanes);
  TIDE_PLAN_CHECK(o.copy_spread_bytes >= 0, "ExecutorOptions.copy_spread_bytes: expected >= 0, got ",
                  o.copy_spread_bytes);
  TIDE_PLAN_CHECK(o.workers >= 0 && o.workers <= kMaxWorkers, "ExecutorOptions.workers: expected 0..", kMaxWorkers,
                  ", got ", o.workers);
  TIDE_PLAN_CHECK(o.cta_split == CtaSplit::kAuto || o.cta_split == CtaSplit::kTiles || o.cta_split == CtaSplit::kRanges,
                  "ExecutorOptions.cta_split: unknown value ", static_cast<int>(o.cta_split));
  TIDE_PLAN_CHECK(o.full_grid == FullGrid::kTiles || o.full_grid == FullGrid::kWave,
                  "ExecutorOptions.full_grid: unknown value ", static_cast<int>(o.full_grid));
  TIDE_PLAN_CHECK(o.copy_2d == Copy2D::kBatch || o.copy_2d == Copy2D::kPerCopy,
                  "ExecutorOptions.copy_2d: unknown value ", static_cast<int>(o.copy_2d));
  TIDE_PLAN_CHECK(o.copies_on == CopiesOn::kAuto || o.copies_on == CopiesOn::kCopyEngines || o.copies_on == CopiesOn::kSms,
                  "ExecutorOptions.copies_on: unknown value ", static_cast<int>(o.copies_on));
  TIDE_PLAN_CHECK(o.copy_ctas >= 1 && o.copy_ctas <= kMaxCtas, "ExecutorOptions.copy_ctas: expected 1..", kMaxCtas, ", got ",
                  o.copy_ctas);
  TIDE_PLAN_CHECK(o.rails == Rails::kOneSided || o.rails == Rails::kTwoSided, "ExecutorOptions.rails: unknown value ",
                  static_cast<int>(o.rails));
  TIDE_PLAN_CHECK(o.rail_ctas >= 1 && o.rail_ctas <= kMaxRailCtas, "ExecutorOptions.rail_ctas: expected 1..", kMaxRailCtas,
                  ", got ", o.rail_ctas);
  TIDE_PLAN_CHECK(o.rail_channels_per_peer >= 1 && o.rail_channels_per_peer <= kMaxRailChannels,
                  "ExecutorOptions.rail_channels_per_peer: expected 1..", kMaxRailChannels, ", got ",
                  o.rail_channels_per_peer);
}

namespace {

int64_t parse_int(const std::string& v, const std::string& where) {
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  TIDE_PLAN_CHECK(!v.empty() && end && *end == '\0', where, ": '", v, "' is not an integer");
  TIDE_PLAN_CHECK(errno == 0, where, ": ", v, " does not fit in 64 bits");
  return x;
}

// An int field of range lo..hi: a value past int is refused here, naming the range, before it
// is narrowed (a wrapped value could land inside the range); validate() checks the rest.
int parse_int_in(const std::string& v, const std::string& where, int lo, int hi) {
  const int64_t x = parse_int(v, where);
  TIDE_PLAN_CHECK(x >= INT32_MIN && x <= INT32_MAX, where, ": expected ", lo, "..", hi, ", got ", x);
  return static_cast<int>(x);
}

bool parse_bool(const std::string& v, const std::string& where) {
  if (v == "1" || v == "true") return true;
  TIDE_PLAN_CHECK(v == "0" || v == "false", where, ": expected 0/1 or false/true, got '", v, "'");
  return false;
}

template <typename E>
E parse_enum(const std::string& v, const std::string& where, const std::vector<std::pair<const char*, E>>& names) {
  std::string known;
  for (const auto& [n, e] : names) {
    if (v == n) return e;
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  throw PlanError(TIDE_STR_CAT(where, ": expected one of ", known, ", got '", v, "'"));
}

}  // namespace

void set_option(ExecutorOptions& o, const std::string& name, const std::string& value, const std::string& where) {
  const std::string w = TIDE_STR_CAT(where, ": ", name);
  if (name == "timeout_s") {
    char* end = nullptr;
    o.timeout_s = std::strtod(value.c_str(), &end);
    TIDE_PLAN_CHECK(!value.empty() && end && *end == '\0', w, ": '", value, "' is not a number");
  } else if (name == "cast_ctas") {
    o.cast_ctas = parse_int_in(value, w, 1, kMaxCtas);
  } else if (name == "zero_ctas") {
    o.zero_ctas = parse_int_in(value, w, 1, kMaxCtas);
  } else if (name == "cta_split") {
    o.cta_split = parse_enum<CtaSplit>(value, w, {{"auto", CtaSplit::kAuto}, {"tiles", CtaSplit::kTiles},
                                                  {"ranges", CtaSplit::kRanges}});
  } else if (name == "full_grid") {
    o.full_grid = parse_enum<FullGrid>(value, w, {{"tiles", FullGrid::kTiles}, {"wave", FullGrid::kWave}});
  } else if (name == "copy_lanes") {
    o.copy_lanes = parse_int_in(value, w, 1, kMaxCopyLanes);
  } else if (name == "copy_spread_bytes") {
    o.copy_spread_bytes = parse_int(value, w);
  } else if (name == "copy_2d") {
    o.copy_2d = parse_enum<Copy2D>(value, w, {{"batch", Copy2D::kBatch}, {"per_copy", Copy2D::kPerCopy}});
  } else if (name == "copies_on") {
    o.copies_on = parse_enum<CopiesOn>(value, w, {{"auto", CopiesOn::kAuto}, {"copy_engines", CopiesOn::kCopyEngines},
                                                  {"sms", CopiesOn::kSms}});
  } else if (name == "copy_ctas") {
    o.copy_ctas = parse_int_in(value, w, 1, kMaxCtas);
  } else if (name == "graphs") {
    o.graphs = parse_bool(value, w);
  } else if (name == "sync_every_call") {
    o.sync_every_call = parse_bool(value, w);
  } else if (name == "issue_gate") {
    o.issue_gate = parse_bool(value, w);
  } else if (name == "staging_canary") {
    o.staging_canary = parse_bool(value, w);
  } else if (name == "trace") {
    o.trace = parse_bool(value, w);
  } else if (name == "workers") {
    o.workers = parse_int_in(value, w, 0, kMaxWorkers);
  } else if (name == "rails") {
    o.rails = parse_rails(value, w);
  } else if (name == "rail_ctas") {
    o.rail_ctas = parse_int_in(value, w, 1, kMaxRailCtas);
  } else if (name == "rail_channels_per_peer") {
    o.rail_channels_per_peer = parse_int_in(value, w, 1, kMaxRailChannels);
  } else {
    throw PlanError(TIDE_STR_CAT(where, ": unknown field '", name, "' (fields: timeout_s, cast_ctas, zero_ctas, "
                                 "cta_split, full_grid, copy_lanes, copy_spread_bytes, copy_2d, copies_on, copy_ctas, "
                                 "graphs, sync_every_call, issue_gate, staging_canary, trace, workers, rails, rail_ctas, rail_channels_per_peer)"));
  }
}

std::string describe(const ExecutorOptions& o) {
  return TIDE_STR_CAT("timeout_s=", o.timeout_s, ",cast_ctas=", o.cast_ctas, ",zero_ctas=", o.zero_ctas,
                      ",cta_split=", cta_split_name(o.cta_split), ",full_grid=", full_grid_name(o.full_grid),
                      ",copy_lanes=", o.copy_lanes, ",copy_spread_bytes=", o.copy_spread_bytes,
                      ",copy_2d=", copy_2d_name(o.copy_2d),
                      ",copies_on=", copies_on_name(o.copies_on), ",copy_ctas=", o.copy_ctas, ",graphs=", o.graphs ? 1 : 0, ",sync_every_call=", o.sync_every_call ? 1 : 0,
                      ",issue_gate=", o.issue_gate ? 1 : 0,
                      ",staging_canary=", o.staging_canary ? 1 : 0, ",trace=", o.trace ? 1 : 0, ",workers=", o.workers, ",rails=", rails_name(o.rails),
                      ",rail_ctas=", o.rail_ctas, ",rail_channels_per_peer=", o.rail_channels_per_peer);
}

double checked_timeout(double timeout_s) {
  ExecutorOptions o;
  o.timeout_s = timeout_s;
  validate(o);
  return timeout_s;
}

ExecutorOptions with_debug_env(ExecutorOptions o) {
  if (const char* dbg = std::getenv("TIDE_DEBUG"); dbg && *dbg && std::strcmp(dbg, "0") != 0) o.trace = true;
  const char* env = std::getenv("TIDE_EXEC_OPTIONS");
  if (env == nullptr || *env == '\0') return o;
  const std::string s(env);
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = s.find(',', at);
    const std::string item = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    at = comma == std::string::npos ? s.size() + 1 : comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    TIDE_PLAN_CHECK(eq != std::string::npos && eq > 0, "TIDE_EXEC_OPTIONS: '", item,
                    "' is not field=value (e.g. TIDE_EXEC_OPTIONS=cta_split=ranges,copy_lanes=1)");
    set_option(o, item.substr(0, eq), item.substr(eq + 1), "TIDE_EXEC_OPTIONS");
  }
  try {
    validate(o);
  } catch (const PlanError& e) {
    throw PlanError(TIDE_STR_CAT("TIDE_EXEC_OPTIONS='", s, "': ", e.what()));
  }
  return o;
}

}  // namespace tide
