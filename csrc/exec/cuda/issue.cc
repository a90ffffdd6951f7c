// The CUDA executors' shared issue path (contract and [Note: enqueue order] in issue.h).
#include "exec/cuda/issue.h"

#include <algorithm>
#include <map>
#include <set>

#include "tide/errors.h"

namespace tide::cuda {

namespace {
bool is_wait(OpKind k) { return k == OpKind::kWait || k == OpKind::kEventWait; }
}  // namespace

ReduceOpInfo build_run_table(const std::vector<Program>& programs, int rank, int i,
                             std::vector<ReduceRun>& table) {
  return build_run_table(programs, programs.at(0).arena, rank, i, table);
}

ReduceOpInfo build_run_table(const std::vector<Program>& programs_, const ArenaSpec& layout, int rank, int i,
                             std::vector<ReduceRun>& table) {
  const Op& op = programs_.at(static_cast<size_t>(rank)).ops.at(static_cast<size_t>(i));
  TIDE_PLAN_CHECK(op.kind == OpKind::kSum || op.kind == OpKind::kLand, "rank ", rank, " op ", i,
                  " is not a SUM/LAND");
  TIDE_PLAN_CHECK(op.dst.height == 1 && op.dst.width % 4 == 0, "rank ", rank, " op ", i,
                  ": SUM/LAND dst must be one row of fp32");
  ReduceOpInfo ro;
  ro.n = op.dst.width / 4;
  std::map<int, std::vector<const SumTerm*>> by_term;  // term id ascending = operand order
  for (const auto& t : op.terms) by_term[t.term].push_back(&t);
  ro.n_terms = static_cast<int>(by_term.size());
  if (ro.n_terms == 0) {
    // No operand at all (e.g. a landing whose wave has no contributor): every element is 0.0f
    // before alpha/accumulate, as on the CPU. One absent term keeps the kernel shape.
    ro.n_terms = 1;
    ro.table_offset = static_cast<int64_t>(table.size());
    if (ro.n > 0) {
      ReduceRun run{};
      run.dst_off = 0;
      run.len = ro.n;
      for (auto& sl : run.slot) sl = -1;
      table.push_back(run);
    }
    ro.n_runs = static_cast<int>(table.size() - static_cast<size_t>(ro.table_offset));
    return ro;
  }
  TIDE_PLAN_CHECK(ro.n_terms >= 1 && ro.n_terms <= kMaxTerms, "rank ", rank, " op ", i, ": ", ro.n_terms,
                  " terms (1..", kMaxTerms, ")");
  std::vector<std::vector<const SumTerm*>> terms;
  std::set<int64_t> cuts = {0, ro.n};
  int ti = 0;
  for (auto& [id, pieces] : by_term) {
    std::sort(pieces.begin(), pieces.end(), [](auto* a, auto* b) { return a->dst_elem < b->dst_elem; });
    const DType dt = pieces[0]->dtype;
    TIDE_PLAN_CHECK(dt == DType::kBF16 || dt == DType::kFP16 || dt == DType::kFP32, "rank ", rank, " op ", i,
                    ": term dtype ", dtype_name(dt), " (SUM/LAND read bfloat16, float16 or float32)");
    if (dt == DType::kFP32) ro.fp32_terms |= 1u << ti;
    if (dt == DType::kFP16) ro.fp16_terms |= 1u << ti;
    for (auto* p : pieces) {
      TIDE_PLAN_CHECK(p->dtype == dt, "rank ", rank, " op ", i, ": mixed dtypes in term ", id);
      TIDE_PLAN_CHECK(p->dst_elem >= 0 && p->dst_elem + p->elems <= ro.n, "rank ", rank, " op ", i,
                      ": term piece outside dst");
      cuts.insert(p->dst_elem);
      cuts.insert(p->dst_elem + p->elems);
    }
    terms.push_back(pieces);
    ++ti;
  }
  ro.table_offset = static_cast<int64_t>(table.size());
  std::vector<size_t> at(terms.size(), 0);
  std::vector<int64_t> cv(cuts.begin(), cuts.end());
  for (size_t c = 0; c + 1 < cv.size(); ++c) {
    ReduceRun run{};
    run.dst_off = cv[c];
    run.len = cv[c + 1] - cv[c];
    for (size_t t = 0; t < terms.size(); ++t) {
      run.slot[t] = -1;
      auto& v = terms[t];
      while (at[t] < v.size() && v[at[t]]->dst_elem + v[at[t]]->elems <= run.dst_off) ++at[t];
      if (at[t] >= v.size() || v[at[t]]->dst_elem > run.dst_off) continue;
      const SumTerm& p = *v[at[t]];
      const int64_t size = dtype_size(p.dtype);
      const int64_t skip = (run.dst_off - p.dst_elem) * size;
      const BufRef& s = p.src;
      if (s.kind == BufKind::kGrad) {
        TIDE_PLAN_CHECK(s.rank == rank && s.index >= 0 && s.index < kMaxGradPtrs, "rank ", rank, " op ", i,
                        ": grad term of rank ", s.rank, "[", s.index, "]");
        run.slot[t] = static_cast<int16_t>(s.index);
        run.off[t] = s.offset + skip;
      } else if (s.kind == BufKind::kOut) {
        run.slot[t] = kSlotOut;
        run.off[t] = s.offset + skip;
      } else if (!is_user_buffer(s.kind)) {
        const int k = static_cast<int>(s.kind);
        TIDE_PLAN_CHECK(s.offset + p.elems * size <= layout.bytes[k], "rank ", rank, " op ", i,
                        ": term beyond ", buf_kind_name(s.kind));
        run.slot[t] = static_cast<int16_t>(kSlotArena0 + s.rank);
        run.off[t] = layout.offset[k] + s.offset + skip;
      } else {
        throw PlanError(TIDE_STR_CAT("rank ", rank, " op ", i, ": SUM/LAND cannot read ", buf_kind_name(s.kind)));
      }
    }
    table.push_back(run);
  }
  ro.n_runs = static_cast<int>(table.size() - static_cast<size_t>(ro.table_offset));
  return ro;
}

Level1Sum level1_sum_shape(const ReduceOpInfo& ro, const std::vector<ReduceRun>& table, std::vector<SumSegment>& segs) {
  Level1Sum l1;
  const int ns = ro.n_terms - 1;
  const uint32_t all = (1u << ro.n_terms) - 1u;  // one 16-bit dtype for every term: bf16 or fp16
  if (ro.fp32_terms != 0 || (ro.fp16_terms != 0 && ro.fp16_terms != all) || ns < 1 || ns > kMaxStaged ||
      ro.n_runs < 1)
    return l1;
  const ReduceRun* runs = table.data() + ro.table_offset;
  for (int j = 0; j < ns; ++j) {
    l1.staged_slot[j] = runs[0].slot[j];
    l1.staged_off[j] = runs[0].off[j] - 2 * runs[0].dst_off;
  }
  for (int r = 0; r < ro.n_runs; ++r) {
    const ReduceRun& run = runs[r];
    for (int j = 0; j < ns; ++j)  // slice j: present, one slot, laid out like dst
      if (run.slot[j] < 0 || run.slot[j] != l1.staged_slot[j] || run.off[j] - 2 * run.dst_off != l1.staged_off[j])
        return l1;
    const int own = run.slot[ns];
    if (own >= kMaxGradPtrs || (own >= 0 && run.off[ns] % 2 != 0)) return l1;  // own: a gradient piece or absent
  }
  l1.seg_offset = static_cast<int64_t>(segs.size());
  for (int r = 0; r < ro.n_runs; ++r) {
    const ReduceRun& run = runs[r];
    const int own = run.slot[ns];
    segs.push_back({run.dst_off, run.len, own >= 0 ? run.off[ns] / 2 : 0, own >= 0 ? own : -1, 0});
  }
  l1.n_segs = ro.n_runs;
  l1.n_staged = ns;
  l1.fp16 = ro.fp16_terms != 0;
  return l1;
}

// ---- program tables ---------------------------------------------------------------------------
ProgramTables::~ProgramTables() {
  if (d_runs || d_segs) {
    cudaSetDevice(device);
    if (d_runs) cudaFree(d_runs);
    if (d_segs) cudaFree(d_segs);
  }
}

std::unique_ptr<ProgramTables> make_program_tables(const std::vector<Program>& programs, const ProgramIndex& index,
                                                   std::vector<int> members, std::vector<char> local,
                                                   const ArenaSpec& layout, int device) {
  auto t = std::make_unique<ProgramTables>();
  const size_t n = programs.size();
  TIDE_CHECK(members.size() == n && local.size() == n && index.stream_ops.size() == n, "program tables: ", n,
             " programs, ", members.size(), " members");
  t->members = std::move(members);
  t->local = std::move(local);
  t->layout = layout;
  t->device = device;
  t->stream_ops = index.stream_ops;
  t->reduce.resize(n);
  t->producer.resize(n);
  for (size_t r = 0; r < n; ++r) {
    t->producer[r].resize(index.producer[r].size());
    for (size_t c = 0; c < index.producer[r].size(); ++c) t->producer[r][c] = index.producer[r][c].rank;
  }
  std::vector<ReduceRun> table;
  std::vector<SumSegment> segs;
  for (size_t r = 0; r < n; ++r) {
    if (!t->local[r]) continue;
    const Program& p = programs[r];
    t->reduce[r].resize(p.ops.size());
    for (size_t i = 0; i < p.ops.size(); ++i) {
      const Op& op = p.ops[i];
      if (op.kind != OpKind::kSum && op.kind != OpKind::kLand) continue;
      ReduceOpInfo& ro = t->reduce[r][i];
      ro = build_run_table(programs, layout, static_cast<int>(r), static_cast<int>(i), table);
      if (op.kind == OpKind::kSum) ro.level1 = level1_sum_shape(ro, table, segs);
    }
  }
  if (!table.empty()) {
    TIDE_CHECK_CUDA(cudaSetDevice(device));
    TIDE_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&t->d_runs), table.size() * sizeof(ReduceRun)), "run tables");
    TIDE_CHECK_CUDA(cudaMemcpy(t->d_runs, table.data(), table.size() * sizeof(ReduceRun), cudaMemcpyHostToDevice),
                    "uploading run tables");
  }
  if (!segs.empty()) {
    TIDE_CHECK_CUDA(cudaSetDevice(device));
    TIDE_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&t->d_segs), segs.size() * sizeof(SumSegment)),
                    "Level-1 SUM segment tables");
    TIDE_CHECK_CUDA(cudaMemcpy(t->d_segs, segs.data(), segs.size() * sizeof(SumSegment), cudaMemcpyHostToDevice),
                    "uploading Level-1 SUM segment tables");
  }
  return t;
}

