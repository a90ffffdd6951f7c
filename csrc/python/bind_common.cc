// Conversions every binding file shares (declared in bind_common.h).
#include "python/bind_common.h"

#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

namespace nb = nanobind;

namespace tide {

RegionTable regions_from_python(const nb::handle& regions) {
  RegionTable out;
  TIDE_PLAN_CHECK(nb::isinstance<nb::dict>(regions), "arena/regions: expected {name: (offset, nbytes)}");
  for (auto kv : nb::borrow<nb::dict>(regions)) {
    const std::string name = nb::cast<std::string>(kv.first);
    nb::sequence t = nb::borrow<nb::sequence>(kv.second);
    TIDE_PLAN_CHECK(nb::len(t) == 2, "arena/regions['", name, "']: expected (offset, nbytes)");
    out[name] = {nb::cast<int64_t>(t[0]), nb::cast<int64_t>(t[1])};
  }
  return out;
}

std::vector<std::vector<Call>> calls_from_python(const nb::list& per_rank) {
  std::vector<std::vector<Call>> out;
  for (auto rank_calls : per_rank) {
    std::vector<Call> v;
    const int r = static_cast<int>(out.size());
    for (auto item : nb::cast<nb::list>(rank_calls)) {
      auto tup = nb::cast<nb::tuple>(item);
      auto ps = nb::cast<std::shared_ptr<ProgramSet>>(tup[0]);
      const int64_t seq = nb::cast<int64_t>(tup[1]);
      TIDE_PLAN_CHECK(r < static_cast<int>(ps->progs.size()), "calls: rank ", r, " has no program in its set");
      v.push_back({&ps->progs[r], seq, ps->generator.get()});
    }
    out.push_back(std::move(v));
  }
  return out;
}

RankBindingList bindings_from_python(const nb::handle& items, const char* who) {
  RankBindingList out;
  for (auto item : nb::borrow<nb::sequence>(items)) {
    nb::sequence t = nb::borrow<nb::sequence>(item);
    TIDE_PLAN_CHECK(nb::len(t) == 4, who, ": a binding is (buf_kind, index, data_ptr, nbytes)");
    const int kind = nb::cast<int>(t[0]);
    TIDE_PLAN_CHECK(kind >= 0 && kind < 4, who, ": kind ", kind, " is not a user buffer (shard, landing, grad, out)");
    Binding b;
    b.kind = static_cast<BufKind>(kind);
    b.index = nb::cast<int>(t[1]);
    b.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(t[2]));
    b.bytes = nb::cast<int64_t>(t[3]);
    TIDE_PLAN_CHECK(b.bytes >= 0, who, ": ", buf_kind_name(b.kind), "[", b.index, "] has negative nbytes ", b.bytes);
    out.push_back(b);
  }
  return out;
}

ExecutorOptions options_from_python(const nb::handle& opts) {
  ExecutorOptions o;
  if (opts.is_none()) return o;
  TIDE_PLAN_CHECK(nb::isinstance<nb::dict>(opts), "options: expected {field: value}");
  for (auto kv : nb::borrow<nb::dict>(opts)) {
    const std::string name = nb::cast<std::string>(kv.first);
    nb::handle v = kv.second;
    std::string text;
    if (nb::isinstance<nb::bool_>(v)) text = nb::cast<bool>(v) ? "1" : "0";
    else text = nb::str(v).c_str();
    set_option(o, name, text, "ExecutorOptions");
  }
  validate(o);
  return o;
}

ExecutorOptions options_from_python(const nb::handle& opts, const nb::handle& timeout_s) {
  ExecutorOptions o = options_from_python(opts);
  if (timeout_s.is_none()) return o;
  const bool both = !opts.is_none() && nb::borrow<nb::dict>(opts).contains("timeout_s");
  o.timeout_s = checked_timeout(nb::cast<double>(timeout_s));
  TIDE_PLAN_CHECK(!both || nb::cast<double>(nb::borrow<nb::dict>(opts)["timeout_s"]) == o.timeout_s,
                  "timeout_s: given twice (as an argument and in options) with different values");
  return o;
}

}  // namespace tide
