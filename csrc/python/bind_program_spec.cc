// Programs from Python descriptions (tests and prototyping of new collectives): the IR of
// program.h spelled as dicts and tuples, validated on the way in.
//   ref    = (kind, rank, index, offset, width[, height, pitch])   kind: "shard", "stage", ...
//   op     = {"kind": "COPY", "stream": 0, "copies": [(ref, ref)], "terms": [(ref, dtype,
//             dst_elem, elems, term)], "dst": ref, "counter": (rank, index), "value": 1,
//             "per_call": 0, "alpha": 1.0, "accumulate": False, "tag": 0, "round": -1,
//             "cast_to": "bfloat16"}
//   rank   = {"streams": [...], "num_counters": n, "ops": [op], "release_event": i,
//             "done_event": i, "user_inputs": [ref], "user_outputs": [ref],
//             "expects": [(ref, dtype, [(ref, dtype)])], "group": 0}
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <memory>

#include "python/bind_common.h"
#include "tide/program.h"

namespace nb = nanobind;
using namespace tide;

namespace {
BufKind kind_of(nb::handle h) {
  if (nb::isinstance<nb::int_>(h)) return static_cast<BufKind>(nb::cast<int>(h));
  const std::string s = nb::cast<std::string>(h);
  for (int k = 0; k < kNumBufKinds; ++k)
    if (s == buf_kind_name(static_cast<BufKind>(k))) return static_cast<BufKind>(k);
  throw PlanError(TIDE_STR_CAT("program spec: unknown buffer kind '", s, "'"));
}
BufRef ref_of(nb::handle h) {
  auto t = nb::cast<nb::tuple>(h);
  TIDE_PLAN_CHECK(t.size() == 5 || t.size() == 7, "program spec: a ref is (kind, rank, index, offset, width[, height, pitch])");
  BufRef b;
  b.kind = kind_of(t[0]);
  b.rank = nb::cast<int>(t[1]);
  b.index = nb::cast<int>(t[2]);
  b.offset = nb::cast<int64_t>(t[3]);
  b.width = nb::cast<int64_t>(t[4]);
  if (t.size() == 7) { b.height = nb::cast<int64_t>(t[5]); b.pitch = nb::cast<int64_t>(t[6]); }
  return b;
}
OpKind op_kind_of(const std::string& s) {
  for (int k = 0; k <= static_cast<int>(OpKind::kCredit); ++k)
    if (s == op_kind_name(static_cast<OpKind>(k))) return static_cast<OpKind>(k);
  throw PlanError(TIDE_STR_CAT("program spec: unknown op kind '", s, "'"));
}
template <typename T>
T get(const nb::dict& d, const char* key, T dflt) {
  return d.contains(key) ? nb::cast<T>(d[key]) : dflt;
}
}  // namespace

void bind_program_spec(nb::module_& m) {
  m.def("program_set_from_spec", [](const Plan& plan, const nb::list& ranks) {
    auto ps = std::make_shared<ProgramSet>();
    int r = 0;
    for (auto rh : ranks) {
      auto d = nb::cast<nb::dict>(rh);
      Program pr;
      pr.rank = r++;
      pr.topo = plan.topo;
      pr.plan_hash = plan.hash;
      pr.group = get<int>(d, "group", 0);
      pr.collective = static_cast<Collective>(get<int>(d, "collective", 0));
      for (auto s : nb::cast<nb::list>(d["streams"])) pr.streams.push_back(nb::cast<std::string>(s));
      pr.num_counters = get<int>(d, "num_counters", 0);
      for (int i = 0; i < pr.num_counters; ++i) pr.counter_names.push_back(TIDE_STR_CAT("c", i));
      pr.arena = arena_spec_for(plan, pr.num_counters);
      pr.release_event = get<int>(d, "release_event", -1);
      pr.done_event = get<int>(d, "done_event", -1);
      if (d.contains("user_inputs")) for (auto h : nb::cast<nb::list>(d["user_inputs"])) pr.user_inputs.push_back(ref_of(h));
      if (d.contains("user_outputs")) for (auto h : nb::cast<nb::list>(d["user_outputs"])) pr.user_outputs.push_back(ref_of(h));
      if (d.contains("expects"))
        for (auto h : nb::cast<nb::list>(d["expects"])) {
          auto t = nb::cast<nb::tuple>(h);
          Expect ex;
          ex.region = ref_of(t[0]);
          ex.region_dtype = parse_dtype(nb::cast<std::string>(t[1]), "expects dtype");
          for (auto sh : nb::cast<nb::list>(t[2])) {
            auto st = nb::cast<nb::tuple>(sh);
            ex.sources.push_back({ref_of(st[0]), parse_dtype(nb::cast<std::string>(st[1]), "expects source dtype")});
          }
          pr.expects.push_back(std::move(ex));
        }
      for (auto oh : nb::cast<nb::list>(d["ops"])) {
        auto od = nb::cast<nb::dict>(oh);
        Op op;
        op.kind = op_kind_of(nb::cast<std::string>(od["kind"]));
        op.stream = static_cast<uint8_t>(get<int>(od, "stream", 0));
        op.tag = static_cast<OpTag>(get<int>(od, "tag", 0));
        op.round = get<int>(od, "round", -1);
        if (od.contains("copies"))
          for (auto ch : nb::cast<nb::list>(od["copies"])) {
            auto ct = nb::cast<nb::tuple>(ch);
            op.copies.push_back({ref_of(ct[0]), ref_of(ct[1])});
          }
        if (od.contains("terms"))
          for (auto th : nb::cast<nb::list>(od["terms"])) {
            auto tt = nb::cast<nb::tuple>(th);
            SumTerm st;
            st.src = ref_of(tt[0]);
            st.dtype = parse_dtype(nb::cast<std::string>(tt[1]), "term dtype");
            st.dst_elem = nb::cast<int64_t>(tt[2]);
            st.elems = nb::cast<int64_t>(tt[3]);
            st.term = nb::cast<int>(tt[4]);
            op.terms.push_back(st);
          }
        if (od.contains("dst")) op.dst = ref_of(od["dst"]);
        if (od.contains("counter")) {
          auto ct = nb::cast<nb::tuple>(od["counter"]);
          op.counter = {nb::cast<int>(ct[0]), nb::cast<int>(ct[1])};
        }
        op.value = get<int64_t>(od, "value", 0);
        op.per_call = get<int64_t>(od, "per_call", 0);
        op.alpha = get<float>(od, "alpha", 1.0f);
        op.accumulate = get<bool>(od, "accumulate", false);
        op.multicast = get<bool>(od, "multicast", false);
        if (od.contains("cast_to")) op.cast_to = parse_dtype(nb::cast<std::string>(od["cast_to"]), "op cast_to");
        op.deadline_s = get<double>(od, "deadline_s", 0.0);
        TIDE_PLAN_CHECK(op.stream < pr.streams.size(), "program spec: rank ", pr.rank, " op stream ", int(op.stream),
                        " out of range");
        pr.ops.push_back(std::move(op));
      }
      ps->progs.push_back(std::move(pr));
    }
    TIDE_PLAN_CHECK(static_cast<int>(ps->progs.size()) == plan.topo.world(), "program spec: ", ps->progs.size(),
                    " ranks described, the plan has ", plan.topo.world());
    return ps;
  }, nb::arg("plan"), nb::arg("ranks"), "Build a ProgramSet from Python dicts (see bind_program_spec.cc).");
}
