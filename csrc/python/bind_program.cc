// Bindings for csrc/program: program sets (one Program per rank), the checker, fault injection.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>

#include "python/bind_common.h"
#include "tide/program.h"
#include "tide/program_index.h"

namespace nb = nanobind;
using namespace tide;

namespace tide {
namespace {
bool same_ref(const BufRef& a, const BufRef& b) {
  return a.kind == b.kind && a.rank == b.rank && a.index == b.index && a.offset == b.offset &&
         a.width == b.width && a.height == b.height && a.pitch == b.pitch;
}
// Every field of two ops (tests: a generated program is the built one, op for op).
bool same_op(const Op& a, const Op& b) {
  if (a.kind != b.kind || a.stream != b.stream || a.tag != b.tag || a.round != b.round ||
      !same_ref(a.dst, b.dst) || a.counter.rank != b.counter.rank || a.counter.index != b.counter.index ||
      a.value != b.value || a.per_call != b.per_call || a.alpha != b.alpha || a.accumulate != b.accumulate ||
      a.multicast != b.multicast || a.cast_to != b.cast_to || a.deadline_s != b.deadline_s || a.copies.size() != b.copies.size() ||
      a.terms.size() != b.terms.size())
    return false;
  for (size_t i = 0; i < a.copies.size(); ++i)
    if (!same_ref(a.copies[i].src, b.copies[i].src) || !same_ref(a.copies[i].dst, b.copies[i].dst)) return false;
  for (size_t i = 0; i < a.terms.size(); ++i) {
    const SumTerm &x = a.terms[i], &y = b.terms[i];
    if (!same_ref(x.src, y.src) || x.dtype != y.dtype || x.dst_elem != y.dst_elem || x.elems != y.elems ||
        x.term != y.term)
      return false;
  }
  return true;
}
}  // namespace

std::string describe_op(const Program& pr, int i) {
  const Op& op = pr.ops[i];
  std::string s = TIDE_STR_CAT(i, " ", op_kind_name(op.kind), " [", pr.streams[op.stream], "] tag=",
                               op_tag_name(op.tag));
  if (op.round >= 0) s += TIDE_STR_CAT(" round=", op.round);
  if (op.rail_group >= 0) s += TIDE_STR_CAT(" rail_group=", op.rail_group);
  if (op.counter.index >= 0)
    s += TIDE_STR_CAT(" counter=", op.counter.index < static_cast<int>(pr.counter_names.size())
                                       ? pr.counter_names[op.counter.index] : "?",
                      "@", op.counter.rank, " value=", op.value, " per_call=", op.per_call);
  for (const auto& cd : op.copies)
    s += TIDE_STR_CAT(" {", buf_kind_name(cd.src.kind), "@", cd.src.rank, "+", cd.src.offset, " -> ",
                      buf_kind_name(cd.dst.kind), "@", cd.dst.rank, "+", cd.dst.offset, " ", cd.src.width,
                      "x", cd.src.height, "}");
  return s;
}
}  // namespace tide

void bind_program_spec(nb::module_& m);  // bind_program_spec.cc

