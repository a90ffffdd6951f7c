// CUDA executor over the program IR (contract and enqueue-order note in executor.h).
#include "exec/cuda/executor.h"

#include <algorithm>
#include <map>
#include <set>

#include "tide/errors.h"

namespace tide::cuda {

void launch_stall(double seconds, cudaStream_t stream);  // kernels.cu (fault injection only)

namespace {
bool is_wait(OpKind k) { return k == OpKind::kWait || k == OpKind::kEventWait; }
// Local names (program.cc's op_kind_name/buf_kind_name are the program layer's; these keep the
// executor free of a link dependency on the builders).
const char* kind_name(OpKind k) {
  static const char* n[] = {"COPY", "CAST", "SUM", "LAND", "ZERO", "PUT", "SIGNAL", "WAIT",
                            "EVENT_RECORD", "EVENT_WAIT", "CREDIT"};
  const int i = static_cast<int>(k);
  return i >= 0 && i < 11 ? n[i] : "?";
}
const char* buf_name(BufKind k) {
  static const char* n[] = {"shard", "landing", "grad", "out", "ring0", "ring1", "resident", "stage",
                            "staging", "outbox", "inbox", "spare"};
  const int i = static_cast<int>(k);
  return i >= 0 && i < kNumBufKinds ? n[i] : "?";
}
}  // namespace

CudaExecutor::CudaExecutor(std::shared_ptr<fabric::InProcessFabric> fabric,
                           std::vector<Program> programs, ExecOptions opt)
    : fabric_(std::move(fabric)), programs_(std::move(programs)), opt_(opt) {
  const int n = fabric_->world();
  TIDE_PLAN_CHECK(static_cast<int>(programs_.size()) == n, "CudaExecutor: ", programs_.size(),
                  " programs for a fabric of ", n, " ranks");
  TIDE_PLAN_CHECK(n <= kMaxSlots - kSlotArena0, "CudaExecutor: at most ", kMaxSlots - kSlotArena0, " ranks");
  const Program& p0 = programs_[0];
  for (int r = 0; r < n; ++r) {
    const Program& p = programs_[static_cast<size_t>(r)];
    TIDE_PLAN_CHECK(p.version == kProgramIrVersion, "rank ", r, ": program IR version ", p.version);
    TIDE_PLAN_CHECK(p.rank == r, "program ", r, " is rank ", p.rank, "'s program");
    // All ranks must run the same plan and group, or the collective order is broken (I4).
    TIDE_PLAN_CHECK(p.plan_hash == p0.plan_hash && p.group == p0.group && p.collective == p0.collective,
                    "rank ", r, " runs plan ", p.plan_hash, " group ", p.group, " but rank 0 runs plan ",
                    p0.plan_hash, " group ", p0.group, " (inconsistent programs)");
    TIDE_PLAN_CHECK(p.arena.total <= fabric_->arena_bytes(), "rank ", r, ": arena needs ", p.arena.total,
                    " bytes, fabric has ", fabric_->arena_bytes());
    TIDE_PLAN_CHECK(p.arena.counters_offset + 8ll * p.num_counters <= fabric_->arena_bytes(),
                    "rank ", r, ": counters exceed the arena");
    for (int k = 0; k < kNumBufKinds; ++k)
      TIDE_PLAN_CHECK(p.arena.offset[k] == p0.arena.offset[k], "arena layouts differ on rank ", r);
  }
  watchdog_ = std::make_unique<Watchdog>(fabric_->device_of(0), opt_.timeout_s);
  streams_.resize(static_cast<size_t>(n));
  stream_ops_.resize(static_cast<size_t>(n));
  reduce_.resize(static_cast<size_t>(n));
  std::vector<ReduceRun> table;
  for (int r = 0; r < n; ++r) {
    const Program& p = programs_[static_cast<size_t>(r)];
    TIDE_CHECK_CUDA(cudaSetDevice(fabric_->device_of(r)));
    const size_t ns = std::max<size_t>(1, p.streams.size());
    // [Note: internal streams] one non-blocking stream per named program stream (caller,
    // readiness, scatter, completion, ...): ordering between them is only what the program's
    // waits and events say, exactly as on the CPU executor.
    streams_[r].resize(ns, nullptr);
    for (auto& s : streams_[r]) TIDE_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ops_[r].resize(ns);
    reduce_[r].resize(p.ops.size());
    fabric_->issued(r, static_cast<size_t>(p.num_counters));
    for (size_t i = 0; i < p.ops.size(); ++i) {
      const Op& op = p.ops[i];
      TIDE_PLAN_CHECK(op.stream < ns, "rank ", r, " op ", i, ": stream ", int(op.stream), " of ", ns);
      stream_ops_[r][op.stream].push_back(static_cast<int>(i));
      if (op.kind == OpKind::kSum || op.kind == OpKind::kLand)
        reduce_[r][i] = build_run_table(programs_, r, static_cast<int>(i), table);
    }
  }
  if (!table.empty()) {
    TIDE_CHECK_CUDA(cudaSetDevice(fabric_->device_of(0)));
    TIDE_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_runs_), table.size() * sizeof(ReduceRun)), "run tables");
    TIDE_CHECK_CUDA(cudaMemcpy(d_runs_, table.data(), table.size() * sizeof(ReduceRun), cudaMemcpyHostToDevice),
                    "uploading run tables");
  }
}

