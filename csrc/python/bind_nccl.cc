// Bindings of the NCCL fabric (csrc/fabric/nccl.h) in tide._core.cuda: NcclFabric, nccl_unique_id,
// nccl_version, nccl_header_version. Built with CUDA; without NCCL headers the names exist and
// raise "built without NCCL headers".
#ifdef TIDE_WITH_CUDA
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "tide/errors.h"
#ifdef TIDE_WITH_NCCL
#include "fabric/nccl.h"
#endif

namespace nb = nanobind;

#ifdef TIDE_WITH_NCCL
namespace {
// The nvidia.nccl wheel's libnccl.so.2, tried after the plain dlopen (it is not on the loader's
// path unless torch has loaded it already). No wheel: nothing added.
void add_wheel_candidates() {
  static bool done = false;
  if (done) return;
  done = true;
  std::vector<std::string> paths;
  try {
    nb::object spec = nb::module_::import_("importlib.util").attr("find_spec")("nvidia.nccl");
    if (!spec.is_none())
      for (nb::handle loc : spec.attr("submodule_search_locations"))
        paths.push_back(nb::cast<std::string>(nb::str(loc)) + "/lib/libnccl.so.2");
  } catch (nb::python_error&) {  // no `nvidia` package at all
  }
  tide::fabric::nccl_add_library_candidates(paths);
}

uint64_t addr(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }
}  // namespace

