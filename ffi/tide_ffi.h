// tide_xla._ffi: XLA FFI custom calls for TIDE-AG and TIDE-RS over the shared C++ core.
//
// Contract
//   - One handler per (op, platform): AllGatherHandler ("tide_all_gather") and
//     ReduceScatterHandler ("tide_reduce_scatter") on XLA:CPU; the *CudaHandler twins on CUDA.
//     Python registers them from the one `registrations()` dict of this module.
//   - A call carries one TIDE group: P operands in, P results out. Everything static about the
//     group travels as attributes (dims0, the device table, topology, mode, op_id, timeout), so a
//     handler needs no state beyond the core's process-wide plan cache (tide/session_registry.h).
//   - Rank and group come from the static device table ((process index, device) -> fsdp group,
//     rank), built in Python from the concrete Mesh. (this process, device ordinal) is only the
//     key into that table; the ordinal is never used as the rank (a permuted mesh maps ordinals
//     to other ranks) and never matched against another process's devices.
//   - A group whose devices all belong to this process is one in-process virtual cluster: XLA runs
//     each device's call on its own thread, concurrently, so the ranks of a group meet in the
//     core's rendezvous (tide/rendezvous.h, keyed by RunId, group, op_id, seq); then the group's per-rank programs run
//     through ExecuteGroup()/CompleteRank() (executor.cc), the one entry into TIDE's core: the
//     group's GroupSession (tide/session.h). The call path runs one way: executor.cc ->
//     executor_cuda.cc (CUDA calls) -> session_state.cc (the sessions), and executor.cc ->
//     session_state.cc; nothing calls back up.
//   - A mesh that spans processes: each rank runs its own program through a rank executor, with
//     no rendezvous (RunRankCall, executor.cc): on XLA:CPU a CPU RankExecutor over every rank's
//     shared-memory segment, on CUDA a CudaProcessRank (tide/cuda.h: its node's peers by CUDA
//     IPC, other nodes over its NCCL rail). Python (tide_xla/processes.py) prepares those rank
//     states at trace time: the processes agree on the plan hash and exchange segment names (CPU)
//     or IPC handles and rail ids (CUDA) through jax.distributed's key-value store.
//   - Every exception stops at the handler boundary (TIDE_FFI_BOUNDARY) and becomes ffi::Error:
//     PlanError -> INVALID_ARGUMENT, TimeoutError -> DEADLINE_EXCEEDED, anything else -> INTERNAL.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "tide/errors.h"
#include "tide/plan.h"
#include "tide/program.h"
#include "tide/rendezvous.h"
#include "tide/session.h"
#include "tide/session_registry.h"
// The vendored headers end some switch functions without a return; silence only that warning.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop

