// Static checker: proves I1-I4 for per-rank call lists by simulating every rank's streams with
// exact happens-before (vector clocks over streams) and symbolic data provenance.
//
// [Note: what the simulation assumes] Ops of one stream run in order (across calls too); a
// WAIT/EVENT_WAIT on counter >= T happens after the producing op that first made the counter
// reach T (single producer per counter, checked). The user is modelled per rank: before call
// e+1's caller-stream (stream 0) ops it has observed the previous call's release_event and
// rewritten user_inputs (a write that must be ordered after every read of them: I2); when
// done_event is recorded it reads user_outputs (every write must be ordered before: I1/I3) and
// the bytes must equal `expects` (I1).
//
// [Note: why one interleaving is a proof] Counters only grow and every wait is "counter >= T",
// so running an op never disables another: the system is monotone. If one maximal schedule
// runs every op, every fair schedule does (no deadlock, I4); if one stops, the blocked waits
// can never be satisfied. With one producing stream per counter, the op a wait synchronises
// with is the same in every schedule, so the happens-before relation (vector clocks) is
// schedule-independent: a conflicting pair unordered here is unordered everywhere (I2/I3), and
// in a race-free program every read sees the same writer, so provenance (I1) is exact too.
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>

#include "program/shadow.h"
#include "tide/program.h"
#include "tide/program_index.h"

namespace tide {

namespace {
using namespace shadow;
using VC = std::vector<uint32_t>;

struct Hist {
  int64_t value;
  std::shared_ptr<VC> snap;
  int refs;
};
struct CounterState {
  int64_t value = 0;
  std::vector<Hist> hist;
  std::vector<int64_t> targets;  // every wait target on this counter (sorted)
  int producer_rank = -1, producer_stream = -1;
};

uint64_t ckey(int group, int rank, int index) {
  return (static_cast<uint64_t>(group & 0xffff) << 48) | (static_cast<uint64_t>(rank & 0xffffff) << 24) |
         static_cast<uint64_t>(index & 0xffffff);
}
uint64_t rkey(int group, int rank, BufKind kind, int index) {
  const int idx = is_user_buffer(kind) ? index + 1 : 0;
  return (static_cast<uint64_t>(group & 0xffff) << 48) | (static_cast<uint64_t>(rank & 0xffffff) << 24) |
         (static_cast<uint64_t>(static_cast<int>(kind)) << 16) | static_cast<uint64_t>(idx & 0xffff);
}

struct Checker {
  const std::vector<std::vector<Call>>& calls;
  int max_errors;
  CheckReport rep;
  int N = 0, S = 0, D = 0;  // ranks, streams per rank (+1 user), VC dimension
  std::vector<VC> vc;       // per stream gid
  std::unordered_map<uint64_t, CounterState> counters;
  std::unordered_map<uint64_t, Region> mem;
  struct Cursor { size_t call = 0, pos = 0; };
  std::vector<std::vector<Cursor>> cur;                              // [rank][stream]
  std::vector<std::vector<std::vector<std::vector<int>>>> sops;      // [rank][call][stream] -> ops
  std::vector<std::vector<char>> started;                            // [rank][call] stream 0 began
  std::vector<std::vector<char>> released, consumed;                 // [rank][call]

  explicit Checker(const std::vector<std::vector<Call>>& c, int me) : calls(c), max_errors(me) {}

  bool full() const { return static_cast<int>(rep.errors.size()) >= max_errors; }
  void error(const std::string& s) {
    rep.ok = false;
    if (!full()) rep.errors.push_back(s);
  }
  std::string where(const OpId& id) const {
    if (id.rank < 0) return "the user (initial data)";
    const Call& c = calls[id.rank][id.call];
    if (id.op < 0) return TIDE_STR_CAT("the user of rank ", id.rank, " around call seq ", c.seq);
    const Op& op = c.program->ops[id.op];
    return TIDE_STR_CAT("rank ", id.rank, " call seq ", c.seq, " (group ", c.program->group, ") op ", id.op, " ",
                        op_kind_name(op.kind), " [", c.program->streams[op.stream], "]",
                        op.round >= 0 ? TIDE_STR_CAT(" round ", op.round) : "");
  }
  static std::string reg_name(const BufRef& b) {
    return TIDE_STR_CAT(buf_kind_name(b.kind), is_user_buffer(b.kind) && b.index >= 0 ? TIDE_STR_CAT("[", b.index, "]") : "",
                        "@rank", b.rank);
  }
  bool hb(const Epoch& e, const VC& v) const { return e.clock == 0 || e.clock <= v[e.gid]; }
  const char* inv_for(const BufRef& b, const Program& pr) const {
    for (const auto& u : pr.user_inputs) if (u.kind == b.kind && u.rank == b.rank) return "I2";
    return "I3";
  }

