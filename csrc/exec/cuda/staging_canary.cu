// The CUDA staging race canary (contract in staging_canary.h).
#include "exec/cuda/staging_canary.h"

#include <cstring>
#include <set>
#include <tuple>
#include <utility>

#include "exec/cuda/runtime.h"
#include "tide/errors.h"

namespace tide::cuda {

struct CanaryRecord {
  int32_t flag;      // 0: no race seen; the first one wins
  int32_t kind;      // ItemKind of the failed check
  int32_t check_id, owner, slot, pusher;
  uint64_t call;     // ordinal of the call whose op failed
  uint64_t expected, found;
};

namespace {

enum ItemKind : int8_t { kPushCheck = 1, kSumCheck = 2, kPushMark = 3, kReadMark = 4 };
constexpr int kUnitBits = 20;
constexpr int kMaxItems = 32;  // per launch

struct DevItem {
  uint64_t* word;
  const uint64_t* read;
  uint64_t value;
  int32_t kind, owner, slot, pusher;
};
struct CanaryStep {
  CanaryRecord* rec;
  uint64_t call;
  int32_t check_id, n;
  DevItem items[kMaxItems];
};

__device__ void report(const CanaryStep& s, const DevItem& it, uint64_t expected, uint64_t found) {
  if (atomicCAS_system(&s.rec->flag, 0, -1) != 0) return;
  s.rec->kind = it.kind;
  s.rec->check_id = s.check_id;
  s.rec->owner = it.owner;
  s.rec->slot = it.slot;
  s.rec->pusher = it.pusher;
  s.rec->call = s.call;
  s.rec->expected = expected;
  s.rec->found = found;
  __threadfence_system();
  atomicExch_system(&s.rec->flag, 1);
}

__global__ void canary_kernel(CanaryStep s) {
  for (int i = 0; i < s.n; ++i) {
    const DevItem& it = s.items[i];
    volatile uint64_t* w = it.word;
    switch (it.kind) {
      case kPushCheck: {  // the unit this pusher last wrote here is this one, or was read
        const uint64_t last = *w >> 8, read = *static_cast<volatile const uint64_t*>(it.read);
        if (last != it.value && last > read) report(s, it, last, read);
        break;
      }
      case kSumCheck: {   // every push op of this pusher for the unit has completed
        const uint64_t got = *w;
        if (got != it.value) report(s, it, it.value, got);
        break;
      }
      default:            // a mark: the op before it on this stream has completed
        *w = it.value;
        __threadfence_system();
        break;
    }
  }
}

uint64_t tag_of(uint64_t call, int32_t unit) { return (call << kUnitBits) | static_cast<uint64_t>(unit + 1); }

const char* op_word(OpKind k) {
  switch (k) {
    case OpKind::kCopy: return "COPY";
    case OpKind::kPut: return "PUT";
    case OpKind::kSum: return "SUM";
    default: return "LAND";
  }
}

}  // namespace

StagingCanary::StagingCanary(int world) : world_(world) {
  TIDE_PLAN_CHECK(world >= 1, "StagingCanary: world ", world);
  const size_t words = static_cast<size_t>(world) * kCanarySlots * (static_cast<size_t>(world) + 1);
  const size_t bytes = words * sizeof(uint64_t) + sizeof(CanaryRecord);
  TIDE_CHECK_CUDA(cudaHostAlloc(&host_, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                  "staging canary: ", bytes, " bytes of mapped pinned memory");
  std::memset(host_, 0, bytes);
  void* dev = nullptr;
  TIDE_CHECK_CUDA(cudaHostGetDevicePointer(&dev, host_, 0), "staging canary: device address");
  pushed_ = static_cast<uint64_t*>(dev);
  read_ = pushed_ + static_cast<size_t>(world) * kCanarySlots * world;
  record_ = reinterpret_cast<CanaryRecord*>(read_ + static_cast<size_t>(world) * kCanarySlots);
}

StagingCanary::~StagingCanary() {
  if (host_ != nullptr) cudaFreeHost(host_);  // the executor synchronised its streams first
}

std::unique_ptr<CanaryPlan> StagingCanary::plan(const std::vector<Program>& progs) {
  auto p = std::make_unique<CanaryPlan>();
  p->ops.resize(progs.size());
  const int n = static_cast<int>(progs.size());
  TIDE_PLAN_CHECK(n == world_, "staging canary: ", n, " programs for ", world_, " ranks");
  auto unit_of = [&](int r, int i, const Op& op) {
    TIDE_PLAN_CHECK(op.round >= 0 && op.round < (1 << kUnitBits) - 1, "staging canary: rank ", r, " op ", i,
                    " touches staging with round ", op.round, " (a Level-1 unit in [0, 2^20 - 1) expected)");
    return op.round;
  };
  auto where = [&](int r, int i, const BufRef& b) {
    TIDE_PLAN_CHECK(b.index >= 0 && b.index < kCanarySlots && b.rank >= 0 && b.rank < n, "staging canary: rank ", r,
                    " op ", i, " touches staging slot ", b.index, " of rank ", b.rank, " (slots 0..",
                    kCanarySlots - 1, ")");
    return std::make_pair(static_cast<int16_t>(b.rank), static_cast<int16_t>(b.index));
  };
  std::map<std::tuple<int, int, int, int>, int> pushes;  // (owner, slot, unit, pusher) -> push ops
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < static_cast<int>(progs[static_cast<size_t>(r)].ops.size()); ++i) {
      const Op& op = progs[static_cast<size_t>(r)].ops[static_cast<size_t>(i)];
      if (op.kind != OpKind::kCopy && op.kind != OpKind::kPut) continue;
      std::set<std::pair<int16_t, int16_t>> dsts;
      for (const auto& cp : op.copies)
        if (cp.dst.kind == BufKind::kStaging) dsts.insert(where(r, i, cp.dst));
      if (dsts.empty()) continue;
      const int32_t u = unit_of(r, i, op);
      CanaryPlan::OpItems& oi = p->ops[static_cast<size_t>(r)][i];
      for (auto [o, s] : dsts) {
        const int k = ++pushes[{o, s, u, r}];
        TIDE_PLAN_CHECK(k < 256, "staging canary: rank ", r, " pushes unit ", u, " into rank ", o, "'s slot ", s,
                        " in more than 255 ops");
        oi.before.push_back({kPushCheck, o, s, static_cast<int16_t>(r), u, 0});
        oi.after.push_back({kPushMark, o, s, static_cast<int16_t>(r), u, k});
      }
    }
  std::map<std::tuple<int, int, int>, std::pair<int, int>> last_sum;  // (owner, slot, unit) -> (rank, op)
  std::map<std::pair<int, int>, int32_t> read_unit;                   // (owner, slot) -> last unit read
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < static_cast<int>(progs[static_cast<size_t>(r)].ops.size()); ++i) {
      const Op& op = progs[static_cast<size_t>(r)].ops[static_cast<size_t>(i)];
      if (op.kind != OpKind::kSum && op.kind != OpKind::kLand) continue;
      std::set<std::pair<int16_t, int16_t>> srcs;
      for (const auto& t : op.terms)
        if (t.src.kind == BufKind::kStaging) srcs.insert(where(r, i, t.src));
      if (srcs.empty()) continue;
      const int32_t u = unit_of(r, i, op);
      CanaryPlan::OpItems& oi = p->ops[static_cast<size_t>(r)][i];
      for (auto [o, s] : srcs) {
        // The read marks compare tags, so an owner reads a slot's units in increasing order
        // (builder_rs.cc: unit u uses slot u mod n_stg, units in order on the read stream).
        TIDE_PLAN_CHECK(o == r, "staging canary: rank ", r, " op ", i, " sums rank ", o, "'s staging");
        auto [it, fresh] = read_unit.try_emplace({o, s}, u);
        TIDE_PLAN_CHECK(fresh || it->second <= u, "staging canary: rank ", r, " op ", i, " reads unit ", u,
                        " of slot ", s, " after unit ", it->second);
        it->second = u;
        for (int w = 0; w < n; ++w) {
          auto c = pushes.find({o, s, u, w});
          if (c != pushes.end()) oi.before.push_back({kSumCheck, o, s, static_cast<int16_t>(w), u, c->second});
        }
        last_sum[{o, s, u}] = {r, i};
      }
    }
  for (const auto& [k, ri] : last_sum)
    p->ops[static_cast<size_t>(ri.first)][ri.second].after.push_back(
        {kReadMark, static_cast<int16_t>(std::get<0>(k)), static_cast<int16_t>(std::get<1>(k)), 0, std::get<2>(k), 0});
  for (int r = 0; r < n; ++r)
    for (auto& [i, oi] : p->ops[static_cast<size_t>(r)]) {
      const Op& op = progs[static_cast<size_t>(r)].ops[static_cast<size_t>(i)];
      oi.check_id = static_cast<int32_t>(ops_.size());
      ops_.push_back(TIDE_STR_CAT("rank ", r, " op ", i, " (", op_word(op.kind), ", tag ", static_cast<int>(op.tag),
                                  ", round ", op.round, ")"));
    }
  return p;
}