void bind_program(nb::module_& m) {
  bind_program_spec(m);
  nb::class_<ProgramSet>(m, "ProgramSet")
      .def("__len__", [](const ProgramSet& s) { return s.progs.size(); })
      .def("copy", [](const ProgramSet& s) { return std::make_shared<ProgramSet>(s); })
      .def_prop_ro("plan_hash", [](const ProgramSet& s) { return s.progs.empty() ? 0 : s.progs[0].plan_hash; })
      .def("num_ops", [](const ProgramSet& s, int r) { return s.program(r).ops.size(); })
      .def_prop_ro("generated", [](const ProgramSet& s) { return s.generator != nullptr; })
      .def("producer", [](const ProgramSet& s, int rank, int index) {
        // (rank, stream) of the ops that bump counter `index` on `rank`; (-1, -1): none.
        const CounterRef c{rank, index};
        if (s.generator) {
          int stream = -1;
          const int p = s.generator->producer(c, &stream);
          return std::make_pair(p, p < 0 ? -1 : stream);
        }
        for (const Program& pr : s.progs)
          for (const Op& op : pr.ops) {
            if (op_produces(op) && op.counter.rank == rank && op.counter.index == index)
              return std::make_pair(pr.rank, static_cast<int>(op.stream));
          }
        return std::make_pair(-1, -1);
      }, nb::arg("rank"), nb::arg("index"),
         "Tests: (rank, stream) producing counter `index` on `rank` (ops scanned, or the generator's map).")
      .def("first_difference", [](const ProgramSet& a, const ProgramSet& b, int r) {
        const Program pa = a.program(r), pb = b.program(r);
        const size_t n = std::min(pa.ops.size(), pb.ops.size());
        for (size_t i = 0; i < n; ++i)
          if (!same_op(pa.ops[i], pb.ops[i])) return static_cast<int64_t>(i);
        return pa.ops.size() == pb.ops.size() ? int64_t{-1} : static_cast<int64_t>(n);
      }, nb::arg("other"), nb::arg("rank"),
         "Tests: index of the first op of rank r that differs in any field between the two sets (-1: none).")
      .def("streams", [](const ProgramSet& s, int r) { return s.progs.at(r).streams; })
      .def("describe", [](const ProgramSet& s, int r) {
        std::vector<std::string> v;
        const Program p = s.program(r);
        for (size_t i = 0; i < p.ops.size(); ++i) v.push_back(describe_op(p, static_cast<int>(i)));
        return v;
      })
      .def_prop_ro("arena_bound", [](const ProgramSet& s) { return s.arena_bound; })
      .def_prop_ro("rails", [](const ProgramSet& s) {
        return std::string(rails_name(s.progs.empty() ? Rails::kOneSided : s.progs[0].rails));
      })
      .def("lowered", [](const ProgramSet& s) {
        s.require_built("ProgramSet.lowered");
        auto out = std::make_shared<ProgramSet>(s);
        lower_two_sided(out->progs);
        return out;
      }, "A copy of this one-sided set in the two-sided rail form ([Note: two-sided rails]).")
      .def_prop_ro("num_counters", [](const ProgramSet& s) {  // counter_base included
        int n = 0;
        for (const auto& p : s.progs) n = std::max(n, p.num_counters);
        return n;
      })
      .def("arena_bytes", [](const ProgramSet& s) { return s.progs.at(0).arena.total; })
      .def("arena_layout", [](const ProgramSet& s) {
        const ArenaSpec& a = s.progs.at(0).arena;
        nb::dict d;
        for (int k = 4; k < kNumBufKinds; ++k)
          d[buf_kind_name(static_cast<BufKind>(k))] = nb::make_tuple(a.offset[k], a.bytes[k]);
        d["counters"] = nb::make_tuple(a.counters_offset, a.counters_bytes);
        return d;
      }, "{region: (offset, nbytes)} of the layout the set is bound to (rank 0's; every rank's is the same).")
      .def("arena_ends", [](const ProgramSet& s, int r) {
        s.require_built("ProgramSet.arena_ends");
        TIDE_PLAN_CHECK(r >= 0 && static_cast<size_t>(r) < s.progs.size(), "ProgramSet.arena_ends: rank ", r,
                        " is outside [0, ", s.progs.size(), ")");
        nb::dict d;
        const ProgramUse& use = s.index()->use[static_cast<size_t>(r)];
        for (int k = 4; k < kNumBufKinds; ++k)
          if (use.arena_end[k] >= 0) d[buf_kind_name(static_cast<BufKind>(k))] = use.arena_end[k];
        return d;
      }, nb::arg("rank"),
         "{region: end byte} of every arena region rank `rank`'s program addresses, in any rank's arena (the "
         "program index's ProgramUse.arena_end; what admission checks a layout against).")
      .def("ag_stats", [](const ProgramSet& s, int r) {
        auto st = ag_program_stats(s.progs.at(r));
        return std::make_tuple(st.scatter_descriptors, st.put_ops, st.ops);
      })
      .def("rail_stats", [](const ProgramSet& s, int r) {
        const RailStats st = rail_stats(s.program(r));
        nb::dict d;
        d["groups"] = st.groups;
        d["sends"] = st.sends;
        d["recvs"] = st.recvs;
        d["send_messages"] = st.send_messages;
        d["send_bytes"] = st.send_bytes;
        return d;
      }, nb::arg("rank"),
         "Rank r's rail per call ([Note: two-sided rails]): groups, sends, recvs, send_messages (1-D "
         "descriptors), send_bytes; zeros for a one-sided set.")
      .def("check", [](const ProgramSet& s, int calls) {
        s.require_built("ProgramSet.check");
        auto rep = check_program_set(s.progs, calls);
        return std::make_pair(rep.ok, rep.errors);
      }, nb::arg("calls") = 2)
      .def("inject_fault", [](ProgramSet& s, int kind, int rank, int tag, std::optional<int> round) {
        s.require_built("ProgramSet.inject_fault");
        ++s.version;  // cached tables of this set are stale (CudaRankExecutor)
        return inject_fault(s.progs, static_cast<FaultKind>(kind), rank, static_cast<OpTag>(tag),
                            round ? static_cast<int32_t>(*round) : kAnyRound);
      }, nb::arg("kind"), nb::arg("rank"), nb::arg("tag") = 0, nb::arg("round") = nb::none(),
         "Mutates rank `rank`'s program (tests); `tag` / `round` (Op::round, -1: none) narrow the op it picks.");

  m.def("build_ag_programs", [](const Plan& plan, int ring_slot, bool resident, bool multicast,
                                bool expert_lane, int group, int64_t head_bytes, bool with_expects,
                                nb::object arena, const std::string& landing_region, int64_t landing_offset,
                                int64_t resident_offset, int64_t counter_base, bool pull_landing) {
    AgCallOptions o;
    o.ring_slot = ring_slot; o.resident = resident; o.multicast = multicast;
    o.expert_lane = expert_lane; o.group = group; o.head_bytes = head_bytes; o.with_expects = with_expects;
    o.pull_landing = pull_landing;
    auto ps = std::make_shared<ProgramSet>();
    ps->progs = build_ag_programs(plan, o);
    RegionTable regions;
    ArenaBindOptions b;
    if (!arena.is_none()) { regions = regions_from_python(arena); b.regions = &regions; }
    b.landing_kind = static_cast<int>(ring_slot == 1 ? BufKind::kRing1 : BufKind::kRing0);
    b.landing_region = landing_region; b.landing_offset = landing_offset;
    b.resident_offset = resident_offset; b.counter_base = counter_base;
    bind_programs_to_arena(ps->progs, b);
    ps->arena_bound = b.regions != nullptr;
    return ps;
  }, nb::arg("plan"), nb::arg("ring_slot") = 0, nb::arg("resident") = true, nb::arg("multicast") = false,
     nb::arg("expert_lane") = false, nb::arg("group") = 0, nb::arg("head_bytes") = 0,
     nb::arg("with_expects") = true, nb::arg("arena") = nb::none(), nb::arg("landing_region") = "",
     nb::arg("landing_offset") = 0, nb::arg("resident_offset") = 0, nb::arg("counter_base") = 0,
     nb::arg("pull_landing") = false,
     "One TIDE-AG Program per rank (pull_landing: each rank lands in its own 'landing' user buffers "
     "by pulling its local peers' staged shards and, across nodes (a cast), their Bruck rounds' stage areas, "
     "[Note: pull landing]). arena={name: (offset, nbytes)} binds the programs to the caller's "
     "arena layout (landing_region/landing_offset: where ring<slot> lands, e.g. 'fixed'; resident_offset: "
     "the group's adopted shards in 'resident'); counter_base offsets every counter index.");

  m.def("check_calls", [](const nb::list& per_rank, int max_errors) {
    auto calls = calls_from_python(per_rank);
    for (const auto& rc : calls)
      for (const Call& c : rc)
        TIDE_PLAN_CHECK(!c.generator, "check_calls: rank ", c.program->rank, " calls a generated program set; "
                        "the checker needs built programs");
    auto rep = check_programs(calls, max_errors);
    return std::make_pair(rep.ok, rep.errors);
  }, nb::arg("calls"), nb::arg("max_errors") = 8,
     "Check per-rank call lists [[(ProgramSet, seq), ...] per rank]; returns (ok, errors).");

  nb::dict tags;
  tags["ReadyGate"] = static_cast<int>(OpTag::kReadyGate);
  tags["CreditWait"] = static_cast<int>(OpTag::kCreditWait);
  tags["PaceWait"] = static_cast<int>(OpTag::kPaceWait);
  tags["ArrivalWait"] = static_cast<int>(OpTag::kArrivalWait);
  tags["DoneWait"] = static_cast<int>(OpTag::kDoneWait);
  tags["Fence"] = static_cast<int>(OpTag::kFence);
  tags["ReadyWait"] = static_cast<int>(OpTag::kReadyWait);
  tags["Scatter"] = static_cast<int>(OpTag::kScatter);
  tags["RoundHead"] = static_cast<int>(OpTag::kRoundHead);
  tags["RoundTail"] = static_cast<int>(OpTag::kRoundTail);
  tags["CastGate"] = static_cast<int>(OpTag::kCastGate);
  tags["ReadySignal"] = static_cast<int>(OpTag::kReadySignal);
  tags["CreditSignal"] = static_cast<int>(OpTag::kCreditSignal);
  tags["Pull"] = static_cast<int>(OpTag::kPull);
  m.attr("op_tags") = tags;
  nb::dict faults;
  for (int k = 0; k <= static_cast<int>(FaultKind::kRailSizeMismatch); ++k)
    faults[fault_kind_name(static_cast<FaultKind>(k))] = k;
  m.attr("fault_kinds") = faults;
}
