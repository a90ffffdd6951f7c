// TIDE-RS as an XLA FFI custom call: P bf16 gradients in, the group's packed fp32 shard out
// (E = sum_p R_p K_p elements, parameter p at its prefix offset o32_p), one call per group. The
// packed shard is TIDE-RS's own output buffer, so the result is written in place.
//   ReduceScatterImpl -> ReduceScatterHandler (XLA:CPU) -> target "tide_reduce_scatter"
//                     -> ReduceScatterCudaHandler (CUDA) -> same target on platform CUDA
//   ReduceScatterVirtual -> ReduceScatterVirtual[Cuda]Handler -> "tide_reduce_scatter_virtual"
//                        (all N ranks' gradients stacked [N, D_p, ...] on one device; [N, E] out)
//   Python face: tide_xla/reduce_scatter.py (ReduceScatterPrimitive, "tide_reduce_scatter") and
//   tide_xla/virtual.py (virtual_reduce_scatter).
//
// With accumulate=1 the call takes one more operand, a packed fp32 shard the result adds to
// (out = acc + scale * sum). Python aliases it to the result (input_output_aliases), so with a
// donated accumulator the fp32 gradient is accumulated in place.
#include <algorithm>

#include "tide_ffi.h"

#ifdef TIDE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tide::xla_ffi {

namespace {

GroupSignature reduce_scatter_signature(const ffi::RemainingArgs& args,
                                        const ffi::RemainingRets& rets, const GroupAttrs& a,
                                        bool accumulate, RankIo& io, int lead = 0) {
  const size_t P = a.dims0.size();
  TIDE_PLAN_CHECK(rets.size() == 1 && args.size() == P + (accumulate ? 1 : 0),
                  "tide_reduce_scatter: ", args.size(), " operands and ", rets.size(),
                  " results for a group of ", P, " parameters with accumulate=", accumulate,
                  " (expected ", P + (accumulate ? 1 : 0), " operands and 1 packed result)");
  GroupSignature sig;  // TIDE-RS reads gradients and writes fp32: no AG cast stage
  for (size_t p = 0; p < P; ++p) {
    auto grad = args.get<ffi::AnyBuffer>(p);
    TIDE_CHECK(grad.has_value(), "parameter ", p, ": not a buffer");
    const int64_t D = a.dims0[p];
    const std::string who = TIDE_STR_CAT("parameter ", p);
    const auto dg = rank_dims(grad->dimensions(), lead, (who + " gradient").c_str());
    TIDE_PLAN_CHECK(dg.size() >= 1 && dg[0] == D, who, ": gradient ", dims_str(dg),
                    " must have D_p = ", D, " rows (dims0)");
    ParamSpec spec;
    spec.name = who;
    spec.shape.assign(dg.begin(), dg.end());
    const DType grad_t = to_tide_dtype(grad->element_type(), "gradient dtype");
    if (p == 0) sig.grad_dtype = sig.ag_dtype = sig.shard_dtype = grad_t;
    TIDE_PLAN_CHECK(grad_t == sig.grad_dtype, who, ": gradient dtype ", dtype_name(grad_t),
                    " differs from parameter 0's ", dtype_name(sig.grad_dtype));
    sig.params.push_back(std::move(spec));
    io.in.push_back(grad->untyped_data());
  }
  // E = sum_p R_p K_p: the packed per-rank fp32 output, parameter p at o32_p (plan layout).
  const int64_t E = build_layout(sig, group_topology(a)).E;
  auto out = rets.get<ffi::AnyBuffer>(0);
  TIDE_CHECK(out.has_value(), "result: not a buffer");
  const size_t lead_n = lead > 0 ? static_cast<size_t>(lead) : 1;  // stacked: N x E
  TIDE_PLAN_CHECK((*out)->element_type() == ffi::DataType::F32 &&
                      (*out)->element_count() == lead_n * static_cast<size_t>(E),
                  "result: TIDE-RS writes ", lead_n,
                  " packed float32 shard(s) of E = sum_p R_p K_p = ", E,
                  " elements, the result is ", dims_str((*out)->dimensions()), " of dtype code ",
                  static_cast<int>((*out)->element_type()));
  io.out.push_back((*out)->untyped_data());
  if (accumulate) {
    auto acc = args.get<ffi::AnyBuffer>(P);
    TIDE_CHECK(acc.has_value(), "accumulator: not a buffer");
    TIDE_PLAN_CHECK(acc->element_type() == ffi::DataType::F32 &&
                        acc->element_count() == lead_n * static_cast<size_t>(E),
                    "accumulator: must be the packed float32 shard of ", E, " elements, got ",
                    dims_str(acc->dimensions()));
    io.acc.push_back(acc->untyped_data());
  }
  return sig;
}

}  // namespace

ffi::Error ReduceScatterImpl(int32_t device_ordinal, ffi::RunId run_id,
                             WhereBuffer where, ffi::RemainingArgs args,
                             ffi::RemainingRets rets, ffi::Span<const int64_t> dims0,
                             ffi::Span<const int64_t> device_table, int64_t nodes,
                             int64_t gpus_per_node, int64_t mode, int64_t op_id,
                             int64_t timeout_ms, float scale, int64_t accumulate) {
  TIDE_FFI_BOUNDARY("tide_reduce_scatter", {
    GroupAttrs attrs{dims0, device_table, nodes, gpus_per_node, mode, op_id, timeout_ms};
    TIDE_PLAN_CHECK(where.element_count() == 2, "where: expected (axis index, group index)");
    attrs.where = where.typed_data();  // host memory on XLA:CPU
    RankIo io;
    const GroupSignature sig = reduce_scatter_signature(args, rets, attrs, accumulate != 0, io);
    CallSpec spec;
    spec.op = Collective::kReduceScatter;
    spec.scale = scale;
    spec.accumulate = accumulate != 0;
    run_group_call(spec, device_ordinal, run_id.run_id, attrs, sig, io);
    return ffi::Error::Success();
  })
}

