// The CPU op interpreter: steps ranks' streams over an arena view (step_ranks), shared by run_cpu
// (executor.cc: every rank of a virtual cluster, threads or processes) and RankExecutor
// (rank_executor.cc: one rank per process). Contract in tide/exec_cpu.h; what it sees of an arena
// in internal.h ([Note: arena views]).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>

#include "exec/cpu/internal.h"
#include "exec/cpu/staging_canary.h"
#include "tide/exec_cpu.h"
#include "tide/numerics.h"
#include "tide/program_index.h"

namespace tide {

namespace {

using Clock = std::chrono::steady_clock;

float load_elem(const uint8_t* p, DType t) {
  if (t == DType::kFP32) { float f; std::memcpy(&f, p, 4); return f; }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == DType::kBF16 ? bf16_to_fp32(h) : fp16_to_fp32(h);
}

// Per-rank run state: stream cursors over the rank's calls.
struct StreamCursor {
  size_t call = 0;
  size_t pos = 0;  // index into the call's per-stream op list (generated call: ops issued so far)
  int step = 0;            // generated call: next step to emit
  std::vector<Op> window;  // generated call: the current step's ops
  size_t wpos = 0;
  Clock::time_point blocked_since{};
  bool blocked = false;
  uint64_t rail_ticket = 0;  // the posted rendezvous group at the head (0: none)
};

struct RankState {
  int rank = 0;
  const std::vector<Call>* calls = nullptr;
  std::vector<std::vector<std::vector<int>>> stream_ops;  // [call][stream] -> op indices
  std::vector<StreamCursor> cursors;
  int64_t ops_done = 0;
  const Op* cur = nullptr;  // the op being executed (generated calls have no op table)
  bool dead = false;
  bool stall_armed = false;
  Clock::time_point stall_until{};
  bool finished = false;
};

struct Runner {
  const ArenaView& arena;
  const std::vector<std::vector<Call>>& per_rank;
  std::vector<RankBindings>& bindings;
  const CpuRunOptions& opt;
  int lo = 0, hi = 0;  // the ranks this runner steps (work()); their blocked waits are visible

  [[noreturn]] void fail(int kind, const std::string& msg) {
    auto* sh = arena.shared();
    int expected = 0;
    if (sh->claimed.compare_exchange_strong(expected, 1)) {
      std::snprintf(sh->message, sizeof(sh->message), "%s", msg.c_str());
      sh->error_kind.store(kind);
    }
    sh->abort.store(1);
    if (kind == 2) throw TimeoutError(msg);
    throw Error(msg);
  }

  // The op `idx` of `call` on `rs`: the program's op, or for a generated call the op being run.
  static const Op& op_at(const RankState& rs, const Call& call, int idx) {
    return call.generator ? *rs.cur : call.program->ops[idx];
  }

  std::string op_name(const RankState& rs, const Call& call, int idx) const {
    const Op& op = op_at(rs, call, idx);
    const Program& pr = *call.program;
    return TIDE_STR_CAT("rank ", rs.rank, " (node ", pr.topo.node_of(rs.rank), ", local ",
                        pr.topo.local_of(rs.rank), ") call seq ", call.seq, " group ", pr.group,
                        ": op ", idx, " ", op_kind_name(op.kind), " [stream ", pr.streams[op.stream],
                        "] tag ", op_tag_name(op.tag), op.round >= 0 ? TIDE_STR_CAT(" round ", op.round) : "");
  }