namespace tide::xla_ffi {

namespace ffi = ::xla::ffi;

// The handlers' first operand: (index along the FSDP axis, group index), int32.
using WhereBuffer = ffi::Buffer<ffi::DataType::S32, 1>;

// Collective: tide::Collective (tide/program.h); the handlers run kAllGather and kReduceScatter.
// The FFI target of a collective: "tide_all_gather" or "tide_reduce_scatter".
const char* target_name(Collective c);

// ---------------------------------------------------------------------------------------------
// Static attributes shared by both ops.
// ---------------------------------------------------------------------------------------------
struct DeviceSlot {
  int64_t group = -1;  // which FSDP group (index over the mesh axes other than `axis`)
  int rank = -1;       // node-major rank r = n*L + l inside the group
};

// device_table: flat (process index, device id, local device, group, rank) rows, one per device
// of the mesh. A handler looks up (this process, its device ordinal): the ordinal is the device id
// on XLA:CPU and the local device on XLA:GPU, so a row of this process matches on either.
constexpr size_t kTableWidth = 5;
DeviceSlot lookup_device(ffi::Span<const int64_t> device_table, int64_t process,
                         int32_t device_ordinal, int world);
// This process's index among the jax.distributed processes (tide_xla.init sets it; 0 alone).
void set_process_index(int64_t process);
int64_t process_index();
// True when some device of the table belongs to another process than `process`.
bool table_spans_processes(ffi::Span<const int64_t> device_table, int64_t process);
// A 64-bit fingerprint of the table (FNV-1a over its integers): which mesh a rank state is for.
uint64_t table_fingerprint(ffi::Span<const int64_t> device_table);
// "ranks 0-3 on process 0, ranks 4-7 on process 1" for group `group`, for messages.
std::string rank_owners(ffi::Span<const int64_t> device_table, int64_t group, int world);
// The survivors' diagnosis of a cross-process rank's timeout (tide/diagnosis.py, over the job's
// key-value store; tide_xla/processes.py sets it): (message, group, rank, owning process of each
// rank of the group, timeout_ms) -> text appended to the TimeoutError ("" when there is none).
using TimeoutDiagnosis = std::function<std::string(const std::string&, int64_t, int, const std::vector<int64_t>&,
                                                   int64_t)>;
void set_timeout_diagnosis(TimeoutDiagnosis fn);

DType to_tide_dtype(ffi::DataType t, const char* what);  // throws PlanError on others
std::string dims_str(ffi::Span<const int64_t> dims);
std::string dims_str(const std::vector<int64_t>& dims);

// ---------------------------------------------------------------------------------------------
// One rank's XLA buffers for one call, visible to every rank of the group (one address space).
// ---------------------------------------------------------------------------------------------
struct RankIo {
  int rank = -1;
  // AG: P shards (R_p x K_p, shard dtype).      RS: P gradients (D_p x K_p, grad dtype).
  std::vector<const void*> in;
  // AG: P parameters (D_p x K_p, AG dtype).      RS: 1 packed fp32 shard (E elements, o32_p).
  std::vector<void*> out;
  // RS with accumulate: 1 packed fp32 shard added to the result (aliased to `out` by XLA).
  std::vector<const void*> acc;
  // CUDA only (executor_cuda.cc): the rank's device and XLA's stream (cudaStream_t), the rank's
  // caller stream for the executor ([Note: stream handoff] in executor_cuda.cc).
  int device = -1;
  void* stream = nullptr;
};

struct CallSpec {
  Collective op = Collective::kAllGather;
  float scale = 1.0f;       // RS: alpha applied to the reduced sum
  bool accumulate = false;  // RS: out = acc + alpha * sum
  bool cuda = false;        // run through the CUDA executor (executor_cuda.cc), not run_cpu
};

// Everything the executor needs about one call of one group, once every rank joined.
struct GroupCall {
  std::shared_ptr<const Plan> plan;
  CallSpec spec;
  int64_t group = 0;                    // which FSDP group of the mesh
  int64_t timeout_ms = 0;               // the executor's wait deadline
  std::vector<const RankIo*> ranks;     // index = rank
  int64_t virtual_device = -1;          // >= 0: a virtual cluster, every rank on this device
  uint64_t table = 0;                   // table_fingerprint of the mesh (0: the virtual cluster's)
};

// [Note: the executor boundary] executor.cc (with executor_cuda.cc and session_state.cc below
// it) is the only part of ffi/ that reaches TIDE's executors. ExecuteGroup runs one call of the group's per-rank TIDE programs over every rank's
// buffers; the rendezvous calls it on rank 0 of the group once all ranks joined. CompleteRank
// then runs on every rank (its own thread) after ExecuteGroup returned, for per-rank completion
// work. Both throw tide::Error / TimeoutError / Unimplemented.
// One (plan, collective, mesh group, virtual device[, rank devices]) of the process: its
// session over its executor in the face's SessionRegistry (session_state.cc; tide/session_registry.h);
// `make` builds the executor for the session's arena the first time. run_session: one call of the group through its session (streams: per rank, CUDA).
// TIDE-AG lands in XLA's result buffers by pulling ([Note: pull landing] in tide/program.h) where
// the plan allows it: fp32 shards cast to the AG dtype (the stage the peers read), on one node or
// several (across nodes the Bruck rounds fill the stage areas the peers pull from). Otherwise
// (shards already in the AG dtype: no stage) it lands in the arena's ring slot and the rank
// copies the landing out.
bool pull_landing(const Plan& plan);
// The rails an executor made now with `opt` runs on (TIDE_EXEC_OPTIONS may set them: the executors
// read it themselves), which every arena below is laid out for.
Rails rails_in_use(const ExecutorOptions& opt);
// The arena of a group's session of `op` on `rails` (GroupSession::own_arena: a TIDE-AG that pulls
// holds its stage and counters only, [Note: pulled arena] in tide/plan.h), and the segment each
// rank of a job of processes needs for it (rank_arena: the same and the entry fence's counter).
ArenaSpec group_arena(const Plan& plan, Collective op, Rails rails);
RankArena group_rank_arena(const Plan& plan, Collective op, Rails rails);
// [Note: state lifetime] A state belongs to its mesh's device table (call.table, the registry's
// scope): it lives until release_table(table) (tide_xla.release, or a re-init of the mesh), which
// frees the states of that table and marks it released until the registry's open(table)
// (tide_xla.init) ([Note: session scopes] in tide/session_registry.h). A call on a released table
// raises PlanError naming tide_xla.release, never reaching freed memory; a call in flight keeps
// its state alive (shared_ptr) until it returns. The virtual cluster's states (table 0) live as
// long as the process. Arena bytes are counted per device (-1: host memory) while a state lives.
SessionRegistry& session_states();  // this process's XLA states
std::shared_ptr<SessionState> group_state(const GroupCall& call, const std::vector<int>* devices,
                                          const std::function<std::shared_ptr<CallExecutor>(const ArenaSpec&)>& make);
// Frees the states of `table` (the registry's release, and the CUDA ranks still pending); every
// executor is synchronised first (a failure is printed, and the state freed all the same).
// Returns how many were freed.
int64_t release_table(uint64_t table);
int64_t run_session(SessionState& st, const GroupCall& call, const std::vector<uintptr_t>& streams);
// The executor options of a group's executor: the call's timeout (tide_xla.init(timeout_s=)); the
// executors apply TIDE_EXEC_OPTIONS themselves.
ExecutorOptions executor_options_for(const GroupCall& call);

// ---- Ranks across processes (session_state.cc; entry: executor.cc; CUDA: executor_cuda.cc) -----
// One rank of a group whose ranks live in several processes: its GroupSession over a rank
// executor (XLA:CPU: a CPU RankExecutor that maps every rank's shared-memory segment; CUDA: the
// core's CudaProcessRank, its node's peers by CUDA IPC and other nodes over its NCCL rail).
// Keyed by (collective, plan hash, device-table fingerprint, group, rank); opened at trace time,
// kept until tide_xla.release of the mesh ([Note: state lifetime] above). The segment every rank
// needs: group_rank_arena above.
struct RankStateKey {
  Collective op = Collective::kAllGather;
  uint64_t plan_hash = 0;
  uint64_t table = 0;  // table_fingerprint of the mesh
  int64_t group = 0;
  int rank = 0;
  bool operator<(const RankStateKey& o) const;
  SessionKey key() const;  // its key in session_states()
};
// Builds the state's session over `executor` (a rank executor whose arena is `arena`, laid out
// for `rails`, which must be the executor's; at `own_arena` in this process: a host segment or
// device memory) and keeps it under `key` (an existing one stays); its arena counts on `device`
// (-1: host); `cuda`: calls go on XLA's stream.
void put_rank_state(const RankStateKey& key, std::shared_ptr<const Plan> plan, std::shared_ptr<CallExecutor> executor,
                    const RankArena& arena, Rails rails, const uint8_t* own_arena, bool cuda, int device);
// Rank `io.rank`'s XLA buffers as its session's bindings (AG: shards, and the landings when
// pulled; RS: gradients and the fp32 output).
RankBindingList rank_bindings(const GroupCall& call, const RankIo& io);
// Maps segments[r] (rank r's shm name) for rank key.rank and builds its session; throws Error
// naming the rank and segment on failure. An existing state is kept (idempotent).
void open_rank_state(const RankStateKey& key, std::shared_ptr<const Plan> plan,
                     const std::vector<std::string>& segments, int64_t timeout_ms);
// Runs `io.rank`'s program of one call (AG without a cast: then copies its landing into XLA's
// results; with one it pulled into them).
void RunRankCall(const GroupCall& call, uint64_t table, const RankIo& io);

// With call.spec.cuda both forward to ExecuteGroupCuda/CompleteRankCuda (executor_cuda.cc,
// which never calls back into executor.cc).
void ExecuteGroup(const GroupCall& call);
void CompleteRank(const GroupCall& call, int rank);
// Whether executor `kind` ("cpu" or "cuda") can run calls here: "cpu" always; "cuda" when the
// module was built with CUDA and a CUDA device is visible. PlanError on another kind.
// executor_description(kind) says which executor runs, or exactly what is missing.
bool executor_available(const std::string& kind);
std::string executor_description(const std::string& kind);
#ifdef TIDE_WITH_CUDA
// A CUDA rank state in two steps, because the IPC handles and the rail's unique id travel between
// the processes in between (tide_xla/processes.py): create allocates the rank's IPC arena on
// `device` and returns its handle; connect opens the node's peers (handles[r] per rank) and the
// rail (rail_id; nodes > 1), then builds the state. Both throw Error naming the rank.
std::string create_cuda_rank_state(const RankStateKey& key, std::shared_ptr<const Plan> plan, int device,
                                   int64_t timeout_ms);
void connect_cuda_rank_state(const RankStateKey& key, const std::vector<std::string>& handles,
                             const std::string& rail_id);
// Drops the CUDA ranks of `table` created but not connected; returns how many.
int64_t release_pending_cuda(uint64_t table);
// TIDE-AG's landing rows [0, D_p) at `ring` (device memory) -> XLA's results, on io.stream.
void copy_landing_async(const GroupCall& call, const char* ring, const RankIo& io);
void ExecuteGroupCuda(const GroupCall& call);
void CompleteRankCuda(const GroupCall& call, int rank);
// RS with accumulate when XLA did not alias acc to out: out <- acc on XLA's stream.
void copy_accumulator_async(const RankIo& io, int64_t bytes);
// Why the CUDA executor cannot run in this process ("" when it can: a device is visible).
std::string cuda_executor_missing();
#endif

// ---------------------------------------------------------------------------------------------
// One group call, shared by both ops (common.cc): checks the device table, builds or reuses the
// plan, takes the next sequence number, meets the other ranks and runs
// ExecuteGroup() (rank 0) and CompleteRank() (every rank).
// ---------------------------------------------------------------------------------------------
struct GroupAttrs {
  ffi::Span<const int64_t> dims0;         // D_p of every parameter
  ffi::Span<const int64_t> device_table;  // (process, id, local, group, rank) rows
  int64_t nodes = 1;                      // M
  int64_t gpus_per_node = 1;              // L
  int64_t mode = 0;                       // Mode (0 in_place, 1 slot_reuse)
  int64_t op_id = 0;                      // call site, fixed at trace time
  int64_t timeout_ms = 0;                 // rendezvous and executor wait budget
  // The device's (axis index, group index) as seen inside the shard_map (host memory, XLA:CPU),
  // or nullptr: checked against the device table to catch a mesh mismatch. Group -1: unchecked.
  const int32_t* where = nullptr;
};

// The binding both ops share after their platform context (the CUDA handlers put
// PlatformStream first); the decoded values are the handler's parameters in this order. TIDE-RS
// appends Attr<float>("scale") and Attr<int64_t>("accumulate").
template <typename Binding>
auto BindGroupCall(Binding b) {
  return std::move(b)
      .template Ctx<ffi::DeviceOrdinal>()                        // key into device_table
      .template Ctx<ffi::RunId>()                                // one launch of the executable
      .template Arg<WhereBuffer>()                               // (axis index, group index)
      .RemainingArgs()                                           // the op's operands
      .RemainingRets()                                           // the op's results
      .template Attr<ffi::Span<const int64_t>>("dims0")          // D_p per parameter
      .template Attr<ffi::Span<const int64_t>>("device_table")   // (process, id, local, group, rank)
      .template Attr<int64_t>("nodes")                           // M
      .template Attr<int64_t>("gpus_per_node")                   // L
      .template Attr<int64_t>("mode")                            // 0 in_place, 1 slot_reuse
      .template Attr<int64_t>("op_id")                           // call site (trace time)
      .template Attr<int64_t>("timeout_ms");                     // wait budget per phase
}

// The virtual cluster's binding (after the platform context): no RunId, no `where`, no device
// table. TIDE-RS appends Attr<float>("scale") and Attr<int64_t>("accumulate").
template <typename Binding>
auto BindVirtualCall(Binding b) {
  return std::move(b)
      .template Ctx<ffi::DeviceOrdinal>()                        // the one device
      .RemainingArgs()                                           // stacked [N, ...] operands
      .RemainingRets()                                           // stacked [N, ...] results
      .template Attr<ffi::Span<const int64_t>>("dims0")          // D_p per parameter
      .template Attr<int64_t>("nodes")                           // M
      .template Attr<int64_t>("gpus_per_node")                   // L
      .template Attr<int64_t>("mode")                            // 0 in_place, 1 slot_reuse
      .template Attr<int64_t>("timeout_ms");                     // executor wait budget
}

// Fills io.rank; `sig` must already hold the parameter shapes and dtypes. A table spanning
// processes runs RunRankCall, never the rendezvous.
void run_group_call(const CallSpec& spec, int32_t device_ordinal, int64_t run_id,
                    const GroupAttrs& attrs, const GroupSignature& sig, RankIo& io);

// Host wall time inside this process's handler calls per collective ([Note: handler host time]
// in common.cc): calls and nanoseconds since the last reset.
struct HandlerStats {
  int64_t calls = 0;
  int64_t ns = 0;
};
HandlerStats handler_stats(Collective c);
void reset_handler_stats();

// Topology (M, L) from the attributes; PlanError when out of range.
Topology group_topology(const GroupAttrs& attrs);

// ---------------------------------------------------------------------------------------------
// Virtual cluster (common.cc): all N ranks of one group on ONE device, operands stacked [N, ...]
// (targets "tide_all_gather_virtual" / "tide_reduce_scatter_virtual"). No rendezvous: the one
// device thread runs ExecuteGroup() and then CompleteRank() for every rank.
// ---------------------------------------------------------------------------------------------
// ios[r] holds rank r's buffers (slices of the stacked operands); `io_stream`/`device` as RankIo.
void run_virtual_call(const CallSpec& spec, int32_t device_ordinal, const GroupAttrs& attrs,
                      const GroupSignature& sig, std::vector<RankIo>& ios);

// Rank r's RankIo from the stacked buffers in `all` (rank 0's addresses): every pointer moves by
// r times its per-rank byte count (in_bytes[p], out_bytes[p], acc_bytes).
std::vector<RankIo> stacked_ranks(const RankIo& all, int world,
                                  const std::vector<int64_t>& in_bytes,
                                  const std::vector<int64_t>& out_bytes, int64_t acc_bytes);

// Operand/result dims with the virtual cluster's leading [N] removed (lead = 0: unchanged).
std::vector<int64_t> rank_dims(ffi::Span<const int64_t> dims, int lead_world, const char* what);

// ---------------------------------------------------------------------------------------------
// Error boundary
// ---------------------------------------------------------------------------------------------
// Thrown where a path exists in the API but not (yet) in this build: maps to UNIMPLEMENTED.
struct Unimplemented : Error {
  using Error::Error;
};
ffi::Error to_ffi_error(const char* op);  // call inside catch(...): maps the active exception

}  // namespace tide::xla_ffi

// Wraps a handler body: every exception becomes an ffi::Error naming the op.
#define TIDE_FFI_BOUNDARY(op, ...)                     \
  try {                                                \
    __VA_ARGS__                                        \
  } catch (...) {                                      \
    return ::tide::xla_ffi::to_ffi_error(op);          \
  }