  // ---- memory accesses --------------------------------------------------------------------
  // Reads bytes [a, a+w) of `b`'s region; appends (offset-from-a, length, label) pieces.
  void read(const BufRef& b, int group, int64_t a, int64_t w, const Epoch& ep, const VC& v, const Program& pr,
            std::vector<std::tuple<int64_t, int64_t, Label>>* out) {
    Region& R = mem[rkey(group, b.rank, b.kind, b.index)];
    auto it = R.carve(a, a + w);
    for (; it != R.segs().end() && it->first < a + w; ++it) {
      Seg& s = it->second;
      if (!hb(s.w, v))
        error(TIDE_STR_CAT(inv_for(b, pr), " race: ", where(ep.who), " reads ", reg_name(b), " bytes [", it->first,
                           ", ", s.end, ") written by ", where(s.w.who), " without happens-before"));
      bool merged = false;
      for (auto& r : s.reads)
        if (r.gid == ep.gid) { r = ep; merged = true; }
      if (!merged) s.reads.push_back(ep);
      if (out) out->emplace_back(it->first - a, s.end - it->first, s.label);
    }
  }
  void write(const BufRef& b, int group, int64_t a, const std::vector<std::tuple<int64_t, int64_t, Label>>& pieces,
             int64_t w, const Epoch& ep, const VC& v, const Program& pr, bool exclusive = false) {
    Region& R = mem[rkey(group, b.rank, b.kind, b.index)];
    auto it = R.carve(a, a + w);
    for (; it != R.segs().end() && it->first < a + w; ++it) {
      Seg& s = it->second;
      if (!hb(s.w, v))
        error(TIDE_STR_CAT(inv_for(b, pr), " race: ", where(ep.who), " writes ", reg_name(b), " bytes [", it->first,
                           ", ", s.end, ") also written by ", where(s.w.who), " without happens-before"));
      for (const auto& r : s.reads)
        if (r.gid != ep.gid && !hb(r, v))
          error(TIDE_STR_CAT(inv_for(b, pr), " race: ", where(ep.who), " overwrites ", reg_name(b), " bytes [",
                             it->first, ", ", s.end, ") before its reader ", where(r.who), " completed"));
      s.reads.clear();
      s.w = ep;
      const bool landing = b.kind == BufKind::kRing0 || b.kind == BufKind::kRing1 || b.kind == BufKind::kLanding;
      if (landing && exclusive) {
        const Call& call = calls[ep.who.rank][ep.who.call];
        if (s.wgroup == group && s.wseq == call.seq)
          error(TIDE_STR_CAT("I1 exactly-once: ", where(ep.who), " writes ", reg_name(b), " bytes [", it->first, ", ",
                             s.end, ") a second time in call seq ", call.seq));
        s.wgroup = group;
        s.wseq = call.seq;
      }
    }
    // Labels: carve again at piece boundaries and assign.
    for (const auto& [off, len, lab] : pieces) {
      auto jt = R.carve(a + off, a + off + len);
      for (; jt != R.segs().end() && jt->first < a + off + len; ++jt) {
        jt->second.label = lab.shifted(jt->first - (a + off));
        jt->second.w = ep;
      }
    }
  }

  // ---- counters ---------------------------------------------------------------------------
  void produce(CounterState& cs, int64_t newv, const VC& v) {
    if (newv <= cs.value) return;
    auto lo = std::upper_bound(cs.targets.begin(), cs.targets.end(), cs.value);
    auto hi = std::upper_bound(cs.targets.begin(), cs.targets.end(), newv);
    const int refs = static_cast<int>(hi - lo);
    cs.hist.push_back({newv, refs ? std::make_shared<VC>(v) : nullptr, refs});
    cs.value = newv;
  }
  // Returns false if unsatisfied; otherwise joins the producer's clock into v.
  bool consume(CounterState& cs, int64_t target, VC& v) {
    if (target <= 0) return true;
    if (cs.value < target) return false;
    for (auto& h : cs.hist) {
      if (h.value >= target) {
        if (h.snap) {
          for (int i = 0; i < D; ++i) v[i] = std::max(v[i], (*h.snap)[i]);
          if (--h.refs <= 0) h.snap.reset();
        }
        break;
      }
    }
    // Entries whose snapshot is gone have no pending waiter (refs counted every static wait).
    size_t k = 0;
    while (k < cs.hist.size() && !cs.hist[k].snap) ++k;
    if (k > 0) cs.hist.erase(cs.hist.begin(), cs.hist.begin() + static_cast<std::ptrdiff_t>(k));
    return true;
  }

