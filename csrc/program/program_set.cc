// ProgramSet (contract in tide/program_set.h).
#include "tide/program_set.h"

#include "tide/errors.h"

namespace tide {

ProgramSet::ProgramSet(const ProgramSet& o)
    : std::enable_shared_from_this<ProgramSet>(), progs(o.progs), arena_bound(o.arena_bound), generator(o.generator),
      version(o.version) {}

Program ProgramSet::program(int r) const {
  TIDE_PLAN_CHECK(r >= 0 && r < static_cast<int>(progs.size()), "rank: ", r, " is outside [0, ",
                  progs.size(), ")");
  if (!generator) return progs[static_cast<size_t>(r)];
  Program p = progs[static_cast<size_t>(r)];
  for (int s = 0; s < static_cast<int>(p.streams.size()); ++s)
    for (int k = 0, n = generator->steps(r, s); k < n; ++k) generator->emit(r, s, k, p.ops);
  return p;
}

void ProgramSet::require_built(const char* what) const {
  TIDE_PLAN_CHECK(!generator, what, ": this program set is generated while it runs (no op tables); "
                  "build it instead (e.g. build_rs_programs)");
}

std::shared_ptr<const ProgramIndex> ProgramSet::index() const {
  require_built("ProgramSet.index");
  std::lock_guard<std::mutex> lock(mu_);
  if (!index_ || index_version_ != version) {
    index_ = std::make_shared<const ProgramIndex>(index_programs(progs));
    index_version_ = version;
  }
  return index_;
}

}  // namespace tide
