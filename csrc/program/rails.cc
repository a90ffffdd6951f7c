// Two-sided rail lowering ([Note: two-sided rails] in tide/program.h): a built one-sided program
// set becomes one whose only cross-node operations are SEND/RECV rendezvous groups on a
// "rail_p2p" stream, the form NCCL send/recv (and torch.distributed send/recv) can realise.
//
// Contract
//   - Pure: rewrites `progs` in place; the same one-sided set always lowers to the same set.
//   - What moves where (rank s sends to rank t on another node):
//       PUT on s, stream X        -> X: EVENT_RECORD pre[X] ; EVENT_WAIT post[X]
//                                    s rail_p2p: EVENT_WAIT pre[X] ; SEND ; EVENT_RECORD post[X]
//                                    t rail_p2p: RECV (bumps t's arrival counter)
//       SIGNAL/CREDIT t -> (s, k) -> the same op on t's fresh counter a(s, k)
//       WAIT on s for (s, k)      -> t rail_p2p: WAIT a(s, k), before the RECV of the next PUT from
//                                    s to t on the waiting stream (the transfer it guarded)
//     pre/post count the rail units of their stream (K per call: the j-th has target
//     j + 1 - K + K*seq), so they are seq-independent like every counter. A unit is one PUT, or
//     a rank's adjacent PUTs of one group on one stream: pre/post sit at its last PUT.
//   - Key = (round, tag, ordinal among the sender's PUTs with that round and tag); keys of one
//     round share a group where the schedule allows (the Note says when); every rank issues its
//     groups in ascending key order, which each sender's stream order must agree with. Per group,
//     one SEND and one RECV per peer, rows that continue each other merged into one message.
#include <algorithm>
#include <map>
#include <tuple>

#include "tide/errors.h"
#include "tide/program.h"

