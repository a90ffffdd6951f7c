// The in-process rendezvous (contract and [Note: rendezvous lifetime] in tide/rendezvous.h).
#include "tide/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>

#include "tide/errors.h"

namespace tide {

bool RendezvousKey::operator<(const RendezvousKey& o) const {
  return std::tie(run_id, group, op_id, seq) < std::tie(o.run_id, o.group, o.op_id, o.seq);
}

namespace {

struct Meeting {
  int world = 0;
  std::vector<const void*> io;  // index = rank (each rank's `mine`)
  std::vector<uint64_t> hash;
  std::vector<bool> done;
  int arrived = 0;
  bool ran = false;  // rank 0 finished group_body
  int finished = 0;
  int left = 0;
  std::string failure;  // non-empty: every rank still inside returns this error
  bool timed_out = false;
  bool bad_input = false;  // the failure was a PlanError on some rank: same code on every rank
};

std::mutex g_mu;  // guards g_meetings and every Meeting
std::condition_variable g_cv;
std::map<RendezvousKey, std::shared_ptr<Meeting>> g_meetings;

std::string key_str(const RendezvousKey& k) {
  return TIDE_STR_CAT("(run ", k.run_id, ", group ", k.group, ", op ", k.op_id, ", seq ", k.seq,
                      ")");
}

std::string missing_ranks(const std::vector<bool>& present) {
  std::ostringstream os;
  bool first = true;
  for (size_t r = 0; r < present.size(); ++r)
    if (!present[r]) { os << (first ? "" : ", ") << r; first = false; }
  return os.str();
}

// Leaves the meeting; the last of the `world` ranks out erases it. Caller holds g_mu.
void leave(const RendezvousKey& key, const std::shared_ptr<Meeting>& m) {
  if (++m->left == m->world) {
    auto it = g_meetings.find(key);
    if (it != g_meetings.end() && it->second == m) g_meetings.erase(it);
  }
}

// The meeting of `key`, created on first use. Caller holds g_mu.
std::shared_ptr<Meeting> meeting(const RendezvousKey& key, int world) {
  auto& slot = g_meetings[key];
  if (!slot) {
    slot = std::make_shared<Meeting>();
    slot->world = world;
    slot->io.assign(world, nullptr);
    slot->hash.assign(world, 0);
    slot->done.assign(world, false);
  }
  return slot;
}

const char kFailedRank = 0;  // marks a rank that posted a failure instead of joining

}  // namespace

int64_t next_rendezvous_seq(int32_t device, int64_t op_id, int64_t run_id) {
  static std::mutex mu;
  static std::map<std::pair<int32_t, int64_t>, std::pair<int64_t, int64_t>> counters;
  std::lock_guard<std::mutex> lock(mu);
  auto& c = counters[{device, op_id}];
  if (c.first != run_id || c.second < 0) c = {run_id, 0};
  else ++c.second;
  return c.second;
}

void rendezvous_fail(const RendezvousKey& key, int world, int rank, const std::string& why,
                     bool bad_input) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::shared_ptr<Meeting> m = meeting(key, world);
  if (m->failure.empty()) {
    m->failure = TIDE_STR_CAT("rendezvous ", key_str(key), ": rank ", rank, " failed: ", why);
    m->bad_input = bad_input;
  }
  if (rank >= 0 && rank < m->world && m->io[rank] == nullptr) {
    m->io[rank] = &kFailedRank;
    ++m->arrived;
    leave(key, m);
  }
  g_cv.notify_all();
}

