// tide_xla._ffi: exports the TIDE FFI handlers as capsules in one `registrations()` dict.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "tide_ffi.h"
#ifdef TIDE_WITH_CUDA
#include "tide/cuda.h"
#endif

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherHandler);          // all_gather.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterHandler);      // reduce_scatter.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherVirtualHandler);   // all_gather.cc (virtual cluster)
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterVirtualHandler);  // reduce_scatter.cc
#ifdef TIDE_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherCudaHandler);      // all_gather.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterCudaHandler);  // reduce_scatter.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherVirtualCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ReduceScatterVirtualCudaHandler);
#endif

namespace {

namespace xf = tide::xla_ffi;

// The core's dtype names (tide::parse_dtype); the handlers move bfloat16, float16 and float32 only.
tide::DType dtype_named(const std::string& name) {
  const tide::DType t = tide::parse_dtype(name, "dtype");
  TIDE_PLAN_CHECK(t != tide::DType::kU8, "dtype ", name, " is not supported (TIDE moves bfloat16, float16, float32)");
  return t;
}

tide::Collective collective_named(const std::string& op) {
  if (op == "tide_all_gather") return tide::Collective::kAllGather;
  if (op == "tide_reduce_scatter") return tide::Collective::kReduceScatter;
  throw tide::PlanError("unknown collective " + op);
}

// The plan a handler will build for this call, as the trace-time preparation needs it.
std::shared_ptr<const tide::Plan> plan_for(const std::string& op, const std::vector<std::vector<int64_t>>& shapes,
                                           const std::string& in, const std::string& out, int nodes, int gpus,
                                           int mode) {
  TIDE_PLAN_CHECK(mode == 0 || mode == 1, "mode: expected 0 (in_place) or 1 (slot_reuse), got ", mode);
  xf::GroupAttrs a;
  a.nodes = nodes;
  a.gpus_per_node = gpus;
  const tide::GroupSignature sig = tide::group_signature(collective_named(op), shapes, dtype_named(in), dtype_named(out));
  return tide::cached_plan(sig, xf::group_topology(a), static_cast<tide::Mode>(mode));
}

xf::RankStateKey rank_key(const std::string& op, uint64_t plan_hash, uint64_t table, int64_t group, int rank) {
  return {collective_named(op), plan_hash, table, group, rank};
}

template <typename Fn>
nb::capsule encapsulate(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "TIDE XLA FFI handlers (TIDE-AG, TIDE-RS) over the shared C++ core";
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef TIDE_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  // {platform: {target name: handler capsule}}; platform names as jax.ffi.register_ffi_target
  // takes them.
  m.def("registrations", []() {
    nb::dict cpu;
    cpu["tide_all_gather"] = encapsulate(AllGatherHandler);
    cpu["tide_reduce_scatter"] = encapsulate(ReduceScatterHandler);
    cpu["tide_all_gather_virtual"] = encapsulate(AllGatherVirtualHandler);
    cpu["tide_reduce_scatter_virtual"] = encapsulate(ReduceScatterVirtualHandler);
    nb::dict out;
    out["cpu"] = cpu;
#ifdef TIDE_WITH_CUDA
    nb::dict cuda;
    cuda["tide_all_gather"] = encapsulate(AllGatherCudaHandler);
    cuda["tide_reduce_scatter"] = encapsulate(ReduceScatterCudaHandler);
    cuda["tide_all_gather_virtual"] = encapsulate(AllGatherVirtualCudaHandler);
    cuda["tide_reduce_scatter_virtual"] = encapsulate(ReduceScatterVirtualCudaHandler);
    out["CUDA"] = cuda;
#endif
    return out;
  });
  // Ranks across processes (tide_xla/processes.py prepares them at trace time).
  m.def("set_process_index", &xf::set_process_index, nb::arg("process"),
        "This process's jax.distributed index: the device table's key is (process, ordinal).");
  m.def("process_index", &xf::process_index);
  m.def("set_timeout_diagnosis", [](nb::object fn) {
    PyObject* f = fn.release().ptr();  // kept for the process's life: never dropped without the GIL
    xf::set_timeout_diagnosis([f](const std::string& message, int64_t group, int rank,
                                  const std::vector<int64_t>& owners, int64_t timeout_ms) -> std::string {
      if (!Py_IsInitialized()) return "";
      nb::gil_scoped_acquire gil;  // XLA's thread running the handler
      try {
        return nb::cast<std::string>(nb::handle(f)(message, group, rank, owners, timeout_ms));
      } catch (const std::exception&) {  // a diagnosis that fails leaves the timeout as it is
        return "";
      }
    });
  }, nb::arg("fn"), "fn(message, group, rank, owners, timeout_ms) -> str, appended to a cross-process rank's "
     "TimeoutError (the survivors' diagnosis; set once per process).");
  m.def("table_fingerprint", [](const std::vector<int64_t>& table) {
    return xf::table_fingerprint(xf::ffi::Span<const int64_t>(table.data(), table.size()));
  });
  m.def("group_plan", [](const std::string& op, const std::vector<std::vector<int64_t>>& shapes,
                         const std::string& in, const std::string& out, int nodes, int gpus, int mode) {
    const auto plan = plan_for(op, shapes, in, out, nodes, gpus, mode);
    const tide::Collective c = collective_named(op);
    // XLA:CPU's executors (one host) on the rails they run on (one-sided unless TIDE_EXEC_OPTIONS says).
    const tide::Rails rails = xf::rails_in_use(tide::ExecutorOptions{});
    const tide::RankArena segment = xf::group_rank_arena(*plan, c, rails);
    const tide::ArenaSpec arena = xf::group_arena(*plan, c, rails);
    nb::dict regions;
    for (int k = static_cast<int>(tide::BufKind::kRing0); k < tide::kNumBufKinds; ++k)
      if (arena.bytes[k] > 0)
        regions[tide::buf_kind_name(static_cast<tide::BufKind>(k))] = nb::make_tuple(arena.offset[k], arena.bytes[k]);
    regions["counters"] = nb::make_tuple(arena.counters_offset, arena.counters_bytes);
    nb::dict d;
    d["hash"] = plan->hash;
    d["segment_bytes"] = segment.bytes;
    d["arena_bytes"] = arena.total;
    d["arena"] = regions;
    d["rails"] = tide::rails_name(rails);
    d["pull_landing"] = c == tide::Collective::kAllGather && xf::pull_landing(*plan);
    return d;
  }, nb::arg("op"), nb::arg("shapes"), nb::arg("in_dtype"), nb::arg("out_dtype"), nb::arg("nodes"),
        nb::arg("gpus_per_node"), nb::arg("mode"),
        "{'hash', 'segment_bytes', 'arena_bytes', 'arena', 'rails', 'pull_landing'} of the plan the handlers "
        "build for this call on XLA:CPU: the shared-memory segment each rank needs for it across processes, the "
        "arena each rank's state holds in one process ({region: (offset, nbytes)} of the regions with bytes, and "
        "the counters), the rails both are laid out for, and whether TIDE-AG lands in XLA's results by pulling "
        "(no copy-out; its arena then holds the stage and counters only).");
  m.def("has_rank", [](const std::string& op, uint64_t plan_hash, uint64_t table, int64_t group, int rank) {
    return xf::session_states().has(rank_key(op, plan_hash, table, group, rank).key());
  });
  m.def("open_rank", [](const std::string& op, const std::vector<std::vector<int64_t>>& shapes,
                        const std::string& in, const std::string& out, int nodes, int gpus, int mode,
                        uint64_t table, int64_t group, int rank, const std::vector<std::string>& segments,
                        int64_t timeout_ms) {
    const auto plan = plan_for(op, shapes, in, out, nodes, gpus, mode);
    xf::open_rank_state(rank_key(op, plan->hash, table, group, rank), plan, segments, timeout_ms);
  }, nb::arg("op"), nb::arg("shapes"), nb::arg("in_dtype"), nb::arg("out_dtype"), nb::arg("nodes"),
        nb::arg("gpus_per_node"), nb::arg("mode"), nb::arg("table"), nb::arg("group"), nb::arg("rank"),
        nb::arg("segments"), nb::arg("timeout_ms"),
        "Maps every rank's segment for `rank` of `group` and builds its session (idempotent).");
#ifdef TIDE_WITH_CUDA
  // Ranks across processes on CUDA ([Note: CUDA rank states], executor_cuda.cc).
  m.def("create_cuda_rank", [](const std::string& op, const std::vector<std::vector<int64_t>>& shapes,
                               const std::string& in, const std::string& out, int nodes, int gpus, int mode,
                               uint64_t table, int64_t group, int rank, int device, int64_t timeout_ms) {
    const auto plan = plan_for(op, shapes, in, out, nodes, gpus, mode);
    return nb::bytes(xf::create_cuda_rank_state(rank_key(op, plan->hash, table, group, rank), plan, device,
                                                timeout_ms).c_str(), tide::kCudaIpcHandleBytes);
  }, nb::arg("op"), nb::arg("shapes"), nb::arg("in_dtype"), nb::arg("out_dtype"), nb::arg("nodes"),
        nb::arg("gpus_per_node"), nb::arg("mode"), nb::arg("table"), nb::arg("group"), nb::arg("rank"),
        nb::arg("device"), nb::arg("timeout_ms"),
        "Allocates `rank`'s CUDA-IPC arena on local `device` and returns its IPC handle (idempotent until "
        "connected).");
  m.def("connect_cuda_rank", [](const std::string& op, uint64_t plan_hash, uint64_t table, int64_t group, int rank,
                                const std::vector<nb::bytes>& handles, const nb::bytes& rail_id) {
    std::vector<std::string> h;
    for (const nb::bytes& b : handles) h.emplace_back(b.c_str(), b.size());
    const std::string id(rail_id.c_str(), rail_id.size());
    nb::gil_scoped_release release;  // the rail's construction waits for its peers in other processes
    xf::connect_cuda_rank_state(rank_key(op, plan_hash, table, group, rank), h, id);
  }, nb::arg("op"), nb::arg("plan_hash"), nb::arg("table"), nb::arg("group"), nb::arg("rank"), nb::arg("handles"),
        nb::arg("rail_id"),
        "Opens the node's peers (handles[r] per rank, b'' for other nodes) and joins the NCCL rail (rail_id; "
        "several nodes), then builds the rank's session.");
  m.def("device_arena_bytes", [](int device) { return xf::session_states().device_bytes(device); }, nb::arg("device"),
        "Bytes of the TIDE arenas this process allocated on local CUDA device `device` (outside XLA's "
        "allocator).");
  m.def("nccl_unique_id", []() {
    const std::string id = tide::nccl_rail_unique_id();
    return nb::bytes(id.data(), id.size());
  }, "ncclGetUniqueId for a rail (loads NCCL).");
  m.def("nccl_library_candidates", &tide::nccl_library_candidates, nb::arg("paths"),
        "libnccl.so.2 paths tried after the framework's copy and the loader's path.");
#endif
  // [Note: state lifetime] in tide_ffi.h: tide_xla.init opens a mesh's table, tide_xla.release frees its states.
  m.def("open_table", [](uint64_t table) { xf::session_states().open(table); }, nb::arg("table"),
        "Lets TIDE calls on the mesh of this device-table fingerprint build states again (tide_xla.init).");
  m.def("release_table", [](uint64_t table) {
    nb::gil_scoped_release release;  // waits for the states' enqueued work
    return xf::release_table(table);
  }, nb::arg("table"),
        "Frees every state (sessions, executors, arenas) of the mesh of this device-table fingerprint, after "
        "their enqueued work; later calls on it raise until open_table. Returns how many were freed.");
  m.def("live_states", []() {
    const tide::SessionRegistry::Live s = xf::session_states().live();
    nb::dict d;
    d["group_states"] = s.cluster_states;
    d["rank_states"] = s.rank_states;
    d["arena_bytes"] = s.arena_bytes;
    return d;
  }, "{'group_states', 'rank_states', 'arena_bytes'}: the states this process holds and their arenas' bytes "
     "(every device and the host).");
  m.def("handler_stats", []() {
    nb::dict d;
    for (auto c : {tide::Collective::kAllGather, tide::Collective::kReduceScatter}) {
      const xf::HandlerStats st = xf::handler_stats(c);
      d[xf::target_name(c)] = nb::make_tuple(st.calls, st.ns);
    }
    return d;
  }, "{target: (calls, host ns)} inside this process's TIDE handlers since the last reset (XLA's launch threads).");
  m.def("reset_handler_stats", &xf::reset_handler_stats);
  m.def("executor_available", &tide::xla_ffi::executor_available, nb::arg("kind"),
        "True when executor `kind` ('cpu' or 'cuda') can run collectives here: 'cpu' always; 'cuda' when "
        "this module was built with CUDA and a CUDA device is visible.");
  m.def("executor_description", &tide::xla_ffi::executor_description, nb::arg("kind"),
        "The executor that runs `kind`'s calls, or exactly what keeps it from running here.");
}
