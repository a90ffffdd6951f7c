// NCCL fabric (contract in nccl.h).
#include "fabric/nccl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "tide/cuda.h"
#include "tide/errors.h"

namespace tide::fabric {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "ncclUniqueId is 128 bytes");

namespace {

// The host-side ncclTeam of nccl_device/core.h (three ints, returned by value by ncclTeamLsa);
// mirrored so this file needs no device headers.
struct LsaTeam {
  int nRanks, rank, stride;
};

struct Api {
  void* lib = nullptr;
  std::string path;
  int version = 0;
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRank) CommInitRank = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommSplit) CommSplit = nullptr;
  decltype(&::ncclCommCount) CommCount = nullptr;
  decltype(&::ncclCommUserRank) CommUserRank = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetLastError) GetLastError = nullptr;
  decltype(&::ncclMemAlloc) MemAlloc = nullptr;
  decltype(&::ncclMemFree) MemFree = nullptr;
  decltype(&::ncclCommWindowRegister) CommWindowRegister = nullptr;
  decltype(&::ncclCommWindowDeregister) CommWindowDeregister = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&::ncclSend) Send = nullptr;
  decltype(&::ncclRecv) Recv = nullptr;
  decltype(&::ncclGroupStart) GroupStart = nullptr;
  decltype(&::ncclGroupEnd) GroupEnd = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  LsaTeam (*TeamLsa)(ncclComm_t) = nullptr;
  // >= 2.29 only (resolved when present):
  ncclResult_t (*GetLsaDevicePointer)(ncclWindow_t, size_t, int, void**) = nullptr;
  void* PutSignal = nullptr;
  void* WaitSignal = nullptr;
};

std::mutex g_mu;
std::vector<std::string> g_candidates;
std::unique_ptr<Api> g_api;

std::string version_str(int code) {
  return TIDE_STR_CAT(code / 10000, ".", (code % 10000) / 100, ".", code % 100);
}

std::string lib_path(void* lib, const std::string& fallback) {
  link_map* lm = nullptr;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0]) return lm->l_name;
  return fallback;
}

template <typename Fn>
void resolve(Api& a, const char* name, Fn* out, const char* since) {
  void* f = dlsym(a.lib, name);
  if (!f)
    throw Error(TIDE_STR_CAT("NCCL library ", a.path, " (", version_str(a.version), ") does not export ", name,
                             " (NCCL >= ", since, " needed)"));
  *out = reinterpret_cast<Fn>(f);
}

// dlopen order of nccl.h's contract; returns the handle or throws naming every attempt.
void* open_library(std::string& path) {
  if (void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD)) {
    path = lib_path(h, "libnccl.so.2 (already loaded)");
    return h;
  }
  std::vector<std::string> tries;
  if (const char* env = std::getenv("TIDE_NCCL_LIBRARY"); env && *env) tries.emplace_back(env);
  tries.emplace_back("libnccl.so.2");
  for (const auto& c : g_candidates) tries.push_back(c);
  std::string errors;
  for (const auto& t : tries) {
    if (void* h = dlopen(t.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      path = lib_path(h, t);
      return h;
    }
    const char* e = dlerror();
    errors += TIDE_STR_CAT("\n  ", t, ": ", e ? e : "not found");
  }
  throw Error(TIDE_STR_CAT("NCCL is not available: no libnccl.so.2 could be loaded (install the nvidia-nccl-cu13 "
                           "wheel torch uses, or set TIDE_NCCL_LIBRARY); tried:",
                           errors));
}

