// The CUDA executors' shared issue path (contract and [Note: enqueue order] in issue.h).
#include "exec/cuda/issue.h"

#include <algorithm>

#include "tide/errors.h"

namespace tide::cuda {

// ---- issue ------------------------------------------------------------------------------------
namespace {

const Program& prog(const IssueContext& c, int r) { return (*c.programs)[static_cast<size_t>(r)]; }
int fabric_rank(const IssueContext& c, int r) { return c.tables->members[static_cast<size_t>(r)]; }

void* resolve(const IssueContext& c, const BufRef& ref) {
  TIDE_CHECK(ref.rank >= 0 && static_cast<size_t>(ref.rank) < c.programs->size(), "buffer rank ", ref.rank);
  if (is_user_buffer(ref.kind)) {
    const UserBuffer* u = (*c.buffers).at(static_cast<size_t>(ref.rank)).find(ref.kind, ref.index);
    void* base = u != nullptr ? u->data : nullptr;
    TIDE_PLAN_CHECK(base != nullptr, "rank ", fabric_rank(c, ref.rank), ": no ", buf_kind_name(ref.kind), "[", ref.index,
                    "] bound for this call");
    return static_cast<char*>(base) + ref.offset;
  }
  const ArenaSpec& a = c.tables->layout;
  const int k = static_cast<int>(ref.kind);
  TIDE_CHECK(a.offset[k] >= 0 && ref.end() <= a.bytes[k], buf_kind_name(ref.kind), " access [", ref.offset, ", ",
             ref.end(), ") beyond the region's ", a.bytes[k], " bytes");
  char* arena = c.fabric->arena(fabric_rank(c, ref.rank));
  TIDE_CHECK(arena != nullptr, "rank ", fabric_rank(c, ref.rank), "'s arena is not open in this process");
  return arena + a.offset[k] + ref.offset;
}

// Whether a COPY/PUT op's copies run on SMs ([Note: copies on SMs], runtime.h): copies_on=sms, or
// auto and one of its copies goes between two ranks on one device.
bool copies_on_sms(const IssueContext& c, const Op& op) {
  const CopiesOn on = c.opt->copies_on;
  if (on != CopiesOn::kAuto) return on == CopiesOn::kSms;
  for (const auto& cp : op.copies) {
    if (cp.src.rank == cp.dst.rank) continue;
    const int a = c.fabric->device_of(fabric_rank(c, cp.src.rank));
    if (a >= 0 && a == c.fabric->device_of(fabric_rank(c, cp.dst.rank))) return true;
  }
  return false;
}

// One call being issued: the counter mirror of every group rank (the fabric's issued values,
// resolved once per call) and the pending stream memory operations of one stream (issue.h:
// consecutive waits or writes of a stream go in one call).
struct Call {
  const IssueContext& c;
  int64_t seq;
  std::vector<uint64_t*> mirror;  // [group rank] -> its counters' issued values
  cudaStream_t stream = nullptr;  // of the pending batch
  int device = 0;
  double deadline_s = 0;
  std::vector<WaitSpec> waits;
  std::vector<CounterWrite> writes;

