// Bindings for the call runtime (tide/session.h): GroupSession, CounterSpace, the executor
// options and the CPU executors. The CUDA executors are bound in bind_cuda_exec.cc (tide._core.cuda).
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "python/bind_common.h"
#include "tide/session.h"

namespace nb = nanobind;
using namespace tide;

namespace {

Collective kind_from(const std::string& name) {
  for (int k = 0; k < kNumCollectives; ++k)
    if (name == collective_name(static_cast<Collective>(k))) return static_cast<Collective>(k);
  throw PlanError(TIDE_STR_CAT("collective: expected all_gather, reduce_scatter or reduce_scatter_expert, got '",
                               name, "'"));
}

std::vector<RankBindingList> buffers_from(const nb::handle& per_rank) {
  std::vector<RankBindingList> out;
  for (auto rank : nb::borrow<nb::sequence>(per_rank)) out.push_back(bindings_from_python(rank, "GroupSession"));
  return out;
}

std::vector<uintptr_t> streams_from(const nb::handle& streams) {
  std::vector<uintptr_t> out;
  if (streams.is_none()) return out;
  for (auto s : nb::borrow<nb::sequence>(streams)) out.push_back(nb::cast<uintptr_t>(s));
  return out;
}

std::shared_ptr<ProgramSet> mutable_set(std::shared_ptr<const ProgramSet> s) {
  return std::const_pointer_cast<ProgramSet>(std::move(s));
}

}  // namespace

