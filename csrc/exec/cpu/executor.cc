// CPU executor: steps every rank's streams over the shared arena (threads or processes).
#include <sys/mman.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <csignal>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "exec/cpu/internal.h"
#include "exec/cpu/staging_canary.h"
#include "tide/exec_cpu.h"
#include "tide/numerics.h"
#include "tide/program_index.h"

namespace tide {

namespace {

using Clock = std::chrono::steady_clock;

float fp16_to_fp32(uint16_t h) {
  const uint32_t s = (h >> 15) & 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
            : e == 31 ? (m ? NAN : INFINITY)
                      : std::ldexp(static_cast<float>(m | 0x400), static_cast<int>(e) - 25);
  return s ? -v : v;
}
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
            if (staged) opt.canary->end_write(cd.dst.rank, cd.dst.index, a, a + cd.dst.width, u);
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
        for (const auto& cd : op.copies) {
          if (cd.src.width != 2 * cd.dst.width || cd.src.height != cd.dst.height)
            fail(1, TIDE_STR_CAT(op_name(rs, call, idx), ": CAST geometry mismatch"));
          const uint8_t* s = resolve(rs, call, idx, cd.src);
          uint8_t* d = resolve(rs, call, idx, cd.dst);
          for (int64_t h = 0; h < cd.src.height; ++h)
            for (int64_t i = 0; i < cd.dst.width / 2; ++i) {
              float f;
              std::memcpy(&f, s + h * cd.src.pitch + 4 * i, 4);
              const uint16_t b = fp32_to_bf16(f);
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
      // [Note: interrupting a call] a runner on the calling thread polls while it waits
      if (opt.interrupted && idle % 64 == 0 && poll_interrupt(arena.shared(), opt, interrupted)) return;
    }
  }
  bool interrupted = false;
};

}  // namespace

// [Note: interrupting a call] The calling thread polls opt.interrupted (Python's signal check)
// while the ranks run: run_polled's wait with ranks as threads or processes, a RankExecutor's
// own step loop (it runs on the calling thread) when it idles. On true it claims the call's error (so no rank's later timeout replaces
// it), raises the arena's abort flag, which every rank's step loop reads (threads and forked
// processes alike: it lives in the shared arena), and the call throws Interrupted once the ranks
// have stopped; a rank process that does not stop within a second is killed.
constexpr int kInterrupted = 3;  // Shared::error_kind of an interrupted call
bool poll_interrupt(CpuArena::Shared* sh, const CpuRunOptions& opt, bool& interrupted) {
  if (interrupted || !opt.interrupted || !opt.interrupted()) return interrupted;
  int expected = 0;
  if (sh->claimed.compare_exchange_strong(expected, 1)) {
    std::snprintf(sh->message, sizeof(sh->message), "%s",
                  "interrupted: the caller stopped the call while its ranks ran (every rank stopped; "
                  "the call's outputs are undefined)");
    sh->error_kind.store(kInterrupted);
  }
  sh->abort.store(1);
  return interrupted = true;
}

// Runs work(0) .. work(workers - 1) on threads of their own while the calling thread polls
// opt.interrupted; returns when every worker is done. A worker's exception that no rank recorded
// in Shared (Runner::fail records the call's first failure) is rethrown here; recorded ones are
// the caller's rethrow_shared.
static void run_polled(CpuArena::Shared* sh, const CpuRunOptions& opt, int workers,
                       const std::function<void(int)>& work) {
  int running = workers;  // under mu; the last worker out wakes the polling caller
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr first;  // a worker's exception that Runner::fail did not record in Shared
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w)
    threads.emplace_back([&, w] {
      std::exception_ptr e;
      try { work(w); } catch (...) { e = std::current_exception(); }
      std::lock_guard<std::mutex> lk(mu);
      if (e && !first) first = e;
      if (--running == 0) cv.notify_all();
    });
  bool interrupted = false;
  if (opt.interrupted) {
    std::unique_lock<std::mutex> lk(mu);
    while (!cv.wait_for(lk, std::chrono::milliseconds(20), [&] { return running == 0; })) {
      lk.unlock();
      poll_interrupt(sh, opt, interrupted);
      lk.lock();
    }
  }
  for (auto& t : threads) t.join();
  if (first && !sh->claimed.load()) std::rethrow_exception(first);  // the call must not look successful
}