  // ---- static checks ----------------------------------------------------------------------
  void structural() {
    N = static_cast<int>(calls.size());
    rail_stream.assign(N, -1);
    for (int r = 0; r < N; ++r) {
      if (calls[r].size() != calls[0].size())
        error(TIDE_STR_CAT("I4 order: rank ", r, " issues ", calls[r].size(), " calls, rank 0 issues ", calls[0].size()));
      for (size_t c = 0; c < calls[r].size() && c < calls[0].size(); ++c) {
        const Program& a = *calls[0][c].program;
        const Program& b = *calls[r][c].program;
        if (b.plan_hash != a.plan_hash)
          error(TIDE_STR_CAT("I4 plan: rank ", r, " call ", c, " uses plan hash ", b.plan_hash, ", rank 0 uses ", a.plan_hash));
        if (b.group != a.group || calls[r][c].seq != calls[0][c].seq)
          error(TIDE_STR_CAT("I4 order: rank ", r, " call ", c, " is (group ", b.group, ", seq ", calls[r][c].seq,
                             ") but rank 0's is (group ", a.group, ", seq ", calls[0][c].seq, ")"));
        if (b.rank != r) error(TIDE_STR_CAT("rank ", r, " call ", c, " runs the program of rank ", b.rank));
      }
    }
    for (int r = 0; r < N; ++r)
      for (const auto& call : calls[r]) S = std::max(S, static_cast<int>(call.program->streams.size()));
    S += 1;  // the user
    D = N * S;
    // Push rule, bounds, counter producers and wait targets.
    for (int r = 0; r < N; ++r) {
      for (size_t c = 0; c < calls[r].size(); ++c) {
        const Program& pr = *calls[r][c].program;
        const int64_t seq = calls[r][c].seq;
        const int L = pr.topo.gpus_per_node;
        for (size_t i = 0; i < pr.ops.size(); ++i) {
          const Op& op = pr.ops[i];
          const OpId id{r, static_cast<int>(c), static_cast<int>(i)};
          auto bad = [&](const std::string& why) { error(TIDE_STR_CAT("rule: ", where(id), ": ", why)); };
          if (op.stream >= pr.streams.size()) { bad("stream out of range"); continue; }
          auto check_ref = [&](const BufRef& b, bool is_write, bool may_peer) {
            if (is_user_buffer(b.kind)) {
              if (b.rank != r) bad(TIDE_STR_CAT("touches ", reg_name(b), ": user buffers are rank-local"));
              const auto& sz = pr.user_buffer_bytes[static_cast<int>(b.kind)];
              const size_t slot = static_cast<size_t>(b.index + 1);
              if (slot < sz.size() && sz[slot] > 0 && (b.offset < 0 || b.end() > sz[slot]))
                bad(TIDE_STR_CAT(reg_name(b), " bytes [", b.offset, ", ", b.end(), ") exceed its ", sz[slot], " bytes"));
              return;
            }
            if (b.rank < 0 || b.rank >= N) { bad(TIDE_STR_CAT("rank ", b.rank, " out of range")); return; }
            if (b.offset < 0 || b.end() > pr.arena.bytes[static_cast<int>(b.kind)])
              bad(TIDE_STR_CAT(reg_name(b), " bytes [", b.offset, ", ", b.end(), ") exceed the region (",
                               pr.arena.bytes[static_cast<int>(b.kind)], ")"));
            const bool same_node = b.rank / L == r / L;
            if (b.rank != r && !may_peer) bad(TIDE_STR_CAT(is_write ? "writes " : "reads ", reg_name(b), " of another rank"));
            if (b.rank != r && may_peer && op.kind != OpKind::kPut && !same_node)
              bad(TIDE_STR_CAT("reaches ", reg_name(b), " on another node without a rail PUT"));
          };
          const bool two_sided = pr.rails == Rails::kTwoSided;
          const bool rail_op = op.kind == OpKind::kSend || op.kind == OpKind::kRecv;
          if (rail_op) {
            const int peer = rail_peer(op);
            if (op.rail_group < 0) bad("a SEND/RECV outside a rail group");
            if (peer < 0 || peer >= N || peer == r) { bad(TIDE_STR_CAT("rail peer ", peer, " is not another rank")); continue; }
            if (rail_stream[r] < 0) rail_stream[r] = op.stream;
            if (rail_stream[r] != op.stream) bad("SEND/RECV ops on two streams (a rank's rail transfers are one sequence)");
            if (op.kind == OpKind::kSend && op.counter.index >= 0) bad("a SEND bumps a counter (its completion is an event)");
            for (size_t d = 0; d < op.copies.size(); ++d) {
              const CopyDesc& cd = op.copies[d];
              if (cd.src.height != 1 || cd.dst.height != 1 || cd.src.width != cd.dst.width)
                bad("rail descriptors are 1-D with equal source and destination widths");
              const BufRef& own = op.kind == OpKind::kSend ? cd.src : cd.dst;
              const BufRef& far = op.kind == OpKind::kSend ? cd.dst : cd.src;
              check_ref(own, op.kind == OpKind::kRecv, false);
              if (far.rank != peer) bad(TIDE_STR_CAT("a rail op's descriptors name ranks ", peer, " and ", far.rank));
              const XferEnd e{r, static_cast<int>(c), static_cast<int>(i), static_cast<int>(d), op.rail_group};
              if (op.kind == OpKind::kSend) rail_sends[{r, peer}].push_back(e);
              else rail_recvs[{peer, r}].push_back(e);
            }
          } else {
            for (const auto& cd : op.copies) {
              check_ref(cd.src, false, /*may_peer=*/op.kind == OpKind::kCopy);  // the pull landing
              check_ref(cd.dst, true, /*may_peer=*/true);  // local pushes, rail PUTs
              if (op.kind == OpKind::kPut && cd.dst.rank != op.counter.rank && op.counter.index >= 0)
                bad("a PUT's descriptors and its signal target different ranks");
              if (op.kind == OpKind::kPut && two_sided && cd.dst.rank / L != r / L)
                bad(TIDE_STR_CAT("PUTs into ", reg_name(cd.dst), " on another node: a two-sided program reaches other "
                                 "nodes only through SEND/RECV"));
            }
          }
          if ((op.kind == OpKind::kSignal || op.kind == OpKind::kCredit) && two_sided && op.counter.rank / L != r / L)
            bad(TIDE_STR_CAT("bumps a counter of rank ", op.counter.rank, " on another node: a two-sided program reaches "
                             "other nodes only through SEND/RECV"));
          if (op.kind == OpKind::kRecv && op.counter.index >= 0 && op.counter.rank != r)
            bad("a RECV bumps a counter of another rank (its arrival counter is its own)");
          for (const auto& t : op.terms) {
            check_ref(t.src, false, op.kind == OpKind::kLand);
            if (t.dtype == DType::kU8)  // layout.cc [Note: byte items]: moved, never summed
              bad(TIDE_STR_CAT("a SUM/LAND term of ", dtype_name(t.dtype), " (1-byte items are all-gather only: "
                               "no arithmetic)"));
          }
          if (op.kind == OpKind::kSum || op.kind == OpKind::kLand || op.kind == OpKind::kZero) check_ref(op.dst, true, false);
          const bool produces = op_produces(op);
          const bool waits = op.kind == OpKind::kWait || op.kind == OpKind::kEventWait;
          if (produces || waits) {
            if (op.counter.index < 0 || op.counter.index >= pr.num_counters || op.counter.rank < 0 || op.counter.rank >= N) {
              bad(TIDE_STR_CAT("counter ", op.counter.index, " on rank ", op.counter.rank, " out of range"));
              continue;
            }
            if ((op.kind == OpKind::kEventRecord || op.kind == OpKind::kEventWait) && op.counter.rank != r)
              bad("events are rank-local");
          }
          if (!produces && !waits) continue;
          auto& cs = counters[ckey(pr.group, op.counter.rank, op.counter.index)];
          if (produces) {
            if (cs.producer_rank < 0) { cs.producer_rank = r; cs.producer_stream = op.stream; }
            else if (cs.producer_rank != r || cs.producer_stream != op.stream)
              error(TIDE_STR_CAT("I4 counter: ", pr.counter_names.size() > static_cast<size_t>(op.counter.index)
                                     ? pr.counter_names[op.counter.index] : "?",
                                 " on rank ", op.counter.rank, " has two producing streams (rank ", cs.producer_rank,
                                 " stream ", cs.producer_stream, " and ", where(id), ")"));
          }
          if (waits) cs.targets.push_back(op.target(seq));
        }
        if (c > 0 && pr.release_event >= 0) {
          // Implicit: call c's stream 0 starts after the previous same-group call's release.
          for (size_t p = c; p-- > 0;)
            if (calls[r][p].program->group == pr.group) {
              counters[ckey(pr.group, r, calls[r][p].program->release_event)].targets.push_back(calls[r][p].seq);
              break;
            }
        }
        if (pr.done_event >= 0) counters[ckey(pr.group, r, pr.done_event)];
      }
    }
    for (auto& kv : counters) std::sort(kv.second.targets.begin(), kv.second.targets.end());
    rail_match();
  }

