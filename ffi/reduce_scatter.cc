// TIDE-RS as an XLA FFI custom call: P bf16 gradients in, P fp32 shards out, one call per group.
//   ReduceScatterImpl -> ReduceScatterHandler (XLA:CPU) -> target "tide_reduce_scatter"
//                     -> ReduceScatterCudaHandler (CUDA) -> same target on platform CUDA
//   Python face: tide_xla/reduce_scatter.py (ReduceScatterPrimitive, "tide_reduce_scatter").
//
// With accumulate=1 the call takes P more operands, fp32 shards that the result adds to
// (out = acc + scale * sum). Python aliases them to the results (input_output_aliases), so with a
// donated accumulator the fp32 gradient is accumulated in place.
#include <algorithm>

#include "tide_ffi.h"

#ifdef TIDE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tide::xla_ffi {

namespace {

GroupSignature reduce_scatter_signature(const ffi::RemainingArgs& args,
                                        const ffi::RemainingRets& shards, const GroupAttrs& a,
                                        bool accumulate, RankIo& io) {
  const size_t P = a.dims0.size();
  TIDE_PLAN_CHECK(shards.size() == P && args.size() == (accumulate ? 2 : 1) * P,
                  "tide_reduce_scatter: ", args.size(), " operands and ", shards.size(),
                  " results for a group of ", P, " parameters with accumulate=", accumulate,
                  " (expected ", (accumulate ? 2 : 1) * P, " operands and ", P, " results)");
  const int64_t N = a.nodes * a.gpus_per_node;
  GroupSignature sig;
  sig.shard_dtype = DType::kFP32;
  for (size_t p = 0; p < P; ++p) {
    auto grad = args.get<ffi::AnyBuffer>(p);
    auto out = shards.get<ffi::AnyBuffer>(p);
    TIDE_CHECK(grad.has_value() && out.has_value(), "parameter ", p, ": not a buffer");
    const auto dg = grad->dimensions();
    const auto dout = (*out)->dimensions();
    const int64_t D = a.dims0[p];
    const int64_t R = (D + N - 1) / N;
    const std::string who = TIDE_STR_CAT("parameter ", p);
    TIDE_PLAN_CHECK(dg.size() >= 1 && dg.size() == dout.size(), who, ": gradient ",
                    dims_str(dg), " and shard ", dims_str(dout), " must have the same rank >= 1");
    TIDE_PLAN_CHECK(dg[0] == D, who, ": gradient has ", dg[0], " rows but dims0 says ", D);
    TIDE_PLAN_CHECK(dout[0] == R, who, ": result ", dims_str(dout), " must have R_p = ceil(",
                    D, "/", N, ") = ", R, " rows");
    ParamSpec spec;
    spec.name = who;
    spec.shape.push_back(D);
    for (size_t i = 1; i < dg.size(); ++i) {
      TIDE_PLAN_CHECK(dg[i] == dout[i], who, ": gradient ", dims_str(dg), " and shard ",
                      dims_str(dout), " differ beyond dim 0 (only dim-0 sharding is supported)");
      spec.shape.push_back(dg[i]);
    }
    const DType grad_t = to_tide_dtype(grad->element_type(), "gradient dtype");
    TIDE_PLAN_CHECK((*out)->element_type() == ffi::DataType::F32, who,
                    ": TIDE-RS writes float32 shards, the result has dtype code ",
                    static_cast<int>((*out)->element_type()));
    if (p == 0) sig.grad_dtype = sig.ag_dtype = grad_t;
    TIDE_PLAN_CHECK(grad_t == sig.grad_dtype, who, ": gradient dtype ", dtype_name(grad_t),
                    " differs from parameter 0's ", dtype_name(sig.grad_dtype));
    if (accumulate) {
      auto acc = args.get<ffi::AnyBuffer>(P + p);
      TIDE_CHECK(acc.has_value(), who, ": accumulator is not a buffer");
      const auto da = acc->dimensions();
      TIDE_PLAN_CHECK(acc->element_type() == ffi::DataType::F32 && da.size() == dout.size() &&
                          std::equal(da.begin(), da.end(), dout.begin()),
                      who, ": the accumulator must be a float32 ", dims_str(dout), " shard, got ",
                      dims_str(da));
      io.acc.push_back(acc->untyped_data());
    }
    sig.params.push_back(std::move(spec));
    io.in.push_back(grad->untyped_data());
    io.out.push_back((*out)->untyped_data());
  }
  return sig;
}

}  // namespace

