// Program IR helpers: names, the arena layout an executor allocates, program statistics.
#include <algorithm>

#include "tide/program.h"

namespace tide {

const char* buf_kind_name(BufKind k) {
  static const char* names[kNumBufKinds] = {"shard",    "landing", "grad",    "out",
                                            "ring0",    "ring1",   "resident", "stage",
                                            "staging",  "outbox",  "inbox",   "spare"};
  const int i = static_cast<int>(k);
  return i >= 0 && i < kNumBufKinds ? names[i] : "?";
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kReduceScatterExpert: return "reduce_scatter_expert";
  }
  return "?";
}

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kCopy: return "COPY";
    case OpKind::kCast: return "CAST";
    case OpKind::kSum: return "SUM";
    case OpKind::kLand: return "LAND";
    case OpKind::kZero: return "ZERO";
    case OpKind::kPut: return "PUT";
    case OpKind::kSignal: return "SIGNAL";
    case OpKind::kWait: return "WAIT";
    case OpKind::kEventRecord: return "EVENT_RECORD";
    case OpKind::kEventWait: return "EVENT_WAIT";
    case OpKind::kCredit: return "CREDIT";
    case OpKind::kSend: return "SEND";
    case OpKind::kRecv: return "RECV";
  }
  return "?";
}

const char* op_tag_name(OpTag t) {
  switch (t) {
    case OpTag::kNone: return "-";
    case OpTag::kReadyWait: return "ReadyWait";
    case OpTag::kReadySignal: return "ReadySignal";
    case OpTag::kReadyGate: return "ReadyGate";
    case OpTag::kCast: return "Cast";
    case OpTag::kCastGate: return "CastGate";
    case OpTag::kLocalPush: return "LocalPush";
    case OpTag::kPull: return "Pull";
    case OpTag::kCreditWait: return "CreditWait";
    case OpTag::kPaceWait: return "PaceWait";
    case OpTag::kPaceSignal: return "PaceSignal";
    case OpTag::kRoundHead: return "RoundHead";
    case OpTag::kRoundTail: return "RoundTail";
    case OpTag::kArrivalWait: return "ArrivalWait";
    case OpTag::kScatter: return "Scatter";
    case OpTag::kCreditSignal: return "CreditSignal";
    case OpTag::kDoneSignal: return "DoneSignal";
    case OpTag::kDoneWait: return "DoneWait";
    case OpTag::kFence: return "Fence";
    case OpTag::kRelease: return "Release";
    case OpTag::kComplete: return "Complete";
    default: return static_cast<int>(t) >= static_cast<int>(OpTag::kRsFirst) ? "rs" : "?";
  }
}

namespace {
int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
constexpr int64_t kAlign = 4096;

// The ArenaSpec of a memory-model region table (regions it does not list: offset 0, 0 bytes);
// its total is the end of the last region.
ArenaSpec spec_of(const std::vector<ArenaRegion>& regions) {
  ArenaSpec a;
  for (const auto& reg : regions) {
    if (reg.name == "counters") {
      a.counters_offset = reg.offset;
      a.counters_bytes = reg.bytes;
    } else {
      for (int k = 4; k < kNumBufKinds; ++k)
        if (reg.name == buf_kind_name(static_cast<BufKind>(k))) {
          a.offset[k] = reg.offset;
          a.bytes[k] = reg.bytes;
        }
    }
    a.total = std::max(a.total, reg.offset + reg.bytes);
  }
  return a;
}
}  // namespace

ArenaSpec arena_spec_for(const Plan& plan, int num_counters) {
  ArenaSpec a;
  const int64_t counter_need = align_up(std::max<int64_t>(8, 8ll * num_counters), kAlign);
  if (!plan.memory.arena.empty()) {
    a = spec_of(plan.memory.arena);
    TIDE_CHECK(a.counters_bytes >= 8ll * num_counters, "plan arena 'counters' region holds ",
               a.counters_bytes / 8, " counters, the program needs ", num_counters);
    // The AG stage must fit what the schedule writes.
    TIDE_CHECK(a.bytes[static_cast<int>(BufKind::kStage)] >= plan.ag.stage_bytes,
               "plan arena 'stage' region is smaller than plan.ag.stage_bytes");
    a.total = align_up(a.total, kAlign);
    return a;
  }
  // Fallback layout (same names and order as MemoryModel::arena).
  const auto& L = plan.layout;
  const int64_t NS = L.unsharded_bytes();
  const int Lg = plan.topo.gpus_per_node;
  const int b_grad = dtype_size(plan.sig.grad_dtype);
  const auto& rs = plan.rs;
  int64_t sizes[kNumBufKinds] = {};
  sizes[static_cast<int>(BufKind::kRing0)] = NS;
  sizes[static_cast<int>(BufKind::kRing1)] = NS;
  sizes[static_cast<int>(BufKind::kResident)] = plan.sig.needs_cast() ? 0 : L.S;
  sizes[static_cast<int>(BufKind::kStage)] = plan.ag.stage_bytes;
  sizes[static_cast<int>(BufKind::kStaging)] =
      static_cast<int64_t>(plan.opt.n_stg) * (Lg - 1) * Lg * rs.E_sub * b_grad;
  sizes[static_cast<int>(BufKind::kOutbox)] = 2ll * rs.n_out * rs.block_bytes;
  sizes[static_cast<int>(BufKind::kInbox)] = static_cast<int64_t>(rs.n_par) * Lg * rs.block_bytes;
  sizes[static_cast<int>(BufKind::kSpare)] = 2 * rs.block_bytes;
  int64_t off = 0;
  for (int k = 4; k < kNumBufKinds; ++k) {
    a.offset[k] = off;
    a.bytes[k] = sizes[k];
    off = align_up(off + sizes[k], kAlign);
  }
  a.counters_offset = off;
  a.counters_bytes = counter_need;
  a.total = off + counter_need;
  return a;
}

ArenaSpec pull_arena_spec_for(const Plan& plan, int num_counters) {
  return spec_of(pull_arena(plan, num_counters));
}

AgProgramStats ag_program_stats(const Program& prog) {
  AgProgramStats st;
  const int L = prog.topo.gpus_per_node;
  for (const auto& op : prog.ops) {
    ++st.ops;
    if (op.kind == OpKind::kPut) ++st.put_ops;
    if (op.tag == OpTag::kScatter) st.scatter_descriptors += static_cast<int64_t>(op.copies.size()) / L;
  }
  return st;
}

}  // namespace tide
