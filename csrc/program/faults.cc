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
bool is_stage_like(BufKind k) {
  return k == BufKind::kStage || k == BufKind::kStaging || k == BufKind::kOutbox || k == BufKind::kInbox;
}
}  // namespace

bool inject_fault(std::vector<Program>& progs, FaultKind kind, int rank, OpTag tag) {
  TIDE_PLAN_CHECK(rank >= 0 && rank < static_cast<int>(progs.size()), "inject_fault: rank ", rank, " out of range");
  Program& p = progs[rank];
  auto tag_ok = [&](const Op& op) { return tag == OpTag::kNone || op.tag == tag; };
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
                                   return (op.kind == OpKind::kWait || op.kind == OpKind::kEventWait) && op.tag == t;
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
    case FaultKind::kReorderCalls:
    case FaultKind::kOtherPlan:
    case FaultKind::kStalledPeer:
    case FaultKind::kDeadPeer:
      return false;  // applied to call lists / plans / the executor, not to one program
  }
  return false;
}

}  // namespace tide
