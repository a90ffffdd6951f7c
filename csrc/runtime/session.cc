// The call runtime: GroupSession and CounterSpace (contract in tide/session.h).
#include "tide/session.h"

#include <algorithm>

#include "tide/errors.h"

namespace tide {

int rs_bank(int64_t seq) {
  TIDE_PLAN_CHECK(seq >= 1, "TIDE-RS call sequence numbers start at 1 (got seq=", seq, ")");
  return static_cast<int>((seq - 1) % 2);
}

namespace {

// The one-sided program set of `kind` (rs->expert_lane set for the expert lane).
std::vector<Program> build_programs(const Plan& plan, Collective kind, const AgCallOptions* ag, const RsCallOptions* rs) {
  return kind == Collective::kAllGather ? build_ag_programs(plan, *ag) : build_rs_programs(plan, *rs);
}

}  // namespace

int program_counters(const Plan& plan, Collective kind, Rails rails, bool pull_landing) {
  TIDE_PLAN_CHECK(!pull_landing || kind == Collective::kAllGather, "program_counters: pull_landing is TIDE-AG's, "
                  "not ", collective_name(kind), "'s");
  AgCallOptions ag;
  ag.with_expects = false;
  ag.pull_landing = pull_landing;
  RsCallOptions rs;
  rs.expert_lane = kind == Collective::kReduceScatterExpert;
  if (rails == Rails::kTwoSided && plan.topo.nodes > 1) {  // the lowering's counters need every rank
    std::vector<Program> progs = build_programs(plan, kind, &ag, &rs);
    lower_two_sided(progs);
    return progs[0].num_counters;
  }
  if (kind == Collective::kAllGather) return build_ag_program(plan, ag, 0).num_counters;
  if (kind == Collective::kReduceScatterExpert) return build_rs_expert_program(plan, rs, 0).num_counters;
  // The header alone: no ops are built (the plan outlives the generator, hence no ownership).
  const std::shared_ptr<const Plan> view(&plan, [](const Plan*) {});
  return RsProgramGenerator(view, rs).header(0, false).num_counters;
}

int64_t CounterSpace::reserve(const Plan& plan, Collective kind, Rails rails) {
  const int64_t base = used_;
  used_ += program_counters(plan, kind, rails);
  return base;
}

ArenaSpec GroupSession::own_arena(const Plan& plan, const std::vector<Collective>& kinds, Rails rails,
                                  bool pull_landing) {
  TIDE_PLAN_CHECK(!kinds.empty(), "GroupSession: a session runs at least one collective");
  if (pull_landing) {  // [Note: pulled arena] in tide/plan.h: the pull programs' counters on `rails`
    TIDE_PLAN_CHECK(kinds.size() == 1 && kinds[0] == Collective::kAllGather, "GroupSession::own_arena: "
                    "pull_landing is TIDE-AG's and its arena is its own (no ring slots, no TIDE-RS regions); give "
                    "the all_gather a session of its own (got ", kinds.size(), " collective(s), the first ",
                    collective_name(kinds[0]), ")");
    return pull_arena_spec_for(plan, program_counters(plan, Collective::kAllGather, rails, true));
  }
  const bool expert = std::find(kinds.begin(), kinds.end(), Collective::kReduceScatterExpert) != kinds.end();
  if (expert) {
    TIDE_PLAN_CHECK(kinds.size() == 1, "GroupSession: the expert lane has its own arena layout; give it a session "
                    "of its own");
    RsCallOptions o;
    o.expert_lane = true;
    ArenaSpec a = build_rs_expert_program(plan, o, 0).arena;
    const int64_t need = 8ll * program_counters(plan, Collective::kReduceScatterExpert, rails);
    if (a.counters_bytes < need) {  // the lowering's counters: the region ends the arena
      a.counters_bytes = need;
      a.total = std::max(a.total, a.counters_offset + need);
    }
    return a;
  }
  int total = 0;
  for (Collective k : kinds) total += program_counters(plan, k, rails);
  return arena_spec_for(plan, total);
}

GroupSession::GroupSession(std::shared_ptr<const Plan> plan, std::shared_ptr<CallExecutor> executor,
                           GroupPlacement placement, SessionOptions opt)
    : plan_(std::move(plan)), executor_(std::move(executor)), placement_(std::move(placement)), opt_(opt) {
  TIDE_PLAN_CHECK(plan_ != nullptr && executor_ != nullptr, "GroupSession: needs a plan and an executor");
  // The planner's range for the same budgets (Options.sum_ctas / land_ctas, kMaxCtas).
  TIDE_PLAN_CHECK(opt_.sum_ctas >= 0 && opt_.sum_ctas <= kMaxCtas, "SessionOptions.sum_ctas: expected 0 (the plan's "
                  "solver) or 1..", kMaxCtas, ", got ", opt_.sum_ctas);
  TIDE_PLAN_CHECK(opt_.land_ctas >= 0 && opt_.land_ctas <= kMaxCtas, "SessionOptions.land_ctas: expected 0 (the "
                  "plan's solver) or 1..", kMaxCtas, ", got ", opt_.land_ctas);
  TIDE_PLAN_CHECK(!placement_.kinds.empty(), "GroupPlacement.kinds: a session runs at least one collective");
  TIDE_PLAN_CHECK(!(opt_.generate_rs && opt_.check), "SessionOptions: the checker needs built programs "
                  "(generate_rs and check exclude each other)");
  rails_ = executor_->rails();
  TIDE_PLAN_CHECK(!(opt_.generate_rs && rails_ == Rails::kTwoSided), "SessionOptions.generate_rs: generated "
                  "programs are one-sided (the executor's rails are two-sided)");
  sum_ctas_ = opt_.sum_ctas > 0 ? opt_.sum_ctas : plan_->solver.sum_ctas;
  land_ctas_ = opt_.land_ctas > 0 ? opt_.land_ctas : plan_->solver.land_ctas;
  const int N = plan_->topo.world();
  if (placement_.members.empty()) {
    TIDE_PLAN_CHECK(N == executor_->world(), "GroupSession: a plan for ", N, " ranks (", plan_->topo.nodes, "x",
                    plan_->topo.gpus_per_node, ") on an executor of ", executor_->world(),
                    " ranks (pass the group's members)");
  } else {
    TIDE_PLAN_CHECK(static_cast<int>(placement_.members.size()) == N, "GroupPlacement.members: ",
                    placement_.members.size(), " ranks for a plan of ", N);
    bool whole = N == executor_->world();
    for (int i = 0; i < N; ++i) {
      const int m = placement_.members[static_cast<size_t>(i)];
      TIDE_PLAN_CHECK(m >= 0 && m < executor_->world(), "GroupPlacement.members: rank ", m, " is outside [0, ",
                      executor_->world(), ")");
      whole = whole && m == i;
    }
    if (whole) placement_.members.clear();  // the whole executor: no sub-group on the call path
  }
  if (const RegionTable* r = executor_->regions()) regions_ = *r;
  // Counter ranges: given (a shared arena), or laid out from 0 in `kinds` order (its own arena).
  int64_t next = 0;
  for (Collective k : placement_.kinds) {
    int64_t& base = placement_.counter_base[static_cast<int>(k)];
    if (base < 0) {
      TIDE_PLAN_CHECK(regions_.empty(), "GroupPlacement.counter_base[", collective_name(k), "]: a group in a shared "
                      "arena needs a range from the arena's CounterSpace");
      base = next;
      next += program_counters(*plan_, k, rails_);
    }
  }
}

std::shared_ptr<ProgramSet> GroupSession::build(Collective kind, int bank, float alpha, bool accumulate) const {
  const int k = static_cast<int>(kind);
  TIDE_PLAN_CHECK(std::find(placement_.kinds.begin(), placement_.kinds.end(), kind) != placement_.kinds.end(),
                  "GroupSession: this session does not run ", collective_name(kind), " (its placement names ",
                  placement_.kinds.size(), " collective(s))");
  auto set = std::make_shared<ProgramSet>();
  ArenaBindOptions b;
  if (!regions_.empty()) b.regions = &regions_;
  b.counter_base = placement_.counter_base[k];
  if (kind == Collective::kAllGather) {
    AgCallOptions o;
    o.ring_slot = placement_.ring_slot;
    o.resident = placement_.resident && !plan_->sig.needs_cast();
    o.group = placement_.group;
    o.multicast = placement_.multicast;
    o.expert_lane = placement_.expert_lane;
    o.pull_landing = placement_.pull_landing;
    o.with_expects = false;
    set->progs = build_ag_programs(*plan_, o);
    b.landing_kind = static_cast<int>(placement_.ring_slot == 1 ? BufKind::kRing1 : BufKind::kRing0);
    b.landing_region = placement_.landing_region;
    b.landing_offset = placement_.landing_offset;
    b.resident_offset = o.resident ? placement_.resident_offset : 0;
  } else {
    RsCallOptions o;
    o.bank = bank;
    o.alpha = alpha;
    o.accumulate = accumulate;
    o.group = placement_.group;
    o.expert_lane = kind == Collective::kReduceScatterExpert;
    if (opt_.generate_rs && kind == Collective::kReduceScatter) {
      TIDE_PLAN_CHECK(regions_.empty() && placement_.counter_base[k] == 0, "SessionOptions.generate_rs: generated "
                      "programs run in their own arena from counter 0");
      auto generator = std::make_shared<RsProgramGenerator>(plan_, o);
      for (int r = 0; r < plan_->topo.world(); ++r) set->progs.push_back(generator->header(r, false));
      set->generator = generator;
    } else {
      set->progs = build_programs(*plan_, kind, nullptr, &o);
    }
  }
  if (rails_ == Rails::kTwoSided) lower_two_sided(set->progs);
  bind_programs_to_arena(set->progs, b);
  set->arena_bound = b.regions != nullptr;
  // The builders stamp the plan's C_sum / C_mc (Eqs. 13-14); only an explicit override restamps.
  for (Program& p : set->progs) {
    if (opt_.sum_ctas > 0) p.sum_ctas = opt_.sum_ctas;
    if (opt_.land_ctas > 0) p.land_ctas = opt_.land_ctas;
  }
  return set;
}

void check_session_programs(Collective kind, const std::vector<const ProgramSet*>& sets) {
  const bool rs = kind != Collective::kAllGather;
  TIDE_PLAN_CHECK(!sets.empty() && sets.size() == (rs ? 2u : 1u), "check_session_programs: ", sets.size(),
                  " program sets for ", collective_name(kind), " (", rs ? 2 : 1, " expected: one per bank)");
  for (const ProgramSet* s : sets) TIDE_PLAN_CHECK(s != nullptr, "check_session_programs: no program set");
  for (const ProgramSet* s : sets) s->require_built("the static checker");
  const size_t N = sets[0]->progs.size();
  std::vector<std::vector<Call>> per_rank(N);
  for (size_t r = 0; r < N; ++r)
    for (int64_t s = 1; s <= (rs ? 3 : 2); ++s) {
      const ProgramSet& set = *sets[rs ? static_cast<size_t>(rs_bank(s)) : 0];
      TIDE_PLAN_CHECK(set.progs.size() == N, "check_session_programs: the banks' sets differ in ranks");
      per_rank[r].push_back({&set.progs[r], s});
    }
  const CheckReport rep = check_programs(per_rank, 8);
  if (!rep.ok) {
    std::string all;
    for (const auto& e : rep.errors) all += (all.empty() ? "" : "; ") + e;
    throw Error("TIDE static checker rejected the " + std::string(collective_name(kind)) + " program: " + all);
  }
}

void GroupSession::check_new(Collective kind, float alpha, bool accumulate) {
  std::vector<const ProgramSet*> sets;
  for (int b = 0; b < (kind == Collective::kAllGather ? 1 : 2); ++b)
    sets.push_back(cache_.at(Key{static_cast<int>(kind), b, alpha, accumulate}).get());
  check_session_programs(kind, sets);
}

std::shared_ptr<const ProgramSet> GroupSession::programs(Collective kind, int64_t seq, float alpha, bool accumulate) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool rs = kind != Collective::kAllGather;
  const int bank = rs ? rs_bank(seq) : 0;
  if (!rs) {
    alpha = 1.0f;
    accumulate = false;
  }
  const Key key{static_cast<int>(kind), bank, alpha, accumulate};
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  // A new set: both banks of TIDE-RS at once, so the checker proves them together (a generated
  // set: only the bank this call uses).
  const bool generated = opt_.generate_rs && kind == Collective::kReduceScatter;
  const int banks = rs && !generated ? 2 : 1;
  for (int i = 0; i < banks; ++i) {
    const int b = banks == 1 ? bank : i;
    const Key kb{static_cast<int>(kind), b, alpha, accumulate};
    if (!cache_.count(kb)) cache_[kb] = build(kind, b, alpha, accumulate);
  }
  if (opt_.check && !generated) {
    try {
      check_new(kind, alpha, accumulate);
    } catch (...) {
      for (int b = 0; b < banks; ++b) cache_.erase(Key{static_cast<int>(kind), b, alpha, accumulate});
      throw;
    }
  }
  return cache_.at(key);
}

