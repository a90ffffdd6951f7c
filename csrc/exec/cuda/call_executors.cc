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

namespace {
const ExecutorOptions& one_sided(const ExecutorOptions& opt) {
  TIDE_PLAN_CHECK(opt.rails == Rails::kOneSided, "ExecutorOptions.rails: the CUDA cluster executor reaches every "
                  "rank of its in-process fabric by pointer (one-sided); two-sided rails run on the CPU virtual "
                  "cluster or the CUDA rank executor (an NcclRail)");
  return opt;
}
}  // namespace

CudaClusterCallExecutor::CudaClusterCallExecutor(std::shared_ptr<fabric::Fabric> fabric, const ExecutorOptions& opt)
    : fabric_(std::move(fabric)), ex_(fabric_, one_sided(opt)) {}

void CudaClusterCallExecutor::run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
                              const std::vector<RankBindings>& buffers, const std::vector<uintptr_t>& streams) {
  const int n = fabric_->world();
  TIDE_PLAN_CHECK(members.empty(), "CudaClusterExecutor.run: an in-process executor runs "
                  "every rank's program (no sub-groups)");
  TIDE_PLAN_CHECK(static_cast<int>(buffers.size()) == n, "CudaClusterExecutor.run: ", buffers.size(),
                  " buffer lists for ", n, " ranks");
  std::vector<cudaStream_t> s;
  for (uintptr_t x : streams) s.push_back(as_stream(x));
  ex_.run(set, seq, buffers, s);
}

CudaRankCallExecutor::CudaRankCallExecutor(std::shared_ptr<fabric::Fabric> fabric, int rank, const Topology& topo,
                                           RegionTable regions, const ExecutorOptions& opt, bool fence)
    : regions_(std::move(regions)), ex_(std::move(fabric), rank, topo, regions_, opt, fence) {}

void CudaRankCallExecutor::run(const std::shared_ptr<const ProgramSet>& set, int64_t seq,
                               const std::vector<int>& members, const std::vector<RankBindings>& buffers,
                               const std::vector<uintptr_t>& streams) {
  TIDE_PLAN_CHECK(buffers.size() == 1, "CudaRankExecutor.run: one buffer list (this rank's), got ", buffers.size());
  TIDE_PLAN_CHECK(streams.size() <= 1, "CudaRankExecutor.run: one caller stream, got ", streams.size());
  ex_.run(set, seq, buffers[0], streams.empty() ? nullptr : as_stream(streams[0]),
          members.empty() ? nullptr : &members);
}

}  // namespace tide::cuda

namespace tide {

std::shared_ptr<CallExecutor> make_cuda_cluster_executor(const std::vector<int>& rank_devices, int64_t arena_bytes,
                                                         const ExecutorOptions& opt) {
  auto fabric = std::make_shared<fabric::InProcessFabric>(rank_devices, arena_bytes);
  return std::make_shared<cuda::CudaClusterCallExecutor>(std::move(fabric), opt);
}

char* cuda_cluster_arena(const CallExecutor& ex, int rank) {
  const auto* c = dynamic_cast<const cuda::CudaClusterCallExecutor*>(&ex);
  TIDE_CHECK(c != nullptr, "cuda_cluster_arena: not an in-process CUDA executor (", ex.name(), ")");
  return const_cast<cuda::CudaClusterCallExecutor*>(c)->fabric().arena(rank);
}

void copy_async(const std::vector<DeviceCopy>& copies, uintptr_t stream) {
  std::vector<cuda::ResolvedCopy> d;
  d.reserve(copies.size());
  for (const DeviceCopy& c : copies)
    if (c.bytes > 0) d.push_back({c.dst, c.src, c.bytes, 1, c.bytes, c.bytes});
  if (!d.empty()) cuda::submit_copies(reinterpret_cast<cudaStream_t>(stream), d.data(), d.size());
}

}  // namespace tide
