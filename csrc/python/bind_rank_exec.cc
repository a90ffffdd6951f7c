// Bindings for RankExecutor (csrc/exec/cpu/rank_executor.cc): one rank's programs per process over
// every rank's arena segment (POSIX shared-memory names, or raw addresses in-process).
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <memory>

#include "python/bind_common.h"
#include "tide/exec_cpu.h"

namespace nb = nanobind;
using namespace tide;


void bind_rank_exec(nb::module_& m) {
  nb::class_<RankExecutor>(m, "RankExecutor",
                           "Runs only `rank`'s TIDE programs; peers run theirs in their own processes.")
      .def("__init__", [](RankExecutor* self, int rank, int nodes, int gpus_per_node, const nb::list& segments,
                          int64_t segment_bytes, nb::object regions, nb::object timeout_s, bool fence, nb::object options) {
        const ExecutorOptions opt = options_from_python(options, timeout_s);
        Topology topo;
        topo.nodes = nodes;
        topo.gpus_per_node = gpus_per_node;
        const RegionTable table = regions.is_none() ? RegionTable{} : regions_from_python(regions);
        bool names = true, addrs = true;
        for (auto s : segments) {
          names = names && nb::isinstance<nb::str>(s);
          addrs = addrs && nb::isinstance<nb::int_>(s);
        }
        if (segments.size() > 0 && addrs && !names) {
          std::vector<uint8_t*> bases;
          for (auto s : segments) bases.push_back(reinterpret_cast<uint8_t*>(nb::cast<uintptr_t>(s)));
          new (self) RankExecutor(rank, topo, bases, segment_bytes, table, opt, fence);
          return;
        }
        TIDE_PLAN_CHECK(names, "RankExecutor: segments must be all shared-memory names (str) or all "
                        "addresses (int)");
        std::vector<std::string> v;
        for (auto s : segments) v.push_back(nb::cast<std::string>(s));
        new (self) RankExecutor(rank, topo, v, segment_bytes, table, opt, fence);
      }, nb::arg("rank"), nb::arg("nodes"), nb::arg("gpus_per_node"), nb::arg("segments"),
         nb::arg("segment_bytes"), nb::arg("regions") = nb::none(), nb::arg("timeout_s") = nb::none(), nb::arg("fence") = true,
         nb::arg("options") = nb::none())
      .def_prop_ro("rank", &RankExecutor::rank)
      .def_prop_ro("world", &RankExecutor::world)
      .def("segment_address", [](const RankExecutor& ex, int r) {
        TIDE_PLAN_CHECK(r >= 0 && r < ex.world(), "rank ", r, " out of range");
        return reinterpret_cast<uintptr_t>(ex.segment(r));
      }, nb::arg("rank"))
      .def("run", [](RankExecutor& ex, std::shared_ptr<ProgramSet> ps, int64_t seq, const nb::list& bindings,
                     nb::object ranks) {
        RankBindings b;
        for (auto item : bindings) {
          auto t = nb::cast<nb::tuple>(item);
          TIDE_PLAN_CHECK(t.size() == 4, "RankExecutor.run: bindings are (kind, index, data_ptr, nbytes)");
          const int kind = nb::cast<int>(t[0]);
          TIDE_PLAN_CHECK(kind >= 0 && kind < 4, "RankExecutor.run: kind ", kind, " is not a user buffer");
          b.bind(static_cast<BufKind>(kind), nb::cast<int>(t[1]), reinterpret_cast<void*>(nb::cast<uintptr_t>(t[2])),
                 nb::cast<int64_t>(t[3]));
        }
        std::vector<int> members;
        if (!ranks.is_none())
          for (auto r : ranks) members.push_back(nb::cast<int>(r));
        nb::gil_scoped_release release;
        ex.run(*ps, seq, b, ranks.is_none() ? nullptr : &members);
      }, nb::arg("programs"), nb::arg("seq"), nb::arg("bindings") = nb::list(), nb::arg("ranks") = nb::none(),
         "Runs this rank's program of `programs` for call `seq`; returns when it is done. bindings: "
         "[(buf_kind, index, data_ptr, nbytes), ...] for shard[p], grad[p], out (index -1). ranks: the "
         "global ranks of a sub-group whose programs these are (group rank i = ranks[i]).");
}
