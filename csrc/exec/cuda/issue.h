// The CUDA executors' shared issue path: a prepared program set (ProgramTables) and one call of
// it enqueued onto CUDA streams (issue_call). CudaExecutor (executor.h, every rank of an
// in-process fabric) and CudaRankExecutor (rank_executor.h, one rank) both issue through it; it
// owns no streams, events or executor state (fail_stop.h holds what the executors share besides).
// issue.cc enqueues; program_tables.cc prepares; enqueue_order.h is the order's host-only walk.
//
// Contract
//   - Preparation: make_program_tables() cuts every local rank's SUM/LAND into a run table and
//     uploads all tables once per program set (the executors cache them per set), and labels the
//     local ranks' waits for the watchdog. Nothing is allocated or uploaded per call after.
//   - issue_call(c, seq) enqueues call `seq` of the local ranks; user buffers are the device
//     pointers of c.buffers (RankBindings, tide/bindings.h), bound per call.
//   - Op mapping: COPY/PUT -> submit_copies (batched when eager; on SMs between ranks that share a
//     device, runtime.h [Note: copies on SMs]); CAST/SUM/LAND/ZERO -> kernels;
//     SIGNAL/CREDIT/PUT bumps and EVENT_RECORD -> a write of the counter's new absolute value
//     (single producer per counter, so the host tracks it: "counter += v" is a write of shadow +
//     v); WAIT/EVENT_WAIT -> WAIT_VALUE_64 GEQ, watched by the executor's watchdog; SEND/RECV
//     rendezvous groups -> the NCCL rail, watched.
//   - Eager, consecutive stream memory operations of one stream with nothing enqueued between
//     them go in one call: consecutive waits (same deadline) as one cuStreamBatchMemOp watched as
//     one watchdog entry, consecutive writes as one cuStreamBatchMemOp of WRITE_VALUE_64 (the
//     driver enqueues a batch's operations in array order; waits and writes never share a batch).
//     A batch is enqueued before anything else is, on any stream, so the host enqueue order and
//     every stream's device order are those of the ops issued one by one. While capturing
//     ([Note: replayed calls]) or with the staging canary, every op is enqueued on its own.
//   - Fail-stop: a wait whose producer is never enqueued (dropped credit, dead peer) raises
//     tide::TimeoutError at enqueue time; a wait whose producer is enqueued but late past the
//     deadline (stalled peer) is raised by the watchdog. Messages name rank, op index, kind,
//     tag and seq (describe_op; the watchdog builds them from the set's wait labels only when it
//     reports).
//
// [Note: enqueue order]
// Streams share a limited number of hardware queues, and a blocked stream wait also blocks the
// unrelated streams queued behind it in the same hardware queue (NCCL #2238). The executor
// therefore enqueues the ranks' ops in a topological order of the program's waits: a WAIT is
// issued only after the op producing its target has been issued. By induction the oldest
// unfinished op always has its producers and hardware-queue predecessors finished, so any
// mapping of streams onto hardware queues makes progress.
// A rank executor (rank_executor.h) issues only its local rank's ops, but it walks the same
// global order: it simulates every peer's program (bumps only update the fabric's host mirror)
// and enqueues its own ops where they fall in that order. Every process thus enqueues a
// restriction of one global topological order, so the argument above holds per process (each
// process has its own hardware queues); the rank executors of a process that holds several ranks
// take turns so that it, too, enqueues one restriction ([Note: same-process issue gate],
// fabric/fabric.h). A two-sided rail group completes only while its peers' matching groups run,
// so the processes must also queue the rendezvous in one relative order: the walk visits every
// node's rail groups in the same (local index, group) sequence (tests/test_enqueue_order.py
// checks it over the builders' lowered sets). If the simulation stalls on a peer's stream, the local
// waits on remote producers are enqueued ungated (the watchdog judges them); only a wait whose
// LOCAL producer is never issued fails at enqueue time.
// The walk is enqueue_order.h's walk_call; each set keeps its last call's walk and the next call
// replays it, testing every gate the walk would test ([Note: replayed enqueue order]): the order
// is the walk's whichever runs, and the walk takes over at the first gate whose outcome differs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "exec/cuda/enqueue_order.h"
#include "exec/cuda/graph.h"
#include "exec/cuda/kernels.h"
#include "exec/cuda/runtime.h"
#include "exec/cuda/staging_canary.h"
#include "fabric/fabric.h"
#include "fabric/nccl.h"
#include "tide/bindings.h"
#include "tide/exec_options.h"
#include "tide/program.h"
#include "tide/program_index.h"

