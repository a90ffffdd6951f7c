// TIDE-AG as an XLA FFI custom call: P shards in, P full parameters out, one call per group.
//   AllGatherImpl -> AllGatherHandler (XLA:CPU) -> target "tide_all_gather"
//                 -> AllGatherCudaHandler (CUDA)  -> target "tide_all_gather" on platform CUDA
//   AllGatherVirtual -> AllGatherVirtual[Cuda]Handler -> "tide_all_gather_virtual" (all N ranks'
//                    shards stacked [N, R_p, ...] on one device; results [N, D_p, ...])
//   Python face: tide_xla/all_gather.py (AllGatherPrimitive, name "tide_all_gather") and
//   tide_xla/virtual.py (virtual_all_gather).
#include "tide_ffi.h"

#ifdef TIDE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tide::xla_ffi {

namespace {

// Operand p is rank r's shard (R_p, trailing...) in the shard dtype; result p is the unsharded
// parameter (D_p, trailing...) in the AG dtype. Rows of the last ranks beyond D_p are FSDP2's
// dim-0 padding: they travel in the shard and are not landed.
// lead > 0: the virtual cluster's stacked buffers, [lead = N, ...] (io gets rank 0's addresses).
GroupSignature all_gather_signature(const ffi::RemainingArgs& shards,
                                    const ffi::RemainingRets& params, const GroupAttrs& a,
                                    RankIo& io, int lead = 0) {
  const size_t P = a.dims0.size();
  TIDE_PLAN_CHECK(shards.size() == P && params.size() == P, "tide_all_gather: ", shards.size(),
                  " operands and ", params.size(), " results for a group of ", P,
                  " parameters (dims0); one operand and one result per parameter");
  GroupSignature sig;
  for (size_t p = 0; p < P; ++p) {
    auto in = shards.get<ffi::AnyBuffer>(p);
    auto out = params.get<ffi::AnyBuffer>(p);
    TIDE_CHECK(in.has_value() && out.has_value(), "parameter ", p, ": not a buffer");
    const int64_t D = a.dims0[p];
    const std::string who = TIDE_STR_CAT("parameter ", p);
    const auto din = rank_dims(in->dimensions(), lead, (who + " shard").c_str());
    const auto dout = rank_dims((*out)->dimensions(), lead, (who + " result").c_str());
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
    const auto din = rank_dims(shards.get<ffi::AnyBuffer>(p)->dimensions(), lead, "shard");
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

// All N ranks on this device (a virtual cluster): stream == nullptr runs the CPU executor.
ffi::Error AllGatherVirtual(void* stream, int32_t device_ordinal, ffi::RemainingArgs shards,
                            ffi::RemainingRets params, ffi::Span<const int64_t> dims0,
                            int64_t nodes, int64_t gpus_per_node, int64_t mode,
                            int64_t timeout_ms) {
  TIDE_FFI_BOUNDARY("tide_all_gather_virtual", {
    const GroupAttrs attrs{dims0, {}, nodes, gpus_per_node, mode, 0, timeout_ms};
    const int N = group_topology(attrs).world();
    RankIo all;
    const GroupSignature sig = all_gather_signature(shards, params, attrs, all, N);
    const GroupLayout lay = build_layout(sig, group_topology(attrs));
    std::vector<int64_t> in_bytes, out_bytes;
    for (const ParamLayout& pl : lay.params) {
      in_bytes.push_back(pl.e * dtype_size(sig.shard_dtype));
      out_bytes.push_back(pl.D * pl.K * dtype_size(sig.ag_dtype));
    }
    CallSpec spec;
    spec.op = Collective::kAllGather;
    spec.cuda = stream != nullptr;
#ifdef TIDE_WITH_CUDA
    if (spec.cuda) {
      all.device = device_ordinal;
      all.stream = stream;
    }
#endif
    std::vector<RankIo> ios = stacked_ranks(all, N, in_bytes, out_bytes, 0);
    run_virtual_call(spec, device_ordinal, attrs, sig, ios);
    return ffi::Error::Success();
  })
}

ffi::Error AllGatherVirtualCpu(int32_t device_ordinal, ffi::RemainingArgs shards,
                               ffi::RemainingRets params, ffi::Span<const int64_t> dims0,
                               int64_t nodes, int64_t gpus_per_node, int64_t mode,
                               int64_t timeout_ms) {
  return AllGatherVirtual(nullptr, device_ordinal, shards, params, dims0, nodes, gpus_per_node,
                          mode, timeout_ms);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherVirtualHandler, AllGatherVirtualCpu,
                              BindVirtualCall(ffi::Ffi::Bind()));

#ifdef TIDE_WITH_CUDA
ffi::Error AllGatherCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::RunId run_id,
                             WhereBuffer where, ffi::RemainingArgs shards,
                             ffi::RemainingRets params, ffi::Span<const int64_t> dims0,
                             ffi::Span<const int64_t> device_table, int64_t nodes,
                             int64_t gpus_per_node, int64_t mode, int64_t op_id,
                             int64_t timeout_ms) {
  TIDE_FFI_BOUNDARY("tide_all_gather[CUDA]", {
    // `where` lives in device memory here: reading it would synchronise, so the mesh-mismatch
    // check by axis index is CPU only (the device table still maps ordinals to ranks).
    (void)where;
    const GroupAttrs attrs{dims0, device_table, nodes, gpus_per_node, mode, op_id, timeout_ms};
    RankIo io;
    const GroupSignature sig = all_gather_signature(shards, params, attrs, io);
    io.device = device_ordinal;
    io.stream = stream;
    CallSpec spec;
    spec.op = Collective::kAllGather;
    spec.cuda = true;
    run_group_call(spec, device_ordinal, run_id.run_id, attrs, sig, io);
    return ffi::Error::Success();
  })
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherCudaHandler, AllGatherCudaImpl,
    BindGroupCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));  // XLA's stream

ffi::Error AllGatherVirtualCuda(cudaStream_t stream, int32_t device_ordinal,
                                ffi::RemainingArgs shards, ffi::RemainingRets params,
                                ffi::Span<const int64_t> dims0, int64_t nodes,
                                int64_t gpus_per_node, int64_t mode, int64_t timeout_ms) {
  return AllGatherVirtual(stream, device_ordinal, shards, params, dims0, nodes, gpus_per_node,
                          mode, timeout_ms);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherVirtualCudaHandler, AllGatherVirtualCuda,
    BindVirtualCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
#endif

}  // namespace tide::xla_ffi