CudaExecutor::~CudaExecutor() {
  for (auto& rs : streams_)
    for (auto s : rs) {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  watchdog_.reset();
  if (d_runs_) cudaFree(d_runs_);
}

cudaStream_t CudaExecutor::stream(int rank, int s) const {
  return streams_.at(static_cast<size_t>(rank)).at(static_cast<size_t>(s));
}

uint64_t* CudaExecutor::counter_ptr(int rank, int index) const {
  const Program& p = programs_.at(static_cast<size_t>(rank));
  TIDE_CHECK(index >= 0 && index < p.num_counters, "counter ", index, " of rank ", rank);
  return reinterpret_cast<uint64_t*>(fabric_->arena(rank) + p.arena.counters_offset) + index;
}

std::string CudaExecutor::describe(int rank, int i, int64_t seq) const {
  const Op& op = programs_[static_cast<size_t>(rank)].ops[static_cast<size_t>(i)];
  std::string s = TIDE_STR_CAT("rank ", rank, " op ", i, " (", kind_name(op.kind), ", tag ",
                               static_cast<int>(op.tag));
  if (op.round >= 0) s += TIDE_STR_CAT(", round ", op.round);
  const Program& p = programs_[static_cast<size_t>(rank)];
  if (is_wait(op.kind) && op.counter.index >= 0) {
    const Program& pc = programs_[static_cast<size_t>(op.counter.rank)];
    const std::string name = static_cast<size_t>(op.counter.index) < pc.counter_names.size()
                                 ? pc.counter_names[static_cast<size_t>(op.counter.index)]
                                 : std::to_string(op.counter.index);
    s += TIDE_STR_CAT(", counter ", name, "@rank ", op.counter.rank, " >= ", op.target(seq));
  }
  (void)p;
  return s + TIDE_STR_CAT(") seq ", seq);
}

void* CudaExecutor::resolve(const BufRef& ref, const std::vector<RankBuffers>& all) const {
  TIDE_CHECK(ref.rank >= 0 && ref.rank < fabric_->world(), "buffer rank ", ref.rank);
  if (is_user_buffer(ref.kind)) {
    const RankBuffers& b = all.at(static_cast<size_t>(ref.rank));
    void* base = nullptr;
    auto pick = [&](const std::vector<void*>& v) -> void* {
      return ref.index >= 0 && static_cast<size_t>(ref.index) < v.size() ? v[static_cast<size_t>(ref.index)] : nullptr;
    };
    switch (ref.kind) {
      case BufKind::kShard: base = pick(b.shard); break;
      case BufKind::kLanding: base = ref.index < 0 ? b.landing : pick(b.landing_p); break;
      case BufKind::kGrad: base = pick(b.grad); break;
      default: base = b.out; break;
    }
    TIDE_PLAN_CHECK(base != nullptr, "rank ", ref.rank, ": no ", buf_name(ref.kind), "[", ref.index,
                    "] bound for this call");
    return static_cast<char*>(base) + ref.offset;
  }
  const ArenaSpec& a = programs_[0].arena;
  const int k = static_cast<int>(ref.kind);
  TIDE_CHECK(ref.end() <= a.bytes[k], buf_name(ref.kind), " access [", ref.offset, ", ", ref.end(),
             ") beyond the region's ", a.bytes[k], " bytes");
  return fabric_->arena(ref.rank) + a.offset[k] + ref.offset;
}

ReduceOpInfo build_run_table(const std::vector<Program>& programs_, int rank, int i,
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
    TIDE_PLAN_CHECK(dt == DType::kBF16 || dt == DType::kFP32, "rank ", rank, " op ", i, ": term dtype");
    if (dt == DType::kFP32) ro.fp32_terms |= 1u << ti;
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
        TIDE_PLAN_CHECK(s.offset + p.elems * size <= programs_[0].arena.bytes[k], "rank ", rank, " op ", i,
                        ": term beyond ", buf_name(s.kind));
        run.slot[t] = static_cast<int16_t>(kSlotArena0 + s.rank);
        run.off[t] = programs_[0].arena.offset[k] + s.offset + skip;
      } else {
        throw PlanError(TIDE_STR_CAT("rank ", rank, " op ", i, ": SUM/LAND cannot read ", buf_name(s.kind)));
      }
    }
    table.push_back(run);
  }
  ro.n_runs = static_cast<int>(table.size() - static_cast<size_t>(ro.table_offset));
  return ro;
}

