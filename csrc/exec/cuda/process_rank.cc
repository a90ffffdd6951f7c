// CudaProcessRank (contract in tide/cuda.h): one rank of a job whose ranks are processes, as the
// XLA face needs it across jax.distributed processes. tide_torch composes the same pieces from
// Python (cuda.IpcFabric, cuda.NcclRail, cuda.RankExecutor); this is that composition once, in
// the core, for a face that exchanges only bytes (IPC handles, a rail's unique id).
#include "exec/cuda/call_executors.h"
#include "fabric/ipc.h"
#ifdef TIDE_WITH_NCCL
#include "fabric/nccl.h"
#endif
#include "tide/cuda.h"
#include "tide/errors.h"

namespace tide {

struct CudaProcessRank::Impl {
  int rank = 0;
  Topology topo;
  std::shared_ptr<fabric::IpcFabric> fabric;
  bool connected = false;
};

CudaProcessRank::CudaProcessRank(int rank, const Topology& topo, int device, int64_t arena_bytes)
    : impl_(std::make_shared<Impl>()) {
  TIDE_PLAN_CHECK(rank >= 0 && rank < topo.world(), "CudaProcessRank: rank ", rank, " is outside the ", topo.nodes,
                  "x", topo.gpus_per_node, " topology");
  impl_->rank = rank;
  impl_->topo = topo;
  impl_->fabric = std::make_shared<fabric::IpcFabric>(rank, topo.world(), device, arena_bytes);
}

std::string CudaProcessRank::ipc_handle() const { return impl_->fabric->handle(); }
char* CudaProcessRank::arena() const { return impl_->fabric->arena(impl_->rank); }
int CudaProcessRank::device() const { return impl_->fabric->device(); }

std::shared_ptr<CallExecutor> CudaProcessRank::connect(const std::vector<std::string>& handles,
                                                       const std::string& rail_id, const RegionTable& regions,
                                                       ExecutorOptions opt,
                                                       const std::vector<const CudaProcessRank*>& same_process) {
  Impl& m = *impl_;
  const int L = m.topo.gpus_per_node, node = m.rank / L;
  TIDE_CHECK(!m.connected, "CudaProcessRank: rank ", m.rank, " is connected already");
  TIDE_PLAN_CHECK(static_cast<int>(handles.size()) == m.topo.world(), "CudaProcessRank.connect: ", handles.size(),
                  " IPC handles for ", m.topo.world(), " ranks");
  // [Note: same-process peers] in fabric/ipc.h: this node's ranks of this process by pointer. The
  // executor's fabric is an alias of the own fabric that also owns theirs: a rank's arena lives
  // until the last executor that reaches it is gone (no cycle: fabrics own nothing).
  std::vector<const fabric::IpcFabric*> local(handles.size(), nullptr);
  auto kept = std::make_shared<std::vector<std::shared_ptr<fabric::IpcFabric>>>(1, m.fabric);
  for (const CudaProcessRank* other : same_process) {
    const Impl& o = *other->impl_;
    if (o.rank == m.rank) continue;
    TIDE_PLAN_CHECK(o.topo.nodes == m.topo.nodes && o.topo.gpus_per_node == L, "CudaProcessRank.connect: rank ",
                    o.rank, " of this process has topology ", o.topo.nodes, "x", o.topo.gpus_per_node, ", rank ", m.rank,
                    " has ", m.topo.nodes, "x", L);
    TIDE_PLAN_CHECK(o.rank / L == node, "CudaProcessRank: this process holds rank ", m.rank, " (node ", node,
                    ") and rank ", o.rank, " (node ", o.rank / L, ") of one group (topology ", m.topo.nodes, "x", L,
                    "): a process may hold several ranks of its own node only (a node is a host; ranks of two nodes "
                    "would meet on an NCCL rail with both ends in this process)");
    local[static_cast<size_t>(o.rank)] = o.fabric.get();
    kept->push_back(o.fabric);
  }
  std::vector<std::string> mine(handles.size());  // this node's peers only; "" = reached by the rail
  for (int q = 0; q < m.topo.world(); ++q) {
    if (q / L != node || q == m.rank || local[static_cast<size_t>(q)] != nullptr) continue;
    TIDE_PLAN_CHECK(handles[static_cast<size_t>(q)].size() == fabric::kIpcHandleBytes, "CudaProcessRank.connect: "
                    "rank ", q, " (node ", node, ", as rank ", m.rank, ") sent a ", handles[static_cast<size_t>(q)].size(),
                    "-byte IPC handle, expected ", fabric::kIpcHandleBytes);
    mine[static_cast<size_t>(q)] = handles[static_cast<size_t>(q)];
  }
  m.fabric->open_peers(mine, local);
  opt.rails = rails_for(m.topo);
  const std::shared_ptr<fabric::Fabric> fab(kept, m.fabric.get());
  auto ex = std::make_shared<cuda::CudaRankCallExecutor>(fab, m.rank, m.topo, regions, opt);
  if (m.topo.nodes > 1) {
#ifdef TIDE_WITH_NCCL
    ex->executor().set_rail(std::make_shared<fabric::NcclRail>(node, m.topo.nodes, m.fabric->device(), rail_id,
                                                              opt.rail_ctas, opt.rail_channels_per_peer, opt.timeout_s));
#else
    (void)rail_id;
    throw PlanError(TIDE_STR_CAT("CudaProcessRank: rank ", m.rank, " reaches ", m.topo.nodes - 1, " other node(s) "
                                 "through an NCCL rail, but this build has no NCCL headers (pip install "
                                 "nvidia-nccl-cu13 and rebuild)"));
#endif
  }
  m.connected = true;
  return ex;
}

std::string nccl_rail_unique_id() {
#ifdef TIDE_WITH_NCCL
  return fabric::nccl_unique_id();
#else
  throw PlanError("nccl_rail_unique_id: this build has no NCCL headers (no rail to other nodes)");
#endif
}

void nccl_library_candidates(const std::vector<std::string>& paths) {
#ifdef TIDE_WITH_NCCL
  fabric::nccl_add_library_candidates(paths);
#else
  (void)paths;
#endif
}

}  // namespace tide
