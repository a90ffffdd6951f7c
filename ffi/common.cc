// Shared pieces of the TIDE FFI handlers: device table, plan cache, dtypes, error boundary.
#include <map>
#include <mutex>
#include <sstream>

#include "tide_ffi.h"

namespace tide::xla_ffi {

const char* collective_name(Collective c) {
  return c == Collective::kAllGather ? "tide_all_gather" : "tide_reduce_scatter";
}

DeviceSlot lookup_device(ffi::Span<const int64_t> table, int32_t device_ordinal, int world) {
  TIDE_PLAN_CHECK(table.size() % 3 == 0 && table.size() > 0,
                  "device_table: expected (device_id, group, rank) triples, got ", table.size(),
                  " integers");
  for (size_t i = 0; i < table.size(); i += 3) {
    if (table[i] != device_ordinal) continue;
    DeviceSlot s;
    s.group = table[i + 1];
    s.rank = static_cast<int>(table[i + 2]);
    TIDE_PLAN_CHECK(s.rank >= 0 && s.rank < world, "device_table: device ", device_ordinal,
                    " has rank ", s.rank, " outside the group of ", world, " ranks");
    return s;
  }
  std::ostringstream ids;
  for (size_t i = 0; i < table.size(); i += 3) ids << (i ? ", " : "") << table[i];
  throw PlanError(TIDE_STR_CAT(
      "device_table: device ", device_ordinal, " is not in the mesh this call was traced for "
      "(devices [", ids.str(), "]); a mesh mismatch between tide_xla.init() and the shard_map?"));
}

std::shared_ptr<const Plan> cached_plan(const GroupSignature& sig, const Topology& topo,
                                        Mode mode) {
  std::ostringstream key;
  key << topo.nodes << 'x' << topo.gpus_per_node << '|' << int(mode) << '|' << int(sig.ag_dtype)
      << int(sig.grad_dtype) << int(sig.shard_dtype);
  for (const auto& p : sig.params) {
    key << '|';
    for (auto d : p.shape) key << d << ',';
  }
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const Plan>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[key.str()];
  if (!slot) {
    Options opt;
    opt.mode = mode;
    slot = std::make_shared<const Plan>(make_plan(sig, topo, opt));
  }
  return slot;
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

void run_group_call(const CallSpec& spec, int32_t device_ordinal, int64_t run_id,
                    const GroupAttrs& attrs, const GroupSignature& sig, RankIo& io) {
  const Topology topo = group_topology(attrs);
  const int world = topo.world();
  const DeviceSlot slot = lookup_device(attrs.device_table, device_ordinal, world);
  TIDE_PLAN_CHECK(attrs.device_table.size() / 3 % world == 0, "device_table: ",
                  attrs.device_table.size() / 3, " devices do not split into groups of ", world,
                  " ranks (topology ", topo.nodes, "x", topo.gpus_per_node, ")");
  TIDE_PLAN_CHECK(attrs.mode == 0 || attrs.mode == 1, "mode: expected 0 (in_place) or 1 "
                  "(slot_reuse), got ", attrs.mode);
  TIDE_PLAN_CHECK(attrs.timeout_ms > 0, "timeout_ms: must be > 0, got ", attrs.timeout_ms);
  auto plan = cached_plan(sig, topo, static_cast<Mode>(attrs.mode));
  io.rank = slot.rank;
  RendezvousKey key;
  key.run_id = run_id;
  key.group = slot.group;
  key.op_id = attrs.op_id;
  key.seq = next_seq(device_ordinal, attrs.op_id, run_id);
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
  rendezvous_and_run(
      key, world, io, plan->hash, attrs.timeout_ms,
      [&](const std::vector<const RankIo*>& ranks) {
        call.ranks = ranks;
        ExecuteGroup(call);
      },
      [&](const std::vector<const RankIo*>& ranks) {
        call.ranks = ranks;
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