int64_t GroupSession::calls(Collective kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  return seq_[static_cast<int>(kind)];
}

int64_t GroupSession::call(Collective kind, float alpha, bool accumulate, const std::vector<RankBindingList>& buffers,
                           const std::vector<uintptr_t>& streams) {
  const int64_t seq = calls(kind) + 1;
  const std::shared_ptr<const ProgramSet> set = programs(kind, seq, alpha, accumulate);
  std::lock_guard<std::mutex> lock(mu_);
  TIDE_CHECK(seq == seq_[static_cast<int>(kind)] + 1, "GroupSession: concurrent calls of one collective");
  seq_[static_cast<int>(kind)] = seq;
  std::vector<RankBindings> b;  // the one per-rank binding type below the session
  b.reserve(buffers.size());
  for (const RankBindingList& l : buffers) b.push_back(to_rank_bindings(l));
  executor_->run(set, seq, placement_.members, b, streams);
  return seq;
}

int64_t GroupSession::all_gather(const std::vector<RankBindingList>& buffers, const std::vector<uintptr_t>& streams) {
  return call(Collective::kAllGather, 1.0f, false, buffers, streams);
}

int64_t GroupSession::reduce_scatter(float alpha, bool accumulate, const std::vector<RankBindingList>& buffers,
                                     const std::vector<uintptr_t>& streams, bool expert_lane) {
  return call(expert_lane ? Collective::kReduceScatterExpert : Collective::kReduceScatter, alpha, accumulate, buffers,
              streams);
}

}  // namespace tide