  // ---- two-sided rails ([Note: two-sided rails] in program.h) -------------------------------
  // The k-th SEND descriptor from s to t meets the k-th RECV descriptor on t from s (NCCL matches
  // send/recv in order per peer pair); both name the same bytes, in calls of the same seq, and a
  // rendezvous group meets exactly one group of each peer it exchanges with.
  struct XferEnd { int rank, call, op, desc, group; };
  struct Xfer {
    XferEnd send, recv;
    std::vector<std::tuple<int64_t, int64_t, Label>> data;  // what the SEND read
    std::shared_ptr<VC> snap;                                // the sender's clock after reading
    bool captured = false;
  };
  using GroupId = std::tuple<int, int, int>;  // rank, call, rail_group
  struct GroupState { bool sent = false; };
  std::map<std::pair<int, int>, std::vector<XferEnd>> rail_sends, rail_recvs;  // (sender, receiver)
  std::vector<Xfer> xfers;
  std::map<std::tuple<int, int, int>, std::vector<int>> xfers_of;  // (rank, call, op) -> transfers
  std::map<GroupId, GroupState> posted;
  std::vector<int> rail_stream;                                    // per rank, -1: no rail ops

  const CopyDesc& desc_of(const XferEnd& e) const { return calls[e.rank][e.call].program->ops[e.op].copies[e.desc]; }
  std::string end_name(const XferEnd& e) const {
    const CopyDesc& cd = desc_of(e);
    return TIDE_STR_CAT(where(OpId{e.rank, e.call, e.op}), " group ", e.group, " descriptor ", e.desc, " (", reg_name(cd.src),
                        " +", cd.src.offset, " -> ", reg_name(cd.dst), " +", cd.dst.offset, ", ", cd.src.width, " bytes)");
  }
  static bool same_ref(const BufRef& a, const BufRef& b) {
    return a.kind == b.kind && a.rank == b.rank && a.offset == b.offset && a.width == b.width;
  }
  void rail_match() {
    std::set<std::pair<int, int>> pairs;
    for (const auto& kv : rail_sends) pairs.insert(kv.first);
    for (const auto& kv : rail_recvs) pairs.insert(kv.first);
    std::map<GroupId, std::set<GroupId>> meets;
    for (const auto& pq : pairs) {
      const auto& S = rail_sends[pq];
      const auto& R = rail_recvs[pq];
      const size_t n = std::min(S.size(), R.size());
      for (size_t k = 0; k < n; ++k) {
        const CopyDesc& a = desc_of(S[k]);
        const CopyDesc& b = desc_of(R[k]);
        const std::string which = TIDE_STR_CAT("transfer #", k, " from rank ", pq.first, " to rank ", pq.second, ": ");
        if (a.src.width != b.src.width) {
          error(TIDE_STR_CAT("R rail size mismatch: ", which, end_name(S[k]), " carries ", a.src.width, " bytes, ",
                             end_name(R[k]), " expects ", b.src.width));
          continue;
        }
        if (!same_ref(a.src, b.src) || !same_ref(a.dst, b.dst) || calls[S[k].rank][S[k].call].seq != calls[R[k].rank][R[k].call].seq) {
          error(TIDE_STR_CAT("R rail order: ", which, end_name(S[k]), " meets ", end_name(R[k]),
                             " (rail groups issued in different orders on the two ranks)"));
          continue;
        }
        xfers_of[{S[k].rank, S[k].call, S[k].op}].push_back(static_cast<int>(xfers.size()));
        xfers_of[{R[k].rank, R[k].call, R[k].op}].push_back(static_cast<int>(xfers.size()));
        const GroupId gs{S[k].rank, S[k].call, S[k].group}, gr{R[k].rank, R[k].call, R[k].group};
        meets[gs].insert(gr);
        meets[gr].insert(gs);
        xfers.push_back(Xfer{S[k], R[k], {}, nullptr, false});
      }
      if (S.size() > n)
        error(TIDE_STR_CAT("R rail dropped receive: rank ", pq.second, " posts ", R.size(), " receive(s) from rank ", pq.first,
                           ", which sends ", S.size(), "; the first unmatched: ", end_name(S[n])));
      if (R.size() > n)
        error(TIDE_STR_CAT("R rail unmatched receive: rank ", pq.first, " sends ", S.size(), " transfer(s) to rank ",
                           pq.second, ", which posts ", R.size(), " receive(s); the first unmatched: ", end_name(R[n])));
    }
    for (const auto& [g, others] : meets) {
      std::map<int, std::vector<GroupId>> by_rank;
      for (const GroupId& o : others) by_rank[std::get<0>(o)].push_back(o);
      for (const auto& [peer, list] : by_rank)
        if (list.size() > 1)
          error(TIDE_STR_CAT("R rail group split: rank ", std::get<0>(g), " call seq ", calls[std::get<0>(g)][std::get<1>(g)].seq,
                             " rail group ", std::get<2>(g), " meets ", list.size(), " groups of rank ", peer, " (groups ",
                             std::get<2>(list[0]), " and ", std::get<2>(list[1]), "): a group split in two"));
    }
  }
  GroupId group_of(const XferEnd& e) const { return GroupId{e.rank, e.call, e.group}; }

