// The global enqueue order of [Note: enqueue order] (issue.h) as host-only code: the walk over
// every rank's program that the CUDA issue path runs per call, the record of one call's walk, and
// its replay. No CUDA here, so CPU tests run the same code the executors run.
//
// Contract
//   - walk_call(in, seq, mirror, visit, order): visits every op of the set's ranks that
//     the call enqueues (visit(rank, stream, k, end): ops stream_ops[rank][stream][k, end), a rail
//     group or one op) in the global topological order; a WAIT is visited only once the counter
//     mirror (mirror[rank][counter], the fabric's issued values) reaches its target. The visitor
//     advances the mirror (bumps of every rank; local ranks' ops are enqueued by it too).
//   - The result says whether the walk ended (every op visited) or stalled (a local wait whose
//     local producer is never visited), and where each unfinished stream stands.
//   - order (optional): the set's record, replayed first and replaced by the call's steps.
//   - A dead rank (tests) visits nothing; a walk with one is neither replayed nor recorded.
//
// [Note: replayed enqueue order]
// The walk is a deterministic function of its gate outcomes: whether, when it reaches a WAIT, the
// mirror has reached the wait's target (pass: visit it and go on along the stream; block: go to
// the next stream). A call's walk is recorded as its steps, each an op (or rail group) visited or a
// stream found blocked, with the walk's pass state at that step (where it is, whether the pass made
// progress, finished every stream so far, left a peer's stream unfinished). The next call replays
// the record: it tests every gate the walk would test, in the walk's order, and requires the same
// outcome (a visited wait still passes, a blocked stream still blocks). While the outcomes repeat
// the replay visits exactly what the walk would, in the same order, with the same mirror updates;
// it saves the walk's passes over every stream (one comparison per wait instead). At the first
// outcome that differs (the first call of a set, whose targets <= 0 pass ungated; a mirror that a
// stall or another set left elsewhere) the walk takes over from that exact state (cursors and pass
// position), so a call's order is the walk's order in every case, and every process of a rank
// executor, which sees the same outcomes, enqueues a restriction of the same global order. The
// call's steps become the record. A walk that stalled (it then trusts remote producers, issue.h)
// or ran with a dead rank leaves no record. Nothing here assumes that calls repeat their
// outcomes (counters that advance by the same amount every call make them repeat, and a stalled
// call's mirror would not): the replay only saves time when they do, and tests the gates itself.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "tide/errors.h"
#include "tide/program.h"