  uint8_t* resolve(const RankState& rs, const Call& call, int idx, const BufRef& b) {
    if (is_user_buffer(b.kind)) {
      if (b.rank != rs.rank)
        fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": touches ", buf_kind_name(b.kind), " of rank ", b.rank,
                             " (user buffers are rank-local)"));
      const auto& v = bindings[rs.rank].by_kind[static_cast<int>(b.kind)];
      const size_t slot = static_cast<size_t>(b.index + 1);
      if (slot >= v.size() || !v[slot].data)
        fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": ", buf_kind_name(b.kind), "[", b.index, "] is not bound"));
      if (b.offset < 0 || b.end() > v[slot].bytes)
        fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": ", buf_kind_name(b.kind), "[", b.index, "] bytes [",
                             b.offset, ", ", b.end(), ") exceed the bound ", v[slot].bytes));
      return static_cast<uint8_t*>(v[slot].data) + b.offset;
    }
    if (b.rank < 0 || b.rank >= arena.world())
      fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": rank ", b.rank, " out of range"));
    if (!arena.has(b.kind))
      fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": uses arena region '", buf_kind_name(b.kind),
                           "', which the arena layout does not have"));
    if (arena.base[static_cast<size_t>(b.rank)] == nullptr)
      fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": touches ", buf_kind_name(b.kind), " of rank ", b.rank,
                           ", whose arena is not mapped in this process (another node: only the rail reaches it)"));
    if (b.offset < 0 || b.end() > arena.region_bytes(b.kind))
      fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": ", buf_kind_name(b.kind), " of rank ", b.rank, " bytes [",
                           b.offset, ", ", b.end(), ") exceed the region (", arena.region_bytes(b.kind), ")"));
    return arena.region(b.rank, b.kind) + b.offset;
  }

  std::atomic<uint64_t>& counter(const RankState& rs, const Call& call, int idx, const CounterRef& c) {
    if (c.rank < 0 || c.rank >= arena.world() || c.index < 0 || c.index >= arena.num_counters())
      fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": counter ", c.index, " on rank ", c.rank, " out of range"));
    return arena.counters(c.rank)[c.index];
  }

  // A generated call's generator, if any rank runs one (then no rank has op tables to scan).
  const ProgramGenerator* generator() const {
    for (const auto& calls : per_rank)
      for (const Call& call : calls)
        if (call.generator) return call.generator;
    return nullptr;
  }

  std::string producer_of(const Call& call, const CounterRef& c) const {
    if (call.generator) {
      int stream = -1;
      const int p = call.generator->producer(c, &stream);
      if (p < 0) return "unknown (generated program)";
      const auto& names = call.program->streams;
      return TIDE_STR_CAT("rank ", p, " [", stream >= 0 && stream < static_cast<int>(names.size()) ? names[stream] : "?",
                          "] (generated program)");
    }
    for (const auto& calls : per_rank) {
      if (calls.empty()) continue;
      const Program& pr = *calls.front().program;
      for (size_t i = 0; i < pr.ops.size(); ++i) {
        const Op& op = pr.ops[i];
        if (op_produces(op) && op.counter.rank == c.rank && op.counter.index == c.index)
          return TIDE_STR_CAT("rank ", pr.rank, " op ", i, " ", op_kind_name(op.kind), " [", pr.streams[op.stream], "]");
      }
    }
    return "no producer";
  }

  int producer_rank(const CounterRef& c) const {
    if (const ProgramGenerator* g = generator()) {
      int stream = -1;
      return g->producer(c, &stream);
    }
    for (const auto& calls : per_rank) {
      if (calls.empty()) continue;
      const Program& pr = *calls.front().program;
      for (const Op& op : pr.ops) {
        if (op_produces(op) && op.counter.rank == c.rank && op.counter.index == c.index) return pr.rank;
      }
    }
    return -1;
  }

  // Follows "waits for a counter produced by rank p, which itself waits for ..." to the root.
  std::string wait_chain(CounterRef c) const {
    std::string out;
    std::vector<int> seen;
    for (int hop = 0; hop < 8; ++hop) {
      const int p = producer_rank(c);
      if (p < 0) {
        out += TIDE_STR_CAT("; root: no op of any rank produces counter #", c.index, " on rank ", c.rank,
                            " (a dropped signal or credit)");
        break;
      }
      if (std::find(seen.begin(), seen.end(), p) != seen.end()) break;
      seen.push_back(p);
      if (opt.peers_remote && (p < lo || p >= hi)) {  // RankExecutor: a producer in another process
        // Its entry-fence counter (the last one, [Note: entry fence]) says whether it reached this run.
        const uint64_t f = opt.fence_run > 0 ? arena.counters(p)[arena.num_counters() - 1].load() : 0;
        if (opt.fence_run > 0 && f < fence_started(opt.fence_run))
          out += TIDE_STR_CAT("; root: rank ", p, " is behind (it has not started run #", opt.fence_run,
                              ": still in an earlier collective, stalled or dead)");
        else if (opt.fence_run > 0)
          out += TIDE_STR_CAT("; rank ", p, " has started run #", opt.fence_run, " and waits in its own process "
                              "(its waits are not visible here)");
        else
          out += TIDE_STR_CAT("; rank ", p, " runs in its own process (behind, stalled or dead; its waits are "
                              "not visible here)");
        break;
      }
      const BlockedWait* found = nullptr;
      int stream = -1;
      for (int s = 0; s < kMaxStreams && !found; ++s) {
        auto* bw = arena.shared()->blocked(p, s);
        if (bw->valid.load() && bw->counter_rank.load() != p) { found = bw; stream = s; }
      }
      for (int s = 0; s < kMaxStreams && !found; ++s) {
        auto* bw = arena.shared()->blocked(p, s);
        if (bw->valid.load()) { found = bw; stream = s; }
      }
      if (!found) {
        out += TIDE_STR_CAT("; root: rank ", p, " is not blocked on any wait (stalled, dead or finished early)");
        break;
      }
      const Program& pr = *per_rank[p].front().program;
      const int ci = found->counter_index.load();
      if (found->counter_rank.load() == kRailGroupBlocked) {
        const int64_t q = found->target.load();
        out += TIDE_STR_CAT(hop == 0 ? "; wait chain: " : " -> ", "rank ", p, " op ", found->op.load(), " [",
                            stream < static_cast<int>(pr.streams.size()) ? pr.streams[stream] : "?", "] seq ",
                            found->seq.load(), " is in rail group ", ci, " with rank ", q, ", which has not completed: "
                            "root: rank ", q, " never posted its matching group (behind, stalled or dead)");
        break;
      }
      out += TIDE_STR_CAT(hop == 0 ? "; wait chain: " : " -> ", "rank ", p, " op ", found->op.load(), " [",
                          stream < static_cast<int>(pr.streams.size()) ? pr.streams[stream] : "?", "] seq ",
                          found->seq.load(), " waits ", ci >= 0 && ci < static_cast<int>(pr.counter_names.size()) ? pr.counter_names[ci] : "?",
                          " on rank ", found->counter_rank.load(), " >= ", found->target.load());
      c = CounterRef{found->counter_rank.load(), ci};
    }
    return out;
  }

  // FNV-1a over a PUT's source (at send) or destination (at the receiver's wait) bytes.
  uint64_t put_hash(const RankState& rs, const Call& call, int idx, bool dst) {
    uint64_t h = 1469598103934665603ull;
    for (const auto& cd : op_at(rs, call, idx).copies) {
      const BufRef& b = dst ? cd.dst : cd.src;
      const uint8_t* p = dst ? arena.region(b.rank, b.kind) + b.offset : resolve(rs, call, idx, b);
      for (int64_t row = 0; row < b.height; ++row)
        for (int64_t i = 0; i < b.width; ++i) { h ^= p[row * b.pitch + i]; h *= 1099511628211ull; }
    }
    return h;
  }

  // After a WAIT on a PUT's counter: the delivered bytes must be unchanged (see internal.h).
  void verify_put(const RankState& rs, const Call& call, int idx) {
    const Op& op = call.program->ops[idx];
    if (op.counter.index < 0 || op.counter.index >= kChecksumCounters) return;
    auto* rec = arena.shared()->put_record(arena.world(), op.counter.rank, op.counter.index);
    if (rec->seq.load(std::memory_order_acquire) != call.seq) return;
    const int src = rec->src_rank.load(), op_idx = rec->op.load(), ci = rec->call.load();
    if (src < 0 || src >= arena.world() || ci < 0 || ci >= static_cast<int>(per_rank[src].size())) return;
    const Call& scall = per_rank[src][ci];
    if (scall.seq != call.seq || op_idx < 0 || op_idx >= static_cast<int>(scall.program->ops.size())) return;
    const Op& put = scall.program->ops[op_idx];
    if (put.kind != OpKind::kPut || put.counter.index != op.counter.index || put.counter.rank != op.counter.rank) return;
    RankState srs;
    srs.rank = src;
    if (put_hash(srs, scall, op_idx, true) != rec->hash.load())
      fail(1, TIDE_STR_CAT("corruption: ", op_name(rs, call, idx), " finds the bytes delivered by rank ", src, " op ",
                           op_idx, " PUT (call seq ", scall.seq, ") changed before they were consumed"));
  }

  int rail_rank(int r) const { return opt.rail_ranks ? (*opt.rail_ranks)[static_cast<size_t>(r)] : r; }

  // The rendezvous group at the head of a stream ([Note: two-sided rails]): posted to the rail
  // once, then polled. Returns the ops it covers once complete (its receives' counters bumped),
  // 0 while it is pending.
  size_t exec_group(RankState& rs, const Call& call, StreamCursor& cur, const std::vector<int>& list) {
    const Program& pr = *call.program;
    const int first = list[cur.pos];
    const int g = pr.ops[first].rail_group;
    const size_t end = rail_group_end(pr, list, cur.pos);
    if (opt.rail == nullptr)
      fail(1, TIDE_STR_CAT(op_name(rs, call, first), ": a two-sided rail group, but this executor has no rail "
                           "transport (ExecutorOptions.rails = 'two_sided' gives it one)"));
    if (cur.rail_ticket == 0) {
      std::vector<RailTransfer> sends, recvs;
      for (size_t k = cur.pos; k < end; ++k) {
        const Op& op = pr.ops[list[k]];
        for (const auto& cd : op.copies) {
          if (op.kind == OpKind::kSend)
            sends.push_back({rail_rank(cd.dst.rank), resolve(rs, call, list[k], cd.src), cd.src.width});
          else
            recvs.push_back({rail_rank(cd.src.rank), resolve(rs, call, list[k], cd.dst), cd.dst.width});
        }
      }
      if (opt.trace) std::fprintf(stderr, "[tide] %s (rail group %d)\n", op_name(rs, call, first).c_str(), g);
      cur.rail_ticket = opt.rail->start(rail_rank(rs.rank), sends, recvs);
    }
    bool done = false;
    try {
      done = opt.rail->test(cur.rail_ticket);
    } catch (const std::exception& e) {
      cur.rail_ticket = 0;
      fail(1, TIDE_STR_CAT(op_name(rs, call, first), ": rail group ", g, " failed: ", e.what()));
    }
    if (!done) return 0;
    cur.rail_ticket = 0;
    for (size_t k = cur.pos; k < end; ++k) {
      const Op& op = pr.ops[list[k]];
      if (op.kind == OpKind::kRecv && op.counter.index >= 0)
        counter(rs, call, list[k], op.counter).fetch_add(static_cast<uint64_t>(op.value), std::memory_order_release);
    }
    return end - cur.pos;
  }

  // Who a pending group waits for (timeout messages).
  std::string group_peers(const Call& call, const std::vector<int>& list, size_t pos) const {
    const Program& pr = *call.program;
    std::string s;
    for (size_t k = pos, e = rail_group_end(pr, list, pos); k < e; ++k) {
      const Op& op = pr.ops[list[k]];
      s += TIDE_STR_CAT(s.empty() ? "" : ", ", op.kind == OpKind::kSend ? "SEND to rank " : "RECV from rank ",
                        rail_rank(rail_peer(op)));
    }
    return s;
  }

  // Returns true when the op could run (and ran); false when its wait is unsatisfied.
  bool exec(RankState& rs, const Call& call, int idx) {
    const Op& op = op_at(rs, call, idx);
    switch (op.kind) {
      case OpKind::kWait:
      case OpKind::kEventWait: {
        const int64_t t = op.target(call.seq);
        if (t <= 0) return true;
        if (static_cast<int64_t>(counter(rs, call, idx, op.counter).load(std::memory_order_acquire)) < t) return false;
        if (op.kind == OpKind::kWait && op.tag == OpTag::kArrivalWait && !call.generator) verify_put(rs, call, idx);
        return true;
      }
      default: break;
    }
    if (opt.trace)
      std::fprintf(stderr, "[tide] %s\n", op_name(rs, call, idx).c_str());
    switch (op.kind) {
      case OpKind::kCopy:
      case OpKind::kPut:
        for (const auto& cd : op.copies) {
          if (cd.src.width != cd.dst.width || cd.src.height != cd.dst.height)
            fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": descriptor geometry mismatch"));
          const uint8_t* s = resolve(rs, call, idx, cd.src);
          uint8_t* d = resolve(rs, call, idx, cd.dst);
          const bool staged = opt.canary != nullptr && cd.dst.kind == BufKind::kStaging;
          const StagingCanary::Unit u{call.seq, op.round};
          for (int64_t h = 0; h < cd.src.height; ++h) {
            const int64_t a = cd.dst.offset + h * cd.dst.pitch;
            if (staged) {
              const std::string why = opt.canary->begin_write(cd.dst.rank, cd.dst.index, a, a + cd.dst.width, u, rs.rank);
              if (!why.empty()) fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": ", why));
            }
            std::memmove(d + h * cd.dst.pitch, s + h * cd.src.pitch, static_cast<size_t>(cd.src.width));
            if (staged) opt.canary->end_write(cd.dst.rank, cd.dst.index, u, rs.rank);
          }
        }
        if (op.kind == OpKind::kPut && op.counter.index >= 0) {
          auto& c = counter(rs, call, idx, op.counter);
          if (op.counter.index < kChecksumCounters && !call.generator) {
            auto* rec = arena.shared()->put_record(arena.world(), op.counter.rank, op.counter.index);
            rec->hash.store(put_hash(rs, call, idx, false));
            rec->src_rank.store(rs.rank);
            rec->op.store(idx);
            rec->call.store(static_cast<int32_t>(&call - rs.calls->data()));
            rec->seq.store(call.seq, std::memory_order_release);
          }
          c.fetch_add(static_cast<uint64_t>(op.value), std::memory_order_release);
        }
        break;
      case OpKind::kCast:
        if (op.cast_to != DType::kBF16 && op.cast_to != DType::kFP16)
          fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": CAST to ", dtype_name(op.cast_to), " (bfloat16 or float16)"));
        for (const auto& cd : op.copies) {
          if (cd.src.width != 2 * cd.dst.width || cd.src.height != cd.dst.height)
            fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": CAST geometry mismatch"));
          const uint8_t* s = resolve(rs, call, idx, cd.src);
          uint8_t* d = resolve(rs, call, idx, cd.dst);
          for (int64_t h = 0; h < cd.src.height; ++h)
            for (int64_t i = 0; i < cd.dst.width / 2; ++i) {
              float f;
              std::memcpy(&f, s + h * cd.src.pitch + 4 * i, 4);
              const uint16_t b = op.cast_to == DType::kFP16 ? fp32_to_fp16(f) : fp32_to_bf16(f);
              std::memcpy(d + h * cd.dst.pitch + 2 * i, &b, 2);
            }
        }
        break;
      case OpKind::kSum:
      case OpKind::kLand: {
        const int64_t n = op.dst.width / 4;
        std::vector<float> acc(static_cast<size_t>(n), 0.0f);
        std::vector<uint8_t> init(static_cast<size_t>(n), 0);
        std::vector<const SumTerm*> order;
        for (const auto& t : op.terms) order.push_back(&t);
        std::stable_sort(order.begin(), order.end(), [](const SumTerm* a, const SumTerm* b) { return a->term < b->term; });
        for (const SumTerm* t : order) {
          const int isz = dtype_size(t->dtype);
          if (t->dtype == DType::kU8)  // layout.cc [Note: byte items]: moved, never summed
            fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": SUM term of 1-byte items (uint8 has no arithmetic)"));
          if (t->dst_elem < 0 || t->dst_elem + t->elems > n || t->src.width < t->elems * isz)
            fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": SUM term out of range"));
          const uint8_t* s = resolve(rs, call, idx, t->src);
          if (opt.canary != nullptr && t->src.kind == BufKind::kStaging) {
            const std::string why = opt.canary->check_read(t->src.rank, t->src.index, t->src.offset,
                                                           t->src.offset + t->elems * isz, {call.seq, op.round});
            if (!why.empty()) fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": ", why));
          }
          for (int64_t i = 0; i < t->elems; ++i) {
            const float x = load_elem(s + i * isz, t->dtype);
            const size_t k = static_cast<size_t>(t->dst_elem + i);
            acc[k] = init[k] ? acc[k] + x : x;
            init[k] = 1;
          }
        }
        if (opt.canary != nullptr)
          for (const SumTerm* t : order)
            if (t->src.kind == BufKind::kStaging)
              opt.canary->mark_read(t->src.rank, t->src.index, t->src.offset,
                                    t->src.offset + t->elems * dtype_size(t->dtype), {call.seq, op.round});
        uint8_t* d = resolve(rs, call, idx, op.dst);
        for (int64_t i = 0; i < n; ++i) {
          float v = acc[static_cast<size_t>(i)];
          if (op.kind == OpKind::kLand || op.alpha != 1.0f) v = op.alpha * v;  // a SUM: only alpha != 1
          if (op.accumulate) { float o; std::memcpy(&o, d + 4 * i, 4); v = o + v; }
          std::memcpy(d + 4 * i, &v, 4);
        }
        break;
      }
      case OpKind::kZero: {
        uint8_t* d = resolve(rs, call, idx, op.dst);
        for (int64_t h = 0; h < op.dst.height; ++h) std::memset(d + h * op.dst.pitch, 0, static_cast<size_t>(op.dst.width));
        break;
      }
      case OpKind::kSignal:
      case OpKind::kCredit:
        counter(rs, call, idx, op.counter).fetch_add(static_cast<uint64_t>(op.value), std::memory_order_release);
        break;
      case OpKind::kEventRecord: {
        auto& c = counter(rs, call, idx, op.counter);
        const uint64_t v = static_cast<uint64_t>(std::max<int64_t>(0, op.target(call.seq)));
        uint64_t cur = c.load(std::memory_order_relaxed);
        while (cur < v && !c.compare_exchange_weak(cur, v, std::memory_order_release)) {}
        break;
      }
      default: break;
    }
    return true;
  }

  // Advances every stream of the rank as far as it can. Returns true on progress.
  bool step(RankState& rs) {
    if (rs.finished || rs.dead) return false;
    const auto now = Clock::now();
    if (rs.stall_armed && now < rs.stall_until) return false;
    bool progress = false, all_done = true;
    for (size_t s = 0; s < rs.cursors.size(); ++s) {
      auto& cur = rs.cursors[s];
      while (cur.call < rs.calls->size()) {
        const Call& call = (*rs.calls)[cur.call];
        int idx;
        if (call.generator) {  // [Note: generated programs] emit the stream's next step when needed
          if (cur.wpos >= cur.window.size()) {
            if (cur.step >= call.generator->steps(rs.rank, static_cast<int>(s))) {
              ++cur.call; cur.pos = 0; cur.step = 0; cur.window.clear(); cur.wpos = 0;
              continue;
            }
            cur.window.clear();
            cur.wpos = 0;
            call.generator->emit(rs.rank, static_cast<int>(s), cur.step++, cur.window);
            continue;
          }
          rs.cur = &cur.window[cur.wpos];
          idx = static_cast<int>(cur.pos);
        } else {
          const auto& list = rs.stream_ops[cur.call][s];
          if (cur.pos >= list.size()) { ++cur.call; cur.pos = 0; continue; }
          idx = list[cur.pos];
          rs.cur = &call.program->ops[idx];
        }
        if (cur.call == 0 && rs.rank == opt.dead_rank && idx >= opt.dead_op) { rs.dead = true; return progress; }
        if (cur.call == 0 && rs.rank == opt.stall_rank && idx >= opt.stall_op && !rs.stall_armed) {
          rs.stall_armed = true;
          rs.stall_until = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.stall_s));
          return true;
        }
        if (!call.generator && is_rail_op(*rs.cur)) {
          const auto& list = rs.stream_ops[cur.call][s];
          const size_t n = exec_group(rs, call, cur, list);
          if (n == 0) {
            if (!cur.blocked) {
              cur.blocked = true;
              cur.blocked_since = now;
              if (s < static_cast<size_t>(kMaxStreams)) {
                auto* bw = arena.shared()->blocked(rs.rank, static_cast<int>(s));
                bw->op.store(idx);
                bw->counter_rank.store(kRailGroupBlocked);
                bw->counter_index.store(rs.cur->rail_group);
                bw->target.store(rail_peer(*rs.cur));
                bw->seq.store(call.seq);
                bw->valid.store(1);
              }
            } else if (std::chrono::duration<double>(now - cur.blocked_since).count() > opt.timeout_s) {
              const std::string msg = TIDE_STR_CAT(
                  "TIDE timeout after ", opt.timeout_s, " s: ", op_name(rs, call, idx), ": rail group ",
                  rs.cur->rail_group, " (", group_peers(call, list, cur.pos), ") did not complete: a peer never "
                  "posted the matching group (behind, stalled or dead); the rail is aborted");
              opt.rail->abort(msg);
              fail(2, msg);
            }
            break;
          }
          if (cur.blocked && s < static_cast<size_t>(kMaxStreams)) arena.shared()->blocked(rs.rank, static_cast<int>(s))->valid.store(0);
          cur.blocked = false;
          cur.pos += n;
          rs.ops_done += static_cast<int64_t>(n);
          progress = true;
          continue;
        }
        if (!exec(rs, call, idx)) {
          if (!cur.blocked) {
            cur.blocked = true;
            cur.blocked_since = now;
            if (s < static_cast<size_t>(kMaxStreams)) {
              const Op& op = *rs.cur;
              auto* bw = arena.shared()->blocked(rs.rank, static_cast<int>(s));
              bw->op.store(idx);
              bw->counter_rank.store(op.counter.rank);
              bw->counter_index.store(op.counter.index);
              bw->target.store(op.target(call.seq));
              bw->seq.store(call.seq);
              bw->valid.store(1);
            }
          }
          else if (std::chrono::duration<double>(now - cur.blocked_since).count() >
                   (rs.cur->deadline_s > 0 ? rs.cur->deadline_s : opt.timeout_s)) {
            const Op& op = *rs.cur;
            const int64_t have = static_cast<int64_t>(counter(rs, call, idx, op.counter).load());
            const auto& names = call.program->counter_names;
            fail(2, TIDE_STR_CAT("TIDE timeout after ", op.deadline_s > 0 ? op.deadline_s : opt.timeout_s, " s: ", op_name(rs, call, idx), " waits for counter ",
                                 op.counter.index < static_cast<int>(names.size()) ? names[op.counter.index] : "?",
                                 " (#", op.counter.index, ") on rank ", op.counter.rank, " >= ", op.target(call.seq),
                                 ", has ", have, "; producer: ", producer_of(call, op.counter),
                                 wait_chain(op.counter)));
          }
          break;
        }
        if (cur.blocked && s < static_cast<size_t>(kMaxStreams)) arena.shared()->blocked(rs.rank, static_cast<int>(s))->valid.store(0);
        cur.blocked = false;
        ++cur.pos;
        if (call.generator) ++cur.wpos;
        ++rs.ops_done;
        progress = true;
      }
      if (cur.call < rs.calls->size()) all_done = false;
    }
    rs.finished = all_done;
    return progress;
  }

  RankState make_state(int r) {
    RankState rs;
    rs.rank = r;
    rs.calls = &per_rank[r];
    size_t streams = 0;
    for (const auto& c : per_rank[r]) streams = std::max(streams, c.program->streams.size());
    rs.cursors.resize(streams);
    for (const auto& c : per_rank[r]) {
      std::vector<std::vector<int>> so(streams);
      for (size_t i = 0; i < c.program->ops.size() && !c.generator; ++i) so[c.program->ops[i].stream].push_back(static_cast<int>(i));
      rs.stream_ops.push_back(std::move(so));
    }
    return rs;
  }

  // Steps ranks [lo, hi) until all finish or the run aborts. Exceptions propagate.
  void work(int lo_rank, int hi_rank) {
    lo = lo_rank;
    hi = hi_rank;
    std::vector<RankState> states;
    for (int r = lo; r < hi; ++r) states.push_back(make_state(r));
    int idle = 0;
    for (;;) {
      if (arena.shared()->abort.load()) return;
      bool progress = false, done = true;
      for (auto& rs : states) {
        progress |= step(rs);
        if (!rs.finished && !rs.dead) done = false;
      }
      if (done) return;
      if (progress) { idle = 0; continue; }
      if (++idle < 64) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(idle < 1024 ? 20 : 200));
      // [Note: interrupting a call] (executor.cc): a runner on the calling thread polls while it waits
      if (opt.interrupted && idle % 64 == 0 && poll_interrupt(arena.shared(), opt, interrupted)) return;
    }
  }
  bool interrupted = false;
};

}  // namespace

void step_ranks(const ArenaView& view, const std::vector<std::vector<Call>>& per_rank,
                std::vector<RankBindings>& bindings, const CpuRunOptions& opt, int lo, int hi) {
  Runner runner{view, per_rank, bindings, opt};
  runner.work(lo, hi);
}

}  // namespace tide