  // Runs the rendezvous group at list[pos] of rank r's call c (stream gid) once every peer group it
  // meets is posted (sends read then) and every matched SEND has read (receives land then).
  // Returns the ops it covers, 0 while blocked.
  size_t step_group(int r, size_t c, const std::vector<int>& list, size_t pos, int gid) {
    const Program& pr = *calls[r][c].program;
    const int g = pr.ops[list[pos]].rail_group;
    const size_t end = rail_group_end(pr, list, pos);
    GroupState& st = posted[GroupId{r, static_cast<int>(c), g}];
    VC& v = vc[gid];
    using Pieces = std::vector<std::tuple<int64_t, int64_t, Label>>;
    if (!st.sent) {
      for (size_t k = pos; k < end; ++k)
        for (int x : xfers_of[{r, static_cast<int>(c), list[k]}]) {
          const Xfer& xf = xfers[x];
          const XferEnd& other = xf.send.rank == r && xf.send.call == static_cast<int>(c) && xf.send.op == list[k] ? xf.recv : xf.send;
          if (!posted.count(group_of(other))) return 0;
        }
      for (size_t k = pos; k < end; ++k) {
        const Op& op = pr.ops[list[k]];
        if (op.kind != OpKind::kSend) continue;
        ++v[gid];
        ++rep.ops_simulated;
        const Epoch ep{static_cast<uint32_t>(gid), v[gid], OpId{r, static_cast<int>(c), list[k]}};
        for (int x : xfers_of[{r, static_cast<int>(c), list[k]}]) {
          Xfer& xf = xfers[x];
          const CopyDesc& cd = desc_of(xf.send);
          if (released[r][c])
            for (const auto& u : pr.user_inputs)
              if (u.kind == cd.src.kind && u.rank == cd.src.rank && (u.index == cd.src.index || u.index < 0))
                error(TIDE_STR_CAT("I2 release: ", where(ep.who), " reads ", reg_name(cd.src), " after release_event was recorded"));
          Pieces pcs;
          read(cd.src, pr.group, cd.src.offset, cd.src.width, ep, v, pr, &pcs);
          xf.data = std::move(pcs);
          xf.snap = std::make_shared<VC>(v);
          xf.captured = true;
        }
      }
      st.sent = true;
    }
    for (size_t k = pos; k < end; ++k)
      if (pr.ops[list[k]].kind == OpKind::kRecv)
        for (int x : xfers_of[{r, static_cast<int>(c), list[k]}])
          if (!xfers[x].captured) return 0;
    for (size_t k = pos; k < end; ++k) {
      const Op& op = pr.ops[list[k]];
      if (op.kind != OpKind::kRecv) continue;
      for (int x : xfers_of[{r, static_cast<int>(c), list[k]}])
        for (int i = 0; i < D; ++i) v[i] = std::max(v[i], (*xfers[x].snap)[i]);
      ++v[gid];
      ++rep.ops_simulated;
      const Epoch ep{static_cast<uint32_t>(gid), v[gid], OpId{r, static_cast<int>(c), list[k]}};
      for (int x : xfers_of[{r, static_cast<int>(c), list[k]}]) {
        const CopyDesc& cd = desc_of(xfers[x].recv);
        write(cd.dst, pr.group, cd.dst.offset, xfers[x].data, cd.dst.width, ep, v, pr, true);
      }
      if (op.counter.index >= 0) {
        auto& cs = counters[ckey(pr.group, op.counter.rank, op.counter.index)];
        produce(cs, cs.value + op.value, v);
      }
    }
    return end - pos;
  }
  // Why the group at the head of a blocked stream cannot complete.
  std::string group_blocker(int r, size_t c, int op_index) {
    for (int x : xfers_of[{r, static_cast<int>(c), op_index}]) {
      const Xfer& xf = xfers[x];
      const bool mine_send = xf.send.rank == r && xf.send.call == static_cast<int>(c) && xf.send.op == op_index;
      const XferEnd& other = mine_send ? xf.recv : xf.send;
      if (!posted.count(group_of(other)))
        return TIDE_STR_CAT("rank ", other.rank, "'s matching rail group ", other.group, " (call seq ",
                            calls[other.rank][other.call].seq, ") is never posted");
      if (!mine_send && !xf.captured)
        return TIDE_STR_CAT("rank ", other.rank, "'s SEND (rail group ", other.group, ") never reads its bytes");
    }
    return "its peers' groups";
  }

