// The CUDA executors as CallExecutors (contract in call_executors.h and tide/cuda.h).
#include "exec/cuda/call_executors.h"

#include "exec/cuda/runtime.h"
#include "fabric/inprocess.h"
#include "tide/cuda.h"
#include "tide/errors.h"

namespace tide::cuda {

namespace {

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace

RankBuffers to_rank_buffers(const RankBindingList& l) {
  RankBuffers b;
  auto put = [](std::vector<void*>& v, int i, void* p) {
    TIDE_PLAN_CHECK(i >= 0, "buffer index ", i);
    if (v.size() <= static_cast<size_t>(i)) v.resize(static_cast<size_t>(i) + 1, nullptr);
    v[static_cast<size_t>(i)] = p;
  };
  for (const Binding& x : l) {
    TIDE_PLAN_CHECK(x.bytes >= 0, "bindings: ", buf_kind_name(x.kind), "[", x.index, "] has negative size ", x.bytes);
    switch (x.kind) {
      case BufKind::kShard: put(b.shard, x.index, x.data); break;
      case BufKind::kLanding:
        if (x.index < 0) b.landing = x.data;
        else put(b.landing_p, x.index, x.data);
        break;
      case BufKind::kGrad: put(b.grad, x.index, x.data); break;
      case BufKind::kOut: b.out = x.data; break;
      default: throw PlanError(TIDE_STR_CAT("bindings: ", buf_kind_name(x.kind), " is not a user buffer"));
    }
    b.bytes[{static_cast<int>(x.kind), x.kind == BufKind::kOut ? -1 : x.index}] = x.bytes;
  }
  return b;
}

namespace {
const ExecutorOptions& one_sided(const ExecutorOptions& opt) {
  TIDE_PLAN_CHECK(opt.rails == Rails::kOneSided, "ExecutorOptions.rails: the CUDA cluster executor reaches every "
                  "rank of its in-process fabric by pointer (one-sided); two-sided rails run on the CPU virtual "
                  "cluster or the CUDA rank executor (an NcclRail)");
  return opt;
}
}  // namespace

CudaClusterExecutor::CudaClusterExecutor(std::shared_ptr<fabric::Fabric> fabric, const ExecutorOptions& opt)
    : fabric_(std::move(fabric)), ex_(fabric_, one_sided(opt)) {}

void CudaClusterExecutor::run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
                              const std::vector<RankBindingList>& buffers, const std::vector<uintptr_t>& streams) {
  const int n = fabric_->world();
  TIDE_PLAN_CHECK(members.empty(), "CudaClusterExecutor.run: an in-process executor runs "
                  "every rank's program (no sub-groups)");
  TIDE_PLAN_CHECK(static_cast<int>(buffers.size()) == n, "CudaClusterExecutor.run: ", buffers.size(),
                  " buffer lists for ", n, " ranks");
  std::vector<RankBuffers> b;
  b.reserve(buffers.size());
  for (const auto& l : buffers) b.push_back(to_rank_buffers(l));
  std::vector<cudaStream_t> s;
  for (uintptr_t x : streams) s.push_back(as_stream(x));
  ex_.run(set, seq, b, s);
}

CudaRankCallExecutor::CudaRankCallExecutor(std::shared_ptr<fabric::Fabric> fabric, int rank, const Topology& topo,
                                           RegionTable regions, const ExecutorOptions& opt, bool fence)
    : regions_(std::move(regions)), ex_(std::move(fabric), rank, topo, regions_, opt, fence) {}

void CudaRankCallExecutor::run(const std::shared_ptr<const ProgramSet>& set, int64_t seq,
                               const std::vector<int>& members, const std::vector<RankBindingList>& buffers,
                               const std::vector<uintptr_t>& streams) {
  TIDE_PLAN_CHECK(buffers.size() == 1, "CudaRankExecutor.run: one buffer list (this rank's), got ", buffers.size());
  TIDE_PLAN_CHECK(streams.size() <= 1, "CudaRankExecutor.run: one caller stream, got ", streams.size());
  ex_.run(set, seq, to_rank_buffers(buffers[0]), streams.empty() ? nullptr : as_stream(streams[0]),
          members.empty() ? nullptr : &members);
}

}  // namespace tide::cuda

namespace tide {

std::shared_ptr<CallExecutor> make_cuda_cluster_executor(const std::vector<int>& rank_devices, int64_t arena_bytes,
                                                         const ExecutorOptions& opt) {
  auto fabric = std::make_shared<fabric::InProcessFabric>(rank_devices, arena_bytes);
  return std::make_shared<cuda::CudaClusterExecutor>(std::move(fabric), opt);
}

char* cuda_cluster_arena(const CallExecutor& ex, int rank) {
  const auto* c = dynamic_cast<const cuda::CudaClusterExecutor*>(&ex);
  TIDE_CHECK(c != nullptr, "cuda_cluster_arena: not an in-process CUDA executor (", ex.name(), ")");
  return const_cast<cuda::CudaClusterExecutor*>(c)->fabric().arena(rank);
}

void copy_async(const std::vector<DeviceCopy>& copies, uintptr_t stream) {
  std::vector<cuda::CopyDesc> d;
  d.reserve(copies.size());
  for (const DeviceCopy& c : copies)
    if (c.bytes > 0) d.push_back({c.dst, c.src, c.bytes, 1, c.bytes, c.bytes});
  if (!d.empty()) cuda::submit_copies(reinterpret_cast<cudaStream_t>(stream), d.data(), d.size());
}

}  // namespace tide
