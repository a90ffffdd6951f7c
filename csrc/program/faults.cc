// Fault injection (tests only): mutations of programs that must be caught (checker rejects, or
// the executor reports corruption / times out naming rank, op and seq).
#include <algorithm>

#include "tide/program.h"

namespace tide {

const char* fault_kind_name(FaultKind k) {
  switch (k) {
    case FaultKind::kDropCredit: return "drop_credit";
    case FaultKind::kDropWait: return "drop_wait";
    case FaultKind::kDropFence: return "drop_fence";
    case FaultKind::kReorderCalls: return "reorder_calls";
    case FaultKind::kEarlyReuse: return "early_reuse";
    case FaultKind::kSkipZero: return "skip_zero";
    case FaultKind::kOtherPlan: return "other_plan";
    case FaultKind::kStalledPeer: return "stalled_peer";
    case FaultKind::kDeadPeer: return "dead_peer";
    case FaultKind::kDropRecv: return "drop_recv";
    case FaultKind::kSplitRailGroup: return "split_rail_group";
    case FaultKind::kSwapRailGroups: return "swap_rail_groups";
    case FaultKind::kRailSizeMismatch: return "rail_size_mismatch";
  }
  return "?";
}

namespace {
template <typename Pred>
bool erase_first(Program& prog, Pred pred) {
  auto it = std::find_if(prog.ops.begin(), prog.ops.end(), pred);
  if (it == prog.ops.end()) return false;
  prog.ops.erase(it);
  return true;
}
// [first, last) of the rail group whose first op is at `from` or later (ops of one group are adjacent).
std::pair<size_t, size_t> next_group(const Program& p, size_t from) {
  size_t a = from;
  while (a < p.ops.size() && !is_rail_op(p.ops[a])) ++a;
  size_t b = a;
  while (b < p.ops.size() && is_rail_op(p.ops[b]) && p.ops[b].rail_group == p.ops[a].rail_group) ++b;
  return {a, b};
}
bool is_stage_like(BufKind k) {
  return k == BufKind::kStage || k == BufKind::kStaging || k == BufKind::kOutbox || k == BufKind::kInbox;
}
}  // namespace

bool inject_fault(std::vector<Program>& progs, FaultKind kind, int rank, OpTag tag, int32_t round) {
  TIDE_PLAN_CHECK(rank >= 0 && rank < static_cast<int>(progs.size()), "inject_fault: rank ", rank, " out of range");
  Program& p = progs[rank];
  auto tag_ok = [&](const Op& op) {
    return (tag == OpTag::kNone || op.tag == tag) && (round == kAnyRound || op.round == round);
  };
  switch (kind) {
    case FaultKind::kDropCredit:
      return erase_first(p, [&](const Op& op) { return op.kind == OpKind::kCredit && tag_ok(op); });
    case FaultKind::kDropWait:
      return erase_first(p, [&](const Op& op) { return op.kind == OpKind::kWait && tag_ok(op); });
    case FaultKind::kDropFence: {
      // The completion fence: every DONE-style wait of the rank (or the tagged event waits).
      const OpTag t = tag == OpTag::kNone ? OpTag::kDoneWait : tag;
      const size_t before = p.ops.size();
      p.ops.erase(std::remove_if(p.ops.begin(), p.ops.end(),
                                 [&](const Op& op) {
                                   return (op.kind == OpKind::kWait || op.kind == OpKind::kEventWait) && op.tag == t &&
                                          (round == kAnyRound || op.round == round);
                                 }),
                  p.ops.end());
      return p.ops.size() != before;
    }
    case FaultKind::kEarlyReuse: {
      // Shift the first write into a stage/staging/outbox/inbox block to the block that an
      // earlier transfer of the same call occupies (reused before its consumer finished).
      for (auto& op : p.ops) {
        if (!tag_ok(op)) continue;
        for (auto& cd : op.copies) {
          if (!is_stage_like(cd.dst.kind) || cd.dst.offset == 0) continue;
          cd.dst.offset = 0;
          return true;
        }
      }
      return false;
    }
    case FaultKind::kSkipZero:
      return erase_first(p, [&](const Op& op) { return op.kind == OpKind::kZero && tag_ok(op); });
    case FaultKind::kDropRecv:
      return erase_first(p, [&](const Op& op) { return op.kind == OpKind::kRecv && tag_ok(op); });
    case FaultKind::kSplitRailGroup: {
      // The first group with two transfers to or from one peer: its later ops form a new group.
      int fresh = 0;
      for (const Op& op : p.ops) fresh = std::max(fresh, op.rail_group + 1);
      for (size_t from = 0;;) {
        const auto [a, b] = next_group(p, from);
        if (a >= p.ops.size()) return false;
        for (size_t i = a + 1; i < b; ++i)
          if (rail_peer(p.ops[i]) == rail_peer(p.ops[a]) && tag_ok(p.ops[a])) {
            for (size_t j = i; j < b; ++j) p.ops[j].rail_group = fresh;
            return true;
          }
        from = b;
      }
    }
    case FaultKind::kSwapRailGroups: {
      // The first two groups swap places (the ops between them stay).
      const auto [a0, b0] = next_group(p, 0);
      if (a0 >= p.ops.size()) return false;
      const auto [a1, b1] = next_group(p, b0);
      if (a1 >= p.ops.size()) return false;
      std::vector<Op> out(p.ops.begin(), p.ops.begin() + static_cast<std::ptrdiff_t>(a0));
      out.insert(out.end(), p.ops.begin() + static_cast<std::ptrdiff_t>(a1), p.ops.begin() + static_cast<std::ptrdiff_t>(b1));
      out.insert(out.end(), p.ops.begin() + static_cast<std::ptrdiff_t>(b0), p.ops.begin() + static_cast<std::ptrdiff_t>(a1));
      out.insert(out.end(), p.ops.begin() + static_cast<std::ptrdiff_t>(a0), p.ops.begin() + static_cast<std::ptrdiff_t>(b0));
      out.insert(out.end(), p.ops.begin() + static_cast<std::ptrdiff_t>(b1), p.ops.end());
      p.ops = std::move(out);
      return true;
    }
    case FaultKind::kRailSizeMismatch:
      for (auto& op : p.ops)
        if (op.kind == OpKind::kRecv && tag_ok(op) && !op.copies.empty() && op.copies[0].dst.width > 1) {
          const int64_t less = std::min<int64_t>(16, op.copies[0].dst.width / 2);
          op.copies[0].src.width -= less;
          op.copies[0].dst.width -= less;
          return true;
        }
      return false;
    case FaultKind::kReorderCalls:
    case FaultKind::kOtherPlan:
    case FaultKind::kStalledPeer:
    case FaultKind::kDeadPeer:
      return false;  // applied to call lists / plans / the executor, not to one program
  }
  return false;
}

}  // namespace tide
