// The staging race canary (contract in staging_canary.h).
#include "exec/cpu/staging_canary.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "tide/errors.h"

namespace tide {

namespace {
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free,
              "the canary's words are shared between processes: they must be lock-free");

constexpr uint64_t kWriting = 1, kWritten = 2, kStateMask = 3;

// (seq, unit) in one word: seq in bits 33..63, unit + 1 in bits 2..32 (the low two bits: state).
// 0 only for (seq 0, unit -1), which no call has (seqs start at 1): a zero word (a fresh page)
// means "nothing".
uint64_t key(const StagingCanary::Unit& u) {
  return (static_cast<uint64_t>(u.seq) & 0x7fffffffu) << 33 | (static_cast<uint64_t>(u.unit + 1) & 0x7fffffffu) << 2;
}
StagingCanary::Unit unit_of(uint64_t tag) {
  return {static_cast<int64_t>(tag >> 33), static_cast<int32_t>((tag >> 2) & 0x7fffffffu) - 1};
}
std::string unit_name(const StagingCanary::Unit& u) { return TIDE_STR_CAT("unit ", u.unit, " of call seq ", u.seq); }

// A record as one pusher left it: tag and hull read twice-consistent (a hull is only ever
// rewritten together with a new tag).
struct Seen {
  int writer;
  uint64_t tag, read;
  int64_t lo, hi;
  bool overlaps(int64_t a, int64_t b) const { return lo < b && a < hi; }
};
Seen see(const StagingCanary::Record& r) {
  Seen s{};
  for (int tries = 0; tries < 4; ++tries) {
    s.tag = r.tag.load(std::memory_order_acquire);
    s.lo = r.lo.load(std::memory_order_acquire);
    s.hi = r.hi.load(std::memory_order_acquire);
    if (r.tag.load(std::memory_order_acquire) == s.tag) break;
  }
  s.writer = r.writer.load(std::memory_order_acquire) - 1;
  s.read = r.read.load(std::memory_order_acquire);
  return s;
}
}  // namespace

StagingCanary::StagingCanary(int world, int slots, int writers)
    : world_(world), slots_(slots), writers_(writers) {
  bytes_ = static_cast<int64_t>(world) * slots * writers * static_cast<int64_t>(sizeof(Record));
  if (bytes_ <= 0) return;
  // Shared and anonymous: forked rank processes inherit it; fresh pages are zero (no records).
  void* p = mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error(TIDE_STR_CAT("run_cpu: mapping the staging canary's ", bytes_, " bytes (", world, " ranks x ", slots,
                             " staging slots x ", writers, " pushers) failed: ", std::strerror(errno)));
  table_ = static_cast<Record*>(p);
}

StagingCanary::~StagingCanary() {
  if (table_) munmap(table_, static_cast<size_t>(bytes_));
}

StagingCanary::Record* StagingCanary::records(int owner, int slot) const {
  if (!table_ || owner < 0 || owner >= world_ || slot < 0 || slot >= slots_) return nullptr;
  return table_ + (static_cast<int64_t>(owner) * slots_ + slot) * writers_;
}

StagingCanary::Record* StagingCanary::claim(int owner, int slot, int writer) const {
  Record* rs = records(owner, slot);
  for (int w = 0; rs && w < writers_; ++w) {
    int32_t have = rs[w].writer.load(std::memory_order_acquire);
    if (have == 0 && rs[w].writer.compare_exchange_strong(have, writer + 1)) return &rs[w];
    if (have == writer + 1) return &rs[w];
  }
  return nullptr;  // outside the table, or more pushers than it tracks: not tracked
}

std::string StagingCanary::begin_write(int owner, int slot, int64_t a, int64_t b, Unit u, int writer) {
  Record* mine = claim(owner, slot, writer);
  if (!mine) return "";
  const uint64_t k = key(u);
  Record* rs = records(owner, slot);
  for (int w = 0; w < writers_; ++w) {
    const Seen s = see(rs[w]);
    const uint64_t sk = s.tag & ~kStateMask;
    if (s.tag == 0 || sk == k || s.read == sk || !s.overlaps(a, b)) continue;
    return TIDE_STR_CAT("early staging reuse: rank ", writer, "'s push of ", unit_name(u), " into rank ", owner,
                        "'s staging slot ", slot, " bytes [", a, ", ", b, ") overwrites ", unit_name(unit_of(s.tag)),
                        " (pushed by rank ", s.writer, ", bytes [", s.lo, ", ", s.hi, ")) before rank ", owner,
                        "'s SUM read it (staging-canary)");
  }
  // Only this pusher writes its record's push fields: the new unit's hull starts here, a
  // further row of the same unit widens it.
  const uint64_t had = mine->tag.load(std::memory_order_relaxed);
  const bool same = had != 0 && (had & ~kStateMask) == k;
  mine->lo.store(same ? std::min(a, mine->lo.load(std::memory_order_relaxed)) : a, std::memory_order_release);
  mine->hi.store(same ? std::max(b, mine->hi.load(std::memory_order_relaxed)) : b, std::memory_order_release);
  mine->tag.store(k | kWriting, std::memory_order_release);
  return "";
}

void StagingCanary::end_write(int owner, int slot, Unit u, int writer) {
  Record* mine = claim(owner, slot, writer);
  if (mine && (mine->tag.load(std::memory_order_relaxed) & ~kStateMask) == key(u))
    mine->tag.store(key(u) | kWritten, std::memory_order_release);
}

std::string StagingCanary::check_read(int owner, int slot, int64_t a, int64_t b, Unit u) {
  Record* rs = records(owner, slot);
  if (!rs) return "";
  const uint64_t k = key(u);
  std::vector<Seen> seen;
  for (int w = 0; w < writers_; ++w) {
    const Seen s = see(rs[w]);
    if (s.tag != 0) seen.push_back(s);
  }
  auto missing = [&](int64_t at, const std::string& what) {
    return TIDE_STR_CAT("missing push fence: rank ", owner, "'s SUM of ", unit_name(u), " reads its staging slot ",
                        slot, " bytes [", at, ", ", b, "), which hold ", what, " (staging-canary)");
  };
  for (const Seen& s : seen)
    if ((s.tag & ~kStateMask) == k && (s.tag & kStateMask) == kWriting && s.overlaps(a, b))
      return missing(std::max(a, s.lo), TIDE_STR_CAT("a push of rank ", s.writer, " still being written"));
  int64_t at = a;  // bytes below `at` are covered by written pushes of unit u
  for (bool grew = true; grew && at < b;) {
    grew = false;
    for (const Seen& s : seen)
      if ((s.tag & ~kStateMask) == k && s.lo <= at && at < s.hi) { at = s.hi; grew = true; }
  }
  if (at >= b) return "";
  for (const Seen& s : seen)
    if ((s.tag & ~kStateMask) != k && s.overlaps(at, b))
      return missing(at, TIDE_STR_CAT(unit_name(unit_of(s.tag)), " (pushed by rank ", s.writer, ")"));
  return missing(at, "nothing pushed yet");
}

void StagingCanary::mark_read(int owner, int slot, int64_t a, int64_t b, Unit u) {
  Record* rs = records(owner, slot);
  const uint64_t k = key(u);
  for (int w = 0; rs && w < writers_; ++w) {
    const Seen s = see(rs[w]);
    if (s.tag != 0 && (s.tag & ~kStateMask) == k && s.overlaps(a, b)) rs[w].read.store(k, std::memory_order_release);
  }
}

}  // namespace tide
