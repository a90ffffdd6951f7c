// Bindings for csrc/exec/cpu: the virtual cluster's arena and executor (numpy buffers).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>

#include "python/bind_common.h"
#include "tide/exec_cpu.h"

namespace nb = nanobind;
using namespace tide;

namespace {
using Bytes = nb::ndarray<nb::c_contig, nb::device::cpu>;

void check_span(const CpuArena& a, int rank, int kind, int64_t offset, int64_t n) {
  TIDE_PLAN_CHECK(rank >= 0 && rank < a.world(), "rank ", rank, " out of range");
  TIDE_PLAN_CHECK(kind >= 4 && kind < kNumBufKinds, "kind ", kind, " is not an arena region");
  TIDE_PLAN_CHECK(offset >= 0 && offset + n <= a.region_bytes(static_cast<BufKind>(kind)),
                  buf_kind_name(static_cast<BufKind>(kind)), " bytes [", offset, ", ", offset + n,
                  ") exceed the region (", a.region_bytes(static_cast<BufKind>(kind)), ")");
}
}  // namespace

void bind_exec(nb::module_& m) {
  nb::class_<CpuArena>(m, "CpuArena")
      .def("__init__", [](CpuArena* self, int world, const ProgramSet& ps, bool shared_memory) {
        TIDE_PLAN_CHECK(!ps.progs.empty(), "CpuArena: empty program set");
        new (self) CpuArena(world, ps.progs[0].arena, shared_memory);
      }, nb::arg("world"), nb::arg("programs"), nb::arg("shared_memory") = false)
      .def_prop_ro("bytes_per_rank", &CpuArena::bytes_per_rank)
      .def_prop_ro("world", &CpuArena::world)
      .def("region_bytes", [](const CpuArena& a, int kind) { return a.region_bytes(static_cast<BufKind>(kind)); })
      .def("counter", [](const CpuArena& a, int rank, int idx) { return a.counters(rank)[idx].load(); })
      .def("read", [](const CpuArena& a, int rank, int kind, int64_t offset, Bytes out) {
        const int64_t n = static_cast<int64_t>(out.nbytes());
        check_span(a, rank, kind, offset, n);
        std::memcpy(out.data(), a.region(rank, static_cast<BufKind>(kind)) + offset, static_cast<size_t>(n));
      }, nb::arg("rank"), nb::arg("kind"), nb::arg("offset"), nb::arg("out"))
      .def("write", [](CpuArena& a, int rank, int kind, int64_t offset, Bytes in) {
        const int64_t n = static_cast<int64_t>(in.nbytes());
        check_span(a, rank, kind, offset, n);
        std::memcpy(a.region(rank, static_cast<BufKind>(kind)) + offset, in.data(), static_cast<size_t>(n));
      }, nb::arg("rank"), nb::arg("kind"), nb::arg("offset"), nb::arg("data"))
      .def("fill", [](CpuArena& a, int rank, int kind, int value) {
        std::memset(a.region(rank, static_cast<BufKind>(kind)), value,
                    static_cast<size_t>(a.region_bytes(static_cast<BufKind>(kind))));
      })
      .def("poke_guard", [](CpuArena& a, int rank) {  // tests: damage a canary
        uint8_t* end = a.region(rank, BufKind::kRing0) - a.spec().offset[static_cast<int>(BufKind::kRing0)] + a.spec().total;
        end[1] ^= 0xff;
      })
      .def("run", [](CpuArena& a, const nb::list& calls, const nb::list& bindings, double timeout_s,
                     int workers, bool processes, int stall_rank, int64_t stall_op, double stall_s,
                     int dead_rank, int64_t dead_op, bool verify_agreement) {
        auto per_rank = calls_from_python(calls);
        for (const auto& rc : per_rank)
          for (const auto& c : rc)
            TIDE_PLAN_CHECK(c.program->arena.total == a.spec().total,
                            "CpuArena.run: a program's arena layout (", c.program->arena.total,
                            " bytes) differs from this arena's (", a.spec().total, ")");
        std::vector<RankBindings> b(static_cast<size_t>(a.world()));
        std::vector<nb::object> keep;
        int r = 0;
        for (auto rank_b : bindings) {
          TIDE_PLAN_CHECK(r < a.world(), "CpuArena.run: more bindings than ranks");
          for (auto item : nb::cast<nb::list>(rank_b)) {
            auto t = nb::cast<nb::tuple>(item);
            Bytes arr = nb::cast<Bytes>(t[2]);
            keep.push_back(nb::borrow(t[2]));
            b[r].bind(static_cast<BufKind>(nb::cast<int>(t[0])), nb::cast<int>(t[1]), arr.data(),
                      static_cast<int64_t>(arr.nbytes()));
          }
          ++r;
        }
        CpuRunOptions o;
        static_cast<ExecutorOptions&>(o) = with_debug_env(ExecutorOptions{});
        o.timeout_s = timeout_s; o.workers = workers; o.processes = processes;
        validate(o);
        o.stall_rank = stall_rank; o.stall_op = stall_op; o.stall_s = stall_s;
        o.dead_rank = dead_rank; o.dead_op = dead_op; o.verify_agreement = verify_agreement;
        o.interrupted = python_interrupt_check();
        nb::gil_scoped_release release;
        run_cpu(a, per_rank, b, o);
      }, nb::arg("calls"), nb::arg("bindings"), nb::arg("timeout_s") = 30.0, nb::arg("workers") = 0,
         nb::arg("processes") = false, nb::arg("stall_rank") = -1, nb::arg("stall_op") = 0,
         nb::arg("stall_s") = 0.0, nb::arg("dead_rank") = -1, nb::arg("dead_op") = 0,
         nb::arg("verify_agreement") = true);

  nb::dict kinds;
  for (int k = 0; k < kNumBufKinds; ++k) kinds[buf_kind_name(static_cast<BufKind>(k))] = k;
  m.attr("buf_kinds") = kinds;
}