const Api& api() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_api) return *g_api;
  auto a = std::make_unique<Api>();
  a->lib = open_library(a->path);
  resolve(*a, "ncclGetVersion", &a->GetVersion, "2.3");
  if (a->GetVersion(&a->version) != ncclSuccess) throw Error(TIDE_STR_CAT("ncclGetVersion failed in ", a->path));
  resolve(*a, "ncclGetUniqueId", &a->GetUniqueId, "2.0");
  resolve(*a, "ncclCommInitRank", &a->CommInitRank, "2.0");
  resolve(*a, "ncclCommDestroy", &a->CommDestroy, "2.0");
  resolve(*a, "ncclCommAbort", &a->CommAbort, "2.4");
  resolve(*a, "ncclCommSplit", &a->CommSplit, "2.18");
  resolve(*a, "ncclCommCount", &a->CommCount, "2.0");
  resolve(*a, "ncclCommUserRank", &a->CommUserRank, "2.0");
  resolve(*a, "ncclGetErrorString", &a->GetErrorString, "2.0");
  resolve(*a, "ncclGetLastError", &a->GetLastError, "2.13");
  resolve(*a, "ncclMemAlloc", &a->MemAlloc, "2.19");
  resolve(*a, "ncclMemFree", &a->MemFree, "2.19");
  resolve(*a, "ncclCommWindowRegister", &a->CommWindowRegister, "2.27");
  resolve(*a, "ncclCommWindowDeregister", &a->CommWindowDeregister, "2.27");
  resolve(*a, "ncclAllReduce", &a->AllReduce, "2.0");
  resolve(*a, "ncclTeamLsa", &a->TeamLsa, "2.28");
  resolve(*a, "ncclCommInitRankConfig", &a->CommInitRankConfig, "2.14");
  resolve(*a, "ncclSend", &a->Send, "2.7");
  resolve(*a, "ncclRecv", &a->Recv, "2.7");
  resolve(*a, "ncclGroupStart", &a->GroupStart, "2.0");
  resolve(*a, "ncclGroupEnd", &a->GroupEnd, "2.0");
  resolve(*a, "ncclCommGetAsyncError", &a->CommGetAsyncError, "2.4");
  a->GetLsaDevicePointer =
      reinterpret_cast<decltype(a->GetLsaDevicePointer)>(dlsym(a->lib, "ncclGetLsaDevicePointer"));
  a->PutSignal = dlsym(a->lib, "ncclPutSignal");
  a->WaitSignal = dlsym(a->lib, "ncclWaitSignal");
  g_api = std::move(a);
  return *g_api;
}

// The loaded library must match the headers this build was compiled against in major.minor.
const Api& checked_api() {
  const Api& a = api();
  const int lib_mm = a.version / 100, hdr_mm = NCCL_VERSION_CODE / 100;
  if (lib_mm != hdr_mm)
    throw Error(TIDE_STR_CAT("NCCL library ", a.path, " is ", version_str(a.version), " but tide was built against "
                             "NCCL ", version_str(NCCL_VERSION_CODE), " headers; major.minor must match (the device "
                             "ABI -- ncclWindow_vidmem, ncclDevComm, ncclDevCommRequirements -- changed between 2.28 "
                             "and 2.32): rebuild tide against the loaded library's headers"));
  return a;
}

void check_nccl(const Api& a, ncclResult_t r, void* comm, const std::string& what) {
  if (r == ncclSuccess) return;
  const char* last = comm ? a.GetLastError(static_cast<ncclComm_t>(comm)) : a.GetLastError(nullptr);
  throw Error(TIDE_STR_CAT(what, " failed: ", a.GetErrorString(r), " (ncclResult ", static_cast<int>(r), ")",
                           last && *last ? ": " : "", last ? last : ""));
}


// Safety, for every communicator TIDE creates: NCCL binds multicast (NVLS) when it is on. A
// non-zero NCCL_NVLS_ENABLE is refused unless the multicast gate is open (TIDE_ENABLE_MULTICAST=1
// AND a multicast-capable GPU AND TORCH_SYMM_MEM_DISABLE_MULTICAST unset); unset, it is set to 0.
// Returns the gate's verdict for `device`. NCCL_NVLS_ENABLE comes from cuda::nccl_nvls_setting().
bool nvls_off_unless_gated(int device, const char* who) {
  const char* nvls = cuda::nccl_nvls_setting();  // the gate's one read of the environment
  const bool nvls_on = nvls && std::strcmp(nvls, "0") != 0;
  const bool multicast = cuda::multicast_allowed(device);  // reads the gate's own variables
  TIDE_PLAN_CHECK(!nvls_on || multicast, who, ": NCCL_NVLS_ENABLE=", nvls ? nvls : "", " but the multicast gate is "
                  "closed (it opens only with TIDE_ENABLE_MULTICAST=1 on a multicast-capable GPU and "
                  "TORCH_SYMM_MEM_DISABLE_MULTICAST unset): set NCCL_NVLS_ENABLE=0");
  if (!nvls) setenv("NCCL_NVLS_ENABLE", "0", 0);  // no window registration or comm binds multicast
  return multicast;
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};