void bind_nccl(nb::module_& m) {
  using tide::fabric::NcclFabric;
  m.def("nccl_header_version", &tide::fabric::nccl_header_version,
        "NCCL_VERSION_CODE of the headers tide was built against (0: built without NCCL headers).");
  m.def("nccl_version", []() {
    add_wheel_candidates();
    return tide::fabric::nccl_version();
  }, "ncclGetVersion of the libnccl.so.2 tide loads (raises tide.Error naming what is missing).");
  m.def("nccl_library_path", []() {
    add_wheel_candidates();
    return tide::fabric::nccl_library_path();
  }, "Path of the libnccl.so.2 tide loaded.");
  m.def("nccl_unique_id", []() {
    add_wheel_candidates();
    const std::string id = tide::fabric::nccl_unique_id();
    return nb::bytes(id.data(), id.size());
  }, "ncclGetUniqueId (128 bytes): made by one rank, passed to every rank's NcclFabric.");

  nb::class_<NcclFabric>(m, "NcclFabric",
                         "NCCL fabric of one rank per process: the arena in an NCCL symmetric window "
                         "(ncclMemAlloc + ncclCommWindowRegister), peers of the LSA team by their LSA pointers, "
                         "a rail communicator per local index. Construction is collective.")
      .def("__init__", [](NcclFabric* self, int rank, int world, int device, int64_t arena_bytes,
                          const nb::bytes& unique_id, nb::object gpus_per_node) {
        add_wheel_candidates();
        const int L = gpus_per_node.is_none() ? world : nb::cast<int>(gpus_per_node);
        const std::string id(unique_id.c_str(), unique_id.size());
        nb::gil_scoped_release release;  // ncclCommInitRank blocks until every rank has joined
        new (self) NcclFabric(rank, world, device, arena_bytes, id, L);
      }, nb::arg("rank"), nb::arg("world"), nb::arg("device"), nb::arg("arena_bytes"), nb::arg("unique_id"),
         nb::arg("gpus_per_node") = nb::none(),
         "gpus_per_node: ranks per node (default: world, one node); world % gpus_per_node must be 0.")
      .def_prop_ro("rank", &NcclFabric::rank)
      .def_prop_ro("world", &NcclFabric::world)
      .def_prop_ro("device", &NcclFabric::device)
      .def_prop_ro("arena_bytes", &NcclFabric::arena_bytes)
      .def_prop_ro("gpus_per_node", &NcclFabric::gpus_per_node)
      .def_prop_ro("arena_ptr", [](const NcclFabric& f) { return addr(f.arena(f.rank())); },
                   "This rank's arena through its LSA pointer (what executors use; 0 once closed).")
      .def_prop_ro("local_arena_ptr", [](const NcclFabric& f) { return addr(f.local_arena()); },
                   "The ncclMemAlloc pointer of this rank's arena (aliases arena_ptr).")
      .def("peer_arena_ptr", [](const NcclFabric& f, int r) {
        TIDE_PLAN_CHECK(r >= 0 && r < f.world(), "NcclFabric.peer_arena_ptr: rank ", r, " is outside [0, ", f.world(),
                        ")");
        return addr(f.arena(r));
      }, nb::arg("rank"), "Rank r's arena as mapped here: its LSA pointer, 0 outside this node's LSA team.")
      .def("is_local", &NcclFabric::is_local, nb::arg("rank"))
      .def("device_of", &NcclFabric::device_of, nb::arg("rank"))
      .def_prop_ro("lsa_size", &NcclFabric::lsa_size)
      .def_prop_ro("lsa_rank", &NcclFabric::lsa_rank)
      .def_prop_ro("rail_size", &NcclFabric::rail_size)
      .def_prop_ro("rail_rank", &NcclFabric::rail_rank)
      .def_prop_ro("rail_put_path", &NcclFabric::rail_put_path, "'put_signal' (NCCL >= 2.29) or 'send_recv'.")
      .def_prop_ro("probe", [](const NcclFabric& f) {
        nb::dict d;
        for (const auto& [name, v] : f.probe()) d[name.c_str()] = v;
        return d;
      }, "The capability probe every rank agreed on (field -> value).")
      .def_prop_ro("closed", &NcclFabric::closed)
      .def("close", &NcclFabric::close, nb::call_guard<nb::gil_scoped_release>(),
           "Collective teardown: synchronise, deregister the window, ncclMemFree, destroy the rail comm and "
           "the comm. Every rank must call it (the destructor does, logging errors instead of raising).");

  using tide::fabric::NcclRail;
  nb::class_<NcclRail>(m, "NcclRail",
                       "The rail of one local index ([Note: NCCL rail], fabric/nccl.h): an NCCL communicator of the "
                       "ranks with that local index on every node (rail rank = node), on which two-sided programs' "
                       "send/recv groups run. Construction is collective over the rail and pre-connects its peers.")
      .def("__init__", [](NcclRail* self, int rank, int size, int device, const nb::bytes& unique_id, int max_ctas,
                          int channels_per_peer, double timeout_s) {
        add_wheel_candidates();
        const std::string id(unique_id.c_str(), unique_id.size());
        nb::gil_scoped_release release;  // until every rail rank has joined, or timeout_s (> 0) passed
        new (self) NcclRail(rank, size, device, id, max_ctas, channels_per_peer, timeout_s);
      }, nb::arg("rank"), nb::arg("size"), nb::arg("device"), nb::arg("unique_id"), nb::arg("max_ctas") = 2,
         nb::arg("channels_per_peer") = 1, nb::arg("timeout_s") = 0.0)
      .def_prop_ro("rank", &NcclRail::rank)
      .def_prop_ro("size", &NcclRail::size)
      .def_prop_ro("max_ctas", &NcclRail::max_ctas, "The SMs a rail group's kernel may take (ncclConfig_t.maxCTAs).")
      .def_prop_ro("channels_per_peer", &NcclRail::channels_per_peer)
      .def_prop_ro("aborted", [](const NcclRail& r) { return r.aborted(); }, "Why the rail was aborted ('' if not).")
      .def("async_error", &NcclRail::async_error, "ncclCommGetAsyncError as text ('' when none).")
      .def("abort", &NcclRail::abort, nb::arg("why"), nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("closed", &NcclRail::closed)
      .def_prop_ro("groups", &NcclRail::groups, "Send/recv groups enqueued.")
      .def_prop_ro("in_progress_waits", &NcclRail::in_progress_waits,
                   "Groups whose ncclGroupEnd returned ncclInProgress: the caller's thread polled until NCCL "
                   "had issued them (a non-blocking rail).")
      .def_prop_ro("in_progress_wait_s", &NcclRail::in_progress_wait_s, "Seconds the host spent in those polls.")
      .def("close", &NcclRail::close, nb::call_guard<nb::gil_scoped_release>(),
           "ncclCommDestroy: every rail rank, after its last group.");
}
#else
void bind_nccl(nb::module_& m) {
  m.def("nccl_header_version", []() { return 0; }, "0: this build has no NCCL headers.");
  for (const char* name : {"NcclFabric", "NcclRail", "nccl_unique_id", "nccl_version", "nccl_library_path"}) {
    const std::string msg = std::string(name) +
                            ": tide._core was built without NCCL headers (the nvidia.nccl Python package was not "
                            "found at configure time); pip install nvidia-nccl-cu13 and rebuild";
    m.def(name, [msg](nb::args, nb::kwargs) -> nb::object { throw tide::PlanError(msg); });
  }
}
#endif
#endif