uint64_t StagingCanary::begin_call(int64_t seq) {
  seq_of_.push_back(seq);
  return seq_of_.size();
}

void StagingCanary::launch(const std::vector<CanaryPlan::Item>& items, int32_t check_id, uint64_t call,
                           cudaStream_t stream) {
  for (size_t at = 0; at < items.size(); at += kMaxItems) {
    CanaryStep s{};
    s.rec = record_;
    s.call = call;
    s.check_id = check_id;
    for (size_t j = at; j < items.size() && s.n < kMaxItems; ++j) {
      const CanaryPlan::Item& it = items[j];
      const size_t os = static_cast<size_t>(it.owner) * kCanarySlots + static_cast<size_t>(it.slot);
      DevItem& d = s.items[s.n++];
      d.kind = it.kind;
      d.owner = it.owner;
      d.slot = it.slot;
      d.pusher = it.pusher;
      d.word = it.kind == kReadMark ? read_ + os : pushed_ + os * static_cast<size_t>(world_) + it.pusher;
      d.read = read_ + os;
      const uint64_t tag = tag_of(call, it.unit);
      d.value = it.kind == kPushCheck || it.kind == kReadMark ? tag : (tag << 8) | static_cast<uint64_t>(it.count);
    }
    canary_kernel<<<1, 1, 0, stream>>>(s);
    TIDE_CHECK_CUDA(cudaGetLastError(), "launching the staging canary for ", ops_[static_cast<size_t>(check_id)]);
  }
}

