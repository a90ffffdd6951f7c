// The CUDA executors as CallExecutors of the call runtime (tide/session.h): one adapter per
// executor kind (the CPU twins, CpuClusterCallExecutor and CpuRankCallExecutor, are in
// tide/session.h). The session's RankBindings go down to the executors as they are.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "exec/cuda/executor.h"
#include "exec/cuda/rank_executor.h"
#include "fabric/fabric.h"
#include "tide/session.h"

namespace tide::cuda {

// Every rank of an in-process fabric (CudaExecutor).
class CudaClusterCallExecutor final : public CallExecutor {
 public:
  CudaClusterCallExecutor(std::shared_ptr<fabric::Fabric> fabric, const ExecutorOptions& opt);
  int world() const override { return fabric_->world(); }
  void run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
           const std::vector<RankBindings>& buffers, const std::vector<uintptr_t>& streams) override;
  void synchronize() override { ex_.synchronize(); }
  std::string name() const override { return "cuda-cluster"; }
  void set_timeout(double timeout_s) override { ex_.set_timeout(timeout_s); }
  CudaExecutor& executor() { return ex_; }
  fabric::Fabric& fabric() { return *fabric_; }

 private:
  std::shared_ptr<fabric::Fabric> fabric_;
  CudaExecutor ex_;
};

// One rank of a job whose ranks are processes (CudaRankExecutor over an IPC or NCCL fabric).
class CudaRankCallExecutor final : public CallExecutor {
 public:
  CudaRankCallExecutor(std::shared_ptr<fabric::Fabric> fabric, int rank, const Topology& topo, RegionTable regions,
                       const ExecutorOptions& opt, bool fence = true);
  int world() const override { return ex_.world(); }
  const RegionTable* regions() const override { return regions_.empty() ? nullptr : &regions_; }
  void run(const std::shared_ptr<const ProgramSet>& set, int64_t seq, const std::vector<int>& members,
           const std::vector<RankBindings>& buffers, const std::vector<uintptr_t>& streams) override;
  void synchronize() override { ex_.synchronize(); }
  std::string name() const override { return "cuda-rank"; }
  void set_timeout(double timeout_s) override { ex_.set_timeout(timeout_s); }
  Rails rails() const override { return ex_.rails(); }
  CudaRankExecutor& executor() { return ex_; }

 private:
  RegionTable regions_;
  CudaRankExecutor ex_;
};

}  // namespace tide::cuda