  // ---- user model -------------------------------------------------------------------------
  void user_inputs_fresh(int r, size_t c, const VC* after) {
    const Call& call = calls[r][c];
    const Program& pr = *call.program;
    const int ug = r * S + (S - 1);
    if (after) {
      for (int i = 0; i < D; ++i) vc[ug][i] = std::max(vc[ug][i], (*after)[i]);
      ++vc[ug][ug];
    }
    Epoch ep{static_cast<uint32_t>(ug), after ? vc[ug][ug] : 0u, OpId{r, static_cast<int>(c), -1}};
    for (const auto& u : pr.user_inputs) {
      Label l;
      l.garbage = false;
      l.terms.push_back(Term{pr.group, r, u.index, static_cast<int8_t>(u.kind), 1, call.seq, u.offset});
      write(u, pr.group, u.offset, {{0, u.width, l}}, u.width, ep, vc[ug], pr);
    }
  }

  void consume_outputs(int r, size_t c, const Epoch& ep, const VC& v) {
    const Call& call = calls[r][c];
    const Program& pr = *call.program;
    for (const auto& u : pr.user_outputs) read(u, pr.group, u.offset, u.width, ep, v, pr, nullptr);
    for (const auto& ex : pr.expects) {
      Label want;
      want.garbage = false;
      const int rb = dtype_size(ex.region_dtype);
      if (ex.sources.size() == 1 && ex.sources[0].dtype == ex.region_dtype) {
        const auto& s = ex.sources[0].src;
        want.terms.push_back(Term{pr.group, s.rank, s.index, static_cast<int8_t>(s.kind), 1, call.seq, s.offset});
      } else {
        want.elem = rb;
        for (const auto& s : ex.sources)
          want.terms.push_back(Term{pr.group, s.src.rank, s.src.index, static_cast<int8_t>(s.src.kind),
                                    dtype_size(s.dtype), call.seq, s.src.offset});
      }
      want.canonical();
      Region& R = mem[rkey(pr.group, ex.region.rank, ex.region.kind, ex.region.index)];
      const int64_t a = ex.region.offset, b = a + ex.region.width;
      auto it = R.carve(a, b);
      for (; it != R.segs().end() && it->first < b; ++it) {
        Label have = it->second.label;
        have.canonical();
        Label exp = want.shifted(it->first - a);
        if (!(have == exp)) {
          std::string what = have.garbage ? "garbage (never written)"
                             : have.terms.empty() ? "zeros"
                             : TIDE_STR_CAT(have.terms.size(), " term(s), first from rank ", have.terms[0].rank, " ",
                                            buf_kind_name(static_cast<BufKind>(have.terms[0].kind)), "[",
                                            have.terms[0].index, "] seq ", have.terms[0].seq, " +", have.terms[0].offset);
          error(TIDE_STR_CAT("I1 landing: at completion of rank ", r, " call seq ", call.seq, " ", reg_name(ex.region),
                             " bytes [", it->first, ", ", it->second.end, ") hold ", what, ", expected ",
                             want.terms.size(), " term(s) from rank ", want.terms.empty() ? -1 : want.terms[0].rank));
          if (full()) return;
        }
      }
    }
  }