// ---- issue ------------------------------------------------------------------------------------
namespace {

const Program& prog(const IssueContext& c, int r) { return (*c.programs)[static_cast<size_t>(r)]; }
int fabric_rank(const IssueContext& c, int r) { return c.tables->members[static_cast<size_t>(r)]; }

// The fabric's issued value of a counter (group ranks).
uint64_t& shadow(const IssueContext& c, const CounterRef& ref) {
  const Program& p = prog(c, ref.rank);
  TIDE_CHECK(ref.index >= 0 && ref.index < p.num_counters, "counter ", ref.index, " of rank ", ref.rank);
  return c.fabric->issued(fabric_rank(c, ref.rank), static_cast<size_t>(p.num_counters))[static_cast<size_t>(ref.index)];
}

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

// The counter value after a bump op (PUT/SIGNAL/CREDIT add, EVENT_RECORD raises to its target).
uint64_t bumped(const Op& op, int64_t seq, uint64_t cur) {
  if (op.kind == OpKind::kEventRecord) return std::max(cur, static_cast<uint64_t>(std::max<int64_t>(0, op.target(seq))));
  return cur + static_cast<uint64_t>(op.value);
}
bool bumps(OpKind k) {
  return k == OpKind::kPut || k == OpKind::kSignal || k == OpKind::kCredit || k == OpKind::kEventRecord;
}
// Advances the host mirror of op's counter (a bump, or a RECV's arrival: + value) and returns its
// new value; while capturing, also records the change for every replay ([Note: replayed calls]).
uint64_t advance(const IssueContext& c, const Op& op, int64_t seq) {
  uint64_t& sh = shadow(c, op.counter);
  sh = op.kind == OpKind::kRecv ? sh + static_cast<uint64_t>(op.value) : bumped(op, seq, sh);
  if (c.graph != nullptr) {
    const int f = fabric_rank(c, op.counter.rank), n = prog(c, op.counter.rank).num_counters;
    if (op.kind == OpKind::kEventRecord)
      c.graph->advance.raise(f, n, op.counter.index, GraphValue{op.value, op.per_call, false});
    else
      c.graph->advance.add(f, n, op.counter.index, static_cast<uint64_t>(op.value));
  }
  return sh;
}
// Local rank r's rendezvous group ops[k, end) on the rail ([Note: NCCL rail], fabric/nccl.h),
// watched; then its receives' counter bumps on the same stream.
void issue_group(const IssueContext& c, int r, const std::vector<int>& ops, size_t k, size_t end, int64_t seq) {
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
    std::shared_ptr<fabric::NcclRail> rail = c.rail;
    const std::string late = what + " did not complete: a peer never posted its matching group (behind, stalled or "
                             "dead); the rail communicator is aborted";
    c.watchdog->watched_work(s, late, [rail, late] { rail->abort(late); });
  }
#else
  throw Error(what + ": this build has no NCCL (the rail needs it)");
#endif
  for (size_t q = k; q < end; ++q) {
    const Op& op = pr.ops[static_cast<size_t>(ops[q])];
    if (op.kind != OpKind::kRecv || op.counter.index < 0) continue;
    const uint64_t v = advance(c, op, seq);
    uint64_t* counter = counter_address(c, op.counter.rank, op.counter.index);
    if (c.graph == nullptr)
      signal(s, counter, v);
    else
      launch_graph_add(counter, static_cast<uint64_t>(op.value), s);
  }
}

