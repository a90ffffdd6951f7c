// Bindings for the CUDA executor and the in-process and CUDA-IPC fabrics (owner: CUDA executor).
// Buffers cross as integer device addresses; tide/cluster_cuda.py wraps them for torch/DLPack.
#ifdef TIDE_WITH_CUDA
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <tuple>
#include <vector>

#include "exec/cuda/executor.h"
#include "exec/cuda/rank_executor.h"
#include "fabric/inprocess.h"
#include "fabric/ipc.h"
#ifdef TIDE_WITH_NCCL
#include "fabric/nccl.h"
#endif
#include "python/bind_common.h"

namespace nb = nanobind;
using namespace tide;

namespace {
// (kind, index, address) per user buffer of one rank.
using BindList = std::vector<std::tuple<int, int, uint64_t>>;

cuda::RankBuffers to_buffers(const BindList& l) {
  cuda::RankBuffers b;
  auto put = [](std::vector<void*>& v, int i, void* p) {
    TIDE_PLAN_CHECK(i >= 0, "buffer index ", i);
    if (v.size() <= static_cast<size_t>(i)) v.resize(static_cast<size_t>(i) + 1, nullptr);
    v[static_cast<size_t>(i)] = p;
  };
  for (auto& [kind, index, addr] : l) {
    void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(addr));
    switch (static_cast<BufKind>(kind)) {
      case BufKind::kShard: put(b.shard, index, p); break;
      case BufKind::kLanding: if (index < 0) b.landing = p; else put(b.landing_p, index, p); break;
      case BufKind::kGrad: put(b.grad, index, p); break;
      case BufKind::kOut: b.out = p; break;
      default: throw PlanError(TIDE_STR_CAT("binding kind ", kind, " is not a user buffer"));
    }
  }
  return b;
}

// [(kind, index, data_ptr, nbytes), ...] -> one rank's buffers with their sizes.
cuda::RankBuffers rank_buffers(const nb::list& l) {
  BindList v;
  std::vector<int64_t> sizes;
  for (auto item : l) {
    nb::sequence t = nb::borrow<nb::sequence>(item);
    TIDE_PLAN_CHECK(nb::len(t) == 4, "CudaRankExecutor.run: buffers are (kind, index, data_ptr, nbytes)");
    const int kind = nb::cast<int>(t[0]);
    TIDE_PLAN_CHECK(kind >= 0 && kind < 4, "CudaRankExecutor.run: kind ", kind, " is not a user buffer");
    const int64_t nbytes = nb::cast<int64_t>(t[3]);
    TIDE_PLAN_CHECK(nbytes >= 0, "CudaRankExecutor.run: buffer (kind ", kind, ", index ", nb::cast<int>(t[1]),
                    ") has negative nbytes ", nbytes);
    v.emplace_back(kind, nb::cast<int>(t[1]), nb::cast<uint64_t>(t[2]));
    sizes.push_back(nbytes);
  }
  cuda::RankBuffers b = to_buffers(v);
  for (size_t i = 0; i < v.size(); ++i) {
    const int kind = std::get<0>(v[i]);
    const int index = kind == static_cast<int>(BufKind::kOut) ? -1 : std::get<1>(v[i]);
    b.bytes[{kind, index}] = sizes[i];
  }
  return b;
}

// CudaRankExecutor over any fabric of one rank per process (CudaIpcFabric, NcclFabric).
template <typename F>
void init_rank_executor(cuda::CudaRankExecutor* self, std::shared_ptr<F> fab, int rank, int nodes, int gpus_per_node,
                        nb::object regions, double timeout_s, bool fence, int sum_ctas, int land_ctas) {
  TIDE_PLAN_CHECK(fab != nullptr, "CudaRankExecutor: fabric is None");
  Topology topo;
  topo.nodes = nodes;
  topo.gpus_per_node = gpus_per_node;
  const RegionTable table = regions.is_none() ? RegionTable{} : regions_from_python(regions);
  cuda::ExecOptions o;
  o.timeout_s = timeout_s;
  o.sum_ctas = sum_ctas;
  o.land_ctas = land_ctas;
  new (self) cuda::CudaRankExecutor(std::move(fab), rank, topo, table, o, fence);
}
}  // namespace

