// Shared pieces of the TIDE FFI handlers: device table, process index, dtypes, the group call
// (over the core's plan cache and rendezvous), the virtual call, error boundary.
#include <atomic>
#include <chrono>
#include <mutex>
#include <sstream>

#include "tide_ffi.h"

namespace tide::xla_ffi {

const char* target_name(Collective c) {
  return c == Collective::kAllGather ? "tide_all_gather" : "tide_reduce_scatter";
}

namespace {
std::atomic<int64_t> g_process{0};
std::mutex g_diagnosis_mu;
TimeoutDiagnosis g_diagnosis;  // empty: timeouts leave unchanged
}  // namespace

void set_timeout_diagnosis(TimeoutDiagnosis fn) {
  const std::lock_guard<std::mutex> lock(g_diagnosis_mu);
  g_diagnosis = std::move(fn);
}

void set_process_index(int64_t process) {
  TIDE_PLAN_CHECK(process >= 0, "process index must be >= 0, got ", process);
  g_process.store(process);
}

int64_t process_index() { return g_process.load(); }

static void check_table(ffi::Span<const int64_t> table) {
  TIDE_PLAN_CHECK(table.size() % kTableWidth == 0 && table.size() > 0,
                  "device_table: expected (process, device id, local device, group, rank) rows, got ",
                  table.size(), " integers");
}

DeviceSlot lookup_device(ffi::Span<const int64_t> table, int64_t process, int32_t device_ordinal,
                         int world) {
  check_table(table);
  // XLA:CPU hands the handler the device id as its ordinal (2048.. on process 1), XLA:GPU the
  // local device: an entry of this process matches on either, and only one may.
  DeviceSlot s;
  int matches = 0;
  for (size_t i = 0; i < table.size(); i += kTableWidth) {
    if (table[i] != process || (table[i + 1] != device_ordinal && table[i + 2] != device_ordinal))
      continue;
    if (matches++ == 0) {
      s.group = table[i + 3];
      s.rank = static_cast<int>(table[i + 4]);
    }
  }
  TIDE_PLAN_CHECK(matches <= 1, "device_table: device ordinal ", device_ordinal, " of process ",
                  process, " matches ", matches, " devices of the mesh (by id and by local index)");
  if (matches == 1) {
    TIDE_PLAN_CHECK(s.rank >= 0 && s.rank < world, "device_table: device ", device_ordinal,
                    " of process ", process, " has rank ", s.rank, " outside the group of ",
                    world, " ranks");
    return s;
  }
  std::ostringstream ids;
  for (size_t i = 0; i < table.size(); i += kTableWidth)
    ids << (i ? ", " : "") << table[i] << ':' << table[i + 1];
  throw PlanError(TIDE_STR_CAT(
      "device_table: device ", device_ordinal, " of process ", process, " is not in the mesh "
      "this call was traced for (process:device id [", ids.str(), "]); a mesh mismatch between "
      "tide_xla.init() and the shard_map?"));
}

bool table_spans_processes(ffi::Span<const int64_t> table, int64_t process) {
  check_table(table);
  for (size_t i = 0; i < table.size(); i += kTableWidth)
    if (table[i] != process) return true;
  return false;
}

uint64_t table_fingerprint(ffi::Span<const int64_t> table) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64-bit
  for (int64_t v : table) {
    for (int b = 0; b < 8; ++b) {
      h ^= (static_cast<uint64_t>(v) >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

static std::vector<int64_t> owners_of(ffi::Span<const int64_t> table, int64_t group, int world) {
  std::vector<int64_t> owner(static_cast<size_t>(world), -1);
  for (size_t i = 0; i + kTableWidth <= table.size(); i += kTableWidth)
    if (table[i + 3] == group && table[i + 4] >= 0 && table[i + 4] < world)
      owner[static_cast<size_t>(table[i + 4])] = table[i];
  return owner;
}

std::string rank_owners(ffi::Span<const int64_t> table, int64_t group, int world) {
  const std::vector<int64_t> owner = owners_of(table, group, world);
  std::ostringstream os;
  for (int r = 0; r < world;) {
    int e = r;
    while (e + 1 < world && owner[e + 1] == owner[r]) ++e;
    os << (r ? ", " : "") << (e > r ? "ranks " : "rank ") << r;
    if (e > r) os << '-' << e;
    os << " on process " << owner[r];
    r = e + 1;
  }
  return os.str();
}

DType to_tide_dtype(ffi::DataType t, const char* what) {
  switch (t) {
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kFP16;
    case ffi::DataType::F32: return DType::kFP32;
    default:
      throw PlanError(TIDE_STR_CAT(what, ": dtype code ", static_cast<int>(t),
                                   " is not supported (TIDE moves bfloat16, float16, float32)"));
  }
}

std::string dims_str(ffi::Span<const int64_t> dims) {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << (dims.size() == 1 ? ",)" : ")");
  return os.str();
}

std::string dims_str(const std::vector<int64_t>& dims) {
  return dims_str(ffi::Span<const int64_t>(dims.data(), dims.size()));
}

std::vector<int64_t> rank_dims(ffi::Span<const int64_t> dims, int lead_world, const char* what) {
  if (lead_world == 0) return std::vector<int64_t>(dims.begin(), dims.end());
  TIDE_PLAN_CHECK(dims.size() >= 2 && dims[0] == lead_world, what, ": ", dims_str(dims),
                  " must stack every rank's buffer on a leading axis of the virtual world N = ",
                  lead_world);
  return std::vector<int64_t>(dims.begin() + 1, dims.end());
}

Topology group_topology(const GroupAttrs& a) {
  TIDE_PLAN_CHECK(a.nodes >= 1 && a.gpus_per_node >= 1, "topology: nodes=", a.nodes,
                  " gpus_per_node=", a.gpus_per_node, " must both be >= 1");
  Topology t;
  t.nodes = static_cast<int>(a.nodes);
  t.gpus_per_node = static_cast<int>(a.gpus_per_node);
  return t;
}

namespace {

// [Note: handler host time] Wall time on XLA's launch thread inside one handler call, from its
// entry to its return: plan lookup, the rendezvous (in-process: waiting for the other ranks'
// threads), the session and the executor's enqueue. On CUDA nothing waits for the GPU here, so
// this is the host issue cost a step pays whenever the GPU work is shorter than it.
std::atomic<int64_t> g_calls[2], g_ns[2];

class HandlerTimer {
 public:
  explicit HandlerTimer(Collective c) : c_(static_cast<int>(c)), t0_(std::chrono::steady_clock::now()) {}
  ~HandlerTimer() {
    g_ns[c_] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
    ++g_calls[c_];
  }

 private:
  int c_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

HandlerStats handler_stats(Collective c) {
  return {g_calls[static_cast<int>(c)].load(), g_ns[static_cast<int>(c)].load()};
}

void reset_handler_stats() {
  for (int i = 0; i < 2; ++i) g_calls[i] = g_ns[i] = 0;
}

void run_group_call(const CallSpec& spec, int32_t device_ordinal, int64_t run_id,
                    const GroupAttrs& attrs, const GroupSignature& sig, RankIo& io) {
  const HandlerTimer timer(spec.op);
  const Topology topo = group_topology(attrs);
  const int world = topo.world();
  const int64_t process = process_index();
  const DeviceSlot slot = lookup_device(attrs.device_table, process, device_ordinal, world);
  TIDE_PLAN_CHECK(attrs.device_table.size() / kTableWidth % world == 0, "device_table: ",
                  attrs.device_table.size() / kTableWidth, " devices do not split into groups of ",
                  world, " ranks (topology ", topo.nodes, "x", topo.gpus_per_node, ")");
  TIDE_PLAN_CHECK(attrs.mode == 0 || attrs.mode == 1, "mode: expected 0 (in_place) or 1 "
                  "(slot_reuse), got ", attrs.mode);
  TIDE_PLAN_CHECK(attrs.timeout_ms > 0, "timeout_ms: must be > 0, got ", attrs.timeout_ms);
  auto plan = cached_plan(sig, topo, static_cast<Mode>(attrs.mode));
  io.rank = slot.rank;
  const uint64_t table = table_fingerprint(attrs.device_table);
  // Every rank of the process sees the same flag: all raise here, none waits in the rendezvous.
  TIDE_PLAN_CHECK(!session_states().released(table), session_states().released_message());
  if (table_spans_processes(attrs.device_table, process)) {
    const std::string owners = rank_owners(attrs.device_table, slot.group, world);
    if (attrs.where != nullptr &&
        (attrs.where[0] != slot.rank || (attrs.where[1] >= 0 && attrs.where[1] != slot.group)))
      throw PlanError(TIDE_STR_CAT(
          "mesh mismatch: device ", device_ordinal, " of process ", process, " is rank ",
          slot.rank, " of group ", slot.group, " in the mesh given to tide_xla.init(), but has "
          "index ", attrs.where[0], " along the FSDP axis (group ", attrs.where[1], ") in the "
          "shard_map running this call; trace with the mesh init() was given"));
    GroupCall call;
    call.plan = plan;
    call.spec = spec;
    call.group = slot.group;
    call.timeout_ms = attrs.timeout_ms;
    try {
      RunRankCall(call, table, io);
    } catch (const TimeoutError& e) {
      TimeoutDiagnosis diagnose;  // run outside the lock: it waits for the other survivors' posts
      {
        const std::lock_guard<std::mutex> lock(g_diagnosis_mu);
        diagnose = g_diagnosis;
      }
      const std::string found = diagnose ? diagnose(e.what(), slot.group, slot.rank, owners_of(attrs.device_table,
                                                    slot.group, world), attrs.timeout_ms) : "";
      throw TimeoutError(TIDE_STR_CAT(e.what(), " [process ", process, "; group ", slot.group,
                                      ": ", owners, "]", found));
    }
    return;
  }
  RendezvousKey key;
  key.run_id = run_id;
  key.group = slot.group;
  key.op_id = attrs.op_id;
  key.seq = next_rendezvous_seq(device_ordinal, attrs.op_id, run_id);
  if (attrs.where != nullptr) {
    const bool group_ok = attrs.where[1] < 0 || attrs.where[1] == slot.group;
    if (attrs.where[0] != slot.rank || !group_ok) {
      const std::string why = TIDE_STR_CAT(
          "mesh mismatch: device ", device_ordinal, " is rank ", slot.rank, " of group ",
          slot.group, " in the mesh given to tide_xla.init(), but has index ", attrs.where[0],
          " along the FSDP axis (group ", attrs.where[1], ") in the shard_map running this "
          "call; trace with the mesh init() was given");
      rendezvous_fail(key, world, slot.rank, why, /*bad_input=*/true);
      throw PlanError(why);
    }
  }
  GroupCall call;
  call.plan = plan;
  call.spec = spec;
  call.group = slot.group;
  call.timeout_ms = attrs.timeout_ms;
  call.table = table;
  // The meeting hands back every rank's RankIo (each rank's `mine`).
  auto ranks_of = [](const std::vector<const void*>& mine) {
    std::vector<const RankIo*> ranks;
    for (const void* m : mine) ranks.push_back(static_cast<const RankIo*>(m));
    return ranks;
  };
  rendezvous_and_run(
      key, world, io.rank, &io, plan->hash, attrs.timeout_ms,
      [&](const std::vector<const void*>& mine) {
        call.ranks = ranks_of(mine);
        ExecuteGroup(call);
      },
      [&](const std::vector<const void*>& mine) {
        call.ranks = ranks_of(mine);
        CompleteRank(call, slot.rank);
      });
}

std::vector<RankIo> stacked_ranks(const RankIo& all, int world,
                                  const std::vector<int64_t>& in_bytes,
                                  const std::vector<int64_t>& out_bytes, int64_t acc_bytes) {
  TIDE_CHECK(in_bytes.size() == all.in.size() && out_bytes.size() == all.out.size(),
             "stacked_ranks: sizes");
  std::vector<RankIo> ios(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    RankIo& io = ios[static_cast<size_t>(r)];
    io = all;
    io.rank = r;
    for (size_t i = 0; i < io.in.size(); ++i)
      io.in[i] = static_cast<const char*>(all.in[i]) + r * in_bytes[i];
    for (size_t i = 0; i < io.out.size(); ++i)
      io.out[i] = static_cast<char*>(all.out[i]) + r * out_bytes[i];
    for (size_t i = 0; i < io.acc.size(); ++i)
      io.acc[i] = static_cast<const char*>(all.acc[i]) + r * acc_bytes;
  }
  return ios;
}

void run_virtual_call(const CallSpec& spec, int32_t device_ordinal, const GroupAttrs& attrs,
                      const GroupSignature& sig, std::vector<RankIo>& ios) {
  const HandlerTimer timer(spec.op);
  const Topology topo = group_topology(attrs);
  TIDE_PLAN_CHECK(attrs.mode == 0 || attrs.mode == 1, "mode: expected 0 (in_place) or 1 "
                  "(slot_reuse), got ", attrs.mode);
  TIDE_PLAN_CHECK(attrs.timeout_ms > 0, "timeout_ms: must be > 0, got ", attrs.timeout_ms);
  TIDE_PLAN_CHECK(static_cast<int>(ios.size()) == topo.world(), "virtual cluster: ", ios.size(),
                  " ranks stacked for topology ", topo.nodes, "x", topo.gpus_per_node);
  auto plan = cached_plan(sig, topo, static_cast<Mode>(attrs.mode));
  GroupCall call;
  call.plan = plan;
  call.spec = spec;
  call.group = 0;
  call.timeout_ms = attrs.timeout_ms;
  call.virtual_device = device_ordinal;
  for (size_t r = 0; r < ios.size(); ++r) {
    ios[r].rank = static_cast<int>(r);
    call.ranks.push_back(&ios[r]);
  }
  ExecuteGroup(call);  // one thread plays every rank: nothing to meet
  for (int r = 0; r < topo.world(); ++r) CompleteRank(call, r);
}

ffi::Error to_ffi_error(const char* op) {
  try {
    throw;
  } catch (const TimeoutError& e) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, TIDE_STR_CAT(op, ": ", e.what()));
  } catch (const Unimplemented& e) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, TIDE_STR_CAT(op, ": ", e.what()));
  } catch (const PlanError& e) {
    return ffi::Error::InvalidArgument(TIDE_STR_CAT(op, ": ", e.what()));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(TIDE_STR_CAT(op, ": ", e.what()));
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kUnknown, TIDE_STR_CAT(op, ": unknown exception"));
  }
}

}  // namespace tide::xla_ffi