void issue(const IssueContext& c, int rank, int i, int64_t seq) {
  const Op& op = prog(c, rank).ops[static_cast<size_t>(i)];
  const RankBindings& b = (*c.buffers)[static_cast<size_t>(rank)];
  const CudaRunOptions& opt = *c.opt;
  const LaunchKnobs knobs = launch_knobs(opt);
  const Program& pr = prog(c, rank);
  const int sum_ctas = pr.sum_ctas > 0 ? pr.sum_ctas : kDefaultSumCtas;
  const int land_ctas = pr.land_ctas > 0 ? pr.land_ctas : kDefaultLandCtas;
  cudaStream_t s = (*c.streams)[static_cast<size_t>(rank)][op.stream];
  auto bump = [&]() {
    const uint64_t v = advance(c, op, seq);
    uint64_t* counter = counter_address(c, op.counter.rank, op.counter.index);
    if (c.graph == nullptr)
      signal(s, counter, v);
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
      WaitSpec w{counter_address(c, op.counter.rank, op.counter.index), static_cast<uint64_t>(op.target(seq))};
      c.watchdog->watched_wait(s, &w, 1, describe_op(c, rank, i, seq), op.deadline_s);  // 0: executor's
      break;
    }
  }
  if (c.canary != nullptr) c.canary->after(*c.canary_plan, rank, i, c.canary_call, s);
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
  std::string s = TIDE_STR_CAT("rank ", fabric_rank(c, rank), " op ", i, " (", op_kind_name(op.kind), ", tag ",
                               static_cast<int>(op.tag));
  if (op.round >= 0) s += TIDE_STR_CAT(", round ", op.round);
  if (is_wait(op.kind) && op.counter.index >= 0) {
    const Program& pc = prog(c, op.counter.rank);
    const size_t idx = static_cast<size_t>(op.counter.index);
    const std::string name = idx < pc.counter_names.size() && !pc.counter_names[idx].empty()
                                 ? pc.counter_names[idx] : std::to_string(op.counter.index);
    s += TIDE_STR_CAT(", counter ", name, "@rank ", fabric_rank(c, op.counter.rank));
    if (seq >= 0) s += TIDE_STR_CAT(" >= ", op.target(seq));
    const int producer = c.tables->producer[static_cast<size_t>(op.counter.rank)][idx];
    s += producer >= 0 ? TIDE_STR_CAT(", produced by rank ", fabric_rank(c, producer)) : std::string(", no producer");
  }
  return seq >= 0 ? s + TIDE_STR_CAT(") seq ", seq) : s + ")";
}

