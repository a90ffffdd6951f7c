// Program tables of the CUDA issue path: SUM/LAND run tables, the Level-1 SUM shape, the wait
// labels, uploaded once per program set (contract in issue.h).
#include <algorithm>
#include <map>
#include <set>

#include "exec/cuda/issue.h"
#include "tide/errors.h"

namespace tide::cuda {

// ---- run tables --------------------------------------------------------------------------------
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

// ---- op descriptions ---------------------------------------------------------------------------
std::string OpText::body(int64_t target) const {
  std::string s = head + counter;
  if (!counter.empty()) s += TIDE_STR_CAT(" >= ", target);
  return s + producer + ")";
}

std::string OpText::text(int64_t seq, int64_t target) const {
  if (seq >= 0) return TIDE_STR_CAT(body(target), " seq ", seq);
  return head + counter + producer + ")";
}

OpText op_text(const std::vector<Program>& programs, const std::vector<int>& members,
               const std::vector<std::vector<int>>& producer, int rank, int i) {
  const Op& op = programs.at(static_cast<size_t>(rank)).ops.at(static_cast<size_t>(i));
  auto fab = [&](int g) { return g >= 0 && static_cast<size_t>(g) < members.size() ? members[static_cast<size_t>(g)] : g; };
  OpText t;
  t.head = TIDE_STR_CAT("rank ", fab(rank), " op ", i, " (", op_kind_name(op.kind), ", tag ", static_cast<int>(op.tag));
  if (op.round >= 0) t.head += TIDE_STR_CAT(", round ", op.round);
  const CounterRef& c = op.counter;
  if ((op.kind == OpKind::kWait || op.kind == OpKind::kEventWait) && c.index >= 0) {
    const size_t idx = static_cast<size_t>(c.index);
    const bool known = c.rank >= 0 && static_cast<size_t>(c.rank) < programs.size();
    const Program* pc = known ? &programs[static_cast<size_t>(c.rank)] : nullptr;
    const std::string name = pc && idx < pc->counter_names.size() && !pc->counter_names[idx].empty()
                                 ? pc->counter_names[idx] : std::to_string(c.index);
    t.counter = TIDE_STR_CAT(", counter ", name, "@rank ", fab(c.rank));
    const int p = known && idx < producer[static_cast<size_t>(c.rank)].size() ? producer[static_cast<size_t>(c.rank)][idx] : -1;
    t.producer = p >= 0 ? TIDE_STR_CAT(", produced by rank ", fab(p)) : std::string(", no producer");
  }
  return t;
}

namespace {
// The local ranks' waits, described when the watchdog reports a batch of them.
class OpWaitLabels final : public WaitLabels {
 public:
  int32_t add(OpText t) {
    items_.push_back(std::move(t));
    return static_cast<int32_t>(items_.size() - 1);
  }
  std::string describe(const WaitSpec* specs, size_t n, int64_t seq) const override {
    auto body = [&](const WaitSpec& w) {
      if (w.label < 0 || static_cast<size_t>(w.label) >= items_.size())
        return TIDE_STR_CAT("a wait (counter at ", static_cast<const void*>(w.counter), " >= ", w.value, ")");
      return items_[static_cast<size_t>(w.label)].body(static_cast<int64_t>(w.value));
    };
    if (n == 0) return TIDE_STR_CAT("no wait, seq ", seq);
    std::string s = TIDE_STR_CAT(body(specs[0]), " seq ", seq);
    if (n == 1) return s;
    s += TIDE_STR_CAT(" (one batch of ", n, " waits on its stream, which stops at the first one not met; the others: ");
    for (size_t i = 1; i < n; ++i) s += (i > 1 ? ", " : "") + body(specs[i]);
    return s + ")";
  }

 private:
  std::vector<OpText> items_;
};
}  // namespace

// ---- program tables ------------------------------------------------------------------------------
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
  // The local ranks' wait labels ([Note: watchdog and fail-stop], runtime.h).
  auto labels = std::make_shared<OpWaitLabels>();
  t->wait_label.resize(n);
  for (size_t r = 0; r < n; ++r) {
    if (!t->local[r]) continue;
    const Program& p = programs[r];
    t->wait_label[r].assign(p.ops.size(), -1);
    for (size_t i = 0; i < p.ops.size(); ++i) {
      const Op& op = p.ops[i];
      if ((op.kind == OpKind::kWait || op.kind == OpKind::kEventWait) && op.counter.index >= 0)
        t->wait_label[r][i] = labels->add(op_text(programs, t->members, t->producer, static_cast<int>(r), static_cast<int>(i)));
    }
  }
  t->wait_labels = std::move(labels);
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

}  // namespace tide::cuda
