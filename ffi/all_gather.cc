// TIDE-AG as an XLA FFI custom call: P shards in, P full parameters out, one call per group.
//   AllGatherImpl -> AllGatherHandler (XLA:CPU) -> target "tide_all_gather"
//                 -> AllGatherCudaHandler (CUDA)  -> target "tide_all_gather" on platform CUDA
//   Python face: tide_xla/all_gather.py (AllGatherPrimitive, name "tide_all_gather").
#include "tide_ffi.h"

#ifdef TIDE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tide::xla_ffi {

namespace {

// Operand p is rank r's shard (R_p, trailing...) in the shard dtype; result p is the unsharded
// parameter (D_p, trailing...) in the AG dtype. Rows of the last ranks beyond D_p are FSDP2's
// dim-0 padding: they travel in the shard and are not landed.
GroupSignature all_gather_signature(const ffi::RemainingArgs& shards,
                                    const ffi::RemainingRets& params, const GroupAttrs& a,
                                    RankIo& io) {
  const size_t P = a.dims0.size();
  TIDE_PLAN_CHECK(shards.size() == P && params.size() == P, "tide_all_gather: ", shards.size(),
                  " operands and ", params.size(), " results for a group of ", P,
                  " parameters (dims0); one operand and one result per parameter");
  GroupSignature sig;
  for (size_t p = 0; p < P; ++p) {
    auto in = shards.get<ffi::AnyBuffer>(p);
    auto out = params.get<ffi::AnyBuffer>(p);
    TIDE_CHECK(in.has_value() && out.has_value(), "parameter ", p, ": not a buffer");
    const auto din = in->dimensions();
    const auto dout = (*out)->dimensions();
    const int64_t D = a.dims0[p];
    const std::string who = TIDE_STR_CAT("parameter ", p);
    TIDE_PLAN_CHECK(din.size() >= 1 && din.size() == dout.size(), who, ": shard ",
                    dims_str(din), " and parameter ", dims_str(dout),
                    " must have the same rank >= 1 (TIDE shards dim 0)");
    TIDE_PLAN_CHECK(dout[0] == D, who, ": result has ", dout[0], " rows but dims0 says ", D);
    ParamSpec spec;
    spec.name = who;
    spec.shape.push_back(D);
    for (size_t i = 1; i < din.size(); ++i) {
      TIDE_PLAN_CHECK(din[i] == dout[i], who, ": shard ", dims_str(din), " and parameter ",
                      dims_str(dout), " differ beyond dim 0 (only dim-0 sharding is supported)");
      spec.shape.push_back(din[i]);
    }
    const DType shard_t = to_tide_dtype(in->element_type(), "shard dtype");
    const DType ag_t = to_tide_dtype((*out)->element_type(), "parameter dtype");
    if (p == 0) {
      sig.shard_dtype = shard_t;
      sig.ag_dtype = ag_t;
      sig.grad_dtype = ag_t;
    }
    TIDE_PLAN_CHECK(shard_t == sig.shard_dtype && ag_t == sig.ag_dtype, who, ": dtypes (",
                    dtype_name(shard_t), " -> ", dtype_name(ag_t), ") differ from parameter 0 (",
                    dtype_name(sig.shard_dtype), " -> ", dtype_name(sig.ag_dtype),
                    "); one group has one shard dtype and one AG dtype");
    sig.params.push_back(std::move(spec));
    io.in.push_back(in->untyped_data());
    io.out.push_back((*out)->untyped_data());
  }
  TIDE_PLAN_CHECK(!sig.needs_cast() || (sig.shard_dtype == DType::kFP32 &&
                                         sig.ag_dtype == DType::kBF16),
                  "tide_all_gather: a ", dtype_name(sig.shard_dtype),
                  " shard cannot be gathered as ", dtype_name(sig.ag_dtype),
                  " (TIDE-AG casts float32 shards to bfloat16 only)");
  const GroupLayout lay = build_layout(sig, group_topology(a));  // R_p as the plan computes it
  for (size_t p = 0; p < P; ++p) {
    const auto din = shards.get<ffi::AnyBuffer>(p)->dimensions();
    TIDE_PLAN_CHECK(din[0] == lay.params[p].R, "parameter ", p, ": shard ", dims_str(din),
                    " must have R_p = ceil(D_p/N) = ceil(", lay.params[p].D, "/", lay.N, ") = ",
                    lay.params[p].R, " rows (dim-0 sharding padded as FSDP2 pads)");
  }
  return sig;
}

}  // namespace

ffi::Error AllGatherImpl(int32_t device_ordinal, ffi::RunId run_id,
                         WhereBuffer where, ffi::RemainingArgs shards,
                         ffi::RemainingRets params, ffi::Span<const int64_t> dims0,
                         ffi::Span<const int64_t> device_table, int64_t nodes,
                         int64_t gpus_per_node, int64_t mode, int64_t op_id, int64_t timeout_ms) {
  TIDE_FFI_BOUNDARY("tide_all_gather", {
    GroupAttrs attrs{dims0, device_table, nodes, gpus_per_node, mode, op_id, timeout_ms};
    TIDE_PLAN_CHECK(where.element_count() == 2, "where: expected (axis index, group index)");
    attrs.where = where.typed_data();  // host memory on XLA:CPU
    RankIo io;
    const GroupSignature sig = all_gather_signature(shards, params, attrs, io);
    CallSpec spec;
    spec.op = Collective::kAllGather;
    run_group_call(spec, device_ordinal, run_id.run_id, attrs, sig, io);
    return ffi::Error::Success();
  })
}

// Operands: P shards (R_p, ...) in the shard dtype; results: P parameters (D_p, ...), AG dtype.
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherHandler, AllGatherImpl,
                              BindGroupCall(ffi::Ffi::Bind()));

#ifdef TIDE_WITH_CUDA
ffi::Error AllGatherCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::RunId run_id,
                             WhereBuffer where, ffi::RemainingArgs shards,
                             ffi::RemainingRets params, ffi::Span<const int64_t> dims0,
                             ffi::Span<const int64_t> device_table, int64_t nodes,
                             int64_t gpus_per_node, int64_t mode, int64_t op_id,
                             int64_t timeout_ms) {
  TIDE_FFI_BOUNDARY("tide_all_gather[CUDA]", {
    const GroupAttrs attrs{dims0, device_table, nodes, gpus_per_node, mode, op_id, timeout_ms};
    RankIo io;
    all_gather_signature(shards, params, attrs, io);  // validates the call like the CPU path
    throw Unimplemented(
        "the CUDA executor is not part of this build yet; TIDE-AG on CUDA runs once "
        "csrc/exec/cuda lands (the CPU handler is complete)");
  })
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherCudaHandler, AllGatherCudaImpl,
    BindGroupCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));  // XLA's stream
#endif

}  // namespace tide::xla_ffi