void StagingCanary::enqueue(const CanaryPlan& p, int rank, int op, uint64_t call, cudaStream_t stream,
                            bool after) {
  const auto& m = p.ops[static_cast<size_t>(rank)];
  auto it = m.find(op);
  if (it == m.end()) return;
  const auto& items = after ? it->second.after : it->second.before;
  if (!items.empty()) launch(items, it->second.check_id, call, stream);
}

std::string StagingCanary::tag_name(uint64_t tag) const {
  const uint64_t call = tag >> kUnitBits;
  const int64_t unit = static_cast<int64_t>(tag & ((uint64_t{1} << kUnitBits) - 1)) - 1;
  if (call == 0 || call > seq_of_.size()) return "nothing";
  return TIDE_STR_CAT("unit ", unit, " of call seq ", seq_of_[call - 1]);
}

std::string StagingCanary::fault() const {
  const volatile CanaryRecord* r = record_;
  if (r->flag != 1) return "";
  const std::string op = ops_.at(static_cast<size_t>(r->check_id));
  const int64_t seq = r->call >= 1 && r->call <= seq_of_.size() ? seq_of_[r->call - 1] : -1;
  const std::string head = TIDE_STR_CAT(op, " seq ", seq, ": ");
  const int o = r->owner, s = r->slot, w = r->pusher;
  if (r->kind == kPushCheck)
    return head + TIDE_STR_CAT("early staging reuse: rank ", w, "'s push into rank ", o, "'s staging slot ", s,
                               " overwrites ", tag_name(r->expected), " (pushed by rank ", w, ") before rank ", o,
                               "'s SUM read it (its last read: ", tag_name(r->found), ") (staging-canary)");
  const uint64_t want = r->expected, got = r->found;
  return head + TIDE_STR_CAT("missing push fence: rank ", o, "'s SUM of ", tag_name(want >> 8), " reads its staging slot ",
                             s, " before rank ", w, "'s ", want & 0xff, " push op(s) of it completed; the slot holds ",
                             got == 0 ? std::string("nothing pushed yet")
                                      : TIDE_STR_CAT(tag_name(got >> 8), ", push op ", got & 0xff, " of rank ", w),
                             " (staging-canary)");
}

}  // namespace tide::cuda
