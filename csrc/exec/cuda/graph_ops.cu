// The graph ops of [Note: replayed calls] (graph.h): one-thread kernels that compute a counter
// value from the call's device-side parameters. Every launch is checked.
#include <cuda_runtime.h>

#include <vector>

#include "exec/cuda/graph.h"
#include "tide/errors.h"

namespace tide::cuda {
namespace {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int64_t value_of(const GraphValue& v, const CallParams* p) {
  return v.value + v.per_call * (v.by_run ? static_cast<int64_t>(p->run) : p->seq);
}

__global__ void graph_head_kernel(CallParams* p, int64_t seq, uint64_t run) {
  p->seq = seq;
  p->run = run;
}

// Eager's WAIT_VALUE_64 GEQ (runtime.h wait_geq), with the target computed on the device.
__global__ void graph_wait_kernel(const uint64_t* counter, GraphValue v, const CallParams* p, uint64_t timeout_ns,
                                  GraphFault* f, GraphFlags* flags, int32_t wait_id, int32_t graph_id) {
  const int64_t target = value_of(v, p);
  if (target <= 0) return;  // counters start at 0: trivially satisfied, as eager skips it
  const uint64_t t = static_cast<uint64_t>(target);
  const volatile int32_t* abort = &flags->abort;
  uint64_t seen = load_acquire(counter);
  if (seen >= t) return;
  const uint64_t start = now_ns();
  unsigned sleep = 32;
  while (seen < t) {
    if (*abort) return;  // another wait failed, or the watchdog gave up on this launch
    if (now_ns() - start > timeout_ns) {
      if (atomicCAS(&f->wait, -1, wait_id) == -1) {
        f->graph = graph_id;
        f->seq = p->seq;
        f->target = t;
        f->seen = seen;
      }
      __threadfence_system();
      static_cast<volatile GraphFlags*>(flags)->faulted = 1;  // host-mapped: plain stores
      static_cast<volatile GraphFlags*>(flags)->abort = 1;
      return;
    }
    __nanosleep(sleep);
    sleep = sleep < 4096 ? sleep * 2 : sleep;
    seen = load_acquire(counter);
  }
}

// Eager's cuStreamWriteValue64 of shadow + v: every earlier write of the stream is visible first.
__global__ void graph_add_kernel(uint64_t* counter, uint64_t v) {
  __threadfence_system();
  atomicAdd_system(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(v));
}

__global__ void graph_raise_kernel(uint64_t* counter, GraphValue v, const CallParams* p) {
  const int64_t target = value_of(v, p);
  if (target <= 0) return;
  __threadfence_system();
  atomicMax_system(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(target));
}

}  // namespace

void launch_graph_head(CallParams* p, int64_t seq, uint64_t run, cudaStream_t stream) {
  graph_head_kernel<<<1, 1, 0, stream>>>(p, seq, run);
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching the graph head");
}

void launch_graph_wait(const uint64_t* counter, GraphValue v, const CallParams* p, uint64_t timeout_ns,
                       GraphFault* fault, GraphFlags* flags, int32_t wait_id, int32_t graph_id,
                       cudaStream_t stream) {
  graph_wait_kernel<<<1, 1, 0, stream>>>(counter, v, p, timeout_ns, fault, flags, wait_id, graph_id);
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching a graph wait");
}

void launch_graph_add(uint64_t* counter, uint64_t v, cudaStream_t stream) {
  graph_add_kernel<<<1, 1, 0, stream>>>(counter, v);
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching a graph signal");
}

void launch_graph_raise(uint64_t* counter, GraphValue v, const CallParams* p, cudaStream_t stream) {
  graph_raise_kernel<<<1, 1, 0, stream>>>(counter, v, p);
  TIDE_CHECK_CUDA(cudaGetLastError(), "launching a graph raise");
}

std::vector<const void*> graph_kernels() {
  return {reinterpret_cast<const void*>(graph_head_kernel), reinterpret_cast<const void*>(graph_wait_kernel),
          reinterpret_cast<const void*>(graph_add_kernel), reinterpret_cast<const void*>(graph_raise_kernel)};
}

}  // namespace tide::cuda