void bind_cuda_exec(nb::module_& m) {
  nb::class_<fabric::InProcessFabric>(m, "CudaFabric")
      .def("__init__", [](fabric::InProcessFabric* self, std::vector<int> rank_device, int64_t arena_bytes) {
        new (self) fabric::InProcessFabric(std::move(rank_device), arena_bytes);
      }, nb::arg("rank_device"), nb::arg("arena_bytes"),
         "In-process fabric: one zeroed cudaMalloc arena per rank, peers by device pointer.")
      .def_prop_ro("world", &fabric::InProcessFabric::world)
      .def_prop_ro("arena_bytes", &fabric::InProcessFabric::arena_bytes)
      .def("arena_ptr", [](const fabric::InProcessFabric& f, int r) {
        TIDE_PLAN_CHECK(r >= 0 && r < f.world(), "rank ", r);
        return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(f.arena(r)));
      });

  m.def("cuda_arena_region", [](const ProgramSet& ps, int kind) {
    TIDE_PLAN_CHECK(!ps.progs.empty(), "empty program set");
    TIDE_PLAN_CHECK(kind >= 0 && kind < kNumBufKinds, "kind ", kind);
    const ArenaSpec& a = ps.progs[0].arena;
    return std::make_pair(a.offset[kind], a.bytes[kind]);
  }, nb::arg("programs"), nb::arg("kind"), "(offset, bytes) of an arena region.");
  m.def("cuda_mixed_programs", [](const ProgramSet& a, const ProgramSet& b, int rank) {
    auto ps = std::make_shared<ProgramSet>(a);
    TIDE_PLAN_CHECK(rank >= 0 && static_cast<size_t>(rank) < ps->progs.size() && static_cast<size_t>(rank) < b.progs.size(),
                    "rank ", rank);
    ps->progs[static_cast<size_t>(rank)] = b.progs[static_cast<size_t>(rank)];
    return ps;
  }, nb::arg("a"), nb::arg("b"), nb::arg("rank"),
     "Tests (FaultKind other_plan): set `a` with rank's program taken from set `b`.");
  m.def("cuda_run_table", [](const ProgramSet& ps, int rank, int op) {
    std::vector<cuda::ReduceRun> t;
    const auto info = cuda::build_run_table(ps.progs, rank, op, t);
    std::vector<std::tuple<int64_t, int64_t, std::vector<int>, std::vector<int64_t>>> runs;
    for (const auto& r : t) {
      std::vector<int> slot(static_cast<size_t>(info.n_terms));
      std::vector<int64_t> off(static_cast<size_t>(info.n_terms));
      for (int k = 0; k < info.n_terms; ++k) { slot[k] = r.slot[k]; off[k] = r.off[k]; }
      runs.emplace_back(r.dst_off, r.len, slot, off);
    }
    std::vector<std::tuple<int, int64_t, int64_t, int, int, int, int64_t, int>> pieces;
    for (const auto& t : ps.progs.at(static_cast<size_t>(rank)).ops.at(static_cast<size_t>(op)).terms)
      pieces.emplace_back(t.term, t.dst_elem, t.elems, static_cast<int>(t.src.kind), t.src.rank, t.src.index,
                          t.src.offset, dtype_size(t.dtype));
    std::vector<cuda::SumSegment> segs;
    const cuda::Level1Sum l1 = cuda::level1_sum_shape(info, t, segs);
    std::vector<std::pair<int, int64_t>> staged;
    for (int j = 0; j < l1.n_staged; ++j) staged.emplace_back(l1.staged_slot[j], l1.staged_off[j]);
    const bool is_sum = ps.progs.at(static_cast<size_t>(rank)).ops.at(static_cast<size_t>(op)).kind == OpKind::kSum;
    nb::object level1 = nb::none();
    if (is_sum && l1.n_staged >= 0) level1 = nb::cast(staged);
    return std::make_tuple(info.n, info.n_terms, info.fp32_terms, runs, pieces, level1);
  }, nb::arg("programs"), nb::arg("rank"), nb::arg("op"),
     "Tests: the REDUCE run table of one SUM/LAND op: (n, n_terms, fp32 mask, [(dst_off, len, "
     "slots, byte offsets)], [(term, dst_elem, elems, src kind, src rank, src index, src offset, "
     "item size)], level1) where level1 is [(slot, byte offset of element 0)] per staged slice when "
     "the executors run the op as kernels.cu's Level-1 SUM, else None. Host only.");
  m.def("cuda_arena_total", [](const ProgramSet& ps) { return ps.progs.at(0).arena.total; });

  nb::class_<cuda::CudaExecutor>(m, "CudaExecutor")
      .def("__init__", [](cuda::CudaExecutor* self, std::shared_ptr<fabric::InProcessFabric> f,
                          const ProgramSet& ps, double timeout_s, int sum_ctas, int land_ctas) {
        ps.require_built("CudaExecutor");
        cuda::ExecOptions o;
        o.timeout_s = timeout_s;
        o.sum_ctas = sum_ctas;
        o.land_ctas = land_ctas;
        new (self) cuda::CudaExecutor(std::move(f), ps.progs, o);
      }, nb::arg("fabric"), nb::arg("programs"), nb::arg("timeout_s") = 30.0, nb::arg("sum_ctas") = 16,
         nb::arg("land_ctas") = 4)
      .def("run", [](cuda::CudaExecutor& e, int64_t seq, const std::vector<BindList>& bindings) {
        std::vector<cuda::RankBuffers> b;
        for (const auto& l : bindings) b.push_back(to_buffers(l));
        e.run(seq, b);
      }, nb::arg("seq"), nb::arg("bindings"), "Enqueue call `seq` of every rank (returns at once).")
      .def("synchronize", &cuda::CudaExecutor::synchronize, nb::call_guard<nb::gil_scoped_release>())
      .def("stream", [](const cuda::CudaExecutor& e, int r, int s) {
        return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(e.stream(r, s)));
      })
      .def("counter_ptr", [](const cuda::CudaExecutor& e, int r, int i) {
        return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(e.counter_ptr(r, i)));
      })
      .def("set_faults", [](cuda::CudaExecutor& e, int dead_rank, int stall_rank, double stall_s) {
        e.options().dead_rank = dead_rank;
        e.options().stall_rank = stall_rank;
        e.options().stall_s = stall_s;
      }, nb::arg("dead_rank") = -1, nb::arg("stall_rank") = -1, nb::arg("stall_s") = 0.0,
         "Executor-level fault injection (tests): a dead rank issues nothing; a stalled rank's "
         "first stream sleeps stall_s before its first op.");

  nb::class_<fabric::IpcFabric>(m, "CudaIpcFabric",
                                "CUDA-IPC fabric of one rank per process: this rank's zeroed cudaMalloc arena, "
                                "exported as a 64-byte IPC handle; peers' arenas opened from their handles.")
      .def("__init__", [](fabric::IpcFabric* self, int rank, int world, int device, int64_t arena_bytes) {
        new (self) fabric::IpcFabric(rank, world, device, arena_bytes);
      }, nb::arg("rank"), nb::arg("world"), nb::arg("device"), nb::arg("arena_bytes"))
      .def_prop_ro("rank", &fabric::IpcFabric::rank)
      .def_prop_ro("world", &fabric::IpcFabric::world)
      .def_prop_ro("device", &fabric::IpcFabric::device)
      .def_prop_ro("arena_bytes", &fabric::IpcFabric::arena_bytes)
      .def_prop_ro("peers_open", &fabric::IpcFabric::peers_open)
      .def_prop_ro("arena_ptr", [](const fabric::IpcFabric& f) {
        return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(f.arena(f.rank())));
      }, "Device pointer of this rank's arena (the cudaMalloc base).")
      .def("peer_arena_ptr", [](const fabric::IpcFabric& f, int r) {
        TIDE_PLAN_CHECK(r >= 0 && r < f.world(), "CudaIpcFabric.peer_arena_ptr: rank ", r, " is outside [0, ",
                        f.world(), ")");
        return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(f.arena(r)));
      }, nb::arg("rank"), "Rank r's arena as mapped in this process (0 until open_peers).")
      .def("handle", [](const fabric::IpcFabric& f) {
        const std::string h = f.handle();
        return nb::bytes(h.data(), h.size());
      }, "This rank's CUDA IPC handle (64 bytes).")
      .def("open_peers", [](fabric::IpcFabric& f, const nb::list& handles) {
        std::vector<std::string> v;
        for (auto h : handles) {
          TIDE_PLAN_CHECK(nb::isinstance<nb::bytes>(h), "CudaIpcFabric.open_peers: handles[", v.size(),
                          "] is not bytes");
          nb::bytes b = nb::borrow<nb::bytes>(h);
          v.emplace_back(b.c_str(), b.size());
        }
        f.open_peers(v);
      }, nb::arg("handles"), "handles[r]: every rank's handle() (the own entry is ignored).");

  nb::class_<cuda::CudaRankExecutor>(m, "CudaRankExecutor",
                                     "Runs only `rank`'s TIDE programs on CUDA streams; peers run theirs in their own "
                                     "processes over a CudaIpcFabric or an NcclFabric.")
      .def("__init__", &init_rank_executor<fabric::IpcFabric>, nb::arg("fabric"), nb::arg("rank"), nb::arg("nodes"),
           nb::arg("gpus_per_node"), nb::arg("regions") = nb::none(), nb::arg("timeout_s") = 30.0,
           nb::arg("fence") = true, nb::arg("sum_ctas") = 16, nb::arg("land_ctas") = 4)
