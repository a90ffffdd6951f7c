// LocalRail: the rail transport of ranks that share this process (contract in tide/rail.h). A
// send and its receive meet once both are posted; the copy happens then, under the rail's lock.
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "tide/errors.h"
#include "tide/rail.h"

namespace tide {

namespace {

class LocalRail final : public Rail {
 public:
  uint64_t start(int rank, const std::vector<RailTransfer>& sends, const std::vector<RailTransfer>& recvs) override {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t t = ++next_;
    Group& g = groups_[t];
    g.pending = static_cast<int>(sends.size() + recvs.size());
    if (!aborted_.empty()) g.error = aborted_;
    for (const auto& s : sends) post(t, rank, s.peer, s, true);
    for (const auto& r : recvs) post(t, r.peer, rank, r, false);
    return t;
  }
  bool test(uint64_t ticket) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(ticket);
    TIDE_CHECK(it != groups_.end(), "LocalRail: unknown ticket ", ticket);
    if (!it->second.error.empty()) {
      const std::string e = it->second.error;
      groups_.erase(it);
      throw Error(e);
    }
    if (it->second.pending > 0) return false;
    groups_.erase(it);
    return true;
  }
  void abort(const std::string& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = why.empty() ? "LocalRail aborted" : why;
    for (auto& kv : groups_) if (kv.second.error.empty()) kv.second.error = aborted_;
  }
  std::string name() const override { return "local"; }

 private:
  struct Posted { uint64_t ticket; RailTransfer x; };
  struct Group { int pending = 0; std::string error; };
  // One side of pair (from, to) posted: meet the other side's oldest, or queue.
  void post(uint64_t t, int from, int to, const RailTransfer& x, bool send) {
    auto& mine = send ? sends_[{from, to}] : recvs_[{from, to}];
    auto& other = send ? recvs_[{from, to}] : sends_[{from, to}];
    if (other.empty()) { mine.push_back({t, x}); return; }
    const Posted o = other.front();
    other.pop_front();
    const RailTransfer& s = send ? x : o.x;
    const RailTransfer& r = send ? o.x : x;
    Group& gs = groups_[send ? t : o.ticket];
    Group& gr = groups_[send ? o.ticket : t];
    if (s.bytes != r.bytes) {
      const std::string e = TIDE_STR_CAT("rail size mismatch: rank ", from, " sends ", s.bytes, " bytes to rank ", to,
                                         ", which receives ", r.bytes);
      if (gs.error.empty()) gs.error = e;
      if (gr.error.empty()) gr.error = e;
    } else if (s.bytes > 0) {
      std::memcpy(r.data, s.data, static_cast<size_t>(s.bytes));
    }
    --gs.pending;
    --gr.pending;
  }
  std::mutex mu_;
  uint64_t next_ = 0;
  std::map<uint64_t, Group> groups_;
  std::map<std::pair<int, int>, std::deque<Posted>> sends_, recvs_;  // (from, to)
  std::string aborted_;
};

}  // namespace

std::shared_ptr<Rail> make_local_rail() { return std::make_shared<LocalRail>(); }

}  // namespace tide
