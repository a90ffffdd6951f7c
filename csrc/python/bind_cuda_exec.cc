// Bindings for the CUDA executor and the in-process fabric (owner: CUDA executor).
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
#include "fabric/inprocess.h"
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
    return std::make_tuple(info.n, info.n_terms, info.fp32_terms, runs, pieces);
  }, nb::arg("programs"), nb::arg("rank"), nb::arg("op"),
     "Tests: the REDUCE run table of one SUM/LAND op: (n, n_terms, fp32 mask, [(dst_off, len, "
     "slots, byte offsets)], [(term, dst_elem, elems, src kind, src rank, src index, src offset, "
     "item size)]). Host only.");
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
}
#endif
