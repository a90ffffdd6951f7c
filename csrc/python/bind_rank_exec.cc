// Bindings for RankExecutor (csrc/exec/cpu/rank_executor.cc): one rank's programs per process over
// every rank's arena segment (POSIX shared-memory names, or raw addresses in-process).
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <memory>

#include "python/bind_common.h"
#include "tide/exec_cpu.h"
#include "tide/rail.h"

namespace nb = nanobind;
using namespace tide;

namespace {

// A rail implemented in Python (a face's framework rail, e.g. tide_torch's torch.distributed
// send/recv): start(rank, sends, recvs) -> ticket, test(ticket) -> bool, abort(why), name. The
// executor calls it from the thread that runs the call, with the GIL released (tide/rail.h).
class PyRail final : public Rail {
 public:
  explicit PyRail(nb::object obj) : obj_(std::move(obj)) {}
  ~PyRail() override {
    nb::gil_scoped_acquire gil;
    obj_.reset();
  }
  uint64_t start(int rank, const std::vector<RailTransfer>& sends, const std::vector<RailTransfer>& recvs) override {
    std::string err;
    {
      nb::gil_scoped_acquire gil;
      try {
        nb::list s, r;
        for (const auto& x : sends) s.append(nb::make_tuple(x.peer, reinterpret_cast<uintptr_t>(x.data), x.bytes));
        for (const auto& x : recvs) r.append(nb::make_tuple(x.peer, reinterpret_cast<uintptr_t>(x.data), x.bytes));
        return nb::cast<uint64_t>(obj_.attr("start")(rank, s, r));
      } catch (nb::python_error& e) {
        err = e.what();
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    throw Error(TIDE_STR_CAT("rail start failed: ", err));
  }
  bool test(uint64_t ticket) override {
    std::string err;
    {
      nb::gil_scoped_acquire gil;
      try {
        return nb::cast<bool>(obj_.attr("test")(ticket));
      } catch (nb::python_error& e) {
        err = e.what();
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    throw Error(err);
  }
  void abort(const std::string& why) override {
    nb::gil_scoped_acquire gil;
    try {
      obj_.attr("abort")(why);
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("tide rail abort");
    }
  }
  std::string name() const override {
    nb::gil_scoped_acquire gil;
    return nb::cast<std::string>(nb::str(obj_.attr("name")));
  }

 private:
  nb::object obj_;
};

}  // namespace


void bind_rank_exec(nb::module_& m) {
  nb::class_<Rail>(m, "Rail", "A rail transport between nodes (tide/rail.h): send/recv rendezvous groups.")
      .def_prop_ro("name", &Rail::name);
  m.def("local_rail", &make_local_rail,
        "A rail whose ranks all live in this process (a send meets its receive in memory).");

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
          self->set_interrupt(python_interrupt_check());
          return;
        }
        TIDE_PLAN_CHECK(names, "RankExecutor: segments must be all shared-memory names (str) or all "
                        "addresses (int)");
        std::vector<std::string> v;
        for (auto s : segments) v.push_back(nb::cast<std::string>(s));
        new (self) RankExecutor(rank, topo, v, segment_bytes, table, opt, fence);
        self->set_interrupt(python_interrupt_check());  // Ctrl-C reaches a blocked run
      }, nb::arg("rank"), nb::arg("nodes"), nb::arg("gpus_per_node"), nb::arg("segments"),
         nb::arg("segment_bytes"), nb::arg("regions") = nb::none(), nb::arg("timeout_s") = nb::none(), nb::arg("fence") = true,
         nb::arg("options") = nb::none())
      .def("set_rail", [](RankExecutor& ex, nb::object rail) {
        if (nb::isinstance<Rail>(rail)) ex.set_rail(nb::cast<std::shared_ptr<Rail>>(rail));
        else ex.set_rail(std::make_shared<PyRail>(rail));
      }, nb::arg("rail"),
         "The transport of two-sided programs' rail groups (options rails='two_sided'): a tide._core.Rail, or an "
         "object with start(rank, sends, recvs) -> ticket, test(ticket) -> bool, abort(why) and name; sends/recvs "
         "are [(peer, address, nbytes)].")
      .def_prop_ro("rails", [](const RankExecutor& ex) { return std::string(rails_name(ex.rails())); })
      .def_prop_ro("rank", &RankExecutor::rank)
      .def_prop_ro("world", &RankExecutor::world)
      .def("segment_address", [](const RankExecutor& ex, int r) {
        TIDE_PLAN_CHECK(r >= 0 && r < ex.world(), "rank ", r, " out of range");
        return reinterpret_cast<uintptr_t>(ex.segment(r));
      }, nb::arg("rank"), "Where rank r's segment is mapped here (0: not mapped, a rank of another node).")
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