void rethrow_shared(CpuArena::Shared* sh) {
  if (!sh->claimed.load()) return;
  std::string msg(sh->message);
  if (sh->error_kind.load() == 2) throw TimeoutError(msg);
  if (sh->error_kind.load() == kInterrupted) throw Interrupted(msg);
  throw Error(msg);
}

void step_ranks(const ArenaView& view, const std::vector<std::vector<Call>>& per_rank,
                std::vector<RankBindings>& bindings, const CpuRunOptions& opt, int lo, int hi) {
  Runner runner{view, per_rank, bindings, opt};
  runner.work(lo, hi);
}

void run_cpu(CpuArena& arena, const std::vector<std::vector<Call>>& per_rank,
             std::vector<RankBindings>& bindings, const CpuRunOptions& opt) {
  const int N = arena.world();
  TIDE_PLAN_CHECK(static_cast<int>(per_rank.size()) == N, "run_cpu: ", per_rank.size(), " call lists for ", N, " ranks");
  TIDE_PLAN_CHECK(static_cast<int>(bindings.size()) == N, "run_cpu: ", bindings.size(), " bindings for ", N, " ranks");
  // Ranks agree on the collective before any data moves: same (group, seq, plan hash) order.
  for (int r = 0; r < N && opt.verify_agreement; ++r) {
    TIDE_PLAN_CHECK(per_rank[r].size() == per_rank[0].size(), "run_cpu: rank ", r, " has ",
                    per_rank[r].size(), " calls, rank 0 has ", per_rank[0].size());
    for (size_t c = 0; c < per_rank[r].size(); ++c) {
      const Program& a = *per_rank[0][c].program;
      const Program& b = *per_rank[r][c].program;
      TIDE_CHECK(b.rank == r, "program for rank ", b.rank, " bound to rank ", r);
      if (a.plan_hash != b.plan_hash)
        throw Error(TIDE_STR_CAT("plan mismatch: rank ", r, " call ", c, " runs plan hash ", b.plan_hash,
                                 ", rank 0 runs ", a.plan_hash, " (ranks must agree on plans)"));
      if (a.group != b.group || per_rank[0][c].seq != per_rank[r][c].seq)
        throw Error(TIDE_STR_CAT("collective order mismatch: rank ", r, " call ", c, " is (group ", b.group,
                                 ", seq ", per_rank[r][c].seq, "), rank 0 has (group ", a.group, ", seq ",
                                 per_rank[0][c].seq, ")"));
    }
  }
  auto* sh = arena.shared();
  sh->abort.store(0);
  sh->claimed.store(0);
  sh->error_kind.store(0);
  sh->message[0] = 0;
  for (int r = 0; r < N; ++r)
    for (int s = 0; s < kMaxStreams; ++s) sh->blocked(r, s)->valid.store(0);
  const ArenaView view = arena.view();

  for (int r = 0; r < N; ++r)
    for (const auto& call : per_rank[r])
      TIDE_PLAN_CHECK(call.program->rails == Rails::kOneSided || (!opt.processes && opt.rail != nullptr),
                      "run_cpu: rank ", r, " runs a two-sided program, which needs a rail transport and ranks as "
                      "threads (ExecutorOptions.rails = 'two_sided', processes=false)");
  if (!opt.processes) {
    const int W = std::max(1, std::min(N, opt.workers > 0 ? opt.workers : 4));
    StagingCanary canary;
    CpuRunOptions topt = opt;  // the workers': the calling thread polls (run_polled)
    topt.canary = &canary;
    topt.interrupted = nullptr;
    run_polled(sh, opt, W, [&](int w) {
      const int lo = static_cast<int>(static_cast<int64_t>(N) * w / W);
      const int hi = static_cast<int>(static_cast<int64_t>(N) * (w + 1) / W);
      step_ranks(view, per_rank, bindings, topt, lo, hi);
    });
  } else {
    TIDE_PLAN_CHECK(arena.shared_memory(), "run_cpu: processes mode needs a shared-memory arena");
    for (int r = 0; r < N; ++r)
      for (const auto& call : per_rank[r])
        TIDE_PLAN_CHECK(!call.generator, "run_cpu: rank ", r, " runs a generated program, which runs in threads "
                        "mode only (processes=false)");
    // [Note: process bounce buffers] Children inherit user inputs copy-on-write, but their writes
    // to user buffers would stay private, so every user buffer the programs write is bounced
    // through a shared anonymous mapping and copied back by the parent.
    struct Bounce { UserBuffer* slot; void* orig; void* shared; int64_t bytes; };
    std::vector<Bounce> bounces;
    for (int r = 0; r < N; ++r)
      for (const auto& call : per_rank[r])
        for (const auto& op : call.program->ops) {
          auto note = [&](const BufRef& b) {
            if (!is_user_buffer(b.kind)) return;
            auto& v = bindings[r].by_kind[static_cast<int>(b.kind)];
            const size_t slot = static_cast<size_t>(b.index + 1);
            if (slot >= v.size() || !v[slot].data) return;
            for (const auto& bo : bounces) if (bo.slot == &v[slot]) return;
            void* m = mmap(nullptr, static_cast<size_t>(std::max<int64_t>(1, v[slot].bytes)), PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) throw Error("run_cpu: bounce mapping failed");
            std::memcpy(m, v[slot].data, static_cast<size_t>(v[slot].bytes));
            bounces.push_back({&v[slot], v[slot].data, m, v[slot].bytes});
            v[slot].data = m;
          };
          for (const auto& cd : op.copies) note(cd.dst);
          if (op.kind == OpKind::kSum || op.kind == OpKind::kLand || op.kind == OpKind::kZero) note(op.dst);
        }
    const int nproc = std::min(N, 64);
    std::vector<pid_t> pids;
    std::fflush(stderr);
    std::fflush(stdout);
    const pid_t parent = getpid();
    CpuRunOptions child = opt;
    child.interrupted = nullptr;  // only the calling process polls (a child must not call into Python)
    for (int w = 0; w < nproc; ++w) {
      const int lo = static_cast<int>(static_cast<int64_t>(N) * w / nproc);
      const int hi = static_cast<int>(static_cast<int64_t>(N) * (w + 1) / nproc);
      const pid_t pid = fork();
      if (pid < 0) { sh->abort.store(1); break; }
      if (pid == 0) {
        // A rank process dies with the process that forked it (a kill -9 of the parent must not
        // leave ranks spinning on a shared arena): the death signal, then the check for a parent
        // that was gone before it was armed.
#ifdef __linux__
        prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
        if (getppid() != parent) _exit(4);
        int code = 0;
        try {
          step_ranks(view, per_rank, bindings, child, lo, hi);
          for (int r = lo; r < hi; ++r)
            if (r == opt.dead_rank) code = 3;  // a dead peer exits without finishing
        } catch (...) { code = 1; }
        _exit(code);
      }
      pids.push_back(pid);
    }
    std::string died;
    std::vector<int> status(pids.size(), 0);
    std::vector<bool> reaped(pids.size(), false);
    bool interrupted = false;  // [Note: interrupting a call]
    auto since = std::chrono::steady_clock::now();
    for (size_t left = pids.size(), tick = 0; left > 0; ++tick) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (reaped[i]) continue;
        const pid_t got = waitpid(pids[i], &status[i], WNOHANG);
        if (got == pids[i] || (got < 0 && errno == ECHILD)) reaped[i] = true, --left;  // ECHILD: reaped elsewhere
      }
      if (left == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      if (!interrupted && tick % 10 == 9 && poll_interrupt(sh, opt, interrupted))  // every ~20 ms
        since = std::chrono::steady_clock::now();
      if (interrupted && std::chrono::steady_clock::now() - since > std::chrono::seconds(1))
        for (size_t i = 0; i < pids.size(); ++i)
          if (!reaped[i]) kill(pids[i], SIGKILL);  // a rank that did not see the abort (e.g. asleep)
    }
    for (size_t i = 0; i < pids.size() && !interrupted; ++i)
      if (WIFSIGNALED(status[i]) && died.empty())
        died = TIDE_STR_CAT("rank process ", i, " killed by signal ", WTERMSIG(status[i]));
    for (auto& b : bounces) {
      std::memcpy(b.orig, b.shared, static_cast<size_t>(b.bytes));
      munmap(b.shared, static_cast<size_t>(std::max<int64_t>(1, b.bytes)));
      b.slot->data = b.orig;
    }
    if (!died.empty() && !sh->claimed.load()) throw Error(died);
    if (static_cast<int>(pids.size()) < nproc && !sh->claimed.load()) throw Error("run_cpu: fork failed");
  }
  rethrow_shared(sh);
  arena.check_canaries();
}

}  // namespace tide
