// [Note: the executor boundary] With executor_cuda.cc, the one place where ffi/ reaches TIDE's
// executors (this file: XLA:CPU through run_cpu; executor_cuda.cc: CUDA through CudaExecutor).
//
// XLA already runs one thread per device, and the rendezvous has every rank's buffers before the
// executor is called. The CPU executor (tide/exec_cpu.h) steps all ranks of a call list itself
// (run_cpu, threads mode), so rank 0 of the group runs one call for every rank (ExecuteGroup)
// while the other device threads wait in the rendezvous; each rank then does its own completion
// work (CompleteRank). Programs come from the TIDE-AG / TIDE-RS builders, unchanged: the same
// per-rank op lists the virtual cluster runs.
//
// Buffers (the push rule of program.h: a rank touches user buffers of its own rank only):
//   TIDE-AG  shard[p] <- XLA operand p (R_p rows, padded); the landing is the arena's ring slot 0;
//            CompleteRank copies rank r's landing rows [0, D_p) of each parameter into XLA
//            result p. That copy is the one the XLA face adds: XLA allocates its results, and
//            peers may only write arena memory. (An executor option to bind per-parameter
//            landings outside the arena in threads mode would remove it.)
//   TIDE-RS  grad[p] <- XLA operand p (read in place); out <- XLA's packed fp32 result (written
//            in place; with accumulate it is the donated accumulator, aliased by XLA).
//
// State per (plan, collective, mesh group): the symmetric arena, the built programs and the call
// sequence number. Counters are epochs and never reset, so the arena lives as long as the
// process (like the virtual cluster's); calls of one state are serialised by its mutex.
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "tide/exec_cpu.h"
#include "tide/program.h"
#include "tide/rs_program.h"
#include "tide_ffi.h"