void issue_call(const IssueContext& c, int64_t seq) {
  const ProgramTables& t = *c.tables;
  const int n = static_cast<int>(c.programs->size());
  std::vector<std::vector<size_t>> cur(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) cur[static_cast<size_t>(r)].assign(t.stream_ops[static_cast<size_t>(r)].size(), 0);
  // trust_remote: the simulation stalled on a peer's stream; local waits on remote producers
  // are then enqueued ungated and peers are no longer simulated ([Note: enqueue order]).
  bool trust_remote = false;
  auto considered = [&](int r) { return r != c.dead_rank && (t.local[static_cast<size_t>(r)] || !trust_remote); };
  for (;;) {
    bool progress = false, done = true, remote_left = false;
    for (int r = 0; r < n; ++r) {
      if (!considered(r)) continue;
      const bool local = t.local[static_cast<size_t>(r)];
      const Program& p = prog(c, r);
      for (size_t s = 0; s < cur[static_cast<size_t>(r)].size(); ++s) {
        const auto& ops = t.stream_ops[static_cast<size_t>(r)][s];
        size_t& k = cur[static_cast<size_t>(r)][s];
        while (k < ops.size()) {
          const Op& op = p.ops[static_cast<size_t>(ops[k])];
          if (is_rail_op(op)) {  // a rendezvous group: issued whole (the GPU meets its peers)
            const size_t end = rail_group_end(p, ops, k);
            if (local) {
              issue_group(c, r, ops, k, end, seq);
            } else {
              for (size_t q = k; q < end; ++q) {
                const Op& o = p.ops[static_cast<size_t>(ops[q])];
                if (o.kind == OpKind::kRecv && o.counter.index >= 0) advance(c, o, seq);
              }
            }
            k = end;
            progress = true;
            continue;
          }
          if (is_wait(op.kind) && op.target(seq) > 0) {
            const int producer = t.producer[static_cast<size_t>(op.counter.rank)][static_cast<size_t>(op.counter.index)];
            const bool gated = !(trust_remote && producer >= 0 && !t.local[static_cast<size_t>(producer)]);
            if (gated && shadow(c, op.counter) < static_cast<uint64_t>(op.target(seq))) break;  // producer not issued
          }
          if (local) {
            issue(c, r, ops[k], seq);
          } else if (bumps(op.kind)) {
            advance(c, op, seq);  // a peer's bump: simulated
          }
          ++k;
          progress = true;
        }
        if (k < ops.size()) {
          done = false;
          remote_left = remote_left || !local;
        }
      }
    }
    if (done) return;
    if (progress) continue;
    if (remote_left && !trust_remote) {
      trust_remote = true;
      continue;
    }
    std::string stuck;
    int shown = 0;
    for (int r = 0; r < n && shown < 4; ++r) {
      if (!considered(r)) continue;
      for (size_t s = 0; s < cur[static_cast<size_t>(r)].size() && shown < 4; ++s) {
        const auto& ops = t.stream_ops[static_cast<size_t>(r)][s];
        const size_t k = cur[static_cast<size_t>(r)][s];
        if (k < ops.size()) {
          stuck += (shown ? "; " : "") + describe_op(c, r, ops[k], seq);
          ++shown;
        }
      }
    }
    throw TimeoutError("wait never satisfied, its producer is never issued (fail-stop): " + stuck);
  }
}

}  // namespace tide::cuda
