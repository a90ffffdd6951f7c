// CpuArena: N symmetric arenas in one mapping (private, or shared with the forked rank processes).
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "exec/cpu/internal.h"
#include "tide/exec_cpu.h"

namespace tide {

namespace {
constexpr int64_t kGuard = 4096;   // canary bytes after each rank's arena
constexpr uint8_t kCanary = 0xA5;

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// End of the alignment gap after region k: the next region's (or the counters') start. The gap
// [end of k, gap_end) belongs to no region and holds canaries.
int64_t gap_end(const ArenaSpec& spec, int k) {
  const int64_t end = spec.offset[k] + spec.bytes[k];
  int64_t next = spec.total;
  for (int j = 4; j < kNumBufKinds; ++j)
    if (spec.offset[j] >= end && spec.offset[j] < next && (spec.bytes[j] > 0 || j != k)) next = spec.offset[j];
  if (spec.counters_offset >= end && spec.counters_offset < next) next = spec.counters_offset;
  return next;
}

// [Note: arena memory check] The memory the mapping can get: physical memory, for the private
// mapping (ranks as threads) and the shared anonymous one (ranks as processes: shmem pages, which
// /dev/shm's size does not bound) alike. Both are lazily backed, so an arena past it maps fine
// and fails later (the OOM killer): the constructor refuses it first, naming the region that
// makes it large. -1 when the limit is unknown.
int64_t memory_available() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : -1;
}

void check_arena_fits(int world, const ArenaSpec& spec, int64_t map_bytes) {
  const int64_t avail = memory_available();
  if (avail < 0 || map_bytes <= avail) return;
  int big = -1;
  for (int k = 4; k < kNumBufKinds; ++k)
    if (big < 0 || spec.bytes[k] > spec.bytes[big]) big = k;
  const bool counters = big < 0 || spec.counters_bytes > spec.bytes[big];
  throw PlanError(TIDE_STR_CAT(
      "CpuArena: ", world, " rank(s) x ", spec.total, " arena bytes (", map_bytes, " bytes mapped) exceed the ",
      avail, " bytes of physical memory; the largest region is '",
      counters ? "counters" : buf_kind_name(static_cast<BufKind>(big)), "' (",
      counters ? spec.counters_bytes : spec.bytes[big], " bytes per rank)"));
}
}  // namespace

CpuArena::CpuArena(int world, const ArenaSpec& spec, bool shared_memory)
    : world_(world), spec_(spec), shm_(shared_memory) {
  TIDE_PLAN_CHECK(world >= 1, "CpuArena: world must be >= 1, got ", world);
  stride_ = round_up(spec.total, 4096) + kGuard;
  shared_bytes_ = round_up(static_cast<int64_t>(Shared::bytes(world)), 4096);
  check_arena_fits(world, spec, shared_bytes_ + stride_ * world);
  map_bytes_ = static_cast<size_t>(shared_bytes_ + stride_ * world);
  // [Note: shared-memory lifetime] Ranks as processes share one anonymous MAP_SHARED mapping
  // that the forked ranks inherit: it has no name, so nothing can outlive the processes that map
  // it, whenever any of them is killed (a named segment, even unlinked at once, leaks if its
  // creator dies between shm_open and shm_unlink).
  void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, (shm_ ? MAP_SHARED : MAP_PRIVATE) | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error(TIDE_STR_CAT("CpuArena: mapping ", map_bytes_, " bytes", shm_ ? " of shared memory" : "", " for ", world,
                             " rank(s) failed: ", std::strerror(errno)));
  uint8_t* mem = static_cast<uint8_t*>(p);
  shared_ = init_shared(mem, world);
  base_ = mem + shared_bytes_;
  // Fresh anonymous/shm pages are zero: counters start at 0. Fill gaps and guards with canaries.
  for (int r = 0; r < world; ++r) {
    uint8_t* a = base_ + stride_ * r;
    std::memset(a + spec.total, kCanary, static_cast<size_t>(stride_ - spec.total));
    for (int k = 4; k < kNumBufKinds; ++k) {
      const int64_t end = spec.offset[k] + spec.bytes[k], next = gap_end(spec, k);
      if (next > end) std::memset(a + end, kCanary, static_cast<size_t>(next - end));
    }
  }
}

CpuArena::~CpuArena() {
  if (shared_) shared_->~Shared();
  if (base_) munmap(base_ - shared_bytes_, map_bytes_);
}

CpuArena::Shared* init_shared(void* mem, int world) {
  auto* sh = new (mem) CpuArena::Shared();
  for (int i = 0; i < world * kMaxStreams; ++i) new (reinterpret_cast<BlockedWait*>(sh + 1) + i) BlockedWait();
  for (int i = 0; i < world * kChecksumCounters; ++i) new (sh->put_record(world, 0, 0) + i) PutRecord();
  return sh;
}

ArenaView CpuArena::view() const {
  ArenaView v;
  v.nranks = world_;
  for (int r = 0; r < world_; ++r) v.base.push_back(base_ + stride_ * r);
  v.spec = spec_;
  v.sh = shared_;
  return v;
}

uint8_t* CpuArena::region(int rank, BufKind kind) const {
  TIDE_CHECK(rank >= 0 && rank < world_, "rank ", rank);
  TIDE_CHECK(!is_user_buffer(kind), "region(", buf_kind_name(kind), ")");
  return base_ + stride_ * rank + spec_.offset[static_cast<int>(kind)];
}

std::atomic<uint64_t>* CpuArena::counters(int rank) const {
  return reinterpret_cast<std::atomic<uint64_t>*>(base_ + stride_ * rank + spec_.counters_offset);
}

void CpuArena::check_canaries() const {
  for (int r = 0; r < world_; ++r) {
    const uint8_t* a = base_ + stride_ * r;
    for (int64_t i = spec_.total; i < stride_; ++i)
      if (a[i] != kCanary)
        throw Error(TIDE_STR_CAT("corruption: rank ", r, "'s arena guard overwritten at byte ", i,
                                 " past the arena end (", spec_.total, " bytes)"));
    for (int k = 4; k < kNumBufKinds; ++k) {
      const int64_t end = spec_.offset[k] + spec_.bytes[k], next = gap_end(spec_, k);
      for (int64_t i = end; i < next; ++i)
        if (a[i] != kCanary)
          throw Error(TIDE_STR_CAT("corruption: rank ", r, ": canary after region '",
                                   buf_kind_name(static_cast<BufKind>(k)), "' overwritten at offset ", i));
    }
  }
}

}  // namespace tide
