// Bindings for the CUDA executors and fabrics in tide._core.cuda (InProcessFabric, IpcFabric,
// ClusterExecutor, RankExecutor) and their inspection helpers in tide._core.testing. Buffers cross
// as integer device addresses; faces wrap them for torch/DLPack.
#ifdef TIDE_WITH_CUDA
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "exec/cuda/call_executors.h"
#include "exec/cuda/enqueue_order.h"  // walk_call
#include "exec/cuda/issue.h"          // build_run_table, level1_sum_shape
#include "fabric/inprocess.h"
#include "fabric/ipc.h"
#ifdef TIDE_WITH_NCCL
#include "fabric/nccl.h"
#endif
#include "python/bind_common.h"

namespace nb = nanobind;
using namespace tide;

namespace {

uint64_t addr(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

// CudaRankExecutor over any fabric of one rank per process (IpcFabric, NcclFabric).
template <typename F>
void init_rank_executor(cuda::CudaRankCallExecutor* self, std::shared_ptr<F> fab, int rank, int nodes,
                        int gpus_per_node, nb::object regions, nb::object timeout_s, bool fence, nb::object options) {
  TIDE_PLAN_CHECK(fab != nullptr, "tide._core.cuda.RankExecutor: fabric is None");
  Topology topo;
  topo.nodes = nodes;
  topo.gpus_per_node = gpus_per_node;
  const RegionTable table = regions.is_none() ? RegionTable{} : regions_from_python(regions);
  new (self) cuda::CudaRankCallExecutor(std::move(fab), rank, topo, table, options_from_python(options, timeout_s), fence);
}

}  // namespace

void bind_cuda_exec(nb::module_& m, nb::module_& testing) {
  m.def("check_device_room", [](int device, int ranks, int64_t arena_bytes, const std::string& who,
                                const std::string& largest) {
    fabric::check_device_room(device, ranks, arena_bytes, who.c_str(), largest);
  }, nb::arg("device"), nb::arg("ranks"), nb::arg("arena_bytes"), nb::arg("who"), nb::arg("largest") = "",
     "PlanError when `ranks` arenas of `arena_bytes` exceed `device`'s free memory (the fabrics check it too; a "
     "face that knows the regions calls it first with `largest`: 'the largest region is ...').");
  nb::class_<fabric::InProcessFabric>(m, "InProcessFabric",
                                      "In-process fabric: one zeroed cudaMalloc arena per rank, peers by device "
                                      "pointer (a virtual cluster on one GPU, or the devices of one process).")
      .def("__init__", [](fabric::InProcessFabric* self, std::vector<int> rank_device, int64_t arena_bytes) {
        new (self) fabric::InProcessFabric(std::move(rank_device), arena_bytes);
      }, nb::arg("rank_device"), nb::arg("arena_bytes"))
      .def_prop_ro("world", &fabric::InProcessFabric::world)
      .def_prop_ro("arena_bytes", &fabric::InProcessFabric::arena_bytes)
      .def("arena_ptr", [](const fabric::InProcessFabric& f, int r) {
        TIDE_PLAN_CHECK(r >= 0 && r < f.world(), "rank ", r);
        return addr(f.arena(r));
      });

  nb::class_<fabric::IpcFabric>(m, "IpcFabric",
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
      .def_prop_ro("arena_ptr", [](const fabric::IpcFabric& f) { return addr(f.arena(f.rank())); },
                   "Device pointer of this rank's arena (the cudaMalloc base).")
      .def("peer_arena_ptr", [](const fabric::IpcFabric& f, int r) {
        TIDE_PLAN_CHECK(r >= 0 && r < f.world(), "IpcFabric.peer_arena_ptr: rank ", r, " is outside [0, ", f.world(),
                        ")");
        return addr(f.arena(r));
      }, nb::arg("rank"), "Rank r's arena as mapped in this process (0 until open_peers).")
      .def("handle", [](const fabric::IpcFabric& f) {
        const std::string h = f.handle();
        return nb::bytes(h.data(), h.size());
      }, "This rank's CUDA IPC handle (64 bytes).")
      .def("open_peers", [](fabric::IpcFabric& f, const nb::list& handles, nb::object same_process) {
        std::vector<std::string> v;
        for (auto h : handles) {
          TIDE_PLAN_CHECK(nb::isinstance<nb::bytes>(h), "IpcFabric.open_peers: handles[", v.size(), "] is not bytes");
          nb::bytes b = nb::borrow<nb::bytes>(h);
          v.emplace_back(b.c_str(), b.size());
        }
        std::vector<const fabric::IpcFabric*> local;
        if (!same_process.is_none())
          for (auto o : same_process) local.push_back(o.is_none() ? nullptr : nb::cast<const fabric::IpcFabric*>(o));
        f.open_peers(v, local);
      }, nb::arg("handles"), nb::arg("same_process") = nb::none(),
         "handles[r]: every rank's handle() (the own entry is ignored; b'': not mapped). same_process[r]: rank r's "
         "IpcFabric when it lives in this process (its arena by pointer; the caller keeps it alive), else None.");

  nb::class_<cuda::CudaClusterCallExecutor, CallExecutor>(
      m, "ClusterExecutor",
      "Every rank of an in-process fabric on CUDA streams (the CUDA virtual cluster, the XLA devices of one "
      "process), as a GroupSession's executor.")
      .def("__init__", [](cuda::CudaClusterCallExecutor* self, std::shared_ptr<fabric::InProcessFabric> f, nb::object options) {
        TIDE_PLAN_CHECK(f != nullptr, "tide._core.cuda.ClusterExecutor: fabric is None");
        new (self) cuda::CudaClusterCallExecutor(std::move(f), options_from_python(options));
      }, nb::arg("fabric"), nb::arg("options") = nb::none())
      .def("stream", [](cuda::CudaClusterCallExecutor& e, int r, int s) { return addr(e.executor().stream(r, s)); },
           nb::arg("rank"), nb::arg("stream"))
      .def("counter_ptr", [](cuda::CudaClusterCallExecutor& e, const ProgramSet& ps, int r, int i) {
        return addr(e.executor().counter_ptr(ps, r, i));
      }, nb::arg("programs"), nb::arg("rank"), nb::arg("index"))
      .def_prop_ro("cached_program_sets", [](cuda::CudaClusterCallExecutor& e) { return e.executor().cached_program_sets(); })
      .def_prop_ro("graph_captures", [](cuda::CudaClusterCallExecutor& e) { return e.executor().graph_captures(); },
                   "calls captured as CUDA graphs ([Note: replayed calls]; ExecutorOptions.graphs)")
      .def_prop_ro("graph_launches", [](cuda::CudaClusterCallExecutor& e) { return e.executor().graph_replays(); },
                   "captured calls launched (each capture's first launch included)")
      .def("run", [](cuda::CudaClusterCallExecutor& ex, std::shared_ptr<ProgramSet> ps, int64_t seq,
                     const nb::list& buffers) {
        TIDE_PLAN_CHECK(ps != nullptr, "ClusterExecutor.run: programs is None");
        std::vector<RankBindings> b;
        for (auto row : buffers) b.push_back(to_rank_bindings(bindings_from_python(row, "ClusterExecutor.run")));
        nb::gil_scoped_release release;
        ex.run(ps, seq, {}, b, {});
      }, nb::arg("programs"), nb::arg("seq"), nb::arg("buffers"),
         "Tests: enqueues call `seq` of a hand-built set on every rank's executor streams (sessions call it "
         "through GroupSession). buffers[r]: [(buf_kind, index, data_ptr, nbytes), ...].")
      .def("set_faults", [](cuda::CudaClusterCallExecutor& e, int dead_rank, int stall_rank, double stall_s) {
        auto& o = e.executor().options();
        o.dead_rank = dead_rank;
        o.stall_rank = stall_rank;
        o.stall_s = stall_s;
      }, nb::arg("dead_rank") = -1, nb::arg("stall_rank") = -1, nb::arg("stall_s") = 0.0,
         "Executor-level fault injection (tests): a dead rank issues nothing; a stalled rank's streams sleep "
         "stall_s before its first op.");

  nb::class_<cuda::CudaRankCallExecutor, CallExecutor>(
      m, "RankExecutor",
      "Runs only `rank`'s TIDE programs on CUDA streams; peers run theirs in their own processes over an "
      "IpcFabric or an NcclFabric.")
      .def("__init__", &init_rank_executor<fabric::IpcFabric>, nb::arg("fabric"), nb::arg("rank"), nb::arg("nodes"),
           nb::arg("gpus_per_node"), nb::arg("regions") = nb::none(), nb::arg("timeout_s") = nb::none(),
           nb::arg("fence") = true, nb::arg("options") = nb::none())
#ifdef TIDE_WITH_NCCL
      .def("__init__", &init_rank_executor<fabric::NcclFabric>, nb::arg("fabric"), nb::arg("rank"), nb::arg("nodes"),
           nb::arg("gpus_per_node"), nb::arg("regions") = nb::none(), nb::arg("timeout_s") = nb::none(),
           nb::arg("fence") = true, nb::arg("options") = nb::none())
#endif
#ifdef TIDE_WITH_NCCL
      .def("set_rail", [](cuda::CudaRankCallExecutor& e, std::shared_ptr<fabric::NcclRail> rail) {
        e.executor().set_rail(std::move(rail));
      }, nb::arg("rail"), "The NcclRail of two-sided programs (options rails='two_sided').")
#endif
      .def_prop_ro("rank", [](cuda::CudaRankCallExecutor& e) { return e.executor().rank(); })
      .def_prop_ro("cached_program_sets", [](cuda::CudaRankCallExecutor& e) { return e.executor().cached_program_sets(); })
      .def_prop_ro("runs_started", [](cuda::CudaRankCallExecutor& e) { return e.executor().runs_started(); })
      .def_prop_ro("arrival_fences", [](cuda::CudaRankCallExecutor& e) { return e.executor().arrival_fences(); },
                   "runs whose entry fence waited for the peers' arrival ([Note: entry fence])")
      .def_prop_ro("graph_captures", [](cuda::CudaRankCallExecutor& e) { return e.executor().graph_captures(); },
                   "calls captured as CUDA graphs ([Note: replayed calls]; ExecutorOptions.graphs)")
      .def_prop_ro("graph_launches", [](cuda::CudaRankCallExecutor& e) { return e.executor().graph_replays(); },
                   "captured calls launched (each capture's first launch included)")
      .def("run", [](cuda::CudaRankCallExecutor& ex, std::shared_ptr<ProgramSet> ps, int64_t seq, const nb::list& buffers,
                     uint64_t stream, nb::object ranks) {
        TIDE_PLAN_CHECK(ps != nullptr, "RankExecutor.run: programs is None");
        RankBindings b = to_rank_bindings(bindings_from_python(buffers, "RankExecutor.run"));
        std::vector<int> members;
        if (!ranks.is_none())
          for (auto r : ranks) members.push_back(nb::cast<int>(r));
        std::vector<uintptr_t> streams{static_cast<uintptr_t>(stream)};
        nb::gil_scoped_release release;
        ex.run(ps, seq, members, {b}, streams);
      }, nb::arg("programs"), nb::arg("seq"), nb::arg("buffers") = nb::list(), nb::arg("stream") = 0,
         nb::arg("ranks") = nb::none(),
         "Tests: enqueues this rank's program of a hand-built set for call `seq` (sessions call it through "
         "GroupSession). buffers: [(buf_kind, index, data_ptr, nbytes), ...]; stream: the caller's cudaStream_t "
         "as int (0: legacy default); ranks: a sub-group's global ranks.");

  m.def("arena_region", [](const ProgramSet& ps, int kind) {
    TIDE_PLAN_CHECK(!ps.progs.empty(), "empty program set");
    TIDE_PLAN_CHECK(kind >= 0 && kind < kNumBufKinds, "kind ", kind);
    const ArenaSpec& a = ps.progs[0].arena;
    return std::make_pair(a.offset[kind], a.bytes[kind]);
  }, nb::arg("programs"), nb::arg("kind"), "(offset, bytes) of an arena region in a set's layout.");

  testing.def("mixed_programs", [](const ProgramSet& a, const ProgramSet& b, int rank) {
    auto ps = std::make_shared<ProgramSet>(a);
    TIDE_PLAN_CHECK(rank >= 0 && static_cast<size_t>(rank) < ps->progs.size() && static_cast<size_t>(rank) < b.progs.size(),
                    "rank ", rank);
    ps->progs[static_cast<size_t>(rank)] = b.progs[static_cast<size_t>(rank)];
    return ps;
  }, nb::arg("a"), nb::arg("b"), nb::arg("rank"), "FaultKind other_plan: set `a` with rank's program taken from `b`.");
  testing.def("run_table", [](const ProgramSet& ps, int rank, int op) {
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
    nb::object level1 = nb::none(), segments = nb::none();
    if (is_sum && l1.n_staged >= 0) {
      level1 = nb::cast(staged);
      std::vector<std::tuple<int64_t, int64_t, int64_t, int>> rows;
      for (const auto& g : segs) rows.emplace_back(g.dst_off, g.len, g.src_off, g.param);
      segments = nb::cast(rows);
    }
    // What each slot of the table stands for, by the executors' slot convention (kernels.h).
    nb::dict slot_of;
    for (const auto& r : t)
      for (int k = 0; k < info.n_terms; ++k) {
        const int sl = r.slot[k];
        if (sl < 0 || slot_of.contains(sl)) continue;
        if (sl < cuda::kMaxGradPtrs) slot_of[nb::int_(sl)] = nb::make_tuple("grad", sl);
        else if (sl == cuda::kSlotOut) slot_of[nb::int_(sl)] = nb::make_tuple("out");
        else slot_of[nb::int_(sl)] = nb::make_tuple("arena", sl - cuda::kSlotArena0);
      }
    return std::make_tuple(info.n, info.n_terms, info.fp32_terms, runs, pieces, level1, segments, slot_of);
  }, nb::arg("programs"), nb::arg("rank"), nb::arg("op"),
     "The REDUCE run table of one SUM/LAND op as the executors build it: (n, n_terms, fp32 mask, [(dst_off, "
     "len, slots, byte offsets)], [(term, dst_elem, elems, src kind, src rank, src index, src offset, item "
     "size)], level1, segments, slots) where slots maps each slot to what it stands for: ('grad', p) the "
     "rank's gradient p, ('out',) its output, ('arena', r) group rank r's arena; and where, when the executors run the op as kernels.cu's Level-1 SUM, level1 is "
     "[(slot, byte offset of element 0)] per staged slice and segments its SUM segment table [(dst_off, len, "
     "src_off, param)] (cuda.sum_segments' rows), else both None. Host only.");
  testing.def("enqueue_orders", [](const ProgramSet& ps, std::vector<int> local_ranks, std::vector<int64_t> seqs) {
    // The issue path's walk ([Note: enqueue order]) and its recorded replay ([Note: replayed
    // enqueue order]) side by side over calls `seqs`, each on its own counter mirror, bumps
    // simulated as the issue path advances them.
    const std::vector<Program>& progs = ps.progs;
    const size_t n = progs.size();
    const auto index = ps.index();
    std::vector<std::vector<int>> producer(n);
    for (size_t r = 0; r < n; ++r)
      for (const auto& p : index->producer[r]) producer[r].push_back(p.rank);
    std::vector<char> local(n, local_ranks.empty() ? 1 : 0);
    for (int r : local_ranks) local.at(static_cast<size_t>(r)) = 1;
    cuda::OrderInput in;
    in.programs = &progs;
    in.stream_ops = &index->stream_ops;
    in.producer = &producer;
    in.local = &local;
    std::vector<std::vector<uint64_t>> mw(n), mr(n);
    for (size_t r = 0; r < n; ++r) {
      mw[r].assign(static_cast<size_t>(progs[r].num_counters), 0);
      mr[r].assign(static_cast<size_t>(progs[r].num_counters), 0);
    }
    auto ptrs = [&](std::vector<std::vector<uint64_t>>& m) {
      std::vector<uint64_t*> v;
      for (auto& x : m) v.push_back(x.data());
      return v;
    };
    cuda::OrderRecord record;
    nb::list out;
    for (int64_t seq : seqs) {
      using Step = std::tuple<int, int, int, int>;
      auto run = [&](std::vector<std::vector<uint64_t>>& m, cuda::OrderRecord* rec, std::vector<Step>& order) {
        std::vector<uint64_t*> mp = ptrs(m);
        auto visit = [&](int r, int s, size_t k, size_t end) {
          order.emplace_back(r, s, static_cast<int>(k), static_cast<int>(end));
          const auto& ops = index->stream_ops[static_cast<size_t>(r)][static_cast<size_t>(s)];
          for (size_t q = k; q < end; ++q) {
            const Op& op = progs[static_cast<size_t>(r)].ops[static_cast<size_t>(ops[q])];
            const bool arrives = op.kind == OpKind::kRecv && op.counter.index >= 0;
            if (!arrives && !cuda::bumps(op.kind)) continue;
            uint64_t& c = m[static_cast<size_t>(op.counter.rank)][static_cast<size_t>(op.counter.index)];
            c = cuda::advanced(op, seq, c);
          }
        };
        return cuda::walk_call(in, seq, mp.data(), visit, rec);
      };
      std::vector<Step> walked, replayed;
      const cuda::WalkResult a = run(mw, nullptr, walked);
      const cuda::WalkResult b = run(mr, &record, replayed);
      nb::dict d;
      d["seq"] = seq;
      d["walk"] = walked;
      d["replay"] = replayed;
      d["stalled"] = nb::make_tuple(a.stalled, b.stalled);
      d["trusted_remote"] = nb::make_tuple(a.trusted_remote, b.trusted_remote);
      d["replayed_steps"] = b.replayed;
      d["deviated"] = b.deviated;
      d["record_steps"] = record.valid ? static_cast<int64_t>(record.steps.size()) : -1;
      d["mirrors_equal"] = mw == mr;
      out.append(d);
    }
    return out;
  }, nb::arg("programs"), nb::arg("local_ranks"), nb::arg("seqs"),
     "The CUDA issue path's enqueue order (host only): per call of `seqs`, a dict with the walk's visits "
     "[(rank, stream, k, end)] ('walk'), the same call through the set's recorded walk ('replay'), "
     "(stalled, stalled) and (trusted_remote, trusted_remote) of both, replayed_steps and deviated of the "
     "replay, record_steps (-1: no record) and mirrors_equal. local_ranks: the executor's ranks (empty: all).");
  testing.def("issue_turns_orders", [](const ProgramSet& ps, std::vector<int> ranks, std::vector<int64_t> seqs,
                                       bool gate, std::vector<double> delay_s, double deadline_s) {
    // [Note: same-process issue gate] on the host: one thread per rank of `ranks` (the ranks of
    // one process, each its own rank executor's view: its own mirror and recorded walk) runs
    // calls `seqs` through the issue path's steps (the entry, the fence waits, the walk) and
    // logs each step when it is "enqueued": waits and counter writes join a pending batch that a
    // later non-memop step, a turn handed on or the call's end enqueues, as issue.cc's Call does.
    const std::vector<Program>& progs = ps.progs;
    const size_t n = progs.size();
    const auto index = ps.index();
    std::vector<std::vector<int>> producer(n);
    for (size_t r = 0; r < n; ++r)
      for (const auto& p : index->producer[r]) producer[r].push_back(p.rank);
    std::vector<int> sorted = ranks;
    std::sort(sorted.begin(), sorted.end());
    auto board = std::make_shared<fabric::IssueBoard>();
    if (gate)
      for (int r : sorted) board->join(r);
    using Step = std::tuple<int64_t, std::string, int, int, int, int>;  // seq, phase, rank, stream, k, end
    std::vector<Step> log;
    std::mutex log_mu;
    std::vector<std::string> errors(ranks.size());
    auto rank_thread = [&](size_t i) {
      const int me = ranks[i];
      std::vector<char> local(n, 0);
      local.at(static_cast<size_t>(me)) = 1;
      cuda::OrderInput in;
      in.programs = &progs;
      in.stream_ops = &index->stream_ops;
      in.producer = &producer;
      in.local = &local;
      std::vector<std::vector<uint64_t>> m(n);
      for (size_t r = 0; r < n; ++r) m[r].assign(static_cast<size_t>(progs[r].num_counters), 0);
      std::vector<uint64_t*> mp;
      for (auto& x : m) mp.push_back(x.data());
      cuda::OrderRecord record;
      try {
        for (int64_t seq : seqs) {
          std::this_thread::sleep_for(std::chrono::duration<double>(delay_s.at(i)));
          std::unique_ptr<fabric::IssueTurns> t;
          if (gate) t = std::make_unique<fabric::IssueTurns>(*board, sorted, me, deadline_s, TIDE_STR_CAT("seq ", seq));
          std::vector<Step> pending;
          auto flush = [&] {
            std::lock_guard<std::mutex> g(log_mu);
            log.insert(log.end(), pending.begin(), pending.end());
            pending.clear();
          };
          auto enqueue = [&](Step st, bool memop) {
            if (!memop) flush();
            pending.push_back(std::move(st));
            if (!memop) flush();
          };
          for (const char* phase : {"entry", "fence"}) {
            for (int r : sorted) {
              if (r != me) {
                if (t) t->peer(r, flush);
                continue;
              }
              if (t) t->own();
              enqueue(Step{seq, phase, me, 0, 0, 0}, false);
            }
          }
          auto visit = [&](int r, int st, size_t k, size_t end) {
            const auto& ops = index->stream_ops[static_cast<size_t>(r)][static_cast<size_t>(st)];
            const Op& first = progs[static_cast<size_t>(r)].ops[static_cast<size_t>(ops[k])];
            const bool mine = r == me, here = std::binary_search(sorted.begin(), sorted.end(), r);
            if (t && here) {
              if (mine) t->own();
              else t->peer(r, flush);
            }
            if (mine)
              enqueue(Step{seq, "op", r, st, static_cast<int>(k), static_cast<int>(end)},
                      !is_rail_op(first) && (cuda::is_wait(first.kind) || cuda::bumps(first.kind)) &&
                          first.kind != OpKind::kPut);
            for (size_t q = k; q < end; ++q) {
              const Op& op = progs[static_cast<size_t>(r)].ops[static_cast<size_t>(ops[q])];
              const bool arrives = op.kind == OpKind::kRecv && op.counter.index >= 0;
              if (!arrives && !cuda::bumps(op.kind)) continue;
              uint64_t& c = m[static_cast<size_t>(op.counter.rank)][static_cast<size_t>(op.counter.index)];
              c = cuda::advanced(op, seq, c);
            }
          };
          cuda::walk_call(in, seq, mp.data(), visit, &record);
          flush();
          if (t) t->finish([] {});
        }
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    };
    {
      nb::gil_scoped_release release;
      std::vector<std::thread> threads;
      for (size_t i = 0; i < ranks.size(); ++i)
        if (delay_s.at(i) >= 0) threads.emplace_back(rank_thread, i);
      for (auto& th : threads) th.join();
    }
    return std::make_pair(log, errors);
  }, nb::arg("programs"), nb::arg("ranks"), nb::arg("seqs"), nb::arg("gate"), nb::arg("delay_s"),
     nb::arg("deadline_s") = 5.0,
     "The same-process issue gate on the host: threads of ranks `ranks` (one process's) run calls `seqs` "
     "through the issue path's steps, each sleeping delay_s[i] before each call (< 0: that rank's thread never "
     "runs); returns (the steps in the order they were enqueued [(seq, 'entry'|'fence'|'op', rank, stream, k, "
     "end)], each thread's error text or ''). gate: the ranks take turns on one IssueBoard (deadline_s each).");
  testing.def("run_table_fp16", [](const ProgramSet& ps, int rank, int op) {
    std::vector<cuda::ReduceRun> t;
    const auto info = cuda::build_run_table(ps.progs, rank, op, t);
    std::vector<cuda::SumSegment> segs;
    const cuda::Level1Sum l1 = cuda::level1_sum_shape(info, t, segs);
    return std::make_tuple(info.fp16_terms, l1.n_staged >= 0 && l1.fp16);
  }, nb::arg("programs"), nb::arg("rank"), nb::arg("op"),
     "The fp16 side of testing.run_table: (fp16 mask: bit i, term i reads fp16; whether the executors run "
     "the op as kernels.cu's Level-1 SUM in its fp16 form). Host only.");
}
#endif