ffi::Error ReduceScatterImpl(int32_t device_ordinal, ffi::RunId run_id, ffi::RemainingArgs args,
                             ffi::RemainingRets shards, ffi::Span<const int64_t> dims0,
                             ffi::Span<const int64_t> device_table, int64_t nodes,
                             int64_t gpus_per_node, int64_t mode, int64_t op_id,
                             int64_t timeout_ms, float scale, int64_t accumulate) {
  TIDE_FFI_BOUNDARY("tide_reduce_scatter", {
    const GroupAttrs attrs{dims0, device_table, nodes, gpus_per_node, mode, op_id, timeout_ms};
    RankIo io;
    const GroupSignature sig = reduce_scatter_signature(args, shards, attrs, accumulate != 0, io);
    CallSpec spec;
    spec.op = Collective::kReduceScatter;
    spec.scale = scale;
    spec.accumulate = accumulate != 0;
    run_group_call(spec, device_ordinal, run_id.run_id, attrs, sig, io);
    return ffi::Error::Success();
  })
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ReduceScatterHandler, ReduceScatterImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::DeviceOrdinal>()                        // device_ordinal: key into device_table
        .Ctx<ffi::RunId>()                                // run_id: one launch of the executable
        .RemainingArgs()                                  // grads: P x (D_p, ...) [+ P acc fp32]
        .RemainingRets()                                  // shards: P x (R_p, ...) float32
        .Attr<ffi::Span<const int64_t>>("dims0")          // D_p per parameter
        .Attr<ffi::Span<const int64_t>>("device_table")   // (device_id, group, rank) triples
        .Attr<int64_t>("nodes")                           // M
        .Attr<int64_t>("gpus_per_node")                   // L
        .Attr<int64_t>("mode")                            // 0 in_place, 1 slot_reuse
        .Attr<int64_t>("op_id")                           // call site (trace time)
        .Attr<int64_t>("timeout_ms")                      // rendezvous/executor wait budget
        .Attr<float>("scale")                             // alpha on the reduced sum
        .Attr<int64_t>("accumulate"));                    // 1: out = acc + alpha * sum

#ifdef TIDE_WITH_CUDA
ffi::Error ReduceScatterCudaImpl(cudaStream_t stream, int32_t device_ordinal, ffi::RunId run_id,
                                 ffi::RemainingArgs args, ffi::RemainingRets shards,
                                 ffi::Span<const int64_t> dims0,
                                 ffi::Span<const int64_t> device_table, int64_t nodes,
                                 int64_t gpus_per_node, int64_t mode, int64_t op_id,
                                 int64_t timeout_ms, float scale, int64_t accumulate) {
  TIDE_FFI_BOUNDARY("tide_reduce_scatter[CUDA]", {
    const GroupAttrs attrs{dims0, device_table, nodes, gpus_per_node, mode, op_id, timeout_ms};
    RankIo io;
    reduce_scatter_signature(args, shards, attrs, accumulate != 0, io);
    throw Unimplemented(
        "the CUDA executor is not part of this build yet; TIDE-RS on CUDA runs once "
        "csrc/exec/cuda lands (the CPU handler is complete)");
  })
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ReduceScatterCudaHandler, ReduceScatterCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()         // stream: XLA's compute stream
        .Ctx<ffi::DeviceOrdinal>()                        // device_ordinal: key into device_table
        .Ctx<ffi::RunId>()                                // run_id: one launch of the executable
        .RemainingArgs()                                  // grads: P x (D_p, ...) [+ P acc fp32]
        .RemainingRets()                                  // shards: P x (R_p, ...) float32
        .Attr<ffi::Span<const int64_t>>("dims0")          // D_p per parameter
        .Attr<ffi::Span<const int64_t>>("device_table")   // (device_id, group, rank) triples
        .Attr<int64_t>("nodes")                           // M
        .Attr<int64_t>("gpus_per_node")                   // L
        .Attr<int64_t>("mode")                            // 0 in_place, 1 slot_reuse
        .Attr<int64_t>("op_id")                           // call site (trace time)
        .Attr<int64_t>("timeout_ms")                      // rendezvous/executor wait budget
        .Attr<float>("scale")                             // alpha on the reduced sum
        .Attr<int64_t>("accumulate"));                    // 1: out = acc + alpha * sum
#endif

}  // namespace tide::xla_ffi