  // ---- op execution -----------------------------------------------------------------------
  bool step_op(int r, size_t c, int i, int gid) {
    const Call& call = calls[r][c];
    const Program& pr = *call.program;
    const Op& op = pr.ops[i];
    VC& v = vc[gid];
    const int g = pr.group;
    if (op.kind == OpKind::kWait || op.kind == OpKind::kEventWait)
      return consume(counters[ckey(g, op.counter.rank, op.counter.index)], op.target(call.seq), v);
    ++v[gid];
    const Epoch ep{static_cast<uint32_t>(gid), v[gid], OpId{r, static_cast<int>(c), i}};
    ++rep.ops_simulated;
    auto check_released = [&](const BufRef& b) {
      if (!released[r][c]) return;
      for (const auto& u : pr.user_inputs)
        if (u.kind == b.kind && u.rank == b.rank && (u.index == b.index || u.index < 0))
          error(TIDE_STR_CAT("I2 release: ", where(ep.who), " reads ", reg_name(b), " after release_event was recorded"));
    };
    using Pieces = std::vector<std::tuple<int64_t, int64_t, Label>>;
    switch (op.kind) {
      case OpKind::kCopy:
      case OpKind::kPut:
      case OpKind::kCast:
        for (const auto& cd : op.copies) {
          check_released(cd.src);
          for (int64_t h = 0; h < cd.src.height; ++h) {
            Pieces pcs;
            read(cd.src, g, cd.src.offset + h * cd.src.pitch, cd.src.width, ep, v, pr, &pcs);
            if (op.kind == OpKind::kCast) {
              for (auto& [off, len, lab] : pcs) {
                Label e4 = lab.as_elems(4);
                e4.elem = 2;
                off /= 2;
                len /= 2;
                lab = e4;
                lab.canonical();
              }
            }
            write(cd.dst, g, cd.dst.offset + h * cd.dst.pitch, pcs, cd.dst.width, ep, v, pr, true);
          }
        }
        if (op.kind == OpKind::kPut && op.counter.index >= 0) {
          auto& cs = counters[ckey(g, op.counter.rank, op.counter.index)];
          produce(cs, cs.value + op.value, v);
        }
        break;
      case OpKind::kSum:
      case OpKind::kLand: {
        const int64_t n = op.dst.width / 4;
        std::vector<std::tuple<int64_t, int64_t, Label>> ins;  // (dst elem start, elems, label as elems)
        for (const auto& t : op.terms) {
          check_released(t.src);
          const int isz = dtype_size(t.dtype);
          Pieces pcs;
          read(t.src, g, t.src.offset, t.elems * isz, ep, v, pr, &pcs);
          for (auto& [off, len, lab] : pcs)
            ins.emplace_back(t.dst_elem + off / isz, len / isz, lab.as_elems(isz));
        }
        if (op.kind == OpKind::kLand && op.accumulate) {
          Pieces pcs;
          read(op.dst, g, op.dst.offset, op.dst.width, ep, v, pr, &pcs);
          for (auto& [off, len, lab] : pcs) ins.emplace_back(off / 4, len / 4, lab.as_elems(4));
        }
        std::vector<int64_t> cuts{0, n};
        for (const auto& [s, len, lab] : ins) { cuts.push_back(s); cuts.push_back(s + len); }
        std::sort(cuts.begin(), cuts.end());
        cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
        Pieces out;
        for (size_t k = 0; k + 1 < cuts.size(); ++k) {
          const int64_t a = cuts[k], b = cuts[k + 1];
          if (a < 0 || b > n || a >= b) continue;
          Label l = Label::zero();
          l.elem = 4;
          for (const auto& [s, len, lab] : ins) {
            if (s > a || s + len < b) continue;
            Label sh = lab.shifted((a - s) * lab.elem);
            if (sh.garbage) { l.garbage = true; break; }
            for (const auto& t : sh.terms) l.terms.push_back(t);
          }
          l.canonical();
          out.emplace_back(a * 4, (b - a) * 4, l);
        }
        write(op.dst, g, op.dst.offset, out, op.dst.width, ep, v, pr);
        break;
      }
      case OpKind::kZero:
        for (int64_t h = 0; h < op.dst.height; ++h)
          write(op.dst, g, op.dst.offset + h * op.dst.pitch, {{0, op.dst.width, Label::zero()}}, op.dst.width, ep, v, pr);
        break;
      case OpKind::kSignal:
      case OpKind::kCredit: {
        auto& cs = counters[ckey(g, op.counter.rank, op.counter.index)];
        produce(cs, cs.value + op.value, v);
        break;
      }
      case OpKind::kEventRecord: {
        auto& cs = counters[ckey(g, op.counter.rank, op.counter.index)];
        produce(cs, std::max(cs.value, op.target(call.seq)), v);
        if (op.counter.index == pr.done_event && op.target(call.seq) >= call.seq && !consumed[r][c]) {
          consumed[r][c] = 1;
          consume_outputs(r, c, ep, v);
        }
        if (op.counter.index == pr.release_event && op.target(call.seq) >= call.seq) released[r][c] = 1;
        break;
      }
      default: break;
    }
    return true;
  }