void rendezvous_and_run(const RendezvousKey& key, int world, int rank, const void* mine, uint64_t plan_hash,
                        int64_t timeout_ms, const RendezvousBody& group_body, const RendezvousBody& rank_body) {
  TIDE_CHECK(mine != nullptr, "rendezvous: rank ", rank, " joins without its buffers");
  TIDE_CHECK(rank >= 0 && rank < world, "rank ", rank, " outside [0, ", world, ")");
  std::unique_lock<std::mutex> lock(g_mu);
  std::shared_ptr<Meeting> m = meeting(key, world);
  if (m->world != world || m->io[rank] != nullptr) {
    const std::string why =
        m->world != world
            ? TIDE_STR_CAT("ranks disagree on the group size (", m->world, " vs ", world, ")")
            : TIDE_STR_CAT("rank ", rank, " arrived twice (two devices map to one rank?)");
    m->failure = TIDE_STR_CAT("rendezvous ", key_str(key), ": ", why);
    g_cv.notify_all();
    throw Error(m->failure);
  }
  m->io[rank] = mine;
  m->hash[rank] = plan_hash;
  ++m->arrived;
  g_cv.notify_all();

  // Leaves the meeting with its failure (TimeoutError when it is a timeout). Caller holds g_mu.
  auto fail = [&]() {
    const std::string msg = m->failure;
    const bool timeout = m->timed_out, bad_input = m->bad_input;
    leave(key, m);
    if (timeout) throw TimeoutError(msg);
    if (bad_input) throw PlanError(msg);
    throw Error(msg);
  };
  // Waits (each phase with its own deadline) until `ready`; on timeout names the ranks for which
  // `present(r)` is false.
  auto wait_for = [&](auto ready, auto present, const char* what) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (!ready() && m->failure.empty()) {
      if (g_cv.wait_until(lock, deadline) == std::cv_status::timeout && !ready() &&
          m->failure.empty()) {
        std::vector<bool> seen(world);
        for (int r = 0; r < world; ++r) seen[r] = present(r);
        m->failure = TIDE_STR_CAT(
            "rendezvous ", key_str(key), ": rank ", rank, " waited ", timeout_ms,
            " ms for ranks [", missing_ranks(seen), "] to ", what,
            " (a rank skipped this call, e.g. under a rank-dependent branch, or hangs)");
        m->timed_out = true;
        g_cv.notify_all();
      }
    }
    if (!m->failure.empty()) fail();
  };

  wait_for([&] { return m->arrived == world; }, [&](int r) { return m->io[r] != nullptr; },
           "join");
  for (int r = 0; r < world && m->failure.empty(); ++r) {
    if (m->hash[r] != plan_hash) {
      m->failure = TIDE_STR_CAT("rendezvous ", key_str(key), ": rank ", r, " has plan hash ",
                                m->hash[r], " but rank ", rank, " has ", plan_hash,
                                " (ranks disagree on the group's shapes, dtypes or topology)");
      m->bad_input = true;
      g_cv.notify_all();
    }
  }
  if (!m->failure.empty()) fail();
  std::vector<const void*> group = m->io;
  auto run = [&](const std::function<void()>& fn) {
    lock.unlock();
    try {
      fn();
    } catch (const std::exception& e) {
      lock.lock();
      if (m->failure.empty()) {
        m->failure =
            TIDE_STR_CAT("rendezvous ", key_str(key), ": rank ", rank, " failed: ", e.what());
        m->timed_out = dynamic_cast<const TimeoutError*>(&e) != nullptr;  // same code everywhere
        m->bad_input = dynamic_cast<const PlanError*>(&e) != nullptr;
      }
      g_cv.notify_all();
      leave(key, m);
      throw;
    }
    lock.lock();
  };
  if (rank == 0) {
    run([&] { group_body(group); });
    m->ran = true;
    g_cv.notify_all();
  } else {
    wait_for([&] { return m->ran; }, [](int r) { return r != 0; }, "run the group's programs");
  }
  run([&] { rank_body(group); });
  m->done[rank] = true;
  ++m->finished;
  g_cv.notify_all();
  wait_for([&] { return m->finished == world; }, [&](int r) { return bool(m->done[r]); },
           "finish");
  leave(key, m);
}

}  // namespace tide
