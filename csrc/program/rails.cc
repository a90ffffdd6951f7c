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
//     pre/post count the cross-node PUTs of their stream (K per call: the j-th has target
//     j + 1 - K + K*seq), so they are seq-independent like every counter.
//   - Group key = (round, tag, ordinal among the sender's PUTs with that round and tag), shared by
//     the PUTs that follow it on its stream to the same peer in the same round ([Note: one group per
//     adjacent run]); every rank issues its groups in ascending key order, which each sender's
//     stream order must agree with.
#include <algorithm>
#include <map>
#include <tuple>

#include "tide/errors.h"
#include "tide/program.h"

namespace tide {

int rail_peer(const Op& op) {
  if (op.copies.empty()) return -1;
  return op.kind == OpKind::kRecv ? op.copies.front().src.rank : op.copies.front().dst.rank;
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
  bool joined = false;        // continues the previous PUT's group (same stream, peer and round)
};

std::vector<CopyDesc> rows_of(const Op& op) {  // 1-D descriptors (a 2-D copy row by row)
  std::vector<CopyDesc> out;
  for (const auto& cd : op.copies)
    for (int64_t h = 0; h < cd.src.height; ++h) {
      CopyDesc r = cd;
      r.src.offset += h * (cd.src.height > 1 ? cd.src.pitch : 0);
      r.dst.offset += h * (cd.dst.height > 1 ? cd.dst.pitch : 0);
      r.src.height = r.dst.height = 1;
      r.src.pitch = r.dst.pitch = 0;
      out.push_back(r);
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
    std::map<uint8_t, size_t> prev_in_stream;  // stream -> its previous op
    for (size_t i = 0; i < pr.ops.size(); ++i) {
      const Op& op = pr.ops[i];
      auto prev = prev_in_stream.find(op.stream);
      const std::ptrdiff_t prev_op = prev == prev_in_stream.end() ? -1 : static_cast<std::ptrdiff_t>(prev->second);
      prev_in_stream[op.stream] = i;
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
          PutInfo p;
          p.rank = t;
          p.op = static_cast<int>(i);
          p.peer = peer;
          p.stream = op.stream;
          p.empty = op.copies.empty();
          // [Note: one group per adjacent run] PUTs that follow each other on a stream to one peer
          // in one round (a round's head and tail) form one group: a group completes as a whole.
          auto run = prev_op < 0 ? put_of.end() : put_of.find({t, static_cast<int>(prev_op)});
          if (run != put_of.end() && puts[run->second].peer == peer && pr.ops[prev_op].round == op.round) {
            p.key = puts[run->second].key;
            p.joined = true;
          } else {
            p.key = Key{op.round, static_cast<uint16_t>(op.tag), ordinal[{op.round, static_cast<uint16_t>(op.tag)}]++};
          }
          put_of[{t, static_cast<int>(i)}] = puts.size();
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

  // Pass C: groups. Each rank's PUTs (per stream) must come in ascending key order.
  std::map<Key, int> group_of;
  for (const auto& p : puts) group_of[p.key] = 0;
  int g = 0;
  for (auto& kv : group_of) kv.second = g++;
  std::vector<std::map<Key, std::vector<size_t>>> outgoing(N), incoming(N);
  std::vector<std::map<uint8_t, int>> per_stream(N);  // stream -> cross-node PUTs per call
  std::vector<std::map<uint8_t, Key>> last_key(N);
  for (size_t x = 0; x < puts.size(); ++x) {
    PutInfo& p = puts[x];
    auto lk = last_key[p.rank].find(p.stream);
    TIDE_PLAN_CHECK(lk == last_key[p.rank].end() || lk->second < p.key || (p.joined && lk->second == p.key),
                    where(p.rank, static_cast<size_t>(p.op)),
                    ": its rail transfers are not in (round, tag) order on their stream: not lowerable");
    last_key[p.rank][p.stream] = p.key;
    if (!p.empty) p.ordinal_in_stream = per_stream[p.rank][p.stream]++;
    outgoing[p.rank][p.key].push_back(x);
    auto& in = incoming[p.peer][p.key];
    TIDE_PLAN_CHECK(in.empty() || puts[in.front()].rank == p.rank, where(p.rank, static_cast<size_t>(p.op)), ": rank ",
                    p.peer, " receives two transfers of round ", std::get<0>(p.key), " tag ",
                    op_tag_name(static_cast<OpTag>(std::get<1>(p.key))), " #", std::get<2>(p.key), " (ranks ",
                    in.empty() ? -1 : puts[in.front()].rank, " and ", p.rank, ")");
    in.push_back(x);
  }

  // The last PUT with data of a group's run on its sender (null: none).
  auto last_send = [&](const std::vector<size_t>& run) -> const PutInfo* {
    for (size_t k = run.size(); k-- > 0;)
      if (!puts[run[k]].empty) return &puts[run[k]];
    return nullptr;
  };

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
      if (p.empty) continue;  // the receiver bumps its counter itself
      const int K = per_stream[r].at(p.stream);
      const auto [pre, post] = prepost[r].at(p.stream);
      out.push_back(counter_op(OpKind::kEventRecord, op.stream, op, r, pre, p.ordinal_in_stream + 1 - K, K));
      if (last_send(outgoing[r].at(p.key)) == &p)  // the group completes as a whole
        out.push_back(counter_op(OpKind::kEventWait, op.stream, op, r, post, p.ordinal_in_stream + 1 - K, K));
    }
    // The rail_p2p stream: groups in key order.
    for (const auto& [key, gid] : group_of) {
      auto o = outgoing[r].find(key);
      auto in = incoming[r].find(key);
      const std::vector<size_t> none;
      const std::vector<size_t>& outs = o == outgoing[r].end() ? none : o->second;
      const std::vector<size_t>& ins = in == incoming[r].end() ? none : in->second;
      if (outs.empty() && ins.empty()) continue;
      for (size_t x : ins)
        for (const Guard& gd : puts[x].guards) {
          Op w = counter_op(OpKind::kWait, rail, progs[puts[x].rank].ops[puts[x].op], r, gd.counter, gd.value,
                            gd.per_call);
          w.tag = OpTag::kCreditWait;
          w.deadline_s = gd.deadline_s;
          out.push_back(w);
        }
      const PutInfo* last = last_send(outs);
      const int K = last ? per_stream[r].at(last->stream) : 0;
      if (last)
        out.push_back(counter_op(OpKind::kEventWait, rail, pr.ops[last->op], r, prepost[r].at(last->stream).first,
                                 last->ordinal_in_stream + 1 - K, K));
      for (size_t x : outs) {
        if (puts[x].empty) continue;
        const Op& put = pr.ops[puts[x].op];
        Op snd = put;
        snd.kind = OpKind::kSend;
        snd.stream = rail;
        snd.copies = rows_of(put);
        snd.counter = CounterRef{};
        snd.value = 0;
        snd.rail_group = gid;
        out.push_back(std::move(snd));
      }
      for (size_t x : ins) {
        if (puts[x].empty) continue;
        Op v = progs[puts[x].rank].ops[puts[x].op];
        v.kind = OpKind::kRecv;
        v.stream = rail;
        v.copies = rows_of(v);
        v.rail_group = gid;
        out.push_back(std::move(v));
      }
      for (size_t x : ins) {  // data-less PUTs: bumped once the group (the data before them) landed
        if (!puts[x].empty) continue;
        const Op& put = progs[puts[x].rank].ops[puts[x].op];
        out.push_back(counter_op(OpKind::kSignal, rail, put, r, put.counter.index, put.value, 0));
      }
      if (last)
        out.push_back(counter_op(OpKind::kEventRecord, rail, pr.ops[last->op], r, prepost[r].at(last->stream).second,
                                 last->ordinal_in_stream + 1 - K, K));
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