// Operands: P gradients (D_p, ...) [+ the packed fp32 accumulator]; result: packed fp32 (E,).
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceScatterHandler, ReduceScatterImpl,
                              BindGroupCall(ffi::Ffi::Bind())
                                  .Attr<float>("scale")           // alpha on the reduced sum
                                  .Attr<int64_t>("accumulate"));  // 1: out = acc + alpha*sum

// All N ranks on this device (a virtual cluster): stream == nullptr runs the CPU executor.
ffi::Error ReduceScatterVirtual(void* stream, int32_t device_ordinal, ffi::RemainingArgs args,
                                ffi::RemainingRets rets, ffi::Span<const int64_t> dims0,
                                int64_t nodes, int64_t gpus_per_node, int64_t mode,
                                int64_t timeout_ms, float scale, int64_t accumulate) {
  TIDE_FFI_BOUNDARY("tide_reduce_scatter_virtual", {
    const GroupAttrs attrs{dims0, {}, nodes, gpus_per_node, mode, 0, timeout_ms};
    const int N = group_topology(attrs).world();
    RankIo all;
    const GroupSignature sig =
        reduce_scatter_signature(args, rets, attrs, accumulate != 0, all, N);
    const GroupLayout lay = build_layout(sig, group_topology(attrs));
    std::vector<int64_t> in_bytes;
    for (const ParamLayout& pl : lay.params)
      in_bytes.push_back(pl.D * pl.K * dtype_size(sig.grad_dtype));
    CallSpec spec;
    spec.op = Collective::kReduceScatter;
    spec.scale = scale;
    spec.accumulate = accumulate != 0;
    spec.cuda = stream != nullptr;
    std::vector<RankIo> ios = stacked_ranks(all, N, in_bytes, {lay.S_fp32}, lay.S_fp32);
#ifdef TIDE_WITH_CUDA
    if (spec.cuda) {
      for (RankIo& io : ios) {
        io.device = device_ordinal;
        io.stream = stream;
        copy_accumulator_async(io, lay.S_fp32);
      }
    }
#endif
    run_virtual_call(spec, device_ordinal, attrs, sig, ios);
    return ffi::Error::Success();
  })
}

ffi::Error ReduceScatterVirtualCpu(int32_t device_ordinal, ffi::RemainingArgs args,
                                   ffi::RemainingRets rets, ffi::Span<const int64_t> dims0,
                                   int64_t nodes, int64_t gpus_per_node, int64_t mode,
                                   int64_t timeout_ms, float scale, int64_t accumulate) {
  return ReduceScatterVirtual(nullptr, device_ordinal, args, rets, dims0, nodes, gpus_per_node,
                              mode, timeout_ms, scale, accumulate);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceScatterVirtualHandler, ReduceScatterVirtualCpu,
                              BindVirtualCall(ffi::Ffi::Bind())
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("accumulate"));

#ifdef TIDE_WITH_CUDA
ffi::Error ReduceScatterCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::RunId run_id,
                                 WhereBuffer where, ffi::RemainingArgs args,
                                 ffi::RemainingRets rets, ffi::Span<const int64_t> dims0,
                                 ffi::Span<const int64_t> device_table, int64_t nodes,
                                 int64_t gpus_per_node, int64_t mode, int64_t op_id,
                                 int64_t timeout_ms, float scale, int64_t accumulate) {
  TIDE_FFI_BOUNDARY("tide_reduce_scatter[CUDA]", {
    (void)where;  // device memory on CUDA (see AllGatherCudaImpl)
    const GroupAttrs attrs{dims0, device_table, nodes, gpus_per_node, mode, op_id, timeout_ms};
    RankIo io;
    const GroupSignature sig = reduce_scatter_signature(args, rets, attrs, accumulate != 0, io);
    io.device = device_ordinal;
    io.stream = stream;
    copy_accumulator_async(io, build_layout(sig, group_topology(attrs)).S_fp32);
    CallSpec spec;
    spec.op = Collective::kReduceScatter;
    spec.scale = scale;
    spec.accumulate = accumulate != 0;
    spec.cuda = true;
    run_group_call(spec, device_ordinal, run_id.run_id, attrs, sig, io);
    return ffi::Error::Success();
  })
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ReduceScatterCudaHandler, ReduceScatterCudaImpl,
    BindGroupCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())  // XLA's stream
        .Attr<float>("scale")                                                  // alpha
        .Attr<int64_t>("accumulate"));                                         // out += ...

ffi::Error ReduceScatterVirtualCuda(cudaStream_t stream, int32_t device_ordinal,
                                    ffi::RemainingArgs args, ffi::RemainingRets rets,
                                    ffi::Span<const int64_t> dims0, int64_t nodes,
                                    int64_t gpus_per_node, int64_t mode, int64_t timeout_ms,
                                    float scale, int64_t accumulate) {
  return ReduceScatterVirtual(stream, device_ordinal, args, rets, dims0, nodes, gpus_per_node,
                              mode, timeout_ms, scale, accumulate);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ReduceScatterVirtualCudaHandler, ReduceScatterVirtualCuda,
    BindVirtualCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
        .Attr<float>("scale")
        .Attr<int64_t>("accumulate"));
#endif

}  // namespace tide::xla_ffi
