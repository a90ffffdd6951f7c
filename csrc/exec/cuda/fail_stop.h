// What both CUDA executors (CudaExecutor, executor.h; CudaRankExecutor, rank_executor.h) hold
// besides their issue path (issue.h): the internal streams of their local ranks, the watchdog,
// fail-stop, and the cache of prepared program sets. Written once here.
//
// Contract
//   - Local ranks are slots 0..n-1 (the in-process executor: every fabric rank; the rank
//     executor: one slot), slot i on device devices[i]. ensure_streams(slot, n) grows the slot's
//     pool to n streams ([Note: internal streams]); stream s >= 1 has a join event. The pools
//     persist across calls and program sets, so stream s of call e+1 queues behind stream s of
//     call e whatever sets they run.
//   - join_caller(): every internal stream of a call joins stream 0, and the caller's stream waits
//     for stream 0 (the out half of [Note: stream handoff]); no host synchronisation.
//   - Fail-stop: fail() keeps the executor's first error. check_usable() (every run, first) throws
//     tide::Error "<who> failed earlier (fail-stop): <first error>" after one, and records and
//     throws a TimeoutError the watchdog saw since the last call. guarded(f) runs enqueue work:
//     an exception is recorded; a TimeoutError also drains every stream first (the watchdog's
//     released waits let them finish). synchronize() drains the watchdog (a timeout: recorded,
//     streams drained, thrown), then synchronises every stream, every return code checked;
//     drain_and_sync() does the same and records nothing (a sync_every_call run's own handling).
//   - Teardown: quiesce() (the executor's destructor, first) synchronises every stream (stuck
//     waits are released by the watchdog) and stops the watchdog; the executor may then drop
//     what its streams read (its cached run tables); the destructor destroys streams and events.
//   - Not thread-safe: each executor serialises its calls with its own mutex.
//
// [Note: internal streams]
// Every internal stream is created cudaStreamNonBlocking so that the legacy default stream never
// serialises with TIDE's work; one per named program stream (caller, readiness, scatter,
// completion, ...), so ordering between them is only what the program's waits and events say,
// exactly as on the CPU executor. The pool owns its streams and destroys them after
// synchronising; the issue path only borrows handles, and the executors order them against the
// caller's stream with events ([Note: stream handoff]).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "exec/cuda/runtime.h"
#include "tide/exec_options.h"
#include "tide/errors.h"
#include "tide/program_set.h"

namespace tide::cuda {

class FailStopStreams {
 public:
  // who: the executor's name in messages ("CudaExecutor", "CudaRankExecutor"); the watchdog runs
  // on devices[0].
  FailStopStreams(std::string who, std::vector<int> devices, double timeout_s);
  ~FailStopStreams();
  FailStopStreams(const FailStopStreams&) = delete;
  FailStopStreams& operator=(const FailStopStreams&) = delete;

  // ---- streams
  void ensure_streams(size_t slot, size_t n);
  const std::vector<cudaStream_t>& streams(size_t slot) const { return streams_[slot]; }
  const std::vector<std::vector<cudaStream_t>>& all_streams() const { return streams_; }  // [slot][stream]
  // Streams 1..n-1 of `slot` join stream 0, then `caller` waits for stream 0. check: every return
  // code is checked, naming `what` (false on an error path: the caller's stream stays ordered
  // after whatever was enqueued).
  void join_caller(size_t slot, size_t n, cudaStream_t caller, bool check, const std::string& what);
  void sync_all() noexcept;  // unchecked: error paths and teardown
  void quiesce() noexcept;

  // ---- fail-stop
  Watchdog& watchdog() { return *watchdog_; }
  // Later waits' deadline: a valid ExecutorOptions::timeout_s (PlanError otherwise), returned.
  double set_timeout(double timeout_s) {
    const double t = checked_timeout(timeout_s);
    watchdog_->set_timeout(t);
    return t;
  }
  void fail(const std::string& msg) {
    if (failed_.empty()) failed_ = msg;
  }
  void check_usable();
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const TimeoutError& ex) {
      fail(ex.what());
      sync_all();  // what was issued has its producers, or the watchdog released its waits
      throw;
    } catch (const std::exception& ex) {
      fail(ex.what());
      throw;
    }
  }
  // The watchdog drained, then every stream synchronised (both checked; nothing recorded).
  void drain_and_sync(const std::string& what);
  void synchronize(const std::string& what);

 private:
  std::string who_;
  std::vector<int> devices_;
  std::vector<std::vector<cudaStream_t>> streams_;  // [slot][stream], grown as sets need
  std::vector<std::vector<cudaEvent_t>> joined_;    // [slot][stream - 1]
  std::vector<cudaEvent_t> done_;                   // [slot]: call -> caller
  std::unique_ptr<Watchdog> watchdog_;
  std::string failed_;
};

// The prepared program sets of an executor, by the set's identity and version (the caller bumps
// ProgramSet::version when it mutates a set in place, e.g. fault injection). Entry derives from
// CachedSet and holds what the executor prepared (its ProgramTables, ...).
struct CachedSet {
  const void* key = nullptr;
  std::weak_ptr<const void> owner;
  uint64_t version = 0;  // ProgramSet::version when prepared
  void bind(const std::shared_ptr<const ProgramSet>& sp) {
    key = sp.get();
    owner = sp;
    version = sp->version;
  }
};

template <class Entry>
class SetCache {
 public:
  // Drops the entries whose set died or changed version since; `quiesce` runs first when any is
  // dropped (its run tables may still be read by enqueued work).
  template <class Quiesce>
  void drop_stale(const ProgramSet& set, Quiesce&& quiesce) {
    auto stale = [&](const std::unique_ptr<Entry>& e) {
      return e->owner.expired() || (e->key == &set && e->version != set.version);
    };
    if (std::none_of(entries_.begin(), entries_.end(), stale)) return;
    quiesce();
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(), stale), entries_.end());
  }
  // The entry of `set` at its version for which match(entry) holds, or null.
  template <class Match>
  Entry* find(const ProgramSet& set, Match&& match) {
    for (auto& e : entries_)
      if (e->key == &set && e->version == set.version && match(*e)) return e.get();
    return nullptr;
  }
  Entry& add(std::unique_ptr<Entry> e) {
    entries_.push_back(std::move(e));
    return *entries_.back();
  }
  size_t size() const { return entries_.size(); }
  void clear() { entries_.clear(); }

 private:
  std::vector<std::unique_ptr<Entry>> entries_;
};

}  // namespace tide::cuda