// A failure every rank reaches together (the probe's disagreement): teardown may be collective.
struct AgreedError : PlanError {
  using PlanError::PlanError;
};

}  // namespace

int nccl_header_version() { return NCCL_VERSION_CODE; }

void nccl_add_library_candidates(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const auto& p : paths)
    if (!p.empty()) g_candidates.push_back(p);
}

int nccl_version() { return api().version; }
std::string nccl_library_path() { return api().path; }

std::string nccl_unique_id() {
  const Api& a = checked_api();
  ncclUniqueId id{};
  check_nccl(a, a.GetUniqueId(&id), nullptr, "nccl_unique_id: ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

NcclFabric::NcclFabric(int rank, int world, int device, int64_t arena_bytes, const std::string& unique_id,
                       int gpus_per_node)
    : rank_(rank), world_(world), device_(device), gpus_per_node_(gpus_per_node), arena_bytes_(arena_bytes) {
  TIDE_PLAN_CHECK(world >= 1, "NcclFabric: world must be >= 1, got ", world);
  TIDE_PLAN_CHECK(rank >= 0 && rank < world, "NcclFabric: rank ", rank, " is outside [0, ", world, ")");
  TIDE_PLAN_CHECK(device >= 0, "NcclFabric: device must be >= 0, got ", device);
  TIDE_PLAN_CHECK(arena_bytes > 0, "NcclFabric: arena_bytes must be positive, got ", arena_bytes);
  TIDE_PLAN_CHECK(unique_id.size() == kNcclUniqueIdBytes, "NcclFabric: unique_id has ", unique_id.size(),
                  " bytes, an ncclUniqueId has ", kNcclUniqueIdBytes, " (use tide._core.nccl_unique_id())");
  TIDE_PLAN_CHECK(gpus_per_node >= 1 && world % gpus_per_node == 0, "NcclFabric: gpus_per_node ", gpus_per_node,
                  " does not divide world ", world);
  const Api& a = checked_api();
  const bool multicast = nvls_off_unless_gated(device, "NcclFabric");  // a closed gate touches no device
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  TIDE_PLAN_CHECK(device < n, "NcclFabric: device ", device, " is not a usable CUDA device (", n, " visible)");
  arena_.assign(static_cast<size_t>(world), nullptr);
  const std::string who = TIDE_STR_CAT("NcclFabric rank ", rank_, " (device ", device_, "): ");
  cuda::DeviceGuard guard(device_, "NcclFabric: ");
  try {
    cudaStream_t s = nullptr;
    TIDE_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), who, "probe stream");
    stream_ = s;
    ncclUniqueId id{};
    std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
    ncclComm_t comm = nullptr;
    check_nccl(a, a.CommInitRank(&comm, world_, id, rank_), nullptr, who + "ncclCommInitRank");
    comm_ = comm;

    // Round 1, before anything collective depends on the sizes.
    agree({{"nccl_version", a.version},
           {"header_version", NCCL_VERSION_CODE},
           {"multicast_allowed", multicast ? 1 : 0},
           {"arena_bytes", arena_bytes_},
           {"gpus_per_node", gpus_per_node_}});

    const size_t bytes = (static_cast<size_t>(arena_bytes_) + 4095) / 4096 * 4096;
    void* p = nullptr;
    check_nccl(a, a.MemAlloc(&p, bytes), comm_, TIDE_STR_CAT(who, "ncclMemAlloc(", bytes, " bytes)"));
    local_ = static_cast<char*>(p);
    TIDE_CHECK_CUDA(cudaMemsetAsync(local_, 0, bytes, s), who, "zeroing the arena");
    TIDE_CHECK_CUDA(cudaStreamSynchronize(s), who, "zeroing the arena");
    ncclWindow_t win = nullptr;
    check_nccl(a, a.CommWindowRegister(comm, local_, bytes, &win, NCCL_WIN_COLL_SYMMETRIC), comm_,
               who + "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)");
    if (!win)  // e.g. NCCL_WIN_ENABLE=0: registration "succeeds" without a window
      throw Error(TIDE_STR_CAT(who, "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) returned no window (is "
                               "NCCL_WIN_ENABLE=0 or NCCL_CUMEM_ENABLE=0 set?)"));
    win_ = win;

    // The LSA team exists once the window is registered (registration initialises the device
    // runtime state ncclTeamLsa reads on 2.28).
    const LsaTeam team = a.TeamLsa(comm);
    if (team.nRanks < 1 || team.nRanks > world_ || team.rank < 0 || team.rank >= team.nRanks || team.stride < 1)
      throw Error(TIDE_STR_CAT(who, "ncclTeamLsa returned {nRanks ", team.nRanks, ", rank ", team.rank, ", stride ",
                               team.stride, "} for a world of ", world_));
    lsa_size_ = team.nRanks;
    lsa_rank_ = team.rank;
    std::vector<void*> ptrs(static_cast<size_t>(lsa_size_), nullptr);
    if (a.GetLsaDevicePointer) {
      for (int q = 0; q < lsa_size_; ++q)
        check_nccl(a, a.GetLsaDevicePointer(win, 0, q, &ptrs[static_cast<size_t>(q)]), comm_,
                   TIDE_STR_CAT(who, "ncclGetLsaDevicePointer(lsa rank ", q, ")"));
    } else {
      void* scratch = nullptr;
      const size_t sb = sizeof(void*) * ptrs.size() + 2 * sizeof(int);
      TIDE_CHECK_CUDA(cudaMalloc(&scratch, sb), who, "LSA-pointer scratch");
      std::unique_ptr<void, CudaFree> own(scratch);
      void** dptrs = static_cast<void**>(scratch);
      int* dranks = reinterpret_cast<int*>(dptrs + ptrs.size());
      detail::launch_lsa_pointers(win, lsa_size_, dptrs, dranks, stream_);
      int ranks[2] = {-1, -1};
      TIDE_CHECK_CUDA(cudaMemcpyAsync(ptrs.data(), dptrs, sizeof(void*) * ptrs.size(), cudaMemcpyDeviceToHost, s),
                      who, "reading the LSA pointers");
      TIDE_CHECK_CUDA(cudaMemcpyAsync(ranks, dranks, sizeof(ranks), cudaMemcpyDeviceToHost, s), who,
                      "reading the window's ranks");
      TIDE_CHECK_CUDA(cudaStreamSynchronize(s), who, "the LSA-pointer kernel");
      if (ranks[0] != lsa_rank_ || ranks[1] != rank_)
        throw Error(TIDE_STR_CAT(who, "the window says lsaRank ", ranks[0], ", worldRank ", ranks[1],
                                 "; ncclTeamLsa says lsa rank ", lsa_rank_, " of world rank ", rank_));
    }
    for (int r = 0; r < world_; ++r) {
      const int delta = r - rank_;
      if (delta % team.stride != 0) continue;
      const int q = lsa_rank_ + delta / team.stride;
      if (q >= 0 && q < lsa_size_) {
        arena_[static_cast<size_t>(r)] = static_cast<char*>(ptrs[static_cast<size_t>(q)]);
        if (!arena_[static_cast<size_t>(r)])
          throw Error(TIDE_STR_CAT(who, "null LSA pointer for lsa rank ", q, " (world rank ", r, ")"));
      }
    }

    // Round 2: the LSA team (known only after registration).
    agree({{"lsa_team_size", lsa_size_}});

    ncclComm_t rail = nullptr;
    const int local = rank_ % gpus_per_node_, node = rank_ / gpus_per_node_;
    check_nccl(a, a.CommSplit(comm, local, node, &rail, nullptr), comm_,
               TIDE_STR_CAT(who, "ncclCommSplit(color = local index ", local, ", key = node ", node, ")"));
    rail_ = rail;
    check_nccl(a, a.CommCount(rail, &rail_size_), rail_, who + "ncclCommCount(rail)");
    check_nccl(a, a.CommUserRank(rail, &rail_rank_), rail_, who + "ncclCommUserRank(rail)");
    if (rail_size_ != world_ / gpus_per_node_ || rail_rank_ != node)
      throw Error(TIDE_STR_CAT(who, "rail communicator is rank ", rail_rank_, " of ", rail_size_, ", expected rank ",
                               node, " of ", world_ / gpus_per_node_));
    if (a.PutSignal && a.WaitSignal) {
      rail_put_path_ = "put_signal";
    } else {
      rail_put_path_ = "send_recv";
      static std::once_flag logged;
      std::call_once(logged, [&a] {
        std::fprintf(stderr, "tide: NCCL %s has no ncclPutSignal/ncclWaitSignal (>= 2.29); rail puts use send/recv\n",
                     version_str(a.version).c_str());
      });
    }
  } catch (const AgreedError&) {
    release(/*orderly=*/true);
    throw;
  } catch (...) {
    release(/*orderly=*/false);
    throw;
  }
}

