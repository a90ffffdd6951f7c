// CPU executor driver: run_cpu runs every rank of a virtual cluster over one CpuArena, the ranks
// as worker threads or as processes it forks, each stepping its ranks with the op interpreter
// (step_ranks, interpreter.cc); and the call-wide failure state both modes share (the first
// error, the abort flag, Ctrl-C). Contract in tide/exec_cpu.h.
#include <sys/mman.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <csignal>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "exec/cpu/internal.h"
#include "exec/cpu/staging_canary.h"
#include "tide/exec_cpu.h"
#include "tide/plan.h"

namespace tide {

// [Note: interrupting a call] The calling thread polls opt.interrupted (Python's signal check)
// while the ranks run: run_polled's wait with ranks as threads or processes, a RankExecutor's
// own step loop (it runs on the calling thread) when it idles. On true it claims the call's error (so no rank's later timeout replaces
// it), raises the arena's abort flag, which every rank's step loop reads (threads and forked
// processes alike: it lives in the shared arena), and the call throws Interrupted once the ranks
// have stopped; a rank process that does not stop within a second is killed.
constexpr int kInterrupted = 3;  // Shared::error_kind of an interrupted call
bool poll_interrupt(CpuArena::Shared* sh, const CpuRunOptions& opt, bool& interrupted) {
  if (interrupted || !opt.interrupted || !opt.interrupted()) return interrupted;
  int expected = 0;
  if (sh->claimed.compare_exchange_strong(expected, 1)) {
    std::snprintf(sh->message, sizeof(sh->message), "%s",
                  "interrupted: the caller stopped the call while its ranks ran (every rank stopped; "
                  "the call's outputs are undefined)");
    sh->error_kind.store(kInterrupted);
  }
  sh->abort.store(1);
  return interrupted = true;
}

// Runs work(0) .. work(workers - 1) on threads of their own while the calling thread polls
// opt.interrupted; returns when every worker is done. A worker's exception that no rank recorded
// in Shared (Runner::fail records the call's first failure) is rethrown here; recorded ones are
// the caller's rethrow_shared.
static void run_polled(CpuArena::Shared* sh, const CpuRunOptions& opt, int workers,
                       const std::function<void(int)>& work) {
  int running = workers;  // under mu; the last worker out wakes the polling caller
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr first;  // a worker's exception that Runner::fail did not record in Shared
  std::vector<std::thread> threads;
  // Every started worker is joined on every path: a thread that fails to start, or an
  // interrupt check that throws, first stops the call's ranks (abort) and joins them, never
  // leaving a joinable thread behind (std::terminate).
  auto join_all = [&] {
    for (auto& t : threads)
      if (t.joinable()) t.join();
  };
  try {
    for (int w = 0; w < workers; ++w)
      threads.emplace_back([&, w] {
        std::exception_ptr e;
        try { work(w); } catch (...) { e = std::current_exception(); }
        std::lock_guard<std::mutex> lk(mu);
        if (e && !first) first = e;
        if (--running == 0) cv.notify_all();
      });
    bool interrupted = false;
    if (opt.interrupted) {
      std::unique_lock<std::mutex> lk(mu);
      while (!cv.wait_for(lk, std::chrono::milliseconds(20), [&] { return running == 0; })) {
        lk.unlock();
        poll_interrupt(sh, opt, interrupted);
        lk.lock();
      }
    }
  } catch (...) {
    sh->abort.store(1);
    join_all();
    throw;
  }
  join_all();
  if (first && !sh->claimed.load()) std::rethrow_exception(first);  // the call must not look successful
}

void rethrow_shared(CpuArena::Shared* sh) {
  if (!sh->claimed.load()) return;
  std::string msg(sh->message);
  if (sh->error_kind.load() == 2) throw TimeoutError(msg);
  if (sh->error_kind.load() == kInterrupted) throw Interrupted(msg);
  throw Error(msg);
}

// The run's staging canary, sized from its calls: the staging slots their ops name (every slot
// a plan may have for generated calls, which have no op tables) and a node's ranks as the pushers
// per slot. None when no call touches staging.
static std::unique_ptr<StagingCanary> make_canary(const std::vector<std::vector<Call>>& per_rank, int world) {
  int slots = 0, pushers = 1;
  for (const auto& calls : per_rank)
    for (const Call& call : calls) {
      pushers = std::max(pushers, call.program->topo.gpus_per_node);
      if (call.generator) {
        slots = kMaxStagingSlots;
        continue;
      }
      for (const Op& op : call.program->ops) {
        for (const auto& cd : op.copies)
          if (cd.dst.kind == BufKind::kStaging) slots = std::max(slots, cd.dst.index + 1);
        for (const auto& t : op.terms)
          if (t.src.kind == BufKind::kStaging) slots = std::max(slots, t.src.index + 1);
      }
    }
  if (slots <= 0) return nullptr;
  return std::make_unique<StagingCanary>(world, slots, std::min(world, pushers));
}

void run_cpu(CpuArena& arena, const std::vector<std::vector<Call>>& per_rank,
             std::vector<RankBindings>& bindings, const CpuRunOptions& opt) {
  const int N = arena.world();
  TIDE_PLAN_CHECK(static_cast<int>(per_rank.size()) == N, "run_cpu: ", per_rank.size(), " call lists for ", N, " ranks");
  TIDE_PLAN_CHECK(static_cast<int>(bindings.size()) == N, "run_cpu: ", bindings.size(), " bindings for ", N, " ranks");
  // Ranks agree on the collective before any data moves: same (group, seq, plan hash) order.
  for (int r = 0; r < N && opt.verify_agreement; ++r) {
    TIDE_PLAN_CHECK(per_rank[r].size() == per_rank[0].size(), "run_cpu: rank ", r, " has ",
                    per_rank[r].size(), " calls, rank 0 has ", per_rank[0].size());
    for (size_t c = 0; c < per_rank[r].size(); ++c) {
      const Program& a = *per_rank[0][c].program;
      const Program& b = *per_rank[r][c].program;
      TIDE_CHECK(b.rank == r, "program for rank ", b.rank, " bound to rank ", r);
      if (a.plan_hash != b.plan_hash)
        throw Error(TIDE_STR_CAT("plan mismatch: rank ", r, " call ", c, " runs plan hash ", b.plan_hash,
                                 ", rank 0 runs ", a.plan_hash, " (ranks must agree on plans)"));
      if (a.group != b.group || per_rank[0][c].seq != per_rank[r][c].seq)
        throw Error(TIDE_STR_CAT("collective order mismatch: rank ", r, " call ", c, " is (group ", b.group,
                                 ", seq ", per_rank[r][c].seq, "), rank 0 has (group ", a.group, ", seq ",
                                 per_rank[0][c].seq, ")"));
    }
  }
  auto* sh = arena.shared();
  sh->abort.store(0);
  sh->claimed.store(0);
  sh->error_kind.store(0);
  sh->message[0] = 0;
  for (int r = 0; r < N; ++r)
    for (int s = 0; s < kMaxStreams; ++s) sh->blocked(r, s)->valid.store(0);
  const ArenaView view = arena.view();

  for (int r = 0; r < N; ++r)
    for (const auto& call : per_rank[r])
      TIDE_PLAN_CHECK(call.program->rails == Rails::kOneSided || (!opt.processes && opt.rail != nullptr),
                      "run_cpu: rank ", r, " runs a two-sided program, which needs a rail transport and ranks as "
                      "threads (ExecutorOptions.rails = 'two_sided', processes=false)");
  // The staging race canary, one table for threads and forked processes alike (staging_canary.h).
  std::unique_ptr<StagingCanary> canary = make_canary(per_rank, N);
  CpuRunOptions copt = opt;
  copt.canary = canary.get();
  if (!opt.processes) {
    const int W = std::max(1, std::min(N, opt.workers > 0 ? opt.workers : 4));
    CpuRunOptions topt = copt;  // the workers': the calling thread polls (run_polled)
    topt.interrupted = nullptr;
    run_polled(sh, opt, W, [&](int w) {
      const int lo = static_cast<int>(static_cast<int64_t>(N) * w / W);
      const int hi = static_cast<int>(static_cast<int64_t>(N) * (w + 1) / W);
      step_ranks(view, per_rank, bindings, topt, lo, hi);
    });
  } else {
    TIDE_PLAN_CHECK(arena.shared_memory(), "run_cpu: processes mode needs a shared-memory arena");
    for (int r = 0; r < N; ++r)
      for (const auto& call : per_rank[r])
        TIDE_PLAN_CHECK(!call.generator, "run_cpu: rank ", r, " runs a generated program, which runs in threads "
                        "mode only (processes=false)");
    // [Note: process bounce buffers] Children inherit user inputs copy-on-write, but their writes
    // to user buffers would stay private, so every user buffer the programs write is bounced
    // through a shared anonymous mapping and copied back by the parent.
    struct Bounce { UserBuffer* slot; void* orig; void* shared; int64_t bytes; };
    std::vector<Bounce> bounces;
    for (int r = 0; r < N; ++r)
      for (const auto& call : per_rank[r])
        for (const auto& op : call.program->ops) {
          auto note = [&](const BufRef& b) {
            if (!is_user_buffer(b.kind)) return;
            auto& v = bindings[r].by_kind[static_cast<int>(b.kind)];
            const size_t slot = static_cast<size_t>(b.index + 1);
            if (slot >= v.size() || !v[slot].data) return;
            for (const auto& bo : bounces) if (bo.slot == &v[slot]) return;
            void* m = mmap(nullptr, static_cast<size_t>(std::max<int64_t>(1, v[slot].bytes)), PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED)
              throw Error(TIDE_STR_CAT("run_cpu: rank ", r, ": mapping the ", v[slot].bytes, "-byte bounce buffer of ",
                                       buf_kind_name(b.kind), "[", b.index, "] failed: ", std::strerror(errno)));
            std::memcpy(m, v[slot].data, static_cast<size_t>(v[slot].bytes));
            bounces.push_back({&v[slot], v[slot].data, m, v[slot].bytes});
            v[slot].data = m;
          };
          for (const auto& cd : op.copies) note(cd.dst);
          if (op.kind == OpKind::kSum || op.kind == OpKind::kLand || op.kind == OpKind::kZero) note(op.dst);
        }
    const int nproc = std::min(N, 64);
    std::vector<pid_t> pids;
    std::vector<std::pair<int, int>> ranks_of;  // process i steps ranks [first, second)
    std::fflush(stderr);
    std::fflush(stdout);
    const pid_t parent = getpid();
    CpuRunOptions child = copt;
    child.interrupted = nullptr;  // only the calling process polls (a child must not call into Python)
    for (int w = 0; w < nproc; ++w) {
      const int lo = static_cast<int>(static_cast<int64_t>(N) * w / nproc);
      const int hi = static_cast<int>(static_cast<int64_t>(N) * (w + 1) / nproc);
      const pid_t pid = fork();
      if (pid < 0) { sh->abort.store(1); break; }
      if (pid == 0) {
        // A rank process dies with the process that forked it (a kill -9 of the parent must not
        // leave ranks spinning on a shared arena): the death signal, then the check for a parent
        // that was gone before it was armed.
#ifdef __linux__
        prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
        if (getppid() != parent) _exit(4);
        int code = 0;
        try {
          step_ranks(view, per_rank, bindings, child, lo, hi);
          for (int r = lo; r < hi; ++r)
            if (r == opt.dead_rank) code = 3;  // a dead peer exits without finishing
        } catch (...) { code = 1; }
        _exit(code);
      }
      pids.push_back(pid);
      ranks_of.push_back({lo, hi});
    }
    std::string died;
    std::vector<int> status(pids.size(), 0);
    std::vector<bool> reaped(pids.size(), false);
    bool interrupted = false;  // [Note: interrupting a call]
    auto since = std::chrono::steady_clock::now();
    for (size_t left = pids.size(), tick = 0; left > 0; ++tick) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (reaped[i]) continue;
        const pid_t got = waitpid(pids[i], &status[i], WNOHANG);
        if (got == pids[i] || (got < 0 && errno == ECHILD)) reaped[i] = true, --left;  // ECHILD: reaped elsewhere
        // [Note: a killed rank process] A rank process killed from outside (kill -9, the OOM
        // killer) records no error and its peers would wait for it until their deadline: the
        // parent claims the call's error and aborts every rank at once.
        if (got == pids[i] && WIFSIGNALED(status[i]) && !interrupted) {
          const auto [lo, hi] = ranks_of[i];
          int expected = 0;
          if (sh->claimed.compare_exchange_strong(expected, 1)) {
            const std::string msg = TIDE_STR_CAT(
                "rank process ", i, " (pid ", pids[i], ", rank", hi - lo > 1 ? "s " : " ", lo,
                hi - lo > 1 ? TIDE_STR_CAT("..", hi - 1) : "", ") was killed by signal ", WTERMSIG(status[i]), " (",
                strsignal(WTERMSIG(status[i])), ") during call seq ",
                per_rank[lo].empty() ? 0 : per_rank[lo].front().seq, "; every rank stopped");
            std::snprintf(sh->message, sizeof(sh->message), "%s", msg.c_str());
            sh->error_kind.store(1);
          }
          sh->abort.store(1);
        }
      }
      if (left == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      if (!interrupted && tick % 10 == 9 && poll_interrupt(sh, opt, interrupted))  // every ~20 ms
        since = std::chrono::steady_clock::now();
      if (interrupted && std::chrono::steady_clock::now() - since > std::chrono::seconds(1))
        for (size_t i = 0; i < pids.size(); ++i)
          if (!reaped[i]) kill(pids[i], SIGKILL);  // a rank that did not see the abort (e.g. asleep)
    }
    for (size_t i = 0; i < pids.size() && !interrupted; ++i)
      if (WIFSIGNALED(status[i]) && died.empty())
        died = TIDE_STR_CAT("rank process ", i, " killed by signal ", WTERMSIG(status[i]));
    for (auto& b : bounces) {
      std::memcpy(b.orig, b.shared, static_cast<size_t>(b.bytes));
      munmap(b.shared, static_cast<size_t>(std::max<int64_t>(1, b.bytes)));
      b.slot->data = b.orig;
    }
    if (!died.empty() && !sh->claimed.load()) throw Error(died);
    if (static_cast<int>(pids.size()) < nproc && !sh->claimed.load()) throw Error("run_cpu: fork failed");
  }
  rethrow_shared(sh);
  arena.check_canaries();
}

}  // namespace tide
