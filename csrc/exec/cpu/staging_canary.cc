// The staging race canary (contract in staging_canary.h).
#include "exec/cpu/staging_canary.h"

#include <vector>

#include "tide/errors.h"

namespace tide {

namespace {
std::string unit_name(const StagingCanary::Unit& u) { return TIDE_STR_CAT("unit ", u.unit, " of call seq ", u.seq); }
}  // namespace

std::string StagingCanary::begin_write(int owner, int s, int64_t a, int64_t b, Unit u, int writer) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot& sl = slot(owner, s);
  auto it = sl.upper_bound(a);
  if (it != sl.begin()) --it;
  std::vector<std::pair<int64_t, Piece>> keep;  // the parts of overlapped pieces outside [a, b)
  while (it != sl.end() && it->first < b) {
    const int64_t p0 = it->first;
    const Piece p = it->second;
    if (p.end <= a) { ++it; continue; }
    if (p.state != kRead && !(p.u == u))
      return TIDE_STR_CAT("early staging reuse: rank ", writer, "'s push of ", unit_name(u), " into rank ", owner,
                          "'s staging slot ", s, " bytes [", a, ", ", b, ") overwrites ", unit_name(p.u),
                          " (pushed by rank ", p.writer, ", bytes [",
                          p0, ", ", p.end, ")) before rank ", owner, "'s SUM read it (staging-canary)");
    if (p0 < a) keep.push_back({p0, Piece{a, p.u, p.state, p.writer}});
    if (p.end > b) keep.push_back({b, Piece{p.end, p.u, p.state, p.writer}});
    it = sl.erase(it);
  }
  for (auto& k : keep) sl.insert(k);
  sl[a] = Piece{b, u, kWriting, writer};
  return "";
}

void StagingCanary::end_write(int owner, int s, int64_t a, int64_t b, Unit u) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot& sl = slot(owner, s);
  auto it = sl.find(a);
  if (it != sl.end() && it->second.end == b && it->second.u == u) it->second.state = kWritten;
}

std::string StagingCanary::check_read(int owner, int s, int64_t a, int64_t b, Unit u) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot& sl = slot(owner, s);
  auto it = sl.upper_bound(a);
  if (it != sl.begin()) --it;
  int64_t at = a;  // bytes below `at` are covered by pieces of unit u
  auto missing = [&](const std::string& what) {
    return TIDE_STR_CAT("missing push fence: rank ", owner, "'s SUM of ", unit_name(u), " reads its staging slot ", s,
                        " bytes [", at, ", ", b, "), which hold ", what, " (staging-canary)");
  };
  for (; it != sl.end() && it->first < b && at < b; ++it) {
    if (it->second.end <= at) continue;
    if (it->first > at) return missing("nothing pushed yet");
    const Piece& p = it->second;
    if (!(p.u == u)) return missing(TIDE_STR_CAT(unit_name(p.u), " (pushed by rank ", p.writer, ")"));
    if (p.state == kWriting) return missing(TIDE_STR_CAT("a push of rank ", p.writer, " still being written"));
    at = p.end;
  }
  return at >= b ? "" : missing("nothing pushed yet");
}

void StagingCanary::mark_read(int owner, int s, int64_t a, int64_t b, Unit u) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot& sl = slot(owner, s);
  auto it = sl.upper_bound(a);
  if (it != sl.begin()) --it;
  for (; it != sl.end() && it->first < b; ++it)
    if (it->second.end > a && it->second.u == u) it->second.state = kRead;
}

}  // namespace tide