  Call(const IssueContext& ctx, int64_t s) : c(ctx), seq(s) {
    const size_t n = c.programs->size();
    mirror.resize(n);
    for (size_t r = 0; r < n; ++r) {
      const size_t nc = static_cast<size_t>((*c.programs)[r].num_counters);
      mirror[r] = c.fabric->issued(fabric_rank(c, static_cast<int>(r)), nc).data();
    }
  }
  uint64_t& shadow(const CounterRef& ref) {
    TIDE_CHECK(ref.rank >= 0 && static_cast<size_t>(ref.rank) < mirror.size() && ref.index >= 0 &&
                   ref.index < prog(c, ref.rank).num_counters,
               "counter ", ref.index, " of rank ", ref.rank);
    return mirror[static_cast<size_t>(ref.rank)][ref.index];
  }
  // Advances the host mirror of op's counter (a bump, or a RECV's arrival: + value) and returns
  // its new value; while capturing, also records the change for every replay ([Note: replayed
  // calls]).
  uint64_t advance(const Op& op) {
    uint64_t& sh = shadow(op.counter);
    sh = advanced(op, seq, sh);
    if (c.graph != nullptr) {
      const int f = fabric_rank(c, op.counter.rank), n = prog(c, op.counter.rank).num_counters;
      if (op.kind == OpKind::kEventRecord)
        c.graph->advance.raise(f, n, op.counter.index, GraphValue{op.value, op.per_call, false});
      else
        c.graph->advance.add(f, n, op.counter.index, static_cast<uint64_t>(op.value));
    }
    return sh;
  }
  // Enqueues the pending batch (issue.h): the waits as one watched batch, or the writes.
  void flush() {
    if (!waits.empty()) {
      c.watchdog->watched_waits(stream, device, waits.data(), waits.size(), c.tables->wait_labels, seq, deadline_s);
      waits.clear();
    }
    if (!writes.empty()) {
      signal_all(stream, writes.data(), writes.size());
      writes.clear();
    }
  }
  void add_wait(cudaStream_t s, int rank, const WaitSpec& w, double deadline) {
    if (!writes.empty() || (!waits.empty() && (s != stream || deadline != deadline_s))) flush();
    if (waits.empty()) {
      stream = s;
      device = c.fabric->device_of(fabric_rank(c, rank));
      deadline_s = deadline;
    }
    waits.push_back(w);
  }
  void add_write(cudaStream_t s, uint64_t* counter, uint64_t v) {
    if (!waits.empty() || (!writes.empty() && s != stream)) flush();
    stream = s;
    writes.push_back({counter, v});
  }
  void issue_group(int r, const std::vector<int>& ops, size_t k, size_t end);
  void issue(int rank, int i);
};

// Local rank r's rendezvous group ops[k, end) on the rail ([Note: NCCL rail], fabric/nccl.h),
// watched; then its receives' counter bumps on the same stream.
void Call::issue_group(int r, const std::vector<int>& ops, size_t k, size_t end) {
  flush();
  const Program& pr = prog(c, r);
  const Op& first = pr.ops[static_cast<size_t>(ops[k])];
  TIDE_CHECK(c.rail != nullptr && c.rail_gpus_per_node > 0, describe_op(c, r, ops[k], seq),
             ": a two-sided rail group, but this executor has no rail (options rails='two_sided' and set_rail)");
  const int L = c.rail_gpus_per_node, me = fabric_rank(c, r);
  auto rail_rank = [&](int group_rank) {
    const int f = fabric_rank(c, group_rank);
    TIDE_CHECK(f % L == me % L, describe_op(c, r, ops[k], seq), ": rail peer rank ", f, " has local index ", f % L,
               ", rank ", me, " has ", me % L, " (a rail connects one local index)");
    return f / L;
  };
  std::vector<fabric::RailXfer> sends, recvs;
  std::string peers;
  for (size_t q = k; q < end; ++q) {
    const Op& op = pr.ops[static_cast<size_t>(ops[q])];
    for (const auto& cd : op.copies) {
      TIDE_CHECK(cd.src.width == cd.dst.width && cd.src.height == 1 && cd.dst.height == 1,
                 describe_op(c, r, ops[q], seq), ": rail descriptors are 1-D with equal widths");
      if (op.kind == OpKind::kSend)
        sends.push_back({rail_rank(cd.dst.rank), resolve(c, cd.src), cd.src.width});
      else
        recvs.push_back({rail_rank(cd.src.rank), resolve(c, cd.dst), cd.dst.width});
    }
    peers += TIDE_STR_CAT(peers.empty() ? "" : ", ", op.kind == OpKind::kSend ? "SEND to rank " : "RECV from rank ",
                          fabric_rank(c, rail_peer(op)));
  }
  cudaStream_t s = (*c.streams)[static_cast<size_t>(r)][first.stream];
  const std::string what = TIDE_STR_CAT(describe_op(c, r, ops[k], seq), ": rail group ", first.rail_group, " (", peers,
                                        ")");
#ifdef TIDE_WITH_NCCL
  c.rail->enqueue(sends, recvs, s, what);
  if (c.graph == nullptr) {  // a replay is watched whole by its executor ([Note: replayed calls])
    // Weakly held ([Note: late work], runtime.cc): the watchdog never owns the rail, whose last
    // reference may be a face's (a Python object, released only under its interpreter's lock).
    std::weak_ptr<fabric::NcclRail> rail = c.rail;
    const std::string late = what + " did not complete: a peer never posted its matching group (behind, stalled or "
                             "dead); the rail communicator is aborted";
    c.watchdog->watched_work(s, late, [rail, late] {
      if (auto r = rail.lock()) r->abort(late);
    });
  }
#else
  throw Error(what + ": this build has no NCCL (the rail needs it)");
#endif
  for (size_t q = k; q < end; ++q) {
    const Op& op = pr.ops[static_cast<size_t>(ops[q])];
    if (op.kind != OpKind::kRecv || op.counter.index < 0) continue;
    const uint64_t v = advance(op);
    uint64_t* counter = counter_address(c, op.counter.rank, op.counter.index);
    if (c.graph == nullptr)
      add_write(s, counter, v);
    else
      launch_graph_add(counter, static_cast<uint64_t>(op.value), s);
  }
}

void Call::issue(int rank, int i) {
  const Op& op = prog(c, rank).ops[static_cast<size_t>(i)];
  // A stream memory operation joins the pending batch; anything else enqueues the batch first.
  const bool memop = is_wait(op.kind) || op.kind == OpKind::kSignal || op.kind == OpKind::kCredit ||
                     op.kind == OpKind::kEventRecord;
  if (!memop || c.canary != nullptr) flush();
  const RankBindings& b = (*c.buffers)[static_cast<size_t>(rank)];
  const CudaRunOptions& opt = *c.opt;
  const LaunchKnobs knobs = launch_knobs(opt);
  const Program& pr = prog(c, rank);
  const int sum_ctas = pr.sum_ctas > 0 ? pr.sum_ctas : kDefaultSumCtas;
  const int land_ctas = pr.land_ctas > 0 ? pr.land_ctas : kDefaultLandCtas;
  cudaStream_t s = (*c.streams)[static_cast<size_t>(rank)][op.stream];
  auto bump = [&]() {
    const uint64_t v = advance(op);
    uint64_t* counter = counter_address(c, op.counter.rank, op.counter.index);
    if (c.graph == nullptr)
      add_write(s, counter, v);
    else if (op.kind == OpKind::kEventRecord)
      launch_graph_raise(counter, GraphValue{op.value, op.per_call, false}, c.graph->params, s);
    else
      launch_graph_add(counter, static_cast<uint64_t>(op.value), s);
  };
  if (c.canary != nullptr) c.canary->before(*c.canary_plan, rank, i, c.canary_call, s);
  switch (op.kind) {
    case OpKind::kCopy:
    case OpKind::kPut: {
      std::vector<ResolvedCopy> d;
      d.reserve(op.copies.size());
      for (const auto& cp : op.copies) {
        TIDE_CHECK(cp.src.width == cp.dst.width && cp.src.height == cp.dst.height, describe_op(c, rank, i, seq),
                   ": copy shapes differ");
        d.push_back({resolve(c, cp.dst), resolve(c, cp.src), static_cast<size_t>(cp.dst.width),
                     static_cast<size_t>(cp.dst.height), static_cast<size_t>(cp.dst.pitch),
                     static_cast<size_t>(cp.src.pitch)});
      }
      if (copies_on_sms(c, op)) {
        submit_copies_on_sms(s, d.data(), d.size(), opt.copy_ctas);
        if (op.kind == OpKind::kPut) bump();
        break;
      }
      size_t bytes = 0;
      for (const ResolvedCopy& x : d) bytes += x.width * x.height;
      const int g = fabric_rank(c, rank);
      submit_copies(s, d.data(), d.size(),
                    c.lanes ? c.lanes->for_op(g, op.stream, c.fabric->device_of(g), d.size(), bytes) : nullptr,
                    opt.copy_2d);
      if (op.kind == OpKind::kPut) bump();  // data first, then the bump
      break;
    }
    case OpKind::kCast:
      TIDE_CHECK(op.cast_to == DType::kBF16 || op.cast_to == DType::kFP16, describe_op(c, rank, i, seq),
                 ": CAST to ", dtype_name(op.cast_to), " (bfloat16 or float16)");
      for (const auto& cp : op.copies) {
        TIDE_CHECK(cp.src.width == 2 * cp.dst.width && cp.src.height == cp.dst.height, describe_op(c, rank, i, seq),
                   ": CAST shapes");
        char* dst = static_cast<char*>(resolve(c, cp.dst));
        const char* src = static_cast<const char*>(resolve(c, cp.src));
        for (int64_t h = 0; h < cp.dst.height; ++h)
          launch_cast(reinterpret_cast<uint16_t*>(dst + h * cp.dst.pitch),
                      reinterpret_cast<const float*>(src + h * cp.src.pitch), cp.dst.width / 2, opt.cast_ctas, s,
                      op.cast_to == DType::kFP16);
      }
      break;
    case OpKind::kSum:
    case OpKind::kLand: {
      const ReduceOpInfo& ro = c.tables->reduce[static_cast<size_t>(rank)][static_cast<size_t>(i)];
      ReduceArgs a;  // its slot bases serve both kernels
      const auto& grads = b.by_kind[static_cast<int>(BufKind::kGrad)];  // grad[p] at slot p + 1
      for (size_t p = 0; p + 1 < grads.size() && p < static_cast<size_t>(kMaxGradPtrs); ++p) a.base[p] = grads[p + 1].data;
      const UserBuffer* out = b.find(BufKind::kOut, -1);
      a.base[kSlotOut] = out != nullptr ? out->data : nullptr;
      for (size_t r = 0; r < c.programs->size(); ++r) a.base[kSlotArena0 + r] = c.fabric->arena(c.tables->members[r]);
      a.dst = static_cast<float*>(resolve(c, op.dst));
      a.n = ro.n;
      if (ro.level1.n_staged >= 0) {  // [Note: Level-1 SUM on kernels.cu's SUM]
        const Level1Sum& l1 = ro.level1;
        SumArgs sa;
        sa.dst = a.dst;
        sa.n = ro.n;
        sa.n_staged = l1.n_staged;
        for (int j = 0; j < l1.n_staged; ++j) {
          const void* base = a.base[l1.staged_slot[j]];
          TIDE_CHECK(base != nullptr, describe_op(c, rank, i, seq), ": staged slice ", j, " reads slot ",
                     l1.staged_slot[j], ", which has no buffer");
          sa.staged[j] = reinterpret_cast<const uint16_t*>(static_cast<const char*>(base) + l1.staged_off[j]);
        }
        sa.segs = c.tables->d_segs + l1.seg_offset;
        sa.n_segs = l1.n_segs;
        for (int p = 0; p < kMaxGradPtrs; ++p) sa.grad[p] = static_cast<const uint16_t*>(a.base[p]);
        sa.fp16 = l1.fp16 ? 1 : 0;
        sa.scale = op.alpha != 1.0f;
        sa.accumulate = op.accumulate ? 1 : 0;
        sa.alpha = op.alpha;
        launch_sum(sa, sum_ctas, knobs, s);
        break;
      }
      a.runs = c.tables->d_runs + ro.table_offset;
      a.n_runs = ro.n_runs;
      a.n_terms = ro.n_terms;
      a.fp32_terms = ro.fp32_terms;
      a.fp16_terms = ro.fp16_terms;
      a.land = op.kind == OpKind::kLand || op.alpha != 1.0f || op.accumulate;  // a direct SUM: as LAND
      a.accumulate = op.accumulate ? 1 : 0;
      a.alpha = op.alpha;
      launch_reduce(a, op.kind == OpKind::kSum ? sum_ctas : land_ctas, knobs, s);
      break;
    }
    case OpKind::kZero: {
      ZeroArgs z;
      char* base = static_cast<char*>(resolve(c, op.dst));
      for (int64_t h = 0; h < op.dst.height; ++h) {
        if (z.n_regions == kMaxZeroRegions) {
          launch_zero(z, opt.zero_ctas, s);
          z.n_regions = 0;
        }
        z.regions[z.n_regions++] = {base + h * op.dst.pitch, op.dst.width};
      }
      launch_zero(z, opt.zero_ctas, s);
      break;
    }
    case OpKind::kSignal:
    case OpKind::kCredit:
    case OpKind::kEventRecord:
      bump();
      break;
    case OpKind::kWait:
    case OpKind::kEventWait: {
      if (c.graph != nullptr) {  // [Note: replayed calls]: the target is computed per replay
        if (op.per_call == 0 && op.value <= 0) break;
        const double limit = op.deadline_s > 0 ? op.deadline_s : c.opt->timeout_s;
        launch_graph_wait(counter_address(c, op.counter.rank, op.counter.index), GraphValue{op.value, op.per_call, false},
                          c.graph->params, static_cast<uint64_t>(limit * 1e9), c.graph->fault, c.graph->flags,
                          c.graph->add_wait(describe_op(c, rank, i, -1)), c.graph->graph_id, s);
        break;
      }
      if (op.target(seq) <= 0) break;  // counters start at 0: trivially satisfied (first call)
      const int32_t label = c.tables->wait_label[static_cast<size_t>(rank)][static_cast<size_t>(i)];
      add_wait(s, rank, WaitSpec{counter_address(c, op.counter.rank, op.counter.index),
                                 static_cast<uint64_t>(op.target(seq)), label},
               op.deadline_s);  // 0: the executor's deadline
      break;
    }
  }
  if (c.canary != nullptr) {
    flush();
    c.canary->after(*c.canary_plan, rank, i, c.canary_call, s);
  }
}

}  // namespace

uint64_t* counter_address(const IssueContext& c, int rank, int index) {
  const Program& p = prog(c, rank);
  TIDE_CHECK(index >= 0 && index < p.num_counters, "counter ", index, " of rank ", fabric_rank(c, rank));
  char* arena = c.fabric->arena(fabric_rank(c, rank));
  TIDE_CHECK(arena != nullptr, "rank ", fabric_rank(c, rank), "'s arena is not open in this process");
  return reinterpret_cast<uint64_t*>(arena + c.tables->layout.counters_offset) + index;
}

std::string describe_op(const IssueContext& c, int rank, int i, int64_t seq) {
  const Op& op = prog(c, rank).ops[static_cast<size_t>(i)];
  return op_text(*c.programs, c.tables->members, c.tables->producer, rank, i).text(seq, op.target(seq));
}

void issue_call(const IssueContext& c, int64_t seq) {
  const ProgramTables& t = *c.tables;
  Call call(c, seq);
  OrderInput in;
  in.programs = c.programs;
  in.stream_ops = &t.stream_ops;
  in.producer = &t.producer;
  in.local = &t.local;
  in.dead_rank = c.dead_rank;
  auto visit = [&](int r, int s, size_t k, size_t end) {
    const auto& ops = t.stream_ops[static_cast<size_t>(r)][static_cast<size_t>(s)];
    const Program& p = prog(c, r);
    const Op& op = p.ops[static_cast<size_t>(ops[k])];
    const bool local = t.local[static_cast<size_t>(r)];
    if (c.turns != nullptr && c.turns->involves(fabric_rank(c, r))) {  // [Note: same-process issue gate]
      if (local)
        c.turns->own();
      else
        c.turns->peer(fabric_rank(c, r), [&] { call.flush(); });
    }
    if (is_rail_op(op)) {  // a rendezvous group: issued whole (the GPU meets its peers)
      if (local) {
        call.issue_group(r, ops, k, end);
      } else {
        for (size_t q = k; q < end; ++q) {
          const Op& o = p.ops[static_cast<size_t>(ops[q])];
          if (o.kind == OpKind::kRecv && o.counter.index >= 0) call.advance(o);
        }
      }
    } else if (local) {
      call.issue(r, ops[k]);
    } else if (bumps(op.kind)) {
      call.advance(op);  // a peer's bump: simulated
    }
  };
  WalkResult res;
  try {
    res = walk_call(in, seq, call.mirror.data(), visit, &t.order);  // [Note: replayed enqueue order]
    call.flush();
    if (c.turns != nullptr) c.turns->finish([] {});  // flushed: the last own steps are issued
  } catch (...) {
    try {
      call.flush();  // what was issued before the error is enqueued, as op by op
    } catch (...) {
    }
    throw;
  }
  if (!res.stalled) return;
  std::string stuck;
  int shown = 0;
  for (const auto& [r, op] : res.unfinished) {
    if (shown == 4) break;
    stuck += (shown++ ? "; " : "") + describe_op(c, r, op, seq);
  }
  throw TimeoutError("wait never satisfied, its producer is never issued (fail-stop): " + stuck);
}

}  // namespace tide::cuda