void NcclFabric::agree(const std::vector<std::pair<std::string, int64_t>>& fields) {
  const Api& a = api();
  const size_t k = fields.size();
  const std::string who = TIDE_STR_CAT("NcclFabric rank ", rank_, " (device ", device_, "): ");
  std::vector<int64_t> host(k), lo(k), hi(k);
  for (size_t i = 0; i < k; ++i) host[i] = fields[i].second;
  void* buf = nullptr;
  TIDE_CHECK_CUDA(cudaMalloc(&buf, 3 * k * sizeof(int64_t)), who, "probe buffer");
  std::unique_ptr<void, CudaFree> own(buf);
  auto* in = static_cast<int64_t*>(buf);
  auto s = static_cast<cudaStream_t>(stream_);
  auto comm = static_cast<ncclComm_t>(comm_);
  TIDE_CHECK_CUDA(cudaMemcpyAsync(in, host.data(), k * sizeof(int64_t), cudaMemcpyHostToDevice, s), who, "probe");
  check_nccl(a, a.AllReduce(in, in + k, k, ncclInt64, ncclMin, comm, s), comm_, who + "ncclAllReduce(probe, min)");
  check_nccl(a, a.AllReduce(in, in + 2 * k, k, ncclInt64, ncclMax, comm, s), comm_, who + "ncclAllReduce(probe, max)");
  TIDE_CHECK_CUDA(cudaMemcpyAsync(lo.data(), in + k, k * sizeof(int64_t), cudaMemcpyDeviceToHost, s), who, "probe");
  TIDE_CHECK_CUDA(cudaMemcpyAsync(hi.data(), in + 2 * k, k * sizeof(int64_t), cudaMemcpyDeviceToHost, s), who,
                  "probe");
  TIDE_CHECK_CUDA(cudaStreamSynchronize(s), who, "probe all-reduce");
  for (size_t i = 0; i < k; ++i)
    if (lo[i] != hi[i])
      throw AgreedError(TIDE_STR_CAT("NcclFabric: the ranks disagree on capability probe field '", fields[i].first,
                                     "': min ", lo[i], ", max ", hi[i], " over ", world_,
                                     " ranks (every rank raises this)"));
  for (size_t i = 0; i < k; ++i) probe_.emplace_back(fields[i].first, lo[i]);
}

