// The same-process issue gate's board and turns ([Note: same-process issue gate] in fabric.h).
// Host only: no CUDA here, so CPU tests run it as the executors do.
#include <algorithm>
#include <chrono>

#include "fabric/fabric.h"
#include "tide/errors.h"

namespace tide::fabric {

std::shared_ptr<IssueBoard> IssueBoard::shared(std::vector<std::pair<int, const void*>> ranks) {
  static std::mutex mu;
  static std::map<std::vector<std::pair<int, const void*>>, std::weak_ptr<IssueBoard>> boards;
  std::sort(ranks.begin(), ranks.end());
  std::lock_guard<std::mutex> g(mu);
  for (auto it = boards.begin(); it != boards.end();) it = it->second.expired() ? boards.erase(it) : std::next(it);
  std::weak_ptr<IssueBoard>& w = boards[ranks];
  std::shared_ptr<IssueBoard> b = w.lock();
  if (!b) {
    b = std::make_shared<IssueBoard>();
    w = b;
  }
  return b;
}

void IssueBoard::join(int rank) {
  std::lock_guard<std::mutex> g(mu_);
  if (std::find(joined_.begin(), joined_.end(), rank) == joined_.end()) joined_.push_back(rank);
  std::sort(joined_.begin(), joined_.end());
}

void IssueBoard::leave(int rank) {
  {
    std::lock_guard<std::mutex> g(mu_);
    joined_.erase(std::remove(joined_.begin(), joined_.end(), rank), joined_.end());
    for (auto it = lanes_.begin(); it != lanes_.end();) {
      const auto& k = it->first;
      it = std::find(k.begin(), k.end(), rank) != k.end() ? lanes_.erase(it) : std::next(it);
    }
  }
  cv_.notify_all();
}

std::vector<int> IssueBoard::joined_among(const std::vector<int>& members) const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int> out;
  for (int r : joined_)
    if (std::find(members.begin(), members.end(), r) != members.end()) out.push_back(r);
  return out;
}

IssueTurns::IssueTurns(IssueBoard& board, std::vector<int> ranks, int me, double deadline_s, std::string what)
    : board_(board), ranks_(std::move(ranks)), me_(me), deadline_s_(deadline_s), what_(std::move(what)) {
  TIDE_CHECK(std::is_sorted(ranks_.begin(), ranks_.end()) && involves(me_), what_, ": issue turns of rank ", me_,
             " among ranks that do not hold it");
  std::lock_guard<std::mutex> g(board_.mu_);
  std::shared_ptr<IssueBoard::Lane>& lane = board_.lanes_[ranks_];
  if (!lane) lane = std::make_shared<IssueBoard::Lane>();
  lane_ = lane;
  start_ = pos_ = lane_->next[me_];
}

bool IssueTurns::involves(int rank) const { return std::binary_search(ranks_.begin(), ranks_.end(), rank); }

void IssueTurns::own() {
  if (!held_) {
    std::unique_lock<std::mutex> lk(board_.mu_);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::microseconds(static_cast<int64_t>(deadline_s_ * 1e6));
    if (!board_.cv_.wait_until(lk, deadline, [&] { return lane_->done >= pos_; })) {
      const int64_t at = lane_->done;
      const std::string who = at >= start_ && at - start_ < static_cast<int64_t>(owner_.size())
                                  ? TIDE_STR_CAT("rank ", owner_[static_cast<size_t>(at - start_)], " of this process")
                                  : std::string("a rank of this process (in its previous call)");
      std::string ranks;
      for (int r : ranks_) ranks += TIDE_STR_CAT(ranks.empty() ? "" : ", ", r);
      throw TimeoutError(TIDE_STR_CAT(what_, ": rank ", me_, " waited ", deadline_s_, " s for its turn to enqueue (",
                                      "same-process issue gate; ranks ", ranks, " of this process issue in one "
                                      "order): ", who, " did not enqueue its step ", at, " (its thread has not reached "
                                      "this call, is stalled, or runs other calls); ExecutorOptions.issue_gate=0 "
                                      "turns the gate off"));
    }
    held_ = true;
  }
  owner_.push_back(me_);
  ++pos_;
}

void IssueTurns::publish() {
  {
    std::lock_guard<std::mutex> g(board_.mu_);
    lane_->done = std::max(lane_->done, pos_);
  }
  held_ = false;
  board_.cv_.notify_all();
}

void IssueTurns::save() {
  std::lock_guard<std::mutex> g(board_.mu_);
  lane_->next[me_] = pos_;
}

}  // namespace tide::fabric
