// A face's process-wide call state: the plans its calls run and the GroupSessions that run them.
//
// Contract
//   - cached_plan(): one Plan per (signature shapes and dtypes, topology, mode) per process, built
//     on first use; group_signature() is the signature a face builds for one collective over
//     parameters of given shapes (the same hash on every rank that asks for the same call).
//   - A SessionRegistry holds one face's states (a SessionState: a GroupSession and what its
//     arena costs), each under a key the face chooses (its identity of a group's call: plan,
//     collective, group, rank, devices, ...) and in a scope (the face's unit of lifetime, e.g. a
//     mesh). get_or_make() builds a state once, under the registry's lock; put() keeps the first
//     state of a key. States are shared (shared_ptr): a call in flight keeps its state alive
//     through a release.
//   - [Note: session scopes] release(scope) frees every state of the scope, after synchronising
//     its executor (enqueued work; a failure there is printed, not raised, and the state freed all
//     the same, so a scope reopened after a failed call starts on fresh states), and marks the
//     scope released until open(scope): building or keeping a state in a released scope raises
//     PlanError with the registry's `released` message, so a call never reaches freed memory.
//   - Arena bytes are counted per device (-1: host memory) while a state lives. Cluster states
//     (a cluster executor: every rank of the group in this process) and rank states (one rank of
//     a job whose ranks are processes, over a rank executor) are counted apart (live()).
//   - rank_arena(): the segment each rank of such a job needs for one collective of a plan on the
//     rank executor's rails: the session's own arena (GroupSession::own_arena; a pulled TIDE-AG's
//     holds its stage and counters only) plus the rank executor's entry-fence counter.
//   - Thread-safe. Nothing here knows a framework.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tide/exec_cpu.h"
#include "tide/plan.h"
#include "tide/program.h"
#include "tide/session.h"

namespace tide {

// The plan of one group, cached per process (see the contract).
std::shared_ptr<const Plan> cached_plan(const GroupSignature& sig, const Topology& topo, Mode mode);

// The signature of `op` over parameters of `shapes` (D_p, ...): TIDE-AG in = shard dtype, out = AG
// dtype; TIDE-RS in = out = the gradient dtype. Parameters are named "parameter <p>".
GroupSignature group_signature(Collective op, const std::vector<std::vector<int64_t>>& shapes, DType in, DType out);

// The segment every rank of a job of processes needs for `op` of `plan`: regions name ->
// (offset, bytes), the counters last with one more slot for the rank executor's entry fence.
// rails: the rank executor's (two-sided when the ranks' topology has several nodes on CUDA: its
// lowering's counters); pull_landing: a TIDE-AG that pulls (GroupSession::own_arena).
struct RankArena {
  int64_t bytes = 0;
  RegionTable regions;
};
RankArena rank_arena(const Plan& plan, Collective op, Rails rails, bool pull_landing = false);

// One state of a registry.
struct SessionState {
  std::unique_ptr<GroupSession> session;
  bool rank_state = false;  // a rank state (one rank, a rank executor), else a cluster state
  bool cuda = false;        // its executor runs on CUDA: calls take the caller's streams
  ArenaSpec arena;          // cluster states: the session's own arena layout
  const uint8_t* arena_base = nullptr;  // rank states: this rank's arena (host segment or device memory)
  int64_t ring0 = -1;       // rank states: offset of the landing ring slot 0 in it (TIDE-AG; -1: none)
  // (device, bytes) of arena memory it holds (-1: host memory); the registry counts them.
  std::vector<std::pair<int, int64_t>> counted;
};

// The key of a state: the face's integers (see the contract).
using SessionKey = std::vector<int64_t>;

class SessionRegistry {
 public:
  // `released`: the error a call in a released scope raises (names how to reopen it).
  explicit SessionRegistry(std::string released);

  // The state under `key`, made by `make` (under the lock) the first time; PlanError when
  // `scope` is released.
  std::shared_ptr<SessionState> get_or_make(const SessionKey& key, uint64_t scope,
                                            const std::function<std::shared_ptr<SessionState>()>& make);
  // Keeps `state` under `key` in `scope` unless one is there already (that one stays);
  // PlanError when `scope` is released.
  void put(const SessionKey& key, uint64_t scope, std::shared_ptr<SessionState> state);
  std::shared_ptr<SessionState> find(const SessionKey& key) const;  // null: none
  bool has(const SessionKey& key) const { return find(key) != nullptr; }

  void open(uint64_t scope);
  bool released(uint64_t scope) const;
  const std::string& released_message() const { return released_; }
  // Frees the states of `scope` and marks it released ([Note: session scopes]); `who` prefixes
  // the printed failure. Returns how many states were freed.
  int64_t release(uint64_t scope, const char* who);

  int64_t device_bytes(int device) const;  // arena bytes live states hold on `device` (-1: host)
  struct Live {
    int64_t cluster_states = 0;
    int64_t rank_states = 0;
    int64_t arena_bytes = 0;  // every device and the host
  };
  Live live() const;

 private:
  struct Entry {
    uint64_t scope = 0;
    std::shared_ptr<SessionState> state;
  };
  void count(const SessionState& s, int sign);  // caller holds mu_
  std::string released_;
  mutable std::mutex mu_;
  std::map<SessionKey, Entry> states_;
  std::set<uint64_t> released_scopes_;
  std::map<int, int64_t> bytes_;  // device (-1: host) -> arena bytes of live states
};

}  // namespace tide