void NcclFabric::close() {
  if (!comm_) return;
  const std::string err = release(/*orderly=*/true);
  if (!err.empty()) throw Error(err);
}

NcclFabric::~NcclFabric() {
  if (!comm_) return;
  const std::string err = release(/*orderly=*/true);
  if (!err.empty()) std::fprintf(stderr, "tide: %s\n", err.c_str());
}

// Teardown in the order of nccl.h's contract. `orderly`: every rank tears down together, so the
// collective window deregistration is safe; otherwise (a local failure during construction,
// peers may be blocked in a collective) the communicators are aborted instead. Returns the
// first failure (every step still runs).
std::string NcclFabric::release(bool orderly) noexcept {
  std::string first;
  auto note = [&](const std::string& m) {
    if (first.empty()) first = m;
  };
  try {
    const std::string who = TIDE_STR_CAT("NcclFabric rank ", rank_, " (device ", device_, "): ");
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) {
      cudaGetLastError();
      prev = -1;
    }
    if (cudaSetDevice(device_) != cudaSuccess) note(who + "cudaSetDevice");
    if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
      note(TIDE_STR_CAT(who, "cudaDeviceSynchronize: ", cudaGetErrorName(e)));
    const Api* a = g_api.get();  // set whenever comm_ or local_ is
    auto step = [&](ncclResult_t r, void* comm, const char* call) {
      if (r == ncclSuccess) return;
      const char* last = a->GetLastError(static_cast<ncclComm_t>(comm));
      note(TIDE_STR_CAT(who, call, " failed: ", a->GetErrorString(r), last && *last ? ": " : "", last ? last : ""));
    };
    if (a) {
      if (orderly) {
        if (win_) step(a->CommWindowDeregister(static_cast<ncclComm_t>(comm_), static_cast<ncclWindow_t>(win_)), comm_,
                       "ncclCommWindowDeregister");
        if (local_) step(a->MemFree(local_), comm_, "ncclMemFree");
        if (rail_) step(a->CommDestroy(static_cast<ncclComm_t>(rail_)), rail_, "ncclCommDestroy(rail)");
        if (comm_) step(a->CommDestroy(static_cast<ncclComm_t>(comm_)), comm_, "ncclCommDestroy");
      } else {
        if (rail_) step(a->CommAbort(static_cast<ncclComm_t>(rail_)), nullptr, "ncclCommAbort(rail)");
        if (comm_) step(a->CommAbort(static_cast<ncclComm_t>(comm_)), nullptr, "ncclCommAbort");
        if (local_) step(a->MemFree(local_), nullptr, "ncclMemFree");
      }
    }
    if (stream_ && cudaStreamDestroy(static_cast<cudaStream_t>(stream_)) != cudaSuccess) note(who + "cudaStreamDestroy");
    if (prev >= 0) cudaSetDevice(prev);
  } catch (...) {
    note("NcclFabric: teardown failed");
  }
  win_ = rail_ = comm_ = stream_ = nullptr;
  local_ = nullptr;
  arena_.assign(arena_.size(), nullptr);
  return first;
}

