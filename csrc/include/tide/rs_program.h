// TIDE-RS programs: one reduce-scatter call of a Plan as per-rank op lists (program.h IR).
//
// Contract
//   - build_rs_program() compiles (plan, call options) into one rank's Program; it is pure and
//     seq-independent like every Program. The bank b = e mod 2 of the two-phase pipeline is a
//     call option: a caller alternates the two programs of a rank (bank 0 for odd seq, bank 1
//     for even seq, i.e. b = (seq - 1) mod 2 with e = seq - 1), as Algorithm 1 does.
//   - Streams: "read" (Level 1: pushes into owners' staging, fp32 sums into outbox blocks and
//     own-node spares; records read completion), "rail" (Level 2 network phase: per wave, gen
//     wait, stale-block ZERO, credits, rounds of PUT + arrival waits, own-spare copy, ready),
//     "land" (wave landings into `out`; records completion).
//   - Inputs: grad[p] (grad dtype, D_p x K_p, read in place; rows past D_p are never read),
//     `out` (fp32, E elements; read too when accumulating). Arena: staging, outbox (2 banks),
//     inbox (n_par generations of L blocks), spare (2 banks x 1 block, passes take turns).
//   - Numerics (paper 4.3): an element's Level-1 partial adds the L-1 staged contributions in
//     local-rank order, then the owner's own, in fp32; a landing adds the L aligned inbox blocks
//     in GPU order j = 0..L-1 and folds alpha and accumulate per wave. Element -> (sub-slice,
//     owner, inbox GPU) does not depend on n_part, chunking, staging slots or mode, so those
//     knobs keep every operand grouping and the bits.
#pragma once

#include <memory>
#include <vector>

#include "tide/plan.h"
#include "tide/program.h"

namespace tide {

// RS op tags (OpTag values from kRsFirst on), for traces, messages and fault injection.
namespace rs_tag {
constexpr OpTag kBankWait = static_cast<OpTag>(100);    // read: bank b free (call e-2's sends)
constexpr OpTag kStagingWait = static_cast<OpTag>(101); // read: owner freed the staging slot
constexpr OpTag kPush = static_cast<OpTag>(102);        // read: Level-1 strided copies
constexpr OpTag kPushSignal = static_cast<OpTag>(103);  // read: tell the owner a push landed
constexpr OpTag kPushWait = static_cast<OpTag>(104);    // read: owner waits for peers' pushes
constexpr OpTag kSum = static_cast<OpTag>(105);         // read: fp32 node partial
constexpr OpTag kStagingFree = static_cast<OpTag>(106); // read: CREDIT staging slot to pushers
constexpr OpTag kProgress = static_cast<OpTag>(107);    // read: record sum progress
constexpr OpTag kOutboxWait = static_cast<OpTag>(108);  // read: outbox block's previous send
constexpr OpTag kGenWait = static_cast<OpTag>(109);     // rail: generation landed everywhere
constexpr OpTag kZero = static_cast<OpTag>(110);        // rail: stale-block zeroing
constexpr OpTag kInboxCredit = static_cast<OpTag>(111); // rail: CREDIT contributors of a wave
constexpr OpTag kSumWait = static_cast<OpTag>(112);     // rail: the block to send is summed
constexpr OpTag kPut = static_cast<OpTag>(113);         // rail: outbox block -> inbox block
constexpr OpTag kSent = static_cast<OpTag>(114);        // rail: record the block reusable
constexpr OpTag kSpareCopy = static_cast<OpTag>(115);   // rail: own-node spare -> inbox
constexpr OpTag kReady = static_cast<OpTag>(116);       // rail: wave complete on this GPU
constexpr OpTag kReadyWait = static_cast<OpTag>(117);   // land: all GPUs ready
constexpr OpTag kLand = static_cast<OpTag>(118);        // land: inbox blocks -> out
constexpr OpTag kLanded = static_cast<OpTag>(119);      // land: tell local GPUs gen is read
constexpr OpTag kRailDone = static_cast<OpTag>(120);    // rail: call's network phase done
constexpr OpTag kSpareWait = static_cast<OpTag>(121);   // read: previous pass's spare copied out
constexpr OpTag kPushStart = static_cast<OpTag>(122);   // read/push: the call reached the caller's stream
constexpr OpTag kPushed = static_cast<OpTag>(123);      // push/read: the push stream's last push read
}  // namespace rs_tag

// Reduction folding (FSDP2): alpha = premul * (op == AVG ? 1/world : 1) / (pre * post).
enum class RsReduceOp : uint8_t { kSum = 0, kAvg = 1, kPremulSum = 2 };
float rs_fold_alpha(RsReduceOp op, int world, double premul = 1.0, double predivide = 1.0,
                    double postdivide = 1.0);

struct RsCallOptions {
  uint32_t struct_size = sizeof(RsCallOptions);
  int bank = 0;            // b = e mod 2 (outbox bank, spare bank)
  float alpha = 1.0f;      // folded scale (rs_fold_alpha)
  bool accumulate = false; // out += alpha * sum instead of out = alpha * sum
  int32_t group = 0;
  bool expert_lane = false; // L_sub = 1 subgroup lane (App. F): no Level 1, bf16 over rails
};

// Expert lane (builder_rs_expert.cc): up to 7 arrivals per wave + own/running output = a fixed
// eight-source sum; each piece travels in four rail parts (one per RMA context).
constexpr int kExpertSlots = 7;
constexpr int kExpertRailParts = 4;
Program build_rs_expert_program(const Plan& plan, const RsCallOptions& opt, int rank);
int64_t rs_expert_inbox_bytes(const Plan& plan);  // 2 generations x 7 slots of E grad items

// TIDE-RS programs generated while they run ([Note: generated programs] in program.h): the
// read stream in n_part*M + 2 steps (bank wait, one per (pass, read position), release), rail and
// land in T + 1 (one per wave, then the final record). build_rs_program concatenates exactly
// these steps, so a generated program is the built one, op for op. Holds `plan` (shared). Not
// for the expert lane (build_rs_expert_program; opt.expert_lane is ignored here, as there).
class RsProgramGenerator final : public ProgramGenerator {
 public:
  RsProgramGenerator(std::shared_ptr<const Plan> plan, const RsCallOptions& opt);
  // A rank's Program without ops and expects (counter_names off: no per-rank name table).
  Program header(int rank, bool counter_names = true) const;
  int steps(int rank, int stream) const override;
  void emit(int rank, int stream, int step, std::vector<Op>& out) const override;
  int producer(const CounterRef& counter, int* stream) const override;  // [Note: RS counters]
  const Plan& plan() const { return *plan_; }

 private:
  std::shared_ptr<const Plan> plan_;
  RsCallOptions opt_;
};

Program build_rs_program(const Plan& plan, const RsCallOptions& opt, int rank);
std::vector<Program> build_rs_programs(const Plan& plan, const RsCallOptions& opt);

// Arena bytes the RS regions need (what the program addresses), to compare with the arena.
struct RsArenaNeeds {
  int64_t staging = 0, outbox = 0, inbox = 0, spare = 0;
};
RsArenaNeeds rs_arena_needs(const Plan& plan);

// Counts measured from a built program (to compare with plan.rs).
struct RsProgramStats {
  int64_t l1_descriptors = 0;  // Level-1 CopyDescs (strided pushes + tails)
  int64_t puts = 0, sums = 0, lands = 0, zeros = 0, ops = 0;
};
RsProgramStats rs_program_stats(const Program& prog);

}  // namespace tide
