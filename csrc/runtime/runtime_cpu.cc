// The CPU executors behind the call runtime (contract in tide/session.h).
#include <algorithm>

#include "tide/errors.h"
#include "tide/session.h"

namespace tide {

namespace {

CpuRunOptions cpu_run_options(const ExecutorOptions& opt, bool processes) {
  CpuRunOptions o;
  static_cast<ExecutorOptions&>(o) = with_debug_env(opt);
  validate(o);
  o.processes = processes;
  return o;
}

}  // namespace

CpuClusterCallExecutor::CpuClusterCallExecutor(int world, const ArenaSpec& spec, bool processes, const ExecutorOptions& opt)
    : arena_(world, spec, processes), opt_(cpu_run_options(opt, processes)) {}

void CpuClusterCallExecutor::run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
                             const std::vector<RankBindings>& buffers, const std::vector<uintptr_t>& streams) {
  TIDE_PLAN_CHECK(set != nullptr && !set->progs.empty(), "CpuClusterExecutor.run: empty program set");
  const int n = arena_.world();
  TIDE_PLAN_CHECK(members.empty(), "CpuClusterExecutor.run: a virtual cluster runs "
                  "every rank's program (no sub-groups)");
  TIDE_PLAN_CHECK(static_cast<int>(set->progs.size()) == n, "CpuClusterExecutor.run: a program set of ",
                  set->progs.size(), " programs for ", n, " ranks");
  TIDE_PLAN_CHECK(static_cast<int>(buffers.size()) == n, "CpuClusterExecutor.run: ", buffers.size(),
                  " buffer lists for ", n, " ranks");
  TIDE_PLAN_CHECK(set->progs[0].arena.total == arena_.spec().total, "CpuClusterExecutor.run: the programs' arena "
                  "layout (", set->progs[0].arena.total, " bytes) differs from this arena's (", arena_.spec().total,
                  "; lay it out with GroupSession::own_arena for the session's collectives, rails and pull_landing)");
  (void)streams;
  std::vector<std::vector<Call>> per_rank(static_cast<size_t>(n));
  std::vector<RankBindings> b = buffers;  // processes mode bounces their slots
  for (int r = 0; r < n; ++r)
    per_rank[static_cast<size_t>(r)].push_back({&set->progs[static_cast<size_t>(r)], seq, set->generator.get()});
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.empty())
    throw Error(TIDE_STR_CAT("CpuClusterExecutor: call seq ", seq, " refused: an earlier call failed and left the "
                             "arena mid-call (", failed_, "); create a new VirtualCluster"));
  try {
    run_locked(per_rank, b);
  } catch (const PlanError&) {
    throw;  // refused before any rank ran: the arena is as it was
  } catch (const std::exception& e) {
    failed_ = e.what();
    throw;
  }
}

void CpuClusterCallExecutor::run_locked(std::vector<std::vector<Call>>& per_rank, std::vector<RankBindings>& b) {
  if (opt_.rails == Rails::kOneSided) {
    run_cpu(arena_, per_rank, b, opt_);
    return;
  }
  // Two-sided: ranks of different nodes meet through a rail of their own for this run.
  TIDE_PLAN_CHECK(!opt_.processes, "CpuClusterExecutor: two-sided rails (ExecutorOptions.rails) run with ranks as "
                  "threads");
  const std::shared_ptr<Rail> rail = make_local_rail();
  CpuRunOptions o = opt_;
  o.rail = rail.get();
  run_cpu(arena_, per_rank, b, o);
}

void CpuClusterCallExecutor::set_timeout(double timeout_s) {
  const double t = checked_timeout(timeout_s);
  std::lock_guard<std::mutex> lock(mu_);
  opt_.timeout_s = t;
}

void CpuRankCallExecutor::set_timeout(double timeout_s) { ex_->set_timeout(timeout_s); }

CpuRankCallExecutor::CpuRankCallExecutor(std::shared_ptr<RankExecutor> ex, RegionTable regions)
    : ex_(std::move(ex)), regions_(std::move(regions)) {
  TIDE_PLAN_CHECK(ex_ != nullptr, "CpuRankExecutor: no RankExecutor");
}

void CpuRankCallExecutor::run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
                          const std::vector<RankBindings>& buffers, const std::vector<uintptr_t>& streams) {
  TIDE_PLAN_CHECK(set != nullptr, "CpuRankExecutor.run: no program set");
  TIDE_PLAN_CHECK(buffers.size() == 1, "CpuRankExecutor.run: one buffer list (this rank's), got ", buffers.size());
  (void)streams;
  ex_->run(*set, seq, buffers[0], members.empty() ? nullptr : &members);
}

}  // namespace tide