  // Runs one stream of rank r as far as it can; returns true on progress.
  bool advance(int r, int s) {
    bool progress = false;
    auto& cu = cur[r][s];
    const int gid = r * S + s;
    while (cu.call < calls[r].size()) {
      const auto& list = sops[r][cu.call][s];
      if (cu.pos >= list.size()) { ++cu.call; cu.pos = 0; continue; }
      const Program& pr = *calls[r][cu.call].program;
      if (s == 0 && !started[r][cu.call]) {
        // The user issues call c after observing the previous same-group call's release.
        size_t prev = cu.call;
        bool found = false;
        while (prev-- > 0)
          if (calls[r][prev].program->group == pr.group) { found = true; break; }
        const VC* snap = nullptr;
        VC joined;
        if (found && pr.release_event >= 0) {
          joined = vc[gid];
          auto& cs = counters[ckey(pr.group, r, calls[r][prev].program->release_event)];
          if (!consume(cs, calls[r][prev].seq, joined)) return progress;
          snap = &joined;
        }
        started[r][cu.call] = 1;
        if (!found || snap) user_inputs_fresh(r, cu.call, snap);
        if (snap) {
          const int ug = r * S + (S - 1);
          for (int i = 0; i < D; ++i) vc[gid][i] = std::max(vc[gid][i], vc[ug][i]);
        }
      }
      if (is_rail_op(pr.ops[list[cu.pos]])) {
        const size_t n = step_group(r, cu.call, list, cu.pos, gid);
        if (n == 0) return progress;
        cu.pos += n;
        progress = true;
        if (full()) return progress;
        continue;
      }
      if (!step_op(r, cu.call, list[cu.pos], gid)) return progress;
      ++cu.pos;
      progress = true;
      if (full()) return progress;
    }
    return progress;
  }

  void run() {
    structural();
    if (!rep.ok) return;
    vc.assign(D, VC(D, 0));
    cur.assign(N, std::vector<Cursor>(S));
    sops.resize(N);
    started.resize(N);
    released.resize(N);
    consumed.resize(N);
    for (int r = 0; r < N; ++r) {
      for (const auto& call : calls[r]) {
        std::vector<std::vector<int>> so(S);
        for (size_t i = 0; i < call.program->ops.size(); ++i) so[call.program->ops[i].stream].push_back(static_cast<int>(i));
        sops[r].push_back(std::move(so));
      }
      started[r].assign(calls[r].size(), 0);
      released[r].assign(calls[r].size(), 0);
      consumed[r].assign(calls[r].size(), 0);
    }
    for (;;) {
      bool progress = false, done = true;
      for (int r = 0; r < N; ++r)
        for (int s = 0; s < S - 1; ++s) {
          progress |= advance(r, s);
          if (full()) return;
          if (cur[r][s].call < calls[r].size()) done = false;
        }
      if (done) break;
      if (!progress) { report_deadlock(); return; }
    }
    for (int r = 0; r < N; ++r)
      for (size_t c = 0; c < calls[r].size(); ++c)
        if (calls[r][c].program->done_event >= 0 && !consumed[r][c])
          error(TIDE_STR_CAT("I1 completion: rank ", r, " call seq ", calls[r][c].seq, " never records done_event"));
  }

  void report_deadlock() {
    int shown = 0;
    for (int r = 0; r < N && shown < 4; ++r)
      for (int s = 0; s < S - 1 && shown < 4; ++s) {
        const auto& cu = cur[r][s];
        if (cu.call >= calls[r].size()) continue;
        const auto& list = sops[r][cu.call][s];
        const Program& pr = *calls[r][cu.call].program;
        if (cu.pos >= list.size()) continue;
        const Op& op = pr.ops[list[cu.pos]];
        if (s == 0 && !started[r][cu.call] && cu.pos == 0 && op.kind != OpKind::kWait && op.kind != OpKind::kEventWait) {
          error(TIDE_STR_CAT("I4 deadlock: rank ", r, " cannot start call seq ", calls[r][cu.call].seq,
                             ": the previous call never records its release_event"));
          ++shown;
          continue;
        }
        if (is_rail_op(op)) {
          std::string why = "its peers' groups";
          for (size_t k = cu.pos, e = rail_group_end(pr, list, cu.pos); k < e && why == "its peers' groups"; ++k)
            why = group_blocker(r, cu.call, list[k]);
          error(TIDE_STR_CAT("I4 deadlock: ", where(OpId{r, static_cast<int>(cu.call), list[cu.pos]}), " rail group ",
                             op.rail_group, " never completes: ", why));
          ++shown;
          continue;
        }
        const auto& cs = counters[ckey(pr.group, op.counter.rank, op.counter.index)];
        error(TIDE_STR_CAT("I4 deadlock: ", where(OpId{r, static_cast<int>(cu.call), list[cu.pos]}), " waits for ",
                           pr.counter_names.size() > static_cast<size_t>(op.counter.index) ? pr.counter_names[op.counter.index] : "?",
                           " on rank ", op.counter.rank, " >= ", op.target(calls[r][cu.call].seq), " but it stops at ",
                           cs.value, cs.producer_rank < 0 ? " (no op ever produces it)" : ""));
        ++shown;
      }
  }
};

}  // namespace

CheckReport check_programs(const std::vector<std::vector<Call>>& per_rank, int max_errors) {
  Checker ck(per_rank, std::max(1, max_errors));
  if (per_rank.empty()) return ck.rep;
  ck.run();
  return ck.rep;
}

CheckReport check_program_set(const std::vector<Program>& progs, int calls) {
  std::vector<std::vector<Call>> pr(progs.size());
  for (size_t r = 0; r < progs.size(); ++r)
    for (int c = 1; c <= calls; ++c) pr[r].push_back({&progs[r], c});
  return check_programs(pr, 8);
}

}  // namespace tide
