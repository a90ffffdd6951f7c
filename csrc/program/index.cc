// The program index and the executors' admission check (contract in tide/program_index.h).
#include "tide/program_index.h"

#include <algorithm>

#include "tide/errors.h"

namespace tide {

bool op_produces(const Op& op) {
  return op.kind == OpKind::kSignal || op.kind == OpKind::kCredit || op.kind == OpKind::kEventRecord ||
         ((op.kind == OpKind::kPut || op.kind == OpKind::kRecv) && op.counter.index >= 0);
}

ProgramUse::ProgramUse() { std::fill(arena_end, arena_end + kNumBufKinds, int64_t{-1}); }

const CounterProducer& ProgramIndex::producer_of(const CounterRef& c) const {
  static const CounterProducer none;
  if (c.rank < 0 || static_cast<size_t>(c.rank) >= producer.size()) return none;
  const auto& v = producer[static_cast<size_t>(c.rank)];
  return c.index >= 0 && static_cast<size_t>(c.index) < v.size() ? v[static_cast<size_t>(c.index)] : none;
}

namespace {

// Notes one buffer reference of rank r's op i into `use`; false (strict: throws) when the
// reference breaks the push rule or names a rank outside the set.
bool note(ProgramUse& use, const BufRef& b, bool write, int r, size_t i, int n, bool strict) {
  const int k = static_cast<int>(b.kind);
  const bool ok = b.rank >= 0 && b.rank < n && k >= 0 && k < kNumBufKinds && (!is_user_buffer(b.kind) || b.rank == r);
  if (!ok) {
    if (strict)
      throw PlanError(TIDE_STR_CAT("rank ", r, " op ", i, " references ",
                                   k >= 0 && k < kNumBufKinds ? buf_kind_name(b.kind) : "an unknown buffer kind",
                                   " of rank ", b.rank,
                                   is_user_buffer(b.kind) && b.rank != r
                                       ? " (the push rule: user buffers are rank-local)"
                                       : TIDE_STR_CAT(" (", n, " ranks)")));
    return false;
  }
  if (is_user_buffer(b.kind)) {
    int64_t& e = use.user_end[{k, b.kind == BufKind::kOut ? -1 : b.index}];
    e = std::max(e, b.end());
    return true;
  }
  use.arena_end[k] = std::max(use.arena_end[k], b.end());
  if (write && b.rank != r && std::find(use.writes.begin(), use.writes.end(), b.rank) == use.writes.end())
    use.writes.push_back(b.rank);
  if (!write && b.rank != r && std::find(use.reads.begin(), use.reads.end(), b.rank) == use.reads.end())
    use.reads.push_back(b.rank);
  if (write && b.rank != r && (b.kind == BufKind::kRing0 || b.kind == BufKind::kRing1)) use.lands_in_peers = true;
  return true;
}

}  // namespace

ProgramIndex index_programs(const std::vector<Program>& progs, bool strict) {
  ProgramIndex x;
  const int n = static_cast<int>(progs.size());
  x.stream_ops.resize(progs.size());
  x.use.resize(progs.size());
  x.producer.resize(progs.size());
  for (int r = 0; r < n; ++r)
    x.producer[static_cast<size_t>(r)].resize(static_cast<size_t>(std::max(0, progs[static_cast<size_t>(r)].num_counters)));
  for (int r = 0; r < n; ++r) {
    const Program& pr = progs[static_cast<size_t>(r)];
    auto& so = x.stream_ops[static_cast<size_t>(r)];
    so.assign(std::max<size_t>(1, pr.streams.size()), {});
    ProgramUse& use = x.use[static_cast<size_t>(r)];
    for (size_t i = 0; i < pr.ops.size(); ++i) {
      const Op& op = pr.ops[i];
      if (op.stream >= so.size()) {
        TIDE_PLAN_CHECK(!strict, "rank ", r, " op ", i, ": stream ", int(op.stream), " of ", pr.streams.size());
        continue;
      }
      so[op.stream].push_back(static_cast<int>(i));
      for (const auto& cd : op.copies) {  // a SEND names the peer's landing, a RECV the peer's source
        if (op.kind != OpKind::kRecv) note(use, cd.src, false, r, i, n, strict);
        if (op.kind != OpKind::kSend) note(use, cd.dst, true, r, i, n, strict);
      }
      for (const auto& t : op.terms) note(use, t.src, false, r, i, n, strict);
      if (op.kind == OpKind::kSum || op.kind == OpKind::kLand || op.kind == OpKind::kZero)
        note(use, op.dst, true, r, i, n, strict);
      if (op.counter.index < 0) continue;
      use.uses_counters = true;
      const bool in_range = op.counter.rank >= 0 && op.counter.rank < n &&
                            op.counter.index < progs[static_cast<size_t>(op.counter.rank)].num_counters;
      if (!in_range) {
        TIDE_PLAN_CHECK(!strict, "rank ", r, " op ", i, ": counter ", op.counter.index, " of rank ", op.counter.rank,
                        " is outside the program set's counters");
        continue;
      }
      if (!op_produces(op)) continue;
      CounterProducer& p = x.producer[static_cast<size_t>(op.counter.rank)][static_cast<size_t>(op.counter.index)];
      if (p.rank < 0) p = CounterProducer{r, op.stream, static_cast<int>(i)};
    }
  }
  for (int r = 0; r < n; ++r) {
    ProgramUse& use = x.use[static_cast<size_t>(r)];
    use.fence_peers = use.writes;
    for (int j = 0; j < n; ++j) {
      const auto& reads = x.use[static_cast<size_t>(j)].reads;
      if (j != r && std::find(reads.begin(), reads.end(), r) != reads.end() &&
          std::find(use.fence_peers.begin(), use.fence_peers.end(), j) == use.fence_peers.end())
        use.fence_peers.push_back(j);
    }
  }
  return x;
}

void admit(const std::vector<Program>& progs, const ProgramIndex& index, int me, const ArenaSpec& layout,
           const char* who, int global_rank, int64_t arena_bytes, bool fence) {
  const Program& mine = progs.at(static_cast<size_t>(me));
  const ProgramUse& use = index.use.at(static_cast<size_t>(me));
  for (int k = 4; k < kNumBufKinds; ++k) {
    if (use.arena_end[k] < 0) continue;
    const char* name = buf_kind_name(static_cast<BufKind>(k));
    if (layout.offset[k] < 0)
      throw Error(TIDE_STR_CAT(who, ": rank ", global_rank, "'s program (group ", mine.group, ") uses arena region '",
                               name, "', which the arena layout does not have"));
    TIDE_PLAN_CHECK(arena_bytes < 0 || layout.offset[k] + layout.bytes[k] <= arena_bytes, who, ": region '", name, "' [",
                    layout.offset[k], ", ", layout.offset[k] + layout.bytes[k], ") does not fit the ", arena_bytes,
                    "-byte arena");
    if (use.arena_end[k] > layout.bytes[k])
      throw Error(TIDE_STR_CAT(who, ": rank ", global_rank, "'s program (group ", mine.group, ") addresses ",
                               use.arena_end[k], " bytes of arena region '", name, "', which has ", layout.bytes[k]));
  }
  const bool counters = use.uses_counters || (fence && !use.fence_peers.empty());
  if (!counters && !fence) return;
  if (layout.counters_offset < 0 || (counters && layout.counters_bytes < 8)) {
    if (!counters) return;  // a fence with nothing to fence: the executor skips it
    throw Error(TIDE_STR_CAT(who, ": rank ", global_rank, "'s program (group ", mine.group,
                             ") uses arena region 'counters', which the arena layout does not have"));
  }
  TIDE_PLAN_CHECK(layout.counters_offset % 8 == 0 &&
                      (arena_bytes < 0 || layout.counters_offset + layout.counters_bytes <= arena_bytes),
                  who, ": region 'counters' [", layout.counters_offset, ", +", layout.counters_bytes,
                  ") is misaligned or outside the ", arena_bytes, "-byte arena");
  const int64_t usable = layout.counters_bytes / 8 - (fence ? 1 : 0);
  for (const Program& p : progs)
    if (p.num_counters > usable)
      throw Error(TIDE_STR_CAT(who, ": rank ", &p == &mine ? global_rank : p.rank, "'s program (group ", p.group,
                               ") uses ", p.num_counters, " counters (counter_base included), region 'counters' holds ",
                               usable, fence ? " (its last counter is the executor's entry fence)" : ""));
}

}  // namespace tide