namespace tide {

const char* rails_name(Rails r) { return r == Rails::kTwoSided ? "two_sided" : "one_sided"; }

Rails parse_rails(const std::string& name, const std::string& where) {
  if (name == "one_sided") return Rails::kOneSided;
  if (name == "two_sided") return Rails::kTwoSided;
  throw PlanError(TIDE_STR_CAT(where, ": expected one of one_sided, two_sided, got '", name, "'"));
}

int rail_peer(const Op& op) {
  if (op.copies.empty()) return -1;
  return op.kind == OpKind::kRecv ? op.copies.front().src.rank : op.copies.front().dst.rank;
}

size_t rail_group_end(const Program& pr, const std::vector<int>& stream_ops, size_t k) {
  const int g = pr.ops[static_cast<size_t>(stream_ops[k])].rail_group;
  size_t e = k;
  while (e < stream_ops.size() && is_rail_op(pr.ops[static_cast<size_t>(stream_ops[e])]) &&
         pr.ops[static_cast<size_t>(stream_ops[e])].rail_group == g)
    ++e;
  return e;
}

RailStats rail_stats(const Program& prog) {
  RailStats st;
  int32_t last = -1;
  for (const Op& op : prog.ops) {
    if (!is_rail_op(op)) continue;
    if (op.rail_group != last) ++st.groups;  // a group's ops are consecutive on rail_p2p
    last = op.rail_group;
    if (op.kind == OpKind::kRecv) {
      ++st.recvs;
      continue;
    }
    ++st.sends;
    for (const auto& cd : op.copies) {
      ++st.send_messages;
      st.send_bytes += cd.src.bytes();
    }
  }
  return st;
}

namespace {

using Key = std::tuple<int32_t, uint16_t, int32_t>;  // round, tag, ordinal

struct Guard {  // a moved wait: receiver's counter a(s, k) >= value + per_call*seq
  int32_t counter = -1;
  int64_t value = 0, per_call = 0;
  double deadline_s = 0;
};

struct PutInfo {
  int rank = 0, op = 0, peer = 0;
  uint8_t stream = 0;
  int ordinal_in_stream = 0;  // j among the cross-node PUTs of its stream
  Key key;
  std::vector<Guard> guards;  // waits moved to the receiver
  bool empty = false;         // no data: the receiver bumps the counter itself at the key's place
};

// Appends a 1-D row to a transfer's rows, extending the last one when it continues it in both
// source and destination (one larger message).
void append_row(std::vector<CopyDesc>& rows, const CopyDesc& cd) {
  if (!rows.empty()) {
    CopyDesc& b = rows.back();
    auto continues = [](const BufRef& a, const BufRef& c) {
      return a.kind == c.kind && a.rank == c.rank && a.index == c.index && a.offset + a.width == c.offset;
    };
    if (continues(b.src, cd.src) && continues(b.dst, cd.dst)) {
      b.src.width += cd.src.width;
      b.dst.width += cd.dst.width;
      return;
    }
  }
  rows.push_back(cd);
}

std::vector<CopyDesc> rows_of(const Op& op) {  // 1-D descriptors (a 2-D copy row by row)
  std::vector<CopyDesc> out;
  for (const auto& cd : op.copies)
    for (int64_t h = 0; h < cd.src.height; ++h) {
      CopyDesc r = cd;
      r.src.offset += h * (cd.src.height > 1 ? cd.src.pitch : 0);
      r.dst.offset += h * (cd.dst.height > 1 ? cd.dst.pitch : 0);
      r.src.height = r.dst.height = 1;
      r.src.pitch = r.dst.pitch = 0;
      append_row(out, r);
    }
  return out;
}

Op counter_op(OpKind kind, uint8_t stream, const Op& like, int rank, int32_t counter, int64_t value,
              int64_t per_call) {
  Op op;
  op.kind = kind;
  op.stream = stream;
  op.tag = like.tag;
  op.round = like.round;
  op.counter = {rank, counter};
  op.value = value;
  op.per_call = per_call;
  return op;
}

}  // namespace

void lower_two_sided(std::vector<Program>& progs) {
  const int N = static_cast<int>(progs.size());
  if (N == 0) return;
  const Topology topo = progs[0].topo;
  auto cross = [&](int a, int b) { return topo.node_of(a) != topo.node_of(b); };
  for (int r = 0; r < N; ++r) {
    TIDE_PLAN_CHECK(progs[r].rank == r, "lower_two_sided: program ", r, " is rank ", progs[r].rank, "'s");
    TIDE_PLAN_CHECK(progs[r].rails == Rails::kOneSided, "lower_two_sided: rank ", r, "'s program is already two-sided");
    TIDE_PLAN_CHECK(progs[r].streams == progs[0].streams, "lower_two_sided: ranks 0 and ", r, " name different streams");
  }
  auto where = [&](int r, size_t i) {
    const Op& op = progs[r].ops[i];
    return TIDE_STR_CAT("lower_two_sided: rank ", r, " op ", i, " ", op_kind_name(op.kind), " [",
                        progs[r].streams[op.stream], "] tag ", op_tag_name(op.tag));
  };

  // Pass A: fresh local counters for cross-node signals; the cross-node PUTs.
  std::vector<int32_t> next(N);
  for (int r = 0; r < N; ++r) next[r] = progs[r].num_counters;
  std::vector<std::vector<std::string>> new_names(N);
  std::map<std::pair<int, int32_t>, std::pair<int, int32_t>> absorbed;  // (s, k) -> (t, a)
  std::map<std::pair<int, int>, size_t> put_of;                          // (rank, op) -> puts index
  std::vector<PutInfo> puts;
  for (int t = 0; t < N; ++t) {
    const Program& pr = progs[t];
    std::map<std::tuple<int32_t, uint16_t>, int> ordinal;
    for (size_t i = 0; i < pr.ops.size(); ++i) {
      const Op& op = pr.ops[i];
      switch (op.kind) {
        case OpKind::kSignal:
        case OpKind::kCredit:
          if (cross(t, op.counter.rank)) {
            auto& slot = absorbed[{op.counter.rank, op.counter.index}];
            TIDE_PLAN_CHECK(slot.second == 0 || slot.first == t, where(t, i), ": counter ", op.counter.index, " of rank ",
                            op.counter.rank, " has producers on two ranks");
            if (slot.second == 0) {
              const auto& names = progs[op.counter.rank].counter_names;
              const std::string nm = op.counter.index < static_cast<int>(names.size()) ? names[op.counter.index] : "?";
              slot = {t, next[t]++};
              new_names[t].push_back(TIDE_STR_CAT("rail:", nm, " of rank ", op.counter.rank));
            }
          }
          break;
        case OpKind::kWait:
        case OpKind::kEventWait:
          TIDE_PLAN_CHECK(op.counter.rank == t, where(t, i), ": waits on a counter of rank ", op.counter.rank,
                          " (waits are rank-local)");
          break;
        case OpKind::kPut: {
          const int peer = op.copies.empty() ? op.counter.rank : op.copies.front().dst.rank;
          if (op.copies.empty() && op.counter.index < 0) break;  // a no-op
          for (const auto& cd : op.copies)
            TIDE_PLAN_CHECK(cd.dst.rank == peer, where(t, i), ": a PUT's descriptors target ranks ", peer, " and ",
                            cd.dst.rank);
          if (!cross(t, peer)) break;
          TIDE_PLAN_CHECK(op.counter.index < 0 || op.counter.rank == peer, where(t, i),
                          ": a PUT's signal and its descriptors target different ranks");
          put_of[{t, static_cast<int>(i)}] = puts.size();
          PutInfo p;
          p.rank = t;
          p.op = static_cast<int>(i);
          p.peer = peer;
          p.stream = op.stream;
          p.empty = op.copies.empty();
          p.key = Key{op.round, static_cast<uint16_t>(op.tag), ordinal[{op.round, static_cast<uint16_t>(op.tag)}]++};
          puts.push_back(p);
          break;
        }
        default:
          for (const auto& cd : op.copies)
            TIDE_PLAN_CHECK(!cross(t, cd.dst.rank) && !cross(t, cd.src.rank), where(t, i),
                            ": reaches rank ", cross(t, cd.dst.rank) ? cd.dst.rank : cd.src.rank,
                            " on another node without a rail PUT");
          for (const auto& term : op.terms)
            TIDE_PLAN_CHECK(!cross(t, term.src.rank), where(t, i), ": reads rank ", term.src.rank,
                            " on another node");
          break;
      }
    }
  }

  // Pass B: waits on absorbed counters move to the receiver of the transfer they guard.
  std::vector<std::vector<char>> removed(N);
  for (int s = 0; s < N; ++s) {
    const Program& pr = progs[s];
    removed[s].assign(pr.ops.size(), 0);
    for (size_t i = 0; i < pr.ops.size(); ++i) {
      const Op& op = pr.ops[i];
      if (op.kind != OpKind::kWait && op.kind != OpKind::kEventWait) continue;
      auto it = absorbed.find({s, op.counter.index});
      if (it == absorbed.end()) continue;
      const int t = it->second.first;
      size_t j = i + 1;
      for (; j < pr.ops.size(); ++j) {
        const Op& o = pr.ops[j];
        if (o.stream == op.stream && o.kind == OpKind::kPut && put_of.count({s, static_cast<int>(j)}) &&
            puts[put_of[{s, static_cast<int>(j)}]].peer == t)
          break;
      }
      TIDE_PLAN_CHECK(j < pr.ops.size(), where(s, i), ": waits for a counter rank ", t, " (another node) bumps, but "
                      "no rail transfer to rank ", t, " follows it on its stream: not lowerable to two-sided rails");
      puts[put_of[{s, static_cast<int>(j)}]].guards.push_back(Guard{it->second.second, op.value, op.per_call, op.deadline_s});
      removed[s][i] = 1;
    }
  }

  // Pass C: keys. Each rank's PUTs (per stream) must come in ascending key order.
  std::map<Key, std::vector<size_t>> by_key;  // key -> its transfers
  std::vector<std::map<Key, size_t>> outgoing(N), incoming(N);
  std::vector<std::map<uint8_t, Key>> last_key(N);
  for (size_t x = 0; x < puts.size(); ++x) {
    PutInfo& p = puts[x];
    auto lk = last_key[p.rank].find(p.stream);
    TIDE_PLAN_CHECK(lk == last_key[p.rank].end() || lk->second < p.key, where(p.rank, static_cast<size_t>(p.op)),
                    ": its rail transfers are not in (round, tag) order on their stream: not lowerable");
    last_key[p.rank][p.stream] = p.key;
    by_key[p.key].push_back(x);
    outgoing[p.rank][p.key] = x;
    TIDE_PLAN_CHECK(!incoming[p.peer].count(p.key), where(p.rank, static_cast<size_t>(p.op)), ": rank ", p.peer,
                    " receives two transfers of round ", std::get<0>(p.key), " tag ",
                    op_tag_name(static_cast<OpTag>(std::get<1>(p.key))), " #", std::get<2>(p.key), " (ranks ",
                    puts[incoming[p.peer].count(p.key) ? incoming[p.peer][p.key] : x].rank, " and ", p.rank, ")");
    incoming[p.peer][p.key] = x;
  }

  // Pass C': groups ([Note: two-sided rails], "one group per round"). Keys in ascending order;
  // a key joins the group of the key before it when both are of one round and every transfer of
  // it is mergeable: no guard, and its sender's previous transfer in the group sits right before
  // it on the same stream (no op between), so one pre/post pair covers both.
  auto adjacent = [&](const PutInfo& a, const PutInfo& b) {  // b right after a on a's stream
    if (a.rank != b.rank || a.stream != b.stream || a.op >= b.op) return false;
    const Program& pr = progs[a.rank];
    for (int i = a.op + 1; i < b.op; ++i)
      if (pr.ops[static_cast<size_t>(i)].stream == a.stream) return false;
    return true;
  };
  std::map<Key, int> group_of;
  std::vector<std::vector<Key>> group_keys;
  {
    std::map<int, size_t> last;  // rank -> its latest transfer in the open group
    for (const auto& [key, xs] : by_key) {
      bool join = !group_keys.empty() && std::get<0>(group_keys.back().front()) == std::get<0>(key);
      for (size_t x : xs) {
        if (!join) break;
        auto it = last.find(puts[x].rank);
        join = puts[x].guards.empty() && it != last.end() && adjacent(puts[it->second], puts[x]);
      }
      if (!join) {
        group_keys.emplace_back();
        last.clear();
      }
      group_keys.back().push_back(key);
      group_of[key] = static_cast<int>(group_keys.size()) - 1;
      for (size_t x : xs) last[puts[x].rank] = x;
    }
  }
  // Units: a rank's transfers of one group (adjacent on one stream) share one pre/post pair,
  // placed at the last non-empty one; pre/post count the stream's units (K per call).
  std::vector<std::map<uint8_t, int>> per_stream(N);  // stream -> units per call
  std::vector<char> unit_end(puts.size(), 0);
  for (int r = 0; r < N; ++r) {
    int open = -1;
    size_t last_full = puts.size();
    for (const auto& [key, x] : outgoing[r]) {
      const int g = group_of.at(key);
      if (g != open && last_full < puts.size()) unit_end[last_full] = 1;
      if (g != open) last_full = puts.size();
      open = g;
      if (puts[x].empty) continue;
      if (last_full == puts.size()) puts[x].ordinal_in_stream = per_stream[r][puts[x].stream]++;
      else puts[x].ordinal_in_stream = puts[last_full].ordinal_in_stream;
      last_full = x;
    }
    if (last_full < puts.size()) unit_end[last_full] = 1;
  }

  // Pass D: rewrite every rank.
  const uint8_t rail = static_cast<uint8_t>(progs[0].streams.size());
  std::vector<std::map<uint8_t, std::pair<int32_t, int32_t>>> prepost(N);  // stream -> (pre, post)
  for (int r = 0; r < N; ++r)
    for (const auto& [stream, count] : per_stream[r]) {
      (void)count;
      prepost[r][stream] = {next[r], next[r] + 1};
      next[r] += 2;
      new_names[r].push_back(TIDE_STR_CAT("ev:rail_pre[", progs[r].streams[stream], "]"));
      new_names[r].push_back(TIDE_STR_CAT("ev:rail_post[", progs[r].streams[stream], "]"));
    }
  const int32_t num_counters = *std::max_element(next.begin(), next.end());
  std::vector<std::vector<Op>> rewritten(N);
  for (int r = 0; r < N; ++r) {
    const Program& pr = progs[r];
    std::vector<Op>& out = rewritten[r];
    out.reserve(pr.ops.size() + 4 * puts.size() / static_cast<size_t>(N) + 4);
    for (size_t i = 0; i < pr.ops.size(); ++i) {
      if (removed[r][i]) continue;
      const Op& op = pr.ops[i];
      if ((op.kind == OpKind::kSignal || op.kind == OpKind::kCredit) && cross(r, op.counter.rank)) {
        Op local = op;
        local.counter = {r, absorbed.at({op.counter.rank, op.counter.index}).second};
        out.push_back(local);
        continue;
      }
      auto pit = put_of.find({r, static_cast<int>(i)});
      if (pit == put_of.end()) {
        out.push_back(op);
        continue;
      }
      const PutInfo& p = puts[pit->second];
      if (p.empty || !unit_end[pit->second]) continue;  // the receiver bumps; or the unit goes on
      const int K = per_stream[r].at(p.stream);
      const auto [pre, post] = prepost[r].at(p.stream);
      out.push_back(counter_op(OpKind::kEventRecord, op.stream, op, r, pre, p.ordinal_in_stream + 1 - K, K));
      out.push_back(counter_op(OpKind::kEventWait, op.stream, op, r, post, p.ordinal_in_stream + 1 - K, K));
    }
    // The rail_p2p stream: groups in key order; per peer one SEND and one RECV.
    for (size_t gid = 0; gid < group_keys.size(); ++gid) {
      std::vector<size_t> sends, recvs;
      for (const Key& key : group_keys[gid]) {
        if (auto o = outgoing[r].find(key); o != outgoing[r].end()) sends.push_back(o->second);
        if (auto in = incoming[r].find(key); in != incoming[r].end()) recvs.push_back(in->second);
      }
      if (sends.empty() && recvs.empty()) continue;
      for (size_t x : recvs)
        for (const Guard& gd : puts[x].guards) {
          Op w = counter_op(OpKind::kWait, rail, progs[puts[x].rank].ops[puts[x].op], r, gd.counter, gd.value,
                            gd.per_call);
          w.tag = OpTag::kCreditWait;
          w.deadline_s = gd.deadline_s;
          out.push_back(w);
        }
      const PutInfo* unit = nullptr;  // the group's last non-empty SEND: its unit's pre/post
      for (size_t x : sends)
        if (!puts[x].empty) unit = &puts[x];
      int K = 0;
      if (unit) {
        K = per_stream[r].at(unit->stream);
        out.push_back(counter_op(OpKind::kEventWait, rail, pr.ops[unit->op], r, prepost[r].at(unit->stream).first,
                                 unit->ordinal_in_stream + 1 - K, K));
      }
      std::vector<Op> after;  // the group's other receive-side bumps, once its transfers are done
      auto transfers = [&](const std::vector<size_t>& xs, OpKind kind) {
        std::map<int, size_t> at;  // peer -> its op in `out`
        for (size_t x : xs) {
          const PutInfo& p = puts[x];
          const Op& put = progs[p.rank].ops[p.op];
          const int peer = kind == OpKind::kSend ? p.peer : p.rank;
          if (p.empty) {
            if (kind == OpKind::kRecv) after.push_back(counter_op(OpKind::kSignal, rail, put, r, put.counter.index, put.value, 0));
            continue;
          }
          auto it = at.find(peer);
          if (it == at.end()) {
            Op t = put;
            t.kind = kind;
            t.stream = rail;
            t.copies = rows_of(put);
            t.rail_group = static_cast<int32_t>(gid);
            if (kind == OpKind::kSend) {
              t.counter = CounterRef{};
              t.value = 0;
            }
            at[peer] = out.size();
            out.push_back(std::move(t));
            continue;
          }
          for (const CopyDesc& cd : rows_of(put)) append_row(out[it->second].copies, cd);
          if (kind == OpKind::kRecv && put.counter.index >= 0)
            after.push_back(counter_op(OpKind::kSignal, rail, put, r, put.counter.index, put.value, 0));
        }
      };
      transfers(sends, OpKind::kSend);
      transfers(recvs, OpKind::kRecv);
      for (Op& a : after) out.push_back(std::move(a));
      if (unit)
        out.push_back(counter_op(OpKind::kEventRecord, rail, pr.ops[unit->op], r, prepost[r].at(unit->stream).second,
                                 unit->ordinal_in_stream + 1 - K, K));
    }
  }
  for (int r = 0; r < N; ++r) {
    Program& pr = progs[r];
    pr.ops = std::move(rewritten[r]);
    pr.streams.push_back("rail_p2p");
    pr.counter_names.resize(static_cast<size_t>(pr.num_counters));
    for (auto& nm : new_names[r]) pr.counter_names.push_back(std::move(nm));
    pr.counter_names.resize(static_cast<size_t>(num_counters), "(unused)");
    pr.num_counters = num_counters;
    pr.rails = Rails::kTwoSided;
    // The counters region grows to fit when it ends the arena (the plan's own layout).
    ArenaSpec& a = pr.arena;
    bool last = a.counters_offset >= 0;
    for (int k = 0; k < kNumBufKinds; ++k) last = last && !(a.bytes[k] > 0 && a.offset[k] > a.counters_offset);
    if (last && a.counters_bytes < 8 * num_counters) {
      a.counters_bytes = 8 * num_counters;
      a.total = std::max(a.total, a.counters_offset + a.counters_bytes);
    }
  }
}

}  // namespace tide