namespace tide::cuda {

// What the issue path takes: the executor's options plus executor-level fault injection (tests):
// a dead rank issues nothing; a stalled rank's streams all sleep `stall_s` seconds before its
// first op. SUM/LAND budgets come from the programs (Program::sum_ctas / land_ctas).
struct CudaRunOptions : ExecutorOptions {
  int dead_rank = -1;
  int stall_rank = -1;
  double stall_s = 0.0;
};
// The budget an op runs with: the program's, or kDefault*Ctas for a program that carries none
// (a hand-written program set; builders always stamp the plan's).
constexpr int kDefaultSumCtas = 16;
constexpr int kDefaultLandCtas = 4;

// [Note: Level-1 SUM on kernels.cu's SUM]
// A SUM whose first T-1 terms are bf16 slices laid out like its destination (in every run, from
// one slot at one base offset) and whose last term is a bf16 gradient piece or absent is the
// Level-1 node partial (paper §4.1: L-1 staged slices + the owner's own gradient). kernels.cu's
// SUM takes exactly that operand shape with fewer live registers than REDUCE's general run walk
// (5 against 4 words per term in flight at L = 8), so the executors run it for such ops:
// 70B at a full grid 1.03-1.05x its byte floor against REDUCE's 1.09-1.13x (BENCHMARKS.md).
// Same association (staged slices in order, then the own term; an absent own term is skipped),
// so the bits do not change. Every other SUM and every LAND runs REDUCE.
struct Level1Sum {
  int n_staged = -1;                     // < 0: not this shape
  int staged_slot[kMaxStaged] = {};      // slot (kernels.h: grad, out, arena of a rank) of slice j
  int64_t staged_off[kMaxStaged] = {};   // byte offset of the slice's element 0 in that slot
  int64_t seg_offset = 0;                // first SumSegment in ProgramTables::d_segs
  int n_segs = 0;
  bool fp16 = false;                     // every term fp16 (else every term bf16)
};

// Cuts SUM/LAND op `op_index` of rank `rank` into REDUCE runs (kernels.h), appended to `table`.
// Host only (no CUDA calls), so CPU tests can check the tables against the program's terms.
struct ReduceOpInfo {
  int64_t table_offset = 0;  // first run in the table
  int n_runs = 0;
  int n_terms = 0;
  uint32_t fp32_terms = 0;   // bit i: term i is fp32
  uint32_t fp16_terms = 0;   // bit i: term i is fp16 (else bf16 where not fp32)
  int64_t n = 0;             // dst elements
  Level1Sum level1;          // SUM ops only: set by level1_sum_shape()
};
// `layout`: the arena offsets (symmetric); the first form uses programs[0].arena.
ReduceOpInfo build_run_table(const std::vector<Program>& programs, int rank, int op_index,
                             std::vector<ReduceRun>& table);
ReduceOpInfo build_run_table(const std::vector<Program>& programs, const ArenaSpec& layout, int rank,
                             int op_index, std::vector<ReduceRun>& table);

// The Level-1 shape of a SUM's runs (table[ro.table_offset ...]), its own-term segments appended
// to `segs`; level1.n_staged < 0 (and nothing appended) when the op has another shape. Host only.
Level1Sum level1_sum_shape(const ReduceOpInfo& ro, const std::vector<ReduceRun>& table, std::vector<SumSegment>& segs);

// One program set prepared for issue over a fabric: per-stream op lists, the producer of every
// counter, and the local ranks' SUM/LAND run tables, uploaded once to `device`. Ranks are the
// set's group ranks; members[i] is group rank i's fabric rank.
struct ProgramTables {
  std::vector<int> members;
  std::vector<char> local;  // group rank i is issued by this executor
  ArenaSpec layout;         // arena offsets on every rank
  std::vector<std::vector<std::vector<int>>> stream_ops;  // [rank][stream] -> op indices
  std::vector<std::vector<ReduceOpInfo>> reduce;          // [rank][op] (local ranks)
  std::vector<std::vector<int>> producer;                 // [owner][counter] -> rank, -1: none
  // The local ranks' waits as the watchdog names them: wait_label[rank][op] is the label of a
  // WAIT/EVENT_WAIT in wait_labels, -1 otherwise ([Note: watchdog and fail-stop], runtime.h).
  std::shared_ptr<const WaitLabels> wait_labels;
  std::vector<std::vector<int32_t>> wait_label;
  // The last call's walk ([Note: replayed enqueue order]); the executor's lock guards it.
  mutable OrderRecord order;
  int device = 0;
  ReduceRun* d_runs = nullptr;
  SumSegment* d_segs = nullptr;  // the Level-1 SUMs' own-term segments
  ProgramTables() = default;
  ~ProgramTables();
  ProgramTables(const ProgramTables&) = delete;
  ProgramTables& operator=(const ProgramTables&) = delete;
};
std::unique_ptr<ProgramTables> make_program_tables(const std::vector<Program>& programs, const ProgramIndex& index,
                                                   std::vector<int> members, std::vector<char> local,
                                                   const ArenaSpec& layout, int device);

// Enqueues call `seq` of the local ranks of `t` in the global topological order ([Note: enqueue
// order]). streams[r][s]: local rank r's CUDA stream for program stream s. dead_rank (a group
// rank; tests) issues nothing. Throws TimeoutError when a local wait's local producer is never
// issued, tide::Error / PlanError on bad programs or buffers.
struct IssueContext {
  fabric::Fabric* fabric = nullptr;
  const std::vector<Program>* programs = nullptr;
  const ProgramTables* tables = nullptr;
  const CudaRunOptions* opt = nullptr;
  Watchdog* watchdog = nullptr;
  const std::vector<std::vector<cudaStream_t>>* streams = nullptr;
  const std::vector<RankBindings>* buffers = nullptr;  // [group rank]: local ranks' only
  CopyLaneTable* lanes = nullptr;  // [Note: copy lanes]; null: every copy on its op's stream
  int dead_rank = -1;
  // Two-sided programs ([Note: two-sided rails]): the rail of this rank's local index and the
  // fabric's ranks per node (rail rank = fabric rank / rail_gpus_per_node).
  std::shared_ptr<fabric::NcclRail> rail;
  int rail_gpus_per_node = 0;
  // ExecutorOptions::staging_canary (in-process executor only; staging_canary.h): the set's
  // checks and the call's ordinal. Null: no canary.
  StagingCanary* canary = nullptr;
  const CanaryPlan* canary_plan = nullptr;
  uint64_t canary_call = 0;
  // [Note: same-process issue gate] (fabric/fabric.h): the call's turns among this process's
  // ranks (own steps wait for their position, other ranks' steps of this process are counted).
  // Null: ungated (one executor issues every local rank, or no other rank of the process runs).
  fabric::IssueTurns* turns = nullptr;
  // Capturing ([Note: replayed calls], graph.h): counter writes and waits become graph ops that
  // read the call's parameters, and every change to the host mirror is recorded. Null: eager.
  GraphCapture* graph = nullptr;
};
void issue_call(const IssueContext& c, int64_t seq);
// "rank R op I (KIND, tag T[, round D][, counter NAME@rank Q >= V, produced by rank P]) seq S"
// (fabric ranks); seq < 0: without ">= V" and "seq S" (a captured wait, valid for every replay).
std::string describe_op(const IssueContext& c, int rank, int op_index, int64_t seq);
// describe_op's text in parts that do not depend on the call (host only): the watchdog's wait
// labels are built from them once per set. members: group rank -> fabric rank.
struct OpText {
  std::string head;      // "rank R op I (KIND, tag T[, round D]"
  std::string counter;   // a wait's ", counter NAME@rank Q"; empty otherwise
  std::string producer;  // with a counter: ", produced by rank P" or ", no producer"
  std::string body(int64_t target) const;              // "... >= V, produced by rank P)"
  std::string text(int64_t seq, int64_t target) const;  // describe_op's
};
OpText op_text(const std::vector<Program>& programs, const std::vector<int>& members,
               const std::vector<std::vector<int>>& producer, int rank, int op_index);
uint64_t* counter_address(const IssueContext& c, int rank, int index);

}  // namespace tide::cuda