// ---- NcclRail ([Note: NCCL rail] in nccl.h) ---------------------------------------------------
// [Note: rail deadline] With timeout_s > 0 the rail's communicator is non-blocking (config.blocking
// = 0): ncclCommInitRankConfig returns at once and the constructor polls ncclCommGetAsyncError until
// the init is done, and the pre-connect polls its stream, each until the deadline; past it the
// communicator is aborted (ncclCommAbort: NCCL's threads and kernels let go) and a TimeoutError says
// which rail ranks (nodes) were being waited for: a process of another node that died or never
// reached its rail cannot keep this one inside NCCL. A non-blocking communicator's ncclGroupEnd may
// return ncclInProgress; enqueue() then waits for it the same way.
namespace {

using Clock = std::chrono::steady_clock;

// Polls `comm` until its pending operation is done; ncclSuccess or the error. Past `deadline` it
// returns ncclInProgress (the caller aborts). An enqueue still in progress is usually done within
// microseconds, and the caller's thread is blocked meanwhile (the next launches wait): it is
// polled at once and then with yields for the first 100 us, as NCCL's own non-blocking examples
// spin, and only then with sleeps that grow from 20 to 200 us (a rail whose peer is slow to
// connect).
ncclResult_t await_comm(const Api& a, ncclComm_t comm, ncclResult_t r, Clock::time_point deadline) {
  const Clock::time_point start = Clock::now();
  auto sleep = std::chrono::microseconds(20);
  while (r == ncclInProgress) {
    if (a.CommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
    if (r != ncclInProgress) break;
    const Clock::time_point now = Clock::now();
    if (now > deadline) return ncclInProgress;
    if (now - start < std::chrono::microseconds(100)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(200));
    }
  }
  return r;
}

}  // namespace