void CudaExecutor::issue(int rank, int i, int64_t seq, const RankBuffers& b) {
  const Op& op = programs_[static_cast<size_t>(rank)].ops[static_cast<size_t>(i)];
  const std::vector<RankBuffers>& all = *bound_;
  cudaStream_t s = streams_[static_cast<size_t>(rank)][op.stream];
  auto bump = [&](const CounterRef& c, uint64_t new_value) {
    uint64_t& sh = shadow(c);
    sh = std::max(sh, new_value);
    signal(s, counter_ptr(c.rank, c.index), sh);
  };
  switch (op.kind) {
    case OpKind::kCopy:
    case OpKind::kPut: {
      std::vector<CopyDesc> d;
      d.reserve(op.copies.size());
      for (const auto& c : op.copies) {
        TIDE_CHECK(c.src.width == c.dst.width && c.src.height == c.dst.height, describe(rank, i, seq),
                   ": copy shapes differ");
        d.push_back({resolve(c.dst, all), resolve(c.src, all), static_cast<size_t>(c.dst.width),
                     static_cast<size_t>(c.dst.height), static_cast<size_t>(c.dst.pitch),
                     static_cast<size_t>(c.src.pitch)});
      }
      submit_copies(s, d.data(), d.size());
      if (op.kind == OpKind::kPut) {
        const uint64_t cur = shadow(op.counter);
        bump(op.counter, cur + static_cast<uint64_t>(op.value));  // data first, then the bump
      }
      break;
    }
    case OpKind::kCast:
      for (const auto& c : op.copies) {
        TIDE_CHECK(c.src.width == 2 * c.dst.width && c.src.height == c.dst.height, describe(rank, i, seq),
                   ": CAST shapes");
        char* dst = static_cast<char*>(resolve(c.dst, all));
        const char* src = static_cast<const char*>(resolve(c.src, all));
        for (int64_t h = 0; h < c.dst.height; ++h)
          launch_cast(reinterpret_cast<uint16_t*>(dst + h * c.dst.pitch),
                      reinterpret_cast<const float*>(src + h * c.src.pitch), c.dst.width / 2, opt_.cast_ctas, s);
      }
      break;
    case OpKind::kSum:
    case OpKind::kLand: {
      const ReduceOp& ro = reduce_[static_cast<size_t>(rank)][static_cast<size_t>(i)];
      ReduceArgs a;
      a.dst = static_cast<float*>(resolve(op.dst, all));
      a.runs = d_runs_ + ro.table_offset;
      a.n_runs = ro.n_runs;
      a.n_terms = ro.n_terms;
      a.fp32_terms = ro.fp32_terms;
      a.land = op.kind == OpKind::kLand;
      a.accumulate = op.accumulate ? 1 : 0;
      a.alpha = op.alpha;
      a.n = ro.n;
      for (size_t p = 0; p < b.grad.size() && p < static_cast<size_t>(kMaxGradPtrs); ++p) a.base[p] = b.grad[p];
      a.base[kSlotOut] = b.out;
      for (int r = 0; r < fabric_->world(); ++r) a.base[kSlotArena0 + r] = fabric_->arena(r);
      launch_reduce(a, op.kind == OpKind::kSum ? opt_.sum_ctas : opt_.land_ctas, s);
      break;
    }
    case OpKind::kZero: {
      ZeroArgs z;
      char* base = static_cast<char*>(resolve(op.dst, all));
      for (int64_t h = 0; h < op.dst.height; ++h) {
        if (z.n_regions == kMaxZeroRegions) {
          launch_zero(z, opt_.zero_ctas, s);
          z.n_regions = 0;
        }
        z.regions[z.n_regions++] = {base + h * op.dst.pitch, op.dst.width};
      }
      launch_zero(z, opt_.zero_ctas, s);
      break;
    }
    case OpKind::kSignal:
    case OpKind::kCredit: {
      const uint64_t cur = shadow(op.counter);
      bump(op.counter, cur + static_cast<uint64_t>(op.value));
      break;
    }
    case OpKind::kEventRecord:
      bump(op.counter, static_cast<uint64_t>(std::max<int64_t>(0, op.target(seq))));
      break;
    case OpKind::kWait:
    case OpKind::kEventWait: {
      if (op.target(seq) <= 0) break;  // counters start at 0: trivially satisfied (first call)
      WaitSpec w{counter_ptr(op.counter.rank, op.counter.index), static_cast<uint64_t>(op.target(seq))};
      watchdog_->watched_wait(s, &w, 1, describe(rank, i, seq), op.deadline_s);  // 0: executor's
      break;
    }
  }
}