#ifdef TIDE_WITH_NCCL
      .def("__init__", &init_rank_executor<fabric::NcclFabric>, nb::arg("fabric"), nb::arg("rank"), nb::arg("nodes"),
           nb::arg("gpus_per_node"), nb::arg("regions") = nb::none(), nb::arg("timeout_s") = 30.0,
           nb::arg("fence") = true, nb::arg("sum_ctas") = 16, nb::arg("land_ctas") = 4)
#endif
      .def_prop_ro("rank", &cuda::CudaRankExecutor::rank)
      .def_prop_ro("world", &cuda::CudaRankExecutor::world)
      .def_prop_ro("cached_program_sets", &cuda::CudaRankExecutor::cached_program_sets)
      .def_prop_ro("runs_started", &cuda::CudaRankExecutor::runs_started)
      .def("run", [](cuda::CudaRankExecutor& ex, std::shared_ptr<ProgramSet> ps, int64_t seq, const nb::list& buffers,
                     uint64_t stream, nb::object ranks) {
        TIDE_PLAN_CHECK(ps != nullptr, "CudaRankExecutor.run: programs is None");
        ps->require_built("CudaRankExecutor.run");
        cuda::RankBuffers b = rank_buffers(buffers);
        std::vector<int> members;
        if (!ranks.is_none())
          for (auto r : ranks) members.push_back(nb::cast<int>(r));
        std::shared_ptr<const std::vector<Program>> progs(ps, &ps->progs);  // shares the set's identity
        const bool bound = ps->arena_bound;
        nb::gil_scoped_release release;
        ex.run(progs, ps->version, bound, seq, b, reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)),
               ranks.is_none() ? nullptr : &members);
      }, nb::arg("programs"), nb::arg("seq"), nb::arg("buffers") = nb::list(), nb::arg("stream") = 0,
         nb::arg("ranks") = nb::none(),
         "Enqueues this rank's program of `programs` for call `seq` and returns without host-synchronising. "
         "buffers: [(buf_kind, index, data_ptr, nbytes), ...]; stream: the caller's cudaStream_t as int (0: "
         "legacy default) -- the call waits for its prior work and it waits for the call; ranks: a sub-group's "
         "global ranks (group rank i = ranks[i]).")
      .def("synchronize", &cuda::CudaRankExecutor::synchronize, nb::call_guard<nb::gil_scoped_release>(),
           "Waits for everything enqueued; raises tide.TimeoutError (rank, op, seq) after a timeout.");
}
#endif