NcclRail::NcclRail(int rank, int size, int device, const std::string& unique_id, int max_ctas, int channels_per_peer,
                   double timeout_s)
    : rank_(rank), size_(size), device_(device), max_ctas_(max_ctas), channels_(channels_per_peer),
      timeout_s_(timeout_s) {
  TIDE_PLAN_CHECK(size >= 1 && rank >= 0 && rank < size, "NcclRail: rank ", rank, " is outside [0, ", size, ")");
  TIDE_PLAN_CHECK(max_ctas >= 1 && max_ctas <= 64, "NcclRail.max_ctas: expected 1..64, got ", max_ctas);
  TIDE_PLAN_CHECK(channels_per_peer >= 1 && channels_per_peer <= 32, "NcclRail.channels_per_peer: expected 1..32, got ",
                  channels_per_peer);
  TIDE_PLAN_CHECK(unique_id.size() == kNcclUniqueIdBytes, "NcclRail: unique_id has ", unique_id.size(), " bytes, an "
                  "ncclUniqueId has ", kNcclUniqueIdBytes);
  TIDE_PLAN_CHECK(timeout_s >= 0 && timeout_s <= 1e6, "NcclRail.timeout_s: expected 0 (no deadline) .. 1e6, got ",
                  timeout_s);
  nvls_off_unless_gated(device, "NcclRail");
  const Api& a = checked_api();
  const std::string who = TIDE_STR_CAT("NcclRail rank ", rank_, " of ", size_, " (device ", device_, "): ");
  cuda::DeviceGuard guard(device_, "NcclRail: ");
  ncclUniqueId id{};
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.minCTAs = 1;
  config.maxCTAs = max_ctas_;
  config.nChannelsPerNetPeer = channels_;
  config.commName = "tide-rail";
  config.blocking = timeout_s_ > 0 ? 0 : 1;  // [Note: rail deadline]
  const auto deadline = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_s_ * 1e6));
  ncclComm_t comm = nullptr;
  ncclResult_t init = a.CommInitRankConfig(&comm, size_, id, rank_, &config);
  if (!config.blocking && comm != nullptr) init = await_comm(a, comm, init, deadline);
  if (init == ncclInProgress) {
    a.CommAbort(comm);
    throw TimeoutError(TIDE_STR_CAT(who, "ncclCommInitRankConfig: rail ranks (nodes) other than ", rank_, " of ", size_,
                                    " did not join within ", timeout_s_, " s (a process of another node that died, "
                                    "or never reached its rail); the communicator was aborted"));
  }
  if (init != ncclSuccess && comm != nullptr) a.CommAbort(comm);
  check_nccl(a, init, nullptr, who + "ncclCommInitRankConfig");
  comm_ = comm;
  static std::once_flag logged;  // once per process: which transfer path the rails take
  std::call_once(logged, [&a, this] {
    std::fprintf(stderr, "tide: rails use ncclSend/ncclRecv kernels (at most %d SMs per group): NCCL %s %s\n",
                 max_ctas_, version_str(a.version).c_str(),
                 a.PutSignal && a.WaitSignal ? "has host RMA (ncclPutSignal), which TIDE's rails do not use yet"
                                             : "has no host RMA (ncclPutSignal/ncclWaitSignal need >= 2.29)");
  });
  if (size_ == 1) return;
  // Pre-connect: one 8-byte exchange with every rail peer, each way, in one group.
  cudaStream_t s = nullptr;
  void* buf = nullptr;
  try {
    TIDE_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), who, "pre-connect stream");
    TIDE_CHECK_CUDA(cudaMalloc(&buf, 16 * static_cast<size_t>(size_)), who, "pre-connect buffer");
    std::vector<RailXfer> sends, recvs;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      sends.push_back({p, static_cast<char*>(buf) + 16 * p, 8});
      recvs.push_back({p, static_cast<char*>(buf) + 16 * p + 8, 8});
    }
    enqueue(sends, recvs, s, "pre-connecting the rail peers");
    if (timeout_s_ > 0) {  // [Note: rail deadline]: the stream is polled, the deadline aborts
      cudaError_t q;
      while ((q = cudaStreamQuery(s)) == cudaErrorNotReady) {
        if (Clock::now() > deadline)
          throw TimeoutError(TIDE_STR_CAT(who, "pre-connecting the rail peers: a rail rank (node) other than ", rank_,
                                          " of ", size_, " did not answer within ", timeout_s_, " s (a process of "
                                          "another node that died); the communicator was aborted"));
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      TIDE_CHECK_CUDA(q, who, "pre-connecting the rail peers");
    }
    TIDE_CHECK_CUDA(cudaStreamSynchronize(s), who, "pre-connecting the rail peers");
  } catch (...) {
    if (buf) cudaFree(buf);
    if (s) cudaStreamDestroy(s);
    a.CommAbort(static_cast<ncclComm_t>(comm_));
    comm_ = nullptr;
    throw;
  }
  cudaFree(buf);
  cudaStreamDestroy(s);
}