uint64_t& CudaExecutor::shadow(const CounterRef& c) {
  const Program& p = programs_.at(static_cast<size_t>(c.rank));
  TIDE_CHECK(c.index >= 0 && c.index < p.num_counters, "counter ", c.index, " of rank ", c.rank);
  return fabric_->issued(c.rank, static_cast<size_t>(p.num_counters))[static_cast<size_t>(c.index)];
}

void CudaExecutor::fail(const std::string& msg) {
  if (failed_.empty()) failed_ = msg;
}

void CudaExecutor::run(int64_t seq, const std::vector<RankBuffers>& buffers) {
  if (!failed_.empty()) throw Error("CudaExecutor failed earlier (fail-stop): " + failed_);
  const int n = fabric_->world();
  TIDE_PLAN_CHECK(static_cast<int>(buffers.size()) == n, "run: ", buffers.size(), " buffer sets for ", n, " ranks");
  bound_ = &buffers;
  TIDE_CHECK_CUDA(cudaSetDevice(fabric_->device_of(0)));
  if (opt_.stall_rank >= 0 && opt_.stall_rank < n && opt_.stall_s > 0)
    for (auto st : streams_[static_cast<size_t>(opt_.stall_rank)]) launch_stall(opt_.stall_s, st);
  std::vector<std::vector<size_t>> cur(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) cur[static_cast<size_t>(r)].assign(streams_[static_cast<size_t>(r)].size(), 0);
  try {
    for (;;) {
      bool progress = false, done = true;
      for (int r = 0; r < n; ++r) {
        if (r == opt_.dead_rank) continue;
        const Program& p = programs_[static_cast<size_t>(r)];
        for (size_t s = 0; s < cur[static_cast<size_t>(r)].size(); ++s) {
          const auto& ops = stream_ops_[static_cast<size_t>(r)][s];
          size_t& c = cur[static_cast<size_t>(r)][s];
          while (c < ops.size()) {
            const Op& op = p.ops[static_cast<size_t>(ops[c])];
            if (is_wait(op.kind) && op.target(seq) > 0 &&
                shadow(op.counter) < static_cast<uint64_t>(op.target(seq)))
              break;  // its producer is not issued yet
            issue(r, ops[c], seq, buffers[static_cast<size_t>(r)]);
            ++c;
            progress = true;
          }
          if (c < ops.size()) done = false;
        }
      }
      if (done) break;
      if (!progress) {
        std::string stuck;
        int shown = 0;
        for (int r = 0; r < n && shown < 4; ++r) {
          if (r == opt_.dead_rank) continue;
          for (size_t s = 0; s < cur[static_cast<size_t>(r)].size() && shown < 4; ++s) {
            const auto& ops = stream_ops_[static_cast<size_t>(r)][s];
            const size_t c = cur[static_cast<size_t>(r)][s];
            if (c < ops.size()) {
              stuck += (shown ? "; " : "") + describe(r, ops[c], seq);
              ++shown;
            }
          }
        }
        const std::string msg = "wait never satisfied, its producer is never issued (fail-stop): " + stuck;
        fail(msg);
        bound_ = nullptr;
        for (auto& rs : streams_)
          for (auto st : rs) cudaStreamSynchronize(st);  // what was issued has its producers
        throw TimeoutError(msg);
      }
    }
  } catch (const TimeoutError&) {
    throw;
  } catch (const std::exception& e) {
    fail(e.what());
    bound_ = nullptr;
    throw;
  }
  bound_ = nullptr;
}

void CudaExecutor::synchronize() {
  try {
    watchdog_->drain();
  } catch (const TimeoutError& e) {
    fail(e.what());
    for (auto& rs : streams_)
      for (auto st : rs) cudaStreamSynchronize(st);  // released waits let the streams drain
    throw;
  }
  for (auto& rs : streams_)
    for (auto st : rs) TIDE_CHECK_CUDA(cudaStreamSynchronize(st), "executor stream");
}

}  // namespace tide::cuda