namespace tide::xla_ffi {

ProgramKey program_key(const GroupCall& call, int64_t seq) {
  const bool rs = call.spec.op == Collective::kReduceScatter;
  // TIDE-RS alternates the two outbox banks: b = (seq - 1) mod 2 (rs_program.h).
  const int bank = rs ? static_cast<int>((seq - 1) % 2) : 0;
  return std::make_tuple(bank, rs ? call.spec.scale : 1.0f, rs && call.spec.accumulate);
}

std::vector<Program> build_call_programs(const GroupCall& call, int bank) {
  const Plan& plan = *call.plan;
  std::vector<Program> progs;
  if (call.spec.op == Collective::kReduceScatter) {
    RsCallOptions o;
    o.bank = bank;
    o.alpha = call.spec.scale;
    o.accumulate = call.spec.accumulate;
    o.group = static_cast<int32_t>(call.group);
    progs = build_rs_programs(plan, o);
  } else {
    AgCallOptions o;
    o.ring_slot = 0;
    o.resident = false;  // XLA owns the shards: read them in place (kShard)
    o.group = static_cast<int32_t>(call.group);
    o.with_expects = false;
    progs = build_ag_programs(plan, o);
  }
  TIDE_CHECK(!progs.empty(), "no programs built");
  return progs;
}

namespace {

struct GroupState {
  std::mutex mu;
  std::unique_ptr<CpuArena> arena;
  std::map<ProgramKey, std::vector<Program>> programs;
  int64_t seq = 0;
};

std::shared_ptr<GroupState> state_for(const GroupCall& call) {
  // A virtual cluster (all ranks on one device) never shares state with a mesh group.
  using Key = std::tuple<uint64_t, int, int64_t, int64_t>;
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<GroupState>> states;
  std::lock_guard<std::mutex> lock(mu);
  auto& st = states[Key{call.plan->hash, static_cast<int>(call.spec.op), call.group,
                        call.virtual_device}];
  if (!st) st = std::make_shared<GroupState>();
  return st;
}

const std::vector<Program>& programs_for(GroupState& st, const GroupCall& call, int64_t seq) {
  const ProgramKey key = program_key(call, seq);
  auto it = st.programs.find(key);
  if (it == st.programs.end()) {
    std::vector<Program> progs = build_call_programs(call, std::get<0>(key));
    const Plan& plan = *call.plan;
    if (!st.arena)
      st.arena = std::make_unique<CpuArena>(plan.topo.world(), progs[0].arena, false);
    TIDE_CHECK(progs[0].arena.total == st.arena->spec().total,
               "programs of one group disagree on the arena layout");
    it = st.programs.emplace(key, std::move(progs)).first;
  }
  return it->second;
}

std::vector<RankBindings> bindings_for(const GroupCall& call) {
  const Plan& plan = *call.plan;
  const GroupLayout& lay = plan.layout;
  const int N = lay.N;
  std::vector<RankBindings> b(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    const RankIo& io = *call.ranks[r];
    if (call.spec.op == Collective::kAllGather) {
      const int b_shard = dtype_size(plan.sig.shard_dtype);
      for (int p = 0; p < lay.P; ++p)
        b[r].bind(BufKind::kShard, p, const_cast<void*>(io.in[p]), lay.params[p].e * b_shard);
    } else {
      const int b_grad = dtype_size(plan.sig.grad_dtype);
      for (int p = 0; p < lay.P; ++p)
        b[r].bind(BufKind::kGrad, p, const_cast<void*>(io.in[p]),
                  lay.params[p].D * lay.params[p].K * b_grad);
      // With accumulate XLA aliases the accumulator to the result; copy only if it did not.
      if (call.spec.accumulate && io.acc[0] != io.out[0])
        std::memcpy(io.out[0], io.acc[0], static_cast<size_t>(lay.S_fp32));
      b[r].bind(BufKind::kOut, -1, io.out[0], lay.S_fp32);
    }
  }
  return b;
}

}  // namespace

bool executor_available() { return true; }

std::string executor_description() {
  return "CPU executor (csrc/exec/cpu, threads mode) running TIDE-AG/TIDE-RS programs";
}

void ExecuteGroup(const GroupCall& call) {
  if (call.spec.cuda) {
#ifdef TIDE_WITH_CUDA
    ExecuteGroupCuda(call);
    return;
#else
    throw Unimplemented("a CUDA call reached a build without the CUDA executor");
#endif
  }
  auto st = state_for(call);
  std::lock_guard<std::mutex> lock(st->mu);
  const int64_t seq = ++st->seq;
  const auto& progs = programs_for(*st, call, seq);
  std::vector<std::vector<Call>> per_rank(progs.size());
  for (size_t r = 0; r < progs.size(); ++r) per_rank[r].push_back(Call{&progs[r], seq});
  std::vector<RankBindings> bindings = bindings_for(call);
  ExecOptions opt = exec_options_from_env();
  opt.timeout_s = static_cast<double>(call.timeout_ms) / 1000.0;
  run_cpu(*st->arena, per_rank, bindings, opt);
}

void CompleteRank(const GroupCall& call, int rank) {
  if (call.spec.cuda) {
#ifdef TIDE_WITH_CUDA
    CompleteRankCuda(call, rank);
#endif
    return;
  }
  if (call.spec.op != Collective::kAllGather) return;  // TIDE-RS wrote XLA's result in place
  auto st = state_for(call);
  const GroupLayout& lay = call.plan->layout;
  const int b_ag = dtype_size(call.plan->sig.ag_dtype);
  const uint8_t* ring = st->arena->region(rank, BufKind::kRing0);
  const RankIo& io = *call.ranks[rank];
  for (int p = 0; p < lay.P; ++p) {
    const ParamLayout& pl = lay.params[p];
    std::memcpy(io.out[p], ring + pl.o * lay.N, static_cast<size_t>(pl.D * pl.K * b_ag));
  }
}

}  // namespace tide::xla_ffi