namespace tide::cuda {

inline bool is_wait(OpKind k) { return k == OpKind::kWait || k == OpKind::kEventWait; }
inline bool bumps(OpKind k) {
  return k == OpKind::kPut || k == OpKind::kSignal || k == OpKind::kCredit || k == OpKind::kEventRecord;
}
// The counter value after `op` of call `seq` from `cur`: PUT/SIGNAL/CREDIT add, EVENT_RECORD
// raises to its target, a RECV's arrival adds.
inline uint64_t advanced(const Op& op, int64_t seq, uint64_t cur) {
  if (op.kind == OpKind::kEventRecord) return std::max(cur, static_cast<uint64_t>(std::max<int64_t>(0, op.target(seq))));
  return cur + static_cast<uint64_t>(op.value);
}

// What the walk reads of a program set (ProgramTables' fields).
struct OrderInput {
  const std::vector<Program>* programs = nullptr;
  const std::vector<std::vector<std::vector<int>>>* stream_ops = nullptr;  // [rank][stream] -> op indices
  const std::vector<std::vector<int>>* producer = nullptr;  // [owner][counter] -> producing rank, -1: none
  const std::vector<char>* local = nullptr;                 // [rank]: issued by this executor
  int dead_rank = -1;
};

// One step of a recorded walk ([Note: replayed enqueue order]).
struct OrderStep {
  static constexpr uint8_t kProgress = 1, kDone = 2, kRemoteLeft = 4;  // the pass state before it
  int32_t rank = 0, stream = 0, k = 0;
  int32_t end = -1;  // > k: ops [k, end) visited; -1: op k blocked its stream
  uint8_t pass = 0;
};

// A set's recorded walk (ProgramTables keeps one per set; the executor's lock guards it).
struct OrderRecord {
  std::vector<OrderStep> steps;
  bool valid = false;
};

struct WalkResult {
  bool stalled = false;         // a local wait's producer is never visited
  bool trusted_remote = false;  // the walk stalled on a peer's stream once
  size_t replayed = 0;          // steps taken from the record
  bool deviated = false;        // a replayed outcome differed; the walk took over
  std::vector<std::pair<int, int>> unfinished;  // (rank, op) where each unfinished stream stands
};

namespace order_detail {
// Whether op (of rank r's stream) blocks: a WAIT with a positive target the mirror has not
// reached; with trust_remote, waits on a remote producer never block.
inline bool blocks(const OrderInput& in, const Op& op, int64_t seq, uint64_t* const* mirror, bool trust_remote) {
  if (!is_wait(op.kind)) return false;
  const int64_t target = op.target(seq);
  if (target <= 0) return false;  // counters start at 0: trivially satisfied (first call)
  const CounterRef& c = op.counter;
  const Program& owner = (*in.programs)[static_cast<size_t>(c.rank)];
  TIDE_CHECK(c.index >= 0 && c.index < owner.num_counters, "counter ", c.index, " of rank ", c.rank);
  if (trust_remote) {
    const int p = (*in.producer)[static_cast<size_t>(c.rank)][static_cast<size_t>(c.index)];
    if (p >= 0 && !(*in.local)[static_cast<size_t>(p)]) return false;
  }
  return mirror[c.rank][c.index] < static_cast<uint64_t>(target);
}
}  // namespace order_detail

// The walk of [Note: enqueue order] for call `seq`; with `order`, its record is replayed first
// and the call's steps recorded into it ([Note: replayed enqueue order]). `mirror[r]`: group
// rank r's counters.
template <class Visit>
WalkResult walk_call(const OrderInput& in, int64_t seq, uint64_t* const* mirror, Visit&& visit,
                     OrderRecord* order = nullptr) {
  using order_detail::blocks;
  const auto& progs = *in.programs;
  const auto& sops = *in.stream_ops;
  const int n = static_cast<int>(progs.size());
  WalkResult res;
  const bool keep = order != nullptr && in.dead_rank < 0;
  std::vector<OrderStep> steps;  // this call's, when it differs from the record
  std::vector<OrderStep>* record = keep ? &steps : nullptr;
  std::vector<std::vector<size_t>> cur(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) cur[static_cast<size_t>(r)].assign(sops[static_cast<size_t>(r)].size(), 0);
  // The pass state (resumable: a replay hands over at any step).
  int r = 0;
  size_t s = 0;
  bool progress = false, done = true, remote_left = false, trust_remote = false;

  if (keep && order->valid) {
    const std::vector<OrderStep>& rec = order->steps;
    size_t j = 0;
    bool fits = true;
    for (; j < rec.size(); ++j) {
      const OrderStep& st = rec[j];
      fits = st.rank >= 0 && st.rank < n && st.stream >= 0 &&
             static_cast<size_t>(st.stream) < cur[static_cast<size_t>(st.rank)].size();
      if (!fits) break;
      const auto& ops = sops[static_cast<size_t>(st.rank)][static_cast<size_t>(st.stream)];
      const size_t k = cur[static_cast<size_t>(st.rank)][static_cast<size_t>(st.stream)];
      fits = k == static_cast<size_t>(st.k) && k < ops.size();
      if (!fits) break;
      const Op& op = progs[static_cast<size_t>(st.rank)].ops[static_cast<size_t>(ops[k])];
      const bool b = !is_rail_op(op) && blocks(in, op, seq, mirror, false);
      if (b != (st.end < 0)) break;  // the walk would decide otherwise here: it takes over
      if (st.end >= 0) {
        visit(st.rank, st.stream, k, static_cast<size_t>(st.end));
        cur[static_cast<size_t>(st.rank)][static_cast<size_t>(st.stream)] = static_cast<size_t>(st.end);
      }
    }
    res.replayed = j;
    if (j == rec.size()) return res;  // every outcome repeated: the walk ends here too
    res.deviated = true;
    steps.assign(rec.begin(), rec.begin() + static_cast<long>(j));
    if (fits) {  // resume the walk exactly where the record leaves it
      r = rec[j].rank;
      s = static_cast<size_t>(rec[j].stream);
      progress = rec[j].pass & OrderStep::kProgress;
      done = rec[j].pass & OrderStep::kDone;
      remote_left = rec[j].pass & OrderStep::kRemoteLeft;
    }  // else (never, for the set it was made from): a walk from the cursors, from a new pass
  }

  auto pass_bits = [&] {
    return static_cast<uint8_t>((progress ? OrderStep::kProgress : 0) | (done ? OrderStep::kDone : 0) |
                                (remote_left ? OrderStep::kRemoteLeft : 0));
  };
  auto considered = [&](int q) {
    return q != in.dead_rank && ((*in.local)[static_cast<size_t>(q)] || !trust_remote);
  };
  for (;;) {
    for (; r < n; ++r, s = 0) {
      if (!considered(r)) continue;
      const bool local = (*in.local)[static_cast<size_t>(r)];
      const Program& p = progs[static_cast<size_t>(r)];
      auto& rc = cur[static_cast<size_t>(r)];
      for (; s < rc.size(); ++s) {
        const auto& ops = sops[static_cast<size_t>(r)][s];
        size_t& k = rc[s];
        while (k < ops.size()) {
          const Op& op = p.ops[static_cast<size_t>(ops[k])];
          size_t end = k + 1;
          if (is_rail_op(op)) {
            end = rail_group_end(p, ops, k);  // a rendezvous group: visited whole
          } else if (blocks(in, op, seq, mirror, trust_remote)) {
            if (record) record->push_back({r, static_cast<int32_t>(s), static_cast<int32_t>(k), -1, pass_bits()});
            break;  // producer not visited yet
          }
          if (record)
            record->push_back({r, static_cast<int32_t>(s), static_cast<int32_t>(k), static_cast<int32_t>(end), pass_bits()});
          visit(r, static_cast<int>(s), k, end);
          k = end;
          progress = true;
        }
        if (k < ops.size()) {
          done = false;
          remote_left = remote_left || !local;
        }
      }
    }
    r = 0;
    s = 0;
    if (done) {
      if (keep) {
        order->valid = !trust_remote;
        order->steps.swap(steps);
      }
      return res;
    }
    if (progress) {
      progress = false;
      done = true;
      remote_left = false;
      continue;
    }
    if (remote_left && !trust_remote) {
      trust_remote = res.trusted_remote = true;
      done = true;
      remote_left = false;
      continue;
    }
    res.stalled = true;
    if (keep) order->valid = false;
    for (int q = 0; q < n; ++q) {
      if (!considered(q)) continue;
      for (size_t t = 0; t < cur[static_cast<size_t>(q)].size(); ++t) {
        const auto& ops = sops[static_cast<size_t>(q)][t];
        const size_t k = cur[static_cast<size_t>(q)][t];
        if (k < ops.size()) res.unfinished.emplace_back(q, ops[k]);
      }
    }
    return res;
  }
}

}  // namespace tide::cuda