void bind_session(nb::module_& m) {
  m.def("executor_options", [](nb::object opts) {
    const ExecutorOptions o = options_from_python(opts);
    return describe(o);
  }, nb::arg("options") = nb::none(),
     "Validates {field: value} executor options (tide.ExecutorOptions' fields) and returns their "
     "canonical text form 'field=value,...' (PlanError naming the field otherwise).");
  m.def("executor_options_with_debug_env", [](nb::object opts) { return describe(with_debug_env(options_from_python(opts))); },
        nb::arg("options") = nb::none(),
        "The options an executor created now would run with: TIDE_DEBUG and TIDE_EXEC_OPTIONS applied.");
  m.def("rs_bank", &rs_bank, nb::arg("seq"), "The TIDE-RS outbox bank of call seq: (seq - 1) mod 2.");
  nb::module_ testing = m.def_submodule("testing", "Inspection and fault helpers for TIDE's tests");
  testing.def("check_session_programs", [](const std::string& kind, const std::vector<std::shared_ptr<ProgramSet>>& sets) {
    std::vector<const ProgramSet*> v;
    for (const auto& s : sets) v.push_back(s.get());
    check_session_programs(kind_from(kind), v);
  }, nb::arg("collective"), nb::arg("sets"),
     "The checker as a session with check=True runs it on a new set (TIDE-RS: both banks, three calls); raises "
     "tide.Error 'TIDE static checker rejected ...'.");
  m.def("program_counters", [](const Plan& plan, const std::string& kind, const std::string& rails, bool pull_landing) {
    return program_counters(plan, kind_from(kind), parse_rails(rails, "program_counters"), pull_landing);
  }, nb::arg("plan"), nb::arg("collective"), nb::arg("rails") = "one_sided", nb::arg("pull_landing") = false,
     "Counters the collective's programs of `plan` use (rails='two_sided': lowered; pull_landing: TIDE-AG's pull "
     "programs).");
  m.def("session_arena", [](const Plan& plan, const std::vector<std::string>& kinds, const std::string& rails,
                            bool pull_landing) {
    std::vector<Collective> k;
    for (const auto& s : kinds) k.push_back(kind_from(s));
    const ArenaSpec a = GroupSession::own_arena(plan, k, parse_rails(rails, "session_arena"), pull_landing);
    nb::dict d;
    for (int i = 4; i < kNumBufKinds; ++i)
      if (a.offset[i] >= 0) d[buf_kind_name(static_cast<BufKind>(i))] = nb::make_tuple(a.offset[i], a.bytes[i]);
    d["counters"] = nb::make_tuple(a.counters_offset, a.counters_bytes);
    return nb::make_tuple(d, a.total);
  }, nb::arg("plan"), nb::arg("collectives"), nb::arg("rails") = "one_sided", nb::arg("pull_landing") = false,
     "The arena ({region: (offset, nbytes)}, total bytes) of a session with its own arena running `collectives` "
     "(pull_landing: a TIDE-AG that pulls, [Note: pulled arena]: its stage and counters only).");

  nb::class_<CounterSpace>(m, "CounterSpace",
                           "Counter slots shared by the groups of one arena: every group reserves its ranges in the "
                           "same order on every rank.")
      .def(nb::init<>())
      .def("reserve", [](CounterSpace& c, const Plan& p, const std::string& kind, const std::string& rails) {
        return c.reserve(p, kind_from(kind), parse_rails(rails, "CounterSpace.reserve"));
      }, nb::arg("plan"), nb::arg("collective"), nb::arg("rails") = "one_sided")
      .def_prop_ro("used", &CounterSpace::used)
      .def_prop_ro("region_bytes", &CounterSpace::region_bytes,
                   "Bytes of the arena's counters region: the reserved slots and the entry fence.");

  nb::class_<CallExecutor>(m, "CallExecutor", "An executor a GroupSession calls (CPU or CUDA, cluster or rank).")
      .def_prop_ro("world", &CallExecutor::world)
      .def_prop_ro("name", &CallExecutor::name)
      .def_prop_ro("rails", [](const CallExecutor& e) { return std::string(rails_name(e.rails())); })
      .def("synchronize", &CallExecutor::synchronize, nb::call_guard<nb::gil_scoped_release>())
      .def("set_timeout", &CallExecutor::set_timeout, nb::arg("timeout_s"), "The deadline of later calls' waits.");

  nb::class_<CpuClusterCallExecutor, CallExecutor>(m, "CpuClusterExecutor",
                                                    "The CPU virtual cluster: every rank's arena here (threads) or "
                                                    "in forked processes over shared memory.")
      .def("__init__", [](CpuClusterCallExecutor* self, int world, const Plan& plan, const std::vector<std::string>& kinds,
                          bool processes, nb::object options, bool pull_landing) {
        std::vector<Collective> k;
        for (const auto& s : kinds) k.push_back(kind_from(s));
        const ExecutorOptions o = options_from_python(options);
        // The rails the executor runs on (TIDE_EXEC_OPTIONS applied), which its programs lower to.
        const Rails rails = with_debug_env(o).rails;
        new (self) CpuClusterCallExecutor(world, GroupSession::own_arena(plan, k, rails, pull_landing), processes, o);
        self->run_options().interrupted = python_interrupt_check();  // Ctrl-C reaches a blocked call
      }, nb::arg("world"), nb::arg("plan"), nb::arg("collectives"), nb::arg("processes") = false,
         nb::arg("options") = nb::none(), nb::arg("pull_landing") = false,
         "An arena laid out for a session of `plan` running `collectives` (GroupSession.own_arena; "
         "pull_landing: a TIDE-AG that pulls).")
      .def_prop_ro("arena", [](CpuClusterCallExecutor& e) -> CpuArena& { return e.arena(); }, nb::rv_policy::reference_internal)
      .def("set_faults", [](CpuClusterCallExecutor& e, int stall_rank, int64_t stall_op, double stall_s, int dead_rank,
                            int64_t dead_op, bool verify_agreement) {
        CpuRunOptions& o = e.run_options();
        o.stall_rank = stall_rank; o.stall_op = stall_op; o.stall_s = stall_s;
        o.dead_rank = dead_rank; o.dead_op = dead_op; o.verify_agreement = verify_agreement;
      }, nb::arg("stall_rank") = -1, nb::arg("stall_op") = 0, nb::arg("stall_s") = 0.0, nb::arg("dead_rank") = -1,
         nb::arg("dead_op") = 0, nb::arg("verify_agreement") = true, "Executor-level fault injection (tests).");

  nb::class_<CpuRankCallExecutor, CallExecutor>(m, "CpuRankExecutor",
                                                 "One rank of a job whose ranks are processes (RankExecutor), as "
                                                 "a GroupSession's executor.")
      .def("__init__", [](CpuRankCallExecutor* self, std::shared_ptr<RankExecutor> ex, nb::object regions) {
        new (self) CpuRankCallExecutor(std::move(ex), regions.is_none() ? RegionTable{} : regions_from_python(regions));
      }, nb::arg("rank_executor"), nb::arg("regions") = nb::none(),
         "regions: the shared arena layout every group's programs are bound to.")
      .def_prop_ro("arrival_fences", [](CpuRankCallExecutor& e) { return e.rank_executor().arrival_fences(); },
                   "runs whose entry fence waited for the peers' arrival ([Note: entry fence])");

  nb::class_<GroupSession>(m, "GroupSession",
                           "One group's per-call state: cached program sets, call sequence numbers, the bank rule, "
                           "counter ranges and CTA budgets (tide/session.h).")
      .def("__init__", [](GroupSession* self, const Plan& plan, std::shared_ptr<CallExecutor> ex,
                          const std::vector<std::string>& kinds, int group, int ring_slot, bool resident,
                          const std::string& landing_region, int64_t landing_offset, int64_t resident_offset,
                          bool multicast, bool expert_lane, nb::object counter_bases, nb::object members,
                          int sum_ctas, int land_ctas, bool check, bool generate_rs, bool pull_landing) {
        GroupPlacement p;
        p.kinds.clear();
        for (const auto& s : kinds) p.kinds.push_back(kind_from(s));
        p.group = group; p.ring_slot = ring_slot; p.resident = resident;
        p.landing_region = landing_region; p.landing_offset = landing_offset; p.resident_offset = resident_offset;
        p.multicast = multicast; p.expert_lane = expert_lane; p.pull_landing = pull_landing;
        if (!counter_bases.is_none())
          for (auto kv : nb::borrow<nb::dict>(counter_bases))
            p.counter_base[static_cast<int>(kind_from(nb::cast<std::string>(kv.first)))] = nb::cast<int64_t>(kv.second);
        if (!members.is_none())
          for (auto r : nb::borrow<nb::sequence>(members)) p.members.push_back(nb::cast<int>(r));
        SessionOptions o;
        o.sum_ctas = sum_ctas; o.land_ctas = land_ctas; o.check = check; o.generate_rs = generate_rs;
        new (self) GroupSession(std::make_shared<const Plan>(plan), std::move(ex), std::move(p), o);
      }, nb::arg("plan"), nb::arg("executor"), nb::arg("collectives"), nb::kw_only(), nb::arg("group") = 0,
         nb::arg("ring_slot") = 0, nb::arg("resident") = true, nb::arg("landing_region") = "",
         nb::arg("landing_offset") = 0, nb::arg("resident_offset") = 0, nb::arg("multicast") = false,
         nb::arg("expert_lane") = false, nb::arg("counter_bases") = nb::none(),
         nb::arg("members") = nb::none(), nb::arg("sum_ctas") = 0, nb::arg("land_ctas") = 0,
         nb::arg("check") = false, nb::arg("generate_rs") = false, nb::arg("pull_landing") = false)
      .def_prop_ro("sum_ctas", &GroupSession::sum_ctas)
      .def_prop_ro("land_ctas", &GroupSession::land_ctas)
      .def_prop_ro("executor", [](const GroupSession& s) -> CallExecutor& { return s.executor(); },
                   nb::rv_policy::reference_internal)
      .def("calls", [](const GroupSession& s, const std::string& kind) { return s.calls(kind_from(kind)); },
           nb::arg("collective"))
      .def("counter_base", [](const GroupSession& s, const std::string& kind) {
        return s.placement().counter_base[static_cast<int>(kind_from(kind))];
      }, nb::arg("collective"))
      .def("programs", [](GroupSession& s, const std::string& kind, int64_t seq, float alpha, bool accumulate) {
        return mutable_set(s.programs(kind_from(kind), seq, alpha, accumulate));
      }, nb::arg("collective"), nb::arg("seq"), nb::arg("alpha") = 1.0f, nb::arg("accumulate") = false,
         "The program set call `seq` runs (built and cached on first use).")
      .def("all_gather", [](GroupSession& s, nb::object buffers, nb::object streams) {
        auto b = buffers_from(buffers);
        auto st = streams_from(streams);
        nb::gil_scoped_release release;
        return s.all_gather(b, st);
      }, nb::arg("buffers"), nb::arg("streams") = nb::none(),
         "One TIDE-AG call. buffers[i]: local rank i's [(buf_kind, index, data_ptr, nbytes)]; streams[i]: its "
         "caller stream (CUDA). Returns the call's seq.")
      .def("reduce_scatter", [](GroupSession& s, float alpha, bool accumulate, nb::object buffers, nb::object streams,
                                bool expert_lane) {
        auto b = buffers_from(buffers);
        auto st = streams_from(streams);
        nb::gil_scoped_release release;
        return s.reduce_scatter(alpha, accumulate, b, st, expert_lane);
      }, nb::arg("alpha"), nb::arg("accumulate"), nb::arg("buffers"), nb::arg("streams") = nb::none(),
         nb::arg("expert_lane") = false, "One TIDE-RS call (bank rs_bank(seq)); returns the call's seq.");
}