void NcclRail::enqueue(const std::vector<RailXfer>& sends, const std::vector<RailXfer>& recvs, void* stream,
                       const std::string& what) {
  const Api& a = api();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) throw Error(TIDE_STR_CAT("NcclRail rank ", rank_, ": ", what, ": the rail was aborted (",
                                                    aborted_, ")"));
    TIDE_CHECK(comm_ != nullptr, "NcclRail rank ", rank_, ": ", what, ": the rail is closed");
  }
  auto comm = static_cast<ncclComm_t>(comm_);
  auto s = static_cast<cudaStream_t>(stream);
  const std::string who = TIDE_STR_CAT("NcclRail rank ", rank_, ": ", what, ": ");
  check_nccl(a, a.GroupStart(), comm_, who + "ncclGroupStart");
  ncclResult_t first = ncclSuccess;
  std::string at;
  for (const auto& x : sends) {
    TIDE_CHECK(x.peer >= 0 && x.peer < size_ && x.peer != rank_, who, "send to rail rank ", x.peer);
    const ncclResult_t r = a.Send(x.data, static_cast<size_t>(x.bytes), ncclUint8, x.peer, comm, s);
    if (r != ncclSuccess && first == ncclSuccess) { first = r; at = TIDE_STR_CAT("ncclSend to rail rank ", x.peer); }
  }
  for (const auto& x : recvs) {
    TIDE_CHECK(x.peer >= 0 && x.peer < size_ && x.peer != rank_, who, "receive from rail rank ", x.peer);
    const ncclResult_t r = a.Recv(x.data, static_cast<size_t>(x.bytes), ncclUint8, x.peer, comm, s);
    if (r != ncclSuccess && first == ncclSuccess) { first = r; at = TIDE_STR_CAT("ncclRecv from rail rank ", x.peer); }
  }
  ncclResult_t end = a.GroupEnd();
  groups_.fetch_add(1, std::memory_order_relaxed);
  if (end == ncclInProgress) {  // a non-blocking rail ([Note: rail deadline]): enqueued, not yet issued
    const double budget = timeout_s_ > 0 ? timeout_s_ : 1e6;
    const Clock::time_point t0 = Clock::now();
    end = await_comm(a, comm, end, t0 + std::chrono::microseconds(static_cast<int64_t>(budget * 1e6)));
    in_progress_.fetch_add(1, std::memory_order_relaxed);
    in_progress_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count(),
                              std::memory_order_relaxed);
    if (end == ncclInProgress)
      throw TimeoutError(TIDE_STR_CAT(who, "ncclGroupEnd still in progress after ", budget, " s"));
  }
  check_nccl(a, first, comm_, who + at);
  check_nccl(a, end, comm_, who + "ncclGroupEnd");
}

std::string NcclRail::async_error() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return aborted_;
  const Api& a = api();
  ncclResult_t r = ncclSuccess;
  if (a.CommGetAsyncError(static_cast<ncclComm_t>(comm_), &r) != ncclSuccess) return "ncclCommGetAsyncError failed";
  if (r == ncclSuccess || r == ncclInProgress) return "";
  const char* last = a.GetLastError(static_cast<ncclComm_t>(comm_));
  return TIDE_STR_CAT(a.GetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

void NcclRail::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_.empty() || !comm_) return;
  aborted_ = why.empty() ? "aborted" : why;
  const Api& a = api();
  a.CommAbort(static_cast<ncclComm_t>(comm_));
  comm_ = nullptr;
}

void NcclRail::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return;
  const Api& a = api();
  cuda::DeviceGuard guard(device_, "NcclRail: ");
  const ncclResult_t r = a.CommDestroy(static_cast<ncclComm_t>(comm_));
  comm_ = nullptr;
  if (r != ncclSuccess && r != ncclInProgress) throw Error(TIDE_STR_CAT("NcclRail rank ", rank_, ": ncclCommDestroy failed: ", a.GetErrorString(r)));
}

NcclRail::~NcclRail() {
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tide: %s\n", e.what());
  }
}

}  // namespace tide::fabric
