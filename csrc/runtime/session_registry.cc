// A face's process-wide call state: the plan cache and the session registry (contract in
// tide/session_registry.h).
#include "tide/session_registry.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "tide/errors.h"

namespace tide {

std::shared_ptr<const Plan> cached_plan(const GroupSignature& sig, const Topology& topo, Mode mode) {
  std::ostringstream key;
  key << topo.nodes << 'x' << topo.gpus_per_node << '|' << int(mode) << '|' << int(sig.ag_dtype)
      << int(sig.grad_dtype) << int(sig.shard_dtype);
  for (const auto& p : sig.params) {
    key << '|';
    for (auto d : p.shape) key << d << ',';
  }
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const Plan>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[key.str()];
  if (!slot) {
    Options opt;
    opt.mode = mode;
    slot = std::make_shared<const Plan>(make_plan(sig, topo, opt));
  }
  return slot;
}

GroupSignature group_signature(Collective op, const std::vector<std::vector<int64_t>>& shapes, DType in, DType out) {
  GroupSignature sig;
  if (op == Collective::kAllGather) {
    sig.shard_dtype = in;
    sig.ag_dtype = sig.grad_dtype = out;
  } else {
    sig.shard_dtype = sig.ag_dtype = sig.grad_dtype = in;
  }
  for (size_t p = 0; p < shapes.size(); ++p) {
    ParamSpec spec;
    spec.name = TIDE_STR_CAT("parameter ", p);
    spec.shape = shapes[p];
    sig.params.push_back(std::move(spec));
  }
  return sig;
}

RankArena rank_arena(const Plan& plan, Collective op, Rails rails, bool pull_landing) {
  const ArenaSpec a = GroupSession::own_arena(plan, {op}, rails, pull_landing);
  RankArena out;
  int64_t end = a.total;
  for (int k = static_cast<int>(BufKind::kRing0); k < kNumBufKinds; ++k) {
    if (a.offset[k] < 0 || a.bytes[k] <= 0) continue;
    out.regions[buf_kind_name(static_cast<BufKind>(k))] = {a.offset[k], a.bytes[k]};
    end = std::max(end, a.offset[k] + a.bytes[k]);
  }
  // The counters go last, one more for the rank executor's entry fence (its last counter).
  const int64_t off = (end + 63) / 64 * 64;
  const int64_t bytes = a.counters_bytes + 8;
  out.regions["counters"] = {off, bytes};
  out.bytes = (off + bytes + 63) / 64 * 64;
  return out;
}

SessionRegistry::SessionRegistry(std::string released) : released_(std::move(released)) {}

void SessionRegistry::count(const SessionState& s, int sign) {
  for (const auto& [device, bytes] : s.counted) bytes_[device] += sign * bytes;
}

std::shared_ptr<SessionState> SessionRegistry::get_or_make(const SessionKey& key, uint64_t scope,
                                                           const std::function<std::shared_ptr<SessionState>()>& make) {
  std::lock_guard<std::mutex> lock(mu_);
  TIDE_PLAN_CHECK(!released_scopes_.count(scope), released_);
  Entry& e = states_[key];
  if (!e.state) {
    std::shared_ptr<SessionState> s;
    try {
      s = make();
    } catch (...) {
      states_.erase(key);
      throw;
    }
    TIDE_CHECK(s != nullptr && s->session != nullptr, "SessionRegistry: make() built no session");
    e.scope = scope;
    e.state = std::move(s);
    count(*e.state, +1);
  }
  return e.state;
}

void SessionRegistry::put(const SessionKey& key, uint64_t scope, std::shared_ptr<SessionState> state) {
  TIDE_CHECK(state != nullptr && state->session != nullptr, "SessionRegistry::put: no session");
  std::lock_guard<std::mutex> lock(mu_);
  TIDE_PLAN_CHECK(!released_scopes_.count(scope), released_);
  Entry& e = states_[key];
  if (e.state) return;
  e.scope = scope;
  e.state = std::move(state);
  count(*e.state, +1);
}

std::shared_ptr<SessionState> SessionRegistry::find(const SessionKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = states_.find(key);
  return it == states_.end() ? nullptr : it->second.state;
}

void SessionRegistry::open(uint64_t scope) {
  std::lock_guard<std::mutex> lock(mu_);
  released_scopes_.erase(scope);
}

bool SessionRegistry::released(uint64_t scope) const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_scopes_.count(scope) > 0;
}

int64_t SessionRegistry::release(uint64_t scope, const char* who) {
  std::vector<std::shared_ptr<SessionState>> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    released_scopes_.insert(scope);  // from here a call in the scope raises instead of building a state
    for (auto it = states_.begin(); it != states_.end();) {
      if (it->second.scope != scope) {
        ++it;
        continue;
      }
      count(*it->second.state, -1);
      gone.push_back(std::move(it->second.state));
      it = states_.erase(it);
    }
  }
  // Outside the lock: wait for each executor's enqueued work (CUDA; a no-op on the CPU), then
  // free. A call still in flight holds its own reference and frees the state when it returns.
  std::string first;
  for (const auto& s : gone) {
    try {
      s->session->executor().synchronize();
    } catch (const std::exception& e) {
      if (first.empty()) first = e.what();
    }
  }
  const auto n = static_cast<int64_t>(gone.size());
  gone.clear();
  if (!first.empty()) std::fprintf(stderr, "%s: freed states whose pending work had failed: %s\n", who, first.c_str());
  return n;
}

int64_t SessionRegistry::device_bytes(int device) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = bytes_.find(device);
  return it == bytes_.end() ? 0 : it->second;
}

SessionRegistry::Live SessionRegistry::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  Live out;
  for (const auto& [key, e] : states_) ++(e.state->rank_state ? out.rank_states : out.cluster_states);
  for (const auto& [device, bytes] : bytes_) out.arena_bytes += bytes;
  return out;
}

}  // namespace tide
